package broker

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"
)

// cutOnCommand is a mochi hook that, once armed, holds the next command
// PUBLISH it reads until cut is called, and then ends that client's
// connection without taking the message in: the command, and every one
// the client wrote after it meanwhile, are lost unacknowledged, as when the
// network between the server and its MQTT broker fails under way.
type cutOnCommand struct {
	mochi.HookBase
	armed   atomic.Bool
	release chan struct{}
	once    sync.Once
}

func newCutOnCommand() *cutOnCommand { return &cutOnCommand{release: make(chan struct{})} }

func (h *cutOnCommand) ID() string { return "cut-on-command" }

func (h *cutOnCommand) Provides(b byte) bool { return b == mochi.OnPacketRead }

func (h *cutOnCommand) OnPacketRead(_ *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Type != packets.Publish {
		return pk, nil
	}
	if t, err := tree.Parse(pk.TopicName); err != nil || t.Kind != topics.KindCommand || !h.armed.CompareAndSwap(true, false) {
		return pk, nil
	}
	<-h.release // the connection's reading stops here: what follows waits unread
	// mochi ends the connection of a packet a hook rejects (and ignores a
	// hook's other errors).
	return pk, packets.ErrRejectPacket
}

// cut lets the held command go, and its connection with it.
func (h *cutOnCommand) cut() { h.once.Do(func() { close(h.release) }) }

// holdReply is a mochi hook that, once armed, stops reading the connection
// of the next client that publishes a reply, at that reply, until
// released: a bridge whose replies do not reach the server for a while (a
// NATS node gone with its connection). held is closed once it holds one.
type holdReply struct {
	mochi.HookBase
	armed   atomic.Bool
	held    chan struct{}
	release chan struct{}
	once    sync.Once
}

func newHoldReply() *holdReply {
	return &holdReply{held: make(chan struct{}), release: make(chan struct{})}
}

func (h *holdReply) ID() string { return "hold-reply" }

func (h *holdReply) Provides(b byte) bool { return b == mochi.OnPacketRead }

func (h *holdReply) OnPacketRead(_ *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Type != packets.Publish {
		return pk, nil
	}
	if t, err := tree.Parse(pk.TopicName); err != nil || t.Kind != topics.KindReplies || !h.armed.CompareAndSwap(true, false) {
		return pk, nil
	}
	close(h.held)
	<-h.release
	return pk, nil
}

// let reads the held reply, and goes on.
func (h *holdReply) let() { h.once.Do(func() { close(h.release) }) }

// testClient is the server's paho client, noting the id of every command
// (not cancel) it has been handed to publish, and failing the next publish
// of the text push failText, at once and without sending it: as paho's
// Publish does when it cannot take a message ("publish was broken by
// timeout" when its writer has been stuck for the write timeout, 30 s by
// default, on a connection that is still up). It can also hold a publish
// (holdNext).
type testClient struct {
	mqtt.Client
	mu       sync.Mutex
	ids      map[string]bool
	order    []string // the ids of ids, in the order each was first handed over
	failText string
	// holdText, when set, holds the next publish of that text push in
	// Publish until unhold is closed, after closing holding.
	holdText string
	holding  chan struct{}
	unhold   chan struct{}
	// lateText, when set, has the next publish of that text push reach
	// the broker only once lateGo is closed, while Publish returns at once
	// and later publishes go straight through: a message the broker
	// delivers after newer ones (a NATS node's redelivery after its ack
	// wait).
	lateText string
	lateGo   chan struct{}
	// lostAckText, when set, has the next publish of that text push go out
	// while its token waits, and fails once lostAck is closed: a PUBACK
	// lost with a connection, the broker having the message all the same.
	lostAckText string
	lostAck     chan struct{}
}

func newTestClient() *testClient { return &testClient{ids: map[string]bool{}} }

// newClient is for Options.NewClient.
func (c *testClient) newClient(o *mqtt.ClientOptions) mqtt.Client {
	c.Client = mqtt.NewClient(o)
	return c
}

