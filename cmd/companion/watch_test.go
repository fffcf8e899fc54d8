package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/asyncapitest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// userWatch is a user's MQTT client as README's "Watching the MQTT
// traffic" has it: logged in with the user's id and API token, every
// message it receives kept with its flags.
type userWatch struct {
	mu   sync.Mutex
	msgs []watchedMsg
	c    mqtt.Client
}

type watchedMsg struct {
	topic    string
	payload  []byte
	retained bool
	qos      byte
}

func (w *userWatch) add(_ mqtt.Client, m mqtt.Message) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, watchedMsg{m.Topic(), append([]byte(nil), m.Payload()...), m.Retained(), m.Qos()})
}

func (w *userWatch) all() []watchedMsg {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.msgs)
}

// seen reports whether a message on topic whose payload holds substr (any
// payload, the empty one too, for "") has arrived.
func (w *userWatch) seen(topic, substr string) bool {
	for _, m := range w.all() {
		if m.topic == topic && (strings.Contains(string(m.payload), substr) || substr == "" && len(m.payload) == 0) {
			return true
		}
	}
	return false
}

// count is how many messages on topic have arrived.
func (w *userWatch) count(topic string) int {
	n := 0
	for _, m := range w.all() {
		if m.topic == topic {
			n++
		}
	}
	return n
}

// watchAsUser connects clientID with f's user's credentials to one node of
// mqttURL and subscribes it to each filter at QoS 1; it returns the SUBACK
// code of each filter (1 granted, 0x80 refused).
func watchAsUser(t *testing.T, mqttURL, clientID string, f *fleet, filters ...string) (*userWatch, []byte) {
	t.Helper()
	node, _, _ := strings.Cut(mqttURL, ",")
	w := &userWatch{}
	w.c = mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(node).
		SetClientID(clientID).
		SetUsername(f.userID).
		SetPassword(f.user.token).
		SetCleanSession(true).
		SetProtocolVersion(4).
		SetAutoReconnect(false).
		SetOrderMatters(true).
		SetDefaultPublishHandler(w.add))
	require.NoError(t, mqtt.WaitTokenTimeout(w.c.Connect(), 15*time.Second))
	t.Cleanup(func() { w.c.Disconnect(50) })
	var codes []byte
	for _, filter := range filters {
		tok := w.c.Subscribe(filter, 1, nil)
		require.NoError(t, mqtt.WaitTokenTimeout(tok, 15*time.Second), filter)
		codes = append(codes, tok.(*mqtt.SubscribeToken).Result()[filter])
	}
	return w, codes
}

