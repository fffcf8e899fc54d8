package api

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/sse"
	"github.com/devicecompanion/companion/internal/ssetest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store"
)

// sseEvent is one event of a stream as a client parses it.
type sseEvent struct{ id, event, data string }

func (e sseEvent) json(t testing.TB) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(e.data), &m), "data: %s", e.data)
	return m
}

// sseEventOf is ev as sseEvent.
func sseEventOf(ev sse.Event) sseEvent {
	return sseEvent{id: ev.ID, event: ev.Type, data: ev.Data}
}

// sseStream is a client's stream of GET /api/v1/events.
type sseStream struct{ *ssetest.Stream }

// sseOpen opens a stream over a real HTTP connection and checks it
// started; the test's end closes it.
func sseOpen(t testing.TB, client *http.Client, url, token string, header map[string]string) *sseStream {
	t.Helper()
	return &sseStream{ssetest.Open(t, client, sseRequest(t, url, token, header))}
}

func sseRequest(t testing.TB, url, token string, header map[string]string) *http.Request {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "text/event-stream")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	return req
}

// next returns the next event, or fails the test after a while.
func (s *sseStream) next(t testing.TB) sseEvent {
	t.Helper()
	ev, err := s.Next(10 * time.Second)
	require.NoError(t, err)
	return sseEventOf(ev)
}

// nextN returns the next n events.
func (s *sseStream) nextN(t testing.TB, n int) []sseEvent {
	t.Helper()
	out := make([]sseEvent, 0, n)
	for range n {
		out = append(out, s.next(t))
	}
	return out
}

// quiet fails the test if an event comes within d.
func (s *sseStream) quiet(t testing.TB, d time.Duration) {
	t.Helper()
	if ev, err := s.Next(d); err != ssetest.ErrTimeout {
		t.Fatalf("unexpected event %+v (%v)", ev, err)
	}
}

// eventsEnv is an API with an event hub over a real bbolt store.
type eventsEnv struct {
	*env
	hub *Events
}

func newEventsEnv(t testing.TB, opts EventsOptions, more ...envOption) *eventsEnv {
	t.Helper()
	return newEventsEnvOn(t, opts, func(db *store.DB) EventStore { return db }, more...)
}

// newEventsEnvOn is newEventsEnv with the hub reading the store through
// wrap.
func newEventsEnvOn(t testing.TB, opts EventsOptions, wrap func(*store.DB) EventStore, more ...envOption) *eventsEnv {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	opts.Store = wrap(db)
	opts.Logger = slog.New(slog.DiscardHandler)
	hub, err := NewEvents(opts)
	require.NoError(t, err)
	db.OnEvents(hub.Wake)
	e := newEnvWith(t, db, db, append(more, func(o *Options) { o.Events = hub })...)
	// Before the HTTP server's Close (registered earlier, run later).
	t.Cleanup(hub.Close)
	return &eventsEnv{env: e, hub: hub}
}

func (e *eventsEnv) stream(t testing.TB, token, query string, header map[string]string) *sseStream {
	t.Helper()
	return sseOpen(t, e.srv.Client(), e.srv.URL+"/api/v1/events"+query, token, header)
}