func (c *testClient) Publish(topic string, qos byte, retained bool, payload any) mqtt.Token {
	b, _ := payload.([]byte)
	cmd, err := topics.ParseCommand(b)
	if err != nil || cmd.Op == topics.OpCancel {
		return c.Client.Publish(topic, qos, retained, payload)
	}
	var text topics.PushText
	_ = json.Unmarshal(cmd.Payload, &text)
	c.mu.Lock()
	if c.holdText != "" && text.Text == c.holdText {
		c.holdText = ""
		c.mu.Unlock()
		close(c.holding)
		<-c.unhold
		c.mu.Lock()
	}
	if c.lostAckText != "" && text.Text == c.lostAckText {
		c.lostAckText = ""
		c.ids[cmd.ID] = true
		c.order = append(c.order, cmd.ID)
		lost := c.lostAck
		c.mu.Unlock()
		c.Client.Publish(topic, qos, retained, payload)
		tok := &lateToken{done: make(chan struct{})}
		go func() {
			<-lost
			tok.err = errors.New("test: the PUBACK was lost")
			close(tok.done)
		}()
		return tok
	}
	if c.lateText != "" && text.Text == c.lateText {
		c.lateText = ""
		c.ids[cmd.ID] = true
		c.order = append(c.order, cmd.ID)
		late := c.lateGo
		c.mu.Unlock()
		tok := &lateToken{done: make(chan struct{})}
		go func() {
			<-late
			real := c.Client.Publish(topic, qos, retained, payload)
			real.Wait()
			tok.err = real.Error()
			close(tok.done)
		}()
		return tok
	}
	fail := c.failText != "" && text.Text == c.failText
	switch {
	case fail:
		c.failText = ""
	case !c.ids[cmd.ID]:
		c.ids[cmd.ID] = true
		c.order = append(c.order, cmd.ID)
	}
	c.mu.Unlock()
	if fail {
		return failedToken{errors.New("test: publish was broken by timeout")}
	}
	return c.Client.Publish(topic, qos, retained, payload)
}

// failNext makes the next publish of the text push text fail.
func (c *testClient) failNext(text string) {
	c.mu.Lock()
	c.failText = text
	c.mu.Unlock()
}

// holdNext holds the next publish of the text push text in Publish (the
// outbox's goroutine waits there) until the function it returns is called;
// the channel is closed once the publish is held. The hold ends with the
// test at the latest.
func (c *testClient) holdNext(t *testing.T, text string) (held <-chan struct{}, release func()) {
	c.mu.Lock()
	c.holdText = text
	c.holding = make(chan struct{})
	c.unhold = make(chan struct{})
	unhold := c.unhold
	held = c.holding
	c.mu.Unlock()
	var once sync.Once
	release = func() { once.Do(func() { close(unhold) }) }
	t.Cleanup(release)
	return held, release
}

// lateNext has the next publish of the text push text reach the broker
// only when the function it returns is called (at the end of the test at
// the latest).
func (c *testClient) lateNext(t *testing.T, text string) (release func()) {
	c.mu.Lock()
	c.lateText = text
	c.lateGo = make(chan struct{})
	late := c.lateGo
	c.mu.Unlock()
	var once sync.Once
	release = func() { once.Do(func() { close(late) }) }
	t.Cleanup(release)
	return release
}

// loseAckNext has the next publish of the text push text reach the broker,
// and its token fail when the function it returns is called (at the end of
// the test at the latest).
func (c *testClient) loseAckNext(t *testing.T, text string) (fail func()) {
	c.mu.Lock()
	c.lostAckText = text
	c.lostAck = make(chan struct{})
	lost := c.lostAck
	c.mu.Unlock()
	var once sync.Once
	fail = func() { once.Do(func() { close(lost) }) }
	t.Cleanup(fail)
	return fail
}

// failed reports whether the publish failNext asked for has failed.
func (c *testClient) failed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failText == ""
}

func (c *testClient) published(ids []string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range ids {
		if !c.ids[id] {
			return false
		}
	}
	return true
}

// firstPublished returns the commands of ids handed over, in the order
// each was handed over the first time.
func (c *testClient) firstPublished(ids []string) []string {
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var got []string
	for _, id := range c.order {
		if want[id] {
			got = append(got, id)
		}
	}
	return got
}

// lateToken is the token of a publish that lateNext delays.
type lateToken struct {
	done chan struct{}
	err  error // set before done is closed
}

