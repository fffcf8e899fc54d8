package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// Bridges serve their own devices only (CONTRACT §9), proven on both
// brokers with real clients: paho probes and mosquitto_sub logged in with a
// bridge's credentials, fake bridges that publish exactly what a test says,
// and real agents with simulated devices.

// tenancyBroker is a broker the tests of this file run on: start returns
// the server and the broker's URL (a NATS cluster's, every node's, comma
// separated).
type tenancyBroker struct {
	name  string
	start func(t *testing.T) (*Main, string)
}

// tenancyBrokers are the two brokers most tests of this file run on.
var tenancyBrokers = []tenancyBroker{
	{"embedded", func(t *testing.T) (*Main, string) {
		m := startServer(t, Config{})
		return m, m.MQTTURL()
	}},
	{"mosquitto", func(t *testing.T) (*Main, string) {
		m, mq := startWithMosquitto(t, t.TempDir())
		return m, mq.URL
	}},
}

// withNATS is tenancyBrokers and a three-node NATS cluster behind the
// server's auth callout, slower to start: for the tests that must hold on
// every broker the server runs on.
func withNATS() []tenancyBroker {
	return append(slices.Clone(tenancyBrokers), tenancyBroker{"nats", func(t *testing.T) (*Main, string) {
		cl, m := startNATSCallout(t)
		return m, cl.MQTTURL()
	}})
}

// addBridge creates a bridge through the admin API and provisions the
// devices, served by it and registered to the fleet's user. It returns the
// fleet as that bridge sees it: the same admin, user and catalog, the new
// bridge's id and secret (for runBridge, connectFakeBridge), and every
// claim code.
func addBridge(tb testing.TB, f *fleet, bridgeID string, devices ...string) *fleet {
	tb.Helper()
	r := f.admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": bridgeID})
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	g := *f
	g.bridgeID, g.bridgeSecret = bridgeID, r.JSON(tb)["secret"].(string)
	for _, id := range devices {
		code := "CLAIM-" + id + "-" + strings.Repeat("Y", 12)
		r := f.admin.do("POST", "/api/v1/admin/devices", map[string]any{"device_id": id, "claim_code": code, "model": "sim-1", "bridge_id": bridgeID})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
		assert.Equal(tb, bridgeID, r.JSON(tb)["bridge_id"])
		f.claims[id] = code
	}
	registerDevices(tb, f, devices...)
	return &g
}

// topicsOf returns a function that takes a topic builder's answer and
// fails tb on its error: must(tree.Status("dev-1")).
func topicsOf(tb testing.TB) func(string, error) string {
	return func(s string, err error) string {
		tb.Helper()
		require.NoError(tb, err)
		return s
	}
}

// publishRefused publishes v as JSON at qos on a topic the broker refuses
// the probe, and returns once the broker has dealt with it: it answers a
// SUBSCRIBE to filter (which the probe may read) sent after it on the same
// connection. The broker drops the message and keeps the connection (at
// QoS 1 it acknowledges it, as MQTT 3.1.1 allows): a bridge that still
// lists a device that moved away keeps serving its other devices.
func (p *mqttProbe) publishRefused(t *testing.T, qos byte, topic string, v any, filter string) {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	require.NoError(t, mqtt.WaitTokenTimeout(p.Publish(topic, qos, false, b), 10*time.Second))
	tok := p.Subscribe(filter, 1, nil)
	select {
	case err := <-p.Lost:
		t.Fatalf("the broker closed the connection after a refused publish on %s: %v", topic, err)
	case <-tok.Done():
		require.NoError(t, tok.Error())
		require.Equal(t, byte(1), tok.(*mqtt.SubscribeToken).Result()[filter], "the round trip's SUBSCRIBE")
	case <-time.After(10 * time.Second):
		t.Fatalf("the broker did not answer after a publish on %s", topic)
	}
}

// assertNext checks that the next message the probe receives is on topic:
// the marker of a test that proves what did not arrive before it.
func (p *mqttProbe) assertNext(t *testing.T, topic, why string) mqtt.Message {
	t.Helper()
	select {
	case m := <-p.Msgs:
		require.Equal(t, topic, m.Topic(), "%s: %s", why, m.Payload())
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("no message on %s (%s)", topic, why)
		return nil
	}
}

// next returns the next message the probe receives, whatever its topic.
func (p *mqttProbe) next(t *testing.T, why string) mqtt.Message {
	t.Helper()
	select {
	case m := <-p.Msgs:
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("no message (%s)", why)
		return nil
	}
}

// watchRetained connects a probe of the fleet's user as clientID to url,
// subscribed to filters: their retained messages come first.
func watchRetained(t *testing.T, url, clientID string, f *fleet, filters ...string) *mqttProbe {
	t.Helper()
	w := mustDialMQTT(t, url, clientID, f.userID, f.user.token)
	for _, filter := range filters {
		require.Equal(t, byte(1), w.subscribe(t, filter), filter)
	}
	return w
}

// waitCut waits until the broker closes the probe's connection.
func (p *mqttProbe) waitCut(t *testing.T, why string) {
	t.Helper()
	select {
	case <-p.Lost:
	case <-time.After(10 * time.Second):
		t.Fatalf("the connection was not closed: %s", why)
	}
}

// twoBridgeFleet is the fleet of the tests that move dev-1: dev-1 and
// dev-3 registered to the user and served by the fleet's bridge, and
// bridge-2 serving dev-2. It returns the fleet as each bridge sees it.
func twoBridgeFleet(t *testing.T, m *Main) (f, f2 *fleet) {
	t.Helper()
	f = setupFleet(t, m, "dev-1", "dev-3")
	registerDevices(t, f, "dev-1", "dev-3")
	return f, addBridge(t, f, "bridge-2", "dev-2")
}

// commandOf decodes a command message a probe received.
func commandOf(t *testing.T, m mqtt.Message) topics.Command {
	t.Helper()
	c, err := topics.ParseCommand(m.Payload())
	require.NoError(t, err, "%s", m.Payload())
	return c
}