// refused asks for a stream that must be refused, and answers the
// refusal; a stream that opens instead fails the test at once, rather
// than being read until it ends.
func (e *eventsEnv) refused(t testing.TB, token, query string) resp {
	t.Helper()
	hr, err := http.NewRequestWithContext(t.Context(), "GET", e.srv.URL+"/api/v1/events"+query, nil)
	require.NoError(t, err)
	hr.Header.Set("Authorization", "Bearer "+token)
	res, err := e.srv.Client().Do(hr)
	require.NoError(t, err)
	defer res.Body.Close()
	require.NotEqual(t, http.StatusOK, res.StatusCode, "GET /api/v1/events%s opened a stream", query)
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

// push sends a text push through the API and returns the command's id.
func (e *eventsEnv) push(t testing.TB, token, dev string) string {
	t.Helper()
	r := e.do("POST", "/api/v1/devices/"+dev+"/push/text", token, map[string]any{"text": "hi"})
	require.Equal(t, 202, r.status, "%s", r.body)
	return r.json(t)["id"].(string)
}

func eventsOfCommand(t testing.TB, evs []sseEvent) []string {
	t.Helper()
	var out []string
	for _, ev := range evs {
		require.Equal(t, "command", ev.event)
		out = append(out, ev.json(t)["state"].(string))
	}
	return out
}

func TestEventsCommandStates(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	id := e.push(t, tok, "dev-1")
	e.cmds.set(t, id, companion.StateSent)
	e.cmds.set(t, id, companion.StateDelivered)
	_, err := e.db.UpdateCommand(t.Context(), id, func(c *companion.Command) error {
		p := 40
		c.State, c.Progress = companion.StateInProgress, &p
		return nil
	})
	require.NoError(t, err)
	e.cmds.set(t, id, companion.StateSucceeded)

	evs := s.nextN(t, 5)
	assert.Equal(t, []string{"queued", "sent", "delivered", "in_progress", "succeeded"}, eventsOfCommand(t, evs))
	for i, ev := range evs {
		require.NotEmpty(t, ev.id)
		if i > 0 {
			assert.Less(t, evs[i-1].id, ev.id, "ids rise")
		}
		m := ev.json(t)
		assert.Equal(t, id, m["id"])
		assert.Equal(t, "dev-1", m["device_id"])
		assert.Equal(t, "push.text", m["op"])
		assert.NotEmpty(t, m["at"])
	}
	assert.Equal(t, 40.0, evs[3].json(t)["progress"])
	assert.NotContains(t, evs[0].json(t), "progress")
}

func TestEventsResumeWithLastEventID(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	id := e.push(t, tok, "dev-1")
	first := s.next(t)
	s.Close()

	// Missed while away.
	e.cmds.set(t, id, companion.StateSent)
	id2 := e.push(t, tok, "dev-1")
	e.cmds.set(t, id, companion.StateSucceeded)

	for _, how := range resumeWays(first.id) {
		t.Run(how.name, func(t *testing.T) {
			s := e.stream(t, tok, how.query, how.header)
			evs := s.nextN(t, 3)
			assert.Equal(t, []string{"sent", "queued", "succeeded"}, eventsOfCommand(t, evs))
			assert.Equal(t, []any{id, id2, id}, []any{evs[0].json(t)["id"], evs[1].json(t)["id"], evs[2].json(t)["id"]})
			s.quiet(t, 100*time.Millisecond)
		})
	}
	// Then live, with nothing twice.
	s = e.stream(t, tok, "", map[string]string{"Last-Event-ID": first.id})
	evs := s.nextN(t, 3)
	id3 := e.push(t, tok, "dev-1")
	ev := s.next(t)
	assert.Equal(t, id3, ev.json(t)["id"])
	assert.Greater(t, ev.id, evs[2].id)
	s.quiet(t, 100*time.Millisecond)

	r := e.send(req{method: "GET", path: "/api/v1/events", token: tok, header: map[string]string{"Last-Event-ID": "nonsense"}})
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, CodeInvalidCursor, r.problem(t).Code)
	// An id net/url cannot read is no id, not a stream from now on.
	r = e.refused(t, tok, "?last_event_id=%zz")
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, CodeInvalidCursor, r.problem(t).Code)
}

func TestEventsDeviceStatusFilterAndIsolation(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	alice := e.bound("dev-a")
	e.provision("dev-a2", "code-a2", "sim-1")
	r := e.do("POST", "/api/v1/devices/register", alice, map[string]any{"device_id": "dev-a2", "claim_code": "code-a2"})
	require.Equal(t, 201, r.status, "%s", r.body)
	bob := e.bound("dev-b")

	all := e.stream(t, alice, "", nil)
	onlyA2 := e.stream(t, alice, "?device_id=dev-a2", nil)
	bobs := e.stream(t, bob, "", nil)

	e.report("dev-a", "1.0.0")
	e.report("dev-b", "1.0.0")
	e.report("dev-a2", "1.0.0", companion.App{AppID: "weather", Version: "1.0.0"})
	e.report("dev-a2", "1.0.0", companion.App{AppID: "weather", Version: "1.0.0"}) // the same: no event
	_, err := e.db.MarkBridgeOffline(t.Context(), "bridge-1")
	require.NoError(t, err)

	evs := all.nextN(t, 4)
	var got []string
	for _, ev := range evs {
		require.Equal(t, "device", ev.event)
		m := ev.json(t)
		got = append(got, fmt.Sprintf("%s %v", m["device_id"], m["online"]))
		assert.Equal(t, 80.0, m["battery"])
		assert.Equal(t, "1.0.0", m["firmware_version"])
		assert.NotNil(t, m["apps"])
		assert.NotEmpty(t, m["at"])
	}
	assert.ElementsMatch(t, []string{"dev-a true", "dev-a2 true", "dev-a false", "dev-a2 false"}, got)
	assert.Equal(t, []any{map[string]any{"app_id": "weather", "version": "1.0.0"}}, evs[1].json(t)["apps"])
	all.quiet(t, 100*time.Millisecond)

	for _, ev := range onlyA2.nextN(t, 2) {
		assert.Equal(t, "dev-a2", ev.json(t)["device_id"])
	}
	onlyA2.quiet(t, 100*time.Millisecond)
	for _, ev := range bobs.nextN(t, 2) {
		assert.Equal(t, "dev-b", ev.json(t)["device_id"], "bob sees only his device")
	}
	bobs.quiet(t, 100*time.Millisecond)

	for _, dev := range []string{"dev-b", "dev-404", "bad id"} {
		r := e.send(req{method: "GET", path: "/api/v1/events?device_id=" + strings.ReplaceAll(dev, " ", "%20"), token: alice})
		require.Equal(t, 404, r.status, "%s: %s", dev, r.body)
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
	}
	// A device id net/url cannot read is no device: never a stream of
	// every device.
	for _, query := range []string{"?device_id=dev-a%zz", "?device_id=dev-a;x"} {
		r := e.refused(t, alice, query)
		require.Equal(t, 404, r.status, "%s: %s", query, r.body)
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
	}
	r = e.send(req{method: "GET", path: "/api/v1/events"})
	assert.Equal(t, 401, r.status)
}

