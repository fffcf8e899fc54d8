package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// subscribeHook lets every client in and allows everything but the
// SUBSCRIBE of the filters in refused (SUBACK 0x80), which a test may
// grant later without a reconnect; while hold is open, the bridge's
// SUBSCRIBEs wait in it (the broker reads nothing else of the connection
// meanwhile, as NATS does while it makes subscriptions), those naming
// holdFilter only when it is set. It counts each
// filter's SUBSCRIBEs and each client's connections. Setting refuseLogin
// turns every new connection away.
type subscribeHook struct {
	mochi.HookBase
	refuseLogin atomic.Bool
	mu          sync.Mutex
	refused     map[string]bool
	asked       map[string]int
	connects    map[string]int
	hold        chan struct{}
	holdFilter  string
	notify      chan struct{} // closed and replaced on every SUBSCRIBE of the bridge
}

func (h *subscribeHook) ID() string { return "subscribe-test" }

func (h *subscribeHook) Provides(b byte) bool {
	return b == mochi.OnConnectAuthenticate || b == mochi.OnACLCheck || b == mochi.OnSubscribe || b == mochi.OnConnect
}

func (h *subscribeHook) OnConnectAuthenticate(*mochi.Client, packets.Packet) bool {
	return !h.refuseLogin.Load()
}

func (h *subscribeHook) OnConnect(cl *mochi.Client, _ packets.Packet) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.connects[cl.ID]++
	return nil
}

func (h *subscribeHook) OnACLCheck(_ *mochi.Client, topic string, write bool) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return write || !h.refused[topic]
}

func (h *subscribeHook) OnSubscribe(cl *mochi.Client, pk packets.Packet) packets.Packet {
	if !strings.HasPrefix(cl.ID, "companion-bridge-") {
		return pk
	}
	h.mu.Lock()
	for _, f := range pk.Filters {
		h.asked[f.Filter]++
	}
	close(h.notify)
	h.notify = make(chan struct{})
	hold := h.hold
	if h.holdFilter != "" && !slices.ContainsFunc(pk.Filters, func(s packets.Subscription) bool { return s.Filter == h.holdFilter }) {
		hold = nil
	}
	h.mu.Unlock()
	if hold != nil {
		<-hold
	}
	return pk
}

func (h *subscribeHook) refuse(filter string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.refused[filter] = true
}

func (h *subscribeHook) grant(filter string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.refused, filter)
}

func (h *subscribeHook) timesAsked(filter string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.asked[filter]
}

// waitAsked waits until the bridge has asked for filter n times.
func (h *subscribeHook) waitAsked(tb testing.TB, filter string, n int) {
	tb.Helper()
	deadline := time.NewTimer(waitLong)
	defer deadline.Stop()
	for {
		h.mu.Lock()
		asked, ch := h.asked[filter], h.notify
		h.mu.Unlock()
		if asked >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			tb.Fatalf("%s asked for %d times; waited for %d", filter, asked, n)
		}
	}
}

func (h *subscribeHook) connections(clientID string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.connects[clientID]
}

// startSubscribeBroker starts an embedded broker on a free port whose
// SUBSCRIBEs go through a subscribeHook refusing the filters given.
func startSubscribeBroker(tb testing.TB, refused ...string) (*testBroker, *subscribeHook) {
	tb.Helper()
	hook := &subscribeHook{refused: map[string]bool{}, asked: map[string]int{}, connects: map[string]int{}, notify: make(chan struct{})}
	for _, f := range refused {
		hook.refused[f] = true
	}
	pubs := newPublishCounter()
	srv, url := mochitest.Start(tb, hook, pubs)
	return &testBroker{srv: srv, url: url, pubs: pubs}, hook
}

// subscribeLog is a logger's output, kept for the test to read.
type subscribeLog struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	notify chan struct{} // closed and replaced on every write
}

func newSubscribeLog() *subscribeLog { return &subscribeLog{notify: make(chan struct{})} }

