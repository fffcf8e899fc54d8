package embedded

import (
	"bytes"
	"context"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion/topics"
)

// accountsTimeout bounds each call to Accounts; it runs on the client's
// connection goroutine.
const accountsTimeout = 5 * time.Second

// hook is the broker's mochi hook. It does three jobs:
//
//   - authentication and access control (CONTRACT §3): OnConnectAuthenticate
//     and OnACLCheck. Mochi calls OnACLCheck with write=true for each PUBLISH,
//     with write=false for each SUBSCRIBE filter, and again with write=false
//     and the topic name for each message it delivers (including to an
//     offline session's queue). It never checks a Will, so the Will topic is
//     checked at connect time. What a bridge publishes for a device it does
//     not serve passes OnACLCheck and is dropped, acknowledged, in OnPublish.
//   - keeping queued messages in order: mochi resends an offline session's
//     queue sorted by uint16(Created seconds) with an unstable sort, which
//     shuffles everything queued within one second. The hook numbers each
//     outgoing QoS 1 message and, when a session is resumed, rewrites Created
//     to the message's rank so that the resend follows publish order.
//   - protecting queued messages from a packet id clash: mochi keeps a
//     client's incoming QoS acks and its outgoing messages in one map keyed
//     by packet id, and an incoming QoS 1 PUBLISH deletes an outgoing
//     message that happens to have the same id. A bridge both receives and
//     sends QoS 1, so without this a command awaiting its PUBACK could
//     vanish and never be resent after a disconnect. The hook moves such a
//     publish to a free packet id while mochi handles it.
type hook struct {
	mqtt.HookBase

	tree       topics.Tree
	accounts   Accounts
	log        *slog.Logger
	clients    *mqtt.Clients
	hasServer  bool
	serverUser [32]byte // SHA-256 of ServerUsername
	serverPass [32]byte // SHA-256 of ServerPassword

	mu      sync.Mutex
	ids     map[*mqtt.Client]Identity    // who each known client is, while mochi keeps it
	seqs    map[string]map[uint16]uint64 // client id → packet id → publish sequence
	seq     uint64                       // last sequence handed out
	lastOut map[string]uint16            // client id → packet id of the last message queued for it
	moved   map[*mqtt.Client]movedID     // incoming publish moved to a free packet id

	replaced map[*mqtt.Client]*mqtt.Client // new client → the one whose session it takes over
}

// movedID is an incoming publish's packet id and the one it was given.
type movedID struct{ temp, orig uint16 }

// ID names the hook in mochi's log.
func (h *hook) ID() string { return "companion-auth" }

// Provides lists the events the hook handles.
func (h *hook) Provides(b byte) bool {
	switch b {
	case mqtt.OnConnectAuthenticate, mqtt.OnACLCheck, mqtt.OnPublish, mqtt.OnSessionEstablish, mqtt.OnSessionEstablished,
		mqtt.OnDisconnect, mqtt.OnClientExpired,
		mqtt.OnQosPublish, mqtt.OnQosComplete, mqtt.OnQosDropped,
		mqtt.OnPacketRead, mqtt.OnPacketEncode, mqtt.OnPacketProcessed:
		return true
	}
	return false
}

func (h *hook) identity(cl *mqtt.Client) (Identity, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	id, ok := h.ids[cl]
	return id, ok
}

// OnConnectAuthenticate admits a client when its credentials are good, its
// Will (if any) is a topic it may publish, and its client id does not name
// a session that belongs to another account.
func (h *hook) OnConnectAuthenticate(cl *mqtt.Client, pk packets.Packet) bool {
	username := string(pk.Connect.Username)
	refuse := func(why string) bool {
		h.log.Info("mqtt connect refused", "reason", why, "username", username,
			"client_id", cl.ID, "remote", cl.Net.Remote)
		return false
	}
	if !pk.Connect.UsernameFlag || username == "" || !pk.Connect.PasswordFlag {
		return refuse("anonymous")
	}
	id, ok := h.authenticate(username, string(pk.Connect.Password))
	if !ok {
		return refuse("bad credentials")
	}
	if pk.Connect.WillFlag && !h.mayWill(id, pk.Connect.WillTopic) {
		return refuse("will topic not allowed")
	}
	if existing, ok := h.clients.Get(cl.ID); ok {
		owner, known := h.identity(existing)
		if known && owner != id || !known && !bytes.Equal(existing.Properties.Username, pk.Connect.Username) {
			// Taking over the session would hand this client the other
			// account's subscriptions and queued messages, which mochi
			// resends without an ACL check.
			return refuse("client id belongs to another account")
		}
	}
	h.mu.Lock()
	h.ids[cl] = id
	h.mu.Unlock()
	return true
}