// signature names what matters of a message for comparing brokers: its
// topic below the device, the flags, the payload's top-level fields and,
// for a status or a reply, the values a watcher reads off it.
func signature(dev string, m watchedMsg) string {
	rest := strings.TrimPrefix(m.topic, topics.DefaultPrefix+"/devices/"+dev+"/")
	head := fmt.Sprintf("%s retain=%v qos=%d", rest, m.retained, m.qos)
	if len(m.payload) == 0 {
		return head + " (empty)"
	}
	var v map[string]any
	if err := json.Unmarshal(m.payload, &v); err != nil {
		return head + " (not JSON)"
	}
	keys := make([]string, 0, len(v))
	for k := range v {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	s := head + " " + strings.Join(keys, ",")
	switch rest {
	case "status":
		s += fmt.Sprintf(" online=%v bridge=%q fw=%v", v["online"], v["bridge_id"], v["firmware_version"])
	case "replies":
		s += fmt.Sprintf(" state=%v", v["state"])
	}
	return s
}

func signatures(dev string, msgs []watchedMsg) []string {
	set := map[string]bool{}
	for _, m := range msgs {
		set[signature(dev, m)] = true
	}
	out := make([]string, 0, len(set))
	for s := range set {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

// watchRun is what one broker showed the user's watchers.
type watchRun struct {
	live, lateServed, lateUnserved []string
	subacks                        []byte
}

// A developer watching their device's MQTT traffic (CONTRACT §3, README
// "Watching the MQTT traffic") logs in with their user id and API token and
// subscribes to companion/v1/devices/DEV/#. On each of the three brokers the
// server runs on, the real server and bridge run every operation of the
// spec on the device, a cancel of a command sent while no bridge ran, a
// move to the user's own bridge and that bridge's deletion, then the
// unbinding; another user's device runs commands all along. Every message
// the watcher receives is checked against docs/asyncapi.yaml (its topic,
// payload and retain flag), at QoS 1, and live messages without the retain
// flag (MQTT 3.1.1 §3.3.1.3); a later subscriber gets the retained status
// and settings and nothing else; none of the other user's device reaches
// any of the user's filters, and one ending in "+/#" reads what "#" does
// (docs/reliability.md, bug 345). What each broker delivered is compared: a
// message one broker delivers and another does not, or with other flags,
// fails the test.
func TestAUserWatchesTheirDeviceAlikeOnEveryBroker(t *testing.T) {
	t.Parallel()
	doc := asyncapitest.Load(t)
	runs := map[string]watchRun{}
	brokers := withNATS()
	for _, tb := range brokers {
		assert.Contains(t, doc.Servers(), tb.name, "a broker the server runs on, among the servers of %s", asyncapitest.Path)
	}
	for _, tb := range brokers {
		ok := t.Run(tb.name, func(t *testing.T) {
			runs[tb.name] = watchEveryOperation(t, doc, tb)
		})
		if !ok {
			return
		}
	}
	first := ""
	for _, tb := range brokers {
		if _, ran := runs[tb.name]; !ran { // not among -run's
			continue
		}
		if first == "" {
			first = tb.name
			continue
		}
		got, want := runs[tb.name], runs[first]
		assert.Equal(t, want.subacks, got.subacks, "SUBACK codes of the user's filters: %s against %s", tb.name, first)
		assert.Equal(t, want.live, got.live, "what the watcher received live: %s against %s", tb.name, first)
		assert.Equal(t, want.lateServed, got.lateServed, "what a later subscriber received (device on its bridge): %s against %s", tb.name, first)
		assert.Equal(t, want.lateUnserved, got.lateUnserved, "what a later subscriber received (device on no bridge): %s against %s", tb.name, first)
	}
}

// watchEveryOperation is TestAUserWatchesTheirDeviceAlikeOnEveryBroker on
// one broker: it checks what holds on each, and returns what is compared.
func watchEveryOperation(t *testing.T, doc *asyncapitest.Doc, tb tenancyBroker) watchRun {
	m, mqttURL := tb.start(t)
	tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
	f := setupFleet(t, m, "dev-1", "dev-2")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"], "name": "Kitchen"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bob, bobID := newClient(t, m, r.JSON(t)["token"].(string)), r.JSON(t)["user_id"].(string)
	r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	var run watchRun
	w, codes := watchAsUser(t, mqttURL, "alice-watch", f, tree.Prefix()+"/devices/dev-1/#")
	require.Equal(t, []byte{1}, codes, "the user's own device")
	// The same with a filter ending in "+/#", which matches the device's
	// status, settings and replies too ("#" standing for no level).
	plus, codes := watchAsUser(t, mqttURL, "alice-plus", f, tree.Prefix()+"/devices/dev-1/+/#")
	require.Equal(t, []byte{1}, codes, "the user's own device, +/#")
	// Filters that name bob's device, or any device: refused or granted,
	// nothing of dev-2 may come through them.
	nosy, codes := watchAsUser(t, mqttURL, "alice-nosy", f,
		tree.Prefix()+"/devices/dev-2/#", tree.Prefix()+"/devices/+/status", tree.Prefix()+"/#")
	run.subacks = codes

	b := startBridge(t, m, mqttURL, f, "", "dev-1", "dev-2")
	exerciseRegistered(t, f, b, "dev-1")
	bobs := bob.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "bob's"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", bobs["state"], "%v", bobs)

	statusTopic, settingsTopic := must(tree.Status("dev-1")), must(tree.Settings("dev-1"))
	testenv.Eventually(t, 20*time.Second, "dev-1's settings", func() bool { return w.seen(settingsTopic, "reported") })
	late, _ := watchAsUser(t, mqttURL, "alice-late-1", f, tree.Prefix()+"/devices/dev-1/#")
	testenv.Eventually(t, 20*time.Second, "the retained status and settings", func() bool {
		return late.count(statusTopic) > 0 && late.count(settingsTopic) > 0
	})
	// What a later subscriber reads first is the retained status and
	// settings, as the API reads them (a live report may follow).
	var first []watchedMsg
	for _, msg := range late.all() {
		first = append(first, msg)
		if slices.ContainsFunc(first, func(m watchedMsg) bool { return m.topic == statusTopic }) &&
			slices.ContainsFunc(first, func(m watchedMsg) bool { return m.topic == settingsTopic }) {
			break
		}
	}
	run.lateServed = signatures("dev-1", first)
	for _, msg := range first {
		if !msg.retained || msg.topic != statusTopic && msg.topic != settingsTopic {
			t.Errorf("a later subscriber's first messages are the retained status and settings; got %s retained=%v: %s", msg.topic, msg.retained, msg.payload)
		}
		switch msg.topic {
		case statusTopic:
			var st topics.Status
			require.NoError(t, json.Unmarshal(msg.payload, &st))
			api := f.user.do("GET", "/api/v1/devices/dev-1/status", nil).JSON(t)
			assert.Equal(t, api["firmware_version"], st.FirmwareVersion, "the retained status's firmware")
			assert.Equal(t, api["online"], st.Online, "the retained status's online")
			apps := f.user.do("GET", "/api/v1/devices/dev-1/apps", nil).JSON(t)["apps"].([]any)
			assert.Len(t, st.Apps, len(apps), "the retained status's apps: %s", msg.payload)
		case settingsTopic:
			var set struct {
				Reported map[string]any `json:"reported"`
			}
			require.NoError(t, json.Unmarshal(msg.payload, &set))
			api := f.user.do("GET", "/api/v1/devices/dev-1/settings", nil).JSON(t)
			assert.Equal(t, api["reported"], set.Reported, "the retained settings")
		}
	}

	// dev-1 moves to the user's own bridge: its settings, the old bridge's,
	// are cleared; the new bridge reports its own.
	r = f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alice-hub"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	hub := *f
	hub.bridgeID, hub.bridgeSecret = "alice-hub", r.JSON(t)["secret"].(string)
	r = f.user.do("PUT", "/api/v1/devices/dev-1/bridge", map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "dev-1's settings cleared", func() bool { return w.seen(settingsTopic, "") })
	// A command sent while the hub does not run yet, then canceled: the
	// server withdraws it with a command.cancel.
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "never shown"})
	id := cmd["id"].(string)
	testenv.Eventually(t, 20*time.Second, "the command on its topic", func() bool { return w.seen(must(tree.Command("dev-1", topics.OpPushText)), id) })
	r = f.user.do("DELETE", "/api/v1/devices/dev-1/commands/"+id, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "the cancel on its topic", func() bool { return w.seen(must(tree.Command("dev-1", topics.OpCancel)), id) })
	startBridge(t, m, mqttURL, &hub, "", "dev-1")
	testenv.Eventually(t, 20*time.Second, "dev-1 online on alice-hub", func() bool { return w.seen(statusTopic, `"bridge_id":"alice-hub"`) })
	cmd = f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "through the hub"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
	testenv.Eventually(t, 20*time.Second, "the hub's settings", func() bool {
		all := w.all()
		for i := len(all) - 1; i >= 0; i-- {
			if all[i].topic == settingsTopic {
				return len(all[i].payload) > 0
			}
		}
		return false
	})

	// The hub deleted: dev-1 is served by no bridge and reads offline.
	settingsSeen := w.count(settingsTopic)
	r = f.user.do("DELETE", "/api/v1/bridges/alice-hub", nil)
	require.Equal(t, 204, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "dev-1's settings cleared again", func() bool {
		all := w.all()
		n := 0
		for _, m := range all {
			if m.topic == settingsTopic {
				n++
				if n > settingsSeen && len(m.payload) == 0 {
					return true
				}
			}
		}
		return false
	})
	testenv.Eventually(t, 20*time.Second, "dev-1 offline on no bridge", func() bool { return w.seen(statusTopic, `"online":false,`) && w.seen(statusTopic, `"bridge_id":""`) })
	// A second subscription on the same connection: its retained status
	// comes after every retained message of the first.
	late2, _ := watchAsUser(t, mqttURL, "alice-late-2", f, tree.Prefix()+"/devices/dev-1/#", statusTopic)
	testenv.Eventually(t, 20*time.Second, "the retained status of both filters", func() bool { return late2.count(statusTopic) >= 2 })
	var snapshot []watchedMsg
	for _, m := range late2.all() {
		snapshot = append(snapshot, m)
		if m.topic == statusTopic {
			break
		}
	}
	for _, m := range late2.all()[len(snapshot):] {
		if m.topic != statusTopic {
			snapshot = append(snapshot, m)
			continue
		}
		break
	}
	run.lateUnserved = signatures("dev-1", snapshot)

	// Unbound: the user's watchers read nothing of dev-1 from then on,
	// though bob registers it, it goes back to bridge-1 and runs bob's
	// command, which bob's watcher sees.
	before := map[*userWatch]int{w: len(w.all()), plus: len(plus.all()), late: len(late.all()), late2: len(late2.all()), nosy: len(nosy.all())}
	r = f.user.do("DELETE", "/api/v1/devices/dev-1", nil)
	require.Equal(t, 204, r.Status, "%s", r.Body)
	r = bob.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bobF := *f
	bobF.user, bobF.userID = bob, bobID
	bobW, codes := watchAsUser(t, mqttURL, "bob-watch", &bobF, tree.Prefix()+"/devices/dev-1/#")
	require.Equal(t, []byte{1}, codes, "bob's device")
	_, codes = watchAsUser(t, mqttURL, "alice-after", f, tree.Prefix()+"/devices/dev-1/#")
	assert.Equal(t, []byte{0x80}, codes, "alice's filter on the device she unbound")
	r = f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f.bridgeID})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	cmd = bob.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "bob's now"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
	testenv.Eventually(t, 20*time.Second, "bob's reply", func() bool { return bobW.seen(must(tree.Replies("dev-1")), cmd["id"].(string)) })
	testenv.Eventually(t, 20*time.Second, "dev-1 online for bob", func() bool { return bobW.seen(statusTopic, `"online":true`) })
	for ww, n := range before {
		for _, msg := range ww.all()[n:] {
			t.Errorf("a message of dev-1 after alice unbound it: %s %s", msg.topic, msg.payload)
		}
	}

	for _, c := range []struct {
		name string
		w    *userWatch
	}{{"watcher", w}, {"watcher on +/#", plus}, {"late watcher", late}, {"late watcher after the hub", late2}, {"nosy watcher", nosy}} {
		for _, msg := range c.w.all() {
			if !strings.HasPrefix(msg.topic, tree.Prefix()+"/devices/dev-1/") {
				t.Errorf("%s: a message on %s, not of the user's device: %s", c.name, msg.topic, msg.payload)
				continue
			}
			if _, err := doc.Validate(msg.topic, msg.payload, msg.retained); err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			if msg.qos != 1 {
				t.Errorf("%s: %s at QoS %d, not 1", c.name, msg.topic, msg.qos)
			}
		}
	}
	for _, msg := range w.all() {
		if msg.retained {
			t.Errorf("a live message with the retain flag: %s %q", msg.topic, msg.payload)
		}
	}
	run.live = signatures("dev-1", w.all())
	assert.Equal(t, run.live, signatures("dev-1", plus.all()), "what the watcher on devices/dev-1/+/# received, against devices/dev-1/#")
	t.Logf("live:\n%s", strings.Join(run.live, "\n"))
	t.Logf("late (served):\n%s", strings.Join(run.lateServed, "\n"))
	t.Logf("late (unserved):\n%s", strings.Join(run.lateUnserved, "\n"))
	t.Logf("subacks of the nosy filters: %v", run.subacks)
	return run
}

