package broker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/logevery"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"
)

var tree = topics.MustNew(topics.DefaultPrefix)

// bridgeAccounts admits the bridges b1 and b2, which serve what the store
// says.
type bridgeAccounts struct{ db *store.DB }

func (bridgeAccounts) Authenticate(_ context.Context, u, p string) (embedded.Identity, bool) {
	return embedded.Identity{Role: embedded.RoleBridge, ID: u}, (u == "b1" || u == "b2") && p == "secret"
}
func (bridgeAccounts) UserOwnsDevice(context.Context, string, string) bool { return false }
func (a bridgeAccounts) BridgeServesDevice(ctx context.Context, bridgeID, deviceID string) bool {
	ok, err := a.db.BridgeServes(ctx, bridgeID, deviceID)
	return err == nil && ok
}

// clock is a settable clock for expiry tests.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

type env struct {
	db    *store.DB
	mqtt  *embedded.Server
	b     *Broker
	clock *clock
}

// bind binds the devices to u1, the user of submit's commands.
func bind(t *testing.T, e *env, devices ...string) {
	t.Helper()
	for _, d := range devices {
		_, _, err := e.db.Bind(context.Background(), companion.Binding{DeviceID: d, UserID: "u1"})
		require.NoError(t, err)
	}
}

func newEnv(t *testing.T, startMQTT bool) *env {
	t.Helper()
	return newEnvStore(t, startMQTT, nil)
}

// newEnvStore is newEnv with the broker on wrap(the store) when wrap is
// set.
func newEnvStore(t *testing.T, startMQTT bool, wrap func(*store.DB) Store) *env {
	t.Helper()
	return newEnvTuned(t, startMQTT, wrap, nil)
}

// newEnvTuned is newEnvStore with the broker's options changed by tune,
// when set, before New.
func newEnvTuned(t *testing.T, startMQTT bool, wrap func(*store.DB) Store, tune func(*Options)) *env {
	t.Helper()
	e := &env{clock: &clock{now: time.Now()}}
	var err error
	e.db, err = store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Now: e.clock.Now})
	require.NoError(t, err)
	t.Cleanup(func() { e.db.Close() })
	require.NoError(t, e.db.CreateBridge(context.Background(), companion.Bridge{ID: "b1", SecretHash: []byte("not used: bridgeAccounts checks")}))
	require.NoError(t, e.db.ProvisionDevice(context.Background(), companion.RegistryDevice{ID: "dev-1", Model: "sim-1", BridgeID: "b1"}))
	require.NoError(t, e.db.ProvisionDevice(context.Background(), companion.RegistryDevice{ID: "dev-2", Model: "sim-1", BridgeID: "b1"}))
	bind(t, e, "dev-1", "dev-2") // submit's commands are u1's, and the store takes a user's commands only for their devices

	e.mqtt, err = embedded.New(embedded.Options{
		Listen: "127.0.0.1:0", Topics: tree, Accounts: bridgeAccounts{db: e.db},
		ServerUsername: "server", ServerPassword: "pw", Logger: quiet(),
	})
	require.NoError(t, err)
	require.NoError(t, e.mqtt.Start())
	t.Cleanup(func() { e.mqtt.Close() })

	var st Store = e.db
	if wrap != nil {
		st = wrap(e.db)
	}
	opts := Options{
		Store: st, MQTTURL: "tcp://" + e.mqtt.Addr(), Username: "server", Password: "pw",
		ClientID: "server-" + t.Name(), Topics: tree, SweepInterval: 20 * time.Millisecond,
		Logger: quiet(), Now: e.clock.Now,
	}
	if inlineConn {
		opts.NewClient = e.mqtt.NewClient
	}
	if tune != nil {
		tune(&opts)
	}
	e.b, err = New(opts)
	require.NoError(t, err)
	if startMQTT {
		require.NoError(t, e.b.Start())
		t.Cleanup(func() { e.b.Close() })
		testenv.Eventually(t, 10*time.Second, "broker ready", e.b.Ready)
	}
	return e
}

// newEnvOn is newEnv with the broker on wrap(the store), which it returns
// too.
func newEnvOn[S Store](t *testing.T, wrap func(*store.DB) S) (*env, S) {
	t.Helper()
	return newEnvOnTuned(t, wrap, nil)
}

// newEnvOnTuned is newEnvOn with the broker's options changed by tune.
func newEnvOnTuned[S Store](t *testing.T, wrap func(*store.DB) S, tune func(*Options)) (*env, S) {
	t.Helper()
	var st S
	e := newEnvTuned(t, true, func(db *store.DB) Store {
		st = wrap(db)
		return st
	}, tune)
	return e, st
}

// inlineConn, when set, has newEnv connect the broker to the embedded one
// in-process (embedded.Server.NewClient), as `companion serve` does,
// instead of over TCP.
var inlineConn bool

// TestWithTheInlineConnection runs the tests of the command's life, of
// cancelling, of status and of a bridge's return over the in-process
// connection the server uses with its embedded broker.
func TestWithTheInlineConnection(t *testing.T) {
	inlineConn = true
	defer func() { inlineConn = false }()
	for name, test := range map[string]func(*testing.T){
		"CommandLifecycle":                  TestCommandLifecycle,
		"Cancel":                            TestCancel,
		"StatusOrderingAndBridgeWill":       TestStatusOrderingAndBridgeWill,
		"BridgeOnlineResendsUnfinished":     TestBridgeOnlineResendsUnfinishedCommands,
		"CommandsOfAnUnservedDeviceWait":    TestCommandsOfAnUnservedDeviceWait,
		"QueueLimit":                        TestQueueLimit,
		"SentCommandsExpireAfterTheGrace":   TestSentCommandsExpireAfterTheGrace,
		"ReplyOnAnotherDevicesTopicIgnored": TestReplyOnAnotherDevicesTopicIsIgnored,
		"OlderStatusMended":                 TestAnOlderStatusPublishedIsMendedOnTheBroker,
	} {
		t.Run(name, test)
	}
}

func quiet() *slog.Logger {
	return slog.New(slog.NewTextHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelError}))
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// fakeBridge is a real paho client acting as a bridge.
type fakeBridge struct {
	c        mqtt.Client
	commands chan topics.Command
}

func connectBridge(t *testing.T, e *env) *fakeBridge {
	t.Helper()
	return connectBridgeAs(t, e, "b1", "dev-1", "dev-2")
}

// connectBridgeAs connects a fake bridge as bridgeID, subscribed to the
// commands of devices (which it must serve: the broker refuses others).
func connectBridgeAs(t *testing.T, e *env, bridgeID string, devices ...string) *fakeBridge {
	t.Helper()
	fb := &fakeBridge{commands: make(chan topics.Command, 1000)}
	o := mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID(bridgeID).
		SetUsername(bridgeID).SetPassword("secret").SetCleanSession(false).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
			c, err := topics.ParseCommand(m.Payload())
			if err == nil {
				fb.commands <- c
			}
		})
	fb.c = mqtt.NewClient(o)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Connect(), 5*time.Second))
	t.Cleanup(func() { fb.c.Disconnect(0) })
	filters := map[string]byte{}
	for _, d := range devices {
		f, err := tree.CommandsFilter(d)
		require.NoError(t, err)
		filters[f] = 1
	}
	tok := fb.c.SubscribeMultiple(filters, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, 5*time.Second))
	for f, code := range tok.(*mqtt.SubscribeToken).Result() {
		require.NotEqual(t, byte(0x80), code, "%s refused %s", bridgeID, f)
	}
	return fb
}

func (fb *fakeBridge) next(t *testing.T) topics.Command {
	t.Helper()
	select {
	case c := <-fb.commands:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no command arrived")
		return topics.Command{}
	}
}

// none fails the test if a command reaches the bridge within d; why says
// what should have kept it.
func (fb *fakeBridge) none(t *testing.T, d time.Duration, why string) {
	t.Helper()
	select {
	case c := <-fb.commands:
		t.Errorf("%s went out: %s", c.ID, why)
	case <-time.After(d):
	}
}

// heldBack checks that the command id, repeated at first, is held back
// for the spacing (less its slack) and then goes.
func (fb *fakeBridge) heldBack(t *testing.T, b *Broker, first time.Time, id string) {
	t.Helper()
	quiet := b.opts.RepeatSpacing - repeatSlack - time.Since(first) - 500*time.Millisecond
	require.Positive(t, quiet, "the events took longer than the spacing")
	fb.none(t, quiet, "a repeat within the spacing of the last")
	assert.Equal(t, id, fb.next(t).ID, "the repeat held back goes")
	assert.GreaterOrEqual(t, time.Since(first), b.opts.RepeatSpacing-repeatSlack, "no sooner than the spacing")
}

// online has the bridge report dev online, and waits for the store to
// have it.
func (fb *fakeBridge) online(t *testing.T, e *env, dev string) {
	t.Helper()
	topic, _ := tree.Status(dev)
	fb.publish(t, topic, topics.Status{Online: true, BridgeID: "b1", Seq: 1, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, dev+" online", func() bool {
		s, err := e.db.Status(context.Background(), dev)
		return err == nil && s.Online
	})
}

// retainStatus publishes st as dev's status, retained as a bridge's are,
// and waits for the store to have its seq.
func (fb *fakeBridge) retainStatus(t *testing.T, e *env, dev string, st topics.Status) {
	t.Helper()
	topic, _ := tree.Status(dev)
	b, err := json.Marshal(st)
	require.NoError(t, err)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, b), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%s's status of seq %d stored", dev, st.Seq), func() bool {
		s, _ := e.db.Status(context.Background(), dev)
		return s.Seq == st.Seq
	})
}

func (fb *fakeBridge) publish(t *testing.T, topic string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, false, b), 5*time.Second))
}

func (fb *fakeBridge) reply(t *testing.T, dev string, r topics.Reply) {
	t.Helper()
	topic, _ := tree.Replies(dev)
	fb.publish(t, topic, r)
}

func submit(t *testing.T, e *env, dev, text string, ttl time.Duration) companion.Command {
	t.Helper()
	p, _ := json.Marshal(topics.PushText{Text: text})
	c, _, err := e.b.Submit(context.Background(), companion.Command{
		DeviceID: dev, UserID: "u1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(ttl),
	}, nil)
	require.NoError(t, err)
	return c
}

func state(t *testing.T, e *env, id string) companion.Command {
	t.Helper()
	c, err := e.db.Command(context.Background(), id)
	require.NoError(t, err)
	return c
}

func TestCommandLifecycle(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)

	c := submit(t, e, "dev-1", "hello", time.Hour)
	assert.Equal(t, companion.StateQueued, c.State)
	got := fb.next(t)
	assert.Equal(t, c.ID, got.ID)
	assert.Equal(t, topics.OpPushText, got.Op)
	assert.JSONEq(t, `{"text":"hello"}`, string(got.Payload))
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State != companion.StateQueued })

	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, c.ID).State == companion.StateDelivered })
	p := 40
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateInProgress, Progress: &p})
	testenv.Eventually(t, 10*time.Second, "in progress", func() bool { return state(t, e, c.ID).State == companion.StateInProgress })

	waitDone := make(chan companion.Command, 1)
	go func() {
		cmd, _ := e.b.Wait(context.Background(), c.ID)
		waitDone <- cmd
	}()
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, Result: json.RawMessage(`{"ok":true}`)})
	select {
	case cmd := <-waitDone:
		assert.Equal(t, companion.StateSucceeded, cmd.State)
		assert.JSONEq(t, `{"ok":true}`, string(cmd.Result))
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return")
	}

	// Replays and late replies change nothing; a final state is final.
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered})
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateFailed, Error: &topics.Error{Code: "x"}})
	// A reply for an unknown command is ignored; a marker reply on another
	// command tells us the ones before it were taken in.
	fb.reply(t, "dev-1", topics.Reply{CommandID: "01890a5d-ac96-774b-bcce-b302099a8057", State: companion.StateSucceeded})
	marker := submit(t, e, "dev-1", "marker", time.Hour)
	fb.next(t)
	fb.reply(t, "dev-1", topics.Reply{CommandID: marker.ID, State: companion.StateFailed, Error: &topics.Error{Code: "device_error"}})
	testenv.Eventually(t, 10*time.Second, "marker", func() bool { return state(t, e, marker.ID).State == companion.StateFailed })
	final := state(t, e, c.ID)
	assert.Equal(t, companion.StateSucceeded, final.State)
	assert.Nil(t, final.Error)
	assert.Equal(t, "device_error", state(t, e, marker.ID).Error.Code)
}

