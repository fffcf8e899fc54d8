package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
)

// subscribeRecorder is a slog.Handler that keeps the message of every
// record and hands each to next when next takes its level.
type subscribeRecorder struct {
	next slog.Handler
	mu   *sync.Mutex
	msgs *[]string
}

func newSubscribeRecorder(next slog.Handler) subscribeRecorder {
	return subscribeRecorder{next: next, mu: new(sync.Mutex), msgs: new([]string)}
}

func (r subscribeRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (r subscribeRecorder) Handle(ctx context.Context, rec slog.Record) error {
	line := rec.Level.String() + " " + rec.Message
	rec.Attrs(func(a slog.Attr) bool {
		line += " " + a.String()
		return true
	})
	r.mu.Lock()
	*r.msgs = append(*r.msgs, line)
	r.mu.Unlock()
	if r.next.Enabled(ctx, rec.Level) {
		return r.next.Handle(ctx, rec)
	}
	return nil
}

func (r subscribeRecorder) WithAttrs(attrs []slog.Attr) slog.Handler {
	r.next = r.next.WithAttrs(attrs)
	return r
}

func (r subscribeRecorder) WithGroup(name string) slog.Handler {
	r.next = r.next.WithGroup(name)
	return r
}

// lines returns the records so far whose line contains s.
func (r subscribeRecorder) lines(s string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, m := range *r.msgs {
		if strings.Contains(m, s) {
			out = append(out, m)
		}
	}
	return out
}

// subscribeWaitFinal is client.waitFinal with a deadline of within: a
// bridge's first connect to NATS with many devices takes a while.
func subscribeWaitFinal(c *client, deviceID, id string, within time.Duration) map[string]any {
	c.tb.Helper()
	deadline := time.Now().Add(within)
	for {
		r := c.do("GET", "/api/v1/devices/"+deviceID+"/commands/"+id, nil, "Prefer", "wait=10")
		require.Contains(c.tb, []int{200, 202}, r.Status, "%s", r.Body)
		cmd := r.JSON(c.tb)
		if companion.IsFinal(cmd["state"].(string)) {
			return cmd
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("command %s still %s after %v", id, cmd["state"], within)
		}
	}
}

// A bridge serving 200 devices comes up on the three-node NATS cluster
// (the server answering its authorization): NATS makes the bridge's 200
// subscriptions one after another, which takes longer than one SUBACK
// used to be awaited. The bridge subscribes in chunks and says "online"
// once every chunk is answered; a command to its last device, sent before
// the bridge even connected, succeeds, and so does one sent after.
func TestSubscribeManyDevicesOnNATS(t *testing.T) {
	t.Parallel()
	const n = 200
	devices := make([]string, n)
	for i := range devices {
		devices[i] = fmt.Sprintf("dev-%03d", i)
	}
	first, last := devices[0], devices[n-1]
	cl, m := startNATSCallout(t)
	f := setupFleet(t, m, devices...)
	registerDevices(t, f, first, last)

	early := f.user.accept("POST", "/api/v1/devices/"+last+"/push/text", map[string]any{"text": "before the bridge"})["id"].(string)
	sims := map[string]*sim.Device{}
	var devs []agent.Device
	for _, id := range devices {
		s := sim.New(sim.Options{ID: id})
		sims[id] = s
		devs = append(devs, s)
	}
	rec := newSubscribeRecorder(testLogger(t).Handler())
	b := runBridge(t, m, cl.MQTTURL(), f, devs, sims, func(o *agent.Options) { o.Logger = slog.New(rec).With("component", "bridge") })

	const within = 5 * time.Minute // a bound, not a measure: 200 took 18 s here
	assert.Equal(t, "succeeded", subscribeWaitFinal(f.user, last, early, within)["state"], "the command sent before the bridge came up")
	late := f.user.accept("POST", "/api/v1/devices/"+last+"/push/text", map[string]any{"text": "after"}, "Prefer", "wait=10")["id"].(string)
	assert.Equal(t, "succeeded", subscribeWaitFinal(f.user, last, late, within)["state"], "the command sent after")
	other := f.user.accept("POST", "/api/v1/devices/"+first+"/push/text", map[string]any{"text": "first"})["id"].(string)
	assert.Equal(t, "succeeded", subscribeWaitFinal(f.user, first, other, within)["state"], "the first device's command")
	for _, id := range []string{early, late} {
		assert.Equal(t, 1, b.sims[last].Executions(id), "%s ran once", id)
	}

	assert.Empty(t, rec.lines("subscribing to commands failed"))
	for _, s := range []string{"refused", "no SUBACK", "SUBSCRIBE failed", "granted", "msg=connected", "INFO connected"} {
		for _, line := range rec.lines(s) {
			t.Logf("bridge: %s", line)
		}
	}
}