// A second bridge, serving its own device, can neither read the commands
// of the first bridge's device (paho and mosquitto_sub with its
// credentials), nor forge that device's status, settings or replies, nor
// download the blob of its unfinished command.
func TestSecondBridgeSeesNothingOfTheFirst(t *testing.T) {
	for _, tb := range tenancyBrokers {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			f2 := addBridge(t, f, "bridge-2", "dev-2")
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			cmds1 := must(tree.CommandsFilter("dev-1"))
			cmds2 := must(tree.CommandsFilter("dev-2"))
			u := f.user

			t.Run("paho cannot subscribe to its commands", func(t *testing.T) {
				p := mustDialMQTT(t, mqttURL, "probe-bridge-2", f2.bridgeID, f2.bridgeSecret)
				assert.Equal(t, byte(0x80), p.subscribe(t, cmds1), "the first bridge's device")
				assert.Equal(t, byte(0x80), p.subscribe(t, must(tree.Command("dev-1", topics.OpPushText))), "one op of it")
				assert.Equal(t, byte(0x80), p.subscribe(t, tree.Prefix()+"/devices/+/commands/#"), "every device")
				assert.Equal(t, byte(0x80), p.subscribe(t, tree.Prefix()+"/#"), "everything")
				assert.Equal(t, byte(1), p.subscribe(t, cmds2), "its own device")
			})

			t.Run("mosquitto_sub with its credentials receives nothing of it", func(t *testing.T) {
				// Subscribed to both devices' commands: dev-1's is refused,
				// dev-2's granted. A command to dev-1 goes to the broker
				// first, then one to dev-2, the marker: the first message
				// mosquitto_sub prints (-C 1) must be the marker.
				ms := startMosquittoSub(t, mqttURL, f2.bridgeID, f2.bridgeSecret, cmds1, cmds2)
				assert.Equal(t, "128, 1", ms.granted, "SUBACK codes of dev-1's and dev-2's commands")
				hidden := u.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "for bridge-1 only"})
				waitState(t, u, "dev-1", hidden["id"].(string), "sent") // the broker has had it for half a second
				marker := u.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "marker"})
				got := ms.wait(t)
				require.Len(t, got, 1, "mosquitto_sub printed %q", got)
				topic, payload, _ := strings.Cut(got[0], " ")
				assert.Equal(t, must(tree.Command("dev-2", topics.OpPushText)), topic)
				c, err := topics.ParseCommand([]byte(payload))
				require.NoError(t, err, "%s", payload)
				assert.Equal(t, marker["id"], c.ID)
				assert.NotContains(t, strings.Join(ms.all, "\n"), hidden["id"].(string))
			})

			t.Run("it cannot forge the first device's status, settings or replies", func(t *testing.T) {
				fb := connectFakeBridge(t, mqttURL, f)
				statusTopic := must(tree.Status("dev-1"))
				settingsTopic := must(tree.Settings("dev-1"))
				replies := must(tree.Replies("dev-1"))
				status := func(seq uint64, battery int) topics.Status {
					return topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: "sim-1",
						Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: seq}
				}
				settings := func(seq uint64, brightness int) topics.Settings {
					return topics.Settings{Reported: map[string]any{"brightness": brightness}, Schema: sim.DefaultSchema(), At: time.Now(), Seq: seq}
				}
				fb.publish(statusTopic, status(100, 80), true)
				fb.publish(settingsTopic, settings(100, 50), true)
				cmd := u.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "real"})["id"].(string)
				waitState(t, u, "dev-1", cmd, "sent")
				testenv.Eventually(t, 20*time.Second, "the first reports", func() bool {
					return u.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)["battery"] == 80.0 &&
						u.do("GET", "/api/v1/devices/dev-1/settings", nil).Status == 200
				})

				// bridge-2 publishes a status and settings with a far higher
				// seq, naming bridge-1, and a final reply for the command.
				// Both at QoS 0 and at QoS 1, as a bridge publishes.
				p := mustDialMQTT(t, mqttURL, "forger-bridge-2", f2.bridgeID, f2.bridgeSecret)
				for _, qos := range []byte{0, 1} {
					p.publishRefused(t, qos, statusTopic, status(1<<60, 1), cmds2)
					p.publishRefused(t, qos, settingsTopic, settings(1<<60, 1), cmds2)
					p.publishRefused(t, qos, replies, topics.Reply{CommandID: cmd, State: companion.StateSucceeded, At: time.Now()}, cmds2)
				}

				// Then bridge-1 reports with lower seqs, and says the command
				// was delivered: none of it would apply had the forged
				// messages been taken.
				fb.publish(statusTopic, status(101, 70), true)
				fb.publish(settingsTopic, settings(101, 60), true)
				fb.publish(replies, topics.Reply{CommandID: cmd, State: companion.StateDelivered, At: time.Now()}, false)
				waitState(t, u, "dev-1", cmd, "delivered")
				testenv.Eventually(t, 20*time.Second, "bridge-1's later status", func() bool {
					return u.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)["battery"] == 70.0
				})
				testenv.Eventually(t, 20*time.Second, "bridge-1's later settings", func() bool {
					rep, _ := u.do("GET", "/api/v1/devices/dev-1/settings", nil).JSON(t)["reported"].(map[string]any)
					return rep["brightness"] == 60.0
				})
				st := u.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
				assert.Equal(t, f.bridgeID, st["bridge_id"])
			})

			t.Run("it cannot download the first device's blob", func(t *testing.T) {
				// No bridge-1 runs: the image command stays unfinished, and
				// its blob is one bridge-1 needs.
				img := pngImage(t, 16, 8)
				sum := sha256.Sum256(img)
				path := "/api/v1/blobs/" + hex.EncodeToString(sum[:])
				cmd := u.accept("POST", "/api/v1/devices/dev-1/push/image", map[string]any{"image": base64.StdEncoding.EncodeToString(img), "content_type": "image/png"})
				require.False(t, companion.IsFinal(commandState(t, u, "dev-1", cmd["id"].(string))))

				as2, as1 := newClient(t, m, f2.bridgeSecret), newClient(t, m, f.bridgeSecret)
				r := as2.do("GET", path, nil)
				assert.Equal(t, 404, r.Status, "bridge-2 got bridge-1's blob: %.100s", r.Body)
				assert.Equal(t, "blob_not_found", r.JSON(t)["code"])
				unknown := as2.do("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), nil)
				assert.Equal(t, string(unknown.Body), string(r.Body), "another's blob reads as one that does not exist")
				r = as1.do("GET", path, nil)
				require.Equal(t, 200, r.Status, "%.200s", r.Body)
				assert.Equal(t, img, r.Body)

				// Once the command is final, bridge-1 needs it no more.
				r = u.do("DELETE", "/api/v1/devices/dev-1/commands/"+cmd["id"].(string), nil)
				require.Equal(t, 200, r.Status, "%s", r.Body)
				assert.Equal(t, 404, as1.do("GET", path, nil).Status, "the blob of a canceled command")
			})
		})
	}
}

// mosquittoSub is a running mosquitto_sub.
type mosquittoSub struct {
	granted string   // the SUBACK codes it printed, e.g. "128, 1"
	all     []string // every line it printed
	msgs    []string // the messages: "topic payload"
	done    chan error
	lines   chan string
}

