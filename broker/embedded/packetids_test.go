package embedded

import (
	"io"
	"log/slog"
	"testing"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// BenchmarkIncomingPublishOverABacklog measures what the packet-id hook
// costs each QoS 1 PUBLISH a bridge sends (a reply) while the server has
// 10,000 messages in flight to it, on the ids mochi handed out from 1 on:
// a bridge back to a backlog, whose own ids meet them. It moves every such
// publish to a free id.
func BenchmarkIncomingPublishOverABacklog(b *testing.B) {
	const backlog = 10000
	m := mqtt.New(&mqtt.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	cl := m.NewClient(nil, "t", "companion-bridge-b1", false)
	h := &packetIDHook{log: m.Log, clients: m.Clients, lastOut: map[string]uint16{}, moved: map[*mqtt.Client]movedID{}}
	for id := uint16(1); id <= backlog; id++ {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: id}
		cl.State.Inflight.Set(pk)
		h.OnQosPublish(cl, pk, 0, 0)
	}
	b.ResetTimer()
	for i := range b.N {
		in := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: uint16(i%backlog) + 1}
		out, err := h.OnPacketRead(cl, in)
		if err != nil || out.PacketID == in.PacketID {
			b.Fatalf("publish on id %d not moved: %d, %v", in.PacketID, out.PacketID, err)
		}
		if _, used := cl.State.Inflight.Get(out.PacketID); used {
			b.Fatalf("publish moved to id %d, in use", out.PacketID)
		}
		h.OnPacketProcessed(cl, out, nil)
	}
}
