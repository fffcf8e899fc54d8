package api

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/ssetest"
	"github.com/devicecompanion/companion/store"
)

// answered is one request the API answered, as its RequestObserver is told.
type answered struct {
	method, route string
	status        int
}

// answers passes on every answered request: the handler has returned by
// the time it is told.
type answers chan answered

func (a answers) Request(method, route string, status int, _ time.Duration) {
	select {
	case a <- answered{method, route, status}:
	default: // the test reads what it waits for; a full channel drops the rest
	}
}

// wait returns the status of the next answer to method and route, failing
// the test if none comes within d.
func (a answers) wait(t testing.TB, d time.Duration, method, route string) int {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case got := <-a:
			if got.method == method && got.route == route {
				return got.status
			}
		case <-timeout:
			t.Fatalf("%s %q: the handler did not return within %v", method, route, d)
			return 0
		}
	}
}

// withBodyIdle sets Limits.BodyIdle.
func withBodyIdle(d time.Duration) envOption {
	return func(o *Options) { o.Limits.BodyIdle = d }
}

// withBodyMinRate sets Limits.BodyMinRate: the tests' bodies are slow
// for their short BodyIdle, not for the default rate.
func withBodyMinRate(n int64) envOption {
	return func(o *Options) { o.Limits.BodyMinRate = n }
}

// A client that sends the head of a request and part of its body, then
// nothing, is answered once the body has been quiet for BodyIdle (408
// when the handler was reading it; its own answer when it was not, as
// after a 401), the connection is closed, and the handler has returned.
func TestStalledBodyIsCut(t *testing.T) {
	const idle = 200 * time.Millisecond
	bound := 25 * idle // generous: the answer is due after idle
	seen := make(answers, 64)
	e := newEnv(t, withBodyIdle(idle), func(o *Options) { o.Requests = seen })
	tok := e.bound("dev-1")

	for _, tc := range []struct {
		name, head, part string
		method, route    string // as the observer names the request
		status           int
		code             string
	}{
		{
			name: "JSON body", head: rawRequest("POST", "/api/v1/devices/dev-1/push/text", tok, "application/json", 1000), part: `{"text": "`,
			method: "POST", route: "/api/v1/devices/:id/push/text", status: http.StatusRequestTimeout, code: CodeBodyTimeout,
		},
		{
			name: "chunked JSON body", head: chunkedHead("POST", "/api/v1/devices/dev-1/push/text", tok, "application/json"), part: "a\r\n{\"text\": \"\r\n",
			method: "POST", route: "/api/v1/devices/:id/push/text", status: http.StatusRequestTimeout, code: CodeBodyTimeout,
		},
		{
			name: "upload", head: rawRequest("PUT", "/api/v1/admin/apps/clock/1.0.0", testAdminToken, "application/octet-stream", 1000), part: "0123456789",
			method: "PUT", route: "/api/v1/admin/apps/:app_id/:version", status: http.StatusRequestTimeout, code: CodeBodyTimeout,
		},
		{
			// The document is larger than net/http's buffer: writing it
			// makes net/http read the unread body first, mid-handler.
			name: "answered before it is read", head: rawRequest("GET", "/api/v1/openapi.json", "", "application/json", 1000), part: `{"x`,
			method: "GET", route: "/api/v1/openapi.json", status: http.StatusOK,
		},
		{
			name: "not authenticated", head: rawRequest("POST", "/api/v1/devices/register", "not-a-token", "application/json", 1000), part: `{"device_id`,
			method: "POST", route: "/api/v1/devices/register", status: http.StatusUnauthorized, code: CodeUnauthorized,
		},
		{
			name: "no such route", head: rawRequest("POST", "/api/v1/nowhere", tok, "application/json", 1000), part: `{"x`,
			method: "POST", route: "", status: http.StatusNotFound, code: CodeNotFound,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			require.NoError(t, conn.SetDeadline(time.Now().Add(bound)))
			_, err = io.WriteString(conn, tc.head+tc.part)
			require.NoError(t, err)

			br := bufio.NewReader(conn)
			r, err := readRaw(br)
			require.NoError(t, err, "no answer: the server is still waiting for the body")
			require.Equal(t, tc.status, r.status, "%s", r.body)
			if tc.code != "" {
				assert.Equal(t, tc.code, r.problem(t).Code)
			}
			assert.True(t, r.close, "the answer says Connection: close")
			_, err = br.ReadByte()
			require.Error(t, err)
			require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the server kept the connection open")

			assert.Equal(t, tc.status, seen.wait(t, bound, tc.method, tc.route))
		})
	}
	assert.Empty(t, blobFiles(t, e.db), "the stalled upload left nothing behind")
}

