package main

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// A bridge that leaves bridge_id out of a device's status, online: the
// server stored the status naming no bridge, GET …/status read online with
// bridge_id null, and when the bridge died its Will marked offline only
// the devices whose status names it: the device read online for good
// (docs/reliability.md, bug 570). Only the device's bridge may publish its
// status (CONTRACT §9), so the server takes it as that bridge's.
func TestAnOnlineStatusNamingNoBridgeIsItsServingBridges(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	must := topicsOf(t)
	tree := topics.MustNew(topics.DefaultPrefix)
	stateTopic, statusTopic := must(tree.BridgeState(f.bridgeID)), must(tree.Status("dev-1"))

	// The bridge through a link the test can cut, with its Will.
	u, err := url.Parse(m.MQTTURL())
	require.NoError(t, err)
	link := testenv.NewRelay(t, u.Host)
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://"+link.Addr()).
		SetClientID("bridge-"+f.bridgeID).SetUsername(f.bridgeID).SetPassword(f.bridgeSecret).
		SetAutoReconnect(false).SetWill(stateTopic, topics.BridgeOffline, 1, true))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), 10*time.Second))
	t.Cleanup(func() { c.Disconnect(50) })
	require.NoError(t, mqtt.WaitTokenTimeout(c.Publish(stateTopic, 1, true, topics.BridgeOnline), 10*time.Second))
	// bridge_id left out.
	status := `{"online":true,"battery":80,"firmware_version":"1.0.0","apps":[],"at":"` +
		time.Now().UTC().Format(time.RFC3339Nano) + `","seq":1}`
	require.NoError(t, mqtt.WaitTokenTimeout(c.Publish(statusTopic, 1, true, status), 10*time.Second))
	waitOnline(t, f, true, "dev-1")
	st := f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
	assert.Equal(t, f.bridgeID, st["bridge_id"], "GET …/status: the bridge of a device online")

	link.Refuse() // the bridge's connection dies: the broker publishes its Will
	testenv.Eventually(t, 30*time.Second, "dev-1 offline after its bridge's Will", func() bool {
		r := f.user.do("GET", "/api/v1/devices/dev-1/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == false
	})
	r := f.user.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	devices, _ := r.JSON(t)["devices"].([]any)
	require.Len(t, devices, 1, "%s", r.Body)
	assert.Equal(t, false, devices[0].(map[string]any)["status"].(map[string]any)["online"], "GET /api/v1/devices")
}