// startMosquittoSub runs mosquitto_sub (-d -v, QoS 1) with the credentials
// on the filters until it has printed one message (-C 1) or 20 seconds
// passed (-W 20), and returns once the broker has answered its
// subscription.
func startMosquittoSub(t *testing.T, mqttURL, user, pass string, filters ...string) *mosquittoSub {
	t.Helper()
	bin, err := exec.LookPath("mosquitto_sub")
	require.NoError(t, err, "mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
	// Its stdout is a pipe here: stdbuf (coreutils) makes it line-buffered,
	// so that its SUBACK line arrives while it runs.
	stdbuf, err := exec.LookPath("stdbuf")
	require.NoError(t, err, "stdbuf (coreutils) is required")
	u, err := url.Parse(mqttURL)
	require.NoError(t, err)
	args := []string{"-oL", bin, "-h", u.Hostname(), "-p", u.Port(), "-u", user, "-P", pass, "-i", "mosquitto-sub-" + user,
		"-q", "1", "-d", "-v", "-C", "1", "-W", "20"}
	for _, f := range filters {
		args = append(args, "-t", f)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, stdbuf, args...)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	ms := &mosquittoSub{done: make(chan error, 1), lines: make(chan string, 100)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ms.lines <- sc.Text()
		}
		_, _ = io.Copy(io.Discard, out)
		close(ms.lines)
		err := cmd.Wait()
		if err != nil {
			err = fmt.Errorf("%w: %s", err, stderr.String())
		}
		ms.done <- err
	}()
	for {
		select {
		case l, ok := <-ms.lines:
			require.True(t, ok, "mosquitto_sub ended before its SUBACK: %q", ms.all)
			ms.all = append(ms.all, l)
			if g, ok := strings.CutPrefix(l, "Subscribed (mid: 1): "); ok {
				ms.granted = g
				return ms
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("mosquitto_sub got no SUBACK: %q", ms.all)
		}
	}
}

// wait waits for mosquitto_sub to end and returns the messages it printed.
func (ms *mosquittoSub) wait(t *testing.T) []string {
	t.Helper()
	for l := range ms.lines {
		ms.all = append(ms.all, l)
		if strings.HasPrefix(l, topics.DefaultPrefix+"/") {
			ms.msgs = append(ms.msgs, l)
		}
	}
	require.NoError(t, <-ms.done, "mosquitto_sub: %q", ms.all)
	return ms.msgs
}

// Moving a device moves its rights at once, while the bridges are connected
// and subscribed (CONTRACT §9). A device no bridge serves has its commands
// wait queued; the bridge it joins may subscribe to its commands and gets
// the waiting ones (once it says it is online, as a bridge does after it
// subscribes); the bridge it left gets none of its commands and may
// publish nothing for it. Both brokers disconnect the clients of each
// bridge whose devices changed (Mosquitto's plugin does so for a role
// that changed), so that a bridge subscribes anew: the probes connect
// again. (A bridge's persistent session, which keeps its old
// subscriptions, is TestMovingADeviceBetweenRunningBridges's.)
func TestMovingADeviceMovesItsRights(t *testing.T) {
	for _, tb := range tenancyBrokers {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f, f2 := twoBridgeFleet(t, m)
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			cmds := func(dev string) string { return must(tree.CommandsFilter(dev)) }
			text := func(dev string) string { return must(tree.Command(dev, topics.OpPushText)) }
			u := f.user

			probes := 0
			dial := func(g *fleet, filters ...string) *mqttProbe {
				t.Helper()
				probes++
				p := mustDialMQTT(t, mqttURL, fmt.Sprintf("%s-probe-%d", g.bridgeID, probes), g.bridgeID, g.bridgeSecret)
				for _, filter := range filters {
					require.Equal(t, byte(1), p.subscribe(t, filter), "%s may read %s", g.bridgeID, filter)
				}
				return p
			}
			// again is the probe of a bridge whose rights just changed: a
			// new one, once the broker has closed the old one.
			again := func(p *mqttProbe, g *fleet, filters ...string) *mqttProbe {
				t.Helper()
				p.waitCut(t, g.bridgeID+"'s devices changed")
				return dial(g, filters...)
			}
			push := u.pushText
			move := func(dev string, to any) {
				t.Helper()
				r := f.admin.do("PUT", "/api/v1/admin/devices/"+dev+"/bridge", map[string]any{"bridge_id": to})
				require.Equal(t, 200, r.Status, "%s", r.Body)
				want, _ := json.Marshal(map[string]any{"device_id": dev, "bridge_id": to})
				assert.JSONEq(t, string(want), string(r.Body))
			}
			reply := func(p *mqttProbe, dev, id, state string) {
				t.Helper()
				b, err := json.Marshal(topics.Reply{CommandID: id, State: state, At: time.Now()})
				require.NoError(t, err)
				require.NoError(t, mqtt.WaitTokenTimeout(p.Publish(must(tree.Replies(dev)), 1, false, b), 10*time.Second))
			}
			online := func(p *mqttProbe, bridgeID string) {
				t.Helper()
				require.NoError(t, mqtt.WaitTokenTimeout(p.Publish(must(tree.BridgeState(bridgeID)), 1, true, topics.BridgeOnline), 10*time.Second))
			}

			b1 := dial(f, cmds("dev-1"), cmds("dev-3"))
			b2 := dial(f2, cmds("dev-2"))
			require.Equal(t, byte(0x80), b2.subscribe(t, cmds("dev-1")), "bridge-2 read dev-1's commands before the move")
			first := push("dev-1", "to bridge-1")
			assert.Equal(t, first, commandOf(t, b1.assertNext(t, text("dev-1"), "dev-1's command")).ID)
			b, err := json.Marshal(topics.Status{Online: true, FirmwareVersion: "1.0.0", Model: "sim-1", Apps: []companion.App{},
				BridgeID: f.bridgeID, At: time.Now(), Seq: 1})
			require.NoError(t, err)
			require.NoError(t, mqtt.WaitTokenTimeout(b1.Publish(must(tree.Status("dev-1")), 1, true, b), 10*time.Second))
			waitOnline(t, f, true, "dev-1")

			// 1. No bridge serves dev-1: bridge-1 is cut off, may no longer
			// subscribe to dev-1's commands and gets none of them, and the
			// new command waits queued. The marker is a command to dev-3,
			// which bridge-1 still serves; dev-3's command is written sent
			// half a second after the broker took it: had dev-1's gone out
			// with it, it would be sent by then.
			move("dev-1", nil)
			b1 = again(b1, f, cmds("dev-3"))
			assert.Equal(t, byte(0x80), b1.subscribe(t, cmds("dev-1")), "bridge-1 may read dev-1's commands once it serves it no more")
			waiting := push("dev-1", "waits for a bridge")
			marker := push("dev-3", "marker")
			assert.Equal(t, marker, commandOf(t, b1.assertNext(t, text("dev-3"), "bridge-1 got dev-1's command after the move")).ID)
			waitState(t, u, "dev-3", marker, "sent")
			assert.Equal(t, "queued", commandState(t, u, "dev-1", waiting))
			assert.Equal(t, false, u.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)["online"], "a device no bridge serves reads offline")

			// 2. bridge-2 serves dev-1: it may subscribe now, and once it
			// says it is online the waiting command (and the one bridge-1
			// never finished) go to it.
			move("dev-1", "bridge-2")
			b2 = again(b2, f2, cmds("dev-2"))
			require.Equal(t, byte(1), b2.subscribe(t, cmds("dev-1")))
			online(b2, f2.bridgeID)
			got := map[string]bool{}
			for range 2 {
				got[commandOf(t, b2.nextOn(t, text("dev-1"))).ID] = true
			}
			assert.Equal(t, map[string]bool{first: true, waiting: true}, got)

			// bridge-1 may not answer for dev-1 now: its "failed" is
			// refused, and bridge-2's "succeeded" after it ends the command.
			b1.publishRefused(t, 1, must(tree.Replies("dev-1")), topics.Reply{CommandID: waiting, State: companion.StateFailed,
				Error: &topics.Error{Code: "forged", Message: "by bridge-1"}, At: time.Now()}, cmds("dev-3"))
			for _, id := range []string{first, waiting} {
				reply(b2, "dev-1", id, companion.StateSucceeded)
				assert.Equal(t, "succeeded", u.waitFinal("dev-1", id)["state"])
			}

			// 3. Straight back to bridge-1: bridge-2 is cut off and may no
			// longer subscribe to dev-1's commands; bridge-1 may again, and
			// gets the new one.
			move("dev-1", "bridge-1")
			b1 = again(b1, f, cmds("dev-3"))
			b2 = again(b2, f2, cmds("dev-2"))
			assert.Equal(t, byte(0x80), b2.subscribe(t, cmds("dev-1")), "bridge-2 may read dev-1's commands after dev-1 left it")
			back := push("dev-1", "back to bridge-1")
			require.Equal(t, byte(1), b1.subscribe(t, cmds("dev-1")))
			online(b1, f.bridgeID)
			assert.Equal(t, back, commandOf(t, b1.nextOn(t, text("dev-1"))).ID)
			marker = push("dev-2", "marker")
			assert.Equal(t, marker, commandOf(t, b2.assertNext(t, text("dev-2"), "bridge-2 got a message of dev-1")).ID)
		})
	}
}

