package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
