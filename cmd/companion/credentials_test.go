package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/natstest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A bridge given a new secret (POST /api/v1/admin/bridges/{id}/secret), and
// a user a new API token (POST /api/v1/admin/users/{id}/token), on each
// broker the server drives: the connections made with the old one are
// closed, the old one is refused from then on and the new one taken; the
// bridge started again with its new secret serves its device with what it
// queued meanwhile.
func TestReplacedCredentials(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		t.Parallel()
		m := startServer(t, Config{})
		testReplacedCredentials(t, m, m.MQTTURL())
	})
	t.Run("mosquitto", func(t *testing.T) {
		t.Parallel()
		m, mq := startWithMosquitto(t, t.TempDir())
		testReplacedCredentials(t, m, mq.URL)
	})
	t.Run("nats", func(t *testing.T) {
		t.Parallel()
		cl, m := startNATSCallout(t)
		testReplacedCredentials(t, m, cl.MQTTURLs[0])
	})
}

func testReplacedCredentials(t *testing.T, m *Main, url string) {
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	testANewBridgeSecret(t, m, url, f)
	testANewUserToken(t, url, f)
}

// lost waits for the broker to close p's connection.
func lost(t *testing.T, p *mqttProbe, what string) {
	t.Helper()
	select {
	case <-p.Lost:
	case <-time.After(15 * time.Second):
		t.Fatalf("a connection made with the old %s is still open", what)
	}
}

func testANewUserToken(t *testing.T, url string, f *fleet) {
	old := f.user.token
	probe := mustDialMQTT(t, url, "old-token-probe", f.userID, old)
	r := f.admin.do("POST", "/api/v1/admin/users/"+f.userID+"/token", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	f.user.token = r.JSON(t)["token"].(string)
	require.NotEqual(t, old, f.user.token)

	lost(t, probe, "token")
	_, err := dialMQTT(t, url, "old-token-again", f.userID, old)
	assert.Error(t, err, "the old token logged in")
	p := mustDialMQTT(t, url, "new-token", f.userID, f.user.token)
	must := topicsOf(t)
	assert.Equal(t, byte(1), p.subscribe(t, must(topics.MustNew(topics.DefaultPrefix).DeviceFilter("dev-1"))), "the user's device with the new token")
	r = f.user.do("GET", "/api/v1/devices/dev-1/status", nil)
	assert.Equal(t, 200, r.Status, "%s", r.Body)
}

func testANewBridgeSecret(t *testing.T, m *Main, url string, f *fleet) {
	bc := bridgeConfig{dataDir: t.TempDir(), sims: map[string]*sim.Device{}}
	b := startBridgeWith(t, m, url, f, bc, "dev-1")
	waitOnline(t, f, true, "dev-1")
	old := f.bridgeSecret
	probe := mustDialMQTT(t, url, "old-secret-probe", f.bridgeID, old)

	r := f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	f.bridgeSecret = r.JSON(t)["secret"].(string)
	require.NotEqual(t, old, f.bridgeSecret)

	lost(t, probe, "secret")
	_, err := dialMQTT(t, url, "old-secret-again", f.bridgeID, old)
	assert.Error(t, err, "the old secret logged in")
	_, err = dialMQTT(t, url, "new-secret", f.bridgeID, f.bridgeSecret)
	require.NoError(t, err, "the new secret did not log in")

	b.stop()
	r = f.user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "after the new secret"})
	require.Equal(t, 202, r.Status, "%s", r.Body)
	id := r.JSON(t)["id"].(string)
	startBridgeWith(t, m, url, f, bc, "dev-1")
	cmd := f.user.waitFinal("dev-1", id)
	assert.Equal(t, "succeeded", cmd["state"], "%v", cmd)
}

