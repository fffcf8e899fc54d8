package main

import (
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// serverAccount is the server's Mosquitto account in tests: everything
// under the prefix, and the dynamic-security plugin's admin, as
// docs/mosquitto.md has the operator make it.
var serverAccount = mqtttest.MosquittoAccount{
	Username: "companion-server", Password: "server-secret",
	ACL:   []string{"topic readwrite companion/v1/#"},
	Admin: true,
}

// mosquittoConfig points cfg at mq with the server's account, the server
// keeping the accounts (--mqtt-dynsec, the default of the flag).
func mosquittoConfig(cfg Config, mq *mqtttest.Mosquitto) Config {
	cfg.MQTTURL, cfg.MQTTUsername, cfg.MQTTPassword = mq.URL, serverAccount.Username, serverAccount.Password
	cfg.MQTTDynsec = true
	return cfg
}

// startOnMosquitto starts the server on mq and waits until it is connected
// and subscribed, so that the accounts the admin API creates next are made
// in Mosquitto at once.
func startOnMosquitto(t *testing.T, cfg Config, mq *mqtttest.Mosquitto) *Main {
	t.Helper()
	m := startServer(t, mosquittoConfig(cfg, mq))
	require.Nil(t, m.MQTT, "nothing embedded runs with --mqtt-url")
	testenv.Eventually(t, 20*time.Second, "the server connected to Mosquitto", m.Broker.Ready)
	return m
}

func startWithMosquitto(t *testing.T, dir string) (*Main, *mqtttest.Mosquitto) {
	t.Helper()
	mq := mqtttest.StartMosquitto(t, serverAccount)
	return startOnMosquitto(t, Config{Data: dir}, mq), mq
}

// The server makes the bridge's account through the dynamic-security
// plugin when the admin API creates the bridge; nobody edits Mosquitto.
func TestEveryOperationMosquitto(t *testing.T) {
	m, mq := startWithMosquitto(t, t.TempDir())
	f := setupFleet(t, m, "dev-1")
	b := startBridge(t, m, mq.URL, f, "", "dev-1")
	exerciseEveryOperation(t, f, b, "dev-1")
}

// A broker outage while the server is down: commands accepted while
// Mosquitto is away stay queued across a server restart and go out, in
// order, once both are back.
func TestQueuedCommandsSurviveBrokerOutageAndRestart(t *testing.T) {
	dir := t.TempDir()
	m, mq := startWithMosquitto(t, dir)
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	mq.Stop(t)
	var ids []string
	for i := 0; i < 10; i++ {
		cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": fmt.Sprintf("msg %d", i)})
		assert.Equal(t, "queued", cmd["state"])
		ids = append(ids, cmd["id"].(string))
	}
	require.NoError(t, m.Close())

	mq.Start(t)
	m2 := startServer(t, mosquittoConfig(Config{Data: dir}, mq))
	f.user = newClient(t, m2, f.user.token)
	b := startBridge(t, m2, mq.URL, f, "", "dev-1")
	for _, id := range ids {
		assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", id)["state"])
	}
	texts := b.sims["dev-1"].Texts()
	require.Len(t, texts, 10)
	for i, tx := range texts {
		assert.Equal(t, fmt.Sprintf("msg %d", i), tx.Text)
	}
}

// --mqtt-url takes a list of brokers (a cluster's nodes, CONTRACT §11):
// with the first one down, the server and the bridge connect to the next,
// and commands run.
func TestBrokerListFailsOver(t *testing.T) {
	mq := mqtttest.StartMosquitto(t, serverAccount)
	down := fmt.Sprintf("tcp://127.0.0.1:%d", mqtttest.FreePort(t)) // nothing listens there
	cfg := mosquittoConfig(Config{}, mq)
	cfg.MQTTURL = down + "," + mq.URL
	m := startServer(t, cfg)
	testenv.Eventually(t, 20*time.Second, "the server connected through the second URL", m.Broker.Ready)
	f := setupFleet(t, m, "dev-1")
	b := startBridge(t, m, down+","+mq.URL, f, "", "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "over the second broker"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.Len(t, b.sims["dev-1"].Texts(), 1)
}

// A broker that refuses one of the server's subscriptions (SUBACK 0x80:
// NATS does while a node's JetStream leaders are elected) leaves the server
// not ready, and it asks again until the broker grants it; then commands
// run.
//
// The refusal is a role of its own given to the server's account before
// its other roles (a higher priority): the admin role mosquitto_ctrl
// dynsec init makes grants reading #, and the plugin takes the first ACL
// that matches, role after role.
func TestRefusedSubscriptionIsAskedAgain(t *testing.T) {
	mq := mqtttest.StartMosquitto(t, serverAccount)
	for _, r := range mq.Dynsec(t,
		map[string]any{"command": "createRole", "rolename": "refuse-replies", "acls": []map[string]any{
			{"acltype": "subscribeLiteral", "topic": "companion/v1/devices/+/replies", "allow": false},
		}},
		map[string]any{"command": "addClientRole", "username": serverAccount.Username, "rolename": "refuse-replies", "priority": 100},
	) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	refused := newLogSignal("MQTT subscriptions refused")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refused), &slog.HandlerOptions{Level: slog.LevelWarn}))
	m := startServerLogging(t, mosquittoConfig(Config{}, mq), logger)
	select {
	case <-refused.seen:
	case <-time.After(20 * time.Second):
		t.Fatal("the server never said its subscription was refused")
	}
	require.False(t, m.Broker.Ready(), "ready without its subscription to the replies")

	for _, r := range mq.Dynsec(t, map[string]any{"command": "removeClientRole", "username": serverAccount.Username, "rolename": "refuse-replies"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	testenv.Eventually(t, 20*time.Second, "ready once the broker grants it", m.Broker.Ready)
	f := setupFleet(t, m, "dev-1")
	b := startBridge(t, m, mq.URL, f, "", "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.Len(t, b.sims["dev-1"].Texts(), 1)
}

// A server whose Mosquitto account may not publish under its topic prefix
// (here its role names companion/v1/# while the server runs with
// --topic-prefix acme/v1, as an operator who changed one and not the
// other has it) is told nothing by Mosquitto: it acknowledges each QoS 1
// publish and drops it. The server finds it out with a probe of its own
// at each connect: it is not ready, /readyz says why, and the log names
// the ACLs to add. Once they are there, it is ready and commands run
// (bug 459).
func TestServerThatCannotPublishUnderItsPrefixIsNotReady(t *testing.T) {
	t.Parallel()
	mq := mqtttest.StartMosquitto(t, serverAccount)
	refused := newLogSignal("publishClientSend")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refused), &slog.HandlerOptions{Level: slog.LevelWarn}))
	m := startServerLogging(t, mosquittoConfig(Config{TopicPrefix: "acme/v1"}, mq), logger)
	select {
	case <-refused.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the server never said it cannot publish under its prefix")
	}
	require.False(t, m.Broker.Ready(), "ready though nothing it publishes reaches anyone")
	r := newClient(t, m, "").do("GET", "/readyz", nil)
	require.Equal(t, 503, r.Status, "%s", r.Body)
	require.Contains(t, string(r.Body), "acme/v1/#")

	for _, r := range mq.Dynsec(t,
		map[string]any{"command": "createRole", "rolename": "acme", "acls": []map[string]any{
			{"acltype": "publishClientSend", "topic": "acme/v1/#", "allow": true},
			{"acltype": "publishClientReceive", "topic": "acme/v1/#", "allow": true},
			{"acltype": "subscribePattern", "topic": "acme/v1/#", "allow": true},
		}},
		map[string]any{"command": "addClientRole", "username": serverAccount.Username, "rolename": "acme"},
	) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	testenv.Eventually(t, 30*time.Second, "ready once the broker lets it publish", m.Broker.Ready)
	f := setupFleet(t, m, "dev-1")
	s := sim.New(sim.Options{ID: "dev-1"})
	runBridge(t, m, mq.URL, f, []agent.Device{s}, map[string]*sim.Device{"dev-1": s}, func(o *agent.Options) {
		o.Topics = topics.MustNew("acme/v1")
	})
	r = f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.Len(t, s.Texts(), 1)
}