// bridgeReads is a store that, once armed, counts the reads of devices'
// bridges, and holds the first one until release is closed.
type bridgeReads struct {
	*store.DB
	armed   atomic.Bool
	reads   atomic.Int64
	first   sync.Once
	release chan struct{}
}

func (s *bridgeReads) hold() {
	if !s.armed.Load() {
		return
	}
	s.reads.Add(1)
	s.first.Do(func() { <-s.release })
}

func (s *bridgeReads) DeviceBridge(ctx context.Context, deviceID string) (string, error) {
	s.hold()
	return s.DB.DeviceBridge(ctx, deviceID)
}

func (s *bridgeReads) DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error) {
	s.hold()
	return s.DB.DeviceBridges(ctx, deviceIDs)
}

func (s *bridgeReads) RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error) {
	s.hold()
	return s.DB.RegistryDevice(ctx, id)
}

// Replies and statuses that arrive while the store reads a device's bridge
// are taken in together, with one read of their devices' bridges (bug 98):
// read one by one, each waited for the one before, and on a
// busy PostgreSQL replies came in slower than a bridge sends them.
func TestMessagesThatArriveTogetherAreTakenWithOneRead(t *testing.T) {
	// Every report is taken as it comes (no reportGate): a status the
	// gate holds is taken later with a read of its own, and how many the
	// gate holds depends on how fast the machine takes the batch in (it
	// refills a token a second). With the gate on, a busy machine made
	// five reads of this test's batch.
	e, reads := newEnvOnTuned(t, func(db *store.DB) *bridgeReads {
		return &bridgeReads{DB: db, release: make(chan struct{})}
	}, func(o *Options) { o.ReportRate = -1 })
	released := sync.OnceFunc(func() { close(reads.release) })
	t.Cleanup(released) // before the broker's Close, which waits for the held read
	fb := connectBridge(t, e)
	// Both devices read online first: a device coming online has its
	// commands go again, with reads of its bridge.
	seq := map[string]uint64{"dev-1": 1, "dev-2": 1}
	for dev := range seq {
		fb.online(t, e, dev)
	}
	const n = 40
	var cmds []companion.Command
	for i := range n {
		c := submit(t, e, []string{"dev-1", "dev-2"}[i%2], fmt.Sprint("text ", i), time.Hour)
		fb.next(t)
		cmds = append(cmds, c)
	}
	for _, c := range cmds {
		testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })
	}
	// A first status's read is held; the replies and statuses arrive
	// meanwhile, and wait for intake all together.
	reads.armed.Store(true)
	first, _ := tree.Status("dev-1")
	seq["dev-1"]++
	fb.publish(t, first, topics.Status{Online: true, BridgeID: "b1", Seq: seq["dev-1"], At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the first read", func() bool { return reads.reads.Load() == 1 })
	p := 50
	for _, c := range cmds {
		fb.reply(t, c.DeviceID, topics.Reply{CommandID: c.ID, State: companion.StateInProgress, Progress: &p})
		seq[c.DeviceID]++
		topic, _ := tree.Status(c.DeviceID)
		fb.publish(t, topic, topics.Status{Online: true, BridgeID: "b1", Seq: seq[c.DeviceID], At: time.Now()})
		fb.reply(t, c.DeviceID, topics.Reply{CommandID: c.ID, State: companion.StateSucceeded})
	}
	testenv.Eventually(t, 10*time.Second, "all waiting for intake", func() bool { return len(e.b.inbox) == 3*n })
	released()
	for _, c := range cmds {
		testenv.Eventually(t, 10*time.Second, "succeeded", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	}
	for dev, last := range seq {
		testenv.Eventually(t, 10*time.Second, "the last status", func() bool {
			s, err := e.db.Status(context.Background(), dev)
			return err == nil && s.Seq == last && s.Online
		})
	}
	assert.LessOrEqual(t, reads.reads.Load(), int64(4), "reads for %d replies and %d statuses", 2*n, n)
}

// failingStore is a store whose reads of devices' bridges fail while
// failReads is set, whose reads of statuses fail while failStatus is,
// whose writes of statuses and settings fail while failWrites is, and
// whose writes of "sent" fail while failSent is; fails counts the
// failures.
type failingStore struct {
	*store.DB
	failReads, failStatus, failWrites, failSent, failReplies atomic.Bool
	fails                                                    atomic.Int64
}

var errStoreDown = errors.New("store down (test)")

func (s *failingStore) failing(flag *atomic.Bool) bool {
	if flag.Load() {
		s.fails.Add(1)
		return true
	}
	return false
}

func (s *failingStore) DeviceBridge(ctx context.Context, deviceID string) (string, error) {
	if s.failing(&s.failReads) {
		return "", errStoreDown
	}
	return s.DB.DeviceBridge(ctx, deviceID)
}

func (s *failingStore) DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error) {
	if s.failing(&s.failReads) {
		return nil, errStoreDown
	}
	return s.DB.DeviceBridges(ctx, deviceIDs)
}

func (s *failingStore) Status(ctx context.Context, deviceID string) (companion.Status, error) {
	if s.failing(&s.failStatus) {
		return companion.Status{}, errStoreDown
	}
	return s.DB.Status(ctx, deviceID)
}

func (s *failingStore) UpdateCommandAsync(id string, fn func(*companion.Command) error, done func(companion.Command, error)) {
	if s.failing(&s.failSent) {
		done(companion.Command{}, errStoreDown)
		return
	}
	s.DB.UpdateCommandAsync(id, fn, done)
}

func (s *failingStore) UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	if s.failing(&s.failReplies) {
		done(companion.Command{}, errStoreDown)
		return
	}
	s.DB.UpdateCommandWithReportAsync(id, fn, report, done)
}

func (s *failingStore) PutStatusAsync(st companion.Status, done func(bool, error)) {
	if s.failing(&s.failWrites) {
		done(false, errStoreDown)
		return
	}
	s.DB.PutStatusAsync(st, done)
}

func (s *failingStore) PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(bool, error)) {
	if s.failing(&s.failWrites) {
		done(false, errStoreDown)
		return
	}
	s.DB.PutReportedSettingsAsync(deviceID, bridgeID, reported, schema, at, seq, done)
}

// A reply whose batch's read of the bridges fails is not lost: it waits,
// unacknowledged, and is taken again once the store answers.
func TestAReplyWhoseBridgeReadFailsIsTakenAgain(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *failingStore { return &failingStore{DB: db} })
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "its reply comes while the store is down", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	st.failReads.Store(true)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the batch read and a retry fail", func() bool { return st.fails.Load() >= 2 })
	assert.NotEqual(t, companion.StateSucceeded, state(t, e, c.ID).State)
	st.failReads.Store(false)
	testenv.Eventually(t, 20*time.Second, "the reply taken once the store answers", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})
}

// A final reply the store failed for every one of its attempts (about ten
// minutes: PostgreSQL down that long) is dropped, its bridge connected all
// along. The device's unfinished commands then go again once the store is
// back, and the bridge's answer, its final reply anew, ends the command;
// before, it stayed delivered until the bridge next came back. Both ways
// of failing are here: the store's write of the reply, and its read of
// the device's bridge.
func TestAFinalReplyDroppedAfterItsAttemptsIsAskedForAgain(t *testing.T) {
	for _, failing := range []string{"write", "read"} {
		t.Run(failing, func(t *testing.T) {
			e, st := newEnvOn(t, func(db *store.DB) *failingStore { return &failingStore{DB: db} })
			fb := connectBridge(t, e)
			c := deliveredCommand(t, e, fb)

			final := topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()}
			acked := make(chan struct{})
			ack := func() { close(acked) }
			if failing == "write" {
				st.failReplies.Store(true)
				e.b.takeReplyAttempt("dev-1", "b1", nil, final, ack, maxReplyAttempts)
			} else {
				e.b.takeReplyAttempt("dev-1", "", errStoreDown, final, ack, maxReplyAttempts)
			}
			select {
			case <-acked: // dropped
			case <-time.After(10 * time.Second):
				t.Fatal("the reply's last attempt was not acknowledged")
			}
			st.failReplies.Store(false)
			assert.Equal(t, companion.StateDelivered, state(t, e, c.ID).State)

			require.Equal(t, c.ID, fb.next(t).ID, "the command sent again for the bridge to answer")
			fb.reply(t, "dev-1", final)
			testenv.Eventually(t, 10*time.Second, "succeeded", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
		})
	}
}

// deliveredCommand submits a command for dev-1 whose final reply will be
// lost: the bridge takes it and says delivered, and the store has it so.
func deliveredCommand(t *testing.T, e *env, fb *fakeBridge) companion.Command {
	t.Helper()
	c := submit(t, e, "dev-1", "its final reply is lost", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, c.ID).State == companion.StateDelivered })
	return c
}

// A command asked for again lands (its "sent" written late, a reply)
// while the outbox's pass that sends it again reads the store: it still
// goes again. Before, the pass took it as answered since its read and
// skipped it, and nothing asked for it again: the final reply dropped
// was never fetched, and the command stayed delivered (bug 248;
// TestAFinalReplyDroppedAfterItsAttemptsIsAskedForAgain failed so in make
// test, the "sent" flush landing under load).
func TestACommandAskedForAgainThatLandsMeanwhileStillGoes(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *landingStore { return &landingStore{DB: db} })
	fb := connectBridge(t, e)
	c := deliveredCommand(t, e, fb)

	landed := func() { e.b.arrived(c.ID) } // the "sent" flush, late
	st.during.Store(&landed)
	e.b.replyDropped("dev-1")
	require.Equal(t, c.ID, fb.next(t).ID, "the command sent again for the bridge to answer")
}

// landingStore is a store that calls during, once, as the outbox reads
// some devices' open commands (QueuedCommandsWith).
type landingStore struct {
	*store.DB
	during atomic.Pointer[func()]
}

func (s *landingStore) QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error) {
	if f := s.during.Swap(nil); f != nil {
		(*f)()
	}
	return s.DB.QueuedCommandsWith(ctx, deviceIDs, skip)
}

// A status or settings whose read of the device's bridge, or whose write,
// the store fails is not dropped: it waits, unacknowledged, and is taken
// again once the store answers (bug 101). Dropped, the device read as
// its report before said until the bridge's next one, a minute later.
func TestAReportTheStoreFailsIsTakenAgain(t *testing.T) {
	for _, failing := range []string{"reads", "writes"} {
		t.Run(failing, func(t *testing.T) {
			e, st := newEnvOn(t, func(db *store.DB) *failingStore { return &failingStore{DB: db} })
			fb := connectBridge(t, e)
			flag := map[string]*atomic.Bool{"reads": &st.failReads, "writes": &st.failWrites}[failing]
			flag.Store(true)
			seq := uint64(time.Now().UnixNano())
			statusTopic, _ := tree.Status("dev-1")
			fb.publish(t, statusTopic, topics.Status{Online: true, FirmwareVersion: "2.0.0", BridgeID: "b1", Seq: seq, At: time.Now()})
			settingsTopic, _ := tree.Settings("dev-1")
			fb.publish(t, settingsTopic, topics.Settings{Reported: map[string]any{"volume": 7}, Seq: seq, At: time.Now()})
			testenv.Eventually(t, 10*time.Second, "the store failing them, and failing them again when they are retried", func() bool { return st.fails.Load() >= 4 })
			flag.Store(false)
			testenv.Eventually(t, 20*time.Second, "the status and settings taken once the store answers", func() bool {
				s, err := e.db.Status(context.Background(), "dev-1")
				if err != nil || s.Seq != seq || !s.Online {
					return false
				}
				set, err := e.db.Settings(context.Background(), "dev-1")
				return err == nil && set.Seq == seq
			})
		})
	}
}

// replyWrites is a store that counts the replies handed to it.
type replyWrites struct {
	*store.DB
	n atomic.Int64
}

func (s *replyWrites) UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	s.n.Add(1)
	s.DB.UpdateCommandWithReportAsync(id, fn, report, done)
}

