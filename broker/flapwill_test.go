package broker

import (
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"
)

// A bridge's Will set every device of the bridge offline in the store and
// republished its status, retained, also of a device offline already: one
// the bridge had itself reported offline (out of its radio's range), or
// every one at a second Will before the bridge reported again (a bridge
// whose link flaps). A gateway with two hundred wearables, most of them
// away at night, had two hundred statuses rewritten and published at each
// flap, each heard by whoever watched the device, none saying anything
// new. Only the devices the Will takes offline are written and
// published (bug 456).
func TestAWillRepublishesNoDeviceOfflineAlready(t *testing.T) {
	e := newEnv(t, true)
	fb := connectBridge(t, e)
	at := time.Now().UTC().Truncate(time.Millisecond)
	away := topics.Status{Online: false, BridgeID: "b1", Seq: 1, At: at, Apps: []companion.App{}}
	here := topics.Status{Online: true, BridgeID: "b1", Seq: 1, At: at, Apps: []companion.App{}}
	fb.retainStatus(t, e, "dev-1", away) // reported offline by its bridge
	fb.retainStatus(t, e, "dev-2", here)

	type heard struct {
		dev string
		s   topics.Status
	}
	ch := make(chan heard, 100)
	w := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + e.mqtt.Addr()).SetClientID("watcher-" + uuid.NewString()).
		SetUsername("server").SetPassword("pw"))
	require.NoError(t, mqtt.WaitTokenTimeout(w.Connect(), 5*time.Second))
	t.Cleanup(func() { w.Disconnect(0) })
	require.NoError(t, mqtt.WaitTokenTimeout(w.Subscribe(tree.Prefix()+"/devices/+/status", 1, func(_ mqtt.Client, m mqtt.Message) {
		if s, err := topics.ParseStatus(m.Payload()); err == nil {
			tp, _ := tree.Parse(m.Topic())
			ch <- heard{tp.DeviceID, s}
		}
	}), 5*time.Second))
	next := func() heard {
		t.Helper()
		select {
		case h := <-ch:
			return h
		case <-time.After(10 * time.Second):
			t.Fatal("no status heard")
			return heard{}
		}
	}
	for range 2 { // the retained ones
		next()
	}

	state, _ := tree.BridgeState("b1")
	require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(state, 1, true, topics.BridgeOffline), 5*time.Second))
	// The Will's statuses go out in device order: dev-1's, had it one,
	// comes before dev-2's.
	var before []string
	for {
		h := next()
		if h.dev == "dev-2" {
			assert.False(t, h.s.Online, "dev-2 after the Will")
			break
		}
		before = append(before, h.dev)
	}
	assert.Empty(t, before, "statuses published for devices offline before the Will")
}
