package broker

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/asyncapitest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// newReplicas makes e's broker one of two replicas on one store and one
// MQTT broker (CONTRACT §11), the one that dispatches, and starts it; the
// other, which does not dispatch, is returned started. set, if given,
// changes both replicas' options.
func newReplicas(t *testing.T, set ...func(*Options)) (e *env, other *Broker) {
	t.Helper()
	e = newEnv(t, false)
	for _, f := range set {
		f(&e.b.opts)
	}
	on := &dispatcher{}
	on.on.Store(true)
	e.b.opts.Dispatcher = on
	require.NoError(t, e.b.Start())
	t.Cleanup(func() { e.b.Close() })
	opts := e.b.opts
	opts.ClientID += "-other"
	opts.Dispatcher = &dispatcher{}
	other, err := New(opts)
	require.NoError(t, err)
	require.NoError(t, other.Start())
	t.Cleanup(func() { other.Close() })
	testenv.Eventually(t, 10*time.Second, "both replicas ready", func() bool { return e.b.Ready() && other.Ready() })
	return e, other
}

// A device moved to another bridge through a replica that does not
// dispatch has its unfinished commands sent to the new bridge at once, as
// when the dispatcher itself is told (DeviceMoved): not a minute later
// (retrySent, and only while the device reads online), nor only once the
// new bridge next says "online".
func TestDeviceMovedThroughAnotherReplicaResendsAtOnce(t *testing.T) {
	ctx := context.Background()
	e, other := newReplicas(t)
	fb1 := connectBridge(t, e)
	c := submit(t, e, "dev-1", "sent to b1", time.Hour)
	require.Equal(t, c.ID, fb1.next(t).ID)
	testenv.Eventually(t, 10*time.Second, "sent", func() bool { return state(t, e, c.ID).State == companion.StateSent })

	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("b2: not used either")}))
	_, err := e.db.AssignDevice(ctx, "dev-1", "b2", "")
	require.NoError(t, err)
	fb2 := connectBridgeAs(t, e, "b2", "dev-1") // granted now that b2 serves dev-1
	other.DeviceMoved("dev-1")
	select {
	case got := <-fb2.commands:
		assert.Equal(t, c.ID, got.ID)
	case <-time.After(5 * time.Second):
		t.Fatal("the command did not go to the bridge the device moved to")
	}
}

// unreachableStore is e's store, whose OpenCommands and
// QueuedCommandsWith fail while fail is set, as a PostgreSQL store's does while the database is away.
type unreachableStore struct {
	*store.DB
	fail   atomic.Bool
	failed atomic.Int32 // how many reads failed
}

func (s *unreachableStore) OpenCommands(ctx context.Context, states ...string) ([]companion.Command, error) {
	if s.fail.Load() {
		s.failed.Add(1)
		return nil, errors.New("test: the store is unreachable")
	}
	return s.DB.OpenCommands(ctx, states...)
}

func (s *unreachableStore) QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error) {
	if s.fail.Load() {
		s.failed.Add(1)
		return nil, errors.New("test: the store is unreachable")
	}
	return s.DB.QueuedCommandsWith(ctx, deviceIDs, skip)
}

// A dispatcher whose read of the store failed, and which then stopped
// dispatching (the same outage of PostgreSQL costs a replica its election),
// kept the set of commands answered during the failed pass (landed) for as
// long as it did not dispatch, and added to it every reply it took in:
// every replica takes every reply, so the set grew by a command id for
// every command the service ran.
func TestAFailedReadLeavesNoLandedSetBehind(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t, false)
	st := &unreachableStore{DB: e.db}
	d := &dispatcher{}
	d.on.Store(true)
	opts := e.b.opts
	opts.Store, opts.Dispatcher = st, d
	b, err := New(opts)
	require.NoError(t, err)
	e.b = b
	require.NoError(t, b.Start())
	t.Cleanup(func() { b.Close() })
	testenv.Eventually(t, 10*time.Second, "broker ready", b.Ready)
	fb := connectBridge(t, e)

	st.fail.Store(true)
	b.CommandChanged(ctx, "") // another replica's command: the dispatcher reads the store
	testenv.Eventually(t, 10*time.Second, "the read failed", func() bool { return st.failed.Load() > 0 })
	d.on.Store(false)
	b.DispatcherChanged(false)
	st.fail.Store(false)

	// Commands another replica dispatches, whose replies this one takes in.
	var ids []string
	for range 20 {
		c, _, err := e.db.CreateCommand(ctx, companion.Command{DeviceID: "dev-1", UserID: "u1", Op: topics.OpPushText,
			Payload: []byte(`{"text":"x"}`), ExpiresAt: e.clock.Now().Add(time.Hour)}, 0, nil)
		require.NoError(t, err)
		ids = append(ids, c.ID)
		fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()})
	}
	testenv.Eventually(t, 10*time.Second, "the replies taken", func() bool {
		for _, id := range ids {
			if state(t, e, id).State != companion.StateSucceeded {
				return false
			}
		}
		return true
	})
	b.mu.Lock()
	n := len(b.landed)
	b.mu.Unlock()
	assert.Zero(t, n, "command ids kept as landed by a replica that does not dispatch")
}

