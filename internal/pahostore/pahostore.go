// Package pahostore is paho's in-memory store with one difference: it
// keeps, and Get returns, copies of PUBLISH packets.
//
// On reconnect paho's resume sets the DUP flag on the packets it loads from
// the store while the previous connection's writer may still be packing the
// same packet: a data race inside paho (eclipse-paho/paho.mqtt.golang#703,
// open as of v1.5.1) that `go test -race` reports in our tests. Handing resume
// a copy leaves the packet being written untouched. Durable state lives in our
// own bbolt files, not here (STYLE: paho's file store has had corruption bugs).
package pahostore

import (
	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
)

// Store is an mqtt.Store; create it with New.
type Store struct {
	*mqtt.MemoryStore
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
	s.MemoryStore.Put(key, p)
}

// New returns an empty store for mqtt.ClientOptions.SetStore.
func New() *Store { return &Store{MemoryStore: mqtt.NewMemoryStore()} }

// Get returns the stored packet, or for a PUBLISH a copy of it.
func (s *Store) Get(key string) packets.ControlPacket {
	p := s.MemoryStore.Get(key)
	if pub, ok := p.(*packets.PublishPacket); ok {
		cp := *pub
		return &cp
	}
	return p
}
