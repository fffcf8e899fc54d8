package testenv

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// echoServer answers each connection with what it reads, until the test
// ends.
func echoServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { io.Copy(c, c) })
		}
	})
	return ln.Addr().String()
}

// quiet is how long a read waits to find a connection that says nothing.
const quiet = 200 * time.Millisecond

// exchange writes ping on c and reads what comes back within quiet: nil
// for the echo, os.ErrDeadlineExceeded for a connection that says
// nothing, another error (io.EOF, a reset) for one closed.
func exchange(t *testing.T, c net.Conn) error {
	t.Helper()
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	c.SetReadDeadline(time.Now().Add(quiet))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != "ping" {
		t.Fatalf("read %q through the relay, not the echo of ping", buf)
	}
	return nil
}

func dial(t *testing.T, r *Relay) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", r.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Each break of the link, as the connections open and new ones see it.
func TestRelayBreaksTheLink(t *testing.T) {
	check := func(t *testing.T, what string, err error, want string) {
		t.Helper()
		var got string
		switch {
		case err == nil:
			got = "answered"
		case errors.Is(err, os.ErrDeadlineExceeded):
			got = "silent"
		default: // io.EOF, or a reset
			got = "closed"
		}
		if got != want {
			t.Fatalf("%s: %s (%v); want %s", what, got, err, want)
		}
	}

	t.Run("refuse and restore", func(t *testing.T) {
		r := NewRelay(t, echoServer(t))
		open := dial(t, r)
		check(t, "a connection", exchange(t, open), "answered")
		r.Refuse()
		check(t, "the connection open when refused", exchange(t, open), "closed")
		check(t, "a new connection while refused", exchange(t, dial(t, r)), "closed")
		r.Restore()
		check(t, "a new connection once restored", exchange(t, dial(t, r)), "answered")
	})
	t.Run("silence", func(t *testing.T) {
		r := NewRelay(t, echoServer(t))
		open := dial(t, r)
		check(t, "a connection", exchange(t, open), "answered")
		r.Silence()
		check(t, "the connection open when silenced", exchange(t, open), "closed")
		check(t, "a new connection while silent", exchange(t, dial(t, r)), "silent")
	})
	t.Run("blackhole", func(t *testing.T) {
		r := NewRelay(t, echoServer(t))
		open := dial(t, r)
		check(t, "a connection", exchange(t, open), "answered")
		r.Blackhole()
		check(t, "the connection open at the blackhole", exchange(t, open), "silent")
		check(t, "a new connection in the blackhole", exchange(t, dial(t, r)), "silent")
	})
}