func TestEventsHeartbeat(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-s.Events():
			if ev.IsComment() && ev.Comment == "ping" {
				return
			}
		case <-timeout:
			t.Fatal("no heartbeat")
		}
	}
}

// sseSlowClient is an HTTP client whose connections take almost nothing
// into their receive buffers, so that a stream it never reads stops the
// server's writes after a few kilobytes.
func sseSlowClient() *http.Client {
	d := testenv.SmallWindow(2048)
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
}

// sseSmallBuffers gives each connection it accepts a small send buffer
// (which also stops the kernel from growing it).
type sseSmallBuffers struct{ net.Listener }

func (l sseSmallBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(4096)
	}
	return c, err
}

// A stream that is never read costs the others nothing: it is dropped
// once its buffer is full, ends, and resumes from its last id.
func TestEventsSlowReaderIsDropped(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Buffer: 64})
	tok := e.bound("dev-1")
	fast := e.stream(t, tok, "", nil)
	// The slow client's connection has small buffers on both ends, as
	// over a slow mobile link, so that the server's writes stop after a
	// few kilobytes rather than the megabytes loopback would take.
	slowSrv := httptest.NewUnstartedServer(e.api.Handler())
	slowSrv.Listener = sseSmallBuffers{slowSrv.Listener}
	slowSrv.Start()
	t.Cleanup(slowSrv.Close)
	t.Cleanup(e.hub.Close) // first: it ends the streams
	slow, err := sseSlowClient().Do(sseRequest(t, slowSrv.URL+"/api/v1/events", tok, nil))
	require.NoError(t, err)
	require.Equal(t, 200, slow.StatusCode)
	defer slow.Body.Close()

	// Events in bursts of 20 (a burst over a stream's buffer drops any
	// stream): the fast stream keeps up, the slow one is stuck.
	e.serve("dev-1")
	const n, burst = 600, 20
	var want []sseEvent
	start := time.Now()
	for i := 0; i < n; i += burst {
		var wg sync.WaitGroup
		for j := i; j < i+burst; j++ {
			wg.Add(1)
			battery := j % 101
			e.db.PutStatusAsync(companion.Status{DeviceID: "dev-1", Online: true, Battery: &battery, FirmwareVersion: strings.Repeat("1", 60),
				Model: "sim-1", BridgeID: "bridge-1", LastSeen: time.Now(), Seq: uint64(j + 1)}, func(bool, error) { wg.Done() })
		}
		wg.Wait()
		want = append(want, fast.nextN(t, burst)...)
	}
	// Other requests too.
	r := e.do("GET", "/api/v1/devices", tok, nil)
	require.Equal(t, 200, r.status)
	assert.Less(t, time.Since(start), 20*time.Second)
	testenv.Eventually(t, 10*time.Second, "the slow stream dropped", func() bool { return e.hub.Dropped() > 0 })

	// The slow stream, read now, ends after some of the events, in order.
	s := ssetest.Read(t, slow)
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the dropped stream did not end")
	}
	var got []sseEvent
	for ev := range s.Events() {
		if !ev.IsComment() {
			got = append(got, sseEventOf(ev.Event))
		}
	}
	require.NotEmpty(t, got, "the slow stream had some events before it fell behind")
	require.Less(t, len(got), n, "the slow stream was cut short")
	assert.Equal(t, sseIDs(want[:len(got)]), sseIDs(got))

	// It resumes with its last id, and gets exactly the rest.
	again := e.stream(t, tok, "", map[string]string{"Last-Event-ID": got[len(got)-1].id})
	rest := again.nextN(t, n-len(got))
	assert.Equal(t, sseIDs(want[len(got):]), sseIDs(rest))
	again.quiet(t, 100*time.Millisecond)
}

func sseIDs(evs []sseEvent) []string {
	out := make([]string, 0, len(evs))
	for _, ev := range evs {
		out = append(out, ev.id)
	}
	return out
}

// Closing the hub ends every stream, so that the HTTP server can shut
// down.
func TestEventsHubCloseEndsStreams(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	e.hub.Close()
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stream did not end")
	}
	r := e.send(req{method: "GET", path: "/api/v1/events", token: tok})
	assert.Equal(t, 503, r.status)
}

// A stream that starts from now carries its starting point as an id
// before any event: a client that loses it before an event came resumes
// from there and misses nothing.
func TestEventsFreshStreamCanResume(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	var last string
	for ev := range s.Events() { // the first heartbeat follows the id
		if ev.IsComment() {
			last = ev.ID
			break
		}
	}
	require.NotEmpty(t, last, "the stream's last event id before any event")
	s.Close()

	id := e.push(t, tok, "dev-1") // while away
	s = e.stream(t, tok, "", map[string]string{"Last-Event-ID": last})
	ev := s.next(t)
	assert.Equal(t, id, ev.json(t)["id"], "the event missed while away")
	assert.Equal(t, "queued", ev.json(t)["state"])
}