// A body that keeps coming in small pieces, each within BodyIdle of the
// one before, at no less than BodyMinRate on average, is read however long
// it takes in all.
func TestSlowBodyIsRead(t *testing.T) {
	const idle = 500 * time.Millisecond
	e := newEnv(t, withBodyIdle(idle), withBodyMinRate(20)) // it comes at 40 bytes a second
	tok := e.bound("dev-1")

	for _, tc := range []struct {
		name, method, path, token, ctype, body string
		status                                 int
	}{
		{"JSON body", "POST", "/api/v1/devices/dev-1/push/text", tok, "application/json", `{"text": "slow, steady"}`, http.StatusAccepted},
		{"upload", "PUT", "/api/v1/admin/apps/clock/1.0.0", testAdminToken, "application/octet-stream", strings.Repeat("clock app ", 4), http.StatusCreated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			require.NoError(t, conn.SetDeadline(time.Now().Add(rawDeadline)))
			_, err = io.WriteString(conn, rawRequest(tc.method, tc.path, tc.token, tc.ctype, int64(len(tc.body))))
			require.NoError(t, err)
			// 2 bytes every idle/10, so twice idle or more in all. The
			// pauses are the behaviour under test, not synchronisation.
			start := time.Now()
			for rest := tc.body; rest != ""; {
				time.Sleep(idle / 10)
				n := min(2, len(rest))
				_, err = io.WriteString(conn, rest[:n])
				require.NoError(t, err, "the server cut a body that kept coming")
				rest = rest[n:]
			}
			require.Greater(t, time.Since(start), idle, "the body took longer than BodyIdle in all")
			r, err := readRaw(bufio.NewReader(conn))
			require.NoError(t, err)
			require.Equal(t, tc.status, r.status, "%s", r.body)
		})
	}
}

