package main

import (
	"crypto/tls"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
)

// A client that speaks broken HTTP/2 (a bad preface, a frame HTTP/2
// forbids, a GOAWAY with an error) had net/http log a warning for each
// connection: anyone who reaches the server's TLS port wrote warnings as
// fast as it opened connections, as a dropped TLS handshake did before
// bug 323. They are the client's, and logged at debug (bug 383).
func TestABrokenHTTP2ClientIsNotAWarning(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	logs := &logCapture{}
	m := startServerWithLog(t, Config{TLSCert: certFile, TLSKey: keyFile}, logs)
	pool := ca.client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	dial := func() *tls.Conn {
		raw, err := net.Dial("tcp", m.HTTPAddr())
		require.NoError(t, err)
		t.Cleanup(func() { raw.Close() })
		conn := tls.Client(raw, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
		require.NoError(t, conn.Handshake())
		require.Equal(t, "h2", conn.ConnectionState().NegotiatedProtocol)
		return conn
	}
	closed := func(c net.Conn) {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				assert.NotContains(t, err.Error(), "timeout", "the server did not close the connection")
				return
			}
		}
	}

	// A bad preface.
	c := dial()
	_, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	require.NoError(t, err)
	closed(c)
	// A DATA frame on stream 0: a connection error.
	c = dial()
	_, err = c.Write([]byte(http2.ClientPreface))
	require.NoError(t, err)
	fr := http2.NewFramer(c, c)
	require.NoError(t, fr.WriteSettings())
	require.NoError(t, fr.WriteRawFrame(http2.FrameData, 0, 0, []byte("x")))
	closed(c)
	// A GOAWAY with an error.
	c = dial()
	_, err = c.Write([]byte(http2.ClientPreface))
	require.NoError(t, err)
	fr = http2.NewFramer(c, c)
	require.NoError(t, fr.WriteSettings())
	require.NoError(t, fr.WriteGoAway(0, http2.ErrCodeProtocol, nil))
	closed(c)

	want := []string{"error reading preface", "server connection error", "received GOAWAY"}
	http2Lines := func() []capturedRecord {
		l := logs.logs()
		l.mu.Lock()
		defer l.mu.Unlock()
		var out []capturedRecord
		for _, r := range l.records {
			if strings.HasPrefix(r.msg, "http2:") {
				out = append(out, r)
			}
		}
		return out
	}
	require.Eventually(t, func() bool {
		seen := 0
		for _, w := range want {
			for _, r := range http2Lines() {
				if strings.Contains(r.msg, w) {
					seen++
					break
				}
			}
		}
		return seen == len(want)
	}, 10*time.Second, 10*time.Millisecond, "the server's lines of the three connections: %v", http2Lines())
	for _, r := range http2Lines() {
		assert.Equal(t, slog.LevelDebug, r.level, "%q", r.msg)
	}
}
