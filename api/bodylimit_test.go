package api

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/openapitest"
	"github.com/devicecompanion/companion/store"
)

// rawDeadline bounds every raw exchange, so that a server that stops
// reading fails the test instead of hanging it.
const rawDeadline = 30 * time.Second

// rawRequest is the head of an HTTP/1.1 request with a body of n bytes.
func rawRequest(method, path, token, ctype string, n int64) string {
	return fmt.Sprintf("%s %s HTTP/1.1\r\nHost: companion\r\nAuthorization: Bearer %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n",
		method, path, token, ctype, n)
}

// rawResp is an answer read off a raw connection.
type rawResp struct {
	resp
	close  bool // the answer said Connection: close
	closed bool // the server closed the connection after the answer
}

// readRaw reads one answer, whole, off br.
func readRaw(br *bufio.Reader) (rawResp, error) {
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		return rawResp{}, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return rawResp{}, err
	}
	return rawResp{resp: resp{status: res.StatusCode, header: res.Header, body: b}, close: res.Close}, nil
}

// sendWhole writes the request head and the whole body on a new
// connection, and only then reads the answer: it returns the connection,
// its reader after the answer, and the answer.
func (e *env) sendWhole(t testing.TB, head string, body io.Reader) (net.Conn, *bufio.Reader, rawResp) {
	t.Helper()
	conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
	require.NoError(t, err)
	require.NoError(t, conn.SetDeadline(time.Now().Add(rawDeadline)))
	_, err = io.Copy(conn, io.MultiReader(strings.NewReader(head), body))
	if err != nil {
		conn.Close()
	}
	require.NoError(t, err, "writing the whole request: the server must read it before it answers")
	br := bufio.NewReader(conn)
	r, err := readRaw(br)
	if err != nil {
		conn.Close()
	}
	require.NoError(t, err, "reading the answer")
	return conn, br, r
}

// sendWholeThenRead does what many clients do (Python's urllib, mobile
// HTTP stacks): it writes the request head and the whole body on a new
// connection, and only then reads the answer, which it returns.
func (e *env) sendWholeThenRead(t testing.TB, head string, body io.Reader) rawResp {
	t.Helper()
	conn, br, r := e.sendWhole(t, head, body)
	defer conn.Close()
	// After the answer, the server closes: the next read ends at once.
	_, err := br.ReadByte()
	r.closed = err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
	return r
}

// sendEndless writes a request whose body goes on far beyond any limit
// while it reads the answer, the way a client that reads as it writes
// does. It returns once the server has closed the connection (failing the
// test if that takes longer than rawDeadline), with the answer if one
// could be read before the close; a reset may come instead.
func (e *env) sendEndless(t testing.TB, head string) *rawResp {
	t.Helper()
	conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
	require.NoError(t, err)
	require.NoError(t, conn.SetDeadline(time.Now().Add(rawDeadline)))
	wrote := make(chan error, 1)
	go func() {
		chunk := bytes.Repeat([]byte("A"), 64<<10)
		_, err := io.WriteString(conn, head)
		for err == nil {
			_, err = conn.Write(chunk)
		}
		wrote <- err
	}()
	br := bufio.NewReader(conn)
	var got *rawResp
	if r, err := readRaw(br); err == nil {
		got = &r
	}
	_, err = io.Copy(io.Discard, br)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the server kept the connection open: %v", err)
	if got != nil {
		got.closed = true
	}
	conn.Close()
	werr := <-wrote
	require.False(t, errors.Is(werr, os.ErrDeadlineExceeded), "the server kept reading: %v", werr)
	return got
}

// chunkedHead is the head of a request whose body comes in chunks with no
// declared length.
func chunkedHead(method, path, token, ctype string) string {
	return fmt.Sprintf("%s %s HTTP/1.1\r\nHost: companion\r\nAuthorization: Bearer %s\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n",
		method, path, token, ctype)
}

// chunked encodes n bytes of filler as one chunk and the last chunk.
func chunked(n int64) io.Reader {
	return io.MultiReader(
		strings.NewReader(fmt.Sprintf("%x\r\n", n)),
		io.LimitReader(repeatReader('A'), n),
		strings.NewReader("\r\n0\r\n\r\n"))
}

