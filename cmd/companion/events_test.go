package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/sse"
	"github.com/devicecompanion/companion/internal/ssetest"
)

// sseEvent is an event of GET /api/v1/events as a plain client parses it;
// a comment (": ping") has only comment set.
type sseEvent struct {
	id, event string
	data      map[string]any
	comment   string
}

// sseEventOf is ev as sseEvent, its data parsed as JSON.
func sseEventOf(ev sse.Event) sseEvent {
	out := sseEvent{id: ev.ID, event: ev.Type}
	if err := json.Unmarshal([]byte(ev.Data), &out.data); err != nil {
		out.data = map[string]any{"unparsable": ev.Data}
	}
	return out
}

// sseStream is a live stream of GET /api/v1/events over HTTP.
type sseStream struct {
	*ssetest.Stream
	tb testing.TB
}

// sseOpen opens GET /api/v1/events (query and headers as given, in pairs)
// as c's user; the test's end closes it.
func sseOpen(tb testing.TB, c *client, query string, headers ...string) *sseStream {
	tb.Helper()
	req, err := http.NewRequest("GET", c.base+"/api/v1/events"+query, nil)
	require.NoError(tb, err)
	req.Header.Set("Authorization", "Bearer "+c.token)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	hc := c.hc
	if hc == nil {
		hc = http.DefaultClient
	}
	return &sseStream{Stream: ssetest.Open(tb, hc, req), tb: tb}
}

// until returns the events (comments left out) up to and including the
// first for which stop holds, failing the test after a while.
func (s *sseStream) until(stop func(sseEvent) bool) []sseEvent {
	s.tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var out []sseEvent
	for {
		ev, err := s.Next(time.Until(deadline))
		require.NoError(s.tb, err, "had %d events", len(out))
		out = append(out, sseEventOf(ev))
		if stop(out[len(out)-1]) {
			return out
		}
	}
}

// drain returns what arrived so far, comments included.
func (s *sseStream) drain() []sseEvent {
	var out []sseEvent
	for {
		select {
		case ev, ok := <-s.Events():
			if !ok {
				return out
			}
			if ev.IsComment() {
				out = append(out, sseEvent{comment: ev.Comment})
			} else {
				out = append(out, sseEventOf(ev.Event))
			}
		default:
			return out
		}
	}
}

// sseFinalOf is a stop of until: the final event of command id.
func sseFinalOf(id string) func(sseEvent) bool {
	return func(ev sseEvent) bool {
		return ev.event == "command" && ev.data["id"] == id && companion.IsFinal(ev.data["state"].(string))
	}
}

// sseDeviceOnline is a stop of until: a device event of dev with online.
func sseDeviceOnline(dev string, online bool) func(sseEvent) bool {
	return func(ev sseEvent) bool {
		return ev.event == "device" && ev.data["device_id"] == dev && ev.data["online"] == online
	}
}

// sseBackOnline is a stop of until: dev online again after offline.
func sseBackOnline(dev string) func(sseEvent) bool {
	wentOffline := false
	return func(ev sseEvent) bool {
		if ev.event != "device" || ev.data["device_id"] != dev {
			return false
		}
		if ev.data["online"] == false {
			wentOffline = true
		}
		return wentOffline && ev.data["online"] == true
	}
}

// sseCommandStates returns the states of command id among evs, checking
// that every event's id rises.
func sseCommandStates(tb testing.TB, evs []sseEvent, id string) []string {
	tb.Helper()
	var out []string
	for i, ev := range evs {
		if i > 0 {
			require.Less(tb, evs[i-1].id, ev.id, "event ids rise")
		}
		if ev.event == "command" && ev.data["id"] == id {
			out = append(out, ev.data["state"].(string))
		}
	}
	return out
}

// sseInStateOrder checks a command's states as its events told them:
// queued first, succeeded last, each later in the lifecycle than the one
// before. (The broker stores no sent or delivered that a quick reply
// overtook: events tell the changes the store made.)
func sseInStateOrder(tb testing.TB, states []string) {
	tb.Helper()
	require.NotEmpty(tb, states)
	assert.Equal(tb, companion.StateQueued, states[0], "states %v", states)
	assert.Equal(tb, companion.StateSucceeded, states[len(states)-1], "states %v", states)
	for i := 1; i < len(states); i++ {
		assert.Less(tb, companion.Rank(states[i-1]), companion.Rank(states[i]), "states %v", states)
	}
}

func sseIDs(evs []sseEvent) []string {
	out := []string{}
	for _, ev := range evs {
		out = append(out, ev.id)
	}
	return out
}

// eventsRegister binds the devices to the fleet's user.
func eventsRegister(tb testing.TB, f *fleet, devs ...string) {
	tb.Helper()
	for _, dev := range devs {
		r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": f.claims[dev]})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
	}
}