// A reply is never retained (CONTRACT §3). A user's own bridge may publish
// one retained all the same, on a device it serves: the embedded broker
// hands it on unretained (bug 297), but Mosquitto and NATS keep it, and
// their rights cannot refuse the flag. When the device leaves that bridge
// (its user unbinds it, or moves it), the server clears the device's
// replies topic, as it clears its settings: the device's next owner's
// watcher never reads a reply that bridge made up (docs/reliability.md,
// bug 347). On each broker.
func TestAReplyABridgeRetainedDoesNotReachTheNextOwner(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			f := setupFleet(t, m)
			r := f.admin.do("POST", "/api/v1/admin/devices", map[string]any{"device_id": "dev-9", "claim_code": "CLAIM-dev-9-XXXXXXXX", "model": "sim-1"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			f.claims["dev-9"] = "CLAIM-dev-9-XXXXXXXX"
			registerDevices(t, f, "dev-9")
			r = f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alice-hub"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			hub := *f
			hub.bridgeID, hub.bridgeSecret = "alice-hub", r.JSON(t)["secret"].(string)
			r = f.user.do("PUT", "/api/v1/devices/dev-9/bridge", map[string]any{"bridge_id": "alice-hub"})
			require.Equal(t, 200, r.Status, "%s", r.Body)

			node, _, _ := strings.Cut(mqttURL, ",")
			fb := connectFakeBridge(t, node, &hub)
			replies := must(tree.Replies("dev-9"))
			planted := topics.Reply{CommandID: "01a22e85-0000-7000-8000-000000000001", State: "succeeded", At: time.Now().UTC()}
			fb.publish(replies, planted, true)
			battery := 90
			fb.publish(must(tree.Status("dev-9")), topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: "sim-1",
				Apps: []companion.App{}, BridgeID: "alice-hub", At: time.Now().UTC(), Seq: uint64(time.Now().UnixNano())}, true)
			waitOnline(t, f, true, "dev-9")

			r = f.user.do("DELETE", "/api/v1/devices/dev-9", nil)
			require.Equal(t, 204, r.Status, "%s", r.Body)
			r = f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			bob := *f
			bob.user, bob.userID = newClient(t, m, r.JSON(t)["token"].(string)), r.JSON(t)["user_id"].(string)
			r = bob.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-9", "claim_code": f.claims["dev-9"]})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			// bob's subscription to the replies, then to the status, which
			// the server published as dev-9 left alice-hub: the status
			// arrives after whatever the replies' subscription brought.
			w, codes := watchAsUser(t, mqttURL, "bob-watch", &bob, replies, must(tree.Status("dev-9")))
			require.Equal(t, []byte{1, 1}, codes)
			testenv.Eventually(t, 20*time.Second, "dev-9's retained status", func() bool { return w.count(must(tree.Status("dev-9"))) > 0 })
			for _, msg := range w.all() {
				if msg.topic == replies {
					t.Errorf("bob read a reply alice's bridge made up: %s retained=%v", msg.payload, msg.retained)
				}
			}
		})
	}
}

