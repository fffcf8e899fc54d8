package api

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
