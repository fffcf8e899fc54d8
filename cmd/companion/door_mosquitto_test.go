package main

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/topics"
)

// mqttProbe is a real paho client of the broker's door tests
// (mqtttest.Probe), with the door tests' helpers.
type mqttProbe struct{ *mqtttest.Probe }

func dialMQTT(t *testing.T, url, clientID, user, pass string) (*mqttProbe, error) {
	t.Helper()
	p, err := mqtttest.DialProbe(t, url, clientID, user, pass)
	if err != nil {
		return nil, err
	}
	return &mqttProbe{p}, nil
}

func mustDialMQTT(t *testing.T, url, clientID, user, pass string) *mqttProbe {
	t.Helper()
	p, err := dialMQTT(t, url, clientID, user, pass)
	require.NoError(t, err, "connect as %q", user)
	return p
}

// mustDialSession connects a probe with a persistent session
// (mqtttest.DialSession).
func mustDialSession(t *testing.T, url, clientID, user, pass string) *mqttProbe {
	t.Helper()
	p, err := mqtttest.DialSession(t, url, clientID, user, pass)
	require.NoError(t, err, "connect as %q", user)
	return &mqttProbe{p}
}

// subscribe returns the SUBACK code: the granted QoS, or 0x80 for refused.
func (p *mqttProbe) subscribe(t *testing.T, filter string) byte {
	t.Helper()
	tok := p.Subscribe(filter, 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, 10*time.Second))
	return tok.(*mqtt.SubscribeToken).Result()[filter]
}

// nextOn returns the next message on topic, skipping others.
func (p *mqttProbe) nextOn(t *testing.T, topic string) mqtt.Message {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case m := <-p.Msgs:
			if m.Topic() == topic {
				return m
			}
		case <-deadline:
			t.Fatalf("no message on %s", topic)
			return nil
		}
	}
}