// The bridge answers every repeat of a command it finished with its final
// reply. Those replies, for a command final here already, are dropped as
// they come, not each handed to the store to be refused there: after
// faults they come by the thousand, and each one taken to the store
// lengthened the queue of replies that kept the commands unfinished
// (bug 100).
func TestRepeatedFinalRepliesAreDroppedWithoutTheStore(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *replyWrites { return &replyWrites{DB: db} })
	fb := connectBridge(t, e)
	done := submit(t, e, "dev-1", "finished, its reply repeated", time.Hour)
	require.Equal(t, done.ID, fb.next(t).ID)
	final := topics.Reply{CommandID: done.ID, State: companion.StateSucceeded, At: time.Now()}
	fb.reply(t, "dev-1", final)
	// Known final here, not only in the store: the store's commit is seen
	// before the broker's callback notes it (a repeat that came in
	// between went to the store, and the count below was off under load).
	testenv.Eventually(t, 10*time.Second, "succeeded, and known final", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.finals.has(done.ID)
	})

	const repeats = 50
	for range repeats {
		fb.reply(t, "dev-1", final)
	}
	// Taken in order: once the next command's reply is stored, the
	// repeats before it have been taken.
	next := submit(t, e, "dev-1", "after the repeats", time.Hour)
	require.Equal(t, next.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: next.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the next command succeeded", func() bool { return state(t, e, next.ID).State == companion.StateSucceeded })
	assert.Equal(t, int64(2), st.n.Load(), "replies handed to the store: the two final ones, none of the %d repeats", repeats)
	assert.Equal(t, companion.StateSucceeded, state(t, e, done.ID).State)
}

func TestReplyOnAnotherDevicesTopicIsIgnored(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "x", time.Hour)
	fb.next(t)
	fb.reply(t, "dev-2", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded})
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, c.ID).State == companion.StateDelivered })
}

func TestCommandsGoOutInOrderOnceTheBrokerIsThere(t *testing.T) {
	e := newEnv(t, false)
	// Accepted before the MQTT connection exists: they wait as queued.
	var ids []string
	for i := 0; i < 50; i++ {
		ids = append(ids, submit(t, e, "dev-1", fmt.Sprint(i), time.Hour).ID)
	}
	fb := connectBridge(t, e)
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	// Each goes out, the first time, in order. A command may go out again
	// (the fake bridge's "online" resends what is not final, and the
	// bridge drops the repeat): repeats are skipped.
	seen := map[string]bool{}
	for _, id := range ids {
		got := fb.next(t).ID
		for seen[got] {
			got = fb.next(t).ID
		}
		seen[got] = true
		assert.Equal(t, id, got)
	}
}

func TestExpiryBeforeDelivery(t *testing.T) {
	e := newEnv(t, false)
	c := submit(t, e, "dev-1", "late", time.Minute)
	e.clock.Add(2 * time.Minute)
	fb := connectBridge(t, e)
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	testenv.Eventually(t, 10*time.Second, "expired", func() bool { return state(t, e, c.ID).State == companion.StateExpired })
	// It never went out: the next command is the first the bridge sees.
	next := submit(t, e, "dev-1", "on time", time.Hour)
	assert.Equal(t, next.ID, fb.next(t).ID)
}

func TestCancel(t *testing.T) {
	e := newEnv(t, false)
	c := submit(t, e, "dev-1", "never", time.Hour)
	got, err := e.b.Cancel(context.Background(), c.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateCanceled, got.State)
	cmd, err := e.b.Wait(context.Background(), c.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateCanceled, cmd.State)
	_, err = e.b.Cancel(context.Background(), c.ID)
	assert.ErrorIs(t, err, companion.ErrFinal)

	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	fb := connectBridge(t, e)
	d := submit(t, e, "dev-1", "delivered", time.Hour)
	assert.Equal(t, d.ID, fb.next(t).ID, "the canceled command was never published")
	fb.reply(t, "dev-1", topics.Reply{CommandID: d.ID, State: companion.StateDelivered})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, d.ID).State == companion.StateDelivered })
	_, err = e.b.Cancel(context.Background(), d.ID)
	assert.ErrorIs(t, err, ErrNotCancelable)
}

func TestStatusOrderingAndBridgeWill(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	topic, _ := tree.Status("dev-1")
	bat := func(i int) *int { return &i }
	fb.publish(t, topic, topics.Status{Online: true, Battery: bat(90), FirmwareVersion: "1.0.0", BridgeID: "b1", Seq: 10, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "status", func() bool {
		s, _ := e.db.Status(context.Background(), "dev-1")
		return s.Seq == 10
	})
	// An older report never overwrites a newer one.
	fb.publish(t, topic, topics.Status{Online: true, Battery: bat(10), BridgeID: "b1", Seq: 5})
	fb.publish(t, topic, topics.Status{Online: true, Battery: bat(80), BridgeID: "b1", Seq: 11})
	testenv.Eventually(t, 10*time.Second, "newer status", func() bool {
		s, _ := e.db.Status(context.Background(), "dev-1")
		return s.Seq == 11
	})
	s, _ := e.db.Status(context.Background(), "dev-1")
	assert.Equal(t, 80, *s.Battery)

	// A status for a device the bridge does not serve is dropped by the
	// broker (at QoS 1 it would be acknowledged all the same).
	ghost, _ := tree.Status("ghost")
	b, _ := json.Marshal(topics.Status{Online: true, Seq: 1})
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(ghost, 0, false, b), 5*time.Second))

	// What slips past the broker's rights (here: published with the
	// server's own account) is dropped by the server when the status names
	// a bridge that does not serve the device, or the device is served by
	// none (CONTRACT §9).
	intruder := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("intruder").
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Connect(), 5*time.Second))
	defer intruder.Disconnect(0)
	for _, st := range []struct {
		topic string
		s     topics.Status
	}{
		{topic, topics.Status{Online: true, Battery: bat(1), BridgeID: "b2", Seq: 99}},
		{ghost, topics.Status{Online: true, BridgeID: "b1", Seq: 99}},
	} {
		b, _ := json.Marshal(st.s)
		require.NoError(t, mqtt.WaitTokenTimeout(intruder.Publish(st.topic, 1, false, b), 5*time.Second))
	}
	fb.publish(t, topic, topics.Status{Online: true, Battery: bat(70), BridgeID: "b1", Seq: 12})
	testenv.Eventually(t, 10*time.Second, "the bridge's status after the forged ones", func() bool {
		s, _ := e.db.Status(context.Background(), "dev-1")
		return s.Seq == 12
	})

	state, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(state, 1, true, topics.BridgeOffline), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "offline", func() bool {
		s, _ := e.db.Status(context.Background(), "dev-1")
		return !s.Online
	})
	g, _ := e.db.Status(context.Background(), "ghost")
	assert.Zero(t, g.Seq)
}

// An online status naming no bridge, on the status topic (bridge_id left
// out) or in a final reply (bridge_id empty), is its serving bridge's:
// stored naming none, the device read online with no bridge, and its
// bridge's Will, which marks offline the devices whose status names it,
// left it online for good (docs/reliability.md, bug 570).
func TestAnOnlineStatusNamingNoBridgeIsItsServingBridges(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	topic, _ := tree.Status("dev-1")
	at := time.Now().UTC().Format(time.RFC3339Nano)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true,
		`{"online":true,"battery":80,"firmware_version":"1.0.0","apps":[],"at":"`+at+`","seq":1}`), 5*time.Second))
	c := submit(t, e, "dev-2", "x", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-2", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Status: &topics.Status{Online: true, FirmwareVersion: "1.0.0", Apps: []companion.App{}, Seq: 1, At: time.Now()}})
	for _, dev := range []string{"dev-1", "dev-2"} {
		testenv.Eventually(t, 10*time.Second, dev+" online", func() bool {
			s, err := e.db.Status(ctx, dev)
			return err == nil && s.Online
		})
		s, err := e.db.Status(ctx, dev)
		require.NoError(t, err)
		assert.Equal(t, "b1", s.BridgeID, "%s: the bridge its status names", dev)
	}

	state, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(state, 1, true, topics.BridgeOffline), 5*time.Second))
	for _, dev := range []string{"dev-1", "dev-2"} {
		testenv.Eventually(t, 10*time.Second, dev+" offline after its bridge's Will", func() bool {
			s, err := e.db.Status(ctx, dev)
			return err == nil && !s.Online
		})
	}
}

// When a bridge's Will fires, its devices' retained status says what the
// store says, online: false, with the last report's battery, firmware, seq
// and at: a watcher of devices/{id}/status, and whoever subscribes later,
// no longer reads online: true from a bridge that is gone (CONTRACT §3).
// An offline status from a bridge that knows nothing of the device (no
// firmware version: one the device just moved to, which never read it and
// cannot now) keeps what the store has of the device: its firmware
// version, model, battery and apps, in the store and retained for
// watchers. Taken whole, it wiped them (docs/reliability.md, bug 230).
func TestAnOfflineStatusThatKnowsNothingKeepsWhatIsKnown(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	bat := 70
	at := time.Now().UTC().Truncate(time.Millisecond)
	report := topics.Status{Online: true, Battery: &bat, FirmwareVersion: "1.2.3", Model: "sim-1",
		Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}}, BridgeID: "b1", Seq: 10, At: at}
	fb.retainStatus(t, e, "dev-1", report)
	blank := topics.Status{Online: false, Apps: []companion.App{}, BridgeID: "b1", Seq: 11, At: at.Add(time.Second)}
	fb.retainStatus(t, e, "dev-1", blank)
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.False(t, s.Online)
	assert.Equal(t, "1.2.3", s.FirmwareVersion)
	assert.Equal(t, "sim-1", s.Model)
	assert.Equal(t, report.Apps, s.Apps)
	require.NotNil(t, s.Battery)
	assert.Equal(t, bat, *s.Battery)

	want := report
	want.Online, want.Seq, want.At = false, 11, blank.At
	testenv.Eventually(t, 10*time.Second, "the retained status, what is known with the offline", func() bool {
		return reflect.DeepEqual(want, retainedStatus(t, e, "dev-1"))
	})
}

// Taken in again by the server, the message changes nothing in the store.
func TestBridgeWillSetsTheRetainedStatusOffline(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	bat := 90
	at := time.Now().UTC().Truncate(time.Millisecond)
	report := topics.Status{Online: true, Battery: &bat, FirmwareVersion: "1.2.3", Model: "sim-1",
		Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}}, BridgeID: "b1", Seq: 10, At: at}
	fb.retainStatus(t, e, "dev-1", report)

	live := watchStatus(t, e, "dev-1")
	assert.True(t, nextStatus(t, live).Online, "the bridge's retained report")

	state, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(state, 1, true, topics.BridgeOffline), 5*time.Second))
	got := nextStatus(t, live)
	want := report
	want.Online = false
	assert.Equal(t, want, got, "the watcher hears the device go offline")

	assert.Equal(t, want, retainedStatus(t, e, "dev-1"), "a later subscriber reads it retained")
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.False(t, s.Online)
	assert.Equal(t, uint64(10), s.Seq)
	assert.True(t, s.LastSeen.Equal(at))

	// A device its bridge reported again since is left as the bridge said:
	// the server never overwrites a newer retained report.
	back := report
	back.Seq, back.At = 11, at.Add(time.Second)
	fb.retainStatus(t, e, "dev-1", back)
	e.b.mu.Lock()
	n := e.b.bridgeGen["b1"]
	e.b.mu.Unlock()
	e.b.publishOffline("b1", n, []string{"dev-1"})
	assert.Equal(t, back, retainedStatus(t, e, "dev-1"), "the retained status after a late publishOffline")
}

// watchStatus subscribes a new client to the device's status topic: its
// retained message first, then what is published there.
func watchStatus(t *testing.T, e *env, dev string) <-chan topics.Status {
	t.Helper()
	topic, err := tree.Status(dev)
	require.NoError(t, err)
	ch := make(chan topics.Status, 100)
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("watcher-" + uuid.NewString()).
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
	t.Cleanup(func() { c.Disconnect(0) })
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) {
		if s, err := topics.ParseStatus(m.Payload()); err == nil {
			ch <- s
		}
	}), 5*time.Second))
	return ch
}

// nextStatus is the next status a watcher hears.
func nextStatus(t *testing.T, ch <-chan topics.Status) topics.Status {
	t.Helper()
	select {
	case s := <-ch:
		return s
	case <-time.After(10 * time.Second):
		t.Fatal("no status heard")
		return topics.Status{}
	}
}

// retainedStatus reads the device's status topic as a new subscriber
// does: its retained message.
func retainedStatus(t *testing.T, e *env, dev string) topics.Status {
	t.Helper()
	return nextStatus(t, watchStatus(t, e, dev))
}

