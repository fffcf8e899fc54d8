package testenv

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// Relay forwards TCP connections to a target and breaks the link the ways
// a network does: Refuse, Silence and Blackhole. Its goroutines and
// sockets end with the test.
type Relay struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	conns []net.Conn // open on either side, held ones included
	mode  relayMode
	ended bool // the test has ended
	// held, while not nil, keeps what the clients send (HoldUplink) until
	// it is closed (ReleaseUplink).
	held chan struct{}
	wg   sync.WaitGroup

	accepted atomic.Int64 // connections the clients made, in any mode
}

type relayMode int

const (
	forwarding relayMode = iota
	refusing             // new connections closed at once
	silent               // new connections held open, never answered
	blackhole            // nothing forwarded either way, every socket kept
)

// NewRelay starts a relay to target (host:port) on a free port of the
// loopback interface.
func NewRelay(tb testing.TB, target string) *Relay {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("relay: %v", err)
	}
	r := &Relay{ln: ln, target: target}
	r.wg.Go(r.accept)
	tb.Cleanup(func() {
		ln.Close()
		r.ReleaseUplink()
		r.mu.Lock()
		r.ended = true
		r.mu.Unlock()
		r.closeAll()
		r.wg.Wait()
	})
	return r
}

// Addr is the relay's host:port, for clients to dial in the target's stead.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// Accepted is how many connections the clients have made to the relay,
// forwarded or not.
func (r *Relay) Accepted() int64 { return r.accepted.Load() }

// Refuse closes the connections open and every new one at once, until
// Restore: a link that breaks and stays down a while, or a host that
// refuses connections.
func (r *Relay) Refuse() { r.breakLink(refusing) }

// Silence closes the connections open and takes new ones without ever
// answering, as a host that is powered off, or behind a firewall that
// drops its packets, looks to a client whose connection completes (a load
// balancer, a proxy).
func (r *Relay) Silence() { r.breakLink(silent) }

// Blackhole forwards nothing more, either way, on any connection, present
// or to come, and keeps every socket open: a link that silently drops
// packets. The relay's own kernel still acknowledges what either side
// sends, so neither side's TCP finds its peer gone.
func (r *Relay) Blackhole() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mode = blackhole
}

// Restore forwards new connections again.
func (r *Relay) Restore() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mode = forwarding
}

// HoldUplink keeps what the clients send, on every connection, present or
// to come, from reaching the target until ReleaseUplink, which forwards it
// then, in order; what the target sends flows on. A client's packets
// stall in its uplink (a congested cellular link, a busy gateway) while it
// reads what it is sent: its acknowledgements and replies arrive late, all
// at once, and neither side's TCP finds its peer gone.
func (r *Relay) HoldUplink() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held == nil {
		r.held = make(chan struct{})
	}
}

// ReleaseUplink forwards what HoldUplink kept, and what the clients send
// from now on.
func (r *Relay) ReleaseUplink() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held != nil {
		close(r.held)
		r.held = nil
	}
}

// uplinkHeld returns the channel a client's bytes wait on (nil: none).
func (r *Relay) uplinkHeld() chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.held
}

func (r *Relay) breakLink(m relayMode) {
	r.mu.Lock()
	r.mode = m
	r.mu.Unlock()
	r.closeAll()
}

func (r *Relay) closeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		c.Close()
	}
	r.conns = nil
}

func (r *Relay) current() relayMode {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mode
}

func (r *Relay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return // the listener is closed when the test ends
		}
		r.accepted.Add(1)
		switch r.current() {
		case refusing:
			c.Close()
			continue
		case silent:
			r.keep(silent, c)
			continue
		}
		s, err := net.Dial("tcp", r.target)
		if err != nil {
			c.Close()
			continue
		}
		if r.keep(forwarding, c, s) {
			r.wg.Go(func() { r.forward(s, c, true) })
			r.wg.Go(func() { r.forward(c, s, false) })
		}
	}
}

// keep records conns as open if the relay is still in mode m (a blackhole
// forwards too) and the test goes on; otherwise it closes them, so that a
// connection accepted while the link broke is not left out of the break.
func (r *Relay) keep(m relayMode, conns ...net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	ok := !r.ended && (r.mode == m || m == forwarding && r.mode == blackhole)
	for _, c := range conns {
		if ok {
			r.conns = append(r.conns, c)
		} else {
			c.Close()
		}
	}
	return ok
}

// forward copies src to dst until either fails, dropping what it reads
// while the link is a blackhole, and holding what a client sends (up)
// while the uplink is held. A side that ends closes both, unless the
// link is a blackhole by then: then they stay open until the test ends.
func (r *Relay) forward(dst, src net.Conn, up bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if err != nil {
			break
		}
		if up {
			if h := r.uplinkHeld(); h != nil {
				<-h
			}
		}
		if r.current() == blackhole {
			continue
		}
		if _, err := dst.Write(buf[:n]); err != nil {
			break
		}
	}
	if r.current() != blackhole {
		src.Close()
		dst.Close()
	}
}
