package flagcheck

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"syscall"
)

// ErrCannotListen is what errors.Is finds in the error ListenFailed makes of a
// listen address the process cannot take until a person acts: another
// process holds it (bug 436), or the system refuses this process its port
// (bug 475). Either is met again at every start, so the binaries exit on
// it with status 2, as on a flag's wrong value, which their units do not
// restart.
var ErrCannotListen = errors.New("the listen address cannot be taken")

// listenError is a listen address of a flag the process cannot take.
type listenError struct {
	flag, addr string
	why        string // what stands in the way, and what to do
	err        error
}

func (e *listenError) Error() string {
	return fmt.Sprintf("--%s %s: %s: %v", e.flag, e.addr, e.why, e.err)
}

func (e *listenError) Unwrap() error { return e.err }

func (e *listenError) Is(target error) bool { return target == ErrCannotListen }

// CannotListen reports whether err, of a listen, is one that ListenFailed
// names: an address in use, or a port the system refuses the process.
func CannotListen(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE) || errors.Is(err, syscall.EACCES)
}

// ListenFailed is err, of a listen on addr for --flagName, naming the flag, the
// address and what to do, and wrapping ErrCannotListen, when the address
// is in use (EADDRINUSE) or the system refuses the process its port
// (EACCES: a port below 1024 without CAP_NET_BIND_SERVICE, or with it in
// a user namespace of its own, as systemd's PrivateUsers=yes makes); any
// other err as it is. Before, "listen tcp …: bind: address already in
// use" or "…: permission denied" named no flag, and the binary exited with
// status 1, which its unit restarts every 2 s for good (bugs 436 and 475).
func ListenFailed(flagName, addr string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.EADDRINUSE):
		hint := ""
		if _, port, err := net.SplitHostPort(addr); err == nil && port != "" {
			hint = fmt.Sprintf(" (ss -ltnp 'sport = :%s' names it)", port)
		}
		return &listenError{flag: flagName, addr: addr, err: err, why: fmt.Sprintf(
			"another process listens there%s: stop it, or give --%s another address", hint, flagName)}
	case errors.Is(err, syscall.EACCES):
		why := fmt.Sprintf("the system refuses this process the address (a security policy?): give --%s another one", flagName)
		if _, port, err := net.SplitHostPort(addr); err == nil {
			if n, err := strconv.Atoi(port); err == nil && n > 0 && n < 1024 {
				why = fmt.Sprintf("a port below 1024 needs CAP_NET_BIND_SERVICE, in the host's user namespace "+
					"(in a systemd unit: AmbientCapabilities=CAP_NET_BIND_SERVICE, CapabilityBoundingSet=CAP_NET_BIND_SERVICE "+
					"and PrivateUsers=no), or give --%s a port of 1024 or above, behind a proxy", flagName)
			}
		}
		return &listenError{flag: flagName, addr: addr, err: err, why: why}
	}
	return err
}
