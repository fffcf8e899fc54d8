// Package flagcheck checks the values of flags shared by the service's
// commands, so that a bad one is refused at start, naming its flag.
package flagcheck

import (
	"fmt"
	"net"
	"strings"
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

// Listen is a listen address and the flag that gave it.
type Listen struct{ Flag, Addr string }

// Distinct refuses, naming both flags, two listen addresses of which the
// later could never be listened on once the earlier is: the same port (not
// 0) on the same host, or on every interface (an empty host, 0.0.0.0 or
// ::) and any host. The second listener failed "address already in use",
// as if another process held the port. Each address must have passed
// ListenAddr; empty ones are off and clash with nothing.
func Distinct(listens ...Listen) error {
	for i, a := range listens {
		for _, b := range listens[:i] {
			if clash(a.Addr, b.Addr) {
				return fmt.Errorf("--%s %q and --%s %q: both would listen on one port; give them different ones", b.Flag, b.Addr, a.Flag, a.Addr)
			}
		}
	}
	return nil
}

// clash reports whether listening on a and b at once must fail.
func clash(a, b string) bool {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil {
		return false
	}
	na, errA := net.LookupPort("tcp", pa)
	nb, errB := net.LookupPort("tcp", pb)
	if errA != nil || errB != nil || na == 0 || na != nb {
		return false
	}
	ha, hb = listenHost(ha), listenHost(hb)
	return ha == "" || hb == "" || ha == hb
}

// listenHost is host as net.Listen takes it: "" for every interface,
// an IP address in its canonical form, localhost as its IPv4 address
// (which net.Listen picks), any other name as it is.
func listenHost(host string) string {
	host = strings.ToLower(host)
	if host == "localhost" {
		return "127.0.0.1"
	}
	if ip := net.ParseIP(host); ip != nil {
		if ip.IsUnspecified() {
			return ""
		}
		return ip.String()
	}
	return host
}