// Moving a device between two running bridges (real agents, each listing
// the device among its own): its next command runs on the bridge it moved
// to and never on the one it left, and the bridge it left keeps serving
// its other devices.
func TestMovingADeviceBetweenRunningBridges(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f, f2 := twoBridgeFleet(t, m)
			u := f.user
			b1 := startBridge(t, m, mqttURL, f, "", "dev-1", "dev-3")
			b2 := startBridge(t, m, mqttURL, f2, "", "dev-2", "dev-1")
			waitOnline(t, f, true, "dev-1", "dev-2", "dev-3")
			push := u.pushText

			// dev-3 stays on bridge-1: bridge-1 is disconnected as dev-1
			// leaves it (its rights change), and comes back without its
			// devices ever reading offline (its Will held: by the embedded
			// broker, by the server on NATS; Mosquitto's plugin sends none).
			events := sseOpen(t, u, "?device_id=dev-3")

			before := push("dev-1", "on bridge-1")
			assert.Equal(t, "succeeded", u.waitFinal("dev-1", before)["state"])
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
			require.Equal(t, 200, r.Status, "%s", r.Body)

			after := push("dev-1", "on bridge-2")
			assert.Equal(t, "succeeded", u.waitFinal("dev-1", after)["state"])
			assert.Equal(t, []string{after}, textIDs(b2.sims["dev-1"]), "the command ran on bridge-2")
			assert.Equal(t, []string{before}, textIDs(b1.sims["dev-1"]), "bridge-1 ran dev-1's command after dev-1 left it")
			other := push("dev-3", "still bridge-1's")
			assert.Equal(t, "succeeded", u.waitFinal("dev-3", other)["state"])
			testenv.Eventually(t, 20*time.Second, "dev-1's status from bridge-2", func() bool {
				return u.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)["bridge_id"] == f2.bridgeID
			})
			for _, ev := range events.drain() {
				if ev.event == "device" {
					assert.Equal(t, true, ev.data["online"], "dev-3, which stayed on bridge-1, read offline as dev-1 left it: %v", ev.data)
				}
			}
		})
	}
}

// A bridge that stops just after a device moved to it reads offline, with
// its devices, on the embedded broker and on Mosquitto. Both disconnect a
// bridge for a change of its rights without its Will (the embedded broker
// holds that Will itself), so an "offline" that follows is the bridge's
// own. The server held it for the grace all the same, and read the bridge
// online meanwhile (docs/reliability.md, bug 201). The grace is an hour
// here, so that a held Will shows. On NATS, which publishes the Will of a
// connection it closes, the server holds it: TestMovingADeviceBetweenRunningBridges.
func TestABridgeStoppedAfterAMoveReadsOffline(t *testing.T) {
	cfg := Config{KickGrace: time.Hour}
	for _, tb := range []tenancyBroker{
		{"embedded", func(t *testing.T) (*Main, string) {
			m := startServer(t, cfg)
			return m, m.MQTTURL()
		}},
		{"mosquitto", func(t *testing.T) (*Main, string) {
			mq := mqtttest.StartMosquitto(t, serverAccount)
			return startOnMosquitto(t, cfg, mq), mq.URL
		}},
	} {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f, f2 := twoBridgeFleet(t, m)
			b2 := startBridge(t, m, mqttURL, f2, "", "dev-2", "dev-1")
			waitOnline(t, f, true, "dev-2")
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			testenv.Eventually(t, 20*time.Second, "dev-1 online on bridge-2", func() bool {
				st := f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
				return st["bridge_id"] == f2.bridgeID && st["online"] == true
			})
			b2.stop()
			waitOnline(t, f, false, "dev-1", "dev-2")
		})
	}
}

// A bridge lost just as one of its devices moves, on Mosquitto: its link
// went silent (its keepalive not yet out), and the plugin, disconnecting
// it for its new rights, drops its Will. The server publishes that Will
// for it once the grace is over with no word from it, so its devices read
// offline; without that they read online for ever (docs/reliability.md,
// bug 202). The bridge the device moved to, disconnected too, comes back:
// its Will is not published. The grace is a second here.
func TestABridgeLostAsADeviceMovesReadsOfflineOnMosquitto(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m := startOnMosquitto(t, Config{KickGrace: grace}, mq)
	f, f2 := twoBridgeFleet(t, m)
	link := testenv.NewRelay(t, strings.TrimPrefix(mq.URL, "tcp://"))
	startBridge(t, m, "tcp://"+link.Addr(), f, "", "dev-1", "dev-3")
	startBridge(t, m, mq.URL, f2, "", "dev-2", "dev-1")
	waitOnline(t, f, true, "dev-1", "dev-2", "dev-3")
	link.Blackhole()
	r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	waitOnline(t, f, false, "dev-3")
	time.Sleep(grace) // past the grace of bridge-2's check too
	for _, dev := range []string{"dev-1", "dev-2"} {
		assert.Equal(t, true, f.user.do("GET", "/api/v1/devices/"+dev+"/status", nil).JSON(t)["online"], "%s, on the bridge that came back", dev)
	}
}

// A command queued in the persistent session of the bridge a device left
// never reaches that bridge: the bridge was away when the server sent it
// (written sent; a bridge's connection dropped, its session kept), the
// device moved meanwhile, and the server sends it again to the bridge the
// device moved to. Were the old bridge given it on its return, it would
// run it too (a text shown twice, a firmware flashed twice), and its word
// on it would be refused. The embedded broker drops such a message from
// the session it resumes (broker/embedded, dropUnreadable); Mosquitto and
// NATS are checked here to do the same. The control: a command of a
// device the bridge still serves, queued in the same session at the same
// time, does reach it.
func TestAMovedDevicesCommandStaysInItsOldBridgesSession(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			mqttURL, _, _ = strings.Cut(mqttURL, ",") // one node of a NATS cluster: the session lives in its JetStream all the same
			f, f2 := twoBridgeFleet(t, m)
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			u := f.user
			push := u.pushText
			clientID := f.bridgeID + "-session"
			b1 := mustDialSession(t, mqttURL, clientID, f.bridgeID, f.bridgeSecret)
			for _, dev := range []string{"dev-1", "dev-3"} {
				require.Equal(t, byte(1), b1.subscribe(t, must(tree.CommandsFilter(dev))))
			}
			b1.Disconnect(50)

			moved := push("dev-1", "queued for bridge-1, then moved")
			stays := push("dev-3", "queued for bridge-1, which keeps dev-3")
			waitState(t, u, "dev-1", moved, "sent")
			waitState(t, u, "dev-3", stays, "sent")
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
			require.Equal(t, 200, r.Status, "%s", r.Body)

			b1 = mustDialSession(t, mqttURL, clientID, f.bridgeID, f.bridgeSecret)
			marker := push("dev-3", "marker")
			var got []string
			for len(got) == 0 || got[len(got)-1] != marker {
				select {
				case msg := <-b1.Msgs:
					got = append(got, commandOf(t, msg).ID)
				case <-time.After(15 * time.Second):
					t.Fatalf("bridge-1 got %q from its session and after; want %s, then the marker", got, stays)
				}
			}
			assert.Equal(t, []string{stays, marker}, got, "bridge-1's session after dev-1 moved to bridge-2 (%s is dev-1's)", moved)
		})
	}
}

