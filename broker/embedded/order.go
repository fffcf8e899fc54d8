package embedded

import (
	"sort"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// orderHook keeps queued messages in order: mochi resends an offline
// session's queue sorted by uint16(Created seconds) with an unstable sort,
// which shuffles everything queued within one second. The hook numbers
// each outgoing QoS 1 message and, when a session is resumed, rewrites
// Created to the message's rank so that the resend follows publish order.
type orderHook struct {
	mqtt.HookBase

	clients *mqtt.Clients

	mu   sync.Mutex
	seqs map[string]map[uint16]uint64 // client id → packet id → publish sequence
	seq  uint64                       // last sequence handed out
}

// ID names the hook in mochi's log.
func (h *orderHook) ID() string { return "companion-order" }

// Provides lists the events the hook handles.
func (h *orderHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnSessionEstablish, mqtt.OnQosPublish, mqtt.OnQosComplete, mqtt.OnQosDropped,
		mqtt.OnDisconnect, mqtt.OnClientExpired:
		return true
	}
	return false
}

// OnSessionEstablish runs after authentication and before mochi takes over
// an existing session with the same client id: it puts that session's
// queue in publish order for the resend that follows.
func (h *orderHook) OnSessionEstablish(cl *mqtt.Client, pk packets.Packet) {
	existing, ok := h.clients.Get(cl.ID)
	if !ok || existing == cl || pk.Connect.Clean {
		return
	}
	queued := existing.State.Inflight.GetAll(false)
	if len(queued) == 0 {
		return
	}
	h.mu.Lock()
	seqs := make(map[uint16]uint64, len(queued))
	for _, p := range queued {
		seqs[p.PacketID] = h.seqs[cl.ID][p.PacketID]
	}
	h.mu.Unlock()
	key := func(p packets.Packet) (uint64, int64) {
		// Messages the hook did not number (none expected) go first, by time.
		return seqs[p.PacketID], p.Created
	}
	sort.SliceStable(queued, func(i, j int) bool {
		si, ci := key(queued[i])
		sj, cj := key(queued[j])
		if si != sj {
			return si < sj
		}
		return ci < cj
	})
	// mochi sorts the resend by uint16(Created); ranks below 65536 (the
	// queue can hold at most 65535) sort exactly. Created is used for
	// nothing else once MaximumMessageExpiryInterval is 0.
	for rank, p := range queued {
		p.Created = int64(rank)
		existing.State.Inflight.Set(p)
	}
}

// OnQosPublish numbers each outgoing message the first time it enters a
// client's inflight store; a resend keeps its number.
func (h *orderHook) OnQosPublish(cl *mqtt.Client, pk packets.Packet, _ int64, _ int) {
	if pk.FixedHeader.Type != packets.Publish {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	m := h.seqs[cl.ID]
	if m == nil {
		m = map[uint16]uint64{}
		h.seqs[cl.ID] = m
	}
	if _, ok := m[pk.PacketID]; !ok {
		h.seq++
		m[pk.PacketID] = h.seq
	}
}

// OnQosComplete forgets a message's number once it is acknowledged.
func (h *orderHook) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	h.forget(cl.ID, pk.PacketID)
}

// OnQosDropped forgets a message's number when mochi drops it.
func (h *orderHook) OnQosDropped(cl *mqtt.Client, pk packets.Packet) {
	h.forget(cl.ID, pk.PacketID)
}

func (h *orderHook) forget(clientID string, packetID uint16) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if m := h.seqs[clientID]; m != nil {
		delete(m, packetID)
		if len(m) == 0 {
			delete(h.seqs, clientID)
		}
	}
}

// OnDisconnect forgets the numbers of a session that ends with its
// connection.
func (h *orderHook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	if !expire || cl.IsTakenOver() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.seqs, cl.ID)
}

// OnClientExpired forgets the numbers of a persistent session mochi has
// given up on, unless a new client holds its id by now.
func (h *orderHook) OnClientExpired(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if cur, ok := h.clients.Get(cl.ID); !ok || cur == cl {
		delete(h.seqs, cl.ID)
	}
}