type repeatReader byte

func (r repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

// imageJSON is a push/image body of n bytes in all, its image being
// base64 filler.
func imageJSON(n int64) io.Reader {
	const pre, post = `{"image":"`, `"}`
	return io.MultiReader(strings.NewReader(pre), io.LimitReader(repeatReader('A'), n-int64(len(pre)+len(post))), strings.NewReader(post))
}

// wantReadable413 checks a 413 that a client reading only after it sent
// everything could read: the whole problem+json, Connection: close, and
// the connection closed after it.
func wantReadable413(t *testing.T, r rawResp) {
	t.Helper()
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "%s", r.body)
	assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
	assert.True(t, r.close, "a 413 says Connection: close")
	assert.True(t, r.closed, "the server must close the connection after a 413")
}

// A body over its limit gets a 413 that a client sending the whole body
// before it reads can read (CONTRACT §8); a body beyond 4× the limit gets
// the connection closed, without hanging the server; nothing is stored.
func TestBodyOverLimitIsReadable(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	const path = "/api/v1/devices/dev-1/push/image"
	limit := e.api.limits.imageBody()
	require.Greater(t, int64(6<<20), limit)
	require.Less(t, int64(6<<20), 4*limit)

	ok := func(t *testing.T) {
		t.Helper()
		// A normal request on a new connection works, and the refused
		// ones stored nothing: no command, no blob.
		r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "still here"})
		require.Equal(t, 202, r.status, "%s", r.body)
		cmds, _, err := e.db.ListCommands(t.Context(), companion.CommandQuery{DeviceID: "dev-1"})
		require.NoError(t, err)
		for _, c := range cmds {
			assert.Equal(t, "push.text", c.Op, "a refused body made a command")
		}
		assert.Empty(t, blobFiles(t, e.db), "a refused body left a blob")
	}

	t.Run("6 MiB image, declared length", func(t *testing.T) {
		wantReadable413(t, e.sendWholeThenRead(t, rawRequest("POST", path, tok, "application/json", 6<<20), imageJSON(6<<20)))
		ok(t)
	})
	t.Run("10 MiB image, chunked", func(t *testing.T) {
		// The server learns of the excess only as it reads.
		require.Greater(t, int64(10<<20), limit)
		require.Less(t, int64(10<<20), 4*limit)
		wantReadable413(t, e.sendWholeThenRead(t, chunkedHead("POST", path, tok, "application/json"), chunked(10<<20)))
		ok(t)
	})
	t.Run("exactly 4× the limit", func(t *testing.T) {
		wantReadable413(t, e.sendWholeThenRead(t, rawRequest("POST", path, tok, "application/json", 4*limit), imageJSON(4*limit)))
		ok(t)
	})
	t.Run("beyond 4× the limit, declared length", func(t *testing.T) {
		if r := e.sendEndless(t, rawRequest("POST", path, tok, "application/json", 1<<40)); r != nil {
			wantReadable413(t, *r)
		}
		ok(t)
	})
	t.Run("beyond 4× the limit, chunked", func(t *testing.T) {
		// A chunk that never ends: the server reads 4× the limit of it and
		// stops.
		if r := e.sendEndless(t, chunkedHead("POST", path, tok, "application/json")+"fffffffffff\r\n"); r != nil {
			wantReadable413(t, *r)
		}
		ok(t)
	})
}

// A client that waits for 100 Continue before it sends a body over the
// limit gets the 413 at once and never sends the body.
func TestBodyOverLimitWithExpectContinue(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(rawDeadline)))
	head := rawRequest("POST", "/api/v1/devices/dev-1/push/text", tok, "application/json", 1<<20)
	head = strings.Replace(head, "\r\n\r\n", "\r\nExpect: 100-continue\r\n\r\n", 1)
	_, err = io.WriteString(conn, head)
	require.NoError(t, err)
	r, err := readRaw(bufio.NewReader(conn))
	require.NoError(t, err)
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "%s", r.body)
	assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
	assert.True(t, r.close, "a 413 says Connection: close")
}