// The deadline goes with the body: a request held by Prefer: wait past
// BodyIdle after its body was read, one without a body, and event streams
// with and without a body all outlive it. A deadline left set would end
// them, through net/http's background read of the connection.
func TestLongRequestsOutliveBodyIdle(t *testing.T) {
	const idle = 200 * time.Millisecond
	e := newEventsEnv(t, EventsOptions{}, withBodyIdle(idle))
	tok := e.bound("dev-1")

	// succeedLater makes the command succeed once the request has been
	// held for 3×idle; the returned channel is closed once it has.
	succeedLater := func(id string) <-chan struct{} {
		done := make(chan struct{})
		time.AfterFunc(3*idle, func() {
			defer close(done)
			e.cmds.set(t, id, companion.StateSucceeded)
		})
		return done
	}

	t.Run("Prefer wait with a body", func(t *testing.T) {
		later := make(chan (<-chan struct{}), 1)
		e.cmds.mu.Lock()
		e.cmds.onSubmit = func(c companion.Command) { later <- succeedLater(c.ID) }
		e.cmds.mu.Unlock()
		defer func() { e.cmds.mu.Lock(); e.cmds.onSubmit = nil; e.cmds.mu.Unlock() }()
		r := e.send(req{method: "POST", path: "/api/v1/devices/dev-1/push/text", token: tok,
			body: map[string]any{"text": "x"}, header: map[string]string{"Prefer": "wait=30"}})
		select {
		case done := <-later:
			<-done
		case <-time.After(10 * time.Second):
			t.Fatal("no command was submitted")
		}
		require.Equal(t, http.StatusOK, r.status, "%s", r.body)
		assert.Equal(t, "succeeded", r.json(t)["state"])
	})
	t.Run("Prefer wait without a body", func(t *testing.T) {
		id := e.push(t, tok, "dev-1")
		done := succeedLater(id)
		r := e.send(req{method: "GET", path: "/api/v1/devices/dev-1/commands/" + id, token: tok, header: map[string]string{"Prefer": "wait=30"}})
		<-done
		require.Equal(t, http.StatusOK, r.status, "%s", r.body)
		assert.Equal(t, "succeeded", r.json(t)["state"])
	})
	withBody, err := http.NewRequest("GET", e.srv.URL+"/api/v1/events", strings.NewReader("{}"))
	require.NoError(t, err)
	withBody.Header.Set("Authorization", "Bearer "+tok)
	for name, hr := range map[string]*http.Request{
		"event stream":             sseRequest(t, e.srv.URL+"/api/v1/events", tok, nil),
		"event stream with a body": withBody,
	} {
		t.Run(name, func(t *testing.T) {
			s := ssetest.Open(t, e.srv.Client(), hr)
			select {
			case <-s.Done():
				t.Fatal("the stream ended")
			case <-time.After(4 * idle): // it outlived BodyIdle
			}
			id := e.push(t, tok, "dev-1")
			for {
				ev, err := s.Next(10 * time.Second)
				require.NoError(t, err, "the stream ended")
				if ev.Type == "command" && strings.Contains(ev.Data, id) {
					break
				}
			}
		})
	}
}

// A handler that flushes its answer before it reads the body has net/http
// read the body to its end and close it, and start its background read;
// the handler's read of the closed body then must not leave a deadline on
// that read, or the request's context ends.
func TestBodyReadAfterNetHTTPClosedIt(t *testing.T) {
	const idle = 200 * time.Millisecond
	e := newEnv(t, withBodyIdle(idle))
	eng := gin.New()
	eng.Use(e.api.bodyIdle)
	eng.POST("/flush-first", func(c *gin.Context) {
		c.Status(http.StatusOK)
		c.Writer.Flush()
		_, err := io.ReadAll(c.Request.Body)
		assert.ErrorIs(t, err, http.ErrBodyReadAfterClose)
		select {
		case <-c.Request.Context().Done():
			_, _ = io.WriteString(c.Writer, "canceled")
		case <-time.After(3 * idle): // held past BodyIdle
			_, _ = io.WriteString(c.Writer, "held")
		}
	})
	srv := httptest.NewServer(eng)
	t.Cleanup(srv.Close)
	res, err := srv.Client().Post(srv.URL+"/flush-first", "text/plain", strings.NewReader("body"))
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	assert.Equal(t, "held", string(b))
}

// slowBlobStore is a store slow to take a blob: it pauses once, after the
// first bytes, as a disk might.
type slowBlobStore struct {
	*store.DB
	pause time.Duration
}

func (s slowBlobStore) PutBlob(ctx context.Context, r io.Reader, max int64) (companion.Blob, error) {
	return s.DB.PutBlob(ctx, &pausingReader{r: r, pause: s.pause}, max)
}

type pausingReader struct {
	r      io.Reader
	pause  time.Duration
	paused bool
}

func (p *pausingReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 && !p.paused {
		p.paused = true
		time.Sleep(p.pause)
	}
	return n, err
}

// h2Server serves the env's API over HTTPS with HTTP/2 too, and returns
// it with a client that speaks HTTP/2 to it.
func (e *env) h2Server(t testing.TB) (*httptest.Server, *http.Client) {
	t.Helper()
	srv := httptest.NewUnstartedServer(e.api.Handler())
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, srv.Client()
}