func (l *subscribeLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	close(l.notify)
	l.notify = make(chan struct{})
	return l.buf.Write(p)
}

// waitLine waits until a line that contains every one of parts is logged.
func (l *subscribeLog) waitLine(tb testing.TB, parts ...string) {
	tb.Helper()
	l.waitAny(tb, parts)
}

// waitAny waits until a line that contains every one of the parts of one
// of alts is logged.
func (l *subscribeLog) waitAny(tb testing.TB, alts ...[]string) {
	tb.Helper()
	deadline := time.NewTimer(waitLong)
	defer deadline.Stop()
	for {
		l.mu.Lock()
		ch := l.notify
		l.mu.Unlock()
		for _, parts := range alts {
			if len(l.lines(parts...)) > 0 {
				return
			}
		}
		select {
		case <-ch:
		case <-deadline.C:
			l.mu.Lock()
			logged := l.buf.String()
			l.mu.Unlock()
			tb.Fatalf("nothing logged with any of %q; the log:\n%s", alts, logged)
		}
	}
}

// lines returns the lines logged so far that contain every one of parts.
func (l *subscribeLog) lines(parts ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for line := range strings.Lines(l.buf.String()) {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			out = append(out, line)
		}
	}
	return out
}

// subscribeBridge runs an agent serving sims on b with the subscriptions'
// timing shortened, its log kept in the returned subscribeLog. It does not
// wait for the bridge to come online.
func subscribeBridge(tb testing.TB, b *testBroker, sims []*sim.Device, timeout time.Duration) (*bridge, *subscribeLog) {
	tb.Helper()
	log := newSubscribeLog()
	devs := make([]agent.Device, len(sims))
	for i, s := range sims {
		devs[i] = s
	}
	a, err := agent.New(agent.Options{
		MQTTURL:  b.url,
		Password: testSecret,
		BridgeID: "b1",
		DataDir:  tb.TempDir(),
		Devices:  devs,
		Logger:   slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	if err != nil {
		tb.Fatal(err)
	}
	a.SetSubscribeTiming(timeout, 20*time.Millisecond, 200*time.Millisecond)
	br := &bridge{Agent: a, id: "b1", done: make(chan error, 1)}
	go func() { br.done <- a.Run(context.Background()) }()
	tb.Cleanup(func() { br.stop(tb) })
	return br, log
}

func subscribeSims(n int) []*sim.Device {
	sims := make([]*sim.Device, n)
	for i := range sims {
		sims[i] = newSim(fmt.Sprintf("dev-%02d", i))
	}
	return sims
}

func mustCommandsFilter(tb testing.TB, deviceID string) string {
	tb.Helper()
	f, err := tree.CommandsFilter(deviceID)
	if err != nil {
		tb.Fatal(err)
	}
	return f
}

// A broker refuses a device's commands for a while (NATS does while a
// killed node's JetStream leaders are elected), then grants them: the
// bridge asks again on the same connection, says "online" again so that
// the server sends that device's commands again, and the device's command
// arrives and runs, with no reconnect. Another device's commands, refused
// for good, are asked for again and again but logged once. The bridge
// serves 40 devices: its SUBSCRIBEs go in more than one chunk.
func TestSubscribeRefusedThenGranted(t *testing.T) {
	sims := subscribeSims(40)
	later, never := mustCommandsFilter(t, "dev-37"), mustCommandsFilter(t, "dev-38")
	b, hook := startSubscribeBroker(t, later, never)
	w := newWatcher(t, b)
	_, log := subscribeBridge(t, b, sims, waitLong)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 1)

	// Granted devices work at once, in either chunk.
	for _, dev := range []string{"dev-00", "dev-39"} {
		cmd := command(t, dev, topics.OpPushText, map[string]string{"text": "hello " + dev})
		w.send(cmd)
		if r := w.waitFinal(dev, cmd.ID); r.State != companion.StateSucceeded {
			t.Fatalf("%s: %s reply; want succeeded", dev, r.State)
		}
	}

	// A command sent while dev-37's filter is refused reaches no one.
	lost := command(t, "dev-37", topics.OpPushText, map[string]string{"text": "lost"})
	w.send(lost)
	hook.grant(later)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	// The server sends it again after the second "online".
	w.send(lost)
	if r := w.waitFinal("dev-37", lost.ID); r.State != companion.StateSucceeded {
		t.Fatalf("dev-37: %s reply; want succeeded", r.State)
	}
	if got := len(sims[37].Texts()); got != 1 {
		t.Errorf("dev-37 showed %d texts; want 1", got)
	}
	if got := log.lines("granted the commands", later); len(got) != 1 {
		t.Errorf("the grant of %s logged %d times; want once: %q", later, len(got), got)
	}

	// dev-38's filter is asked for again (at the backoff's pace, up to
	// once a minute outside tests), and its refusal is logged once.
	hook.waitAsked(t, never, 4)
	if got := log.lines("refused the commands", never); len(got) != 1 {
		t.Errorf("the refusal of %s logged %d times; want once: %q", never, len(got), got)
	}
	if got := log.lines("refused the commands", later); len(got) != 1 {
		t.Errorf("the refusal of %s logged %d times; want once: %q", later, len(got), got)
	}
	if got := hook.timesAsked(mustCommandsFilter(t, "dev-00")); got != 1 {
		t.Errorf("a granted filter was asked for %d times; want once", got)
	}
	if got := hook.connections("companion-bridge-b1"); got != 1 {
		t.Errorf("the bridge connected %d times; want once", got)
	}
	stateTopic, _ := tree.BridgeState("b1")
	if got := b.pubs.count(stateTopic, topics.BridgeOnline); got != 2 {
		t.Errorf(`the bridge said "online" %d times; want 2 (connect, grant)`, got)
	}
	if got := log.lines("subscribing to commands failed"); len(got) != 0 {
		t.Errorf("logged %q", got)
	}
}

// A broker that does not answer a SUBSCRIBE in time (NATS making hundreds
// of subscriptions one after another) does not lose its filters: the
// bridge says "online" once the first round is over, asks again on the
// same connection, and says "online" again once they are granted; the
// device's command then runs.
func TestSubscribeUnansweredIsAskedAgain(t *testing.T) {
	sims := subscribeSims(2)
	filter := mustCommandsFilter(t, "dev-01")
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	answer := hook.holdSubscribes(t, "")
	_, log := subscribeBridge(t, b, sims, 300*time.Millisecond)
	hook.waitAsked(t, filter, 1)
	log.waitLine(t, "no SUBACK in time")
	answer()

	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	cmd := command(t, "dev-01", topics.OpPushText, map[string]string{"text": "late but there"})
	w.send(cmd)
	if r := w.waitFinal("dev-01", cmd.ID); r.State != companion.StateSucceeded {
		t.Fatalf("dev-01: %s reply; want succeeded", r.State)
	}
	if got := hook.timesAsked(filter); got < 2 {
		t.Errorf("%s asked for %d times; want it asked again", filter, got)
	}
	if got := hook.connections("companion-bridge-b1"); got != 1 {
		t.Errorf("the bridge connected %d times; want once", got)
	}
	if got := log.lines("subscribing to commands failed"); len(got) != 0 {
		t.Errorf("logged %q", got)
	}
}

// blockedText is a simulated device on which the text "blocks", once it
// reached the device (started closed), waits until release is closed;
// ended is closed once it has run.
type blockedText struct {
	*sim.Device
	started, release, ended chan struct{}
	// once: started and ended close at the first run of "blocks"; a run
	// again (stopped and held, bug 504) goes through.
	once sync.Once
}

func newBlockedText(id string) *blockedText {
	return &blockedText{Device: newSim(id), started: make(chan struct{}), release: make(chan struct{}), ended: make(chan struct{})}
}

func (d *blockedText) PushText(ctx context.Context, cmdID, title, text string) error {
	first := false
	if text == "blocks" {
		d.once.Do(func() { first = true })
	}
	if first {
		defer close(d.ended)
		close(d.started)
		select {
		case <-d.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return d.Device.PushText(ctx, cmdID, title, text)
}

// wrapBlocked is a bridgeConfig.wrap that puts d between the bridge and
// its simulated device.
func wrapBlocked(d *blockedText) func(*sim.Device) agent.Device {
	return func(s *sim.Device) agent.Device {
		if s == d.Device {
			return d
		}
		return s
	}
}

// waitClosed waits for c to be closed, or fails the test with what.
func waitClosed(tb testing.TB, c chan struct{}, what string) {
	tb.Helper()
	select {
	case <-c:
	case <-time.After(waitLong):
		tb.Fatal(what)
	}
}

// blockedQueue is a bridge serving dev-1 (and more), on which the command
// "blocks" runs, held by the device, and another is queued behind it,
// delivered: the set-up of the tests of a move or a deletion that catches
// the bridge running a command.
type blockedQueue struct {
	w               *watcher
	dev             *blockedText
	log             *subscribeLog
	running, behind topics.Command
}

func startBlockedQueue(t *testing.T, b *testBroker, more ...*sim.Device) blockedQueue {
	t.Helper()
	return startBlockedQueueWith(t, b, bridgeConfig{devices: more})
}

// startBlockedQueueWith is startBlockedQueue with the bridge's config
// (cfg.devices the devices beside dev-1).
func startBlockedQueueWith(t *testing.T, b *testBroker, cfg bridgeConfig) blockedQueue {
	t.Helper()
	q := blockedQueue{w: newWatcher(t, b), dev: newBlockedText("dev-1"), log: newSubscribeLog()}
	cfg.devices = append([]*sim.Device{q.dev.Device}, cfg.devices...)
	cfg.wrap = wrapBlocked(q.dev)
	cfg.logger = slog.New(slog.NewTextHandler(q.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	startBridge(t, b, nil, q.w, cfg)
	q.running = command(t, "dev-1", topics.OpPushText, map[string]string{"text": "blocks"})
	q.w.send(q.running)
	waitClosed(t, q.dev.started, "the first command did not reach the device")
	q.behind = command(t, "dev-1", topics.OpPushText, map[string]string{"text": "queued behind it"})
	q.w.send(q.behind)
	q.w.waitReply("dev-1", q.behind.ID, companion.StateDelivered)
	return q
}

// holdSubscribes has the broker hold the bridge's SUBSCRIBEs, those naming
// filter only when it is not "", until the returned func is called (also
// at the test's end, before the bridge stops and the broker closes).
func (h *subscribeHook) holdSubscribes(t *testing.T, filter string) (answer func()) {
	hold := make(chan struct{})
	var once sync.Once
	answer = func() {
		once.Do(func() {
			h.mu.Lock()
			h.hold, h.holdFilter = nil, ""
			h.mu.Unlock()
			close(hold)
		})
	}
	t.Cleanup(answer)
	h.mu.Lock()
	h.hold, h.holdFilter = hold, filter
	h.mu.Unlock()
	return answer
}

// A device is moved off the bridge while the bridge runs one of its
// commands, with another queued behind it in the spool: the move
// disconnects the bridge, and the broker refuses it the device's commands
// from then on (CONTRACT §9). The server failed the queued one at the move
// (device_not_served), or sends it to the device's new bridge: the bridge
// holds it rather than run it on the device, serving its other devices on,
// and runs it only once the broker grants the device's commands again (as
// NATS does after refusing a filter while its leaders are elected)
// (docs/reliability.md, bug 240). The command running as the refusal
// comes is stopped, and held with it: run on, it held the device's link
// from its new bridge (bug 504).
func TestCommandsOfADeviceTheBrokerRefusesAreHeld(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	q := startBlockedQueue(t, b, newSim("dev-2"))
	w, dev, log, running, behind := q.w, q.dev, q.log, q.running, q.behind
	text := func(dev, text string) topics.Command {
		c := command(t, dev, topics.OpPushText, map[string]string{"text": text})
		w.send(c)
		return c
	}

	filter := mustCommandsFilter(t, "dev-1")
	hook.refuse(filter)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2) // back, dev-1's commands refused
	waitClosed(t, dev.ended, "the running command was not stopped as the broker refused its device")
	log.waitLine(t, "stopped the command", "device_id=dev-1")
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")
	marker := text("dev-2", "dev-2 is served on")
	if r := w.waitFinal("dev-2", marker.ID); r.State != companion.StateSucceeded {
		t.Fatalf("dev-2: %s reply; want succeeded", r.State)
	}
	for _, c := range []topics.Command{running, behind} {
		if n := dev.Executions(c.ID); n != 0 {
			t.Fatalf("%s ran %d times while the broker refused its device", c.Payload, n)
		}
		if rs := w.replies("dev-1", c.ID); len(rs) > 0 && companion.IsFinal(rs[len(rs)-1].State) {
			t.Fatalf("%s was answered %s while held", c.Payload, rs[len(rs)-1].State)
		}
	}

	hook.grant(filter)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 3)
	for _, c := range []topics.Command{running, behind} {
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Fatalf("the held command %s once granted: %s reply; want succeeded", c.Payload, r.State)
		}
	}
	var got []string
	for _, tx := range dev.Texts() {
		got = append(got, tx.CmdID)
	}
	if want := []string{running.ID, behind.ID}; !slices.Equal(got, want) {
		t.Errorf("texts %q; want %q", got, want)
	}
}

// A bridge deleted on the server (or whose secret changed) while it runs a
// command, another queued behind it: the broker refuses its login from then
// on, and the server failed both commands (device_not_served) as it
// deleted it. The bridge holds the queued one rather than run it on the
// device, and runs it once the broker lets it in again (docs/reliability.md,
// bug 243).
func TestCommandsHeldWhileTheLoginIsRefused(t *testing.T) {
	b := startBroker(t)
	q := startBlockedQueue(t, b)
	w, dev, log, running, behind := q.w, q.dev, q.log, q.running, q.behind

	b.hook.refuse.Store(true)
	b.dropClient(t, "companion-bridge-b1")
	log.waitLine(t, "refuses the bridge's id and secret")
	close(dev.release)
	waitClosed(t, dev.ended, "the first command did not end")
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times while the broker refused the bridge", n)
	}

	b.hook.refuse.Store(false)
	if r := w.waitFinal("dev-1", behind.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the held command once let in: %s reply; want succeeded", r.State)
	}
	if n := dev.Executions(behind.ID); n != 1 {
		t.Errorf("the held command ran %d times; want once", n)
	}
	if r := w.waitFinal("dev-1", running.ID); r.State != companion.StateSucceeded {
		t.Errorf("the running command: %s reply; want succeeded", r.State)
	}
}

// A bridge restarted after one of its devices was moved to another bridge:
// its spool still holds that device's commands, which the server failed at
// the move (device_not_served), and the broker refuses it the device's
// commands from then on. The bridge holds them from the start, rather than
// run them before the broker answers its SUBSCRIBE, serving its other
// devices on; they run if the broker grants the device's commands again
// (docs/reliability.md, bug 249).
func TestCommandsOfADeviceRefusedAtRestartAreHeld(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	dev, other := newSim("dev-1"), newSim("dev-2")
	dir := t.TempDir()
	br := startBridge(t, b, nil, w, bridgeConfig{dataDir: dir, devices: []*sim.Device{dev, other}})
	// The first hangs on the device until the bridge stops; the second
	// waits behind it.
	dev.HangNext()
	running := command(t, "dev-1", topics.OpPushText, map[string]string{"text": "hangs"})
	queued := command(t, "dev-1", topics.OpPushText, map[string]string{"text": "failed at the move"})
	w.send(running)
	w.send(queued)
	w.waitReply("dev-1", queued.ID, companion.StateDelivered)
	br.stop(t)

	// dev-1 moves to another bridge while this one is stopped.
	filter := mustCommandsFilter(t, "dev-1")
	hook.refuse(filter)
	log := newSubscribeLog()
	startBridge(t, b, nil, w, bridgeConfig{
		dataDir: dir,
		devices: []*sim.Device{dev, other},
		logger:  slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	marker := command(t, "dev-2", topics.OpPushText, map[string]string{"text": "dev-2 is served on"})
	w.send(marker)
	if r := w.waitFinal("dev-2", marker.ID); r.State != companion.StateSucceeded {
		t.Fatalf("dev-2: %s reply; want succeeded", r.State)
	}
	for _, c := range []topics.Command{running, queued} {
		if n := dev.Executions(c.ID); n != 0 {
			t.Fatalf("%s ran %d times after the restart while the broker refused its device", c.Payload, n)
		}
	}
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")

	hook.grant(filter)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 3)
	for _, c := range []topics.Command{running, queued} {
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Fatalf("%s once granted: %s reply; want succeeded", c.Payload, r.State)
		}
		if n := dev.Executions(c.ID); n != 1 {
			t.Errorf("%s ran %d times; want once", c.Payload, n)
		}
	}
}

// A bridge restarted after it was deleted on the server (or given another
// secret): the broker refuses its login, and the server failed the
// commands its spool holds. The bridge holds them from the start, rather
// than run them before the broker answers its CONNECT, and runs them once
// the broker lets it in (docs/reliability.md, bugs 243 and 249).
func TestCommandsHeldWhenTheLoginIsRefusedAtRestart(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()
	held := command(t, "dev-1", topics.OpPushText, map[string]string{"text": "failed at the deletion"})
	if err := agent.SpoolCommands(dir, []topics.Command{held}); err != nil {
		t.Fatal(err)
	}
	b.hook.refuse.Store(true)
	log := newSubscribeLog()
	a, err := agent.New(agent.Options{MQTTURL: b.url, Password: testSecret, BridgeID: "b1", DataDir: dir,
		Devices: []agent.Device{dev}, Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	br := &bridge{Agent: a, id: "b1", dataDir: dir, done: make(chan error, 1)}
	go func() { br.done <- a.Run(context.Background()) }()
	t.Cleanup(func() { br.stop(t) })
	log.waitLine(t, "refuses the bridge's id and secret")
	log.waitAny(t, []string{"holding the device's commands", "device_id=dev-1"}, []string{"command succeeded", held.ID})
	if n := dev.Executions(held.ID); n != 0 {
		t.Fatalf("the spooled command ran %d times while the broker refused the bridge", n)
	}

	b.hook.refuse.Store(false)
	if r := w.waitFinal("dev-1", held.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the held command once let in: %s reply; want succeeded", r.State)
	}
}

// silentBroker accepts connections and never answers: a broker, or a
// firewall, that swallows the bridge's CONNECT.
func silentBroker(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	tb.Cleanup(func() {
		l.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return "tcp://" + l.Addr().String()
}

// A bridge that cannot reach the broker at start runs what its spool
// holds, as one away from the broker does: here a broker that takes the
// connection and never answers, for which no attempt to connect fails
// before its timeout. The bridge waits for a connection a bounded time
// only (agent.SetStartHold; connectTimeout outside tests). TestBrokerDown
// has nothing listening.
func TestSpooledCommandsRunWhenTheBrokerDoesNotAnswerAtStart(t *testing.T) {
	dir := t.TempDir()
	dev := newSim("dev-1")
	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "offline work"})
	if err := agent.SpoolCommands(dir, []topics.Command{c}); err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Options{MQTTURL: silentBroker(t), BridgeID: "b1", DataDir: dir, Devices: []agent.Device{dev}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	a.SetStartHold(100 * time.Millisecond)
	br := &bridge{Agent: a, id: "b1", dataDir: dir, done: make(chan error, 1)}
	go func() { br.done <- a.Run(context.Background()) }()
	t.Cleanup(func() { br.stop(t) })
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(5 * time.Second) // within paho's 10 s attempt, which would end the wait too
	for dev.Executions(c.ID) == 0 {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatal("the spooled command did not run while the broker did not answer")
		}
	}
}

// A device is moved off the bridge while the bridge runs one of its
// commands, another queued behind it: the move disconnects the bridge,
// which connects again at once and subscribes, and the running command
// ends before the broker answers (NATS takes seconds for a few hundred
// filters). The queued one, which the server failed at the move, waits for
// the answer rather than run on what the last connection said, and is then
// held, the device's filter refused (docs/reliability.md, bugs 240 and
// 250).
func TestCommandsWaitForAReconnectsSubscriptionsToBeAnswered(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	q := startBlockedQueue(t, b)
	w, dev, log, behind := q.w, q.dev, q.log, q.behind

	filter := mustCommandsFilter(t, "dev-1")
	letAnswer := hook.holdSubscribes(t, "")
	hook.refuse(filter)
	b.dropClient(t, "companion-bridge-b1")
	hook.waitAsked(t, filter, 2) // the SUBSCRIBE of the new connection, not answered yet
	close(dev.release)
	waitClosed(t, dev.ended, "the first command did not end")
	log.waitAny(t, []string{"waiting for the broker's answer to the subscriptions", "device_id=dev-1"}, []string{"command succeeded", behind.ID})
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times before the broker answered the subscriptions of the new connection", n)
	}

	letAnswer()
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times while the broker refused its device", n)
	}
	hook.grant(filter)
	if r := w.waitFinal("dev-1", behind.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the held command once granted: %s reply; want succeeded", r.State)
	}
}

// A bridge deleted on the server while it runs a command of dev-1, another
// queued behind it, and made again: the broker refused its login
// meanwhile, and lets it in again, but dev-1, taken off the bridge as it
// was deleted, is not its device any more. The queued command, which the
// server failed at the deletion, stays held as the login is let in, until
// the broker answers the subscriptions (it refuses dev-1's), rather than
// run in between (docs/reliability.md, bugs 243 and 250).
func TestCommandsHeldAsTheLoginIsLetInUntilTheSubscriptionsAreAnswered(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	q := startBlockedQueue(t, b)
	w, dev, log, behind := q.w, q.dev, q.log, q.behind

	filter := mustCommandsFilter(t, "dev-1")
	hook.refuse(filter)
	hook.refuseLogin.Store(true)
	b.dropClient(t, "companion-bridge-b1")
	log.waitLine(t, "refuses the bridge's id and secret")
	close(dev.release)
	waitClosed(t, dev.ended, "the first command did not end")
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")

	hook.refuseLogin.Store(false)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	log.waitAny(t, []string{"holding the device's commands: the broker refuses them", "device_id=dev-1"}, []string{"command succeeded", behind.ID})
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times as the broker let the bridge in, refusing its device", n)
	}
	hook.grant(filter)
	if r := w.waitFinal("dev-1", behind.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the held command once granted: %s reply; want succeeded", r.State)
	}
}