// A developer watching one of their devices who registers another is not
// cut off for it (docs/reliability.md, bug 349). A register only adds
// rights: on the embedded broker the store is asked at every subscription,
// and on NATS the watcher keeps the rights of its login, the new device's
// coming with its next. Mosquitto's plugin closes the clients of a role
// whose ACLs change, whatever the change (docs/mosquitto.md): there the
// watcher is cut, and logs in again with both devices. On each broker, a
// login made after the register reads the new device.
func TestAWatcherIsNotCutAsTheUserRegistersAnotherDevice(t *testing.T) {
	t.Parallel()
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
			f := setupFleet(t, m, "dev-1", "dev-2")
			registerDevices(t, f, "dev-1")
			w, codes := watchAsUser(t, mqttURL, "alice-watch", f, tree.Prefix()+"/devices/dev-1/#")
			require.Equal(t, []byte{1}, codes)
			registerDevices(t, f, "dev-2")
			// The server publishes a command of dev-1 (no bridge runs):
			// the watcher reads it if it is still connected.
			cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "after the register"})
			topic := must(tree.Command("dev-1", topics.OpPushText))
			if tb.name == "mosquitto" {
				testenv.Eventually(t, 20*time.Second, "the watcher cut by Mosquitto's plugin", func() bool { return !w.c.IsConnectionOpen() })
			} else {
				testenv.Eventually(t, 20*time.Second, "the command, read by the watcher", func() bool { return w.seen(topic, cmd["id"].(string)) })
				assert.True(t, w.c.IsConnectionOpen(), "the watcher of dev-1 is connected still")
			}
			_, codes = watchAsUser(t, mqttURL, "alice-later", f, tree.Prefix()+"/devices/dev-2/#")
			assert.Equal(t, []byte{1}, codes, "a login after the register, on the new device")
		})
	}
}