// failingBridgeStore is e's store, whose MarkBridgeOfflineAsync and
// ServedDevices fail the first fail times each is called, as a PostgreSQL
// store's do while the database restarts.
type failingBridgeStore struct {
	*store.DB
	offlineFails, servedFails atomic.Int32 // failures left
	offlineCalls              atomic.Int32
}

func (s *failingBridgeStore) MarkBridgeOfflineAsync(bridgeID string, done func([]string, error)) {
	s.offlineCalls.Add(1)
	if s.offlineFails.Add(-1) >= 0 {
		done(nil, errors.New("test: the store is unreachable"))
		return
	}
	s.DB.MarkBridgeOfflineAsync(bridgeID, done)
}

func (s *failingBridgeStore) ServedDevices(ctx context.Context, bridgeID string) ([]string, error) {
	if s.servedFails.Add(-1) >= 0 {
		return nil, errors.New("test: the store is unreachable")
	}
	return s.DB.ServedDevices(ctx, bridgeID)
}

// A bridge's Will, or its "online", that came while the store failed was
// acknowledged and dropped: the bridge's devices read online for as long as
// it stayed away, and the resend its "online" calls for (bug 2: final
// replies a crashed broker lost) never came, leaving commands delivered
// for good. Each is taken again, as a reply is, until the store takes it.
func TestBridgeStateTakenAgainWhenTheStoreFails(t *testing.T) {
	ctx := context.Background()
	e, st := newFailingBridgeEnv(t)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	delivered := submit(t, e, "dev-1", "delivered, its final reply lost", time.Hour)
	require.Equal(t, delivered.ID, fb.next(t).ID)
	fb.reply(t, "dev-1", topics.Reply{CommandID: delivered.ID, State: companion.StateDelivered, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "delivered", func() bool { return state(t, e, delivered.ID).State == companion.StateDelivered })

	// "online" with the store failing twice: the resend comes all the same.
	st.servedFails.Store(2)
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	assert.Equal(t, delivered.ID, fb.next(t).ID, "the unfinished command goes out again")

	// The Will with the store failing twice: the devices read offline.
	st.offlineFails.Store(2)
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "offline after the Will", func() bool {
		s, _ := e.db.Status(ctx, "dev-1")
		return !s.Online
	})
}

// newFailingBridgeEnv is newEnv with a started broker on a
// failingBridgeStore.
func newFailingBridgeEnv(t *testing.T) (*env, *failingBridgeStore) {
	t.Helper()
	e := newEnv(t, false)
	st := &failingBridgeStore{DB: e.db}
	opts := e.b.opts
	opts.Store = st
	b, err := New(opts)
	require.NoError(t, err)
	e.b = b
	require.NoError(t, b.Start())
	t.Cleanup(func() { b.Close() })
	testenv.Eventually(t, 10*time.Second, "broker ready", b.Ready)
	return e, st
}

// A Will the store failed to take is not taken again once the bridge has
// said "online" since: late, it would mark offline the devices the bridge
// reports online after it.
func TestBridgeWillTakenAgainNotAfterItsOnline(t *testing.T) {
	ctx := context.Background()
	e, st := newFailingBridgeEnv(t)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")

	st.offlineFails.Store(3) // the fourth attempt, within about a second, would be taken
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "the Will failed", func() bool { return st.offlineCalls.Load() > 0 })
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	status, _ := tree.Status("dev-1")
	fb.publish(t, status, topics.Status{Online: true, BridgeID: "b1", Seq: 2, At: time.Now()})
	testenv.Eventually(t, 10*time.Second, "the status after the online", func() bool {
		s, _ := e.db.Status(ctx, "dev-1")
		return s.Seq == 2
	})
	time.Sleep(3 * time.Second) // the Will's attempts, had they gone on (100, 200, 400 ms, each ±50%)
	s, err := e.db.Status(ctx, "dev-1")
	require.NoError(t, err)
	assert.True(t, s.Online, "the Will before the online was taken after it")
}

// kickedBridge connects bridge b1 serving dev-1, online, and returns a
// function that publishes its state (retained, as a Will is) and one that
// reads whether dev-1 is online in the store.
func kickedBridge(t *testing.T, e *env) (state func(string), online func() bool) {
	t.Helper()
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	bs, _ := tree.BridgeState("b1")
	state = func(s string) {
		t.Helper()
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, s), 5*time.Second))
	}
	online = func() bool {
		s, err := e.db.Status(context.Background(), "dev-1")
		require.NoError(t, err)
		return s.Online
	}
	return state, online
}

