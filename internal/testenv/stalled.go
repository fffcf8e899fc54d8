package testenv

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// StalledClientIsCut sends request (a whole HTTP/1.1 request) to addr from
// a client whose receive buffer is small and which reads nothing for stall,
// then reads on, and reports whether the server had cut the connection: the
// read ends (EOF, or a reset) within a few seconds. A server that kept
// writing to the stalled client finishes its answer once it is read and
// keeps the connection open for the next request, so the read waits until
// its deadline. The answer must be larger than the sockets' buffers take
// in, and stall longer than the server's write deadline.
//
// The outcome is the connection's, not a goroutine count polled now and
// then: a handler cut within one poll of the goroutines (a dump of many
// under -race, on a busy machine) was never seen at all.
func StalledClientIsCut(tb testing.TB, addr, request string, stall time.Duration) bool {
	tb.Helper()
	d := SmallWindow(4096)
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, request); err != nil {
		tb.Fatal(err)
	}
	time.Sleep(stall) // the client reads nothing: the stall under test
	if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		tb.Fatal(err)
	}
	_, err = io.Copy(io.Discard, conn)
	return !errors.Is(err, os.ErrDeadlineExceeded)
}

// SmallWindow returns a dialer whose connections take at most about n
// bytes into their receive buffer, set before the connection is made so
// that the window it offers is small: a client that stops reading stops
// the server's writes after a few kilobytes.
func SmallWindow(n int) *net.Dialer {
	return &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, n)
		})
		return errors.Join(err, serr)
	}}
}
