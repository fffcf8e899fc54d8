package broker

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// coalescings counts the reports the broker acknowledged unstored.
type coalescings struct {
	nopObserver
	status, settings atomic.Int64
}

func (c *coalescings) ReportCoalesced(kind string) {
	switch kind {
	case "status":
		c.status.Add(1)
	case "settings":
		c.settings.Add(1)
	}
}

// deviceEvents returns the device events of u1's log.
func deviceEvents(t *testing.T, e *env) []companion.Event {
	t.Helper()
	var all []companion.Event
	after := ""
	for {
		evs, next, err := e.db.Events(context.Background(), "u1", after, 1000)
		require.NoError(t, err)
		for _, ev := range evs {
			if ev.Kind == companion.EventDevice {
				all = append(all, ev)
			}
		}
		if len(evs) == 0 || next == "" {
			return all
		}
		after = next
	}
}

// A bridge that publishes a device's statuses and settings faster than
// Options.ReportRate has a burst of them stored, and then one a turn: the
// newest of those that came meanwhile, which always lands. Before, every
// report was a store write, and every status that changed an event for the
// device's user, however fast a bridge sent them: a bridge of a user's own
// (CONTRACT §9) could fill the store and the event log, and hold up every
// other bridge's replies, which intake takes in the same order.
func TestReportsOverTheRateAreCoalesced(t *testing.T) {
	const perSecond, burst, reports = 4, 3, 200
	obs := &coalescings{}
	e := newEnvTuned(t, true, nil, func(o *Options) {
		o.ReportRate, o.ReportBurst, o.Observer = perSecond, burst, obs
	})
	fb := connectBridge(t, e)
	status, _ := tree.Status("dev-1")
	settings, _ := tree.Settings("dev-1")

	start := time.Now()
	for i := 1; i <= reports; i++ {
		battery := i % 101
		b, err := json.Marshal(topics.Status{Online: true, Battery: &battery, BridgeID: "b1", Seq: uint64(i), At: time.Now()})
		require.NoError(t, err)
		fb.c.Publish(status, 1, false, b) // waited for below, all at once
		b, err = json.Marshal(topics.Settings{Reported: map[string]any{"volume": i}, Seq: uint64(i), At: time.Now()})
		require.NoError(t, err)
		fb.c.Publish(settings, 1, false, b)
	}
	testenv.Eventually(t, 20*time.Second, "the newest status and settings stored", func() bool {
		s, err := e.db.Status(context.Background(), "dev-1")
		require.NoError(t, err)
		set, err := e.db.Settings(context.Background(), "dev-1")
		require.NoError(t, err)
		return s.Seq == reports && set.Seq == reports
	})
	took := time.Since(start)
	s, err := e.db.Status(context.Background(), "dev-1")
	require.NoError(t, err)
	require.NotNil(t, s.Battery)
	assert.Equal(t, reports%101, *s.Battery, "the newest status is the one stored")
	set, err := e.db.Settings(context.Background(), "dev-1")
	require.NoError(t, err)
	assert.JSONEq(t, `200`, string(set.Reported["volume"]), "the newest settings are the ones stored")

	// At most the burst, one a turn over the time it took, and the newest.
	most := burst + int(perSecond*took.Seconds()) + 1
	events := deviceEvents(t, e)
	assert.LessOrEqual(t, len(events), most, "statuses stored as events over %s", took)
	assert.Positive(t, obs.status.Load(), "statuses acknowledged unstored")
	assert.Positive(t, obs.settings.Load(), "settings acknowledged unstored")
	assert.GreaterOrEqual(t, int(obs.status.Load()), reports-most, "statuses coalesced")
	t.Logf("%d statuses and settings each in %s: %d events, %d statuses and %d settings coalesced",
		reports, took, len(events), obs.status.Load(), obs.settings.Load())

	// A device's bucket is its own: another device's report goes at once.
	fb.online(t, e, "dev-2")
}

