package flagcheck

import (
	"errors"
	"fmt"
	"net"
	"syscall"
)

// ErrAddrInUse is what errors.Is finds in the error InUse makes of a
// listen address another process holds: it is taken again at every start
// until a person frees it or gives another, so the binaries exit on it
// with status 2, as on a flag's wrong value, which their units do not
// restart (bug 436).
var ErrAddrInUse = errors.New("the listen address is in use")

// inUseError is a listen address of a flag another process holds.
type inUseError struct {
	flag, addr string
	err        error
}

func (e *inUseError) Error() string {
	hint := ""
	if _, port, err := net.SplitHostPort(e.addr); err == nil && port != "" {
		hint = fmt.Sprintf(" (ss -ltnp 'sport = :%s' names it)", port)
	}
	return fmt.Sprintf("--%s %s: another process listens there%s: stop it, or give --%s another address: %v",
		e.flag, e.addr, hint, e.flag, e.err)
}

func (e *inUseError) Unwrap() error { return e.err }

func (e *inUseError) Is(target error) bool { return target == ErrAddrInUse }

// InUse is err, of a listen on addr for --flagName, naming the flag and
// the address and wrapping ErrAddrInUse when the address is in use
// (EADDRINUSE); any other err as it is. Before, "listen tcp …: bind:
// address already in use" named no flag, and the binary exited with status
// 1, which its unit restarts every 2 s for good (bug 436).
func InUse(flagName, addr string, err error) error {
	if err != nil && errors.Is(err, syscall.EADDRINUSE) {
		return &inUseError{flag: flagName, addr: addr, err: err}
	}
	return err
}
