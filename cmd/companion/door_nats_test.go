package main

import (
	"context"
	"encoding/json"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"
)

// mosquittoSubOnce runs mosquitto_sub with the credentials on filter
// until it prints count messages (-C) or 10 seconds pass (-W 10), and
// returns what it printed.
func mosquittoSubOnce(t *testing.T, mqttURL, user, pass, filter string, count int) (string, error) {
	t.Helper()
	bin, err := exec.LookPath("mosquitto_sub")
	require.NoError(t, err, "mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
	u, err := url.Parse(mqttURL)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	args := []string{"-h", u.Hostname(), "-p", u.Port(), "-V", "mqttv311", "-t", filter, "-v", "-q", "1", "-C", strconv.Itoa(count), "-W", "10"}
	if user != "" { // anonymous otherwise
		args = append(args, "-u", user, "-P", pass)
	}
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// TestBrokerDoorNATS proves every row of the broker's door (CONTRACT §3,
// §9, docs/security.md) on the three-node NATS cluster, with the server
// answering the cluster's authorization (--nats-callout): real paho
// clients and mosquitto_sub, on different nodes, and a real bridge. The
// server's account has everything under the prefix; a bridge subscribes
// to its devices' commands only and publishes for them only (the rest is
// acknowledged and dropped), and moving a device moves that at once; a
// user reads their own devices' topics and nothing else and loses them on
// unbind; a deleted bridge is cut off; nobody anonymous or with a wrong
// password gets in.
func TestBrokerDoorNATS(t *testing.T) {
	t.Parallel()
	cl, m := startNATSCallout(t)
	urls := cl.MQTTURLs
	f := setupFleet(t, m, "dev-1", "dev-2") // bridge-1 serves both
	registerDevices(t, f, "dev-1")
	// dev-2 belongs to another user.
	r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bob := newClient(t, m, r.JSON(t)["token"].(string))
	r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	// bridge-2 serves dev-3, alice's too.
	f2 := addBridge(t, f, "bridge-2", "dev-3")
	b1 := startBridge(t, m, urls[0], f, "", "dev-1", "dev-2")
	waitOnline(t, f, true, "dev-1")

	tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
	dev1, dev2 := must(tree.DeviceFilter("dev-1")), must(tree.DeviceFilter("dev-2"))
	cmds := func(dev string) string { return must(tree.CommandsFilter(dev)) }
	text := func(dev string) string { return must(tree.Command(dev, topics.OpPushText)) }
	status1 := must(tree.Status("dev-1"))

	// A watcher with the server's account sees every message under the
	// prefix, to show what did not get through: a refused publish, then
	// a marker; the watcher must see the marker first.
	w := mustDialMQTT(t, urls[1], "watcher", natsServerUser.Username, natsServerUser.Password)
	require.Equal(t, byte(1), w.subscribe(t, text("dev-1")))
	assertRefused := func(p *mqttProbe, who string) {
		t.Helper()
		_ = mqtt.WaitTokenTimeout(p.Publish(text("dev-1"), 1, false, "forged by "+who), 10*time.Second) // acknowledged and dropped
		require.NoError(t, mqtt.WaitTokenTimeout(w.Publish(text("dev-1"), 1, false, "marker "+who), 10*time.Second))
		for { // the server's own commands may come first
			got := string(w.nextOn(t, text("dev-1")).Payload())
			require.NotEqual(t, "forged by "+who, got, "a command published by the %s went through", who)
			if got == "marker "+who {
				return
			}
		}
	}

	t.Run("the server's account has everything under the prefix, and nothing else", func(t *testing.T) {
		s := mustDialMQTT(t, urls[2], "server-probe", natsServerUser.Username, natsServerUser.Password)
		assert.Equal(t, byte(1), s.subscribe(t, tree.Prefix()+"/#"))
		assert.Equal(t, byte(1), s.subscribe(t, tree.AllReplies()))
		assert.Equal(t, byte(0x80), s.subscribe(t, "#"))
		assert.Equal(t, byte(0x80), s.subscribe(t, "other/topic"))
	})

	t.Run("anonymous and wrong passwords are refused", func(t *testing.T) {
		for _, c := range []struct{ name, id, user, pass string }{
			{"anonymous", "anon", "", ""},
			{"user with a wrong token", "wrong-user", f.userID, "not-the-token"},
			{"bridge with a wrong secret", "wrong-bridge", f.bridgeID, "not-the-secret"},
			{"bridge with another bridge's secret", "wrong-bridge-2", f.bridgeID, f2.bridgeSecret},
			{"server with a wrong password", "wrong-server", natsServerUser.Username, "not-the-password"},
			{"unknown name", "nobody", "nobody", "whatever"},
			{"user taking the bridge's client id", "companion-bridge-" + f.bridgeID, f.userID, f.user.token},
		} {
			_, err := dialMQTT(t, urls[len(c.id)%len(urls)], c.id, c.user, c.pass)
			assert.Error(t, err, c.name)
		}
		for _, c := range []struct{ name, user, pass string }{
			{"anonymous", "", ""},
			{"wrong token", f.userID, "not-the-token"},
		} {
			out, err := mosquittoSubOnce(t, urls[2], c.user, c.pass, dev1, 1)
			assert.Error(t, err, "mosquitto_sub %s: %s", c.name, out)
			assert.Contains(t, out, "not authorised", "mosquitto_sub %s", c.name)
		}
	})

	t.Run("a bridge subscribes to its devices' commands only", func(t *testing.T) {
		b := mustDialMQTT(t, urls[1], "probe-bridge", f.bridgeID, f.bridgeSecret)
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.AllReplies()))
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/#"))
		assert.Equal(t, byte(1), b.subscribe(t, cmds("dev-1")))
		assert.Equal(t, byte(1), b.subscribe(t, must(tree.CommandsGrant("dev-1"))), "commands/# of its device (CONTRACT §3)")
		assert.Equal(t, byte(1), b.subscribe(t, text("dev-1")), "one op of its device")
		assert.Equal(t, byte(0x80), b.subscribe(t, cmds("dev-3")), "another bridge's device")
		assert.Equal(t, byte(0x80), b.subscribe(t, cmds("dev-9")), "a device no bridge serves")
		assert.Equal(t, byte(0x80), b.subscribe(t, tree.Prefix()+"/devices/+/commands/#"), "every device")
		assertRefused(b, "bridge")
	})

	t.Run("mosquitto_sub with a bridge's credentials gets its own device's commands only", func(t *testing.T) {
		ms := startMosquittoSub(t, urls[2], f2.bridgeID, f2.bridgeSecret, cmds("dev-1"), cmds("dev-3"))
		assert.Equal(t, "128, 1", ms.granted, "SUBACK codes of dev-1's and dev-3's commands")
		hidden := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "for bridge-1 only"})
		assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", hidden["id"].(string))["state"])
		marker := f.user.accept("POST", "/api/v1/devices/dev-3/push/text", map[string]any{"text": "marker"})
		got := ms.wait(t)
		require.Len(t, got, 1, "mosquitto_sub printed %q", got)
		topic, payload, _ := strings.Cut(got[0], " ")
		assert.Equal(t, text("dev-3"), topic)
		c, err := topics.ParseCommand([]byte(payload))
		require.NoError(t, err, "%s", payload)
		assert.Equal(t, marker["id"], c.ID)
	})

	t.Run("a bridge's publishes for a device it does not serve are dropped", func(t *testing.T) {
		w1 := mustDialMQTT(t, urls[0], "watcher-dev-1", natsServerUser.Username, natsServerUser.Password)
		require.Equal(t, byte(1), w1.subscribe(t, must(tree.Replies("dev-1"))))
		p := mustDialMQTT(t, urls[2], "forger-bridge-2", f2.bridgeID, f2.bridgeSecret)
		for _, qos := range []byte{0, 1} {
			for _, topic := range []string{must(tree.Replies("dev-1")), status1, must(tree.Settings("dev-1"))} {
				p.publishRefused(t, qos, topic, map[string]string{"forged": "by bridge-2"}, cmds("dev-3"))
			}
		}
		require.NoError(t, mqtt.WaitTokenTimeout(w1.Publish(must(tree.Replies("dev-1")), 1, false, "marker"), 10*time.Second))
		assert.Equal(t, "marker", string(w1.assertNext(t, must(tree.Replies("dev-1")), "bridge-2's forged reply went through").Payload()))
		st := f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
		assert.Equal(t, f.bridgeID, st["bridge_id"])
	})

	t.Run("mosquitto_sub as the user sees their device's status, not another's", func(t *testing.T) {
		// The device's retained status and settings.
		out, err := mosquittoSubOnce(t, urls[1], f.userID, f.user.token, dev1, 2)
		require.NoError(t, err, "%s", out)
		var status string
		for _, line := range strings.Split(out, "\n") {
			if p, ok := strings.CutPrefix(line, status1+" "); ok {
				status = p
			}
		}
		require.NotEmpty(t, status, "no status among %q", out)
		s, err := topics.ParseStatus([]byte(status))
		require.NoError(t, err, "%s", status)
		assert.Equal(t, f.bridgeID, s.BridgeID)
		ms := startMosquittoSub(t, urls[1], f.userID, f.user.token, dev2)
		assert.Equal(t, "128", ms.granted, "bob's device")
	})

	u := mustDialMQTT(t, urls[2], "alice", f.userID, f.user.token)
	t.Run("a user reads their own device and nothing else", func(t *testing.T) {
		require.Equal(t, byte(1), u.subscribe(t, dev1))
		_, err := topics.ParseStatus(u.nextOn(t, status1).Payload())
		assert.NoError(t, err)
		assert.Equal(t, byte(0x80), u.subscribe(t, dev2), "another user's device")
		assert.Equal(t, byte(0x80), u.subscribe(t, tree.Prefix()+"/#"))
		assert.Equal(t, byte(0x80), u.subscribe(t, must(tree.Status("dev-2"))))
		assert.Equal(t, byte(0x80), u.subscribe(t, tree.AllBridgeStates()))
	})

	t.Run("a user cannot publish", func(t *testing.T) {
		p := mustDialMQTT(t, urls[0], "alice-publisher", f.userID, f.user.token)
		assertRefused(p, "user")
	})

	t.Run("moving a device moves the rights at once", func(t *testing.T) {
		probe1 := mustDialMQTT(t, urls[1], "bridge-1-probe", f.bridgeID, f.bridgeSecret)
		require.Equal(t, byte(1), probe1.subscribe(t, cmds("dev-1")))
		probe2 := mustDialMQTT(t, urls[2], "bridge-2-probe", f2.bridgeID, f2.bridgeSecret)
		require.Equal(t, byte(0x80), probe2.subscribe(t, cmds("dev-1")))

		r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
		require.Equal(t, 200, r.Status, "%s", r.Body)
		// Both bridges' connections are closed before the answer; they log
		// in again with the rights the store gives them now.
		probe1.waitCut(t, "bridge-1 no longer serves dev-1")
		probe2.waitCut(t, "bridge-2 serves dev-1")
		probe1 = mustDialMQTT(t, urls[1], "bridge-1-probe", f.bridgeID, f.bridgeSecret)
		assert.Equal(t, byte(0x80), probe1.subscribe(t, cmds("dev-1")), "bridge-1 may read dev-1's commands after the move")
		require.Equal(t, byte(1), probe1.subscribe(t, cmds("dev-2")), "bridge-1 keeps its other device")
		probe2 = mustDialMQTT(t, urls[2], "bridge-2-probe", f2.bridgeID, f2.bridgeSecret)
		require.Equal(t, byte(1), probe2.subscribe(t, cmds("dev-1")))
		require.NoError(t, mqtt.WaitTokenTimeout(probe2.Publish(must(tree.BridgeState(f2.bridgeID)), 1, true, topics.BridgeOnline), 10*time.Second))

		// The next command goes to bridge-2 only: the real bridge-1 (its
		// session's subscription to dev-1 refused on its new login) never
		// runs it, and what bridge-1 says of it is dropped.
		id := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "on bridge-2"})["id"].(string)
		assert.Equal(t, id, commandOf(t, probe2.nextOn(t, text("dev-1"))).ID)
		probe1.publishRefused(t, 1, must(tree.Replies("dev-1")), topics.Reply{CommandID: id, State: companion.StateFailed,
			Error: &topics.Error{Code: "forged", Message: "by bridge-1"}, At: time.Now()}, cmds("dev-2"))
		b, err := json.Marshal(topics.Reply{CommandID: id, State: companion.StateSucceeded, At: time.Now()})
		require.NoError(t, err)
		require.NoError(t, mqtt.WaitTokenTimeout(probe2.Publish(must(tree.Replies("dev-1")), 1, false, b), 10*time.Second))
		assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", id)["state"])
		assert.Zero(t, b1.sims["dev-1"].Executions(id), "bridge-1 ran dev-1's command after dev-1 left it")
		other := bob.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "still bridge-1's"})["id"].(string)
		assert.Equal(t, "succeeded", bob.waitFinal("dev-2", other)["state"], "bridge-1 serves its other device")
	})

	t.Run("unbinding cuts the user off at once", func(t *testing.T) {
		r := f.user.do("DELETE", "/api/v1/devices/dev-1", nil)
		require.Equal(t, 204, r.Status, "%s", r.Body)
		u.waitCut(t, "the user's connection was not closed on unbind")
		again := mustDialMQTT(t, urls[0], "alice-again", f.userID, f.user.token)
		assert.Equal(t, byte(0x80), again.subscribe(t, dev1))
	})

	t.Run("a deleted bridge is cut off", func(t *testing.T) {
		r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alice-hub"})
		require.Equal(t, 201, r.Status, "%s", r.Body)
		secret := r.JSON(t)["secret"].(string)
		hub := mustDialMQTT(t, urls[1], "companion-bridge-alice-hub", "alice-hub", secret)
		r = f.user.do("DELETE", "/api/v1/bridges/alice-hub", nil)
		require.Equal(t, 204, r.Status, "%s", r.Body)
		hub.waitCut(t, "its bridge was deleted")
		_, err := dialMQTT(t, urls[1], "companion-bridge-alice-hub", "alice-hub", secret)
		assert.Error(t, err, "a deleted bridge's secret")
	})
}