// TestBrokerDoorMosquitto proves every row of the broker's door
// (docs/security.md) on Mosquitto, with the accounts and ACLs the server
// made through the dynamic-security plugin: a user reads their own device's
// topics and nothing else and loses them on unbind, a bridge cannot read
// replies or send commands, nobody anonymous gets in.
func TestBrokerDoorMosquitto(t *testing.T) {
	m, mq := startWithMosquitto(t, t.TempDir())
	f := setupFleet(t, m, "dev-1", "dev-2")
	registerDevices(t, f, "dev-1")
	// dev-2 belongs to another user.
	r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bob := newClient(t, m, r.JSON(t)["token"].(string))
	r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	startBridge(t, m, mq.URL, f, "", "dev-1", "dev-2")

	tree := topics.MustNew(topics.DefaultPrefix)
	must := func(s string, err error) string {
		require.NoError(t, err)
		return s
	}
	dev1, dev2 := must(tree.DeviceFilter("dev-1")), must(tree.DeviceFilter("dev-2"))
	status1 := must(tree.Status("dev-1"))
	cmd1 := must(tree.Command("dev-1", topics.OpPushText))

	// A watcher that sees every message, to show what did not get through.
	watcher := mqtttest.MosquittoAccount{Username: "watcher", Password: "watcher-secret", ACL: []string{"topic readwrite companion/v1/#"}}
	mq.AddAccount(t, watcher)
	w := mustDialMQTT(t, mq.URL, "watcher", watcher.Username, watcher.Password)
	require.Equal(t, byte(1), w.subscribe(t, cmd1))
	// refused publishes, then a marker: the watcher must see the marker first.
	assertRefused := func(p *mqttProbe, who string) {
		t.Helper()
		_ = mqtt.WaitTokenTimeout(p.Publish(cmd1, 1, false, "forged by "+who), 10*time.Second) // refused either way
		require.NoError(t, mqtt.WaitTokenTimeout(w.Publish(cmd1, 1, false, "marker "+who), 10*time.Second))
		assert.Equal(t, "marker "+who, string(w.nextOn(t, cmd1).Payload()), "a command published by the %s went through", who)
	}

	t.Run("anonymous and wrong passwords are refused", func(t *testing.T) {
		_, err := dialMQTT(t, mq.URL, "anon", "", "")
		assert.Error(t, err, "anonymous")
		_, err = dialMQTT(t, mq.URL, "wrong-user", f.userID, "not-the-token")
		assert.Error(t, err, "user with a wrong token")
		_, err = dialMQTT(t, mq.URL, "wrong-bridge", f.bridgeID, "not-the-secret")
		assert.Error(t, err, "bridge with a wrong secret")
	})

	t.Run("a bridge cannot read replies or send commands", func(t *testing.T) {
		b := mustDialMQTT(t, mq.URL, "probe-bridge", f.bridgeID, f.bridgeSecret)
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.AllReplies()))
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/#"))
		assert.Equal(t, byte(1), b.subscribe(t, must(tree.CommandsFilter("dev-1"))))
		assert.Equal(t, byte(1), b.subscribe(t, must(tree.CommandsGrant("dev-1"))), "commands/# of its device (CONTRACT §3)")
		assert.Equal(t, byte(1), b.subscribe(t, must(tree.Command("dev-1", topics.OpPushText))), "one op of its device")
		assert.Equal(t, byte(0x80), b.subscribe(t, must(tree.CommandsFilter("dev-9"))), "a device it does not serve")
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/devices/+/commands/#"), "every device")
		assertRefused(b, "bridge")
	})

	t.Run("mosquitto_sub as the user sees the device's status", func(t *testing.T) {
		bin, err := exec.LookPath("mosquitto_sub")
		if err != nil {
			t.Fatal("mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		// Its status topic: on the device's filter, its retained settings
		// may come first (Mosquitto sends the retained messages in the
		// order their topics were first published).
		out, err := exec.CommandContext(ctx, bin, "-h", "127.0.0.1", "-p", strconv.Itoa(mq.Port),
			"-u", f.userID, "-P", f.user.token, "-t", status1, "-v", "-C", "1", "-W", "10").CombinedOutput()
		require.NoError(t, err, "%s", out)
		topic, payload, ok := strings.Cut(strings.TrimSpace(string(out)), " ")
		require.True(t, ok, "%s", out)
		assert.Equal(t, status1, topic)
		s, err := topics.ParseStatus([]byte(payload))
		require.NoError(t, err, "%s", payload)
		assert.Equal(t, f.bridgeID, s.BridgeID)
	})

	u := mustDialMQTT(t, mq.URL, "alice", f.userID, f.user.token)
	t.Run("a user reads their own device and nothing else", func(t *testing.T) {
		require.Equal(t, byte(1), u.subscribe(t, dev1))
		_, err := topics.ParseStatus(u.nextOn(t, status1).Payload())
		assert.NoError(t, err)
		assert.Equal(t, byte(0x80), u.subscribe(t, dev2), "another user's device")
		assert.Equal(t, byte(0x80), u.subscribe(t, tree.Prefix()+"/#"))
		assert.Equal(t, byte(0x80), u.subscribe(t, must(tree.Status("dev-2"))))
	})

	t.Run("a user cannot publish", func(t *testing.T) {
		p := mustDialMQTT(t, mq.URL, "alice-publisher", f.userID, f.user.token)
		assertRefused(p, "user")
	})

	t.Run("unbinding cuts the user off at once", func(t *testing.T) {
		r := f.user.do("DELETE", "/api/v1/devices/dev-1", nil)
		require.Equal(t, 204, r.Status, "%s", r.Body)
		// The plugin disconnects a client whose role changed...
		select {
		case <-u.Lost:
		case <-time.After(10 * time.Second):
			t.Fatal("the user's connection was not closed on unbind")
		}
		// ...its role no longer grants the device (so no delivery is
		// allowed either), and a new subscription is refused.
		role := mq.Dynsec(t, map[string]any{"command": "getRole", "rolename": dynsec.UserRole(f.userID)})
		require.Empty(t, role[0].Error)
		assert.NotContains(t, string(role[0].Data), "dev-1")
		again := mustDialMQTT(t, mq.URL, "alice-again", f.userID, f.user.token)
		assert.Equal(t, byte(0x80), again.subscribe(t, dev1))
	})
}

// With --mqtt-pin-client-ids a user's account logs in with its own client
// id only (dynsec.UserClientID), and a bridge's with its own
// (dynsec.BridgeClientID): neither takes the server's client id nor the
// other's, and the owners stay connected. (Mosquitto would close the
// owner's connection and hand the newcomer its persistent session, the
// server's queued replies or the bridge's commands.)
func TestMosquittoPinClientIDs(t *testing.T) {
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m := startOnMosquitto(t, Config{Data: t.TempDir(), MQTTPinClientIDs: true}, mq)
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	startBridge(t, m, mq.URL, f, "", "dev-1")
	userCID := dynsec.UserClientID(f.userID)
	for _, c := range []struct{ cid, user, pass string }{
		{"companion-server", f.userID, f.user.token},
		{"companion-server-r2", f.userID, f.user.token},
		{dynsec.BridgeClientID(f.bridgeID), f.userID, f.user.token},
		{"alice", f.userID, f.user.token},
		{"companion-server", f.bridgeID, f.bridgeSecret},
		{userCID, f.bridgeID, f.bridgeSecret},
	} {
		_, err := dialMQTT(t, mq.URL, c.cid, c.user, c.pass)
		assert.Error(t, err, "%s logged in as %s", c.user, c.cid)
	}
	// The server and the bridge still carry a command through.
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "still here"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	u := mustDialMQTT(t, mq.URL, userCID, f.userID, f.user.token)
	assert.True(t, u.IsConnected())
}
