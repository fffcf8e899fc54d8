package main

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
)

// bridgeACL is what docs/mosquitto.md tells an operator to grant a bridge.
func bridgeACL(bridgeID string) []string {
	return []string{
		"topic read companion/v1/devices/+/commands/#",
		"topic write companion/v1/devices/+/replies",
		"topic write companion/v1/devices/+/status",
		"topic write companion/v1/devices/+/settings",
		"topic readwrite companion/v1/bridges/" + bridgeID + "/state",
	}
}

func startWithMosquitto(t *testing.T, dir string) (*Main, *mqtttest.Mosquitto) {
	t.Helper()
	mq := mqtttest.StartMosquitto(t, mqtttest.MosquittoAccount{
		Username: "companion-server", Password: "server-secret",
		ACL: []string{"topic readwrite companion/v1/#"},
	})
	m := startServer(t, Config{Data: dir, MQTTURL: mq.URL, MQTTUsername: "companion-server", MQTTPassword: "server-secret"})
	require.Nil(t, m.MQTT, "nothing embedded runs with --mqtt-url")
	return m, mq
}

func TestEveryOperationMosquitto(t *testing.T) {
	m, mq := startWithMosquitto(t, t.TempDir())
	f := setupFleet(t, m, "dev-1")
	mq.AddAccount(t, mqtttest.MosquittoAccount{Username: f.bridgeID, Password: f.bridgeSecret, ACL: bridgeACL(f.bridgeID)})
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
	mq.AddAccount(t, mqtttest.MosquittoAccount{Username: f.bridgeID, Password: f.bridgeSecret, ACL: bridgeACL(f.bridgeID)})
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
	m2 := startServer(t, Config{Data: dir, MQTTURL: mq.URL, MQTTUsername: "companion-server", MQTTPassword: "server-secret"})
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
