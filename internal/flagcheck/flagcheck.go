// Package flagcheck checks the values of flags shared by the service's
// commands, so that a bad one is refused at start, naming its flag.
package flagcheck

import (
	"fmt"
	"net"
)

// ListenAddr refuses, naming the flag, an address net.Listen could never
// take (no port, a port out of range or of no service name), which would
// otherwise end the start with a listen error that names no flag. HOST may
// be empty (every interface). An empty address is left to the flag's
// meaning of it (off, or the default).
func ListenAddr(flagName, addr string) error {
	if addr == "" {
		return nil
	}
	_, port, err := net.SplitHostPort(addr)
	if err == nil {
		_, err = net.LookupPort("tcp", port)
	}
	if err != nil {
		return fmt.Errorf("--%s %q: give HOST:PORT to listen on (port 0: any free one): %v", flagName, addr, err)
	}
	return nil
}
