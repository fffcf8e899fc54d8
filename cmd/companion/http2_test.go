package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/testenv"
)

// h2Conn is an HTTP/2 client connection written by hand, so that a test
// can stop reading it entirely: a phone whose app froze, whose kernel
// still acknowledges but takes no more (a zero window). Go's client
// always reads.
type h2Conn struct {
	tb     testing.TB
	conn   net.Conn
	fr     *http2.Framer
	enc    *hpack.Encoder
	hbuf   bytes.Buffer
	nextID uint32
}

// dialH2 connects to m over TLS with a small receive buffer, and gives
// each stream a window of window bytes, the connection one as large as
// HTTP/2 allows: with the largest window (1<<31 - 1) what the server
// sends fills the socket rather than stopping at a window.
func dialH2(tb testing.TB, m *Main, ca *testCA, window uint32) *h2Conn {
	tb.Helper()
	d := testenv.SmallWindow(4096)
	raw, err := d.Dial("tcp", m.HTTPAddr())
	require.NoError(tb, err)
	tb.Cleanup(func() { raw.Close() })
	pool := ca.client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	conn := tls.Client(raw, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	require.NoError(tb, conn.Handshake())
	require.Equal(tb, "h2", conn.ConnectionState().NegotiatedProtocol)
	_, err = conn.Write([]byte(http2.ClientPreface))
	require.NoError(tb, err)
	c := &h2Conn{tb: tb, conn: conn, fr: http2.NewFramer(conn, conn), nextID: 1}
	c.enc = hpack.NewEncoder(&c.hbuf)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	require.NoError(tb, c.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: window}))
	require.NoError(tb, c.fr.WriteWindowUpdate(0, 1<<31-1-65535))
	return c
}

// get sends a GET of path with token on a new stream, and returns its id.
func (c *h2Conn) get(path, token string, header ...string) uint32 {
	c.tb.Helper()
	return c.request("GET", path, token, true, header...)
}

// put starts a PUT of path with token on a new stream, its body to be
// sent with c.fr.WriteData, and returns its id.
func (c *h2Conn) put(path, token string, header ...string) uint32 {
	c.tb.Helper()
	return c.request("PUT", path, token, false, header...)
}

func (c *h2Conn) request(method, path, token string, end bool, header ...string) uint32 {
	c.tb.Helper()
	c.hbuf.Reset()
	h := append([]string{":method", method, ":scheme", "https", ":authority", "127.0.0.1", ":path", path, "authorization", "Bearer " + token}, header...)
	for i := 0; i+1 < len(h); i += 2 {
		require.NoError(c.tb, c.enc.WriteField(hpack.HeaderField{Name: h[i], Value: h[i+1]}))
	}
	id := c.nextID
	c.nextID += 2
	require.NoError(c.tb, c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hbuf.Bytes(), EndStream: end, EndHeaders: true}))
	return id
}

// status reads frames (acknowledging the server's settings) until the
// response headers of stream id, and returns its status.
func (c *h2Conn) status(id uint32) string {
	c.tb.Helper()
	require.NoError(c.tb, c.conn.SetReadDeadline(time.Now().Add(20*time.Second)))
	defer c.conn.SetReadDeadline(time.Time{})
	for {
		f, err := c.fr.ReadFrame()
		require.NoError(c.tb, err)
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				require.NoError(c.tb, c.fr.WriteSettingsAck())
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == id {
				return f.PseudoValue("status")
			}
		case *http2.RSTStreamFrame:
			require.NotEqual(c.tb, id, f.StreamID, "stream reset: %v", f.ErrCode)
		case *http2.GoAwayFrame:
			// A shutdown's GOAWAY: the streams up to its last go on.
			if f.ErrCode != http2.ErrCodeNo || f.LastStreamID < id {
				c.tb.Fatalf("GOAWAY: %v, last stream %d", f.ErrCode, f.LastStreamID)
			}
		}
	}
}