func (t *lateToken) Wait() bool { <-t.done; return true }
func (t *lateToken) WaitTimeout(d time.Duration) bool {
	select {
	case <-t.done:
		return true
	case <-time.After(d):
		return false
	}
}
func (t *lateToken) Done() <-chan struct{} { return t.done }
func (t *lateToken) Error() error {
	select {
	case <-t.done:
		return t.err
	default:
		return nil
	}
}

// failedToken is a publish token that failed as it was made.
type failedToken struct{ err error }

func (t failedToken) Wait() bool                     { return true }
func (t failedToken) WaitTimeout(time.Duration) bool { return true }
func (t failedToken) Done() <-chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}
func (t failedToken) Error() error { return t.err }

// orderEnv is a server and a real bridge (the agent, with one simulated
// device, dev-1) on a bare mochi broker, over TCP, with the server's paho
// client wrapped in a testClient.
type orderEnv struct {
	*env
	srv    *mochi.Server
	url    string
	client *testClient
	dev    *sim.Device
	gate   *gatedDevice // dev as the bridge has it
}

// gatedDevice is a simulated device that, once told to, holds the text
// push of one text before it runs it, until the test lets it go: a device
// busy with a command, while the bridge queues those that come after.
type gatedDevice struct {
	*sim.Device
	mu      sync.Mutex
	text    string
	entered chan struct{}
	open    chan struct{}
}

// hold makes the next push of text wait until the function it returns is
// called; the channel is closed once it waits. It ends with the test at
// the latest.
func (g *gatedDevice) hold(t *testing.T, text string) (waiting <-chan struct{}, release func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.text, g.entered, g.open = text, make(chan struct{}), make(chan struct{})
	open := g.open
	var once sync.Once
	release = func() { once.Do(func() { close(open) }) }
	t.Cleanup(release)
	return g.entered, release
}

func (g *gatedDevice) PushText(ctx context.Context, cmdID, title, text string) error {
	g.mu.Lock()
	held := g.text != "" && text == g.text
	entered, open := g.entered, g.open
	if held {
		g.text = ""
	}
	g.mu.Unlock()
	if held {
		close(entered)
		select {
		case <-open:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.Device.PushText(ctx, cmdID, title, text)
}

// newOrderEnv starts the broker with hooks besides AllowAll and the bridge,
// waits for the bridge's subscription, and makes the server, not started
// (newServer).
func newOrderEnv(t *testing.T, hooks ...mochi.Hook) *orderEnv {
	t.Helper()
	srv, url := mochitest.Start(t, append([]mochi.Hook{new(mochitest.AllowAll)}, hooks...)...)
	ctx := context.Background()
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	require.NoError(t, db.CreateBridge(ctx, companion.Bridge{ID: "b1", SecretHash: []byte("not used: the broker lets everyone in")}))
	require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "dev-1", Model: "sim-1", BridgeID: "b1"}))

	o := &orderEnv{env: &env{db: db, clock: &clock{now: time.Now()}}, srv: srv, url: url}
	bind(t, o.env, "dev-1")
	o.dev = sim.New(sim.Options{ID: "dev-1", Logger: quiet()})
	o.gate = &gatedDevice{Device: o.dev}
	a, err := agent.New(agent.Options{
		MQTTURL: url, BridgeID: "b1", Password: "secret", DataDir: t.TempDir(),
		Devices: []agent.Device{o.gate}, Logger: quiet(),
	})
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- a.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		<-ran
		a.Close()
	})
	cmdTopic, err := tree.Command("dev-1", topics.OpPushText)
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, "the bridge subscribed", func() bool {
		return len(srv.Topics.Subscribers(cmdTopic).Subscriptions) > 0
	})

	o.newServer(t)
	return o
}

// newServer makes the server anew, not started, with a testClient of its
// own. Close the one before first.
func (o *orderEnv) newServer(t *testing.T) {
	t.Helper()
	o.client = newTestClient()
	b, err := New(Options{
		Store: o.db, MQTTURL: o.url, ClientID: "server-" + t.Name(), Topics: tree,
		Logger: quiet(), Now: o.clock.Now, NewClient: o.client.newClient,
	})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	o.b = b
}