// A command sent to a bridge that was away when its device was taken off
// that bridge waits queued (CONTRACT §9: commands for an unassigned device
// wait queued), listed so, and runs on the bridge the device is assigned
// to next.
func TestASentCommandOfAnUnassignedDeviceWaitsQueued(t *testing.T) {
	t.Parallel() // it mostly waits
	for _, tb := range tenancyBrokers {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f, f2 := twoBridgeFleet(t, m)
			u := f.user
			b1 := mustDialSession(t, mqttURL, f.bridgeID+"-session", f.bridgeID, f.bridgeSecret)
			require.Equal(t, byte(1), b1.subscribe(t, topicsOf(t)(topics.MustNew(topics.DefaultPrefix).CommandsFilter("dev-1"))))
			b1.Disconnect(50)

			id := u.pushText("dev-1", "sent to bridge-1, then unassigned")
			waitState(t, u, "dev-1", id, "sent")
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": nil})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			waitState(t, u, "dev-1", id, "queued")
			r = u.do("GET", "/api/v1/devices/dev-1/commands?state=queued", nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			assert.Len(t, r.JSON(t)["commands"], 1, "the queued commands of dev-1: %s", r.Body)

			r = f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			b2 := startBridge(t, m, mqttURL, f2, "", "dev-1", "dev-2")
			assert.Equal(t, "succeeded", u.waitFinal("dev-1", id)["state"])
			assert.Equal(t, []string{id}, textIDs(b2.sims["dev-1"]), "the command ran on bridge-2")
		})
	}
}

// A device moved to another bridge while the bridge it leaves runs a
// command on it, another queued behind it there (one device in range of
// both, as when bridges are rebalanced): both fail, device_not_served,
// whether they took effect being unknown to the server, and the bridge it
// moved to never runs them; the device's next command runs there. The
// bridge it left, refused the device's commands once the move has it
// subscribe anew, holds the queued one rather than run it on the device
// (docs/reliability.md, bug 240), and stops the running one, holding it
// too (bug 504). On every broker.
func TestMovingADeviceWhileItsBridgeRunsACommand(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			f2 := addBridge(t, f, "bridge-2")
			shared := map[string]*sim.Device{}
			held := newLogSignal("holding the device's commands")
			logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), held), nil))
			startBridgeWith(t, m, mqttURL, f, bridgeConfig{sims: shared, commandTimeout: 3 * time.Second, logger: logger}, "dev-1")
			startBridgeWith(t, m, mqttURL, f2, bridgeConfig{sims: shared}, "dev-1")
			waitOnline(t, f, true, "dev-1")
			dev := shared["dev-1"]
			push := func(text string) string { return f.user.pushText("dev-1", text) }

			dev.HangNext()
			hung := push("hangs on bridge-1")
			behind := push("queued behind it on bridge-1")
			waitState(t, f.user, "dev-1", hung, "delivered")
			waitState(t, f.user, "dev-1", behind, "delivered")
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			for _, id := range []string{hung, behind} {
				cmd := f.user.waitFinal("dev-1", id)
				assert.Equal(t, "failed", cmd["state"], "%v", cmd)
				if e, ok := cmd["error"].(map[string]any); assert.True(t, ok, "%v", cmd) {
					assert.Equal(t, "device_not_served", e["code"])
				}
			}

			next := push("on bridge-2")
			assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", next)["state"])
			select {
			case <-held.seen: // bridge-1 stopped the hung command, or it timed out
			case <-time.After(30 * time.Second):
				t.Errorf("bridge-1 did not hold dev-1's queued command; the device ran %q", textIDs(dev))
			}
			assert.Zero(t, dev.Executions(hung), "the command the bridge it left had ran")
			assert.Zero(t, dev.Executions(behind), "the command queued behind it on the bridge it left ran")
			assert.Equal(t, []string{next}, textIDs(dev))
		})
	}
}

// A watcher of a device's topics (its user, CONTRACT §3) reads it go
// offline with its bridge: the bridge's last retained status said online,
// and the server sets it to what the store says once the bridge's state
// reads offline; whoever subscribes later reads that too. On each broker:
// the server's right to publish it, and the broker's retained message, are
// theirs.
func TestWatcherReadsTheDeviceOfflineWithItsBridge(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			b := startBridge(t, m, mqttURL, f, "", "dev-1")
			waitOnline(t, f, true, "dev-1")
			next := watchStatusAs(t, mqttURL, f, "watcher-1", "dev-1")
			last := next()
			require.True(t, last.Online, "the bridge's retained status")

			b.stop()
			waitOnline(t, f, false, "dev-1")
			var got topics.Status
			for got = next(); got.Online; got = next() {
				last = got // a report the bridge made as it stopped
			}
			want := last
			want.Online = false
			assert.Equal(t, want.Seq, got.Seq, "the offline status keeps the last report's seq")
			assert.Equal(t, want.BridgeID, got.BridgeID)
			assert.Equal(t, want.FirmwareVersion, got.FirmwareVersion)
			later := watchStatusAs(t, mqttURL, f, "watcher-2", "dev-1")
			assert.False(t, later().Online, "the retained status after the bridge left")
		})
	}
}

// watchStatusAs subscribes a watcher with f's user's credentials (CONTRACT
// §3), on one node of mqttURL, to dev's status topic, and returns what
// reads the next status it hears: the retained one first.
func watchStatusAs(t *testing.T, mqttURL string, f *fleet, clientID, dev string) func() topics.Status {
	t.Helper()
	topic := topicsOf(t)(topics.MustNew(topics.DefaultPrefix).Status(dev))
	node, _, _ := strings.Cut(mqttURL, ",") // one node of a NATS cluster
	w := mustDialMQTT(t, node, clientID, f.userID, f.user.token)
	require.Equal(t, byte(1), w.subscribe(t, topic))
	return func() topics.Status {
		t.Helper()
		m := w.nextOn(t, topic)
		s, err := topics.ParseStatus(m.Payload())
		require.NoError(t, err, "%s", m.Payload())
		return s
	}
}