// Over HTTP/2 an event stream whose client stopped reading its socket
// entirely ends within the events' write timeout and gives its place back
// (--max-streams-per-user), as over HTTP/1. The stream's write timeout
// resets the stream, but the reset is a frame to write on the connection,
// and the connection's writer was stuck on the full socket: the stream
// stayed, holding its place, until TCP_USER_TIMEOUT (a minute) or longer.
// docs/reliability.md, bug 324.
func TestEventsStreamOfAClientThatStoppedReadingEndsOverHTTP2(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	cfg := Config{TLSCert: certFile, TLSKey: keyFile, Events: api.EventsOptions{Heartbeat: 100 * time.Millisecond, WriteTimeout: 300 * time.Millisecond}}
	cfg.Limits.MaxStreamsPerUser = 1
	m := startServer(t, cfg)
	tlsClients.Store(m, &testTLS{http: ca.client()})
	t.Cleanup(func() { tlsClients.Delete(m) })
	f := setupFleet(t, m)
	app := make([]byte, 12<<20) // more than the socket buffers hold
	rand.Read(app)
	r := f.admin.do("PUT", "/api/v1/admin/apps/big/1.0.0", app)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	sum := sha256.Sum256(app)

	h2 := dialH2(t, m, ca, 1<<31-1)
	stream := h2.get("/api/v1/events", f.user.token, "accept", "text/event-stream")
	require.Equal(t, "200", h2.status(stream))
	blob := h2.get("/api/v1/blobs/"+hex.EncodeToString(sum[:]), m.AdminToken())
	_ = blob // never read: the app froze

	testenv.Eventually(t, 20*time.Second, "the stream's place given back", func() bool {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, "GET", m.APIURL()+"/api/v1/events", nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+f.user.token)
		req.Header.Set("Accept", "text/event-stream")
		res, err := ca.client().Do(req)
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	})
}

// A shutdown does not wait for an upload whose body stalls, over HTTP/1
// or HTTP/2: its request is answered 503 at once (nothing of it was kept),
// and Close ends cleanly. It waited out the HTTP server's shutdown limit
// (15 s) for the body and failed with its deadline, and `companion serve`
// exited with status 1. docs/reliability.md, bug 325.
func TestShutdownEndsAStalledUpload(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	const head = "PUT /api/v1/admin/apps/stalled/1.0.0 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n" +
		"Content-Type: application/octet-stream\r\nContent-Length: 1000000\r\nExpect: 100-continue\r\n\r\n"
	for _, proto := range []string{"HTTP/1", "HTTP/2"} {
		t.Run(proto, func(t *testing.T) {
			m := startServer(t, Config{TLSCert: certFile, TLSKey: keyFile})
			var answer func() string
			if proto == "HTTP/1" {
				pool := ca.client().Transport.(*http.Transport).TLSClientConfig.RootCAs
				conn, err := tls.Dial("tcp", m.HTTPAddr(), &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
				require.NoError(t, err)
				defer conn.Close()
				_, err = fmt.Fprintf(conn, head, m.AdminToken())
				require.NoError(t, err)
				require.NoError(t, conn.SetReadDeadline(time.Now().Add(20*time.Second)))
				rd := bufio.NewReader(conn)
				line, err := rd.ReadString('\n')
				require.NoError(t, err)
				require.True(t, strings.HasPrefix(line, "HTTP/1.1 100"), "answer %q", line) // the handler reads the body
				_, err = conn.Write(make([]byte, 1000))
				require.NoError(t, err)
				answer = func() string {
					for line, err = rd.ReadString('\n'); err == nil && (strings.HasPrefix(line, "HTTP/1.1 100") || line == "\r\n"); line, err = rd.ReadString('\n') {
					}
					require.NoError(t, err)
					return strings.Fields(line)[1]
				}
			} else {
				h2 := dialH2(t, m, ca, 1<<31-1)
				id := h2.put("/api/v1/admin/apps/stalled/1.0.0", m.AdminToken(), "content-type", "application/octet-stream",
					"content-length", "1000000", "expect", "100-continue")
				require.Equal(t, "100", h2.status(id)) // the handler reads the body
				require.NoError(t, h2.fr.WriteData(id, false, make([]byte, 1000)))
				answer = func() string { return h2.status(id) }
			}
			require.NoError(t, m.Close(), "Close with an upload stalled")
			assert.Equal(t, "503", answer())
		})
	}
}

// A shutdown does not wait for an event stream whose write its client
// does not take (its window full: an app that stopped reading), for as
// long as the write timeout (30 s): the stream ends at once, and Close
// ends cleanly. It waited out the HTTP server's shutdown limit (15 s),
// and failed with its deadline. docs/reliability.md, bug 326.
func TestShutdownEndsAnEventStreamBlockedOnItsWrite(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	m := startServer(t, Config{TLSCert: certFile, TLSKey: keyFile})
	tlsClients.Store(m, &testTLS{http: ca.client()})
	t.Cleanup(func() { tlsClients.Delete(m) })
	f := setupFleet(t, m)
	h2 := dialH2(t, m, ca, 4) // the app took 4 bytes of the stream, and reads no more
	id := h2.get("/api/v1/events", f.user.token, "accept", "text/event-stream")
	require.Equal(t, "200", h2.status(id)) // its first write, "retry: 2000", waits for the window
	require.NoError(t, m.Close(), "Close with an event stream blocked on its write")
}
