// Package pahostore is paho's in-memory store with three differences: it
// keeps, and Get returns, copies of PUBLISH packets; All hands out the
// packets in the order they were put; and it can have resume send chosen
// PUBLISHes again unretained (ResentUnretained).
//
// On reconnect paho's resume sends again, in the order All gives, every
// PUBLISH the broker had not acknowledged. Paho's MemoryStore gives them in
// the order of a Go map, that is at random: the commands of one device lost
// with the server's connection reached the bridge shuffled, and it ran a
// later one first (docs/reliability.md, bug 8). Paho's OrderedMemoryStore
// sorts by a clock reading taken at each Put, with an unstable sort: two
// Puts within the clock's resolution can swap. A count cannot.
//
// On reconnect paho's resume sets the DUP flag on the packets it loads from
// the store while the previous connection's writer may still be packing the
// same packet: a data race inside paho (eclipse-paho/paho.mqtt.golang#703,
// open as of v1.5.1) that `go test -race` reports in our tests. Handing resume
// a copy leaves the packet being written untouched. Durable state lives in our
// own bbolt files, not here (STYLE: paho's file store has had corruption bugs).
package pahostore

import (
	"cmp"
	"slices"
	"strings"
	"sync"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
)

// Store is an mqtt.Store; create it with New.
type Store struct {
	*mqtt.MemoryStore
	unretained func(topic string) bool // nil: resend every PUBLISH as it was

	mu    sync.Mutex        // keeps order in step with the packets
	order map[string]uint64 // key → the count of its Put: All's order
	puts  uint64
}

// ResentUnretained has paho's resume (on connect) send the outgoing
// PUBLISHes whose topic match accepts again with their retain flag
// cleared. It returns s.
//
// For a retained message that the client says anew on every connect, and
// that must not arrive after a newer one: the bridge's state. Paho calls
// the OnConnect handler before resume reads the store, so a PUBLISH made
// from that handler is in the store when resume reads it and goes out
// twice, the second time with DUP set and possibly after later messages
// (seen: "online" sent at connect arriving again after the "offline" of a
// clean stop, which left the bridge retained online; docs/reliability.md,
// bug 6). Sent again unretained, the repeat changes no retained state.
//
// It is sent again rather than left out: paho frees a packet id only on
// the message's acknowledgement (or a Disconnect), and resume takes back
// only the ids of the packets All lists, so a PUBLISH left out whose
// connection was lost before its PUBACK kept its id for good; after
// 65,535 of them the client could publish nothing ("no message IDs
// available"; bug 42). A subscriber sees the repeat as one live message
// more.
func (s *Store) ResentUnretained(match func(topic string) bool) *Store {
	s.unretained = match
	return s
}

// All returns the keys of the stored packets in the order they were put.
func (s *Store) All() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys := s.MemoryStore.All()
	slices.SortFunc(keys, func(a, b string) int { return cmp.Compare(s.order[a], s.order[b]) })
	return keys
}

// Put stores a copy of a PUBLISH packet: a packet published while paho
// resumes after a reconnect is in the store and in the new connection's
// send queue at once, and the writer sets its length while Get would copy
// it (seen with a NATS node killed under load).
func (s *Store) Put(key string, p packets.ControlPacket) {
	if pub, ok := p.(*packets.PublishPacket); ok {
		cp := *pub
		p = &cp
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.puts++
	s.order[key] = s.puts
	s.MemoryStore.Put(key, p)
}

// Del deletes the packet stored under key.
func (s *Store) Del(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.order, key)
	s.MemoryStore.Del(key)
}

// Reset deletes every stored packet.
func (s *Store) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.order)
	s.MemoryStore.Reset()
}

// New returns an empty store for mqtt.ClientOptions.SetStore.
func New() *Store { return &Store{MemoryStore: mqtt.NewMemoryStore(), order: map[string]uint64{}} }

// Get returns the stored packet, or for a PUBLISH a copy of it: for an
// outgoing one whose topic ResentUnretained chose, with its retain flag
// cleared (paho reads the store only to send again on resume).
func (s *Store) Get(key string) packets.ControlPacket {
	p := s.MemoryStore.Get(key)
	if pub, ok := p.(*packets.PublishPacket); ok {
		cp := *pub
		// "o." is paho's prefix of the keys of outgoing packets: incoming
		// ones are paho's to acknowledge.
		if s.unretained != nil && strings.HasPrefix(key, "o.") && s.unretained(cp.TopicName) {
			cp.Retain = false
		}
		return &cp
	}
	return p
}