// The real server, the real bridge with simulated devices, and plain HTTP
// clients reading the stream: command events in state order with ids; a
// reconnection with Last-Event-ID gets exactly what it missed; device
// events when the bridge goes and comes back; the device filter; another
// user sees nothing; the heartbeat.
func TestEventsSSEEndToEnd(t *testing.T) {
	m := startServer(t, Config{Events: api.EventsOptions{Heartbeat: 100 * time.Millisecond}})
	f := setupFleet(t, m, "dev-1", "dev-2")
	b := startBridge(t, m, m.MQTTURL(), f, "", "dev-1", "dev-2")
	eventsRegister(t, f, "dev-1", "dev-2")

	r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "mallory"})
	require.Equal(t, 201, r.Status)
	mallory := newClient(t, m, r.JSON(t)["token"].(string))
	theirs := sseOpen(t, mallory, "")
	assert.Equal(t, 404, mallory.do("GET", "/api/v1/events?device_id=dev-1", nil).Status)

	witness := sseOpen(t, f.user, "") // connected throughout
	onlyDev2 := sseOpen(t, f.user, "?device_id=dev-2")
	s := sseOpen(t, f.user, "")

	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "one"})
	id := cmd["id"].(string)
	evs := s.until(sseFinalOf(id))
	sseInStateOrder(t, sseCommandStates(t, evs, id))
	for _, ev := range evs {
		if ev.event == "command" {
			assert.Equal(t, "dev-1", ev.data["device_id"])
			assert.Equal(t, "push.text", ev.data["op"])
			assert.NotEmpty(t, ev.data["at"])
		}
	}
	last := evs[len(evs)-1].id
	s.Close()

	// Missed while disconnected.
	cmd2 := f.user.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "two"})
	id2 := cmd2["id"].(string)
	f.user.waitFinal("dev-2", id2)
	seen := witness.until(sseFinalOf(id2))

	again := sseOpen(t, f.user, "", "Last-Event-ID", last)
	resumed := again.until(sseFinalOf(id2))
	sseInStateOrder(t, sseCommandStates(t, resumed, id2))
	var missed []sseEvent
	for _, ev := range seen {
		if ev.id > last {
			missed = append(missed, ev)
		}
	}
	assert.Equal(t, sseIDs(missed), sseIDs(resumed), "exactly the events missed: no gap, none twice")

	// The bridge goes: its devices go offline; it comes back: online.
	b.stop()
	witness.until(sseDeviceOnline("dev-1", false))
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1", "dev-2")
	witness.until(sseDeviceOnline("dev-1", true))
	again.until(sseBackOnline("dev-2"))
	filtered := onlyDev2.until(sseBackOnline("dev-2"))
	var sawOffline bool
	for _, ev := range filtered {
		assert.Equal(t, "dev-2", ev.data["device_id"], "the filter keeps dev-2's events only")
		if ev.event == "device" {
			for _, k := range []string{"online", "battery", "firmware_version", "apps", "at"} {
				assert.Contains(t, ev.data, k)
			}
			sawOffline = sawOffline || ev.data["online"] == false
		}
	}
	assert.True(t, sawOffline, "dev-2 went offline with its bridge")
	sseInStateOrder(t, sseCommandStates(t, filtered, id2))

	// Mallory saw nothing but heartbeats.
	var pings int
	for _, ev := range theirs.drain() {
		require.Empty(t, ev.id, "another user's event reached mallory: %+v", ev)
		if ev.comment == "ping" {
			pings++
		}
	}
	assert.Positive(t, pings, "heartbeats")
}

// Two replicas on one PostgreSQL store: a stream on replica 2 sees the
// command accepted on replica 1 and answered (whichever replica took the
// reply in), and a stream resumes on replica 1 from replica 2's ids.
func TestEventsSSETwoReplicas(t *testing.T) {
	t.Parallel()
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	var out, errOut bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"migrate", "--store", dsn}, &out, &errOut), "%s", errOut.String())
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m1 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r1"}, mq)
	m2 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r2"}, mq)

	f := setupFleet(t, m1, "dev-1")
	startBridge(t, m1, mq.URL, f, "", "dev-1")
	eventsRegister(t, f, "dev-1")
	on1 := f.user
	on2 := newClient(t, m2, f.user.token)

	s2 := sseOpen(t, on2, "")
	cmd := on1.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "via r1"})
	id := cmd["id"].(string)
	evs := s2.until(sseFinalOf(id))
	sseInStateOrder(t, sseCommandStates(t, evs, id))
	last := evs[len(evs)-1].id
	s2.Close()

	cmd2 := on2.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "via r2"})
	id2 := cmd2["id"].(string)
	on1.waitFinal("dev-1", id2)
	s1 := sseOpen(t, on1, "", "Last-Event-ID", last)
	resumed := s1.until(sseFinalOf(id2))
	sseInStateOrder(t, sseCommandStates(t, resumed, id2))
	for _, ev := range resumed {
		assert.Greater(t, ev.id, last)
		assert.NotEqual(t, id, ev.data["id"], "nothing from before the resume")
	}
}