// A bridge given a new secret and not started again with it (its edge box
// still has the old one, refused) reads offline once the grace is over,
// with its devices, on each broker the server drives; started with the new
// one, it reads online again. (NATS publishes the Will as it closes the
// connection; the server holds it for the grace.) Mosquitto's plugin closes the connections of
// the old secret without their Will, and the server did not stand in for
// it: the bridge and its devices read online for good (docs/reliability.md,
// bug 299).
func TestABridgeGivenANewSecretReadsOfflineUntilItIsBack(t *testing.T) {
	const grace = time.Second
	for _, tb := range []struct {
		name  string
		start func(t *testing.T) (*Main, string)
	}{
		{"embedded", func(t *testing.T) (*Main, string) {
			m := startServer(t, Config{KickGrace: grace})
			return m, m.MQTTURL()
		}},
		{"mosquitto", func(t *testing.T) (*Main, string) {
			mq := mqtttest.StartMosquitto(t, serverAccount)
			return startOnMosquitto(t, Config{KickGrace: grace}, mq), mq.URL
		}},
		{"nats", func(t *testing.T) (*Main, string) {
			cl := natstest.StartCluster(t, natstest.Options{Callout: true})
			m := startServer(t, natsCallout(t, cl, Config{KickGrace: grace}))
			testenv.Eventually(t, 30*time.Second, "the server logged in to the NATS cluster", m.Broker.Ready)
			return m, cl.MQTTURLs[0]
		}},
	} {
		t.Run(tb.name, func(t *testing.T) {
			t.Parallel()
			m, url := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			bc := bridgeConfig{dataDir: t.TempDir(), sims: map[string]*sim.Device{}}
			b := startBridgeWith(t, m, url, f, bc, "dev-1")
			waitOnline(t, f, true, "dev-1")

			r := f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			waitOnline(t, f, false, "dev-1")

			b.stop()
			f.bridgeSecret = r.JSON(t)["secret"].(string)
			startBridgeWith(t, m, url, f, bc, "dev-1")
			waitOnline(t, f, true, "dev-1")
		})
	}
}

// A bridge given a new secret while Mosquitto was away reads offline once
// Mosquitto is back and the driver's retry has set the new secret there,
// which closes the bridge's connection (made again with the old secret,
// which Mosquitto still had) without its Will (docs/reliability.md, bug
// 301).
func TestABridgeGivenANewSecretWhileMosquittoIsAwayReadsOffline(t *testing.T) {
	t.Parallel()
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m := startOnMosquitto(t, Config{KickGrace: time.Second}, mq)
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	startBridge(t, m, mq.URL, f, "", "dev-1")
	waitOnline(t, f, true, "dev-1")

	mq.Stop(t)
	r := f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	mq.Start(t)
	secret := r.JSON(t)["secret"].(string)
	testenv.Eventually(t, 30*time.Second, "the new secret set in Mosquitto", func() bool {
		p, err := dialMQTT(t, mq.URL, "new-secret-probe", f.bridgeID, secret)
		if err == nil {
			p.Disconnect(50)
		}
		return err == nil
	})
	waitOnline(t, f, false, "dev-1")
}

// --mqtt-sessions-per-account reaches the embedded broker: with 1, a
// user's second MQTT connection under another client id is refused while
// the first is connected (CONTRACT §6's limits are configurable; so are
// the broker's own bounds, docs/security.md API4).
func TestMQTTSessionsPerAccountReachesTheBroker(t *testing.T) {
	var cfg Config
	require.NoError(t, parseFlags(newServeFlags(&cfg), []string{"--mqtt-sessions-per-account", "1"}))
	cfg.fromFlags()
	m := startServer(t, Config{MQTTSessionsPerAccount: cfg.MQTTSessionsPerAccount})
	f := setupFleet(t, m)
	mustDialMQTT(t, m.MQTTURL(), "first", f.userID, f.user.token)
	_, err := dialMQTT(t, m.MQTTURL(), "second", f.userID, f.user.token)
	assert.Error(t, err, "a second session of the account was let in")
}