// warmUp runs a command through the server, so that the bridge is past the
// burst of its connection's first messages, which it gathers and sorts
// before it runs them: a bridge that has been running.
func (o *orderEnv) warmUp(t *testing.T) {
	t.Helper()
	o.waitSucceeded(t, submit(t, o.env, "dev-1", "warm-up", time.Hour).ID)
}

// waitSucceeded waits until every command of ids has succeeded.
func (o *orderEnv) waitSucceeded(t *testing.T, ids ...string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "the commands succeeded", func() bool {
		for _, id := range ids {
			if state(t, o.env, id).State != companion.StateSucceeded {
				return false
			}
		}
		return true
	})
}

// ranInOrder checks that the device ran ids, after skip commands before
// them, in that order and each once.
func (o *orderEnv) ranInOrder(t *testing.T, skip int, ids []string) {
	t.Helper()
	var order []string
	for _, x := range o.dev.Texts()[skip:] {
		order = append(order, x.CmdID)
	}
	assert.Equal(t, ids, order, "the order the device ran them in")
	for _, id := range ids {
		assert.Equal(t, 1, o.dev.Executions(id), "executions of %s", id)
	}
}

// Commands whose publishes are lost with the server's MQTT connection go
// out again once it is back, and a bridge that stayed connected runs them
// on its device in the order they were accepted, each once (CONTRACT §2,
// §7). Paho sends them again from its store as it reconnects, before the
// outbox can: the store must give them back in the order they were
// published (pahostore), or the bridge, which runs what arrives while its
// device is idle, runs a later command before an earlier one.
func TestCommandsLostWithTheConnectionRunInOrder(t *testing.T) {
	cut := newCutOnCommand()
	o := newOrderEnv(t, cut)
	t.Cleanup(cut.cut) // never leave mochi's reader held
	require.NoError(t, o.b.Start())
	o.warmUp(t)

	// Each goes out as it is accepted; the first is held unread, and the
	// others wait behind it on the connection, which is then cut.
	cut.armed.Store(true)
	var ids []string
	for i := range 20 {
		ids = append(ids, submit(t, o.env, "dev-1", string(rune('a'+i)), time.Hour).ID)
	}
	testenv.Eventually(t, 10*time.Second, "every command handed to paho", func() bool { return o.client.published(ids) })
	require.False(t, cut.armed.Load(), "no command was held")
	cut.cut()

	o.waitSucceeded(t, ids...)
	o.ranInOrder(t, 1, ids)
}

// A command whose publish fails at once holds back its device's later
// commands, and they go out after it, in order: the bridge runs them in
// the order they were accepted, each once (CONTRACT §2, §7). Without the
// hold, the outbox went on to the later ones of its pass, and a later
// pass published a command accepted meanwhile, before the store scan
// published the failed one after them.
func TestAFailedPublishHoldsBackItsDevicesLaterCommands(t *testing.T) {
	o := newOrderEnv(t)
	require.NoError(t, o.b.Start())
	o.warmUp(t)

	// In one pass: accepted while the server is down; once it is back, its
	// first pass publishes them back to back, and the second fails.
	require.NoError(t, o.b.Close())
	o.newServer(t)
	var ids []string
	for _, text := range []string{"a", "b", "c", "d", "e"} {
		ids = append(ids, submit(t, o.env, "dev-1", text, time.Hour).ID)
	}
	o.client.failNext("b")
	require.NoError(t, o.b.Start())
	o.waitSucceeded(t, ids...)

	// In the pass after: a command accepted once the one before it has
	// failed, with nothing else to send, goes out after it.
	o.client.failNext("f")
	ids = append(ids, submit(t, o.env, "dev-1", "f", time.Hour).ID)
	testenv.Eventually(t, 10*time.Second, "the publish of f failed", o.client.failed)
	ids = append(ids, submit(t, o.env, "dev-1", "g", time.Hour).ID)

	o.waitSucceeded(t, ids...)
	assert.Equal(t, ids, o.client.firstPublished(ids), "the order they first went out in")
	o.ranInOrder(t, 1, ids)
}

