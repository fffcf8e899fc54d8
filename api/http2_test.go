package api

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// heldBody is a request body that gives its first bytes and then nothing
// more until it is closed (as net/http's client closes it once the stream
// is done with): a phone's upload on a slow link, still under way when
// the answer comes.
type heldBody struct {
	first  io.Reader
	closed chan struct{}
	once   sync.Once
}

func newHeldBody(first []byte) *heldBody {
	return &heldBody{first: bytes.NewReader(first), closed: make(chan struct{})}
}

func (b *heldBody) Read(p []byte) (int, error) {
	if n, err := b.first.Read(p); err != io.EOF {
		return n, err
	}
	<-b.closed
	return 0, io.ErrClosedPipe
}

func (b *heldBody) Close() error {
	b.once.Do(func() { close(b.closed) })
	return nil
}

// connOf returns a context that records, in *addr, the local address of
// the connection a request is sent on.
func connOf(ctx context.Context, addr *string) context.Context {
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) {
		*addr = ci.Conn.LocalAddr().String()
	}})
}

// Over HTTP/2 a body over its limit is answered 413 as soon as the server
// knows it is over, while the client is still sending it: the answer ends
// the stream (RST_STREAM NO_ERROR after it, which tells the client to
// stop sending, RFC 9113 §8.1), not the connection, so there is nothing to
// read first. The server read the rest of the body, up to 4× the limit,
// before it answered, as it must over HTTP/1: a phone pushing a photo too
// large sent up to four times the limit over its mobile link before it
// read the 413, and one on a link that paused waited BodyIdle for it. The
// connection's other requests go on. docs/reliability.md, bug 326.
func TestBodyTooLargeOverHTTP2IsAnsweredAtOnce(t *testing.T) {
	e := newEnv(t, withBodyIdle(time.Minute))
	tok := e.bound("dev-1")
	srv, client := e.h2Server(t)
	limit := e.api.limits.imageBody()
	head := `{"image": "`
	for _, tc := range []struct {
		name   string
		length int64 // -1: no Content-Length
		first  int64 // the bytes the client sends before it waits
	}{
		{"declared over", 2 * limit, 64 << 10},
		{"found over", -1, limit + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := newHeldBody([]byte(head + strings.Repeat("A", int(tc.first)-len(head))))
			defer body.Close()
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			var first, second string
			hr, err := http.NewRequestWithContext(connOf(ctx, &first), "POST", srv.URL+"/api/v1/devices/dev-1/push/image", body)
			require.NoError(t, err)
			hr.ContentLength = tc.length
			hr.Header.Set("Authorization", "Bearer "+tok)
			hr.Header.Set("Content-Type", "application/json")
			res, err := client.Do(hr)
			require.NoError(t, err, "no answer: the server waits for the rest of the body")
			defer res.Body.Close()
			b, err := io.ReadAll(res.Body)
			require.NoError(t, err)
			require.Equal(t, 2, res.ProtoMajor)
			r := resp{status: res.StatusCode, header: res.Header, body: b}
			require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "%s", b)
			assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)

			hr, err = http.NewRequestWithContext(connOf(ctx, &second), "GET", srv.URL+"/api/v1/devices/dev-1/status", nil)
			require.NoError(t, err)
			hr.Header.Set("Authorization", "Bearer "+tok)
			res, err = client.Do(hr)
			require.NoError(t, err)
			res.Body.Close()
			assert.Equal(t, http.StatusOK, res.StatusCode)
			assert.Equal(t, first, second, "the next request goes on the same connection")
		})
	}
}
