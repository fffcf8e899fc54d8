package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/sim"
)

// A bridge given a new secret (POST /api/v1/admin/bridges/{id}/secret), on
// each broker the server drives: the connections made with the old secret
// are closed, the old secret is refused from then on and the new one
// taken, and the bridge started again with it serves its device with what
// it queued meanwhile.
func TestANewBridgeSecret(t *testing.T) {
	t.Run("embedded", func(t *testing.T) {
		t.Parallel()
		m := startServer(t, Config{})
		testANewBridgeSecret(t, m, m.MQTTURL())
	})
	t.Run("mosquitto", func(t *testing.T) {
		t.Parallel()
		m, mq := startWithMosquitto(t, t.TempDir())
		testANewBridgeSecret(t, m, mq.URL)
	})
	t.Run("nats", func(t *testing.T) {
		t.Parallel()
		cl, m := startNATSCallout(t)
		testANewBridgeSecret(t, m, cl.MQTTURLs[0])
	})
}

func testANewBridgeSecret(t *testing.T, m *Main, url string) {
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	bc := bridgeConfig{dataDir: t.TempDir(), sims: map[string]*sim.Device{}}
	b := startBridgeWith(t, m, url, f, bc, "dev-1")
	waitOnline(t, f, true, "dev-1")
	old := f.bridgeSecret
	probe := mustDialMQTT(t, url, "old-secret-probe", f.bridgeID, old)

	r := f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	f.bridgeSecret = r.JSON(t)["secret"].(string)
	require.NotEqual(t, old, f.bridgeSecret)

	select {
	case <-probe.Lost:
	case <-time.After(15 * time.Second):
		t.Fatal("a connection made with the old secret is still open")
	}
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