// A Will's offline status is not published once its bridge has said
// anything since: its "online" is on its way in, and the bridge's reports
// say what holds.
func TestWillsOfflineStatusGivesWayToTheBridge(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	topic, _ := tree.Status("dev-1")
	report := topics.Status{Online: true, Apps: []companion.App{}, BridgeID: "b1", Seq: 10, At: time.Now().UTC().Truncate(time.Millisecond)}
	b, _ := json.Marshal(report)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, b), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "the report stored", func() bool {
		s, _ := e.db.Status(ctx, "dev-1")
		return s.Seq == 10 && s.Online
	})
	// The store has taken the Will: dev-1 reads offline.
	applied, err := e.db.PutStatus(ctx, companion.Status{DeviceID: "dev-1", Online: false, BridgeID: "b1", Seq: 11, LastSeen: report.At})
	require.NoError(t, err)
	require.True(t, applied)

	will := e.b.noteBridgeState("b1")
	e.b.noteBridgeState("b1") // the bridge's "online" since
	e.b.publishOffline("b1", will, []string{"dev-1"})
	assert.Equal(t, report, retainedStatus(t, e, "dev-1"), "the bridge's own retained report")
}

// A report's seq orders it, and the store keeps the highest: one with a
// seq far past any clock (2^64−1, or a bridge's clock set years ahead) held
// back every later report of the device for good. Such a report is
// refused, alone or with a final reply (whose state is taken); a bridge
// whose clock is merely ahead is not.
func TestReportWithASeqFarAheadIsRefused(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	status, _ := tree.Status("dev-1")
	settings, _ := tree.Settings("dev-1")
	seqAt := func(d time.Duration) uint64 { return uint64(e.clock.Now().Add(d).UnixNano()) }
	seqOf := func() uint64 {
		s, err := e.db.Status(ctx, "dev-1")
		require.NoError(t, err)
		return s.Seq
	}
	settingsSeq := func() uint64 {
		s, err := e.db.Settings(ctx, "dev-1")
		require.NoError(t, err)
		return s.Seq
	}

	fb.publish(t, status, topics.Status{Online: true, FirmwareVersion: "1.0.0", BridgeID: "b1", Seq: seqAt(0), At: time.Now()})
	fb.publish(t, status, topics.Status{Online: true, FirmwareVersion: "6.6.6", BridgeID: "b1", Seq: math.MaxUint64, At: time.Now()})
	ahead := seqAt(time.Hour) // a bridge's clock an hour fast
	fb.publish(t, status, topics.Status{Online: true, FirmwareVersion: "1.0.1", BridgeID: "b1", Seq: ahead, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the status after the one from far ahead", func() bool { return seqOf() == ahead })

	fb.publish(t, settings, topics.Settings{Reported: map[string]any{"volume": 1}, Seq: math.MaxUint64, At: time.Now()})
	fb.publish(t, settings, topics.Settings{Reported: map[string]any{"volume": 2}, Seq: ahead, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the settings after the ones from far ahead", func() bool { return settingsSeq() == ahead })

	c := submit(t, e, "dev-1", "x", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Status:   &topics.Status{Online: true, FirmwareVersion: "6.6.6", BridgeID: "b1", Seq: seqAt(48 * time.Hour), At: time.Now()},
		Settings: &topics.Settings{Reported: map[string]any{"volume": 3}, Seq: seqAt(48 * time.Hour), At: time.Now()}})
	testenv.Eventually(t, 10*time.Second, "the reply taken", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	assert.Equal(t, ahead, seqOf(), "the reply's status from two days ahead was stored")
	assert.Equal(t, ahead, settingsSeq(), "the reply's settings from two days ahead were stored")
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, "1.0.1", s.FirmwareVersion)
}

// A device's firmware declares its own settings schema: the settings the
// server can neither describe (CONTRACT §3's types) nor check a value
// against are left out with their values, from the settings topic and from
// a final reply alike; the rest is stored.
func TestUnusableSettingsAreLeftOut(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	settings, _ := tree.Settings("dev-1")
	one, five := 1, 5
	schema := topics.Schema{
		"volume": {Type: topics.SettingInt, Default: 50},
		"speed":  {Type: "float", Default: 1.5},
		"mode":   {Type: topics.SettingEnum, Default: "a"},
		"level":  {Type: topics.SettingInt, Min: &five, Max: &one, Default: 3},
		"name":   {Type: topics.SettingString, MaxLen: -1, Default: ""},
	}
	reported := func(volume int) map[string]any {
		return map[string]any{"volume": volume, "speed": 1.5, "mode": "a", "level": 3, "name": "x"}
	}
	stored := func(t *testing.T) (map[string]json.RawMessage, topics.Schema) {
		s, err := e.db.Settings(ctx, "dev-1")
		require.NoError(t, err)
		var sch topics.Schema
		if len(s.Schema) > 0 {
			require.NoError(t, json.Unmarshal(s.Schema, &sch))
		}
		return s.Reported, sch
	}
	want := topics.Schema{"volume": {Type: topics.SettingInt, Default: float64(50)}} // as JSON decodes it

	fb.publish(t, settings, topics.Settings{Reported: reported(7), Schema: schema, Seq: 1, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the settings taken", func() bool { r, _ := stored(t); return len(r) > 0 })
	r, sch := stored(t)
	assert.Equal(t, map[string]json.RawMessage{"volume": json.RawMessage("7")}, r)
	assert.Equal(t, want, sch)

	c := submit(t, e, "dev-1", "x", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Settings: &topics.Settings{Reported: reported(8), Schema: schema, Seq: 2, At: time.Now()}})
	testenv.Eventually(t, 10*time.Second, "the reply taken", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	r, sch = stored(t)
	assert.Equal(t, map[string]json.RawMessage{"volume": json.RawMessage("8")}, r)
	assert.Equal(t, want, sch)
}

// A default the device declares that is not a value of its setting (of
// another type, out of its bounds, not among its enum's values, longer
// than its max_len, not a time zone) is taken out, and the setting kept:
// the schema stored has no default for it (bug 150).
func TestADefaultThatIsNotAValueIsTakenOut(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	topic, _ := tree.Settings("dev-1")
	zero, hundred := 0, 100
	schema := topics.Schema{
		"volume":     {Type: topics.SettingInt, Min: &zero, Max: &hundred, Default: 50},
		"brightness": {Type: topics.SettingInt, Min: &zero, Max: &hundred, Default: 150},
		"contrast":   {Type: topics.SettingInt, Default: "50"},
		"gamma":      {Type: topics.SettingInt, Default: 1.5},
		"silent":     {Type: topics.SettingBool, Default: 0},
		"language":   {Type: topics.SettingEnum, Values: []string{"en", "de"}, Default: "fr"},
		"greeting":   {Type: topics.SettingString, MaxLen: 3, Default: "hello"},
		"timezone":   {Type: topics.SettingTimezone, Default: "Mars/Olympus_Mons"},
		"home":       {Type: topics.SettingTimezone, Default: "Europe/Berlin"},
		"nickname":   {Type: topics.SettingString},
	}
	fb.publish(t, topic, topics.Settings{Reported: map[string]any{"volume": 7}, Schema: schema, Seq: 1, At: time.Now()})
	var stored topics.Schema
	testenv.Eventually(t, 10*time.Second, "the settings taken", func() bool {
		s, err := e.db.Settings(ctx, "dev-1")
		return err == nil && len(s.Schema) > 0 && json.Unmarshal(s.Schema, &stored) == nil
	})
	want := map[string]any{"volume": float64(50), "home": "Europe/Berlin"} // as JSON decodes them
	require.Len(t, stored, len(schema), "every setting is kept")
	for name, spec := range stored {
		assert.Equal(t, want[name], spec.Default, "the default of %s", name)
		assert.Equal(t, schema[name].Type, spec.Type, "the type of %s", name)
	}
}

// An int setting's value past 2^53 is stored as the device reported it,
// not as the float64 nearest it (bug 151).
func TestAnIntPast2To53IsStoredExactly(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	topic, _ := tree.Settings("dev-1")
	schema := topics.Schema{"counter": {Type: topics.SettingInt, Default: int64(1<<53 + 3)}}
	fb.publish(t, topic, topics.Settings{Reported: map[string]any{"counter": int64(1<<53 + 1)}, Schema: schema, Seq: 1, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the settings taken", func() bool { s, _ := e.db.Settings(ctx, "dev-1"); return len(s.Reported) > 0 })
	s, err := e.db.Settings(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, "9007199254740993", string(s.Reported["counter"]))
	assert.Contains(t, string(s.Schema), `"default":9007199254740995`)
}

// An app a device lists more than once, on the status topic or in a final
// reply's status, is stored once, as first listed: GET …/apps listed it
// twice (bug 149).
func TestAnAppListedTwiceIsStoredOnce(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	topic, _ := tree.Status("dev-1")
	apps := func(clock string) []companion.App {
		return []companion.App{{AppID: "weather", Version: "1.0.0"}, {AppID: "clock", Version: clock},
			{AppID: "weather", Version: "1.1.0"}, {AppID: "weather", Version: "1.0.0"}, {AppID: "clock", Version: "9.9.9"}}
	}
	stored := func(seq uint64) func() bool {
		return func() bool { s, _ := e.db.Status(ctx, "dev-1"); return s.Seq == seq }
	}

	fb.publish(t, topic, topics.Status{Online: true, BridgeID: "b1", Apps: apps("2.0.0"), Seq: 1, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the status stored", stored(1))
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, []companion.App{{AppID: "weather", Version: "1.0.0"}, {AppID: "clock", Version: "2.0.0"}}, s.Apps)

	c := submit(t, e, "dev-1", "x", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Status: &topics.Status{Online: true, BridgeID: "b1", Apps: apps("2.1.0"), Seq: 2, At: time.Now()}})
	testenv.Eventually(t, 10*time.Second, "the reply's status stored", stored(2))
	s, err = e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, []companion.App{{AppID: "weather", Version: "1.0.0"}, {AppID: "clock", Version: "2.1.0"}}, s.Apps)
}

func TestQueueLimit(t *testing.T) {
	e := newEnv(t, false)
	e.b.opts.MaxOpenCommands = 3
	for i := 0; i < 3; i++ {
		submit(t, e, "dev-1", "x", time.Hour)
	}
	p, _ := json.Marshal(topics.PushText{Text: "one too many"})
	_, _, err := e.b.Submit(context.Background(), companion.Command{DeviceID: "dev-1", Op: topics.OpPushText, Payload: p, ExpiresAt: time.Now().Add(time.Hour)}, nil)
	assert.ErrorIs(t, err, companion.ErrQueueFull)
	// Other devices are not affected.
	submit(t, e, "dev-2", "fine", time.Hour)
}

// The queue limit at CONTRACT §6's default: a device takes 1000
// unfinished commands and refuses the 1001st, whatever the others do.
func TestQueueLimitAtItsDefault(t *testing.T) {
	e := newEnv(t, false)
	const limit = 1000
	var wg sync.WaitGroup
	for range limit {
		wg.Go(func() { submit(t, e, "dev-1", "x", time.Hour) })
	}
	wg.Wait()
	p, _ := json.Marshal(topics.PushText{Text: "one too many"})
	_, _, err := e.b.Submit(context.Background(), companion.Command{DeviceID: "dev-1", UserID: "u1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(time.Hour)}, nil)
	assert.ErrorIs(t, err, companion.ErrQueueFull, "command #%d", limit+1)
	submit(t, e, "dev-2", "fine", time.Hour)
}

// Under steady load with retention, the bbolt file stops growing: final
// commands past the retention are purged and their pages reused.
func TestRetentionKeepsTheFileFromGrowing(t *testing.T) {
	e := newEnv(t, false)
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	ctx := context.Background()
	round := func() {
		var wg sync.WaitGroup
		ids := make(chan string, 200)
		for i := 0; i < 200; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p, _ := json.Marshal(topics.PushText{Text: "load"})
				c, _, err := e.b.Submit(ctx, companion.Command{DeviceID: "dev-1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(time.Hour)}, nil)
				if err != nil {
					t.Error(err)
					return
				}
				ids <- c.ID
			}()
		}
		wg.Wait()
		close(ids)
		for id := range ids {
			wg.Add(1)
			go func(id string) {
				defer wg.Done()
				e.db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
			}(id)
		}
		wg.Wait()
		e.clock.Add(31 * 24 * time.Hour)
		testenv.Eventually(t, 10*time.Second, "purge", func() bool {
			l, _, _ := e.db.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1"})
			return len(l) == 0
		})
	}
	size := func() int64 {
		fi, err := os.Stat(e.db.Path())
		require.NoError(t, err)
		return fi.Size()
	}
	for i := 0; i < 3; i++ {
		round()
	}
	steady := size()
	for i := 0; i < 5; i++ {
		round()
	}
	assert.Equal(t, steady, size(), "the file grew under steady load")
}

// The hourly retention pass deletes the blobs nothing needs once they are
// older than blobGrace, and keeps those stored within it (content is
// stored before the command that references it) and those of unfinished
// commands.
func TestRetentionPurgesUnneededBlobs(t *testing.T) {
	e := newEnv(t, false)
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	ctx := context.Background()
	put := func(content string) string {
		t.Helper()
		b, err := e.db.PutBlob(ctx, strings.NewReader(content), 0)
		require.NoError(t, err)
		return b.SHA256
	}
	gone := func(sha string) func() bool {
		return func() bool {
			_, err := e.db.Blob(ctx, sha)
			return errors.Is(err, companion.ErrNotFound)
		}
	}
	first := put("first")
	forCmd := put("for an unfinished command")
	p, _ := json.Marshal(topics.PushText{Text: "with a blob"})
	_, _, err := e.b.Submit(ctx, companion.Command{DeviceID: "dev-1", Op: topics.OpPushText, Payload: p, Blob: forCmd, ExpiresAt: e.clock.Now().Add(30 * 24 * time.Hour)}, nil)
	require.NoError(t, err)

	// A pass runs at start and then once more than an hour has passed.
	e.clock.Add(61 * time.Minute)
	testenv.Eventually(t, 10*time.Second, "the first blob purged", gone(first))
	second := put("second")
	e.clock.Add(30 * time.Minute)
	recent := put("recent")
	e.clock.Add(31 * time.Minute)
	testenv.Eventually(t, 10*time.Second, "the second blob purged", gone(second))
	_, err = e.db.Blob(ctx, recent)
	assert.NoError(t, err, "a blob stored half an hour before the pass")
	_, err = e.db.Blob(ctx, forCmd)
	assert.NoError(t, err, "the blob of an unfinished command")
}

// A broker that crashes between its autosaves forgets the final replies it
// acknowledged to the bridge and the commands it acknowledged to us; no Will
// fires then. When the bridge says "online" again (after it has
// subscribed), every unfinished command of its devices goes out again, so
// that the bridge answers the finished ones with their final reply.
func TestBridgeOnlineResendsUnfinishedCommands(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	delivered := submit(t, e, "dev-1", "delivered, final reply lost", time.Hour)
	assert.Equal(t, delivered.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: delivered.ID, State: companion.StateDelivered, At: time.Now()})
	done := submit(t, e, "dev-1", "done", time.Hour)
	assert.Equal(t, done.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: done.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "replies taken", func() bool {
		return state(t, e, delivered.ID).State == companion.StateDelivered && state(t, e, done.ID).State == companion.StateSucceeded
	})

	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	assert.Equal(t, delivered.ID, fb.next(t).ID, "the unfinished command goes out again")
	select {
	case c := <-fb.commands:
		t.Errorf("a finished command went out again: %s", c.ID)
	case <-time.After(200 * time.Millisecond):
	}
}

// A device back online gets its own unfinished commands again, in order,
// the later naming the earlier, and no other device's: the outbox reads
// them, with the queued ones, and not the store's other open commands.
func TestADeviceBackOnlineGetsItsUnfinishedCommandsAgain(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	fb.online(t, e, "dev-2")
	first := submit(t, e, "dev-1", "first", time.Hour)
	second := submit(t, e, "dev-1", "second", time.Hour)
	other := submit(t, e, "dev-2", "other device", time.Hour)
	got := map[string]bool{}
	for range 3 {
		got[fb.next(t).ID] = true
	}
	require.Equal(t, map[string]bool{first.ID: true, second.ID: true, other.ID: true}, got)
	fb.reply(t, "dev-1", topics.Reply{CommandID: first.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered and sent written", func() bool {
		return state(t, e, first.ID).State == companion.StateDelivered && state(t, e, second.ID).State == companion.StateSent &&
			state(t, e, other.ID).State == companion.StateSent
	})

	topic, _ := tree.Status("dev-1")
	fb.publish(t, topic, topics.Status{Online: false, BridgeID: "b1", Seq: 2, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "dev-1 offline", func() bool {
		s, err := e.db.Status(context.Background(), "dev-1")
		return err == nil && !s.Online
	})
	fb.publish(t, topic, topics.Status{Online: true, BridgeID: "b1", Seq: 3, At: time.Now()})
	again := fb.next(t)
	assert.Equal(t, first.ID, again.ID, "dev-1's delivered command goes out again first")
	again2 := fb.next(t)
	assert.Equal(t, second.ID, again2.ID, "then its sent one")
	assert.Equal(t, first.ID, again2.After, "which runs after the first")
	fb.none(t, 300*time.Millisecond, "another device's command, or one twice, on dev-1's return")
}

// A command whose final reply is slow to come (queued behind others in the
// MQTT broker, or lost by it) is sent again on the first event that calls
// for it; the events that follow within the spacing (a bridge that
// reconnects again and again, its devices coming back online) hold the next
// repeat back rather than each sending one, and the repeat held back still
// goes, so that a reply the broker lost is fetched (bug 100).
func TestRepeatsOfACommandAreSpacedNotDropped(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "its final reply is lost twice", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool {
		return state(t, e, c.ID).State == companion.StateDelivered
	})

	online := func() {
		t.Helper()
		bs, _ := tree.BridgeState("b1")
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	}
	online()
	first := time.Now()
	assert.Equal(t, c.ID, fb.next(t).ID, "the first online sends the unfinished command again")
	for range 5 {
		online()
	}
	// None of the five sends the command again before the spacing.
	fb.heldBack(t, e.b, first, c.ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the final reply fetched", func() bool {
		return state(t, e, c.ID).State == companion.StateSucceeded
	})
	fb.none(t, 500*time.Millisecond, "the five onlines are one repeat")
}

// A replica that stops dispatching and starts again (its lock lost and won
// back, as a PostgreSQL restart does) sends every open command again, as a
// new dispatcher must; but one it repeated itself a moment ago waits for
// its spacing, as it would for any other event (bug 100).
func TestRepeatsStaySpacedWhenADispatcherComesBack(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	require.NoError(t, e.b.Close()) // r alone dispatches
	d := &dispatcher{}
	d.on.Store(true)
	opts := e.b.opts
	opts.ClientID += "-r"
	opts.Dispatcher = d
	r, err := New(opts)
	require.NoError(t, err)
	require.NoError(t, r.Start())
	t.Cleanup(func() { r.Close() })
	testenv.Eventually(t, 10*time.Second, "the replica ready", r.Ready)

	p, _ := json.Marshal(topics.PushText{Text: "its final reply is missing"})
	c, _, err := r.Submit(context.Background(), companion.Command{
		DeviceID: "dev-1", UserID: "u1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(time.Hour),
	}, nil)
	require.NoError(t, err)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, c.ID).State == companion.StateDelivered })

	flap := func() {
		t.Helper()
		d.on.Store(false)
		r.DispatcherChanged(false)
		r.wake()
		testenv.Eventually(t, 10*time.Second, "the outbox saw it no longer dispatches", func() bool {
			r.mu.Lock()
			defer r.mu.Unlock()
			return len(r.lastOut) == 0
		})
		d.on.Store(true)
		r.DispatcherChanged(true)
	}
	flap()
	first := time.Now()
	assert.Equal(t, c.ID, fb.next(t).ID, "back as the dispatcher, it sends the open command again")
	flap()
	fb.heldBack(t, r, first, c.ID)
}

// Each command names the device's command published before it that has not
// ended (topics.Command.After), so that a bridge that gets it first waits
// for that one: none once those before it have ended, and, sent again, the
// one before it again.
func TestCommandsNameTheOneTheyRunAfter(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	end := func(ids ...string) {
		t.Helper()
		for _, id := range ids {
			fb.reply(t, "dev-1", topics.Reply{CommandID: id, State: companion.StateSucceeded, At: time.Now()})
		}
		testenv.Eventually(t, 10*time.Second, "replies taken", func() bool {
			for _, id := range ids {
				if state(t, e, id).State != companion.StateSucceeded {
					return false
				}
			}
			return true
		})
	}
	after := func(c companion.Command) string {
		t.Helper()
		got := fb.next(t)
		require.Equal(t, c.ID, got.ID)
		return got.After
	}

	a := submit(t, e, "dev-1", "a", time.Hour)
	assert.Empty(t, after(a), "the device's first command")
	b := submit(t, e, "dev-1", "b", time.Hour)
	assert.Equal(t, a.ID, after(b))
	other := submit(t, e, "dev-2", "other", time.Hour)
	assert.Empty(t, after(other), "another device's")
	fb.reply(t, "dev-2", topics.Reply{CommandID: other.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "other's reply taken", func() bool { return state(t, e, other.ID).State == companion.StateSucceeded })
	end(a.ID)
	c := submit(t, e, "dev-1", "c", time.Hour)
	assert.Equal(t, b.ID, after(c), "the one before has not ended")
	end(b.ID, c.ID)
	d := submit(t, e, "dev-1", "d", time.Hour)
	assert.Empty(t, after(d), "every one before it has ended")
	f := submit(t, e, "dev-1", "f", time.Hour)
	assert.Equal(t, d.ID, after(f))

	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	assert.Empty(t, after(d), "sent again")
	assert.Equal(t, d.ID, after(f), "sent again")
}

// startRetryingSent starts e's broker with the retry of long sent commands
// ticking every 100 ms of real time; the commands' age is on e.clock.
func startRetryingSent(t *testing.T, e *env) {
	t.Helper()
	e.b.opts.SentRetry = 100 * time.Millisecond
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	testenv.Eventually(t, 10*time.Second, "broker ready", e.b.Ready)
}

// A command that stays sent, with no word from the bridge, while its device
// reads online was lost on its way (a broker that dropped it and told
// nobody): SentRetry after it was sent it goes out again, and again only
// after another SentRetry. One whose device reads offline waits for its
// bridge's return, which sends everything again anyway.
func TestLongSentCommandsGoOutAgain(t *testing.T) {
	e := newEnv(t, false)
	startRetryingSent(t, e)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	lost := submit(t, e, "dev-1", "lost on its way", time.Hour)
	away := submit(t, e, "dev-2", "for a device that reads offline", time.Hour)
	// The bridge takes both and says nothing, as if they never came.
	got := map[string]bool{fb.next(t).ID: true, fb.next(t).ID: true}
	require.True(t, got[lost.ID] && got[away.ID], "both went out: %v", got)
	testenv.Eventually(t, 10*time.Second, "both sent", func() bool {
		return state(t, e, lost.ID).State == companion.StateSent && state(t, e, away.ID).State == companion.StateSent
	})
	noCommand := func(why string) {
		t.Helper()
		select {
		case c := <-fb.commands:
			t.Fatalf("%s went out again: %s", why, c.ID)
		case <-time.After(500 * time.Millisecond): // five ticks
		}
	}
	noCommand("a command sent less than SentRetry ago")

	e.clock.Add(time.Minute)
	assert.Equal(t, lost.ID, fb.next(t).ID, "sent long ago to an online device: sent again")
	noCommand("a command retried less than SentRetry ago, or one of a device that reads offline,")

	e.clock.Add(time.Minute)
	assert.Equal(t, lost.ID, fb.next(t).ID, "still no word: sent again")
	fb.reply(t, "dev-1", topics.Reply{CommandID: lost.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, lost.ID).State == companion.StateDelivered })
	e.clock.Add(time.Minute)
	noCommand("a delivered command")
	assert.Equal(t, companion.StateSent, state(t, e, away.ID).State)
}

// The server's clock stepped back an hour (NTP setting right a clock that
// ran ahead) after a command was sent and lost: the retry still sends it
// again a SentRetry on. Its age was its updated_at, written an hour ahead
// of the clock since: it read as not sent yet, and went out again only once
// the clock had caught up, an hour later (bug 332).
func TestLongSentCommandsGoOutAgainAfterTheClockSteppedBack(t *testing.T) {
	e := newEnv(t, false)
	startRetryingSent(t, e)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	lost := submit(t, e, "dev-1", "lost on its way", time.Hour)
	require.Equal(t, lost.ID, fb.next(t).ID)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, lost.ID).State == companion.StateSent })
	e.clock.Add(-time.Hour)
	e.clock.Add(time.Minute)
	assert.Equal(t, lost.ID, fb.next(t).ID, "sent long ago to an online device: sent again")
}

