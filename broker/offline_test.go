package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// statusHookStore is e's store whose reads of a status call hook first,
// and after, if set, once the status is read.
type statusHookStore struct {
	*store.DB
	hook, after func(deviceID string)
}

func (s *statusHookStore) Status(ctx context.Context, deviceID string) (companion.Status, error) {
	if s.hook != nil {
		s.hook(deviceID)
	}
	st, err := s.DB.Status(ctx, deviceID)
	if s.after != nil {
		s.after(deviceID)
	}
	return st, err
}

// After a bridge's Will the server publishes each of its devices' retained
// status as offline (publishOffline), but not while its connection to the
// MQTT broker is down: paho would hold such a status and send it after the
// reconnect, over what the bridge, back meanwhile, said of the device.
// Here the connection breaks as the first device's status goes out, and
// the bridge comes back before the server reconnects: the second device's
// retained status stays what the bridge said. The first one's, past the
// check before the link broke, goes out after the reconnect, over the
// bridge's: the race the check narrows and cannot close. The intake,
// taking the bridge's online status in, publishes it again over the
// offline one (repairStatus).
func TestOfflineStatusesAreNotHeldWhileTheConnectionIsDown(t *testing.T) {
	e := newEnv(t, false)
	link := testenv.NewRelay(t, e.mqtt.Addr())
	var (
		reads atomic.Int32
		first atomic.Value // the device whose status publishOffline read first
	)
	st := &statusHookStore{DB: e.db}
	opts := e.b.opts
	opts.Store = st
	opts.MQTTURL = "tcp://" + link.Addr()
	b, err := New(opts)
	require.NoError(t, err)
	e.b = b
	st.hook = func(deviceID string) {
		if reads.Add(1) != 1 {
			return
		}
		first.Store(deviceID)
		link.Refuse()
		testenv.Eventually(t, 10*time.Second, "the server's connection down", func() bool { return !b.client.IsConnectionOpen() })
	}
	require.NoError(t, b.Start())
	t.Cleanup(func() { b.Close() })
	testenv.Eventually(t, 10*time.Second, "broker ready", b.Ready)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	fb.online(t, e, "dev-2")
	w := watchStatuses(t, e, "dev-1", "dev-2")

	// The Will at QoS 0: the link breaks before the server's PUBACK of a
	// QoS 1 one may have gone out, and the broker would deliver it again
	// after the reconnect, ahead of the bridge's return, and have the
	// server publish both statuses offline anew, the link up.
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 0, true, topics.BridgeOffline), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "publishOffline read a status", func() bool { return reads.Load() > 0 })
	time.Sleep(300 * time.Millisecond) // the rest of publishOffline's loop, a few microseconds

	// The bridge is back, and says so, while the server is away.
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	for _, dev := range []string{"dev-1", "dev-2"} {
		topic, _ := tree.Status(dev)
		p, _ := json.Marshal(topics.Status{Online: true, BridgeID: "b1", Seq: 2, At: time.Now()})
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, p), 5*time.Second))
	}
	link.Restore()
	testenv.Eventually(t, 20*time.Second, "the server back, with the bridge's statuses", func() bool {
		for _, dev := range []string{"dev-1", "dev-2"} {
			if s, err := e.db.Status(context.Background(), dev); err != nil || s.Seq != 2 {
				return false
			}
		}
		return b.client.IsConnectionOpen()
	})
	firstDev := first.Load().(string)
	second := "dev-2"
	if firstDev == "dev-2" {
		second = "dev-1"
	}
	testenv.Eventually(t, 10*time.Second, "the first device's offline status, past the check, out after the reconnect (else this test shows nothing)", func() bool {
		return w.offlineAfter(firstDev, 2)
	})
	time.Sleep(time.Second) // what paho held, and any repair, goes out
	assert.False(t, w.offlineAfter(second, 2), "%s: the offline status was held while the connection was down, and sent over the bridge's", second)
	for _, dev := range []string{"dev-1", "dev-2"} {
		testenv.Eventually(t, 10*time.Second, dev+"'s retained status the bridge's, online", func() bool {
			s, ok := w.last(dev)
			return ok && s.Online && s.Seq == 2
		})
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	assert.Empty(t, b.offline, "a device whose bridge's status was taken in stays marked")
}