// A Last-Event-ID past every id the store has assigned, kept across a
// reset of the store, resumes from the log's start, then live, instead of
// waiting in silence for the log to pass it.
func TestEventsResumePastTheEnd(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	tok := e.bound("dev-1")
	const kept = "00000000000003e8" // the store's log is far shorter

	// Nothing in the log for the user yet: the stream says where it
	// starts, as a stream without an id does, then carries what comes.
	s := e.stream(t, tok, "", map[string]string{"Last-Event-ID": kept})
	var start, reset string
	for ev := range s.Events() { // the reset, then the first heartbeat, follow the id
		if !ev.IsComment() {
			assert.Equal(t, "reset", ev.Type)
			reset = ev.ID
		}
		if ev.IsComment() {
			start = ev.ID
			break
		}
	}
	assert.NotEmpty(t, start, "the stream's starting point")
	assert.NotEqual(t, kept, start, "the stream's starting point")
	assert.Equal(t, start, reset, "the reset's id: the stream's starting point")
	id := e.push(t, tok, "dev-1")
	ev := s.next(t)
	assert.Equal(t, id, ev.json(t)["id"])
	assert.Equal(t, "queued", ev.json(t)["state"])
	s.Close()

	// With events in the log: all of them, then live, nothing twice. The
	// stream starts without an id, so that a client that loses it before
	// the first event keeps its own, which still reads the log's start.
	e.cmds.set(t, id, companion.StateSent)
	res, err := e.srv.Client().Do(sseRequest(t, e.srv.URL+"/api/v1/events", tok, map[string]string{"Last-Event-ID": kept}))
	require.NoError(t, err)
	require.Equal(t, 200, res.StatusCode)
	r := bufio.NewReader(res.Body)
	first, err := r.ReadString('\n')
	require.NoError(t, err)
	second, err := r.ReadString('\n')
	res.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, []string{"retry: 2000\n", "\n"}, []string{first, second}, "the stream's first lines")
	for _, how := range resumeWays(kept) {
		t.Run(how.name, func(t *testing.T) {
			log, _, err := e.db.Events(t.Context(), "", "", 100)
			require.NoError(t, err)
			require.GreaterOrEqual(t, len(log), 2)
			s := e.stream(t, tok, how.query, how.header)
			// The client is told it missed events, before the replay
			// (docs/reliability.md, bug 274).
			reset := s.next(t)
			assert.Equal(t, "reset", reset.event)
			assert.Equal(t, map[string]any{"reason": "unknown_id"}, reset.json(t))
			evs := s.nextN(t, len(log))
			assert.Equal(t, []string{"queued", "sent"}, eventsOfCommand(t, evs[:2]))
			var want []string
			for _, ev := range log {
				want = append(want, ev.ID)
			}
			assert.Equal(t, want, sseIDs(evs), "the log's events")
			id2 := e.push(t, tok, "dev-1")
			ev := s.next(t)
			assert.Equal(t, id2, ev.json(t)["id"])
			assert.Equal(t, "queued", ev.json(t)["state"])
			assert.Greater(t, ev.id, evs[len(evs)-1].id)
			s.quiet(t, 100*time.Millisecond)
		})
	}
}