// Over HTTP/2 the deadline is the stream's: a stalled body is cut with a
// 408, a slow one is read.
func TestBodyIdleOverHTTP2(t *testing.T) {
	const idle = 300 * time.Millisecond
	e := newEnv(t, withBodyIdle(idle), withBodyMinRate(20)) // the slow one comes at 66 bytes a second
	tok := e.bound("dev-1")
	srv, client := e.h2Server(t)
	url := srv.URL + "/api/v1/devices/dev-1/push/text"
	post := func(t *testing.T, body io.Reader, length int64) *http.Response {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 25*idle)
		t.Cleanup(cancel)
		hr, err := http.NewRequestWithContext(ctx, "POST", url, body)
		require.NoError(t, err)
		hr.ContentLength = length
		hr.Header.Set("Authorization", "Bearer "+tok)
		hr.Header.Set("Content-Type", "application/json")
		res, err := client.Do(hr)
		require.NoError(t, err, "no answer: the server is still waiting for the body")
		t.Cleanup(func() { res.Body.Close() })
		require.Equal(t, 2, res.ProtoMajor)
		return res
	}

	t.Run("stalled", func(t *testing.T) {
		pr, pw := io.Pipe()
		defer pw.Close()
		go func() { _, _ = io.WriteString(pw, `{"text": "`) }() // then nothing
		res := post(t, pr, 1000)
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		r := resp{status: res.StatusCode, header: res.Header, body: b}
		require.Equal(t, http.StatusRequestTimeout, r.status, "%s", b)
		assert.Equal(t, CodeBodyTimeout, r.problem(t).Code)
	})
	t.Run("slow", func(t *testing.T) {
		body := `{"text": "slow, steady"}`
		pr, pw := io.Pipe()
		go func() {
			for rest := body; rest != ""; rest = rest[min(2, len(rest)):] {
				time.Sleep(idle / 10) // the pace of a slow client
				if _, err := io.WriteString(pw, rest[:min(2, len(rest))]); err != nil {
					return
				}
			}
			pw.Close()
		}()
		res := post(t, pr, int64(len(body)))
		b, _ := io.ReadAll(res.Body)
		require.Equal(t, http.StatusAccepted, res.StatusCode, "%s", b)
	})
}

// Only the client's pauses count: a handler that stops reading for longer
// than BodyIdle (a slow disk under an upload) and then reads on gets the
// rest of the body, over HTTP/1 and HTTP/2. The body is larger than what
// HTTP/2's flow control lets the client send ahead.
func TestHandlerPausesAreNotStalls(t *testing.T) {
	const idle = 200 * time.Millisecond
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	e := newEnvWith(t, db, slowBlobStore{DB: db, pause: 3 * idle}, withBodyIdle(idle))
	h2, h2Client := e.h2Server(t)
	body := bytes.Repeat([]byte("firmware"), 4<<20/8)

	for _, tc := range []struct {
		name, base, version string
		client              *http.Client
		proto               int
	}{
		{"HTTP/1", e.srv.URL, "1.0.0", e.srv.Client(), 1},
		{"HTTP/2", h2.URL, "2.0.0", h2Client, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hr, err := http.NewRequest("PUT", tc.base+"/api/v1/admin/apps/clock/"+tc.version, bytes.NewReader(body))
			require.NoError(t, err)
			hr.Header.Set("Authorization", "Bearer "+testAdminToken)
			hr.Header.Set("Content-Type", "application/octet-stream")
			res, err := tc.client.Do(hr)
			require.NoError(t, err)
			defer res.Body.Close()
			b, _ := io.ReadAll(res.Body)
			require.Equal(t, tc.proto, res.ProtoMajor)
			require.Equal(t, http.StatusCreated, res.StatusCode, "%s", b)
		})
	}
}