// The bridge, back, says its device is online after publishOffline read
// the device's status (offline) and before its offline status went out:
// the intake takes the online status in and publishes it again at once,
// ahead of the offline one; so publishOffline, once its offline status is
// acknowledged, publishes the store's status once more, and the retained
// status ends the bridge's.
func TestAnOnlineStatusTakenInAsTheOfflineOneGoesOutIsPublishedAgain(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *statusHookStore { return &statusHookStore{DB: db} })
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	w := watchStatuses(t, e, "dev-1")
	topic, _ := tree.Status("dev-1")

	var reads atomic.Int32
	st.after = func(deviceID string) {
		if reads.Add(1) != 1 {
			return
		}
		p, _ := json.Marshal(topics.Status{Online: true, BridgeID: "b1", Seq: 2, At: time.Now()})
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, p), 5*time.Second))
		testenv.Eventually(t, 10*time.Second, "the bridge's status and the intake's repair heard", func() bool {
			return w.count("dev-1", true, 2) == 2
		})
	}
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second))
	testenv.Eventually(t, 10*time.Second, "the offline status, read before the bridge's, out after it (else this test shows nothing)", func() bool {
		return w.offlineAfter("dev-1", 2)
	})
	testenv.Eventually(t, 10*time.Second, "the retained status the bridge's, online", func() bool {
		s, ok := w.last("dev-1")
		return ok && s.Online && s.Seq == 2
	})
}

// statusWatch records every status a watcher of the devices hears, in
// order (watchStatus's channels, drained as it is asked).
type statusWatch struct {
	mu   sync.Mutex
	chs  map[string]<-chan topics.Status
	seen map[string][]topics.Status
}

func watchStatuses(t *testing.T, e *env, devices ...string) *statusWatch {
	t.Helper()
	w := &statusWatch{chs: map[string]<-chan topics.Status{}, seen: map[string][]topics.Status{}}
	for _, dev := range devices {
		w.chs[dev] = watchStatus(t, e, dev)
	}
	return w
}

// heard returns what the watcher of dev has heard so far. Called with mu
// held.
func (w *statusWatch) heard(dev string) []topics.Status {
	for {
		select {
		case s := <-w.chs[dev]:
			w.seen[dev] = append(w.seen[dev], s)
		default:
			return w.seen[dev]
		}
	}
}

// count is how many statuses of dev with online and seq were heard.
func (w *statusWatch) count(dev string, online bool, seq uint64) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, s := range w.heard(dev) {
		if s.Online == online && s.Seq == seq {
			n++
		}
	}
	return n
}

// offlineAfter reports whether an offline status of the device was heard
// after its status of seq.
func (w *statusWatch) offlineAfter(dev string, seq uint64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	after := false
	for _, s := range w.heard(dev) {
		if s.Online && s.Seq == seq {
			after = true
		}
		if after && !s.Online {
			return true
		}
	}
	return false
}

// last is the device's status heard last: what the broker retains.
func (w *statusWatch) last(dev string) (topics.Status, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if heard := w.heard(dev); len(heard) > 0 {
		return heard[len(heard)-1], true
	}
	return topics.Status{}, false
}