// Every topic README's "Watching the MQTT traffic" lists in its table is
// one a user may subscribe to, on each broker: their own device's, and
// their own bridge's for a topic of bridges. A user reads only the topics
// of their devices (CONTRACT §3); the table listed the bridges' state
// topic, which no user may read, not even of their own bridge
// (docs/reliability.md, bug 350).
func TestAUserMaySubscribeToEveryTopicTheWatchingTableLists(t *testing.T) {
	t.Parallel()
	section := readmeParagraph(t, "| topic | from → to | retained |")
	var filters []string
	for _, line := range strings.Split(section, "\n")[2:] {
		cells := strings.Split(line, "|")
		require.Greater(t, len(cells), 2, "a row of the table: %s", line)
		topic := strings.Trim(strings.TrimSpace(cells[1]), "`")
		topic = strings.NewReplacer("{op}", "push.text").Replace(topic)
		if strings.Contains(topic, "/bridges/") {
			topic = strings.ReplaceAll(topic, "{id}", "alice-hub")
		} else {
			topic = strings.ReplaceAll(topic, "{id}", "dev-1")
		}
		filters = append(filters, topic)
	}
	require.NotEmpty(t, filters)
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alice-hub"})
			require.Equal(t, 201, r.Status, "%s", r.Body)
			for _, filter := range filters {
				_, codes := watchAsUser(t, mqttURL, "alice-"+strings.NewReplacer("/", "-", ".", "-").Replace(filter), f, filter)
				assert.Equal(t, []byte{1}, codes, "the user's SUBACK for %s, which README's watching table lists", filter)
			}
		})
	}
}

