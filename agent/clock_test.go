package agent_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// steppedClock is the bridge's wall clock, off the real one by an offset a
// test steps, as NTP steps a clock while the bridge runs.
type steppedClock struct{ off atomic.Int64 }

func (c *steppedClock) Now() time.Time       { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *steppedClock) step(d time.Duration) { c.off.Add(int64(d)) }
func newSteppedClock(off time.Duration) *steppedClock {
	c := &steppedClock{}
	c.step(off)
	return c
}

// The bridge's clock stepped back an hour (NTP setting a fast clock right)
// after the first message of its connection: the commands that come next
// are taken in at once. The settle of the connection's first messages
// (settleTime) was a wall time: after the step it lay an hour ahead, and
// the intake slept until then on every message (bug 327).
func TestIntakeGoesOnAfterTheClockSteppedBack(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	clk := newSteppedClock(0)
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, now: clk.Now})

	first := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "before the step"})
	w.send(first)
	if r := w.waitFinal("dev-1", first.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the first command ended %s; want succeeded", r.State)
	}
	clk.step(-time.Hour)
	next := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "after the step"})
	w.send(next)
	if r := w.waitFinal("dev-1", next.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the command after the step ended %s; want succeeded", r.State)
	}
}

// A bridge whose clock runs a day ahead (a board without a battery-backed
// clock, a time zone taken for UTC) runs the commands that reach it in
// time, and still expires one that reached it past its TTL on the
// server's clock. It judged expires_at on its own clock alone: every
// command with the default TTL of a day read expired as it arrived
// (bug 328).
func TestBridgeWithItsClockADayAheadRunsCommands(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	clk := newSteppedClock(25 * time.Hour)
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, now: clk.Now})

	fresh := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "in time"})
	w.send(fresh)
	if r := w.waitFinal("dev-1", fresh.ID); r.State != companion.StateSucceeded {
		t.Errorf("a command in its TTL ended %s; want succeeded", r.State)
	}
	if n := dev.Executions(fresh.ID); n != 1 {
		t.Errorf("Executions(in time) = %d; want 1", n)
	}

	late := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "too late"})
	late.CreatedAt = late.CreatedAt.Add(-2 * time.Hour)
	late.ExpiresAt = late.CreatedAt.Add(time.Hour)
	w.send(late)
	if r := w.waitFinal("dev-1", late.ID); r.State != companion.StateExpired {
		t.Errorf("a command past its TTL ended %s; want expired", r.State)
	}
	if n := dev.Executions(late.ID); n != 0 {
		t.Errorf("Executions(too late) = %d; want 0", n)
	}
}

// A bridge that ran a command while its clock read 1970 (a board without a
// battery-backed clock, before NTP synced) remembers it as done for
// DoneRetention once its clock is set: it was stamped 1970, and the purge
// that followed the sync forgot it, so that a repeat (the server sends a
// command whose final reply it never stored) ran again (bug 330).
func TestDoneIDsOutliveTheClockSetFrom1970(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	clk := newSteppedClock(time.Until(time.Unix(0, 0)))
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, now: clk.Now})

	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "run at 1970"})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the command ended %s; want succeeded", r.State)
	}
	// Its reply acknowledged: nothing keeps its id but its age.
	for deadline := time.Now().Add(waitLong); ; {
		n, err := br.OwedReplies()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d final replies still owed", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	clk.step(time.Since(clk.Now())) // NTP synced
	if n, err := br.PurgeSpool(); err != nil || n != 0 {
		t.Errorf("PurgeSpool() = %d, %v; want 0 forgotten, the command done a moment ago", n, err)
	}
	if st, err := br.SpoolState(c.ID); err != nil || st != "done" {
		t.Errorf("SpoolState = %q, %v; want done", st, err)
	}
}