func (h *hook) authenticate(username, password string) (Identity, bool) {
	if h.hasServer && equalHash(username, h.serverUser) {
		// The server's username never falls through to Accounts.
		return Identity{Role: RoleServer}, equalHash(password, h.serverPass)
	}
	if h.accounts == nil {
		return Identity{}, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), accountsTimeout)
	defer cancel()
	id, ok := h.accounts.Authenticate(ctx, username, password)
	if !ok || (id.Role != RoleBridge && id.Role != RoleUser) {
		return Identity{}, false
	}
	if id.Role == RoleBridge && !topics.ValidBridgeID(id.ID) {
		return Identity{}, false
	}
	return id, true
}

// OnACLCheck decides each publish (write) and each subscription filter or
// delivery (read).
func (h *hook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
	id, ok := h.identity(cl)
	if !ok {
		return false
	}
	if write {
		return h.mayWrite(id, topic)
	}
	return h.mayRead(id, topic)
}

// below returns the levels of a topic or filter under the prefix.
func (h *hook) below(s string) ([]string, bool) {
	rest, ok := strings.CutPrefix(s, h.tree.Prefix()+"/")
	if !ok || rest == "" {
		return nil, false
	}
	return strings.Split(rest, "/"), true
}

// mayWrite says whether id may publish to topic (never a filter: mochi
// refuses wildcards in topic names before it asks).
func (h *hook) mayWrite(id Identity, topic string) bool {
	switch id.Role {
	case RoleServer:
		_, ok := h.below(topic)
		return ok
	case RoleBridge:
		t, err := h.tree.Parse(topic)
		if err != nil {
			return false
		}
		switch t.Kind {
		case topics.KindReplies, topics.KindStatus, topics.KindSettings:
			// Whether the bridge serves the device is OnPublish's to say.
			return true
		case topics.KindBridgeState:
			return t.BridgeID == id.ID
		}
	}
	return false
}

// OnPublish drops what a bridge publishes for a device it does not serve
// now (CONTRACT §9), and acknowledges it all the same, as Mosquitto does.
// Refused in OnACLCheck, a QoS 1 publish would cost the connection (all
// MQTT 3.1.1 allows besides an acknowledgement), and the bridge would
// send it again after each reconnect: a bridge whose list still names a
// device that moved away would be cut off for all its devices.
func (h *hook) OnPublish(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	id, ok := h.identity(cl)
	if !ok || id.Role != RoleBridge {
		return pk, nil
	}
	t, err := h.tree.Parse(pk.TopicName)
	if err != nil || t.DeviceID == "" || h.serves(id.ID, t.DeviceID) {
		return pk, nil
	}
	h.log.Warn("mqtt publish for a device the bridge does not serve dropped", "bridge_id", id.ID,
		"device_id", t.DeviceID, "topic", pk.TopicName, "client_id", cl.ID)
	return pk, packets.CodeSuccessIgnore
}

// serves asks the accounts whether the bridge serves the device now.
func (h *hook) serves(bridgeID, deviceID string) bool {
	if h.accounts == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), accountsTimeout)
	defer cancel()
	return h.accounts.BridgeServesDevice(ctx, bridgeID, deviceID)
}

// mayWill says whether id may leave a Will on topic. A bridge's Will is its
// own state topic ("offline"); a user may not publish at all.
func (h *hook) mayWill(id Identity, topic string) bool {
	switch id.Role {
	case RoleServer:
		return h.mayWrite(id, topic)
	case RoleBridge:
		t, err := h.tree.Parse(topic)
		return err == nil && t.Kind == topics.KindBridgeState && t.BridgeID == id.ID
	}
	return false
}

// mayRead says whether id may subscribe to filter, or receive a message on
// the topic filter names.
func (h *hook) mayRead(id Identity, filter string) bool {
	levels, ok := h.below(filter)
	if !ok {
		return false
	}
	switch id.Role {
	case RoleServer:
		return true
	case RoleBridge:
		// devices/{an id it serves}/commands/{op|+|#}; a wildcard device
		// is refused.
		if len(levels) != 4 || levels[0] != "devices" || levels[2] != "commands" {
			return false
		}
		dev, op := levels[1], levels[3]
		return topics.ValidDeviceID(dev) && (op == "+" || op == "#" || topics.ValidOp(op)) && h.serves(id.ID, dev)
	case RoleUser:
		// devices/{an id they own}/… ; a wildcard device is refused.
		if len(levels) < 2 || levels[0] != "devices" || !topics.ValidDeviceID(levels[1]) {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), accountsTimeout)
		defer cancel()
		return h.accounts != nil && h.accounts.UserOwnsDevice(ctx, id.ID, levels[1])
	}
	return false
}