// A status older than the one stored (a late repeat, a bridge whose clock
// went back), published live, is not stored, and the broker retains it all
// the same: the intake publishes the store's status over it, so that a
// watcher, and whoever subscribes later, never read an older status than
// the store's (CONTRACT §3). The store's status coming back is not older:
// it is published once.
func TestAnOlderStatusPublishedIsMendedOnTheBroker(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	topic, _ := tree.Status("dev-1")
	at := time.Now().UTC().Truncate(time.Millisecond)
	newer := topics.Status{Online: true, BridgeID: "b1", FirmwareVersion: "2.0.0", Apps: []companion.App{}, Seq: 20, At: at}
	retain := func(s topics.Status) {
		t.Helper()
		b, err := json.Marshal(s)
		require.NoError(t, err)
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, b), 5*time.Second))
	}
	retain(newer)
	testenv.Eventually(t, 10*time.Second, "the newer status stored", func() bool {
		s, err := e.db.Status(context.Background(), "dev-1")
		return err == nil && s.Seq == 20
	})
	w := watchStatuses(t, e, "dev-1")
	testenv.Eventually(t, 10*time.Second, "the retained status heard by the watcher", func() bool {
		return w.count("dev-1", true, 20) == 1
	})
	older := newer
	older.Seq, older.At, older.FirmwareVersion, older.Online = 10, at.Add(-time.Minute), "1.0.0", false
	retain(older) // acknowledged: the broker retains it
	testenv.Eventually(t, 10*time.Second, "the store's status published over the older one", func() bool {
		return w.count("dev-1", true, 20) == 2 // the bridge's, retained when the watcher came; the intake's
	})
	assert.Equal(t, newer.Seq, retainedStatus(t, e, "dev-1").Seq, "the retained status")
	s, err := e.db.Status(context.Background(), "dev-1")
	require.NoError(t, err)
	assert.Equal(t, "2.0.0", s.FirmwareVersion, "the older status stored")
	time.Sleep(200 * time.Millisecond)
	assert.Equal(t, 2, w.count("dev-1", true, 20), "the store's status published again when it came back")
}

// While a bridge is away (its Will taken), its devices' commands stay
// queued in the store rather than pile up in the MQTT broker's session for
// it: mochi copies and sorts a client's whole queue every second, and holds
// a core once a bridge away has tens of thousands (docs/performance.md),
// and Mosquitto drops past its max_queued_messages. Back ("online"), the
// bridge gets them in order, each naming the one before.
func TestCommandsOfABridgeAwayStayQueued(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second)) // its Will
	fb.c.Disconnect(250)                                                                                      // its session stays
	testenv.Eventually(t, 10*time.Second, "the bridge taken as away", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.away["b1"]
	})

	var cmds []companion.Command
	for _, text := range []string{"first", "second", "third"} {
		cmds = append(cmds, submit(t, e, "dev-1", text, time.Hour))
	}
	// Handed to the MQTT broker, they would read sent sentDelay after its
	// PUBACK.
	time.Sleep(3 * sentDelay)
	for _, c := range cmds {
		assert.Equal(t, companion.StateQueued, state(t, e, c.ID).State, "a command of a bridge away left the store")
	}

	back := connectBridge(t, e)
	back.none(t, 300*time.Millisecond, "a command was in the session of a bridge away")
	require.NoError(t, mqtt.WaitTokenTimeout(back.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	after := ""
	for _, c := range cmds {
		got := back.next(t)
		require.Equal(t, c.ID, got.ID, "the held commands go out in order")
		assert.Equal(t, after, got.After)
		after = got.ID
	}
	back.none(t, 300*time.Millisecond, "a command twice")
}

// queuedReads is e's store, which records what each QueuedCommandsWith
// returned.
type queuedReads struct {
	*store.DB
	mu    sync.Mutex
	reads [][]companion.Command
}

func (s *queuedReads) QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error) {
	cmds, err := s.DB.QueuedCommandsWith(ctx, deviceIDs, skip)
	s.mu.Lock()
	s.reads = append(s.reads, slices.Clone(cmds)) // the outbox filters cmds in place
	s.mu.Unlock()
	return cmds, err
}

// lastRead has the outbox read the store and returns what it read.
func (s *queuedReads) lastRead(t *testing.T, b *Broker) []companion.Command {
	t.Helper()
	s.mu.Lock()
	n := len(s.reads)
	s.mu.Unlock()
	b.mu.Lock()
	b.scan = true
	b.mu.Unlock()
	b.wake()
	var got []companion.Command
	testenv.Eventually(t, 10*time.Second, "the outbox's read", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		if len(s.reads) > n {
			got = s.reads[len(s.reads)-1]
		}
		return len(s.reads) > n
	})
	return got
}