// Uploads streamed into blobs behave the same: the 413 is readable, and no
// blob, temp file or release is left of the refused body.
func TestUploadOverLimitIsReadable(t *testing.T) {
	// The body is larger than what the sockets buffer (or the client
	// would finish writing whatever the server does).
	const limit = 2 << 20
	e := newEnv(t, func(o *Options) { o.Limits.MaxFirmwareBytes = limit })
	const path = "/api/v1/admin/firmware/sim-1/1.0.0"
	for _, tc := range []struct {
		name string
		head string
		body io.Reader
	}{
		{"declared length", rawRequest("PUT", path, testAdminToken, "application/octet-stream", 3.5*limit), io.LimitReader(repeatReader('f'), 3.5*limit)},
		{"chunked", chunkedHead("PUT", path, testAdminToken, "application/octet-stream"), chunked(3.5 * limit)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantReadable413(t, e.sendWholeThenRead(t, tc.head, tc.body))
			_, err := e.db.Firmware(t.Context(), "sim-1", "1.0.0")
			assert.ErrorIs(t, err, companion.ErrNotFound)
			assert.Empty(t, blobFiles(t, e.db))
		})
	}
	t.Run("beyond 4× the limit", func(t *testing.T) {
		if r := e.sendEndless(t, rawRequest("PUT", path, testAdminToken, "application/octet-stream", 1<<40)); r != nil {
			wantReadable413(t, *r)
		}
		if r := e.sendEndless(t, chunkedHead("PUT", path, testAdminToken, "application/octet-stream")+"fffffffffff\r\n"); r != nil {
			wantReadable413(t, *r)
		}
		assert.Empty(t, blobFiles(t, e.db))
	})
	// The limit itself is fine, on a new connection.
	fw := firmwareImage(t, "1.0.0", limit)
	r := e.send(req{method: "PUT", path: path, token: testAdminToken, body: fw, header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, 201, r.status, "%s", r.body)
	assert.Len(t, blobFiles(t, e.db), 1)
}

// blobFiles lists every file under the store's blob directory, temp files
// included.
func blobFiles(t *testing.T, db *store.DB) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(db.BlobDir(), func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			out = append(out, path)
		}
		return err
	})
	require.NoError(t, err)
	return out
}

// An upload whose body cannot be read to its end, because the client cut
// it short or sent chunks that are not chunked encoding, is the client's
// failure: a 400 bad_request, as a JSON body that cannot be read is, that
// api/openapi.json documents; not a 500, which the server's log tells as
// its own error and the metrics count among the 5xx answers.
func TestUploadCutShortIsTheClients(t *testing.T) {
	seen := make(answers, 64)
	e := newEnv(t, func(o *Options) { o.Requests = seen })
	doc := mustContract(t)
	for _, up := range []struct{ path, route string }{
		{"/api/v1/admin/firmware/sim-1/1.0.0", "/api/v1/admin/firmware/:model/:version"},
		{"/api/v1/admin/apps/clock/1.0.0", "/api/v1/admin/apps/:app_id/:version"},
	} {
		for _, tc := range []struct {
			name, head, body string
			cut              bool // the client stops sending (closes its side) mid-body
		}{
			{name: "not chunked encoding", head: chunkedHead("PUT", up.path, testAdminToken, "application/octet-stream"), body: "5\r\nhello\r\nZZ\r\nxx\r\n0\r\n\r\n"},
			{name: "cut short", head: rawRequest("PUT", up.path, testAdminToken, "application/octet-stream", 100000), body: strings.Repeat("x", 5000), cut: true},
		} {
			t.Run(up.route+"/"+tc.name, func(t *testing.T) {
				conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
				require.NoError(t, err)
				defer conn.Close()
				require.NoError(t, conn.SetDeadline(time.Now().Add(rawDeadline)))
				_, err = io.WriteString(conn, tc.head+tc.body)
				require.NoError(t, err)
				if tc.cut {
					require.NoError(t, conn.(*net.TCPConn).CloseWrite())
				}
				r, err := readRaw(bufio.NewReader(conn))
				require.NoError(t, err)
				require.Equal(t, http.StatusBadRequest, r.status, "%s", r.body)
				assert.Equal(t, CodeBadRequest, r.problem(t).Code)
				hr, err := http.NewRequest("PUT", e.srv.URL+up.path, nil)
				require.NoError(t, err)
				hr.Header.Set("Authorization", "Bearer "+testAdminToken)
				hr.Header.Set("Content-Type", "application/octet-stream")
				doc.Check(t, hr, []byte(tc.body), openapitest.Answer{Status: r.status, Header: r.header, Body: r.body})
				assert.Equal(t, http.StatusBadRequest, seen.wait(t, rawDeadline, "PUT", up.route))
				assert.Empty(t, blobFiles(t, e.db), "the unread upload left nothing behind")
			})
		}
	}
}