// OnSessionEstablish runs after authentication and before mochi takes over
// an existing session with the same client id: it puts that session's
// queue in publish order for the resend that follows.
func (h *hook) OnSessionEstablish(cl *mqtt.Client, pk packets.Packet) {
	existing, ok := h.clients.Get(cl.ID)
	if !ok || existing == cl {
		return
	}
	// The old client object is replaced by cl in mochi's client map once
	// the session is established; an offline one never reports a
	// disconnect again, so its identity is dropped then (not now: until
	// then mochi still queues messages for it, checking the ACL).
	h.mu.Lock()
	h.replaced[cl] = existing
	h.mu.Unlock()
	if pk.Connect.Clean {
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

// OnSessionEstablished forgets the client object cl replaced.
func (h *hook) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropReplaced(cl)
}

func (h *hook) dropReplaced(cl *mqtt.Client) {
	if old, ok := h.replaced[cl]; ok {
		delete(h.ids, old)
		delete(h.moved, old)
		delete(h.replaced, cl)
	}
}

// OnQosPublish numbers each outgoing message the first time it enters a
// client's inflight store; a resend keeps its number.
func (h *hook) OnQosPublish(cl *mqtt.Client, pk packets.Packet, _ int64, _ int) {
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
		h.lastOut[cl.ID] = pk.PacketID
	}
}

// OnQosComplete forgets a message's number once it is acknowledged.
func (h *hook) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	h.forget(cl.ID, pk.PacketID)
}

// OnQosDropped forgets a message's number when mochi drops it.
func (h *hook) OnQosDropped(cl *mqtt.Client, pk packets.Packet) {
	h.forget(cl.ID, pk.PacketID)
}

func (h *hook) forget(clientID string, packetID uint16) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if m := h.seqs[clientID]; m != nil {
		delete(m, packetID)
		if len(m) == 0 {
			delete(h.seqs, clientID)
		}
	}
}

// OnPacketRead moves an incoming packet off a packet id that one of the
// client's outgoing messages holds (see hook). The client picks the ids of
// what it sends and the server those of what it sends, but mochi keeps
// both in one inflight store: for a QoS 1 PUBLISH it would delete the
// outgoing message from that store, and it refuses a SUBSCRIBE or an
// UNSUBSCRIBE with 0x91, "packet identifier in use" (a bridge back on its
// persistent session, its commands on their way, subscribing while they
// are). The packet is given a free id for its trip through mochi, and
// OnPacketEncode puts the client's own id back on the acknowledgement. The
// free id is searched downwards from the id mochi handed out last, the far
// end of the space from the ids it hands out next. Packets of one client
// are processed one at a time, so each client has at most one packet moved
// at once.
func (h *hook) OnPacketRead(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
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
	last := h.lastOut[cl.ID]
	for i := 1; i < 1<<16; i++ {
		free := last - uint16(i)
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
func (h *hook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
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
func (h *hook) OnPacketProcessed(cl *mqtt.Client, pk packets.Packet, _ error) {
	switch pk.FixedHeader.Type {
	case packets.Publish, packets.Subscribe, packets.Unsubscribe:
	default:
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.moved, cl)
}

// OnDisconnect forgets a client whose session ends with its connection.
// A persistent session keeps its identity: mochi checks the ACL for each
// message it queues for it while it is offline.
func (h *hook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.moved, cl)
	h.dropReplaced(cl)
	if expire || cl.IsTakenOver() {
		delete(h.ids, cl)
	}
	if expire && !cl.IsTakenOver() {
		delete(h.seqs, cl.ID)
		delete(h.lastOut, cl.ID)
	}
}

// OnClientExpired forgets a persistent session mochi has given up on.
func (h *hook) OnClientExpired(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.ids, cl)
	if cur, ok := h.clients.Get(cl.ID); !ok || cur == cl {
		delete(h.seqs, cl.ID)
		delete(h.lastOut, cl.ID)
	}
}