// The commands held for a bridge away are not read again with every pass
// of the outbox (each accepted command, with replicas): a bridge away for
// a day may have tens of thousands. Another device's are, and the held
// ones are again once the bridge is back.
func TestCommandsHeldForABridgeAwayAreNotReadEachPass(t *testing.T) {
	e, st := newEnvOn(t, func(db *store.DB) *queuedReads { return &queuedReads{DB: db} })
	ctx := context.Background()
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: []byte("x")}))
	require.NoError(t, e.db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "dev-3", Model: "sim-1"}))
	bind(t, e, "dev-3") // no bridge: its commands wait queued, and are read each pass
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second))
	fb.c.Disconnect(250)
	testenv.Eventually(t, 10*time.Second, "the bridge taken as away", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.away["b1"]
	})
	held := submit(t, e, "dev-1", "held", time.Hour)
	unserved := submit(t, e, "dev-3", "no bridge", time.Hour)
	testenv.Eventually(t, 10*time.Second, "the held command taken as held", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.awayDevices["dev-1"] == "b1"
	})

	assert.Equal(t, []string{unserved.ID}, commandIDs(st.lastRead(t, e.b)), "the outbox's read of the store")
	assert.Equal(t, companion.StateQueued, state(t, e, held.ID).State)

	back := connectBridge(t, e)
	require.NoError(t, mqtt.WaitTokenTimeout(back.c.Publish(bs, 1, true, topics.BridgeOnline), 5*time.Second))
	assert.Equal(t, held.ID, back.next(t).ID)
}

func commandIDs(cmds []companion.Command) []string {
	ids := []string{}
	for _, c := range cmds {
		ids = append(ids, c.ID)
	}
	return ids
}

// A bridge taken as away that is heard from (a device's status, as it
// publishes it) is back: its Will came after it was, or its "online" was
// lost. Its devices' held commands go, rather than wait for its next
// "online", which a bridge that stays connected never sends, past their
// TTL.
func TestABridgeAwayThatReportsGetsItsHeldCommands(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	bs, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, topics.BridgeOffline), 5*time.Second)) // a stale Will
	testenv.Eventually(t, 10*time.Second, "the bridge taken as away", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return e.b.away["b1"]
	})
	held := submit(t, e, "dev-1", "held", time.Hour)
	fb.none(t, 3*sentDelay, "a command of a bridge away")

	topic, _ := tree.Status("dev-1")
	fb.publish(t, topic, topics.Status{Online: true, BridgeID: "b1", Seq: 2, At: time.Now()})
	assert.Equal(t, held.ID, fb.next(t).ID, "the held command goes once the bridge is heard from")
}

// bridgesKnown is how many bridges the broker keeps state of, and how many
// it takes as away.
func (b *Broker) bridgesKnown() (known, away int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.bridgeGen), len(b.away)
}