// The retry of long sent commands sends one again only to a device it
// read online: a status the store fails to read counts as offline, and
// the command goes out at the first retry that reads it. (The expiry
// passes count such a device online instead: see
// TestSentCommandsWaitOutAFailedStatusRead.)
func TestLongSentCommandsWaitForAStatusTheStoreCanRead(t *testing.T) {
	var st *failingStore
	e := newEnvStore(t, false, func(db *store.DB) Store {
		st = &failingStore{DB: db}
		return st
	})
	startRetryingSent(t, e)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	lost := submit(t, e, "dev-1", "lost on its way", time.Hour)
	require.Equal(t, lost.ID, fb.next(t).ID)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, lost.ID).State == companion.StateSent })

	st.failStatus.Store(true)
	e.clock.Add(time.Minute)
	testenv.Eventually(t, 10*time.Second, "a retry that fails to read the status", func() bool { return st.fails.Load() >= 1 })
	select {
	case c := <-fb.commands:
		t.Fatalf("sent again to a device whose status was not read: %s", c.ID)
	case <-time.After(500 * time.Millisecond): // five more retries
	}
	st.failStatus.Store(false)
	assert.Equal(t, lost.ID, fb.next(t).ID, "sent again once its device reads online")
}

// A sent command may be in the bridge's hands when its TTL passes: the
// server waits ExpiryGrace for the bridge's word before it calls it expired,
// so a delivered reply on the way is not overtaken.
func TestSentCommandsExpireAfterTheGrace(t *testing.T) {
	e := newEnv(t, true)
	e.b.opts.ExpiryGrace = time.Hour
	fb := connectBridge(t, e)
	late := submit(t, e, "dev-1", "taken just in time", time.Minute)
	gone := submit(t, e, "dev-1", "never answered", time.Minute)
	fb.next(t)
	fb.next(t)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, gone.ID).State == companion.StateSent })

	e.clock.Add(2 * time.Minute) // past the TTL, within the grace
	fb.reply(t, "dev-1", topics.Reply{CommandID: late.ID, State: companion.StateDelivered})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, late.ID).State == companion.StateDelivered })
	assert.Equal(t, companion.StateSent, state(t, e, gone.ID).State, "not expired within the grace")

	e.clock.Add(time.Hour)
	testenv.Eventually(t, 10*time.Second, "expired", func() bool { return state(t, e, gone.ID).State == companion.StateExpired })
	assert.Equal(t, companion.StateDelivered, state(t, e, late.ID).State, "a delivered command never expires")
	// It may be on its way: it is withdrawn, so that it never runs late and
	// a command that names it as the one before waits for it no longer.
	withdrawal := fb.next(t)
	assert.Equal(t, topics.OpCancel, withdrawal.Op)
	var p topics.Cancel
	require.NoError(t, json.Unmarshal(withdrawal.Payload, &p))
	assert.Equal(t, gone.ID, p.CommandID)
}