// TestBodyOverLimitSaysTheLimit sends bodies over their limits, as this
// server has them, over the real server: each 413 says the limit in bytes.
// It said "the body is over its limit" alone, and a client had to guess
// the operator's --max-* flags from the documented defaults.
func TestBodyOverLimitSaysTheLimit(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.MaxJSONBody = 1000; o.Limits.MaxAppBytes = 3000 })
	tok := e.bound("dev-1")
	for _, tc := range []struct {
		method, path, token string
		body                any
		limit               int64
	}{
		{"POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "dev-1", "claim_code": strings.Repeat("c", 2000)}, 1000},
		{"POST", "/api/v1/devices/dev-1/push/image", tok, map[string]any{"image": strings.Repeat("A", int(e.api.limits.imageBody()))}, e.api.limits.imageBody()},
		{"PUT", "/api/v1/admin/apps/clock/1.0.0", testAdminToken, bytes.Repeat([]byte("p"), 4000), 3000},
	} {
		r := e.send(req{method: tc.method, path: tc.path, token: tc.token, body: tc.body})
		require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "%s %s: %.300s", tc.method, tc.path, r.body)
		assert.Equal(t, fmt.Sprintf("the body is over this operation's limit of %d bytes", tc.limit), r.problem(t).Detail, "%s %s", tc.method, tc.path)
	}
}

// An app package and a firmware image at their limit are published, and
// one a byte over is a 413 body_too_large, whether the body's length is
// declared or it comes chunked (the server then learns it only as it
// reads): at their defaults of 16 MiB and 64 MiB, and at configured
// limits.
func TestUploadsAtTheirLimits(t *testing.T) {
	put := func(t *testing.T, e *env, path string, body []byte, chunked bool) resp {
		t.Helper()
		hr, err := http.NewRequest("PUT", e.srv.URL+path, bytes.NewReader(body))
		require.NoError(t, err)
		if chunked {
			hr.ContentLength = -1 // not known: net/http sends the body chunked
		}
		hr.Header.Set("Authorization", "Bearer "+testAdminToken)
		hr.Header.Set("Content-Type", "application/octet-stream")
		res, err := e.srv.Client().Do(hr)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return resp{status: res.StatusCode, header: res.Header, body: b}
	}
	for _, tc := range []struct {
		name        string
		app, fw     int64 // the configured limits; 0 the default
		appAt, fwAt int64 // what is published at the limit; 0: nothing
	}{
		{name: "defaults", appAt: DefaultLimits.MaxAppBytes, fwAt: DefaultLimits.MaxFirmwareBytes},
		{name: "configured", app: 500, fw: 1000, appAt: 500, fwAt: 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Limits.MaxAppBytes, o.Limits.MaxFirmwareBytes = tc.app, tc.fw })
			for i, chunked := range []bool{false, true} {
				how := map[bool]string{false: "declared", true: "chunked"}[chunked]
				if tc.appAt > 0 {
					at := bytes.Repeat([]byte{byte('a' + i)}, int(tc.appAt))
					r := put(t, e, fmt.Sprintf("/api/v1/admin/apps/clock/1.0.%d", i), at, chunked)
					assert.Equal(t, 201, r.status, "app at the limit, %s: %s", how, r.body)
					r = put(t, e, fmt.Sprintf("/api/v1/admin/apps/clock/2.0.%d", i), append(at, 'x'), chunked)
					if assert.Equal(t, 413, r.status, "app a byte over, %s: %.300s", how, r.body) {
						assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
					}
				}
				if tc.fwAt > 0 {
					r := put(t, e, fmt.Sprintf("/api/v1/admin/firmware/sim-1/1.0.%d", i), firmwareImage(t, fmt.Sprintf("1.0.%d", i), int(tc.fwAt)), chunked)
					assert.Equal(t, 201, r.status, "firmware at the limit, %s: %s", how, r.body)
					r = put(t, e, fmt.Sprintf("/api/v1/admin/firmware/sim-1/2.0.%d", i), firmwareImage(t, fmt.Sprintf("2.0.%d", i), int(tc.fwAt)+1), chunked)
					if assert.Equal(t, 413, r.status, "firmware a byte over, %s: %.300s", how, r.body) {
						assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
					}
				}
			}
		})
	}
}

