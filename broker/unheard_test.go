package broker

import (
	"bytes"
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/store"
)

// lockedLog is a slog destination the test reads while the broker writes.
type lockedLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// gaugeObserver keeps the last BridgesUnheard and BridgesStateless.
type gaugeObserver struct {
	nopObserver
	unheard, stateless atomic.Int64
}

func (o *gaugeObserver) BridgesUnheard(n int)   { o.unheard.Store(int64(n)) }
func (o *gaugeObserver) BridgesStateless(n int) { o.stateless.Store(int64(n)) }

// aclEnv opens a store in which each bridge of serves serves its device,
// bound to u1: the fleet of the acl_file tests.
func aclEnv(t *testing.T, serves map[string]string) *env {
	t.Helper()
	ctx := context.Background()
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	e := &env{db: db, clock: &clock{now: time.Now()}}
	for bridge, dev := range serves {
		require.NoError(t, db.CreateBridge(ctx, companion.Bridge{ID: bridge, SecretHash: []byte("not used: Mosquitto's password file " + bridge)}))
		require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "sim-1", BridgeID: bridge}))
		bind(t, e, dev)
	}
	return e
}

// startACLBroker starts e's broker on Mosquitto mq as the server's
// account, retrying sent commands every 100 ms, logging at Warn into the
// log it returns; tune, when not nil, sets what it has to before Start.
func startACLBroker(t *testing.T, e *env, mq *mqtttest.Mosquitto, server mqtttest.MosquittoAccount, tune func(*Broker)) (*lockedLog, *gaugeObserver) {
	t.Helper()
	var logs lockedLog
	obs := &gaugeObserver{}
	b, err := New(Options{
		Store: e.db, MQTTURL: mq.URL, Username: server.Username, Password: server.Password,
		ClientID: "server-" + t.Name(), Topics: tree, SentRetry: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})), Observer: obs,
	})
	require.NoError(t, err)
	if tune != nil {
		tune(b)
	}
	require.NoError(t, b.Start())
	t.Cleanup(func() { b.Close() })
	e.b = b
	testenv.Eventually(t, 10*time.Second, "broker ready", b.Ready)
	return &logs, obs
}

// runACLBridge runs a bridge agent on mq as acct (its bridge id the
// account's name) with the device and data directory dir, until the test
// ends or stop is called.
func runACLBridge(t *testing.T, mq *mqtttest.Mosquitto, acct mqtttest.MosquittoAccount, dev agent.Device, dir string) (stop func()) {
	t.Helper()
	a, err := agent.New(agent.Options{
		MQTTURL: mq.URL, BridgeID: acct.Username, Username: acct.Username, Password: acct.Password,
		DataDir: dir, Devices: []agent.Device{dev}, Logger: quiet(),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- a.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-ran
			a.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// waitOnline waits until each device reads online.
func waitOnline(t *testing.T, e *env, devices ...string) {
	t.Helper()
	for _, dev := range devices {
		testenv.Eventually(t, 10*time.Second, dev+" reads online", func() bool {
			st, err := e.db.Status(context.Background(), dev)
			return err == nil && st.Online
		})
	}
}

// A bridge whose block of Mosquitto's acl_file lacks its 'topic read
// …/commands/#' line has every subscription granted and receives nothing;
// it says online, and its devices read online. The server sent its
// commands again and again and said nothing (docs/reliability.md, bug
// 489): it must warn once, naming the bridge and the line, and count the
// bridge, while a bridge that answers (its command held by its device, a
// slow one) is not named.
func TestABridgeThatNeverAnswersCommandsSentAgainIsNamed(t *testing.T) {
	server := mqtttest.MosquittoAccount{Username: "companion-server", Password: "server-pw"}
	deaf := mqtttest.MosquittoAccount{Username: "b1", Password: "b1-pw"}
	slow := mqtttest.MosquittoAccount{Username: "b2", Password: "b2-pw"}
	acl := `user companion-server
topic readwrite companion/v1/#

user b1
topic write companion/v1/devices/+/replies
topic write companion/v1/devices/+/status
topic write companion/v1/devices/+/settings
topic write companion/v1/bridges/b1/state

user b2
topic read companion/v1/devices/+/commands/#
topic write companion/v1/devices/+/replies
topic write companion/v1/devices/+/status
topic write companion/v1/devices/+/settings
topic write companion/v1/bridges/b2/state
`
	mq := mqtttest.StartMosquittoStatic(t, []byte(acl), server, deaf, slow)
	e := aclEnv(t, map[string]string{"b1": "dev-1", "b2": "dev-2"})
	gate := &gatedDevice{Device: sim.New(sim.Options{ID: "dev-2", Logger: quiet()})}
	_, release := gate.hold(t, "held")
	runACLBridge(t, mq, deaf, sim.New(sim.Options{ID: "dev-1", Logger: quiet()}), t.TempDir())
	runACLBridge(t, mq, slow, gate, t.TempDir())
	logs, obs := startACLBroker(t, e, mq, server, nil)
	waitOnline(t, e, "dev-1", "dev-2")

	held := submit(t, e, "dev-2", "held", time.Hour)
	testenv.Eventually(t, 10*time.Second, "the slow bridge's command delivered", func() bool {
		return state(t, e, held.ID).State == companion.StateDelivered
	})
	lost := submit(t, e, "dev-1", "never received", time.Hour)

	const said = "said nothing of commands sent to it again and again"
	testenv.Eventually(t, 20*time.Second, "the server names the bridge that never answers", func() bool {
		return strings.Contains(logs.String(), said)
	})
	out := logs.String()
	assert.Equal(t, 1, strings.Count(out, said), "%s", out)
	assert.Contains(t, out, "bridge_id=b1")
	assert.NotContains(t, out, "bridge_id=b2", "the bridge that answered was named")
	assert.Contains(t, out, "'topic read companion/v1/devices/+/commands/#'")
	assert.Contains(t, out, "'user b1'")
	assert.EqualValues(t, 1, obs.unheard.Load(), "bridges unheard")
	assert.Equal(t, companion.StateSent, state(t, e, lost.ID).State)

	// Granted the line, the bridge receives the command, answers, and is
	// counted no more.
	mq.SetACL(t, []byte(strings.Replace(acl, "user b1\n", "user b1\ntopic read companion/v1/devices/+/commands/#\n", 1)))
	testenv.Eventually(t, 30*time.Second, "the command runs once the bridge may read it", func() bool {
		return state(t, e, lost.ID).State == companion.StateSucceeded
	})
	testenv.Eventually(t, 10*time.Second, "no bridge unheard", func() bool { return obs.unheard.Load() == 0 })
	release()
}