// A bridge deleted is forgotten: one away as it is deleted, and one whose
// Will comes after (the broker's accounts close its connection), is not
// taken as away for good (companion_bridges_away, and its alert, stayed
// up for ever, and the broker kept each deleted bridge's state), and the
// MQTT broker retains no state of it, which the server took in again at
// every restart.
func TestDeletedBridgesAreForgotten(t *testing.T) {
	e := newEnvTuned(t, true, nil, func(o *Options) { o.SentRetry = 200 * time.Millisecond })
	ctx := context.Background()
	client := func(id string) mqtt.Client {
		c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID(id).
			SetUsername("server").SetPassword("pw"))
		require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
		t.Cleanup(func() { c.Disconnect(0) })
		return c
	}
	srv := client("test-server")
	// What each bridge's state topic carried, in order.
	var mu sync.Mutex
	seen := map[string][]string{}
	require.NoError(t, mqtt.WaitTokenTimeout(client("test-watcher").Subscribe(tree.AllBridgeStates(), 1, func(_ mqtt.Client, m mqtt.Message) {
		if topic, err := tree.Parse(m.Topic()); err == nil {
			mu.Lock()
			seen[topic.BridgeID] = append(seen[topic.BridgeID], string(m.Payload()))
			mu.Unlock()
		}
	}), 5*time.Second))
	will := func(id string) {
		t.Helper()
		topic, _ := tree.BridgeState(id)
		require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(topic, 1, true, topics.BridgeOffline), 5*time.Second))
	}

	const n = 20
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("gone-%d", i)
		require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: ids[i], OwnerID: "u1", SecretHash: []byte(ids[i])}))
	}
	// Half are away as they are deleted.
	for _, id := range ids[:n/2] {
		will(id)
	}
	testenv.Eventually(t, 10*time.Second, "the bridges away", func() bool {
		_, away := e.b.bridgesKnown()
		return away == n/2
	})
	for i, id := range ids {
		_, err := e.db.DeleteBridge(ctx, id, "u1")
		require.NoError(t, err)
		e.b.BridgeDeleted(id)
		if i >= n/2 {
			will(id) // its Will, as its connection is closed
		}
	}
	testenv.Eventually(t, 10*time.Second, "the deleted bridges forgotten, none away", func() bool {
		known, away := e.b.bridgesKnown()
		return known == 0 && away == 0
	})
	// And still once each one's state is cleared after its Will: for those
	// whose Will came after the deletion, once more when it was taken in.
	testenv.Eventually(t, 10*time.Second, "every deleted bridge's state cleared after its Will", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for i, id := range ids {
			s := seen[id]
			clears := len(s) - len(slices.DeleteFunc(slices.Clone(s), func(p string) bool { return p == "" }))
			if !slices.Contains(s, topics.BridgeOffline) || s[len(s)-1] != "" || i >= n/2 && clears < 2 {
				return false
			}
		}
		return true
	})
	testenv.Eventually(t, 10*time.Second, "the deleted bridges forgotten once their Wills are in", func() bool {
		known, away := e.b.bridgesKnown()
		return known == 0 && away == 0
	})

	// A replica that did not hear of a deletion (its MQTT connection down
	// as the state was cleared) forgets the bridge all the same.
	require.NoError(t, e.db.CreateBridge(ctx, companion.Bridge{ID: "unheard", OwnerID: "u1", SecretHash: []byte("unheard")}))
	will("unheard")
	testenv.Eventually(t, 10*time.Second, "the bridge away", func() bool {
		_, away := e.b.bridgesKnown()
		return away == 1
	})
	_, err := e.db.DeleteBridge(ctx, "unheard", "u1")
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, "the bridge deleted unheard forgotten", func() bool {
		_, away := e.b.bridgesKnown()
		return away == 0
	})

	// Nothing of them is retained: a server restarted would take them as
	// away again. The first message on a topic of theirs after the
	// subscription's SUBACK is the one published after it.
	got := make(chan mqtt.Message, 2*n)
	watcher := client("test-late-watcher")
	for _, id := range ids {
		topic, _ := tree.BridgeState(id)
		require.NoError(t, mqtt.WaitTokenTimeout(watcher.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) { got <- m }), 5*time.Second))
		require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(topic, 1, false, "marker"), 5*time.Second))
		select {
		case m := <-got:
			assert.Equal(t, "marker", string(m.Payload()), "the MQTT broker retains %q for deleted bridge %s", m.Payload(), id)
			if m.Retained() {
				<-got // the marker
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the marker did not come")
		}
	}
}

// Settings older than the stored ones (a late repeat, a bridge whose clock
// went back), published live, are not stored, and the broker retains them
// all the same: the intake publishes the store's settings over them, as it
// does a status (TestAnOlderStatusPublishedIsMendedOnTheBroker), so that
// whoever subscribes later reads the settings GET …/settings does
// (docs/reliability.md, bug 348). The store's settings coming back are not
// older: they are published once.
func TestOlderSettingsPublishedAreMendedOnTheBroker(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	topic, _ := tree.Settings("dev-1")
	at := time.Now().UTC().Truncate(time.Millisecond)
	schema := topics.Schema{"volume": {Type: "int", Default: float64(5)}}
	newer := topics.Settings{Reported: map[string]any{"volume": float64(7)}, Schema: schema, At: at, Seq: 20}
	retain := func(s topics.Settings) {
		t.Helper()
		b, err := json.Marshal(s)
		require.NoError(t, err)
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, b), 5*time.Second))
	}
	retain(newer)
	testenv.Eventually(t, 10*time.Second, "the newer settings stored", func() bool {
		s, err := e.db.Settings(context.Background(), "dev-1")
		return err == nil && s.Seq == 20
	})
	heard := make(chan topics.Settings, 100)
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("settings-watcher").
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
	t.Cleanup(func() { c.Disconnect(0) })
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) {
		var s topics.Settings
		if json.Unmarshal(m.Payload(), &s) == nil {
			heard <- s
		}
	}), 5*time.Second))
	next := func(what string) topics.Settings {
		t.Helper()
		select {
		case s := <-heard:
			return s
		case <-time.After(10 * time.Second):
			t.Fatalf("no settings heard: %s", what)
			return topics.Settings{}
		}
	}
	require.Equal(t, uint64(20), next("the retained settings").Seq)

	older := newer
	older.Seq, older.At, older.Reported = 10, at.Add(-time.Minute), map[string]any{"volume": float64(1)}
	retain(older) // acknowledged: the broker retains it
	require.Equal(t, uint64(10), next("the older settings, live").Seq)
	mended := next("the store's settings published over the older ones")
	assert.Equal(t, uint64(20), mended.Seq)
	assert.Equal(t, newer.Reported, mended.Reported)

	late := watchSettingsOnce(t, e, topic)
	assert.Equal(t, uint64(20), late.Seq, "the retained settings a later subscriber reads")
	assert.Equal(t, newer.Reported, late.Reported, "the retained settings a later subscriber reads")
	select {
	case s := <-heard:
		t.Errorf("settings published again as the store's came back: %+v", s)
	case <-time.After(300 * time.Millisecond):
	}
}

