package broker

import (
	"fmt"
	"maps"
	"sync"
	"time"
)

// StatelessAfter is how long the devices of a bridge are heard from, live,
// while no state message of the bridge has been taken in, before the
// bridge is taken as one whose state messages the MQTT broker drops. A
// bridge says online as it connects, before its devices report, and a
// server that connects later is handed the retained state as it
// subscribes; a minute is no race between the two.
const StatelessAfter = time.Minute

// stateless keeps, of each bridge whose devices were heard from live, when
// the first such message came, for checkStateless; only bridges bound to
// devices are in it.
type stateless struct {
	mu    sync.Mutex
	first map[string]time.Time // bridge id: its devices' first live message taken in
	after time.Duration        // StatelessAfter, shorter in tests
}

func newStateless() *stateless {
	return &stateless{first: map[string]time.Time{}, after: StatelessAfter}
}

// heardLive notes a live message (a reply, a status report) of a device
// of the bridge.
func (b *Broker) heardLive(bridgeID string) {
	if bridgeID == "" {
		return
	}
	s := b.stateless
	s.mu.Lock()
	if _, ok := s.first[bridgeID]; !ok {
		s.first[bridgeID] = b.now()
	}
	s.mu.Unlock()
}

// forget forgets a deleted bridge.
func (s *stateless) forget(bridgeID string) {
	s.mu.Lock()
	delete(s.first, bridgeID)
	s.mu.Unlock()
}

// checkStateless warns of each bridge whose devices have been heard from
// for StatelessAfter while no state message of it ("online", "offline", its
// Will) was ever taken in, at most once an hour a bridge, and counts them.
//
// Mosquitto takes a publish its acl_file refuses and drops it, the Will of
// a CONNECT too (2.0.11 connects a client whose Will topic its ACLs refuse).
// A bridge whose block lacks its 'topic write PREFIX/bridges/ID/state' line
// runs every command and reports its devices, so nothing looks amiss, but
// the server never hears it go: once it is gone its devices read online for
// good, and their commands are sent and wait, with no word that the bridge
// is away. It cannot tell itself: it may not read its own state
// (docs/reliability.md, bug 496).
func (b *Broker) checkStateless() {
	s := b.stateless
	now := b.now()
	s.mu.Lock()
	late := map[string]time.Duration{} // bridge id: heard from for
	for id, at := range s.first {
		if d := now.Sub(at); d >= s.after {
			late[id] = d
		}
	}
	s.mu.Unlock()
	b.mu.Lock()
	maps.DeleteFunc(late, func(id string, _ time.Duration) bool {
		_, stated := b.bridgeGen[id]
		return stated
	})
	b.mu.Unlock()
	b.opts.Observer.BridgesStateless(len(late))
	for id, d := range late {
		b.hourly.Warn("stateless\x00"+id, "a bridge whose devices report has never said its state: the MQTT broker drops its state messages, so once the bridge is gone its devices will read online for good and their commands wait sent",
			"bridge_id", id, "heard_for", d.Round(time.Second), "hint", b.statelessHint(id))
	}
}

// statelessHint says what to grant a bridge checkStateless warns of.
func (b *Broker) statelessHint(bridgeID string) string {
	p := b.tree.Prefix()
	return fmt.Sprintf("with Mosquitto's acl_file, the bridge's block ('user %s') must have 'topic write %s/bridges/%s/state', and the server's 'topic read %s/bridges/+/state' (docs/companion.acl.example); reload Mosquitto, then restart the bridge: it says online as it connects",
		bridgeID, p, bridgeID, p)
}