// The --nats-* flags, and what --nats-callout needs: refused before
// anything connects.
func TestNATSCalloutFlags(t *testing.T) {
	var cfg Config
	fs := newServeFlags(&cfg)
	fs.SetOutput(io.Discard)
	require.NoError(t, parseFlags(fs, []string{"--mqtt-url", "tcp://n1:1883", "--mqtt-username", "srv", "--mqtt-password", "pw",
		"--nats-callout", "nats://n1:4222,nats://n2:4222", "--nats-callout-user", "auth", "--nats-callout-password", "apw",
		"--nats-system-user", "sys", "--nats-system-password", "spw", "--nats-issuer-seed", "/etc/issuer.nk"}))
	assert.Equal(t, NATSConfig{URL: "nats://n1:4222,nats://n2:4222", User: "auth", Password: "apw",
		SystemUser: "sys", SystemPassword: "spw", IssuerSeedFile: "/etc/issuer.nk", Account: "COMPANION"}, cfg.NATS)
	assert.True(t, cfg.MQTTDynsec, "the flag's default; --nats-callout turns it off in Run")

	seed := filepath.Join(t.TempDir(), "issuer.nk")
	require.NoError(t, os.WriteFile(seed, []byte("not a seed"), 0o600))
	good := Config{MQTTURL: "tcp://127.0.0.1:1", MQTTUsername: "srv", MQTTPassword: "pw",
		NATS: NATSConfig{URL: "nats://127.0.0.1:1", User: "auth", Password: "apw", SystemUser: "sys", SystemPassword: "spw",
			IssuerSeedFile: seed, Account: "COMPANION"}}
	for name, edit := range map[string]func(*Config){
		"no --mqtt-url":         func(c *Config) { c.MQTTURL = "" },
		"no server account":     func(c *Config) { c.MQTTPassword = "" },
		"no callout user":       func(c *Config) { c.NATS.Password = "" },
		"no system user":        func(c *Config) { c.NATS.SystemUser = "" },
		"no issuer seed":        func(c *Config) { c.NATS.IssuerSeedFile = "" },
		"an issuer seed unread": func(c *Config) { c.NATS.IssuerSeedFile = filepath.Join(t.TempDir(), "missing") },
		"not a seed":            func(*Config) {},
	} {
		c := good
		edit(&c)
		c.HTTP, c.Data, c.AdminToken = "127.0.0.1:0", t.TempDir(), "test-admin-token"
		m := NewMain(c, testLogger(t))
		err := m.Run(context.Background())
		m.Close()
		assert.Error(t, err, name)
		assert.Nil(t, m.NATSAuth, name)
		assert.Nil(t, m.Broker, "%s: nothing connects", name)
	}
}
