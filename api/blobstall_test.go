package api

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// A client that asks for a blob and then takes nothing of the answer
// (its process stuck, its receive window shut) is cut once it has taken
// nothing for BodyIdle, and the handler returns: it held the handler's
// goroutine, the blob's file and the connection for as long as the
// client's kernel answered, for ever.
func TestStalledBlobDownloadIsCut(t *testing.T) {
	const idle = 300 * time.Millisecond
	seen := make(answers, 64)
	e := newEnv(t, withBodyIdle(idle), func(o *Options) { o.Requests = seen })
	// Larger than what the kernels' socket buffers take in.
	blob, err := e.db.PutBlob(context.Background(), bytes.NewReader(bytes.Repeat([]byte("firmware"), 8<<20)), 128<<20)
	require.NoError(t, err)

	for i := range 3 {
		conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
		require.NoError(t, err)
		defer conn.Close()
		require.NoError(t, conn.(*net.TCPConn).SetReadBuffer(4096))
		_, err = fmt.Fprintf(conn, "GET /api/v1/blobs/%s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n", blob.SHA256, testAdminToken)
		require.NoError(t, err)
		// Nothing of the answer is read.
		status := seen.wait(t, 50*idle, "GET", "/api/v1/blobs/:sha256")
		require.Equal(t, 200, status, "download %d", i)
	}
}

// dialSmallWindow connects with a receive buffer of 2 KiB, set before the
// connection is made (so that the window it offers is small).
func dialSmallWindow(t *testing.T, addr string) net.Conn {
	t.Helper()
	d := testenv.SmallWindow(2048)
	conn, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Likewise any answer larger than the sockets' buffers take in, whose
// client reads nothing: the OpenAPI document, which anyone may ask for,
// and a page of commands.
func TestStalledLargeAnswerIsCut(t *testing.T) {
	const idle = 300 * time.Millisecond
	seen := make(answers, 64)
	e := newEnv(t, withBodyIdle(idle), func(o *Options) { o.Requests = seen })
	srv := httptest.NewUnstartedServer(e.api.Handler())
	srv.Listener = sseSmallBuffers{srv.Listener}
	srv.Start()
	t.Cleanup(srv.Close)
	tok := e.bound("dev-1")
	for range 200 { // a page of 49 KB
		r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hello"})
		require.Equal(t, 202, r.status, "%s", r.body)
	}
	for _, tc := range []struct{ path, token, route string }{
		{"/api/v1/openapi.json", "", "/api/v1/openapi.json"},
		{"/api/v1/devices/dev-1/commands?limit=200", tok, "/api/v1/devices/:id/commands"},
	} {
		for range 3 {
			conn := dialSmallWindow(t, srv.Listener.Addr().String())
			auth := ""
			if tc.token != "" {
				auth = "Authorization: Bearer " + tc.token + "\r\n"
			}
			_, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n", tc.path, auth)
			require.NoError(t, err)
			// Nothing of the answer is read.
			require.Equal(t, 200, seen.wait(t, 50*idle, "GET", tc.route), tc.path)
		}
	}
}
