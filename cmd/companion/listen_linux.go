package main

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// httpUserTimeout is how long data the server sent on an HTTP connection
// may stay unacknowledged before the kernel aborts the connection
// (TCP_USER_TIMEOUT).
const httpUserTimeout = time.Minute

// listenHTTP listens on addr for the HTTP API, with httpUserTimeout on
// every connection (set on the listening socket, whose connections inherit
// it). An event stream whose client vanished without a word (a phone that
// changed networks, a laptop closed) ends at the first heartbeat written
// after that, and gives its place back (--max-streams-per-user): without
// it, the kernel tried for about 15 minutes (tcp_retries2), and a client
// that reconnected from each network it met ran out of places
// (docs/reliability.md, bug 225). An idle connection (a held Prefer:
// wait) is probed by the TCP keepalive Go sets after 15 s idle, and the
// same timeout bounds the probes (tcp(7)).
func listenHTTP(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		if cerr := c.Control(func(fd uintptr) {
			err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(httpUserTimeout.Milliseconds()))
		}); cerr != nil {
			return cerr
		}
		return err
	}}
	return lc.Listen(context.Background(), "tcp", addr)
}