// Under the rate, every report is stored as it comes, with none held
// back; a negative ReportRate takes every report at once.
func TestReportsUnderTheRateAreEachStored(t *testing.T) {
	for _, rate := range []float64{0, -1} { // 0: the default
		obs := &coalescings{}
		e := newEnvTuned(t, true, nil, func(o *Options) { o.ReportRate, o.Observer = rate, obs })
		fb := connectBridge(t, e)
		status, _ := tree.Status("dev-1")
		n := defaultReportBurst
		if rate < 0 {
			n = 50
		}
		for i := 1; i <= n; i++ {
			battery := i
			fb.publish(t, status, topics.Status{Online: true, Battery: &battery, BridgeID: "b1", Seq: uint64(i), At: time.Now()})
		}
		testenv.Eventually(t, 10*time.Second, "the last status stored", func() bool {
			s, err := e.db.Status(context.Background(), "dev-1")
			return err == nil && s.Seq == uint64(n)
		})
		assert.Len(t, deviceEvents(t, e), n, "rate %v: every status an event", rate)
		assert.Zero(t, obs.status.Load(), "rate %v: none coalesced", rate)
	}
}

// A report held back over the rate is taken with its device's bridge read
// anew, not as intake read it for the message's batch: a device moved to
// another bridge meanwhile no longer takes its old bridge's word (CONTRACT
// §9).
func TestAReportHeldBackReadsItsBridgeAnew(t *testing.T) {
	e := newEnvTuned(t, true, nil, func(o *Options) { o.ReportRate, o.ReportBurst = 2, 1 })
	ctx := context.Background()
	fb := connectBridge(t, e)
	status, _ := tree.Status("dev-1")
	fb.publish(t, status, topics.Status{Online: true, FirmwareVersion: "1.0.0", BridgeID: "b1", Seq: 1, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the first status stored", func() bool {
		s, err := e.db.Status(ctx, "dev-1")
		return err == nil && s.Seq == 1
	})

	// The second waits for its turn (half a second); meanwhile dev-1 moves.
	fb.publish(t, status, topics.Status{Online: true, FirmwareVersion: "6.6.6", BridgeID: "b1", Seq: 2, At: time.Now()})
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("b2: not used")}))
	_, err := e.db.AssignDevice(ctx, "dev-1", "b2", "")
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, "the held status taken", func() bool {
		e.b.gate.mu.Lock()
		defer e.b.gate.mu.Unlock()
		g := e.b.gate.devices[gateKey{topics.KindStatus, "dev-1"}]
		return g != nil && g.take == nil
	})
	// The held one is taken (or not) as it leaves the gate; a status of
	// dev-2 through intake comes after it in the store's order.
	fb.online(t, e, "dev-2")
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, "1.0.0", s.FirmwareVersion, "the status of the bridge dev-1 left was stored")
	assert.False(t, s.Online, "dev-1 reads online before b2 reports it")
	assert.Empty(t, s.BridgeID)
}

// A report that comes while a newer one of its device is held at the gate
// is acknowledged unstored, and the held one keeps its turn (bug 461).
// Before, whichever came last took the held one's place: the server's own
// status, republished retained as the store had it after the bridge's Will,
// took the place of the bridge's newer report that the device was online,
// and the device read offline until its bridge's next report, a minute on.
func TestAnOlderReportDoesNotTakeAHeldNewerOnesPlace(t *testing.T) {
	var turns []func()
	later := func(_ time.Duration, f func()) { turns = append(turns, f) }
	g := newReportGate(1, 1, later, quiet(), func(string) {})
	var got []string
	report := func(name string) (func(bool), func()) {
		return func(bool) { got = append(got, "took "+name) }, func() { got = append(got, "acked "+name) }
	}
	t0 := time.Now()
	take, ack := report("first")
	g.admit(topics.KindStatus, "dev-1", 1, t0, take, ack) // the bucket's one token
	take, ack = report("newer")
	g.admit(topics.KindStatus, "dev-1", 1, t0.Add(2*time.Second), take, ack) // held
	take, ack = report("older")
	g.admit(topics.KindStatus, "dev-1", 1, t0.Add(time.Second), take, ack) // comes last, older
	require.Len(t, turns, 1, "one report held")
	turns[0]()
	assert.Equal(t, []string{"took first", "acked older", "took newer"}, got)

	// A newer one still takes a held one's place.
	turns, got = nil, nil
	g = newReportGate(1, 1, later, quiet(), func(string) {})
	take, ack = report("first")
	g.admit(topics.KindStatus, "dev-1", 1, t0, take, ack)
	take, ack = report("held")
	g.admit(topics.KindStatus, "dev-1", 2, t0, take, ack)
	take, ack = report("newest")
	g.admit(topics.KindStatus, "dev-1", 3, t0, take, ack)
	require.Len(t, turns, 1)
	turns[0]()
	assert.Equal(t, []string{"took first", "acked held", "took newest"}, got)
}