// watchSettingsOnce reads topic, a device's settings, as a new subscriber
// does: its retained message.
func watchSettingsOnce(t *testing.T, e *env, topic string) topics.Settings {
	t.Helper()
	ch := make(chan topics.Settings, 10)
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("settings-late-" + uuid.NewString()).
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
	t.Cleanup(func() { c.Disconnect(0) })
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(topic, 1, func(_ mqtt.Client, m mqtt.Message) {
		var s topics.Settings
		if json.Unmarshal(m.Payload(), &s) == nil {
			ch <- s
		}
	}), 5*time.Second))
	select {
	case s := <-ch:
		return s
	case <-time.After(10 * time.Second):
		t.Fatal("no retained settings")
		return topics.Settings{}
	}
}

// A status or settings whose seq is far past the server's clock (a bridge's
// clock set days ahead) is not stored (TestReportWithASeqFarAheadIsRefused),
// and the broker retains it all the same: the intake publishes the store's
// over it, as over an older one, so that whoever subscribes later reads
// what GET …/status and GET …/settings do, not the firmware or values the
// server refused (docs/reliability.md, bug 352).
func TestAReportFromFarAheadIsMendedOnTheBroker(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	status, _ := tree.Status("dev-1")
	settings, _ := tree.Settings("dev-1")
	at := time.Now().UTC().Truncate(time.Millisecond)
	retain := func(topic string, v any) {
		t.Helper()
		b, err := json.Marshal(v)
		require.NoError(t, err)
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(topic, 1, true, b), 5*time.Second))
	}
	retain(status, topics.Status{Online: true, BridgeID: "b1", FirmwareVersion: "1.0.0", Apps: []companion.App{}, Seq: 20, At: at})
	retain(settings, topics.Settings{Reported: map[string]any{"volume": float64(7)}, Seq: 20, At: at})
	testenv.Eventually(t, 10*time.Second, "the status and settings stored", func() bool {
		s, err1 := e.db.Status(context.Background(), "dev-1")
		set, err2 := e.db.Settings(context.Background(), "dev-1")
		return err1 == nil && err2 == nil && s.Seq == 20 && set.Seq == 20
	})
	w := watchStatuses(t, e, "dev-1")
	testenv.Eventually(t, 10*time.Second, "the retained status heard", func() bool { return w.count("dev-1", true, 20) == 1 })
	far := uint64(time.Now().Add(72 * time.Hour).UnixNano())
	retain(status, topics.Status{Online: true, BridgeID: "b1", FirmwareVersion: "6.6.6", Apps: []companion.App{}, Seq: far, At: at})
	retain(settings, topics.Settings{Reported: map[string]any{"volume": float64(1)}, Seq: far, At: at})
	testenv.Eventually(t, 10*time.Second, "the store's status published over the one from far ahead", func() bool {
		return w.count("dev-1", true, 20) == 2
	})
	assert.Equal(t, "1.0.0", retainedStatus(t, e, "dev-1").FirmwareVersion, "the retained status's firmware")
	testenv.Eventually(t, 10*time.Second, "the store's settings retained", func() bool {
		return watchSettingsOnce(t, e, settings).Seq == 20
	})
}
