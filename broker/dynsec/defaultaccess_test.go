package dynsec_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// defaultAccess is the plugin's default ACL access, by ACL type.
func defaultAccess(t *testing.T, mq *mqtttest.Mosquitto) map[string]bool {
	t.Helper()
	r := mq.Dynsec(t, map[string]any{"command": "getDefaultACLAccess"})
	require.Empty(t, r[0].Error)
	var got struct {
		ACLs []struct {
			Type  string `json:"acltype"`
			Allow bool   `json:"allow"`
		} `json:"acls"`
	}
	require.NoError(t, json.Unmarshal(r[0].Data, &got))
	out := map[string]bool{}
	for _, a := range got.ACLs {
		out[a.Type] = a.Allow
	}
	return out
}

// The server sets the plugin's default ACL access to deny as it connects;
// an operator who set it to allow afterwards (mosquitto_ctrl dynsec
// setDefaultACLAccess subscribe allow, as the plugin's documentation
// shows) let every bridge read every device's commands, another
// customer's included, until the server next connected, and nobody was
// told. The server checks it every CheckInterval, sets it back and says
// so (bug 498).
func TestDefaultAccessSetToAllowByHandIsSetBack(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	logs := &lockedBuffer{}
	d, granted := newDriverWith(t, mq, server, dynsec.Options{Store: st, CheckInterval: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.True(t, granted)
	st.createBridge("b1", "secret-1")
	st.createBridge("b2", "secret-2")
	st.assign("dev-1", "b1")
	st.assign("dev-2", "b2")
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-1"))
	require.NoError(t, d.BridgeCreated(ctx, "b2", "secret-2"))
	d.Start()
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	testenv.Eventually(t, 10*time.Second, "the server sets the default access to deny as it connects", func() bool {
		return !defaultAccess(t, mq)["subscribe"]
	})

	for _, r := range mq.Dynsec(t, map[string]any{"command": "setDefaultACLAccess", "acls": []map[string]any{
		{"acltype": "subscribe", "allow": true},
		{"acltype": "publishClientReceive", "allow": true},
	}}) {
		require.Empty(t, r.Error, r.Command)
	}
	srv, err := mqtttest.DialProbe(t, mq.URL, "probe-server", server.Username, server.Password)
	require.NoError(t, err)
	other := "companion/v1/devices/dev-2/commands/push.text"

	testenv.Eventually(t, 10*time.Second, "the plugin's default access, set to allow by hand, is set back to deny", func() bool {
		a := defaultAccess(t, mq)
		return !a["subscribe"] && !a["publishClientReceive"]
	})
	b1, err := mqtttest.DialProbe(t, mq.URL, dynsec.BridgeClientID("b1"), "b1", "secret-1")
	require.NoError(t, err)
	tok := b1.Subscribe("companion/v1/devices/dev-2/commands/+", 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, 5*time.Second))
	assert.Equal(t, byte(0x80), tok.(*mqtt.SubscribeToken).Result()["companion/v1/devices/dev-2/commands/+"], "b1 subscribing to b2's device's commands")
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(other, 1, false, "b2's"), 5*time.Second))
	select {
	case m := <-b1.Msgs:
		t.Fatalf("b1 read %s, a command of b2's device", m.Topic())
	case <-time.After(500 * time.Millisecond):
	}
	line := ""
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "default ACL access") && strings.Contains(l, "level=WARN") {
			line = l
		}
	}
	require.NotEmpty(t, line, "the server set the default access back without a word; log:\n%s", logs.String())
	assert.Contains(t, line, "allowed=\"[publishClientReceive subscribe]\"")
	assert.Equal(t, 1, strings.Count(logs.String(), "default ACL access"), "said more than once")
}