// The hub encodes each event once and hands the same bytes to every
// stream that wants it: each stream still gets only its own events, each
// with its own id, the same as a stream that reads them from the log
// (resuming with Last-Event-ID), and resumes after the last it got.
func TestEventsSharedAcrossStreams(t *testing.T) {
	var hub gatedEvents
	e := newEventsEnvOn(t, EventsOptions{}, func(db *store.DB) EventStore { hub.EventStore = db; return &hub })
	alice := e.bound("dev-a")
	e.provision("dev-a2", "code-a2", "sim-1")
	r := e.do("POST", "/api/v1/devices/register", alice, map[string]any{"device_id": "dev-a2", "claim_code": "code-a2"})
	require.Equal(t, 201, r.status, "%s", r.body)
	bob := e.bound("dev-b")

	all := e.stream(t, alice, "", nil)
	all2 := e.stream(t, alice, "", nil)
	onlyA := e.stream(t, alice, "?device_id=dev-a", nil)
	onlyA2 := e.stream(t, alice, "?device_id=dev-a2", nil)
	bobs := e.stream(t, bob, "", nil)

	// The hub reads the five events in one read, and encodes them in
	// turn before any stream writes one.
	hub.Lock()
	a1 := e.push(t, alice, "dev-a")
	b1 := e.push(t, bob, "dev-b")
	a21 := e.push(t, alice, "dev-a2")
	e.report("dev-a2", "1.0.0")
	e.cmds.set(t, a1, companion.StateSent)
	hub.Unlock()

	evs := all.nextN(t, 4)
	assert.Equal(t, evs, all2.nextN(t, 4), "two streams of every device")
	var ofA, ofA2 []sseEvent
	for i, ev := range evs {
		if i > 0 {
			assert.Less(t, evs[i-1].id, ev.id, "ids rise")
		}
		switch ev.json(t)["device_id"] {
		case "dev-a":
			ofA = append(ofA, ev)
		case "dev-a2":
			ofA2 = append(ofA2, ev)
		default:
			t.Errorf("alice's stream has %+v", ev)
		}
	}
	require.Len(t, ofA, 2)
	require.Len(t, ofA2, 2)
	assert.Equal(t, []any{a1, a1}, []any{ofA[0].json(t)["id"], ofA[1].json(t)["id"]})
	assert.Equal(t, []any{a21, "dev-a2"}, []any{ofA2[0].json(t)["id"], ofA2[1].json(t)["device_id"]})
	assert.Equal(t, ofA, onlyA.nextN(t, 2), "dev-a's stream")
	assert.Equal(t, ofA2, onlyA2.nextN(t, 2), "dev-a2's stream")
	bev := bobs.next(t)
	assert.Equal(t, b1, bev.json(t)["id"], "bob's stream")
	for _, s := range []*sseStream{all, all2, onlyA, onlyA2, bobs} {
		s.quiet(t, 50*time.Millisecond)
	}

	// The log's copy of each event, read by a resuming stream, is the
	// bytes the hub handed out live.
	back := e.stream(t, alice, "", map[string]string{"Last-Event-ID": evs[0].id})
	assert.Equal(t, evs[1:], back.nextN(t, 3), "resumed after the first")
	back.quiet(t, 50*time.Millisecond)

	// dev-a's stream, lost after its first event, resumes with dev-a's
	// events only, then live.
	onlyA.Close()
	resumed := e.stream(t, alice, "?device_id=dev-a", map[string]string{"Last-Event-ID": ofA[0].id})
	assert.Equal(t, ofA[1:], resumed.nextN(t, 1))
	e.cmds.set(t, a21, companion.StateSent)
	e.cmds.set(t, a1, companion.StateDelivered)
	ev := resumed.next(t)
	assert.Equal(t, []any{a1, "delivered"}, []any{ev.json(t)["id"], ev.json(t)["state"]})
	assert.Greater(t, ev.id, ofA[1].id)
	resumed.quiet(t, 50*time.Millisecond)
	live := all.nextN(t, 2)
	assert.Equal(t, live, all2.nextN(t, 2))
	assert.Equal(t, live[1], ev, "the same event on both streams")
}

// gatedEvents holds the hub's reads of the log (those of every user's
// events) while it is locked; the streams' own reads go through.
type gatedEvents struct {
	EventStore
	sync.Mutex
}

func (g *gatedEvents) Events(ctx context.Context, userID, after string, limit int) ([]companion.Event, string, error) {
	if userID == "" {
		g.Lock()
		defer g.Unlock()
	}
	return g.EventStore.Events(ctx, userID, after, limit)
}

// TestEventsParameterGivenTwice asks for the stream of two devices at
// once, and after two ids: each is a 422 naming the parameter, as the
// lists answer a filter given twice. The stream opened, of the first
// device alone, without the fix.
func TestEventsParameterGivenTwice(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	for _, tc := range []struct{ query, field string }{
		{"?device_id=dev-1&device_id=dev-2", "device_id"},
		{"?last_event_id=00000000000000000001&last_event_id=00000000000000000002", "last_event_id"},
	} {
		r := e.refused(t, tok, tc.query)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%s: %s", tc.query, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code, tc.query)
		assert.Equal(t, []FieldError{{Field: tc.field, Message: "must be given once"}}, p.Errors, tc.query)
	}
	// The same value twice is one value, as on the lists.
	s := e.stream(t, tok, "?device_id=dev-1&device_id=dev-1", nil)
	e.push(t, tok, "dev-1")
	assert.Equal(t, "command", s.next(t).event)
}

