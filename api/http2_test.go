package api

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store"
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
// connection's other requests go on. docs/reliability.md, bug 320.
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

// slowTokens is a store whose read of a token, once armed, answers only
// after pause: PostgreSQL not answering for a while.
type slowTokens struct {
	*store.DB
	armed   atomic.Bool
	entered chan struct{}
	pause   time.Duration
}

func (s *slowTokens) UserByTokenHash(ctx context.Context, hash []byte) (companion.User, error) {
	if s.armed.CompareAndSwap(true, false) {
		s.entered <- struct{}{}
		select {
		case <-time.After(s.pause):
		case <-ctx.Done():
			return companion.User{}, ctx.Err()
		}
	}
	return s.DB.UserByTokenHash(ctx, hash)
}

// An event stream outlives a pause of the server's own longer than the
// write timeout (EventsOptions.WriteTimeout), over HTTP/2 as over HTTP/1:
// the timeout ends a stream whose client does not take a write in time,
// not one with nothing to write. Over HTTP/2 the write deadline is the
// stream's, a timer that fires whether or not a write is under way, and
// it stayed set after each write: a stream whose heartbeat's check of its
// token waited on the store (PostgreSQL not answering) for longer was
// reset, INTERNAL_ERROR, and every phone on HTTP/2 lost its stream, while
// a client on HTTP/1 kept it. docs/reliability.md, bug 321.
func TestEventsStreamOutlivesAPauseOverHTTP2(t *testing.T) {
	const timeout = 300 * time.Millisecond
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	hub, err := NewEvents(EventsOptions{Store: db, Heartbeat: timeout / 3, WriteTimeout: timeout, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	db.OnEvents(hub.Wake)
	st := &slowTokens{DB: db, entered: make(chan struct{}, 1), pause: 5 * timeout}
	e := &eventsEnv{env: newEnvWith(t, db, st, func(o *Options) { o.Events = hub }), hub: hub}
	t.Cleanup(hub.Close)
	tok := e.bound("dev-1")
	h2, h2Client := e.h2Server(t)

	for _, tc := range []struct {
		name   string
		base   string
		client *http.Client
		proto  int
	}{
		{"HTTP/1", e.srv.URL, e.srv.Client(), 1},
		{"HTTP/2", h2.URL, h2Client, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := sseOpen(t, tc.client, tc.base+"/api/v1/events", tok, nil)
			st.armed.Store(true) // the next heartbeat's check waits
			waitFor(t, st.entered, "a heartbeat's check of the token")
			id := e.push(t, tok, "dev-1")
			for {
				ev, err := s.Next(10 * time.Second)
				require.NoError(t, err, "the stream ended during the pause")
				if ev.Type == "command" && strings.Contains(ev.Data, id) {
					break
				}
			}
		})
	}
}

// The write timeout still ends an HTTP/2 stream whose client takes no
// more (its window full: an app that stopped reading), and gives its
// place back (bug 321's fix clears the deadline only once a write is
// done).
func TestEventsUnreadStreamEndsOverHTTP2(t *testing.T) {
	const timeout = 300 * time.Millisecond
	e := newEventsEnv(t, EventsOptions{WriteTimeout: timeout}, func(o *Options) { o.Limits.MaxStreamsPerUser = 1 })
	tok := e.bound("dev-1")
	srv := httptest.NewUnstartedServer(e.api.Handler())
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	t.Cleanup(e.hub.Close) // first: it ends the streams
	// A client that takes 64 KiB of a stream until the app reads it.
	tr := srv.Client().Transport.(*http.Transport).Clone()
	tr.HTTP2 = &http.HTTP2Config{MaxReceiveBufferPerStream: 64 << 10}
	t.Cleanup(tr.CloseIdleConnections)
	unread, err := (&http.Client{Transport: tr}).Do(sseRequest(t, srv.URL+"/api/v1/events", tok, nil))
	require.NoError(t, err)
	defer unread.Body.Close()
	require.Equal(t, 2, unread.ProtoMajor)
	require.Equal(t, http.StatusOK, unread.StatusCode)

	e.serve("dev-1")
	for j := range 400 { // 400 events of 300 bytes and more: past the window
		battery := j % 101
		done := make(chan struct{})
		e.db.PutStatusAsync(companion.Status{DeviceID: "dev-1", Online: true, Battery: &battery, FirmwareVersion: strings.Repeat("1", 60),
			Model: "sim-1", BridgeID: "bridge-1", LastSeen: time.Now(), Seq: uint64(j + 1)}, func(bool, error) { close(done) })
		<-done
	}
	testenv.Eventually(t, 20*time.Second, "the unread stream's place given back", func() bool {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		hr := sseRequest(t, srv.URL+"/api/v1/events", tok, nil).WithContext(ctx)
		res, err := srv.Client().Do(hr)
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	})
	_, err = io.ReadAll(unread.Body)
	require.Error(t, err, "the unread stream was reset")
}
