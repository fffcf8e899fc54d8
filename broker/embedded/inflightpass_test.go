package embedded

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// BenchmarkInflightExpiryPass measures what mochi's event loop spends
// each second on one client with a backlog of commands in flight or
// queued for it (a bridge away): ClearExpiredInflights copies the client's
// whole in-flight store into a slice and sorts it, whatever the message
// expiry settings, under the store's read lock. ns/op is the cost of one
// such second. Nothing of ours changes it (docs/performance.md,
// "Fleet-scale operations (2026-11-30)"): it is here to measure mochi again
// when it changes.
func BenchmarkInflightExpiryPass(b *testing.B) {
	for _, backlog := range []int{1000, 10000} {
		b.Run(fmt.Sprint(backlog), func(b *testing.B) {
			m := mqtt.New(&mqtt.Options{Capabilities: capabilities(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			cl := m.NewClient(nil, "t", "companion-bridge-b1", false)
			payload := []byte(`{"id":"019a0000-0000-7000-8000-000000000000","op":"push.text","device_id":"dev-0001",` +
				`"created_at":"2026-11-30T00:00:00Z","expires_at":"2026-12-01T00:00:00Z","payload":{"text":"` + strings.Repeat("x", 100) + `"}}`)
			now := time.Now().Unix()
			for id := 1; id <= backlog; id++ {
				cl.State.Inflight.Set(packets.Packet{
					FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
					PacketID:    uint16(id), TopicName: "companion/v1/devices/dev-0001/commands/push.text",
					Payload: payload, Created: now - int64(id%100), Expiry: 0, ProtocolVersion: 4,
				})
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if gone := cl.ClearExpiredInflights(now, maxMessageExpiry); len(gone) > 0 {
					b.Fatalf("%d in-flight messages expired", len(gone))
				}
			}
		})
	}
}