// TestEventsLastEventIDGivenTwice: a Last-Event-ID header sent twice
// with different values is a 422 naming it, as the query given twice is,
// and the query is refused so even beside a header. Without the fix the
// stream opened after the first header's id (bug 368). The header and the
// query together are not twice: the header wins, as EventSource sends it
// when it reconnects to the URL it opened with ?last_event_id=.
func TestEventsLastEventIDGivenTwice(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	e.push(t, tok, "dev-1")
	first := s.next(t)
	second := e.push(t, tok, "dev-1")
	require.Equal(t, second, s.next(t).json(t)["id"])
	s.Close()

	for _, tc := range []struct {
		name    string
		query   string
		headers []string
		field   string
	}{
		{"header twice", "", []string{first.id, "00000000000000000000"}, "Last-Event-ID"},
		{"query twice beside a header", "?last_event_id=" + first.id + "&last_event_id=00000000000000000000", []string{first.id}, "last_event_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hr := sseRequest(t, e.srv.URL+"/api/v1/events"+tc.query, tok, nil)
			for _, h := range tc.headers {
				hr.Header.Add("Last-Event-ID", h)
			}
			res, err := e.srv.Client().Do(hr.WithContext(t.Context()))
			require.NoError(t, err)
			defer res.Body.Close()
			require.NotEqual(t, http.StatusOK, res.StatusCode, "a stream opened")
			b, err := io.ReadAll(res.Body)
			require.NoError(t, err)
			require.Equal(t, http.StatusUnprocessableEntity, res.StatusCode, "%s", b)
			p := resp{status: res.StatusCode, header: res.Header, body: b}.problem(t)
			assert.Equal(t, CodeValidationFailed, p.Code)
			assert.Equal(t, []FieldError{{Field: tc.field, Message: "must be given once"}}, p.Errors)
		})
	}
	// The same value twice is one value.
	hr := sseRequest(t, e.srv.URL+"/api/v1/events", tok, nil)
	hr.Header.Add("Last-Event-ID", first.id)
	hr.Header.Add("Last-Event-ID", first.id)
	again := &sseStream{ssetest.Open(t, e.srv.Client(), hr)}
	assert.Equal(t, second, again.next(t).json(t)["id"], "resumed after the id sent twice")
	again.Close()
	// The header wins over the query: resumed after first, not from the start.
	s = e.stream(t, tok, "?last_event_id=00000000000000000000", map[string]string{"Last-Event-ID": first.id})
	assert.Equal(t, second, s.next(t).json(t)["id"], "resumed after the header's id")
}

// timedAnswers passes on every answered request with the time the
// RequestObserver is told it took.
type timedAnswers chan timedAnswer

type timedAnswer struct {
	answered
	took time.Duration
}

func (a timedAnswers) Request(method, route string, status int, took time.Duration) {
	select {
	case a <- timedAnswer{answered{method, route, status}, took}:
	default:
	}
}

// An event stream is counted, for the metrics, with the time it took to
// begin, not with how long the client kept it: open streams landed in the
// top bucket of the request duration histogram, and made its quantiles
// meaningless (docs/reliability.md, bug 273). The time told is at most
// what the client saw from sending the request to having the stream's
// headers, whatever the stream's length.
func TestEventsRequestTimeIsTheStreamStart(t *testing.T) {
	seen := make(timedAnswers, 64)
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond}, func(o *Options) { o.Requests = seen })
	tok := e.bound("dev-1")
	for len(seen) > 0 {
		<-seen
	}

	sent := time.Now()
	s := e.stream(t, tok, "", nil)
	begun := time.Since(sent)
	// The stream stays open for heartbeats, then the client leaves.
	pings := 0
	timeout := time.After(10 * time.Second)
	for pings < 3 {
		select {
		case ev := <-s.Events():
			if ev.IsComment() && ev.Comment == "ping" {
				pings++
			}
		case <-timeout:
			t.Fatal("no heartbeat")
		}
	}
	s.Close()

	timeout = time.After(10 * time.Second)
	for {
		select {
		case got := <-seen:
			if got.route != "/api/v1/events" {
				continue
			}
			assert.Equal(t, answered{"GET", "/api/v1/events", 200}, got.answered)
			assert.LessOrEqual(t, got.took, begun, "the stream's time: its start, not its length")
			return
		case <-timeout:
			t.Fatal("the stream's end was not observed")
		}
	}
}

// A Last-Event-ID older than the log keeps (events after it purged) starts
// the stream with an event "reset", then the replay of what the log holds:
// the client knows it missed events and reads the state again. Without it
// the replay came alone, and the gap went unseen (docs/reliability.md,
// bug 274). An id the log still covers resumes with no reset.
func TestEventsResumeAfterPurgeSaysReset(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	s := e.stream(t, tok, "", nil)
	e.push(t, tok, "dev-1")
	first := s.next(t)
	s.Close()
	missed := e.push(t, tok, "dev-1")
	_ = missed

	// Nothing purged yet: a resume, no reset.
	s = e.stream(t, tok, "", map[string]string{"Last-Event-ID": first.id})
	ev := s.next(t)
	assert.Equal(t, []any{"command", missed}, []any{ev.event, ev.json(t)["id"]})
	s.Close()

	// Every event purged (as two hours later), then a new one.
	n, err := e.db.PurgeEvents(t.Context(), time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.GreaterOrEqual(t, n, 2)
	after := e.push(t, tok, "dev-1")
	for _, how := range resumeWays(first.id) {
		t.Run(how.name, func(t *testing.T) {
			s := e.stream(t, tok, how.query, how.header)
			ev := s.next(t)
			require.Equal(t, "reset", ev.event, "the first event: %+v", ev)
			assert.Equal(t, map[string]any{"reason": "expired"}, ev.json(t))
			ev = s.next(t)
			assert.Equal(t, []any{"command", after}, []any{ev.event, ev.json(t)["id"]})
			s.quiet(t, 100*time.Millisecond)
		})
	}
	// A client resumed after the purge, from an id the log covers: no
	// reset.
	log, _, err := e.db.Events(t.Context(), "", "", 100)
	require.NoError(t, err)
	require.NotEmpty(t, log)
	last := log[len(log)-1].ID
	s = e.stream(t, tok, "", map[string]string{"Last-Event-ID": last})
	id := e.push(t, tok, "dev-1")
	ev = s.next(t)
	assert.Equal(t, []any{"command", id}, []any{ev.event, ev.json(t)["id"]})
}

// A stream of one device ends once the device is no longer the caller's,
// and the client's reconnection is a 404 device_not_found; a stream of
// another of the caller's devices, and one of all of them, stay. Without
// the fix the stream stayed open, pings only, for as long as the client
// kept it (docs/reliability.md, bug 275).
func TestEventsStreamOfUnboundDeviceEnds(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	tok := e.bound("dev-1")
	e.provision("dev-2", "code-dev-2", "sim-1")
	r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "dev-2", "claim_code": "code-dev-2"})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)

	one := e.stream(t, tok, "?device_id=dev-1", nil)
	other := e.stream(t, tok, "?device_id=dev-2", nil)
	all := e.stream(t, tok, "", nil)
	r = e.do("DELETE", "/api/v1/devices/dev-1", tok, nil)
	require.Equal(t, http.StatusNoContent, r.status, "%s", r.body)

	select {
	case <-one.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stream of the unbound device is still open")
	}
	r = e.refused(t, tok, "?device_id=dev-1")
	assert.Equal(t, http.StatusNotFound, r.status, "%s", r.body)
	assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)

	id := e.push(t, tok, "dev-2")
	for _, s := range []*sseStream{other, all} {
		ev := s.next(t)
		assert.Equal(t, id, ev.json(t)["id"])
	}
}