// A watcher reads a device go offline as it is taken off its bridge
// (CONTRACT §9: an unassigned device reads offline), the bridge running on:
// the broker retained its last report, online, and the bridge's reports
// of it are refused from then on, so the server publishes the store's
// status, offline and with no bridge; whoever subscribes later reads that
// too. So it does as the device moves to another bridge, one that does not
// have it: its old bridge's word no longer holds, and the new one never
// reports it. On each broker.
func TestWatcherReadsTheDeviceOfflineOffItsBridge(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			f2 := addBridge(t, f, "bridge-2") // never runs: it does not have dev-1
			startBridge(t, m, mqttURL, f, "", "dev-1")
			waitOnline(t, f, true, "dev-1")
			next := watchStatusAs(t, mqttURL, f, "watcher-1", "dev-1")
			require.True(t, next().Online, "the bridge's retained status")

			for i, to := range []any{nil, f2.bridgeID} {
				if i > 0 {
					// Back to bridge-1, which reports it online again.
					r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f.bridgeID})
					require.Equal(t, 200, r.Status, "%s", r.Body)
					waitOnline(t, f, true, "dev-1")
					for got := next(); !got.Online; got = next() {
						// the offline status published as it left bridge-1
					}
				}
				r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": to})
				require.Equal(t, 200, r.Status, "%s", r.Body)
				waitOnline(t, f, false, "dev-1")
				assert.Nil(t, f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)["bridge_id"], "the status of dev-1 moved to %v", to)
				var got topics.Status
				for got = next(); got.Online; got = next() {
					// a report the bridge made as the device moved
				}
				assert.Empty(t, got.BridgeID, "the status of a device moved to %v", to)
				s := watchStatusAs(t, mqttURL, f, fmt.Sprintf("watcher-%d", i+2), "dev-1")()
				assert.False(t, s.Online, "the retained status once the device moved to %v", to)
				assert.Empty(t, s.BridgeID)
			}
		})
	}
}

// A bridge may leave its Will on its device's status or settings topic
// (the project's bridge does not, but the device's topics are the
// bridge's to publish while it serves it). Taken off the bridge, the
// device is no longer its, and what that bridge publishes for it is the
// server's to drop (CONTRACT §9): NATS publishes the Will of a connection
// it closes, with the rights of its login, so it reached the broker and
// stayed retained, and the device's watcher, its next owner once it was
// unbound, read the bridge's made-up firmware and settings over the
// server's status (docs/reliability.md, bug 242). The server overwrites
// such a status with its own and clears such settings. The embedded
// broker refuses the Will at connect, and Mosquitto's plugin drops it.
func TestABridgesWillOnADeviceItLeftIsNotRetained(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			node, _, _ := strings.Cut(mqttURL, ",")
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			statusTopic, settingsTopic := must(tree.Status("dev-1")), must(tree.Settings("dev-1"))
			battery := 90
			connectFakeBridge(t, node, f).publish(statusTopic, topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0",
				Model: "sim-1", Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: 1}, true)
			waitOnline(t, f, true, "dev-1")

			seq := uint64(time.Now().Add(time.Hour).UnixNano())
			forged := map[string]any{
				statusTopic: topics.Status{Online: true, Battery: &battery, FirmwareVersion: "6.6.6", Model: "sim-1",
					Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: seq},
				settingsTopic: topics.Settings{Reported: map[string]any{"brightness": 1}, Schema: sim.DefaultSchema(), At: time.Now(), Seq: seq},
			}
			for i, topic := range []string{statusTopic, settingsTopic} {
				b, err := json.Marshal(forged[topic])
				require.NoError(t, err)
				c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(node).SetClientID(fmt.Sprintf("will-%d", i)).
					SetUsername(f.bridgeID).SetPassword(f.bridgeSecret).SetAutoReconnect(false).SetBinaryWill(topic, b, 1, true))
				if err := mqtt.WaitTokenTimeout(c.Connect(), 10*time.Second); err != nil {
					t.Logf("a Will on %s refused at connect: %v", topic, err)
					continue
				}
				t.Cleanup(func() { c.Disconnect(50) })
			}
			r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": nil})
			require.Equal(t, 200, r.Status, "%s", r.Body)
			waitOnline(t, f, false, "dev-1")

			// Read by a watcher that subscribes after: the settings, then
			// the status, retained, which the server has published since
			// the device left its bridge (offline).
			watchers := 0
			testenv.Eventually(t, 20*time.Second, "the retained status and settings the server's", func() bool {
				watchers++
				w := watchRetained(t, node, fmt.Sprintf("watcher-%d", watchers), f, settingsTopic, statusTopic)
				defer w.Disconnect(50)
				for {
					msg := w.next(t, "the retained status")
					if msg.Topic() == settingsTopic {
						if strings.Contains(string(msg.Payload()), `"brightness":1`) {
							return false // the forged settings
						}
						continue
					}
					st, err := topics.ParseStatus(msg.Payload())
					require.NoError(t, err, "%s", msg.Payload())
					return !st.Online && st.FirmwareVersion == "1.0.0"
				}
			})
			st := f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
			assert.Equal(t, "1.0.0", st["firmware_version"], "the stored status")
		})
	}
}

// The settings a device's old bridge left retained on the broker, with
// that bridge's seq (its clock, here an hour ahead of the new bridge's),
// do not come back as the device's once it has moved: the server takes
// the retained messages in again whenever it subscribes anew (Mosquitto
// restarted here), and settings name no bridge. Taken, they held off every
// report of the new bridge until its clock passed the old one's
// (docs/reliability.md, bug 244). The server clears them at the move.
func TestAMovedDevicesOldSettingsDoNotComeBack(t *testing.T) {
	t.Parallel()
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m := startOnMosquitto(t, Config{}, mq)
	f, f2 := twoBridgeFleet(t, m)
	tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
	settingsTopic, statusTopic := must(tree.Settings("dev-1")), must(tree.Status("dev-1"))
	brightness := func() any {
		rep, _ := f.user.do("GET", "/api/v1/devices/dev-1/settings", nil).JSON(t)["reported"].(map[string]any)
		return rep["brightness"]
	}
	report := func(g *fleet, value int, ahead time.Duration) {
		t.Helper()
		fb := connectFakeBridge(t, mq.URL, g)
		fb.publish(settingsTopic, topics.Settings{Reported: map[string]any{"brightness": value}, Schema: sim.DefaultSchema(),
			At: time.Now(), Seq: uint64(time.Now().Add(ahead).UnixNano())}, true)
		fb.c.Disconnect(50)
		testenv.Eventually(t, 20*time.Second, fmt.Sprintf("brightness %d reported", value), func() bool { return brightness() == float64(value) })
	}
	battery := 80
	connectFakeBridge(t, mq.URL, f).publish(statusTopic, topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0",
		Model: "sim-1", Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: 1}, true)
	report(f, 10, time.Hour)
	r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	// Once the server has published dev-1's status for the move, a watcher
	// reads it first: the old settings cleared before it.
	testenv.Eventually(t, 20*time.Second, "the old bridge's settings cleared", func() bool {
		w := watchRetained(t, mq.URL, "watcher", f, settingsTopic, statusTopic)
		defer w.Disconnect(50)
		msg := w.next(t, "the retained status")
		if msg.Topic() == settingsTopic {
			return false
		}
		st, err := topics.ParseStatus(msg.Payload())
		require.NoError(t, err)
		return !st.Online
	})

	mq.Stop(t)
	mq.Start(t)
	testenv.Eventually(t, 20*time.Second, "the server back on Mosquitto", m.Broker.Ready)
	report(f2, 20, 0)
}