// A user's filters that name their device but match none of its topics,
// `devices/DEV` and `devices/DEV/x1`, are refused by the embedded broker,
// whose hook holds a watcher to filters of the device's topics, and
// granted by Mosquitto and NATS, whose rights cannot tell them from
// `devices/DEV/#` (NATS subscribes a "#" filter's parent too). Either way
// nothing reaches them, as the device runs a command. docs/security.md
// says so, with a column for each broker (docs/reliability.md, bug 351).
func TestAUsersFiltersThatMatchNoTopicOfTheirDevice(t *testing.T) {
	t.Parallel()
	want := map[string][]byte{"embedded": {0x80, 0x80}, "mosquitto": {1, 1}, "nats": {1, 1}}
	for _, tb := range withNATS() {
		t.Run(tb.name, func(t *testing.T) {
			m, mqttURL := tb.start(t)
			tree := topics.MustNew(topics.DefaultPrefix)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			w, codes := watchAsUser(t, mqttURL, "alice-odd", f, tree.Prefix()+"/devices/dev-1", tree.Prefix()+"/devices/dev-1/x1")
			assert.Equal(t, want[tb.name], codes, "SUBACK codes of devices/dev-1 and devices/dev-1/x1")
			all, _ := watchAsUser(t, mqttURL, "alice-all", f, tree.Prefix()+"/devices/dev-1/#")
			startBridge(t, m, mqttURL, f, "", "dev-1")
			cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hi"}, "Prefer", "wait=30")
			require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
			testenv.Eventually(t, 20*time.Second, "the reply, on devices/dev-1/#", func() bool {
				return all.seen(tree.Prefix()+"/devices/dev-1/replies", cmd["id"].(string))
			})
			for _, msg := range w.all() {
				t.Errorf("a message on a filter that matches no topic of the device: %s %s", msg.topic, msg.payload)
			}
		})
	}
}

// docs/security.md's table of the broker's door has a column for each
// broker the server runs on, the servers of docs/asyncapi.yaml: it had
// none for NATS (docs/reliability.md, bug 351).
func TestTheBrokerDoorTableHasAColumnForEveryBroker(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "security.md"))
	require.NoError(t, err)
	_, door, ok := strings.Cut(string(b), "## The broker's door\n")
	require.True(t, ok, "docs/security.md has a section \"The broker's door\"")
	header, _, _ := strings.Cut(strings.TrimLeft(door, "\n"), "\n")
	require.True(t, strings.HasPrefix(header, "| who |"), "the section opens with its table: %s", header)
	cells := strings.Split(strings.ToLower(header), "|")
	for _, server := range asyncapitest.Load(t).Servers() {
		assert.True(t, slices.ContainsFunc(cells, func(c string) bool { return strings.Contains(c, strings.ToLower(server)) }),
			"a column for %s in the door table's header: %s", server, header)
	}
}
