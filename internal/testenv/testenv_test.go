package testenv

import (
	"net"
	"strconv"
	"testing"
)

// TestFreePortIsOutsideTheEphemeralRange checks that FreePort hands out
// distinct ports that a server can bind, from below the range the kernel
// gives outgoing connections, so that no connection opened meanwhile can
// take one.
func TestFreePortIsOutsideTheEphemeralRange(t *testing.T) {
	lo, hi := belowEphemeral()
	if hi <= lo {
		t.Fatalf("belowEphemeral() = %d, %d: the ephemeral range of /proc/sys/net/ipv4/ip_local_port_range was not read", lo, hi)
	}
	seen := map[int]bool{}
	for range 50 {
		p := FreePort(t)
		if p < lo || p >= hi {
			t.Fatalf("FreePort() = %d; want a port in [%d, %d), below the ephemeral range", p, lo, hi)
		}
		if seen[p] {
			t.Fatalf("FreePort() = %d twice", p)
		}
		seen[p] = true
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("listen on FreePort() = %d: %v", p, err)
		}
		ln.Close()
	}
}

// TestFreePortSkipsABoundPort checks that a port some listener holds, or
// one handed out before, is not handed out.
func TestFreePortSkipsABoundPort(t *testing.T) {
	lo, hi := belowEphemeral()
	// Hold every port of a small range but the last, which alone is left:
	// a range of which this process has handed out none, and whose ports
	// no other listener holds.
	const n = 8
	var held []net.Listener
	defer func() {
		for _, ln := range held {
			ln.Close()
		}
	}()
	hold := func(base int) bool {
		portsMu.Lock()
		for p := base; p < base+n; p++ {
			if reserved[p] {
				portsMu.Unlock()
				return false
			}
		}
		portsMu.Unlock()
		for p := base; p < base+n-1; p++ {
			ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
			if err != nil {
				return false
			}
			held = append(held, ln)
		}
		return true
	}
	release := func() {
		for _, ln := range held {
			ln.Close()
		}
		held = nil
	}
	for base := lo; ; base += n {
		if base+2*n > hi {
			t.Fatalf("no %d ports in a row free in [%d, %d)", n, lo, hi)
		}
		if !hold(base) {
			release()
			continue
		}
		p, ok := freePortIn(base, base+n)
		if !ok && !bindable(base+n-1) {
			// Another process took the last port meanwhile: the test
			// packages beside this one (make test runs four at once)
			// take theirs from the same range. Another range.
			release()
			continue
		}
		if !ok || p != base+n-1 {
			t.Fatalf("freePortIn(%d, %d) = %d, %v; want %d, the one port no listener holds", base, base+n, p, ok, base+n-1)
		}
		if p, ok := freePortIn(base, base+n); ok {
			t.Fatalf("freePortIn(%d, %d) = %d again; want none left", base, base+n, p)
		}
		return
	}
}

// bindable reports whether a listener can take the port now.
func bindable(port int) bool {
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}