// A user's own bridge (a phone, a home hub) runs that user's commands
// (CONTRACT §9): the user creates it, assigns their devices to it (the
// agent already running, as a phone app would be, subscribes anew when
// they are), lists it, and deletes it, after which its devices are served
// by no bridge and its secret opens nothing. Nobody assigns another's
// device, nor to another's bridge, the operator included.
func TestUsersOwnBridge(t *testing.T) {
	t.Parallel()
	for _, tb := range tenancyBrokers {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1") // bridge-1, the operator's, serves dev-1
			registerDevices(t, f, "dev-1")
			alice := f.user
			for _, id := range []string{"phone-1", "phone-2"} {
				r := f.admin.do("POST", "/api/v1/admin/devices", map[string]any{"device_id": id, "claim_code": "CLAIM-" + id, "model": "sim-1"})
				require.Equal(t, 201, r.Status, "%s", r.Body)
				assert.Nil(t, r.JSON(t)["bridge_id"])
				f.claims[id] = "CLAIM-" + id
			}
			registerDevices(t, f, "phone-1", "phone-2")
			r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			bob := newClient(t, m, r.JSON(t)["token"].(string))
			r = f.admin.do("POST", "/api/v1/admin/devices", map[string]any{"device_id": "bobs-dev", "claim_code": "CLAIM-bob", "model": "sim-1"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "bobs-dev", "claim_code": "CLAIM-bob"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			assign := func(c *client, dev string, bridge any) response {
				t.Helper()
				return c.do("PUT", "/api/v1/devices/"+dev+"/bridge", map[string]any{"bridge_id": bridge})
			}

			// alice's hub, and bob's.
			r = alice.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alice-hub"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			hub := &fleet{bridgeID: "alice-hub", bridgeSecret: r.JSON(t)["secret"].(string)}
			require.NotEmpty(t, hub.bridgeSecret)
			r = bob.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "bob-hub"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			for _, taken := range []string{"alice-hub", f.bridgeID} {
				r = bob.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": taken})
				assert.Equal(t, 409, r.Status, "%s: %s", taken, r.Body)
				assert.Equal(t, "bridge_exists", r.JSON(t)["code"])
			}

			// A command accepted while phone-1 has no bridge waits queued;
			// the hub's agent runs already (its subscription to phone-1 is
			// refused until phone-1 is assigned to it).
			waiting := alice.accept("POST", "/api/v1/devices/phone-1/push/text", map[string]any{"text": "from the queue"})
			assert.Equal(t, "queued", waiting["state"])
			agent := startBridge(t, m, mqttURL, hub, "", "phone-1", "phone-2")
			for _, dev := range []string{"phone-1", "phone-2"} {
				r = assign(alice, dev, "alice-hub")
				require.Equal(t, 200, r.Status, "%s", r.Body)
				assert.JSONEq(t, `{"device_id":"`+dev+`","bridge_id":"alice-hub"}`, string(r.Body))
			}
			assert.Equal(t, "succeeded", alice.waitFinal("phone-1", waiting["id"].(string))["state"])
			assert.Equal(t, []string{waiting["id"].(string)}, textIDs(agent.sims["phone-1"]))
			cmd := alice.accept("POST", "/api/v1/devices/phone-2/push/text", map[string]any{"text": "direct"}, "Prefer", "wait=20")
			assert.Equal(t, "succeeded", cmd["state"], "%v", cmd)
			waitOnline(t, f, true, "phone-1", "phone-2")

			r = alice.do("GET", "/api/v1/bridges", nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			list := r.JSON(t)
			require.Len(t, list["bridges"], 1, "%s", r.Body)
			mine := list["bridges"].([]any)[0].(map[string]any)
			assert.Equal(t, "alice-hub", mine["bridge_id"])
			assert.Equal(t, []any{"phone-1", "phone-2"}, mine["devices"])
			assert.NotEmpty(t, mine["created_at"])
			assert.Nil(t, list["next_cursor"])

			// bob cannot assign alice's device, to any bridge or to none:
			// the answer is that of a device that does not exist.
			unknown := assign(bob, "no-such-device", "bob-hub")
			require.Equal(t, 404, unknown.Status, "%s", unknown.Body)
			assert.Equal(t, "device_not_found", unknown.JSON(t)["code"])
			for _, to := range []any{"bob-hub", "alice-hub", f.bridgeID, nil} {
				r := assign(bob, "phone-1", to)
				assert.Equal(t, 404, r.Status, "bob assigned phone-1 to %v: %s", to, r.Body)
				assert.JSONEq(t, string(unknown.Body), strings.ReplaceAll(string(r.Body), "phone-1", "no-such-device"))
			}
			// alice cannot assign hers to bob's bridge, nor to the
			// operator's: the answer is that of a bridge that does not exist.
			nowhere := assign(alice, "phone-1", "no-such-bridge")
			require.Equal(t, 404, nowhere.Status, "%s", nowhere.Body)
			assert.Equal(t, "bridge_not_found", nowhere.JSON(t)["code"])
			for _, to := range []string{"bob-hub", f.bridgeID} {
				r := assign(alice, "phone-1", to)
				assert.Equal(t, 404, r.Status, "alice assigned phone-1 to %s: %s", to, r.Body)
				assert.JSONEq(t, string(nowhere.Body), string(r.Body))
			}
			// Nor can the operator give alice's bridge bob's device.
			r = f.admin.do("PUT", "/api/v1/admin/devices/bobs-dev/bridge", map[string]any{"bridge_id": "alice-hub"})
			assert.Equal(t, 404, r.Status, "%s", r.Body)
			assert.Equal(t, "bridge_not_found", r.JSON(t)["code"])
			for dev, want := range map[string]string{"phone-1": "alice-hub", "bobs-dev": "", "dev-1": f.bridgeID} {
				got, err := m.DB.DeviceBridge(context.Background(), dev)
				require.NoError(t, err)
				assert.Equal(t, want, got, "the bridge of %s", dev)
			}

			// Unbinding phone-2 takes it off alice's bridge.
			r = alice.do("DELETE", "/api/v1/devices/phone-2", nil)
			require.Equal(t, 204, r.Status, "%s", r.Body)
			got, err := m.DB.DeviceBridge(context.Background(), "phone-2")
			require.NoError(t, err)
			assert.Empty(t, got, "phone-2 is still on alice's bridge after the unbind")
			mine = alice.do("GET", "/api/v1/bridges", nil).JSON(t)["bridges"].([]any)[0].(map[string]any)
			assert.Equal(t, []any{"phone-1"}, mine["devices"])

			// Deleting the hub: phone-1 is served by no bridge (a new command
			// waits queued while dev-1's, the marker, goes to the broker),
			// and the secret opens neither the broker nor the blobs.
			require.Equal(t, 404, bob.do("DELETE", "/api/v1/bridges/alice-hub", nil).Status, "bob deleted alice's bridge")
			r = alice.do("DELETE", "/api/v1/bridges/alice-hub", nil)
			require.Equal(t, 204, r.Status, "%s", r.Body)
			r = alice.do("DELETE", "/api/v1/bridges/alice-hub", nil)
			assert.Equal(t, 404, r.Status, "%s", r.Body)
			assert.Equal(t, "bridge_not_found", r.JSON(t)["code"])
			assert.JSONEq(t, `{"bridges":[],"next_cursor":null}`, string(alice.do("GET", "/api/v1/bridges", nil).Body))
			got, err = m.DB.DeviceBridge(context.Background(), "phone-1")
			require.NoError(t, err)
			assert.Empty(t, got)
			waitOnline(t, f, false, "phone-1") // the hub's connection was closed: its Will
			after := alice.accept("POST", "/api/v1/devices/phone-1/push/text", map[string]any{"text": "no bridge"})["id"].(string)
			marker := alice.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "marker"})["id"].(string)
			waitState(t, alice, "dev-1", marker, "sent")
			assert.Equal(t, "queued", commandState(t, alice, "phone-1", after))
			_, err = dialMQTT(t, mqttURL, "deleted-hub", hub.bridgeID, hub.bridgeSecret)
			assert.Error(t, err, "the deleted bridge's secret still connects")
			r = newClient(t, m, hub.bridgeSecret).do("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), nil)
			assert.Equal(t, 401, r.Status, "%s", r.Body)

			// A user's bridge cannot take another user's MQTT name (bridges
			// and users log in to the broker alike): alice still logs in.
			r = bob.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": f.userID})
			assert.Equal(t, 409, r.Status, "bob's bridge took alice's user id: %s", r.Body)
			p := mustDialMQTT(t, mqttURL, "alice-after", f.userID, alice.token)
			assert.Equal(t, byte(1), p.subscribe(t, topicsOf(t)(topics.MustNew(topics.DefaultPrefix).DeviceFilter("dev-1"))))
		})
	}
}

