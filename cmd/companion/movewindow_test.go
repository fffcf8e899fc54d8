package main

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/store/postgres"
)

// moveBrokers are the brokers the move-window tests run on: the embedded one
// and Mosquitto.
var moveBrokers = []struct {
	name  string
	start func(*testing.T, *slog.Logger) (*Main, string)
}{
	{"embedded", func(t *testing.T, logger *slog.Logger) (*Main, string) {
		m := startServerLogging(t, Config{}, logger)
		return m, m.MQTTURL()
	}},
	{"mosquitto", func(t *testing.T, logger *slog.Logger) (*Main, string) {
		mq := mqtttest.StartMosquitto(t, serverAccount)
		m := startServerLogging(t, mosquittoConfig(Config{}, mq), logger)
		testenv.Eventually(t, 20*time.Second, "the server connected to Mosquitto", m.Broker.Ready)
		return m, mq.URL
	}},
}

// A device moved to another bridge just after its bridge took a command
// in, before that bridge's "delivered" had reached the server (the bridge
// says it a quarter of a second after it takes a command, agent's
// deliveredDelay): the server read the command sent (or queued, on its
// way), not had, and sent it to the new bridge too, which ran it on the
// device the old one had handed it to already (CONTRACT §7: none is
// delivered twice). The move now waits for the old bridge's word on the
// commands on their way to it: what it had fails device_not_served as a
// delivered command does (docs/reliability.md, bugs 97 and 509), and only
// what it never had goes to the new bridge. Here bridge-1's uplink stalls
// as it takes the command, so that its word is still on the way when the
// device moves, whatever the machine's speed. On the embedded broker and
// on Mosquitto.
func TestAMoveWaitsForTheWordOfTheBridgeItLeaves(t *testing.T) {
	t.Parallel()
	for _, tb := range moveBrokers {
		t.Run(tb.name, func(t *testing.T) {
			w := newMoveWindow(t, tb.start)
			f := w.fleet()
			f2 := addBridge(t, f, "bridge-2")
			w.takenAsItLeaves(f, f2, func() int {
				return f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID}).Status
			}, 200, nil)
		})
	}
}

// The same for a user's bridge deleted just after it took a command in:
// its devices read served by no bridge, and the command it had went to the
// next bridge the user gave the device (docs/reliability.md, bug 553).
func TestADeletedBridgesWordComesInBeforeItsDevicesLeaveIt(t *testing.T) {
	t.Parallel()
	for _, tb := range moveBrokers {
		t.Run(tb.name, func(t *testing.T) {
			w := newMoveWindow(t, tb.start)
			f := w.fleet()
			userBridge := func(id string) *fleet {
				r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": id})
				require.Equal(t, 201, r.Status, "%s", r.Body)
				g := *f
				g.bridgeID, g.bridgeSecret = id, r.JSON(t)["secret"].(string)
				return &g
			}
			hub, hub2 := userBridge("hub"), userBridge("hub-2")
			r := f.user.do("PUT", "/api/v1/devices/dev-1/bridge", map[string]any{"bridge_id": "hub"})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			w.takenAsItLeaves(hub, hub2, func() int {
				return f.user.do("DELETE", "/api/v1/bridges/hub", nil).Status
			}, 204, func() {
				r := f.user.do("PUT", "/api/v1/devices/dev-1/bridge", map[string]any{"bridge_id": "hub-2"})
				require.Equal(t, 200, r.Status, "%s", r.Body)
			})
		})
	}
}

// The same for a device moved through a replica that does not dispatch
// (CONTRACT §11), two replicas on one PostgreSQL store and one Mosquitto:
// only the dispatcher knows what it has published, and the command on its
// way to the bridge still reads queued in the store (docs/reliability.md,
// bug 554).
func TestAMoveThroughAReplicaThatDoesNotDispatchWaitsForTheWord(t *testing.T) {
	t.Parallel()
	dsn := pgtest.Start(t).NewDatabase(t)
	require.NoError(t, postgres.Migrate(t.Context(), dsn))
	mq := mqtttest.StartMosquitto(t, serverAccount)
	w := newMoveWindow(t, func(t *testing.T, logger *slog.Logger) (*Main, string) {
		return startServerLogging(t, mosquittoConfig(Config{Store: dsn, ReplicaID: "r1"}, mq), logger), mq.URL
	})
	m2 := startServerLogging(t, mosquittoConfig(Config{Store: dsn, ReplicaID: "r2"}, mq), w.logger)
	for _, m := range []*Main{w.m, m2} {
		testenv.Eventually(t, 20*time.Second, "the server connected to Mosquitto", m.Broker.Ready)
	}
	testenv.Eventually(t, 20*time.Second, "a dispatcher", func() bool { return w.m.pg.Dispatching() || m2.pg.Dispatching() })
	quiet := w.m
	if w.m.pg.Dispatching() {
		quiet = m2
	}
	f := w.fleet()
	f2 := addBridge(t, f, "bridge-2")
	admin := newClient(t, quiet, quiet.AdminToken())
	w.takenAsItLeaves(f, f2, func() int {
		return admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID}).Status
	}, 200, nil)
}