// A command that reaches the bridge after the ones accepted behind it (a
// NATS node's redelivery after its ack wait, here a publish the test
// delays) still runs first, and the device runs all in the order they were
// accepted (CONTRACT §2): each names the command before it, and the bridge
// waits for that one (docs/reliability.md, bug 92). Without the wait the
// bridge ran the later ones as they came.
func TestACommandDeliveredLateRunsBeforeTheOnesAfterIt(t *testing.T) {
	o := newOrderEnv(t)
	require.NoError(t, o.b.Start())
	o.warmUp(t)

	release := o.client.lateNext(t, "a")
	var ids []string
	for _, text := range []string{"a", "b", "c"} {
		ids = append(ids, submit(t, o.env, "dev-1", text, time.Hour).ID)
	}
	// b and c are with the bridge (it says delivered), and wait for a.
	testenv.Eventually(t, 10*time.Second, "b and c delivered", func() bool {
		delivered := companion.Rank(companion.StateDelivered)
		return companion.Rank(state(t, o.env, ids[1]).State) >= delivered && companion.Rank(state(t, o.env, ids[2]).State) >= delivered
	})
	assert.Len(t, o.dev.Texts(), 1, "the device ran only the warm-up before a came")
	release()
	o.waitSucceeded(t, ids...)
	o.ranInOrder(t, 1, ids)
}

// A command whose PUBACK is lost may be with the bridge all the same: it
// does not expire the instant its TTL passes, while the bridge's replies
// may be on their way, but with the grace, as a sent one does (CONTRACT §2:
// expired means never delivered). Before, the failed publish took it off
// the commands in flight, and the sweep expired it at its TTL though the
// device ran it.
func TestACommandWhosePUBACKWasLostExpiresOnlyWithTheGrace(t *testing.T) {
	hold := newHoldReply()
	o := newOrderEnv(t, hold)
	t.Cleanup(hold.let)
	ctx := context.Background()
	require.NoError(t, o.db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "dev-2", Model: "sim-1"}))
	bind(t, o.env, "dev-2")
	require.NoError(t, o.b.Start())
	o.warmUp(t)

	lose := o.client.loseAckNext(t, "x")
	hold.armed.Store(true)
	x := submit(t, o.env, "dev-1", "x", time.Minute)
	select {
	case <-hold.held: // the bridge has x, and its reply waits
	case <-time.After(10 * time.Second):
		t.Fatal("the bridge did not answer x")
	}
	lose()
	testenv.Eventually(t, 10*time.Second, "x's publish failed", func() bool { return !o.b.isFlying(x.ID) || o.b.mayBeOut(x.ID) })
	// A command of a device no bridge serves never goes out: it expires at
	// its TTL, in the sweep that also looks at x (soonest first).
	never := submit(t, o.env, "dev-2", "never", time.Minute)
	o.clock.Add(90 * time.Second) // past both TTLs, within the grace
	testenv.Eventually(t, 10*time.Second, "the sweep", func() bool { return state(t, o.env, never.ID).State == companion.StateExpired })
	assert.NotEqual(t, companion.StateExpired, state(t, o.env, x.ID).State, "x expired at its TTL while the bridge had it")

	hold.let()
	o.waitSucceeded(t, x.ID)
	assert.Equal(t, 1, o.dev.Executions(x.ID))
}

// passHeldOnFirst accepts two commands of dev-1 ("a", then "b") while the
// server is down, and starts it again: its first pass reads both from the
// store and publishes them one after the other. The pass is held on the
// publish of the first until release is called.
func (o *orderEnv) passHeldOnFirst(t *testing.T) (first, second companion.Command, release func()) {
	t.Helper()
	require.NoError(t, o.b.Start())
	o.warmUp(t)
	require.NoError(t, o.b.Close())
	o.newServer(t)
	first = submit(t, o.env, "dev-1", "a", time.Hour)
	second = submit(t, o.env, "dev-1", "b", time.Hour)
	held, release := o.client.holdNext(t, "a")
	require.NoError(t, o.b.Start())
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the first command was not published")
	}
	return first, second, release
}

