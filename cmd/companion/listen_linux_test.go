package main

import (
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// userTimeout reads TCP_USER_TIMEOUT of a TCP listener's or connection's
// socket, in milliseconds.
func userTimeout(t *testing.T, c syscall.Conn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	require.NoError(t, err)
	var v int
	var gerr error
	require.NoError(t, rc.Control(func(fd uintptr) {
		v, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
	}))
	require.NoError(t, gerr, "getsockopt TCP_USER_TIMEOUT (Go's MPTCP listener, with it unset, answers not supported)")
	return v
}

// The server's HTTP connections abort once what it sent stays
// unacknowledged for a minute, so that an event stream whose client
// vanished gives its place back (docs/reliability.md, bug 225): the
// listener of a running server has TCP_USER_TIMEOUT, and a connection it
// accepts inherits it. What a dead client then does to a stream is not
// reproduced here: that needs a peer whose packets are dropped.
func TestHTTPConnectionsOfADeadClientTimeOut(t *testing.T) {
	m := startServer(t, Config{})
	require.Equal(t, int(httpUserTimeout.Milliseconds()), userTimeout(t, m.ln.(*net.TCPListener)), "the server's HTTP listener")

	ln, err := listenHTTP("127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	dialed := make(chan error, 1)
	go func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err == nil {
			c.Close()
		}
		dialed <- err
	}()
	c, err := ln.Accept()
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, <-dialed)
	require.Equal(t, int(httpUserTimeout.Milliseconds()), userTimeout(t, c.(*net.TCPConn)), "a connection the listener accepted")
}
