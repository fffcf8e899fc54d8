// Package pahoconn gives paho's plain TCP connections a read buffer and
// writes behind.
//
// Paho reads each packet straight from its connection
// (packets.ReadPacket): one read for the packet's first byte, one for each
// byte of its remaining length, one for the rest. That is three system
// calls or more per packet, however many packets wait in the socket: a
// fifth of a bridge's CPU under load went to them (docs/performance.md,
// "The ninth pass"). Through a buffer, one read takes in whatever has
// arrived. And paho writes each packet with a system call of its own;
// here the packets written while the last write is in the kernel go out
// together in the next one (writeBehind). TLS connections get neither:
// crypto/tls reads whole records and hands out bytes from them.
package pahoconn

import (
	"bufio"
	"net"
	"net/url"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"golang.org/x/net/proxy"
)

// readBuffer holds a burst of small packets (a command is a few hundred
// bytes) and one 4 KiB text push whole.
const readBuffer = 8 << 10

// Buffered has the client that o configures dial its brokers through a
// read buffer and write behind, when every broker URL is plain TCP
// (tcp:// or mqtt://); it leaves o to paho's own dialing otherwise. As paho does, it dials
// through the proxy that ALL_PROXY names, with o's Dialer. It returns o.
func Buffered(o *mqtt.ClientOptions) *mqtt.ClientOptions {
	for _, u := range o.Servers {
		if !plain(u) {
			return o
		}
	}
	return o.SetCustomOpenConnectionFn(open(func(o mqtt.ClientOptions) dialFunc {
		d := o.Dialer
		if d == nil {
			d = &net.Dialer{Timeout: o.ConnectTimeout}
		}
		return proxy.FromEnvironmentUsing(d).Dial
	}))
}

func plain(u *url.URL) bool { return u.Scheme == "tcp" || u.Scheme == "mqtt" }

type dialFunc func(network, addr string) (net.Conn, error)

// open is the OpenConnectionFunc that dials with what dialer gives for
// the client's options and wraps the connection in a read buffer and a
// writeBehind bounded by the options' write timeout.
func open(dialer func(mqtt.ClientOptions) dialFunc) mqtt.OpenConnectionFunc {
	return func(u *url.URL, o mqtt.ClientOptions) (net.Conn, error) {
		c, err := dialer(o)("tcp", u.Host)
		if err != nil {
			return nil, err
		}
		return &conn{Conn: c, r: bufio.NewReaderSize(c, readBuffer), w: newWriteBehind(c, o.WriteTimeout)}, nil
	}
}

// conn is a net.Conn whose reads go through r and whose writes are
// written behind: Write queues its bytes and returns, and one flusher
// goroutine writes whatever queued up while its last write was on its way,
// in one system call (see writeBehind).
type conn struct {
	net.Conn
	r *bufio.Reader
	w *writeBehind
}

func (c *conn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *conn) Write(p []byte) (int, error) { return c.w.write(p) }

// SetWriteDeadline does nothing: paho sets one around each packet it
// writes, which here only queues it; the flusher bounds each of its
// writes by the client's write timeout instead.
func (c *conn) SetWriteDeadline(time.Time) error { return nil }

// SetDeadline sets the read deadline (paho's, around its CONNECT and
// CONNACK); writes are bounded as SetWriteDeadline says.
func (c *conn) SetDeadline(t time.Time) error { return c.Conn.SetReadDeadline(t) }

// Close gives what is queued (a DISCONNECT paho wrote just before, whose
// loss would have the broker publish the client's Will) up to closeFlush
// to go out, then closes the connection.
func (c *conn) Close() error {
	c.w.close()
	return c.Conn.Close()
}

const (
	// maxQueued is how much Write queues before it waits for the flusher:
	// bounded, so that a broker that stops reading holds paho's writes
	// back as the socket would.
	maxQueued = 64 << 10
	// closeFlush is how long Close waits for the queue to go out.
	closeFlush = time.Second
)

// writeBehind writes a connection's packets in batches. Paho writes each
// packet with a system call of its own (a PUBLISH or a PUBACK each), from
// one goroutine; a bridge under load spent a seventh of its CPU in them
// (docs/performance.md). Here the packets a busy client writes while the
// last write is in the kernel go out together in the next, as a group
// commit does, and a lone packet waits for no timer. A failed write fails
// every later Write and the connection's next read (see flush): paho
// reconnects and sends again what the broker has not acknowledged, as it
// does after any lost connection.
type writeBehind struct {
	c       net.Conn
	timeout time.Duration // of each write; 0 for none

	mu      sync.Mutex
	cond    sync.Cond
	queued  []byte
	spare   []byte // the last batch's buffer, for the next
	writing bool   // the flusher is writing a batch
	closing bool
	closeBy time.Time
	err     error
	done    chan struct{} // the flusher has returned
}

func newWriteBehind(c net.Conn, timeout time.Duration) *writeBehind {
	w := &writeBehind{c: c, timeout: timeout, done: make(chan struct{})}
	w.cond.L = &w.mu
	go w.flush()
	return w
}

func (w *writeBehind) write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.err == nil && !w.closing && len(w.queued) > 0 && len(w.queued)+len(p) > maxQueued {
		w.cond.Wait()
	}
	switch {
	case w.err != nil:
		return 0, w.err
	case w.closing:
		return 0, net.ErrClosed
	}
	w.queued = append(w.queued, p...)
	w.cond.Broadcast()
	return len(p), nil
}

func (w *writeBehind) flush() {
	defer close(w.done)
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		for len(w.queued) == 0 && !w.closing {
			w.cond.Wait()
		}
		if len(w.queued) == 0 {
			return // closing, and nothing left to write
		}
		batch := w.queued
		w.queued = w.spare[:0]
		// The deadline is set under the lock, so that close's (shorter)
		// one is never overwritten.
		switch {
		case w.closing:
			w.c.SetWriteDeadline(w.closeBy)
		case w.timeout > 0:
			w.c.SetWriteDeadline(time.Now().Add(w.timeout))
		}
		w.writing = true
		w.mu.Unlock()
		_, err := w.c.Write(batch)
		w.mu.Lock()
		w.writing = false
		w.spare = batch
		w.cond.Broadcast() // room for the writers waiting
		if err != nil {
			w.err = err
			w.queued = nil
			// Paho learns of a lost connection from its reader, not its
			// writer, once its writes no longer fail: the reader's next
			// read fails now. Not by closing the connection, whose "use
			// of closed network connection" paho takes for its own
			// Disconnect and would neither report nor reconnect from.
			w.c.SetReadDeadline(time.Now())
			return
		}
	}
}

// close stops further writes and waits, up to closeFlush, for the queue
// to be written.
func (w *writeBehind) close() {
	w.mu.Lock()
	if !w.closing {
		w.closing = true
		w.closeBy = time.Now().Add(closeFlush)
		if w.writing {
			w.c.SetWriteDeadline(w.closeBy)
		}
		w.cond.Broadcast()
	}
	w.mu.Unlock()
	<-w.done
}