// A command canceled while the outbox publishes what it read of the store
// is not published, and never runs: the outbox read it queued before the
// cancel, and held nothing of it yet (CONTRACT §2: a cancel takes a
// command the bridge does not have, and canceled is final).
func TestCanceledWhileTheOutboxPublishesNeverRuns(t *testing.T) {
	o := newOrderEnv(t)
	first, canceled, release := o.passHeldOnFirst(t)
	got, err := o.b.Cancel(context.Background(), canceled.ID)
	require.NoError(t, err)
	require.Equal(t, companion.StateCanceled, got.State)
	release()

	// The device runs a device's commands in order: once the one after
	// has run, the canceled one would have run before it.
	after := submit(t, o.env, "dev-1", "c", time.Hour)
	o.waitSucceeded(t, first.ID, after.ID)
	assert.Zero(t, o.dev.Executions(canceled.ID), "executions of the canceled command")
	assert.False(t, o.client.published([]string{canceled.ID}), "the canceled command was published")
	assert.Equal(t, companion.StateCanceled, state(t, o.env, canceled.ID).State)
	o.ranInOrder(t, 1, []string{first.ID, after.ID})
}

// Commands an unbind ends while the outbox publishes what it read of the
// store are not published after their end (Ended): the stale copy would go
// out after the cancel that withdraws them, to whichever bridge serves the
// device by then (its next owner's, CONTRACT §9).
func TestEndedWhileTheOutboxPublishesIsNotPublished(t *testing.T) {
	ctx := context.Background()
	o := newOrderEnv(t)
	first, ended, release := o.passHeldOnFirst(t)
	unbound, err := o.db.Unbind(ctx, "dev-1", "u1")
	require.NoError(t, err)
	o.b.Ended(unbound.Ended)
	release()

	// Bound again, the device takes a new command: by the time it has
	// run, the stale copy would have gone out.
	bind(t, o.env, "dev-1")
	after := submit(t, o.env, "dev-1", "c", time.Hour)
	o.waitSucceeded(t, after.ID)
	assert.False(t, o.client.published([]string{ended.ID}), "a command ended by the unbind was published")
	assert.Zero(t, o.dev.Executions(ended.ID), "executions of the ended command")
	assert.Equal(t, companion.StateCanceled, state(t, o.env, first.ID).State)
}

// watchReplies subscribes to the replies of device on the broker at url
// and hands over each, in order.
func watchReplies(t *testing.T, url, device string) <-chan topics.Reply {
	t.Helper()
	replies := make(chan topics.Reply, 100)
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("watcher-" + t.Name()))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
	t.Cleanup(func() { c.Disconnect(0) })
	topic, err := tree.Replies(device)
	require.NoError(t, err)
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) {
		if r, err := topics.ParseReply(m.Payload()); err == nil {
			replies <- r
		}
	}), 5*time.Second))
	return replies
}

// A command whose publish got no PUBACK within the publish timeout may
// still reach the bridge: paho keeps it and sends it again after a
// reconnect. Canceled meanwhile, it is withdrawn with a cancel message,
// which the bridge obeys while the command waits in its queue; without
// one, the bridge runs a command the server reads canceled.
func TestCanceledAfterItsPublishTimedOutNeverRuns(t *testing.T) {
	ctx := context.Background()
	cut := newCutOnCommand()
	o := newOrderEnv(t, cut)
	t.Cleanup(cut.cut) // never leave mochi's reader held
	o.b.opts.PublishTimeout = 300 * time.Millisecond
	require.NoError(t, o.b.Start())
	o.warmUp(t)

	// The device is busy: what the bridge takes now waits in its queue.
	busyWaiting, unbusy := o.gate.hold(t, "busy")
	busy := submit(t, o.env, "dev-1", "busy", time.Hour)
	select {
	case <-busyWaiting:
	case <-time.After(10 * time.Second):
		t.Fatal("the device did not start the first command")
	}
	replies := watchReplies(t, o.url, "dev-1")

	// Its publish is held unread until the server gives up waiting for
	// the PUBACK; the connection is then cut, and paho sends it again.
	cut.armed.Store(true)
	c := submit(t, o.env, "dev-1", "c", time.Hour)
	testenv.Eventually(t, 10*time.Second, "the publish timed out", func() bool {
		return !cut.armed.Load() && o.b.mayBeOut(c.ID)
	})
	got, err := o.b.Cancel(ctx, c.ID)
	require.NoError(t, err)
	require.Equal(t, companion.StateCanceled, got.State)
	cut.cut()

	// The bridge's first word about it: it has it, or it took it off.
	r := firstReply(t, replies, c.ID)
	t.Logf("the bridge's first reply for the canceled command: %s", r.State)
	unbusy()
	after := submit(t, o.env, "dev-1", "after", time.Hour)
	o.waitSucceeded(t, busy.ID, after.ID)
	assert.Zero(t, o.dev.Executions(c.ID), "executions of the canceled command")
	assert.Equal(t, companion.StateCanceled, state(t, o.env, c.ID).State)
}

