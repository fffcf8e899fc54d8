// Package mochilisten is a TCP listener for mochi-mqtt that owns its
// goroutines, for the embedded broker (broker/embedded) and the bare mochi
// brokers of tests (internal/mochitest).
package mochilisten

import (
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/listeners"
)

// Listener is a TCP listener for mochi that owns its goroutines: the
// accept loop and one goroutine per connection are counted in wg, and
// every accepted connection is closed on Close, so Wait returns only when
// all of them have ended. Mochi's own TCP listener starts goroutines
// nobody waits for, leaves a connection that never sends CONNECT open
// forever, and lets a connection accepted as the server closes call
// Add on the WaitGroup mochi's Close waits on (a race the race detector
// reports). Create it with New; set TLS and Disconnect before mochi's
// AddListener.
type Listener struct {
	network, address string
	log              *slog.Logger
	// TLS, when set, makes every connection TLS.
	TLS *tls.Config
	// Disconnect, when set, sends DISCONNECT to the clients of this
	// listener as it closes.
	Disconnect func()
	// ConnectTimeout, when set, is how long a connection has to send its
	// CONNECT (a TLS connection, to finish its handshake first): the
	// connection's deadline until then. Mochi sets the deadline of the
	// client's keepalive once it has read the CONNECT, and sets none
	// before: a connection that sent nothing was kept for ever.
	ConnectTimeout time.Duration
	// Ended, when set, is called with each connection once mochi is done
	// with it (its establish returned). Mochi tells its hooks nothing of a
	// client it let in whose CONNACK it could not write.
	Ended func(net.Conn)

	id   string
	ln   net.Listener
	wg   sync.WaitGroup
	done chan struct{}

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
}

var _ listeners.Listener = (*Listener)(nil)

// New returns a listener on address (host:port; port 0 picks a free one)
// of network ("tcp"), named id for mochi.
func New(id, network, address string, log *slog.Logger) *Listener {
	return &Listener{
		id:      id,
		network: network,
		address: address,
		log:     log,
		done:    make(chan struct{}),
		conns:   map[net.Conn]struct{}{},
	}
}

// ID names the listener for mochi.
func (l *Listener) ID() string { return l.id }

// Protocol is the listener's protocol for mochi's log.
func (l *Listener) Protocol() string { return l.network }

// Address returns the bound address once Init has run.
func (l *Listener) Address() string {
	if l.ln != nil {
		return l.ln.Addr().String()
	}
	return l.address
}

// Init binds the address. Mochi calls it from AddListener, synchronously, so
// Start returns with the port bound. The accept loop is counted here, before
// mochi starts Serve on a goroutine of its own, so that wait can never miss it.
func (l *Listener) Init(_ *slog.Logger) error {
	ln, err := net.Listen(l.network, l.address)
	if err != nil {
		return err
	}
	if l.TLS != nil {
		ln = tls.NewListener(ln, l.TLS)
	}
	l.ln = ln
	l.wg.Add(1)
	return nil
}

// Abandon undoes Init when Serve will never be called.
func (l *Listener) Abandon() {
	l.closeAll()
	l.wg.Done()
}

// Serve accepts connections until Close and hands each to establish on a
// goroutine of its own.
func (l *Listener) Serve(establish listeners.EstablishFn) {
	defer l.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || l.isClosed() {
				return
			}
			// Out of file descriptors and the like: wait a little, as
			// net/http does, instead of spinning.
			l.log.Warn("mqtt accept failed", "error", err, "retry_in", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-l.done:
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if !l.track(conn) {
			_ = conn.Close()
			return
		}
		go func() {
			defer l.wg.Done()
			defer l.untrack(conn)
			if l.ConnectTimeout > 0 {
				_ = conn.SetDeadline(time.Now().Add(l.ConnectTimeout))
			}
			if err := establish(l.ID(), conn); err != nil && !l.isClosed() {
				l.log.Debug("mqtt connection ended", "remote", conn.RemoteAddr().String(), "error", err)
			}
			if l.Ended != nil {
				l.Ended(conn)
			}
		}()
	}
}

// track records a new connection and counts its goroutine; false once closed.
func (l *Listener) track(c net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.conns[c] = struct{}{}
	l.wg.Add(1)
	return true
}

func (l *Listener) untrack(c net.Conn) {
	_ = c.Close()
	l.mu.Lock()
	delete(l.conns, c)
	l.mu.Unlock()
}

func (l *Listener) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// Close is called by mochi's Close: it disconnects the clients mochi knows
// (each gets a DISCONNECT), stops accepting, closes every connection still
// open, including those that never finished connecting, and waits for their
// goroutines. Waiting here, before mochi's Close waits on its own
// WaitGroup, also keeps mochi from calling that WaitGroup's Add (at the
// start of each connection) while it waits.
//
// Mochi's closeClients is not used: its Clients.GetByListener takes the
// clients' read lock twice (it calls Len under it), so a connection that
// takes the write lock in between (a client id taken over) deadlocks both
// for good. Disconnect reads the clients under one read lock.
func (l *Listener) Close(listeners.CloseFn) {
	if l.isClosed() {
		return
	}
	if l.Disconnect != nil {
		l.Disconnect()
	}
	l.closeAll()
	l.wg.Wait()
}

func (l *Listener) closeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	close(l.done)
	if l.ln != nil {
		_ = l.ln.Close()
	}
	for c := range l.conns {
		_ = c.Close()
	}
}

// Wait returns when the accept loop and every connection goroutine are
// done.
func (l *Listener) Wait() { l.wg.Wait() }