// A command that went out, whose "sent" the store failed to write, reads
// queued and is no longer on its way: it expires at its TTL. A later
// command went out naming it as the one to run after, so the bridge is
// told it ended: without the withdrawal the bridge would run it if it
// has it, and hold the later one back for it if it does not.
func TestAnExpiredCommandALaterOneNamesIsWithdrawn(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *failingStore { return &failingStore{DB: db} })
	// Should the outbox's scan of the store send it again before it
	// expires, it would be on its way, and expire only past the grace.
	e.b.opts.ExpiryGrace = time.Millisecond
	st.failSent.Store(true)
	fb := connectBridge(t, e)
	first := submit(t, e, "dev-1", "its sent write fails", time.Minute)
	require.Equal(t, first.ID, fb.next(t).ID)
	second := submit(t, e, "dev-1", "runs after it", time.Hour)
	c := fb.next(t)
	require.Equal(t, second.ID, c.ID)
	require.Equal(t, first.ID, c.After, "named as the one to run after")
	testenv.Eventually(t, 10*time.Second, "the sent write failed", func() bool { return !e.b.isFlying(first.ID) })
	require.Equal(t, companion.StateQueued, state(t, e, first.ID).State)

	e.clock.Add(2 * time.Minute) // past the TTL: queued, not on its way
	testenv.Eventually(t, 10*time.Second, "expired", func() bool { return state(t, e, first.ID).State == companion.StateExpired })
	deadline := time.After(10 * time.Second)
	for {
		select {
		case c := <-fb.commands:
			if c.Op != topics.OpCancel {
				continue // the outbox's scan of the store may send either again first
			}
			var p topics.Cancel
			require.NoError(t, json.Unmarshal(c.Payload, &p))
			assert.Equal(t, first.ID, p.CommandID)
			return
		case <-deadline:
			t.Fatal("the expired command was not withdrawn")
		}
	}
}

// Past the grace, a sent command of a device that reads online waits for
// its bridge's word (bug 99): the bridge may have run it, its replies
// queued in the MQTT broker behind others for longer than the grace. What
// the bridge says, however late, ends it; one it never answers expires
// expiryWaitGraces graces past its TTL. A device that reads offline has
// its commands expire with the grace, as before.
func TestSentCommandsOfAnOnlineDeviceWaitForTheBridgesWord(t *testing.T) {
	e := newEnv(t, true)
	e.b.opts.ExpiryGrace = time.Minute
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	// Of one TTL, swept in this order (the expiry index's, by id).
	ran := submit(t, e, "dev-1", "run, its replies late", time.Minute)
	silent := submit(t, e, "dev-1", "never answered", time.Minute)
	offline := submit(t, e, "dev-2", "on a device that reads offline", time.Minute)
	for _, c := range []companion.Command{ran, silent, offline} {
		fb.next(t)
		testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })
	}

	e.clock.Add(3 * time.Minute) // past the TTL and the grace
	testenv.Eventually(t, 10*time.Second, "the offline device's command expired", func() bool {
		return state(t, e, offline.ID).State == companion.StateExpired
	})
	assert.Equal(t, companion.StateSent, state(t, e, ran.ID).State, "swept before it, and waiting for the bridge")
	assert.Equal(t, companion.StateSent, state(t, e, silent.ID).State, "swept before it, and waiting for the bridge")

	fb.reply(t, "dev-1", topics.Reply{CommandID: ran.ID, State: companion.StateSucceeded})
	testenv.Eventually(t, 10*time.Second, "the late reply taken", func() bool { return state(t, e, ran.ID).State == companion.StateSucceeded })

	e.clock.Add(expiryWaitGraces * time.Minute)
	testenv.Eventually(t, 10*time.Second, "the silent one expired", func() bool { return state(t, e, silent.ID).State == companion.StateExpired })
	assert.Equal(t, companion.StateSucceeded, state(t, e, ran.ID).State)
}

// A sent command past its TTL and the grace expires only on a status read
// that says its device is offline: one the store fails to read counts as
// online, and the command waits for a sweep that reads it.
func TestSentCommandsWaitOutAFailedStatusRead(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *failingStore { return &failingStore{DB: db} })
	e.b.opts.ExpiryGrace = time.Minute
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-2", "on a device that never reported", time.Minute)
	fb.next(t)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })

	st.failStatus.Store(true)
	before := st.fails.Load()
	e.clock.Add(3 * time.Minute) // past the TTL and the grace
	testenv.Eventually(t, 10*time.Second, "a sweep that fails to read the status", func() bool { return st.fails.Load() > before })
	time.Sleep(300 * time.Millisecond) // that sweep's write, had it expired the command, and more sweeps
	assert.Equal(t, companion.StateSent, state(t, e, c.ID).State, "expired on a failed read")
	st.failStatus.Store(false)
	testenv.Eventually(t, 10*time.Second, "expired once the store says offline", func() bool {
		return state(t, e, c.ID).State == companion.StateExpired
	})
}

// The commands of a device no bridge serves wait queued (CONTRACT §9);
// once a bridge serves it they go to that bridge, in order. Replies for it
// that slip past the broker meanwhile change nothing.
func TestCommandsOfAnUnservedDeviceWait(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	require.NoError(t, e.db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "dev-3", Model: "sim-1"}))
	bind(t, e, "dev-3")
	fb := connectBridge(t, e)

	waiting := []companion.Command{submit(t, e, "dev-3", "first", time.Hour), submit(t, e, "dev-3", "second", time.Hour)}
	served := submit(t, e, "dev-1", "served", time.Hour)
	assert.Equal(t, served.ID, fb.next(t).ID)
	// dev-1's command is written sent half a second after its PUBACK; had
	// dev-3's gone out with it, they would be sent by then too.
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, served.ID).State == companion.StateSent })
	for _, c := range waiting {
		assert.Equal(t, companion.StateQueued, state(t, e, c.ID).State, "a command of an unserved device left the queue")
	}

	// A reply for it, past the broker's rights (the server's account),
	// is dropped: no bridge serves dev-3.
	intruder := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("intruder").
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Connect(), 5*time.Second))
	defer intruder.Disconnect(0)
	replies, _ := tree.Replies("dev-3")
	b, _ := json.Marshal(topics.Reply{CommandID: waiting[0].ID, State: companion.StateSucceeded, At: time.Now()})
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Publish(replies, 1, false, b), 5*time.Second))
	// The server takes one connection's messages in order: once it has
	// stored a status sent after the reply, it has dropped the reply (had
	// dev-3 been assigned first, the reply would have been taken). The
	// status says offline: a device coming online has its commands resent.
	status1, _ := tree.Status("dev-1")
	b, _ = json.Marshal(topics.Status{Online: false, BridgeID: "b1", Seq: 4242, At: time.Now()})
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Publish(status1, 1, false, b), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "the status after the reply", func() bool {
		s, _ := e.db.Status(context.Background(), "dev-1")
		return s.Seq == 4242
	})

	_, err := e.db.AssignDevice(ctx, "dev-3", "b1", "")
	require.NoError(t, err)
	f, _ := tree.CommandsFilter("dev-3") // granted now that b1 serves dev-3
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Subscribe(f, 1, nil), 5*time.Second))
	e.b.DeviceMoved("dev-3")
	for _, c := range waiting {
		assert.Equal(t, c.ID, fb.next(t).ID, "the waiting commands go out in order")
	}
	assert.NotEqual(t, companion.StateSucceeded, state(t, e, waiting[0].ID).State, "a forged reply was taken")
}

// bridgeHasTwo has fb take two commands of dev-1 and say it has them:
// one delivered, one in progress.
func bridgeHasTwo(t *testing.T, e *env, fb *fakeBridge) (had, running companion.Command) {
	t.Helper()
	had = submit(t, e, "dev-1", "the bridge has it", time.Hour)
	require.Equal(t, had.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: had.ID, State: companion.StateDelivered, At: time.Now()})
	running = submit(t, e, "dev-1", "the bridge runs it", time.Hour)
	require.Equal(t, running.ID, fb.next(t).ID)
	p := 10
	fb.reply(t, "dev-1", topics.Reply{CommandID: running.ID, State: companion.StateInProgress, Progress: &p, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered, in progress", func() bool {
		return state(t, e, had.ID).State == companion.StateDelivered && state(t, e, running.ID).State == companion.StateInProgress
	})
	return had, running
}

// assertFailedNotServed checks that each command a bridge had reads failed,
// with error.code device_not_served.
func assertFailedNotServed(t *testing.T, e *env, cmds ...companion.Command) {
	t.Helper()
	for _, c := range cmds {
		got := state(t, e, c.ID)
		if assert.Equal(t, companion.StateFailed, got.State, "a command the bridge had") && assert.NotNil(t, got.Error) {
			assert.Equal(t, "device_not_served", got.Error.Code)
		}
	}
}

// A device moved straight to another bridge while the bridge it leaves has
// some of its commands (delivered, in progress): the bridge it left may
// have run them, so they fail as on an unassignment, and the new bridge
// gets only the command the old one had not taken, never those (it would
// run them again).
func TestCommandsTheBridgeHadFailWhenTheDeviceMovesToAnother(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	had, running := bridgeHasTwo(t, e, fb)

	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("b2: not used")}))
	_, err := e.db.AssignDevice(ctx, "dev-1", "b2", "")
	require.NoError(t, err)
	waiting := submit(t, e, "dev-1", "for the new bridge", time.Hour)
	b2 := connectBridgeAs(t, e, "b2", "dev-1")
	e.b.DeviceMoved("dev-1")
	assertFailedNotServed(t, e, had, running)
	// The new one may come twice (its first publish, then the move's
	// resend); the bridge drops a repeat.
	assert.Equal(t, waiting.ID, b2.next(t).ID, "the new bridge's first command")
	quiet := time.After(300 * time.Millisecond)
	for {
		select {
		case c := <-b2.commands:
			assert.Equal(t, waiting.ID, c.ID, "a command the bridge it left had went to the new bridge")
			continue
		case <-quiet:
		}
		break
	}
}

