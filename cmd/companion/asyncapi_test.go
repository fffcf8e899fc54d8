package main

import (
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/asyncapitest"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// watcherAccount reads the whole tree of a test Mosquitto.
var watcherAccount = mqtttest.MosquittoAccount{
	Username: "asyncapi-watcher", Password: "watcher-secret",
	ACL: []string{"topic read companion/v1/#"},
}

// wireLog is every message a watcher received, in order.
type wireLog struct {
	mu   sync.Mutex
	msgs []wireMsg
}

type wireMsg struct {
	topic    string
	payload  []byte
	retained bool
}

func (l *wireLog) add(_ mqtt.Client, m mqtt.Message) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, wireMsg{m.Topic(), append([]byte(nil), m.Payload()...), m.Retained()})
}

func (l *wireLog) all() []wireMsg {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]wireMsg(nil), l.msgs...)
}

// seen reports whether a message on topic whose payload holds substr has
// arrived.
func (l *wireLog) seen(topic, substr string) bool {
	for _, m := range l.all() {
		if m.topic == topic && strings.Contains(string(m.payload), substr) {
			return true
		}
	}
	return false
}

// docs/asyncapi.yaml describes every message that travels: the real server
// and bridge run every operation (and a cancel of a command already sent)
// on Mosquitto while a watcher subscribed to the whole tree validates each
// message against the document's schema for its topic. A topic missing
// from the document, a field a payload gains without the document
// declaring it, or a required one it loses fails the test; so does a
// channel of the document that nothing used. A device moved to another
// bridge has its retained settings cleared: that empty message is
// validated too.
func TestAsyncAPIDocumentsEveryMessage(t *testing.T) {
	doc := asyncapitest.Load(t)
	mq := mqtttest.StartMosquitto(t, serverAccount, watcherAccount)
	tree := topics.MustNew(topics.DefaultPrefix)

	var log wireLog
	watcher := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(mq.URL).
		SetClientID("asyncapi-watcher").
		SetUsername(watcherAccount.Username).
		SetPassword(watcherAccount.Password).
		SetCleanSession(true).
		SetAutoReconnect(false).
		SetOrderMatters(false).
		SetDefaultPublishHandler(log.add))
	require.NoError(t, mqtt.WaitTokenTimeout(watcher.Connect(), 10*time.Second))
	t.Cleanup(func() { watcher.Disconnect(50) })
	sub := watcher.Subscribe(tree.Prefix()+"/#", 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(sub, 10*time.Second))
	require.Equal(t, byte(1), sub.(*mqtt.SubscribeToken).Result()[tree.Prefix()+"/#"])
	// The watcher is there before the server, which probes its topics
	// as it connects (serverProbe).
	m := startOnMosquitto(t, Config{}, mq)
	f := setupFleet(t, m, "dev-1", "dev-2")

	// A command sent while no bridge runs, then canceled: the server
	// withdraws it with a command.cancel.
	registerDevices(t, f, "dev-2")
	cmd := f.user.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "never shown"})
	id := cmd["id"].(string)
	pushTopic, err := tree.Command("dev-2", topics.OpPushText)
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, "the command on its topic", func() bool { return log.seen(pushTopic, id) })
	r := f.user.do("DELETE", "/api/v1/devices/dev-2/commands/"+id, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	cancelTopic, err := tree.Command("dev-2", topics.OpCancel)
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, "the cancel on its topic", func() bool { return log.seen(cancelTopic, id) })

	b := startBridge(t, m, mq.URL, f, "", "dev-1", "dev-2")
	exerciseEveryOperation(t, f, b, "dev-1")
	// dev-2 moves to another bridge: the server clears its retained
	// settings, the old bridge's, with an empty retained message, and
	// publishes its status as the store has it, with no bridge.
	settingsTopic, err := tree.Settings("dev-2")
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, "dev-2's settings", func() bool { return log.seen(settingsTopic, "reported") })
	r = f.admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-2"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = f.admin.do("PUT", "/api/v1/admin/devices/dev-2/bridge", map[string]any{"bridge_id": "bridge-2"})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "dev-2's settings cleared", func() bool {
		for _, msg := range log.all() {
			if msg.topic == settingsTopic && len(msg.payload) == 0 {
				return true
			}
		}
		return false
	})
	b.stop()
	stateTopic, err := tree.BridgeState(f.bridgeID)
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, "the bridge's offline state", func() bool { return log.seen(stateTopic, topics.BridgeOffline) })

	used := map[string]int{}
	for _, msg := range log.all() {
		channel, err := doc.Validate(msg.topic, msg.payload, msg.retained)
		if err != nil {
			t.Error(err)
			continue
		}
		used[channel]++
	}
	for _, c := range doc.Channels() {
		if c == "devicesMoved" || c == "bridgesKicked" {
			continue // only between replicas: TestTwoReplicasShareOnePostgresStore, and the broker's TestTheWillOfABridgeDisconnectedForItsRightsIsHeld
		}
		if used[c] == 0 {
			t.Errorf("no message on channel %s of %s: every operation ran, so the document lists a topic nothing uses, or the test missed one", c, asyncapitest.Path)
		}
	}
	t.Logf("messages validated by channel: %v", used)
}