// The admin CLI assigns devices to bridges (CONTRACT §9): `device
// provision … --bridge B` and `device assign ID --bridge B | --none`
// against a running server, each taking effect in the server's store.
// Mistakes are usage errors; an unknown bridge or device, or a user's own
// bridge, is the API's 404 with its code.
func TestAdminCLIAssignsDevices(t *testing.T) {
	m := startServer(t, Config{})
	api := "http://" + m.HTTPAddr()
	// try runs the CLI against the server and decodes what it prints.
	try := func(args ...string) (map[string]any, error) {
		t.Helper()
		var out, errOut bytes.Buffer
		err := run(context.Background(), append(args, "--api-url", api, "--admin-token", m.AdminToken()), &out, &errOut)
		if err != nil {
			return nil, err
		}
		var v map[string]any
		require.NoError(t, json.Unmarshal(out.Bytes(), &v), "%s", out.String())
		return v, nil
	}
	cli := func(args ...string) map[string]any {
		t.Helper()
		v, err := try(args...)
		require.NoError(t, err, "companion %v", args)
		return v
	}
	bridgeOf := func(dev string) string {
		t.Helper()
		b, err := m.DB.DeviceBridge(context.Background(), dev)
		require.NoError(t, err)
		return b
	}
	cli("bridge", "create", "hub-1")
	cli("bridge", "create", "hub-2")

	got := cli("device", "provision", "watch-1", "--claim-code", "CODE-1", "--model", "sim-1", "--bridge", "hub-1")
	assert.Equal(t, map[string]any{"device_id": "watch-1", "model": "sim-1", "bridge_id": "hub-1"}, got)
	assert.Equal(t, "hub-1", bridgeOf("watch-1"))
	got = cli("device", "provision", "watch-2", "--claim-code", "CODE-2", "--model", "sim-1")
	assert.Nil(t, got["bridge_id"])
	assert.Empty(t, bridgeOf("watch-2"))

	assert.Equal(t, map[string]any{"device_id": "watch-1", "bridge_id": "hub-2"}, cli("device", "assign", "watch-1", "--bridge", "hub-2"))
	assert.Equal(t, "hub-2", bridgeOf("watch-1"))
	assert.Equal(t, map[string]any{"device_id": "watch-2", "bridge_id": "hub-1"}, cli("device", "assign", "--bridge", "hub-1", "watch-2"))
	assert.Equal(t, "hub-1", bridgeOf("watch-2"))
	assert.Equal(t, map[string]any{"device_id": "watch-1", "bridge_id": nil}, cli("device", "assign", "watch-1", "--none"))
	assert.Empty(t, bridgeOf("watch-1"))

	// A user's own bridge serves only that user's devices: the operator
	// cannot put a device of the registry on it.
	u := cli("user", "create", "carol")
	carol := newClient(t, m, u["token"].(string))
	r := carol.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "carols-phone"})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	for _, tc := range []struct {
		args []string
		want string // in the error; "" for a usage error
	}{
		{[]string{"device", "assign", "watch-1"}, ""},
		{[]string{"device", "assign", "watch-1", "--bridge", "hub-1", "--none"}, ""},
		{[]string{"device", "assign", "--bridge", "hub-1"}, ""},
		{[]string{"device", "assign", "watch-1", "--bridge", "no-such-hub"}, "404 bridge_not_found"},
		{[]string{"device", "assign", "no-such-watch", "--bridge", "hub-1"}, "404 device_not_found"},
		{[]string{"device", "assign", "watch-1", "--bridge", "carols-phone"}, "404 bridge_not_found"},
		{[]string{"device", "provision", "watch-3", "--claim-code", "C", "--model", "sim-1", "--bridge", "no-such-hub"}, "404 bridge_not_found"},
		{[]string{"device", "provision", "watch-3", "--claim-code", "C", "--model", "sim-1", "--bridge", "carols-phone"}, "404 bridge_not_found"},
		{[]string{"device", "provision", "watch-4", "--claim-code", "C", "--model", "sim-1", "--bridge", "bad id"}, "422 validation_failed"},
	} {
		_, err := try(tc.args...)
		if tc.want == "" {
			var ue usageError
			assert.ErrorAs(t, err, &ue, "companion %v", tc.args)
		} else {
			assert.ErrorContains(t, err, tc.want, "companion %v", tc.args)
		}
	}
	assert.Equal(t, "hub-1", bridgeOf("watch-2"), "a refused assignment changed nothing")
	_, err := m.DB.RegistryDevice(context.Background(), "watch-3")
	assert.ErrorIs(t, err, companion.ErrNotFound, "a device provisioned onto a bridge it may not have")
}

// TestUnbindEndsThePreviousOwnersCommands: what a user asked of a device
// and it has not done ends with the binding. Alice's text, waiting for a
// bridge, is canceled when she unbinds the device (her event stream says
// so), and never shows on the device once Bob registers it and its bridge
// comes up: Bob's own text is all the device shows.
func TestUnbindEndsThePreviousOwnersCommands(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	events := sseOpen(t, f.user, "")
	alices := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "alice's private note"})
	r := f.user.do("DELETE", "/api/v1/devices/dev-1", nil)
	require.Equal(t, 204, r.Status, "%s", r.Body)
	evs := events.until(sseFinalOf(alices["id"].(string)))
	last := evs[len(evs)-1].data
	assert.Equal(t, companion.StateCanceled, last["state"], "alice's command after the unbind: %v", last)
	if e, ok := last["error"].(map[string]any); assert.True(t, ok, "error: %v", last) {
		assert.Equal(t, companion.CodeDeviceUnbound, e["code"])
	}

	r = f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bob := newClient(t, m, r.JSON(t)["token"].(string))
	r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	b := startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	// A device runs its commands in the order they were accepted: once
	// Bob's is done, Alice's older one would have run before it.
	bobs := bob.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "bob's note"})
	assert.Equal(t, companion.StateSucceeded, bob.waitFinal("dev-1", bobs["id"].(string))["state"])
	var shown []string
	for _, tx := range b.sims["dev-1"].Texts() {
		shown = append(shown, tx.Text)
	}
	assert.Equal(t, []string{"bob's note"}, shown, "texts the device showed")
	r = bob.do("GET", "/api/v1/devices/dev-1/commands", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Len(t, r.JSON(t)["commands"], 1, "bob's commands: his own only: %s", r.Body)
}