// A device taken off its bridge while the bridge has some of its commands
// (delivered, in progress): the bridge may have run them, but no word of
// its about them is taken any more (CONTRACT §9), so they would read
// delivered until the device had a bridge again, and then go to that
// bridge. They fail, as an unbind's do, with error.code device_not_served;
// those the bridge does not have yet wait for a bridge.
func TestCommandsTheBridgeHadFailWhenTheDeviceLosesItsBridge(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	had, running := bridgeHasTwo(t, e, fb)
	waiting := submit(t, e, "dev-1", "on its way", time.Hour)
	require.Equal(t, waiting.ID, fb.next(t).ID)
	waited := make(chan companion.Command, 1)
	go func() {
		c, _ := e.b.Wait(ctx, had.ID)
		waited <- c
	}()

	_, err := e.db.AssignDevice(ctx, "dev-1", "", "")
	require.NoError(t, err)
	e.b.DeviceMoved("dev-1")
	assertFailedNotServed(t, e, had, running)
	assert.False(t, companion.IsFinal(state(t, e, waiting.ID).State), "a command the bridge did not have ended")
	select {
	case c := <-waited:
		assert.Equal(t, companion.StateFailed, c.State, "the waiter's answer")
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter was not answered")
	}

	// Served again, the device gets the command that waited, and not those
	// that failed.
	_, err = e.db.AssignDevice(ctx, "dev-1", "b1", "")
	require.NoError(t, err)
	f, _ := tree.CommandsFilter("dev-1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Subscribe(f, 1, nil), 5*time.Second))
	e.b.DeviceMoved("dev-1")
	assert.Equal(t, waiting.ID, fb.next(t).ID)
	// The command that waited may go out twice: each move has the device's
	// unfinished commands sent again, and the outbox may take the first
	// move's word only once the device is served again (a repeat the
	// bridge drops by its id). Those that failed go out never.
	quiet := time.After(300 * time.Millisecond)
	for {
		select {
		case c := <-fb.commands:
			if c.ID != waiting.ID {
				t.Errorf("%s went out again (had %s, running %s)", c.ID, had.ID, running.ID)
			}
			continue
		case <-quiet:
		}
		break
	}
}

// A command that another replica finishes in the shared store answers the
// waiters here once the store says it changed (CONTRACT §11: a Prefer:
// wait on any replica, whichever replica takes the reply in).
func TestWaitersHearOfAnotherReplicasFinalState(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	// Stored by "another replica": straight into the store, not through
	// this broker.
	cmd, _, err := e.db.CreateCommand(ctx, companion.Command{DeviceID: "dev-1", UserID: "u1", Op: "text.push",
		Payload: []byte(`{}`), ExpiresAt: e.clock.Now().Add(time.Hour)}, 0, nil)
	require.NoError(t, err)

	got := make(chan companion.Command, 1)
	go func() {
		c, _ := e.b.Wait(ctx, cmd.ID)
		got <- c
	}()
	testenv.Eventually(t, 10*time.Second, "a waiter", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return len(e.b.waiters[cmd.ID]) == 1
	})
	e.b.CommandChanged(ctx, cmd.ID) // not final yet: the waiter keeps waiting
	select {
	case c := <-got:
		t.Fatalf("Wait returned %s before the command was final", c.State)
	default:
	}
	_, err = e.db.UpdateCommand(ctx, cmd.ID, func(c *companion.Command) error {
		c.State = companion.StateSucceeded
		return nil
	})
	require.NoError(t, err)
	e.b.CommandChanged(ctx, "") // the listener LISTENs anew: every waited command is read again
	select {
	case c := <-got:
		assert.Equal(t, companion.StateSucceeded, c.State)
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not hear of the final state")
	}
}

// Commands that an unbind ended in the store (companion.Unbound) answer
// their waiters at once and are withdrawn from the bridge, the one it has
// as well as the one on its way: a bridge drops a command canceled before
// it starts.
func TestEndedCommandsAreAnsweredAndWithdrawn(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	_, _, err := e.db.Bind(ctx, companion.Binding{DeviceID: "dev-1", UserID: "u1"})
	require.NoError(t, err)
	fb := connectBridge(t, e)
	had := submit(t, e, "dev-1", "the bridge has it", time.Hour)
	require.Equal(t, had.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: had.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, had.ID).State == companion.StateDelivered })
	sent := submit(t, e, "dev-1", "on its way", time.Hour)
	require.Equal(t, sent.ID, fb.next(t).ID)
	waited := make(chan companion.Command, 1)
	go func() {
		c, _ := e.b.Wait(ctx, sent.ID)
		waited <- c
	}()

	unbound, err := e.db.Unbind(ctx, "dev-1", "u1")
	require.NoError(t, err)
	require.Len(t, unbound.Ended, 2)
	e.b.Ended(unbound.Ended)
	select {
	case c := <-waited:
		assert.Equal(t, companion.StateCanceled, c.State, "the waiter's answer")
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter was not answered")
	}
	for _, want := range []string{had.ID, sent.ID} {
		c := fb.next(t)
		require.Equal(t, topics.OpCancel, c.Op, "withdrawn: %+v", c)
		var p topics.Cancel
		require.NoError(t, json.Unmarshal(c.Payload, &p))
		assert.Equal(t, want, p.CommandID, "the cancels, oldest first")
	}
}

// restart closes e's broker and starts a new one on the same store and MQTT
// broker, with the same options (and MQTT session), as after a restart of
// the server.
func restart(t *testing.T, e *env) {
	t.Helper()
	require.NoError(t, e.b.Close())
	b, err := New(e.b.opts)
	require.NoError(t, err)
	e.b = b
	require.NoError(t, b.Start())
	t.Cleanup(func() { b.Close() })
	testenv.Eventually(t, 10*time.Second, "broker ready", b.Ready)
}

// A command the bridge took just before its TTL ran out reads queued on
// disk when the server stops within sentDelay of the PUBACK (before its
// "delivered" comes, or with it lost in the embedded broker). Restarted
// past the TTL, the server cannot tell it from one that never went out: it
// waits the grace, as for a sent one, and takes the final reply the bridge
// sends once it is back (the bridge keeps it until the broker has it),
// instead of calling expired a command the device ran.
func TestCommandTakenBeforeARestartIsNotExpiredAtItsTTL(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "taken just in time", time.Minute)
	require.Equal(t, c.ID, fb.next(t).ID)
	require.NoError(t, e.b.Close())
	require.Equal(t, companion.StateQueued, state(t, e, c.ID).State, "closed within sentDelay of the PUBACK: sent not written")

	e.clock.Add(2 * time.Minute) // past the TTL
	e.b.opts.ExpiryGrace = time.Hour
	restart(t, e)
	// The restarted server's first pass deals with the open commands, in
	// id order, before one accepted after the restart goes out.
	// (It goes out again, within the grace, to fetch a final reply that
	// may have been lost: TestFinalReplyLostPastItsTTLIsFetchedAgain.)
	marker := submit(t, e, "dev-2", "after the restart", time.Hour)
	for fb.next(t).ID != marker.ID {
		// the open commands first, the one past its TTL among them
	}
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the bridge's final reply taken", func() bool { return state(t, e, c.ID).State != companion.StateQueued })
	assert.Equal(t, companion.StateSucceeded, state(t, e, c.ID).State)
}

// A command the bridge ran, whose final reply a broker acknowledged and
// then lost (the embedded one dies with the server), reads queued or sent
// after a restart past its TTL. Within ExpiryGrace it goes to the bridge
// again, which answers from its record: the command ends as it ended on
// the device. It was never sent past its TTL, and read expired once the
// grace was over, though the device had run it. One the bridge never had
// is answered expired, at once (the bridge checks the TTL as it takes a
// command in), and ends so.
func TestFinalReplyLostPastItsTTLIsFetchedAgain(t *testing.T) {
	for _, sent := range []bool{false, true} {
		t.Run(fmt.Sprintf("sent=%v", sent), func(t *testing.T) {
			e := newEnv(t, true)
			fb := connectBridge(t, e)
			ran := submit(t, e, "dev-1", "run, its reply lost", time.Minute)
			require.Equal(t, ran.ID, fb.next(t).ID)
			never := submit(t, e, "dev-1", "lost on its way", time.Minute)
			require.Equal(t, never.ID, fb.next(t).ID) // the bridge "never had it": it answers expired below
			if sent {
				testenv.Eventually(t, 10*time.Second, "sent written", func() bool {
					return state(t, e, ran.ID).State == companion.StateSent && state(t, e, never.ID).State == companion.StateSent
				})
			}
			e.clock.Add(2 * time.Minute) // past the TTL
			e.b.opts.ExpiryGrace = time.Hour
			restart(t, e)

			// In order; a command may come twice in a row: the broker
			// before the restart may have sent it again as the clock
			// passed its TTL (seen under load in make test).
			var got []string
			for len(got) < 2 {
				id := fb.next(t).ID
				if len(got) == 0 || got[len(got)-1] != id {
					got = append(got, id)
				}
			}
			require.Equal(t, []string{ran.ID, never.ID}, got, "the commands past their TTL, within the grace, go out again in order")
			fb.reply(t, "dev-1", topics.Reply{CommandID: ran.ID, State: companion.StateSucceeded, At: time.Now()})
			fb.reply(t, "dev-1", topics.Reply{CommandID: never.ID, State: companion.StateExpired, At: time.Now()})
			testenv.Eventually(t, 10*time.Second, "the bridge's answers taken", func() bool {
				return companion.IsFinal(state(t, e, ran.ID).State) && companion.IsFinal(state(t, e, never.ID).State)
			})
			assert.Equal(t, companion.StateSucceeded, state(t, e, ran.ID).State)
			assert.Equal(t, companion.StateExpired, state(t, e, never.ID).State)
		})
	}
}

// dispatcher is a Dispatcher a test switches.
type dispatcher struct{ on atomic.Bool }

func (d *dispatcher) Dispatching() bool { return d.on.Load() }

// A replica that takes over from a dispatcher that died cannot tell a
// command the dead one published from one that never went out: both read
// queued when the dead one had not written sent yet (sentDelay). Past its
// TTL, such a command waits the grace, as after a restart, and takes the
// final reply of the bridge that ran it, however long ago the replica
// itself started.
func TestCommandTakenBeforeATakeoverIsNotExpiredAtItsTTL(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	d := &dispatcher{}
	opts := e.b.opts
	opts.ClientID += "-other"
	opts.Dispatcher = d
	opts.ExpiryGrace = time.Hour
	other, err := New(opts) // a replica started long before the command
	require.NoError(t, err)
	require.NoError(t, other.Start())
	t.Cleanup(func() { other.Close() })
	testenv.Eventually(t, 10*time.Second, "the other replica ready", other.Ready)

	c := submit(t, e, "dev-1", "taken just in time", time.Minute)
	require.Equal(t, c.ID, fb.next(t).ID)
	require.NoError(t, e.b.Close()) // the dispatcher dies
	require.Equal(t, companion.StateQueued, state(t, e, c.ID).State, "closed within sentDelay of the PUBACK: sent not written")

	e.clock.Add(2 * time.Minute) // past the TTL
	d.on.Store(true)
	other.DispatcherChanged(true)
	// The new dispatcher's first pass deals with the open commands, in id
	// order, before one accepted after the takeover goes out.
	p, _ := json.Marshal(topics.PushText{Text: "after the takeover"})
	marker, _, err := other.Submit(context.Background(), companion.Command{
		DeviceID: "dev-2", UserID: "u1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(time.Hour),
	}, nil)
	require.NoError(t, err)
	for fb.next(t).ID != marker.ID {
		// the open commands first, the one past its TTL among them
	}
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the bridge's final reply taken", func() bool { return state(t, e, c.ID).State != companion.StateQueued })
	assert.Equal(t, companion.StateSucceeded, state(t, e, c.ID).State)
}