// A stream opened with an identity provider's access token ends once the
// token has expired, as a new request with it is a 401. Without the fix
// the stream stayed open past the token's exp (docs/reliability.md, bug
// 275).
func TestEventsStreamEndsWhenAccessTokenExpires(t *testing.T) {
	p := newIDP(t)
	const issuer, audience = "https://idp.example", "companion-api"
	var skew atomic.Int64 // how far the verifier's clock is ahead
	v, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: issuer, Audience: audience, JWKSURL: p.server.URL,
		Now: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }})
	require.NoError(t, err)
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond}, func(o *Options) { o.Tokens = v })
	now := time.Now()
	tok := sign(t, p.key, "k1", map[string]any{"iss": issuer, "aud": audience, "sub": "alice@idp", "exp": now.Add(time.Hour).Unix(), "iat": now.Unix()})

	s := e.stream(t, tok, "", nil)
	pings := 0
	for ev := range s.Events() { // alive, token valid
		if ev.IsComment() && ev.Comment == "ping" {
			if pings++; pings == 2 {
				break
			}
		}
	}
	skew.Store(int64(2 * time.Hour))
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stream is still open after its access token expired")
	}
	r := e.refused(t, tok, "")
	assert.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)
}

// resumeWay is a way a client names the last event it had: the
// Last-Event-ID header, or the last_event_id query parameter.
type resumeWay struct {
	name   string
	query  string
	header map[string]string
}

// resumeWays are the ways to resume after the event id.
func resumeWays(id string) []resumeWay {
	return []resumeWay{
		{"header", "", map[string]string{"Last-Event-ID": id}},
		{"query", "?last_event_id=" + id, nil},
	}
}

// A stream opened with a user's API token ends once the operator gives
// the user a new token (POST /api/v1/admin/users/{id}/token), as a new
// request with the old one is a 401; a stream with the new token stays.
func TestEventsStreamEndsWhenAPITokenIsReplaced(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	r := e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "carol"})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	id, old := r.json(t)["user_id"].(string), r.json(t)["token"].(string)
	s := e.stream(t, old, "", nil)

	r = e.do("POST", "/api/v1/admin/users/"+id+"/token", testAdminToken, nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	tok := r.json(t)["token"].(string)
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the stream of the replaced token is still open")
	}
	r = e.refused(t, old, "")
	assert.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)

	s = e.stream(t, tok, "", nil)
	s.quiet(t, 200*time.Millisecond) // ten heartbeats
	select {
	case <-s.Done():
		t.Fatal("the stream of the new token ended")
	default:
	}
}