// moveWindow is a server whose log tells when a move waits for the word of
// the bridge a device leaves, and when it waited that out.
type moveWindow struct {
	t                *testing.T
	m                *Main
	mqttURL          string
	logger           *slog.Logger
	waiting, unheard *logSignal
}

func newMoveWindow(t *testing.T, start func(*testing.T, *slog.Logger) (*Main, string)) *moveWindow {
	w := &moveWindow{
		t:       t,
		waiting: newLogSignal("moving a device: waiting for its bridge's word"),
		unheard: newLogSignal("no word from its bridge on commands on their way"),
	}
	w.logger = slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), w.waiting, w.unheard), &slog.HandlerOptions{Level: slog.LevelInfo}))
	w.m, w.mqttURL = start(t, w.logger)
	return w
}

// fleet is the server's user, its bridge and dev-1, registered.
func (w *moveWindow) fleet() *fleet {
	f := setupFleet(w.t, w.m, "dev-1")
	registerDevices(w.t, f, "dev-1")
	return f
}

// takenAsItLeaves runs from's bridge, its uplink through a relay, and
// to's, both in range of dev-1, which from serves. from's bridge takes a
// text in while what it says waits in its uplink, and leave (answering
// want) takes dev-1 off it; then, after then (nil: nothing), to's bridge
// serves dev-1. The text must have been handed to the device once, and
// read failed device_not_served.
func (w *moveWindow) takenAsItLeaves(from, to *fleet, leave func() int, want int, then func()) {
	t := w.t
	dev := sim.New(sim.Options{ID: "dev-1"})
	handed := &handedCount{n: map[string]int{}}
	started := make(chan string, 1)
	release := make(chan struct{})
	first := &countingDevice{Device: dev, handed: handed, started: started, release: release}
	second := &countingDevice{Device: dev, handed: handed}

	u, err := url.Parse(w.mqttURL)
	require.NoError(t, err)
	link := testenv.NewRelay(t, u.Host)
	viaLink := *u
	viaLink.Host = link.Addr()
	sims := map[string]*sim.Device{"dev-1": dev}
	runBridge(t, w.m, viaLink.String(), from, []agent.Device{first}, sims, nil)
	runBridge(t, w.m, w.mqttURL, to, []agent.Device{second}, sims, nil)
	waitOnline(t, from, true, "dev-1")

	link.HoldUplink() // what from's bridge says from now on waits in its uplink
	id := from.user.pushText("dev-1", "taken by "+from.bridgeID+" just before it is left")
	select {
	case got := <-started:
		require.Equal(t, id, got)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not hand the command to the device", from.bridgeID)
	}

	left := make(chan int, 1)
	go func() { left <- leave() }()
	status := 0
	select {
	case <-w.waiting.seen: // the server waits for from's word
	case status = <-left: // it did not wait
	case <-time.After(30 * time.Second):
		t.Fatalf("leaving %s neither answered nor waited for its word", from.bridgeID)
	}
	link.ReleaseUplink() // its word (its PUBACK, its "delivered") comes in
	if status == 0 {
		select {
		case status = <-left:
		case <-time.After(30 * time.Second):
			t.Fatal("leaving the bridge did not answer")
		}
	}
	require.Equal(t, want, status)
	select {
	case <-w.unheard.seen:
		t.Errorf("the server waited out its bound, though %s's word came in", from.bridgeID)
	default:
	}
	close(release)
	if then != nil {
		then()
	}

	next := from.user.pushText("dev-1", "on "+to.bridgeID)
	assert.Equal(t, "succeeded", from.user.waitFinal("dev-1", next)["state"])
	assert.Equal(t, 1, handed.of(id), "times the command was handed to the device, by either bridge (CONTRACT §7: none is delivered twice)")
	cmd := from.user.waitFinal("dev-1", id)
	assert.Equal(t, "failed", cmd["state"], "%v", cmd)
	if e, ok := cmd["error"].(map[string]any); assert.True(t, ok, "%v", cmd) {
		assert.Equal(t, "device_not_served", e["code"])
	}
}

// handedCount counts the commands handed to a device, by id.
type handedCount struct {
	mu sync.Mutex
	n  map[string]int
}

func (h *handedCount) add(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n[id]++
}

func (h *handedCount) of(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n[id]
}

// countingDevice is a bridge's link to a simulated device that counts the
// texts handed to it, the device's dropping of an id it has run aside. With
// started set, its first text says its id there and waits for release (or
// its context) before the device has it.
type countingDevice struct {
	*sim.Device
	handed  *handedCount
	started chan string
	release chan struct{}
	once    sync.Once
}

func (d *countingDevice) PushText(ctx context.Context, cmdID, title, text string) error {
	d.handed.add(cmdID)
	if d.started != nil {
		first := false
		d.once.Do(func() { first = true })
		if first {
			d.started <- cmdID
			select {
			case <-d.release:
			case <-ctx.Done():
			}
		}
	}
	return d.Device.PushText(ctx, cmdID, title, text)
}