// A final reply's status, like one on the status topic, names the bridge
// that sent it: one naming a bridge that does not serve the device (the
// bridge the device was moved from, its reply slipping past the broker's
// rights) is not stored, or the device would read as that bridge's, and
// that bridge's Will would mark it offline while the bridge serving it is
// up (CONTRACT §9). The command's state is taken.
func TestReplyStatusFromABridgeThatDoesNotServeTheDeviceIsDropped(t *testing.T) {
	e := newEnv(t, true)
	ctx := context.Background()
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "run on b1", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)

	// dev-1 moves to b2, which reports it online.
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("not used")}))
	_, err := e.db.AssignDevice(ctx, "dev-1", "b2", "")
	require.NoError(t, err)
	intruder := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("intruder").
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Connect(), 5*time.Second))
	defer intruder.Disconnect(0)
	publish := func(topic string, v any) {
		t.Helper()
		b, err := json.Marshal(v)
		require.NoError(t, err)
		require.NoError(t, mqtt.WaitTokenTimeout(intruder.Publish(topic, 1, false, b), 5*time.Second))
	}
	status, _ := tree.Status("dev-1")
	publish(status, topics.Status{Online: true, FirmwareVersion: "1.0.0", BridgeID: "b2", Seq: 10, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "b2's status", func() bool {
		s, _ := e.db.Status(ctx, "dev-1")
		return s.Seq == 10
	})

	// b1's final reply for the command it ran, past the broker's rights
	// (the server's account), with the status b1 read.
	replies, _ := tree.Replies("dev-1")
	publish(replies, topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Status: &topics.Status{Online: true, FirmwareVersion: "1.0.0", BridgeID: "b1", Seq: 20, At: time.Now()}})
	testenv.Eventually(t, 10*time.Second, "the reply taken", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.Equal(t, "b2", s.BridgeID, "the device's bridge, as its status reads")

	// b1's Will marks b1's devices offline; dev-1 is not one of them. The
	// server takes one connection's messages in order: once a status
	// published after the Will is stored, the Will is taken.
	b1, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(intruder.Publish(b1, 1, true, topics.BridgeOffline), 5*time.Second))
	status2, _ := tree.Status("dev-2")
	publish(status2, topics.Status{Online: false, BridgeID: "b1", Seq: 5, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the status after the Will", func() bool {
		s, _ := e.db.Status(ctx, "dev-2")
		return s.Seq == 5
	})
	s, err = e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.True(t, s.Online, "dev-1, served by b2, read offline on b1's Will")
}

// A reply naming a command of another device (a bridge that once served
// that device knows its ids) changes nothing of that command: neither its
// state, nor what this replica keeps of it on its way. Taken as an
// answer, it made the replica drop the command from those it had handed
// to the MQTT broker, so that "sent" was never written: the command read
// queued for good, though the broker had it (bug 139).
func TestReplyForAnotherDevicesCommandChangesNothing(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "x", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	fb.reply(t, "dev-2", topics.Reply{CommandID: c.ID, State: companion.StateDelivered, At: time.Now()})
	// "sent" is written sentDelay after the PUBACK; 2 s is well past it,
	// and well before the command would go out again and be written so.
	testenv.Eventually(t, 2*time.Second, "the command written sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })
	e.b.mu.Lock()
	defer e.b.mu.Unlock()
	assert.True(t, e.b.live[c.ID], "the command no longer live here")
}

// unusableSettings is a device's settings of n settings whose type the
// server does not know, each with its reported value (past 8,000 more than
// a message holds: the benchmark is of the time each takes).
func unusableSettings(n int) topics.Settings {
	s := topics.Settings{Reported: map[string]any{}, Schema: topics.Schema{}}
	for i := range n {
		k := fmt.Sprintf("k%d", i)
		s.Reported[k], s.Schema[k] = 0.0, topics.SettingSpec{Type: "x"}
	}
	return s
}

// BenchmarkUnusableSettings measures the intake of a settings message of
// 8,000 settings the server cannot use, about what 256 KiB holds: each was
// looked for among all the others, 64 million comparisons on the intake
// that takes every bridge's messages in turn (docs/reliability.md, bug 144).
func BenchmarkUnusableSettings(b *testing.B) {
	br := &Broker{log: slog.New(slog.DiscardHandler), noisy: logevery.New(slog.New(slog.DiscardHandler), time.Minute, nil)}
	s := unusableSettings(8000)
	for b.Loop() {
		r, err := br.reportedSettings("dev-1", s)
		if err != nil || len(r.Reported) != 0 {
			b.Fatalf("reportedSettings = %d values, %v; want none", len(r.Reported), err)
		}
	}
}

// hangUpStore is e's store whose UpdateCommand answers as PostgreSQL's
// does when its caller's context ends while the write is in a lane's
// batch: the write commits, and the caller gets the context's error.
// hangUp, when set, is the caller going away during the write.
type hangUpStore struct {
	*store.DB
	hangUp atomic.Pointer[context.CancelFunc]
}

func (s *hangUpStore) UpdateCommand(ctx context.Context, id string, fn func(*companion.Command) error) (companion.Command, error) {
	cmd, err := s.DB.UpdateCommand(context.WithoutCancel(ctx), id, fn)
	if f := s.hangUp.Swap(nil); f != nil {
		(*f)()
	}
	if ctx.Err() != nil {
		return companion.Command{}, ctx.Err()
	}
	return cmd, err
}

// A cancel whose client hung up while the store wrote it is canceled
// all the same (PostgreSQL's lane commits it): the bridge is told, and a
// later Wait on it answers at once (docs/reliability.md, bug 276).
func TestACancelWhoseClientHungUpIsWithdrawnFromTheBridge(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *hangUpStore { return &hangUpStore{DB: db} })
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "canceled by a client that hung up", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })

	ctx, hangUp := context.WithCancel(context.Background())
	st.hangUp.Store(&hangUp)
	_, _ = e.b.Cancel(ctx, c.ID)
	require.Equal(t, companion.StateCanceled, state(t, e, c.ID).State, "stored")
	select {
	case got := <-fb.commands:
		require.Equal(t, topics.OpCancel, got.Op, "withdrawn: %+v", got)
		var p topics.Cancel
		require.NoError(t, json.Unmarshal(got.Payload, &p))
		assert.Equal(t, c.ID, p.CommandID)
	case <-time.After(5 * time.Second):
		t.Fatal("no cancel reached the bridge: it runs the command, which reads canceled")
	}
	wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := e.b.Wait(wctx, c.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateCanceled, got.State)
	assert.NoError(t, wctx.Err(), "Wait answered only when its time ran out")
}

// movingStore moves dev-1 to b2 as the broker stores its settings, after
// the broker read its bridge: the race of a move with a late report.
type movingStore struct {
	*store.DB
	stored chan bool
}

func (s *movingStore) PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(bool, error)) {
	if _, err := s.DB.AssignDevice(context.Background(), deviceID, "b2", ""); err != nil {
		done(false, err)
		return
	}
	s.DB.PutReportedSettingsAsync(deviceID, bridgeID, reported, schema, at, seq, func(applied bool, err error) {
		done(applied, err)
		s.stored <- applied && err == nil
	})
}

// Settings the bridge a device left reported, taken in as the device
// moved, are not stored: with its clock ahead, they held the new bridge's
// reports off, and GET …/settings read the old bridge's values
// (docs/reliability.md, bug 272).
func TestSettingsOfTheBridgeADeviceLeftAreNotStored(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *movingStore { return &movingStore{DB: db, stored: make(chan bool, 1)} })
	ctx := context.Background()
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("not used")}))
	fb := connectBridge(t, e)
	topic, _ := tree.Settings("dev-1")
	ahead := time.Now().Add(time.Hour)
	fb.publish(t, topic, topics.Settings{Reported: map[string]any{"volume": 7}, Seq: uint64(ahead.UnixNano()), At: ahead})
	select {
	case stored := <-st.stored:
		assert.False(t, stored, "b1's settings stored after dev-1 moved to b2")
	case <-time.After(10 * time.Second):
		t.Fatal("the settings never reached the store")
	}
	s, err := e.db.Settings(ctx, "dev-1")
	require.NoError(t, err)
	assert.Empty(t, s.Reported, "dev-1's settings after its move")
	assert.Zero(t, s.Seq, "dev-1's settings seq after its move")
}

// movingReplyStore moves dev-1 to b2 as the broker stores a final reply of
// it, after the broker read its bridge: the race of a move with a late
// reply.
type movingReplyStore struct {
	*store.DB
}

func (s *movingReplyStore) UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	if report.Settings != nil {
		if _, err := s.DB.AssignDevice(context.Background(), "dev-1", "b2", ""); err != nil {
			done(companion.Command{}, err)
			return
		}
	}
	s.DB.UpdateCommandWithReportAsync(id, fn, report, done)
}

// The settings in a final reply of the bridge a device left, taken in as
// the device moved, are not stored, as those of the settings topic are
// not (bug 272): with its clock ahead, they held the new bridge's reports
// off, and GET …/settings read the old bridge's values (docs/reliability.md,
// bug 289). The reply's state is stored.
func TestReplySettingsOfTheBridgeADeviceLeftAreNotStored(t *testing.T) {
	e, _ := newEnvOn(t, func(db *store.DB) *movingReplyStore { return &movingReplyStore{DB: db} })
	ctx := context.Background()
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("not used")}))
	fb := connectBridge(t, e)
	c := submit(t, e, "dev-1", "run on b1", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	ahead := time.Now().Add(time.Hour)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now(),
		Settings: &topics.Settings{Reported: map[string]any{"volume": 7}, Seq: uint64(ahead.UnixNano()), At: ahead}})
	testenv.Eventually(t, 10*time.Second, "the reply taken", func() bool { return state(t, e, c.ID).State == companion.StateSucceeded })
	s, err := e.db.Settings(ctx, "dev-1")
	require.NoError(t, err)
	assert.Empty(t, s.Reported, "dev-1's settings after its move: b1's final reply's stored")
	assert.Zero(t, s.Seq, "dev-1's settings seq after its move")
}

// latencies keeps the accept-to-final latencies the broker observed.
type latencies struct {
	nopObserver
	mu   sync.Mutex
	ages []time.Duration
}

func (l *latencies) CommandState(_, state string, age time.Duration) {
	if companion.IsFinal(state) {
		l.mu.Lock()
		l.ages = append(l.ages, age)
		l.mu.Unlock()
	}
}

func (l *latencies) observed() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.ages)
}

// A command that ends after the server's clock stepped back (NTP setting
// a fast clock right) has an accept-to-final latency of no less than 0:
// the time from its created_at, a wall time, to the clock was an hour
// below zero, and companion_command_duration_seconds took it in, its sum
// falling (bug 354).
func TestLatencyAfterTheClockSteppedBackIsNotNegative(t *testing.T) {
	obs := &latencies{}
	e := newEnvTuned(t, true, nil, func(o *Options) { o.Observer = obs })
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	c := submit(t, e, "dev-1", "before the step", time.Hour)
	require.Equal(t, c.ID, fb.next(t).ID)
	e.clock.Add(-time.Hour)
	fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the final state observed", func() bool { return len(obs.observed()) > 0 })
	if ages := obs.observed(); ages[0] < 0 {
		t.Errorf("accept-to-final latency %v; want none below 0", ages[0])
	}
}

// offsetStore is a store whose times are on a clock off the broker's by
// offset, as store/postgres's are on the database's (ClockOffset).
type offsetStore struct {
	*store.DB
	offset time.Duration
}

func (s offsetStore) ClockOffset() time.Duration { return s.offset }

// A command's TTL runs on the clock of the store's times: a dispatcher 2 h
// ahead of the database expired at once the commands of an hour's TTL it
// and every other replica accepted (docs/reliability.md, bug 314).
func TestExpiryByTheStoresClock(t *testing.T) {
	e, _ := newEnvOn(t, func(db *store.DB) offsetStore { return offsetStore{db, -2 * time.Hour} })
	fb := connectBridge(t, e)
	p, _ := json.Marshal(topics.PushText{Text: "an hour's TTL"})
	// Stored as store/postgres stores it: expires_at an hour ahead by
	// the database's clock, 2 h behind the broker's.
	c, _, err := e.db.CreateCommand(context.Background(), companion.Command{
		DeviceID: "dev-1", UserID: "u1", Op: topics.OpPushText, Payload: p, ExpiresAt: e.clock.Now().Add(-2*time.Hour + time.Hour),
	}, 0, nil)
	require.NoError(t, err)
	e.b.wake() // stored behind the broker's back: the outbox reads it anew
	assert.Equal(t, c.ID, fb.next(t).ID, "the command, published")
	assert.NotEqual(t, companion.StateExpired, state(t, e, c.ID).State)
}