// A stream that gets no event for a while (a device of the caller's that
// is quiet while the caller's others are busy, or a caller whose devices
// are all quiet while other users' are busy) keeps its client's last
// event id current: its heartbeat carries the place it has reached. The
// client that loses it later resumes from there, not from the last event
// it got hours ago: no reset for events it never missed, once the log has
// purged other devices' events, and no replay of every event of the
// caller's other devices to find its device's. Without the fix the
// heartbeat was a comment only (docs/reliability.md, bug 366).
func TestEventsQuietStreamKeepsItsPlace(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{Heartbeat: 20 * time.Millisecond})
	alice := e.bound("dev-1")
	e.provision("dev-2", "code-dev-2", "sim-1")
	r := e.do("POST", "/api/v1/devices/register", alice, map[string]any{"device_id": "dev-2", "claim_code": "code-dev-2"})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	bob := e.bound("dev-b")

	ways := []struct {
		name, query, token string
	}{
		{"a quiet device of a busy user", "?device_id=dev-1", alice},
		{"a quiet user", "", bob},
	}
	var streams []*sseStream
	for _, w := range ways {
		streams = append(streams, e.stream(t, w.token, w.query, nil))
	}
	for range 3 {
		e.push(t, alice, "dev-2")
	}
	log, _, err := e.db.Events(t.Context(), "", "", 100)
	require.NoError(t, err)
	require.Len(t, log, 3)
	busy := log[len(log)-1].ID

	lasts := make([]string, len(ways))
	for i, w := range ways {
		t.Run(w.name, func(t *testing.T) {
			s := streams[i]
			// The client's last event id, as its heartbeats leave it.
			defer s.Close()
			timeout := time.After(10 * time.Second)
			for lasts[i] < busy {
				select {
				case ev, ok := <-s.Events():
					require.True(t, ok, "the stream ended")
					require.True(t, ev.IsComment(), "an event of dev-2 on the stream: %+v", ev)
					lasts[i] = ev.ID
				case <-timeout:
					t.Fatalf("the client's last event id is %q, before the events of dev-2 (%q) its stream has passed", lasts[i], busy)
				}
			}
		})
	}

	// Two hours later every event has been purged; the clients resume.
	n, err := e.db.PurgeEvents(t.Context(), time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.Equal(t, 3, n, "events purged")
	for i, w := range ways {
		t.Run(w.name+" resumes", func(t *testing.T) {
			s := e.stream(t, w.token, w.query, map[string]string{"Last-Event-ID": lasts[i]})
			dev := "dev-1"
			if w.token == bob {
				dev = "dev-b"
			}
			id := e.push(t, w.token, dev)
			ev := s.next(t)
			assert.Equal(t, []any{"command", id}, []any{ev.event, ev.json(t)["id"]}, "the first event of the resumed stream: %+v", ev)
		})
	}
}

// A stream's headers tell a proxy or CDN that compresses what it passes
// on not to transform it (RFC 9111 §5.2.2.6: no-transform), as it would
// otherwise hold the stream's events in its compressor's buffer; and
// nginx not to buffer it. GET and HEAD alike (docs/reliability.md,
// bug 507).
func TestEventsStreamHeadersForbidProxyTransforms(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	for _, method := range []string{"GET", "HEAD"} {
		req, err := http.NewRequestWithContext(t.Context(), method, e.srv.URL+"/api/v1/events", nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Accept", "text/event-stream")
		req.Header.Set("Accept-Encoding", "gzip")
		res, err := e.srv.Client().Do(req)
		require.NoError(t, err)
		res.Body.Close()
		require.Equal(t, http.StatusOK, res.StatusCode, method)
		checkProxyHeaders(t, method, res.Header)
	}
}

func checkProxyHeaders(t *testing.T, method string, h http.Header) {
	t.Helper()
	cc := strings.Split(strings.ReplaceAll(h.Get("Cache-Control"), " ", ""), ",")
	assert.Contains(t, cc, "no-store", "%s: Cache-Control %q", method, h.Get("Cache-Control"))
	assert.Contains(t, cc, "no-transform", "%s: Cache-Control %q lets a compressing proxy hold the stream's events", method, h.Get("Cache-Control"))
	assert.Equal(t, "no", h.Get("X-Accel-Buffering"), method)
	assert.Empty(t, h.Get("Content-Encoding"), method)
}

// The Last-Event-ID that api/openapi.json gives as its example (what an
// API explorer's "Try it" and a generated client's documentation send)
// resumes a stream, and the ids of its example stream are ids this store
// hands out: the example had 20 digits, a 422 invalid_cursor on either
// store (docs/reliability.md, bug 508).
func TestEventsOpenAPIExampleIDsResume(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	var doc map[string]any
	require.NoError(t, json.Unmarshal(openapiJSON, &doc))
	item := doc["paths"].(map[string]any)["/api/v1/events"].(map[string]any)
	var ids []string
	for _, method := range []string{"get", "head"} {
		for _, p := range item[method].(map[string]any)["parameters"].([]any) {
			if p := p.(map[string]any); p["name"] == "Last-Event-ID" {
				ids = append(ids, p["example"].(string))
			}
		}
	}
	stream := item["get"].(map[string]any)["responses"].(map[string]any)["200"].(map[string]any)["content"].(map[string]any)["text/event-stream"].(map[string]any)["example"].(string)
	for _, line := range strings.Split(stream, "\n") {
		if id, ok := strings.CutPrefix(line, "id: "); ok {
			ids = append(ids, id)
		}
	}
	require.Len(t, ids, 4)
	e.push(t, tok, "dev-1")
	for _, id := range ids {
		req := sseRequest(t, e.srv.URL+"/api/v1/events", tok, map[string]string{"Last-Event-ID": id})
		res, err := e.srv.Client().Do(req.WithContext(t.Context()))
		require.NoError(t, err)
		res.Body.Close()
		assert.Equal(t, http.StatusOK, res.StatusCode, "api/openapi.json's example id %q is refused", id)
	}
}