// firstReply returns the first reply of replies for the command id,
// failing t if none comes within 10 s.
func firstReply(t *testing.T, replies <-chan topics.Reply, id string) topics.Reply {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case r := <-replies:
			if r.CommandID == id {
				return r
			}
		case <-timeout:
			t.Fatalf("no reply for %s", id)
			return topics.Reply{}
		}
	}
}

// A command that expires while an outbox pass publishes what it read of
// the store is not published after its end: the sweep expired it (it had
// not gone out), and the stale queued copy went out all the same, to a
// bridge whose clock may let it run (CONTRACT §7: none is delivered after
// it expired). Here the pass is held on the command before it, past the
// TTL on the server's clock; the bridge's clock is behind it.
func TestExpiredWhileTheOutboxPublishesIsNotPublished(t *testing.T) {
	o := newOrderEnv(t)
	require.NoError(t, o.b.Start())
	o.warmUp(t)
	require.NoError(t, o.b.Close())
	o.newServer(t)
	o.b.opts.SweepInterval = 20 * time.Millisecond
	first := submit(t, o.env, "dev-1", "a", time.Hour)
	expiring := submit(t, o.env, "dev-1", "b", time.Minute)
	held, release := o.client.holdNext(t, "a")
	require.NoError(t, o.b.Start())
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the first command was not published")
	}
	o.clock.Add(2 * time.Minute) // past the second's TTL: the sweep expires it
	testenv.Eventually(t, 10*time.Second, "expired", func() bool {
		return state(t, o.env, expiring.ID).State == companion.StateExpired
	})
	release()

	after := submit(t, o.env, "dev-1", "c", time.Hour)
	o.waitSucceeded(t, first.ID, after.ID)
	assert.False(t, o.client.published([]string{expiring.ID}), "the expired command was published")
	assert.Zero(t, o.dev.Executions(expiring.ID), "executions of the expired command")
	assert.Equal(t, companion.StateExpired, state(t, o.env, expiring.ID).State)
}

// mayBeOut reports whether the broker holds a command as one whose publish
// failed for want of its PUBACK.
func (b *Broker) mayBeOut(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	o := b.flying[id]
	return o != nil && o.mayBeOut
}

// The repeats of a command are spaced 5 s, then twice as long at each
// repeat, up to a minute however long SentRetry is: a later command of the
// device names a held one as the command it runs after, and a bridge that
// never had the held one waits agent.DefaultAfterWait for it before running
// the later one without it, out of order (docs/reliability.md, bug 102).
func TestRepeatSpacingDoublesUpToLessThanTheBridgesWait(t *testing.T) {
	b := &Broker{
		opts:    Options{RepeatSpacing: 5 * time.Second, SentRetry: 10 * time.Minute},
		repeats: make(map[string]map[string]*repeat),
		held:    make(map[string]time.Time),
	}
	now := time.Now()
	var spacings []time.Duration
	for range 8 {
		require.False(t, b.holdRepeat("d", "c", now), "a repeat once its spacing is over goes")
		next := b.repeats["d"]["c"].next
		spacings = append(spacings, next.Sub(now))
		assert.True(t, b.holdRepeat("d", "c", now.Add(next.Sub(now)/2)), "a repeat within the spacing waits")
		now = next
	}
	s := 5 * time.Second
	assert.Equal(t, []time.Duration{s, 2 * s, 4 * s, 8 * s, time.Minute, time.Minute, time.Minute, time.Minute}, spacings)
	assert.Less(t, maxRepeatSpacing, agent.DefaultAfterWait)
}