// trickle writes the head of a request, then one byte of its body every
// pause, each well within BodyIdle of the last, until stop is closed or a
// write fails; the returned channel is closed when it has stopped.
func trickle(conn net.Conn, head string, pause time.Duration, stop <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := io.WriteString(conn, head); err != nil {
			return
		}
		tick := time.NewTicker(pause)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C: // the client's pace, not synchronisation
			}
			if _, err := io.WriteString(conn, "A"); err != nil {
				return
			}
		}
	}()
	return done
}

// A client that trickles a large body, one byte just before each
// BodyIdle runs out, is cut once its body has averaged less than the
// minimum rate (Limits.BodyMinRate, 256 bytes a second by default) past
// the first BodyIdle: a 408 body_timeout, the connection closed, the
// handler returned. Before the minimum, such a client held a handler and
// a connection for as long as the body limit let it go on: a 2.8 MB image
// push a byte every 59 s, over five years.
func TestTrickledBodyIsCut(t *testing.T) {
	const idle = 300 * time.Millisecond
	bound := 20 * idle // the answer is due a little after idle
	seen := make(answers, 64)
	e := newEnv(t, withBodyIdle(idle), func(o *Options) { o.Requests = seen })
	tok := e.bound("dev-1")

	for _, tc := range []struct {
		name, head    string
		method, route string
	}{
		{"image push", rawRequest("POST", "/api/v1/devices/dev-1/push/image", tok, "application/json", 100_000),
			"POST", "/api/v1/devices/:id/push/image"},
		{"upload", rawRequest("PUT", "/api/v1/admin/apps/clock/1.0.0", testAdminToken, "application/octet-stream", 100_000),
			"PUT", "/api/v1/admin/apps/:app_id/:version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(bound)))
			stop := make(chan struct{})
			stopped := trickle(conn, tc.head, idle/2, stop)
			defer func() { close(stop); <-stopped }()

			br := bufio.NewReader(conn)
			r, err := readRaw(br)
			require.NoError(t, err, "no answer: the server is still reading the trickle")
			require.Equal(t, http.StatusRequestTimeout, r.status, "%s", r.body)
			p := r.problem(t)
			assert.Equal(t, CodeBodyTimeout, p.Code)
			assert.Contains(t, p.Detail, "bytes a second")
			assert.True(t, r.close, "the answer says Connection: close")
			_, err = br.ReadByte()
			require.Error(t, err)
			require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the server kept the connection open")
			assert.Equal(t, http.StatusRequestTimeout, seen.wait(t, bound, tc.method, tc.route))
		})
	}
	t.Run("HTTP/2", func(t *testing.T) {
		srv, client := e.h2Server(t)
		ctx, cancel := context.WithTimeout(t.Context(), bound)
		defer cancel()
		pr, pw := io.Pipe()
		wrote := make(chan struct{})
		defer func() { pw.Close(); <-wrote }()
		go func() {
			defer close(wrote)
			tick := time.NewTicker(idle / 2)
			defer tick.Stop()
			for range tick.C { // the client's pace, not synchronisation
				if _, err := io.WriteString(pw, "A"); err != nil {
					return
				}
			}
		}()
		hr, err := http.NewRequestWithContext(ctx, "POST", srv.URL+"/api/v1/devices/dev-1/push/image", pr)
		require.NoError(t, err)
		hr.ContentLength = 100_000
		hr.Header.Set("Authorization", "Bearer "+tok)
		hr.Header.Set("Content-Type", "application/json")
		res, err := client.Do(hr)
		require.NoError(t, err, "no answer: the server is still reading the trickle")
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		require.Equal(t, 2, res.ProtoMajor)
		r := resp{status: res.StatusCode, header: res.Header, body: b}
		require.Equal(t, http.StatusRequestTimeout, r.status, "%s", b)
		assert.Equal(t, CodeBodyTimeout, r.problem(t).Code)
	})
}