// A bridge of 40 devices reconnects, and the broker answers the first
// chunk of its SUBSCRIBEs (32 devices) but holds the second, as NATS does
// for a while with a fleet's subscriptions (each makes a consumer). A
// command of a device of the first chunk runs meanwhile: the broker
// granted its filter on this connection. Only the devices whose filter is
// not answered yet wait (bug 250's hold is per device).
func TestAGrantedDeviceDoesNotWaitForTheRestOfTheRound(t *testing.T) {
	sims := subscribeSims(40)
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	subscribeBridge(t, b, sims, time.Minute)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 1)

	last := mustCommandsFilter(t, "dev-39")
	letAnswer := hook.holdSubscribes(t, last)
	b.dropClient(t, "companion-bridge-b1")
	hook.waitAsked(t, last, 2) // the first chunk answered; the second held

	cmd := command(t, "dev-00", topics.OpPushText, map[string]string{"text": "granted, so it runs"})
	w.send(cmd)
	testenv.Eventually(t, waitLong, "dev-00's command to run while the second chunk is unanswered", func() bool {
		return sims[0].Executions(cmd.ID) == 1
	})
	letAnswer()
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
}

// Paho runs the bridge's connection-lost handler in a goroutine of its
// own, beside its reconnect: the handler of a lost connection can run
// after the next connection has said "online". The bridge then marked
// itself offline on a connection that was open, and published no final
// reply nor status until the next reconnect: a command ran on the device
// and read delivered on the server for good (docs/reliability.md, bug 290).
func TestALateConnectionLostHandlerLeavesTheNextConnectionOnline(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	log := newSubscribeLog()
	startBridge(t, b, nil, w, bridgeConfig{
		devices: []*sim.Device{dev},
		logger:  slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	agent.SetHookLost(t, func() {
		once.Do(func() { close(held) })
		<-release
	})
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo)

	b.dropClient(t, "companion-bridge-b1")
	waitClosed(t, held, "the connection-lost handler did not run")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2) // the next connection, its handler held
	letGo()
	log.waitLine(t, "MQTT connection lost")

	cmd := command(t, "dev-1", topics.OpPushText, map[string]string{"text": "after the flap"})
	w.send(cmd)
	if r := w.waitFinal("dev-1", cmd.ID); r.State != companion.StateSucceeded {
		t.Fatalf("dev-1: %s reply; want succeeded", r.State)
	}
}

