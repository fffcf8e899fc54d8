package broker

import (
	"context"
	"fmt"
	"slices"

	"github.com/devicecompanion/companion"
)

// UnheardRepeats is how many times in a row retrySent sends a command
// again, with no word from its bridge, before the bridge is taken as one
// the broker does not let read its commands or whose replies it drops.
// A bridge answers every command it receives, at once: "delivered" when it
// takes it (even one queued behind others on its device, or for a device
// out of its reach, which then fails or expires with a word), its final
// reply for one it finished. A command lost once (a broker that dropped
// it) is answered after its first repeat; three repeats, SentRetry apart
// at least, with no word at all are no slow bridge.
const UnheardRepeats = 3

// unheard is what noteUnheard keeps between runs of retrySent; only the
// retry loop touches it.
type unheard struct {
	repeats map[string]int // sent command id: times sent again with no word since
}

func newUnheard() *unheard {
	return &unheard{repeats: map[string]int{}}
}

// noteUnheard counts the repeats of the commands retrySent sent again
// (again, of those still sent: sent), and warns of each bridge with a
// command sent again UnheardRepeats times or more, at most once an hour a
// bridge.
//
// A bridge whose Mosquitto acl_file block lacks, or mistypes, its 'topic
// read PREFIX/devices/+/commands/#' line has every SUBSCRIBE granted (an
// acl_file refuses none) and receives nothing; it says online and its
// devices read online, so every command read sent, was sent again every
// minute or two until its TTL passed, and nobody was told: the bridge
// cannot know what it never received, and the server logged only, at
// info, that it sent commands again (docs/reliability.md, bug 489). A
// bridge whose replies the broker drops looks the same from here (it says
// so itself, bug 484); the warning names both.
func (b *Broker) noteUnheard(ctx context.Context, u *unheard, sent, again []companion.Command, read bool) {
	if !read {
		return // the counts stand, and so does the gauge
	}
	still := make(map[string]companion.Command, len(sent))
	for _, c := range sent {
		still[c.ID] = c
	}
	for id := range u.repeats {
		if _, ok := still[id]; !ok {
			delete(u.repeats, id) // answered, ended, or its device offline
		}
	}
	for _, c := range again {
		u.repeats[c.ID]++
	}
	byDevice := map[string][]string{}
	for id, n := range u.repeats {
		if n >= UnheardRepeats {
			d := still[id].DeviceID
			byDevice[d] = append(byDevice[d], id)
		}
	}
	if len(byDevice) == 0 {
		b.opts.Observer.BridgesUnheard(0)
		return
	}
	devices := make([]string, 0, len(byDevice))
	for d := range byDevice {
		devices = append(devices, d)
	}
	slices.Sort(devices)
	bridgeOf, err := b.st.DeviceBridges(ctx, devices)
	if err != nil {
		b.log.Warn("reading the bridges of commands sent again failed", "err", err)
		return
	}
	type bridgeUnheard struct {
		devices  []string
		commands int
	}
	bridges := map[string]*bridgeUnheard{}
	for _, d := range devices {
		id := bridgeOf[d]
		if id == "" {
			continue // moved off its bridge since: its commands wait queued
		}
		bu := bridges[id]
		if bu == nil {
			bu = &bridgeUnheard{}
			bridges[id] = bu
		}
		bu.devices = append(bu.devices, d)
		bu.commands += len(byDevice[d])
	}
	b.opts.Observer.BridgesUnheard(len(bridges))
	for id, bu := range bridges {
		shown := bu.devices
		if len(shown) > 10 {
			shown = shown[:10]
		}
		b.hourly.Warn("unheard\x00"+id, "a bridge that reads online said nothing of commands sent to it again and again: the MQTT broker does not let it read its devices' commands, or drops its replies",
			"bridge_id", id, "commands", bu.commands, "devices", len(bu.devices), "device_ids", shown,
			"repeats", UnheardRepeats, "hint", b.unheardHint(id))
	}
}

// unheardHint says what to check of a bridge noteUnheard warns of.
func (b *Broker) unheardHint(bridgeID string) string {
	p := b.tree.Prefix()
	return fmt.Sprintf("with Mosquitto's acl_file, the bridge's block ('user %s') must have 'topic read %s/devices/+/commands/#' and 'topic write %s/devices/+/replies' (docs/companion.acl.example; reload Mosquitto after a change); "+
		"with the dynamic-security plugin or NATS the server writes its rights: run the bridge with the server's --topic-prefix (%s); the bridge's own log says whether its replies are dropped (docs/operations.md)",
		bridgeID, p, p, p)
}
