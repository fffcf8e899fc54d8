package agent_test

import (
	"fmt"
	"sync"
	"testing"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// loseOnline is a mochi hook that loses the first "online" of a bridge as
// a network failure between the PUBLISH and its PUBACK would: no PUBACK,
// and the connection cut. It notes the packet id that "online" held, and
// every packet id the bridge's client publishes with afterwards (repeats
// with DUP left out).
type loseOnline struct {
	mochi.HookBase
	client, stateTopic string

	mu   sync.Mutex
	lost uint16          // the packet id of the lost "online"; 0 until then
	used map[uint16]bool // packet ids of the bridge's PUBLISHes since
}

func (h *loseOnline) ID() string { return "lose-online" }

func (h *loseOnline) Provides(b byte) bool { return b == mochi.OnPublish }

func (h *loseOnline) OnPublish(cl *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	if cl.ID != h.client || pk.FixedHeader.Qos == 0 || pk.FixedHeader.Dup {
		return pk, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lost == 0 && pk.TopicName == h.stateTopic && string(pk.Payload) == topics.BridgeOnline {
		h.lost = pk.PacketID
		cl.Net.Conn.Close()
		return pk, packets.ErrRejectPacket // no PUBACK
	}
	if h.lost != 0 {
		h.used[pk.PacketID] = true
	}
	return pk, nil
}

// A state message dropped from the session store on reconnect (what
// pahostore.Store.NotResent did) kept its packet id taken in paho for good:
// paho frees an id only on its acknowledgement, or on a Disconnect, and
// resume claims again only the ids of what the store hands it. Every
// "online" lost with its connection before its PUBACK took one of the
// 65,535 ids, and past the last one the bridge could publish nothing (paho:
// "no message IDs available"). Here the bridge's client goes once round
// all the ids after the loss: the lost one must come round again.
func TestLostOnlineFreesItsPacketID(t *testing.T) {
	stateTopic, _ := tree.BridgeState("b1")
	lose := &loseOnline{client: "companion-bridge-b1", stateTopic: stateTopic, used: map[uint16]bool{}}
	hook, pubs := new(allowHook), newPublishCounter()
	// lose before pubs: the lost "online" is not counted, so startBridge
	// returns once the bridge is online on its second connection.
	srv, url := mochitest.Start(t, hook, lose, pubs)
	b := &testBroker{srv: srv, url: url, hook: hook, pubs: pubs}
	w := newWatcher(t, b)
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}})
	lose.mu.Lock()
	lost := lose.lost
	lose.mu.Unlock()
	if lost == 0 {
		t.Fatal("no online was lost")
	}

	c := br.MQTTClient()
	const window = 4096 // publishes in flight at once, well below the 65,535 ids
	for sent := 0; sent < 1<<16; {
		toks := make([]mqtt.Token, 0, window)
		for range window {
			toks = append(toks, c.Publish("test/ids", 1, false, fmt.Sprint(sent)))
			sent++
		}
		for _, tok := range toks {
			if err := mqtt.WaitTokenTimeout(tok, waitLong); err != nil {
				t.Fatalf("publish %d: %v", sent, err)
			}
		}
	}
	lose.mu.Lock()
	defer lose.mu.Unlock()
	if !lose.used[lost] {
		t.Errorf("packet id %d of the lost online never used again in %d publishes (%d ids used)", lost, 1<<16, len(lose.used))
	}
}