// sendWholeThenReadAgain is sendWholeThenRead, but a connection the answer
// keeps (no Connection: close) is checked by a second request on it, which
// must be answered; one it closes must be closed.
func (e *env) sendWholeThenReadAgain(t testing.TB, head string, body io.Reader) rawResp {
	t.Helper()
	conn, br, r := e.sendWhole(t, head, body)
	defer conn.Close()
	if r.close {
		_, err := br.ReadByte()
		r.closed = err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
		assert.True(t, r.closed, "the server must close the connection after Connection: close")
		return r
	}
	_, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: companion\r\n\r\n")
	require.NoError(t, err)
	again, err := readRaw(br)
	require.NoError(t, err, "a second request on the connection the answer kept")
	assert.Equal(t, http.StatusOK, again.status, "%s", again.body)
	return r
}

// awayStore is a store that cannot be reached once down is set: Binding
// fails with errAway.
type awayStore struct {
	*store.DB
	down atomic.Bool
}

var errAway = errors.New("the database is restarting")

func (s *awayStore) Binding(ctx context.Context, id string) (companion.Binding, error) {
	if s.down.Load() {
		return companion.Binding{}, errAway
	}
	return s.DB.Binding(ctx, id)
}

// An answer given before the body is read (the rate limit, a token
// refused, a device not found or not the caller's, a media type refused,
// the store away, an unknown route) reaches a client that sends its whole
// body before it reads, as a 413 does (CONTRACT §8): a phone pushing an
// image while rate limited read "connection reset", not the 429 and its
// Retry-After (docs/reliability.md, bug 263). The bodies are within their
// limits and larger than what the sockets buffer.
func TestEarlyAnswersAreReadable(t *testing.T) {
	const (
		imageLimit = 8 << 20  // MaxImageBytes: an image push's body may be 21 MiB
		n          = 16 << 20 // the body sent
	)
	configure := func(o *Options) {
		o.Limits.MaxImageBytes = imageLimit
		o.Unavailable = func(err error) bool { return errors.Is(err, errAway) }
	}
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	away := &awayStore{DB: db}
	e := newEnvWith(t, db, away, configure)
	require.Greater(t, e.api.limits.imageBody(), int64(n))
	tok := e.bound("dev-1")
	otherTok := e.bound("dev-2")
	const image = "/api/v1/devices/dev-1/push/image"

	// The rate limit: the token's one request is spent.
	limited := newEnvWith(t, db, db, configure, func(o *Options) {
		o.Limits.RequestsPerSecond, o.Limits.RequestBurst = 1e-6, 1
	})
	require.Equal(t, http.StatusOK, limited.do("GET", "/api/v1/devices", tok, nil).status)
	// A source that has spent its allowance of wrong tokens.
	spent := newEnvWith(t, db, db, configure, func(o *Options) { o.Limits.UnauthPerMinute = 1 })
	require.Equal(t, http.StatusUnauthorized, spent.do("GET", "/api/v1/devices", "ctk_wrong", nil).status)

	for _, tc := range []struct {
		name   string
		e      *env
		head   string
		status int
		code   string
	}{
		{"rate limited", limited, rawRequest("POST", image, tok, "application/json", n), http.StatusTooManyRequests, CodeRateLimited},
		{"no token", e, rawRequest("POST", image, "", "application/json", n), http.StatusUnauthorized, CodeUnauthorized},
		{"wrong token", e, rawRequest("POST", image, "ctk_wrong", "application/json", n), http.StatusUnauthorized, CodeUnauthorized},
		{"wrong token, allowance spent", spent, rawRequest("POST", image, "ctk_wrong", "application/json", n), http.StatusTooManyRequests, CodeRateLimited},
		{"unknown device", e, rawRequest("POST", "/api/v1/devices/dev-9/push/image", tok, "application/json", n), http.StatusNotFound, CodeDeviceNotFound},
		{"another's device", e, rawRequest("POST", image, otherTok, "application/json", n), http.StatusNotFound, CodeDeviceNotFound},
		{"not JSON", e, rawRequest("POST", image, tok, "text/plain", n), http.StatusUnsupportedMediaType, CodeUnsupportedMedia},
		{"firmware, wrong token", e, rawRequest("PUT", "/api/v1/admin/firmware/sim-1/1.0.0", "ctk_wrong", "application/octet-stream", n), http.StatusUnauthorized, CodeUnauthorized},
		{"store away", e, rawRequest("POST", image, tok, "application/json", n), http.StatusServiceUnavailable, CodeUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.code == CodeUnavailable {
				away.down.Store(true)
				defer away.down.Store(false)
			}
			r := tc.e.sendWholeThenReadAgain(t, tc.head, imageJSON(n))
			require.Equal(t, tc.status, r.status, "%s", r.body)
			assert.Equal(t, tc.code, r.problem(t).Code)
			if tc.status == http.StatusTooManyRequests || tc.status == http.StatusServiceUnavailable {
				assert.NotEmpty(t, r.header.Get("Retry-After"))
			}
		})
	}
	t.Run("beyond 4× the limit", func(t *testing.T) {
		// A body that never ends: the server reads 4× the limit of it,
		// then answers, closes the connection and is done with it.
		for _, head := range []string{
			rawRequest("POST", "/api/v1/devices/register", "ctk_wrong", "application/json", 1<<40),
			chunkedHead("POST", "/api/v1/devices/register", "ctk_wrong", "application/json") + "fffffffffff\r\n",
		} {
			if r := e.sendEndless(t, head); r != nil {
				assert.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)
				assert.True(t, r.close, "the answer says Connection: close")
			}
		}
	})
	assert.Zero(t, e.cmds.count()+limited.cmds.count()+spent.cmds.count(), "a refused request made a command")
}

// Each route largeBodies names is one the server has: a route it misnamed
// would have its early answers read only 4× the JSON body limit.
func TestLargeBodiesAreRoutes(t *testing.T) {
	e := newEnv(t)
	routes := map[string]bool{}
	for _, r := range e.api.engine.Routes() {
		routes[r.Path] = true
	}
	for path := range largeBodies {
		assert.True(t, routes[path], "largeBodies names %q, which is no route", path)
	}
}

// A request with no valid token is read, before its 401, no further than
// four times the largest body of a user's operation (an image push's),
// whatever its route: a firmware upload's 4× would have the server read
// hundreds of MiB for anyone who asks (bug 263's drain, bounded).
func TestARequestWithoutATokenIsReadBoundedly(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.MaxFirmwareBytes = 4 << 30 })
	r := e.sendEndless(t, chunkedHead("PUT", "/api/v1/admin/firmware/sim-1/1.0.0", "ctk_wrong", "application/octet-stream")+"fffffffffff\r\n")
	require.NotNil(t, r, "no answer")
	assert.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)
	assert.True(t, r.close, "the answer says Connection: close")
}