// A device is moved off the bridge while the bridge runs one of its
// commands, another queued behind it, and the broker, reconnected to,
// leaves the new connection's SUBSCRIBE unanswered past the bridge's
// timeout (NATS making a fleet's subscriptions, a broker busy). The bridge
// is connected: it cannot tell a move from a slow broker, and the server
// failed the queued command at the move (device_not_served). So the
// command stays held while the filter's SUBACK is missing, the filter
// asked for again, rather than run as if the broker had granted it; it is
// held on once the broker refuses the filter, and runs once it grants it
// (docs/reliability.md, bugs 249, 250 and 291). A bridge away from the
// broker still runs what it holds (TestBrokerDown).
func TestCommandsHeldWhileTheirFiltersSUBACKIsMissing(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	q := startBlockedQueueWith(t, b, bridgeConfig{subscribeTimeout: 300 * time.Millisecond})
	w, dev, log, behind := q.w, q.dev, q.log, q.behind

	filter := mustCommandsFilter(t, "dev-1")
	letAnswer := hook.holdSubscribes(t, "")
	hook.refuse(filter)
	b.dropClient(t, "companion-bridge-b1")
	hook.waitAsked(t, filter, 2) // the SUBSCRIBE of the new connection, held
	log.waitLine(t, "no SUBACK in time")
	close(dev.release)
	waitClosed(t, dev.ended, "the first command did not end")
	log.waitAny(t, []string{"waiting for the broker's answer to the subscriptions", "device_id=dev-1"}, []string{"command succeeded", behind.ID})
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times while the broker had not answered its filter's SUBSCRIBE", n)
	}

	letAnswer()
	log.waitLine(t, "holding the device's commands", "device_id=dev-1")
	if n := dev.Executions(behind.ID); n != 0 {
		t.Fatalf("the command queued behind ran %d times while the broker refused its device", n)
	}
	hook.grant(filter)
	if r := w.waitFinal("dev-1", behind.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the held command once granted: %s reply; want succeeded", r.State)
	}
}