// A bridge whose clock reads 1970 (a board without a battery-backed clock,
// before NTP synced) reports a device's state, after a command, with a
// seq no lower than the command's created_at: the server takes no report
// below the one it stored, and it stored the bridge's last report before
// the restart, on a clock that was right. With its clock for seq alone,
// the bridge's reports were refused until NTP synced: after a settings
// change or an OTA, GET …/settings and …/status kept the old values
// (CONTRACT §8), and its devices read offline after its Will (bug 333).
func TestReportsOfABridgeAt1970FollowTheServersClock(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	clk := newSteppedClock(time.Until(time.Unix(0, 0)))
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, now: clk.Now})

	c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80}})
	w.send(c)
	r := w.waitFinal("dev-1", c.ID)
	if r.State != companion.StateSucceeded || r.Settings == nil {
		t.Fatalf("the command ended %s with settings %v; want succeeded with them", r.State, r.Settings)
	}
	if created := uint64(c.CreatedAt.UnixNano()); r.Settings.Seq < created {
		t.Errorf("the settings' seq %d is below the command's created_at %d", r.Settings.Seq, created)
	}
}

// The reports of a bridge whose clock reads 1970 carry, once a command
// came, a time no earlier than that command's created_at: the server
// shows a report's at as the device's last_seen, which read 1970-01-01
// until NTP synced, beside a seq of the server's time (bug 334).
func TestReportTimesOfABridgeAt1970FollowTheServersClock(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	clk := newSteppedClock(time.Until(time.Unix(0, 0)))
	bs := startBlobServer(t)
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{dev}, now: clk.Now})

	c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80}})
	w.send(c)
	r := w.waitFinal("dev-1", c.ID)
	if r.State != companion.StateSucceeded || r.Settings == nil {
		t.Fatalf("the command ended %s with settings %v; want succeeded with them", r.State, r.Settings)
	}
	if r.Settings.At.Before(c.CreatedAt) {
		t.Errorf("the settings' at %v is before the command's created_at %v", r.Settings.At, c.CreatedAt)
	}
	u := command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: bs.add([]byte("weather 1.0.0"))})
	w.send(u)
	r = w.waitFinal("dev-1", u.ID)
	if r.State != companion.StateSucceeded || r.Status == nil {
		t.Fatalf("the install ended %s with status %v; want succeeded with it", r.State, r.Status)
	}
	if r.Status.At.Before(c.CreatedAt) {
		t.Errorf("the status' at %v is before the first command's created_at %v", r.Status.At, c.CreatedAt)
	}
}

// A command whose created_at is past what a seq can hold (a server's clock
// set centuries ahead) does not carry the bridge's reports there.
func TestACreatedAtPastEverySeqIsNotTaken(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}})

	far := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "from the future"})
	far.CreatedAt = time.Date(2300, 1, 1, 0, 0, 0, 0, time.UTC)
	far.ExpiresAt = far.CreatedAt.Add(time.Hour)
	w.send(far)
	w.waitFinal("dev-1", far.ID)
	c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"volume": 20}})
	w.send(c)
	r := w.waitFinal("dev-1", c.ID)
	if r.Settings == nil {
		t.Fatalf("the command ended %s without settings", r.State)
	}
	limit := time.Now().Add(time.Hour)
	if r.Settings.Seq > uint64(limit.UnixNano()) || r.Settings.At.After(limit) {
		t.Errorf("the settings' seq %d and at %v; want them before %v", r.Settings.Seq, r.Settings.At, limit)
	}
}

// A bridge restarted with its clock 9 days ahead (a board without a
// battery-backed clock restored to a wrong date) still knows the commands
// it ran before: the purge at its start judged their age on its clock
// alone, as no command had yet shown the server's, and forgot them, so
// that a repeat the server sent after the restart ran again (bug 353).
func TestDoneIDsOutliveARestartWithTheClockAhead(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})

	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "before the restart"})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the command ended %s; want succeeded", r.State)
	}
	waitNoOwedReplies(t, br)
	br.stop(t)
	w.waitBridgeState("b1", topics.BridgeOffline, 1)

	clk := newSteppedClock(9 * 24 * time.Hour)
	br = startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir, now: clk.Now})
	if n, err := br.PurgeSpool(); err != nil || n != 0 {
		t.Errorf("PurgeSpool() = %d, %v; want 0 forgotten, the command done a moment ago", n, err)
	}
	if st, err := br.SpoolState(c.ID); err != nil || st != "done" {
		t.Errorf("SpoolState = %q, %v; want done", st, err)
	}
}

// waitNoOwedReplies waits for the broker to acknowledge every final reply
// of br: nothing keeps a done id then but its age.
func waitNoOwedReplies(t *testing.T, br *bridge) {
	t.Helper()
	for deadline := time.Now().Add(waitLong); ; {
		n, err := br.OwedReplies()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d final replies still owed", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
