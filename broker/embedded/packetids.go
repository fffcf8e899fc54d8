package embedded

import (
	"log/slog"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// packetIDHook protects queued messages from a packet id clash: mochi keeps
// a client's incoming QoS acks and its outgoing messages in one map keyed
// by packet id, and an incoming QoS 1 PUBLISH deletes an outgoing message
// that happens to have the same id. A bridge both receives and sends QoS
// 1, so without this a command awaiting its PUBACK could vanish and never
// be resent after a disconnect. The hook moves such a publish to a free
// packet id while mochi handles it.
type packetIDHook struct {
	mqtt.HookBase

	log     *slog.Logger
	clients *mqtt.Clients

	mu      sync.Mutex
	lastOut map[string]uint16        // client id → packet id of the last message queued for it
	moved   map[*mqtt.Client]movedID // incoming packet moved to a free packet id
}

// movedID is an incoming packet's id and the one it was given.
type movedID struct{ temp, orig uint16 }

// ID names the hook in mochi's log.
func (h *packetIDHook) ID() string { return "companion-packet-ids" }

// Provides lists the events the hook handles.
func (h *packetIDHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnQosPublish, mqtt.OnPacketRead, mqtt.OnPacketEncode, mqtt.OnPacketProcessed,
		mqtt.OnDisconnect, mqtt.OnClientExpired:
		return true
	}
	return false
}

// OnQosPublish notes the packet id of each new outgoing message (a resend,
// DUP set, keeps its old one).
func (h *packetIDHook) OnQosPublish(cl *mqtt.Client, pk packets.Packet, _ int64, _ int) {
	if pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Dup {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lastOut[cl.ID] = pk.PacketID
}

// OnPacketRead moves an incoming packet off a packet id that one of the
// client's outgoing messages holds (see packetIDHook). The client picks the ids of
// what it sends and the server those of what it sends, but mochi keeps
// both in one inflight store: for a QoS 1 PUBLISH it would delete the
// outgoing message from that store, and it refuses a SUBSCRIBE or an
// UNSUBSCRIBE with 0x91, "packet identifier in use" (a bridge back on its
// persistent session, its commands on their way, subscribing while they
// are). The packet is given a free id for its trip through mochi, and
// OnPacketEncode puts the client's own id back on the acknowledgement. The
// free id is searched from half the id space away from the id mochi handed
// out last: mochi hands out the ids above it next, and those below it are
// the ones it handed out last, most of them still in flight when the
// client has a backlog. Searched downwards from that id itself, a move
// stepped over every one of them: with thousands queued for a bridge back
// from an outage (or the server's restart), each of its replies took
// thousands of look-ups under mochi's lock, and the backlog drained at a
// hundred commands a second with the server's CPU busy. Packets of one
// client are processed one at a time, so each client has at most one
// packet moved at once.
func (h *packetIDHook) OnPacketRead(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	switch t := pk.FixedHeader.Type; {
	case t == packets.Publish && pk.FixedHeader.Qos == 1:
		out, ok := cl.State.Inflight.Get(pk.PacketID)
		if !ok || (out.FixedHeader.Type != packets.Publish && out.FixedHeader.Type != packets.Pubrel) {
			return pk, nil
		}
	case t == packets.Subscribe || t == packets.Unsubscribe:
		if _, ok := cl.State.Inflight.Get(pk.PacketID); !ok {
			return pk, nil
		}
	default:
		return pk, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	far := h.lastOut[cl.ID] + 1<<15
	for i := 0; i < 1<<16; i++ {
		free := far - uint16(i)
		if free == 0 || free == pk.PacketID {
			continue
		}
		if _, used := cl.State.Inflight.Get(free); !used {
			h.moved[cl] = movedID{temp: free, orig: pk.PacketID}
			pk.PacketID = free
			return pk, nil
		}
	}
	h.log.Warn("mqtt inflight store full; an incoming packet may displace a queued message", "client_id", cl.ID)
	return pk, nil
}

// OnPacketEncode gives a moved packet's acknowledgement back its id.
func (h *packetIDHook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	switch pk.FixedHeader.Type {
	case packets.Puback, packets.Suback, packets.Unsuback:
	default:
		return pk
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if m, ok := h.moved[cl]; ok && m.temp == pk.PacketID {
		pk.PacketID = m.orig
		delete(h.moved, cl)
	}
	return pk
}

// OnPacketProcessed drops a move whose packet was not acknowledged (a
// refused publish).
func (h *packetIDHook) OnPacketProcessed(cl *mqtt.Client, pk packets.Packet, _ error) {
	switch pk.FixedHeader.Type {
	case packets.Publish, packets.Subscribe, packets.Unsubscribe:
	default:
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.moved, cl)
}

// OnDisconnect drops the client's move, and the packet id it was last
// handed when its session ends with its connection.
func (h *packetIDHook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.moved, cl)
	if expire && !cl.IsTakenOver() {
		delete(h.lastOut, cl.ID)
	}
}

// OnClientExpired forgets a persistent session mochi has given up on,
// unless a new client holds its id by now.
func (h *packetIDHook) OnClientExpired(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if cur, ok := h.clients.Get(cl.ID); !ok || cur == cl {
		delete(h.lastOut, cl.ID)
	}
}