// The Will of a bridge about to be disconnected for a change of its rights
// (BridgesDisconnecting, told to one replica) is held on every replica: a
// bridge that says "online" again within the grace never has its devices
// read offline. One that does not come back has its Will taken in once the
// grace is over.
func TestTheWillOfABridgeDisconnectedForItsRightsIsHeld(t *testing.T) {
	grace := time.Second
	e, other := newReplicas(t, func(o *Options) { o.KickGrace = grace })

	state, online := kickedBridge(t, e)

	toldAt := func() time.Time {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.kicked["b1"]
	}
	// The word between the replicas, as docs/asyncapi.yaml has it.
	kicked := make(chan mqtt.Message, 10)
	w := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("kicked-watcher").
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(w.Connect(), 5*time.Second))
	defer w.Disconnect(0)
	require.NoError(t, mqtt.WaitTokenTimeout(w.Subscribe(tree.BridgesKicked(), 1, func(_ mqtt.Client, m mqtt.Message) { kicked <- m }), 5*time.Second))

	other.BridgesDisconnecting("b1") // told to the replica that does not dispatch
	testenv.Eventually(t, 10*time.Second, "the dispatcher told", func() bool { return !toldAt().IsZero() })
	select {
	case m := <-kicked:
		channel, err := asyncapitest.Load(t).Validate(m.Topic(), m.Payload(), m.Retained())
		require.NoError(t, err)
		assert.Equal(t, "bridgesKicked", channel)
		assert.Equal(t, "b1", string(m.Payload()))
	case <-time.After(10 * time.Second):
		t.Fatal("no word on the replicas' topic of a bridge about to be disconnected")
	}
	state(topics.BridgeOffline) // its Will, as NATS publishes it
	state(topics.BridgeOnline)  // back within the grace
	time.Sleep(2 * grace)
	assert.True(t, online(), "the device read offline: a held Will was taken in after the bridge's online")

	was := toldAt()
	other.BridgesDisconnecting("b1")
	testenv.Eventually(t, 10*time.Second, "the dispatcher told again", func() bool { return toldAt().After(was) })
	state(topics.BridgeOffline) // and not back
	time.Sleep(grace / 4)
	assert.True(t, online(), "the Will was taken in within the grace")
	testenv.Eventually(t, 10*time.Second, "the Will taken in after the grace", func() bool { return !online() })
}

// A bridge back from a disconnection for its rights (its held Will, then
// its "online") that stops or is lost after has its "offline" taken in at
// once, not held for the rest of the grace: the Will held was that
// disconnection's (docs/reliability.md, bug 224). The grace is an hour.
func TestABridgeBackFromAKickThatStopsReadsOffline(t *testing.T) {
	e, _ := newReplicas(t, func(o *Options) { o.KickGrace = time.Hour })
	state, online := kickedBridge(t, e)

	e.b.BridgesDisconnecting("b1")
	state(topics.BridgeOffline) // the Will of the disconnection, as NATS publishes it: held
	state(topics.BridgeOnline)  // back
	state(topics.BridgeOffline) // then stopped
	testenv.Eventually(t, 10*time.Second, "the device offline with its bridge stopped", func() bool { return !online() })
}

// namedKept is how many ids the broker keeps as named by a later command
// (named).
func (b *Broker) namedKept() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.named)
}

// Commands that went out as the one a later command runs after, and that
// another replica ended without a word from the bridge (canceled there, or
// ended by an unbind there), are forgotten by the dispatcher: it kept each
// one's id for as long as it ran.
func TestCommandsNamedAndEndedOnAnotherReplicaAreForgotten(t *testing.T) {
	ctx := context.Background()
	e, other := newReplicas(t, func(o *Options) { o.SentRetry = 200 * time.Millisecond })
	fb := connectBridge(t, e)
	var cmds []companion.Command
	for i := range 20 {
		c := submit(t, e, "dev-1", fmt.Sprintf("text %d", i), time.Hour)
		require.Equal(t, c.ID, fb.next(t).ID)
		cmds = append(cmds, c)
	}
	require.Equal(t, len(cmds)-1, e.b.namedKept(), "each but the last named by the next")
	for _, c := range cmds {
		_, err := other.Cancel(ctx, c.ID)
		require.NoError(t, err)
		e.b.CommandChanged(ctx, c.ID) // the store's notification
	}
	testenv.Eventually(t, 10*time.Second, "the commands ended on the other replica forgotten", func() bool {
		return e.b.namedKept() == 0
	})
}
