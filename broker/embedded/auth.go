package embedded

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/logevery"
	"github.com/devicecompanion/companion/topics"
)

// accountsTimeout bounds each call to Accounts; it runs on the client's
// connection goroutine.
const accountsTimeout = 5 * time.Second

// authHook is the broker's authentication and access control (CONTRACT §3):
// OnConnectAuthenticate and OnACLCheck. Mochi calls OnACLCheck with
// write=true for each PUBLISH, with write=false for each SUBSCRIBE filter,
// and again with write=false and the topic name for each message it
// delivers (including to an offline session's queue). It never checks a
// Will, so the Will topic is checked at connect time, nor a queue it
// resends to the client that takes the session over, so
// OnSessionEstablish checks that queue. What a bridge
// publishes for a device it does not serve passes OnACLCheck and is
// dropped, acknowledged, in OnPublish.
type authHook struct {
	mqtt.HookBase

	tree     topics.Tree
	accounts Accounts
	log      *slog.Logger
	// noisy logs a bridge's publishes dropped once a minute per bridge
	// (a bridge can publish as fast as its loop runs, bug 379), and a
	// source's refused logins once a minute per reason (bug 380).
	noisy      *logevery.Log
	clients    *mqtt.Clients
	hasServer  bool
	serverUser []byte // companion.HashSecret of ServerUsername
	serverPass []byte // and of ServerPassword
	// drop removes a queued message from a client's session as mochi
	// drops one (Server.dropQueued).
	drop func(cl *mqtt.Client, pk packets.Packet)
	// connected is told of every client let in (Server.bridgeBack).
	connected func(Identity)

	// maxSessions bounds the sessions of one account (Options.MaxSessions);
	// 0 none.
	maxSessions int
	// discard ends a session left by a client that went, as
	// Server.discardSession does.
	discard func(cl *mqtt.Client) bool

	mu       sync.Mutex
	ids      map[*mqtt.Client]Identity     // who each known client is, while mochi keeps it
	replaced map[*mqtt.Client]*mqtt.Client // new client → the one whose session it takes over
	// sessions are the clients of ids by account, each with the number of
	// its admission (seq): a bridge's or user's sessions, counted against
	// maxSessions.
	sessions map[Identity]map[*mqtt.Client]uint64
	seq      uint64

	// A login checks its credentials, then is let in, then connected
	// (mochi's client map): a change of an account's credentials told
	// then (changed) finds no connection to close, and the login went on
	// with the old ones. So changes counts the changes told, changed
	// holds each account's latest, and checked each client let in, until
	// its session is established, the count as its login began; logins
	// counts the logins under way, which changed is kept for
	// (docs/reliability.md, bug 300).
	changes uint64
	changed map[Identity]uint64
	checked map[*mqtt.Client]uint64
	logins  int
	// gone holds, of the changes in changed, those that deleted the
	// account (Server.DeleteBridge): its late login's session goes too.
	gone map[Identity]bool
	// kick closes a client let in with credentials changed since, as
	// Server.DisconnectBridge, DisconnectUser and DeleteBridge close those
	// connected; deleted says the account was deleted.
	kick func(cl *mqtt.Client, id Identity, deleted bool)
	// takenOver is told of a login that takes over the session of a
	// client still connected, before mochi closes that client
	// (Server.takenOver).
	takenOver func(cl, existing *mqtt.Client)
}

// ID names the hook in mochi's log.
func (h *authHook) ID() string { return "companion-auth" }

// Provides lists the events the hook handles.
func (h *authHook) Provides(b byte) bool {
	switch b {
	case mqtt.OnConnectAuthenticate, mqtt.OnACLCheck, mqtt.OnPublish, mqtt.OnSubscribe, mqtt.OnUnsubscribe,
		mqtt.OnSessionEstablish, mqtt.OnSessionEstablished, mqtt.OnDisconnect, mqtt.OnClientExpired:
		return true
	}
	return false
}

func (h *authHook) identity(cl *mqtt.Client) (Identity, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	id, ok := h.ids[cl]
	return id, ok
}

// OnConnectAuthenticate admits a client when its credentials are good, its
// Will (if any) is a topic it may publish, and its client id is not the
// server's or a bridge's of another account (MayUseClientID) and does not
// name a session that belongs to another account.
func (h *authHook) OnConnectAuthenticate(cl *mqtt.Client, pk packets.Packet) bool {
	username := string(pk.Connect.Username)
	refuse := func(why string) bool {
		// Anyone who reaches the listener can be refused as fast as it
		// connects: a source's refusals of one reason are logged once a
		// minute, with their count (bug 380).
		host, _, err := net.SplitHostPort(cl.Net.Remote)
		if err != nil {
			host = cl.Net.Remote
		}
		h.noisy.Log(slog.LevelInfo, "refused\x00"+why+"\x00"+host, "mqtt connect refused", "reason", why, "username", username,
			"client_id", cl.ID, "remote", cl.Net.Remote)
		return false
	}
	if !pk.Connect.UsernameFlag || username == "" || !pk.Connect.PasswordFlag {
		return refuse("anonymous")
	}
	began := h.beginLogin()
	defer h.endLogin()
	id, ok := h.authenticate(username, string(pk.Connect.Password))
	if !ok {
		return refuse("bad credentials")
	}
	if pk.Connect.WillFlag && !h.mayWill(id, pk.Connect.WillTopic) {
		return refuse("will topic not allowed")
	}
	if !MayUseClientID(id, cl.ID) {
		return refuse("client id belongs to another account")
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
	if !h.admit(cl, id) {
		return refuse("too many sessions for the account")
	}
	if !h.noteChecked(cl, id, began) {
		return refuse("credentials changed as they were checked")
	}
	if h.connected != nil {
		h.connected(id)
	}
	return true
}

// admit notes cl as id's when the account has room for one more session
// (maxSessions): a session of cl's client id is the one cl takes over, not
// one more; past the bound, the account's oldest session whose client has
// gone is ended to make room, and with none the client is refused. Each
// session holds a write queue of 512 KiB (maxWritesPending), and one left
// by a client that went is kept two weeks: unbounded, anyone with a user's
// token or a bridge's secret could open sessions under client ids of
// their choosing until the server ran out of memory.
func (h *authHook) admit(cl *mqtt.Client, id Identity) bool {
	for range 3 { // an offline session ended, then asked again
		h.mu.Lock()
		var oldest *mqtt.Client
		n, first := 0, uint64(0)
		if id.Role != RoleServer && h.maxSessions > 0 {
			for other, seq := range h.sessions[id] {
				if other.ID == cl.ID {
					continue
				}
				if cur, ok := h.clients.Get(other.ID); ok && cur != other {
					continue // replaced as its session is taken over
				}
				n++
				if other.Closed() && (oldest == nil || seq < first) {
					oldest, first = other, seq
				}
			}
		}
		if n < h.maxSessions || id.Role == RoleServer || h.maxSessions <= 0 {
			h.ids[cl] = id
			if h.sessions[id] == nil {
				h.sessions[id] = map[*mqtt.Client]uint64{}
			}
			h.seq++
			h.sessions[id][cl] = h.seq
			h.mu.Unlock()
			return true
		}
		h.mu.Unlock()
		if oldest == nil || !h.discard(oldest) {
			return false
		}
		h.log.Info("mqtt session ended to make room for a new one of its account",
			"client_id", oldest.ID, "new_client_id", cl.ID, "max_sessions", h.maxSessions)
	}
	return false
}

// beginLogin notes a login under way and returns the count of changes
// of credentials as it begins.
func (h *authHook) beginLogin() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.logins++
	return h.changes
}

// endLogin notes the end of a login's check (beginLogin).
func (h *authHook) endLogin() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.logins--
}

// noteChecked keeps the count of changes (beginLogin) of cl, let in as
// id, until its session is established; it forgets cl and says false if
// id's credentials changed since.
func (h *authHook) noteChecked(cl *mqtt.Client, id Identity, began uint64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.changed[id] > began {
		h.forget(cl)
		return false
	}
	h.checked[cl] = began
	return true
}

// credentialsChanged notes that id's credentials (or rights) changed:
// a login under way that checked them before is closed once connected
// (OnSessionEstablished). Call it before closing id's connections.
func (h *authHook) credentialsChanged(id Identity, deleted bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.logins == 0 && len(h.checked) == 0 {
		clear(h.changed) // no login began before these changes
		clear(h.gone)
	}
	h.changes++
	h.changed[id] = h.changes
	h.gone[id] = deleted
}

// unestablished returns the client let in on conn whose session was not
// established (OnSessionEstablished), if any, once mochi is done with conn:
// it never will be. The session it took over (replaced) is forgotten, as
// mochi handed it to this client.
func (h *authHook) unestablished(conn net.Conn) *mqtt.Client {
	h.mu.Lock()
	defer h.mu.Unlock()
	for cl := range h.checked {
		if cl.Net.Conn == conn {
			delete(h.checked, cl)
			h.dropReplaced(cl)
			return cl
		}
	}
	return nil
}

// forgetClient drops what the hook knows of cl.
func (h *authHook) forgetClient(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.forget(cl)
}

// forget drops what the hook knows of cl; h.mu held.
func (h *authHook) forget(cl *mqtt.Client) {
	delete(h.checked, cl)
	if id, ok := h.ids[cl]; ok {
		delete(h.sessions[id], cl)
		if len(h.sessions[id]) == 0 {
			delete(h.sessions, id)
		}
	}
	delete(h.ids, cl)
}

// The server's client ids are "companion-server" and
// "companion-server-REPLICA"; a bridge's is "companion-bridge-ID".
const serverClientID, bridgeClientIDPrefix = "companion-server", "companion-bridge-"

// ReservedClientID says whether cid is one of the server's or the
// bridges' client ids, which MayUseClientID ties to their accounts by
// name.
func ReservedClientID(cid string) bool {
	return cid == serverClientID || strings.HasPrefix(cid, serverClientID+"-") ||
		strings.HasPrefix(cid, bridgeClientIDPrefix)
}

// MayUseClientID says whether id may connect with MQTT client id cid.
// The server's and the bridges' client ids belong to them whether they
// are connected or not: a broker hands a client that takes a client id
// the session's queued messages and closes the other connection, and
// one that holds it (connected, or with a persistent session) keeps the
// owner out.
func MayUseClientID(id Identity, cid string) bool {
	switch {
	case cid == serverClientID || strings.HasPrefix(cid, serverClientID+"-"):
		return id.Role == RoleServer
	case strings.HasPrefix(cid, bridgeClientIDPrefix):
		return id.Role == RoleBridge && cid == bridgeClientIDPrefix+id.ID
	}
	return true
}

func (h *authHook) authenticate(username, password string) (Identity, bool) {
	if h.hasServer && companion.SecretMatches(username, h.serverUser) {
		// The server's username never falls through to Accounts.
		return Identity{Role: RoleServer}, companion.SecretMatches(password, h.serverPass)
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
func (h *authHook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
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
func (h *authHook) below(s string) ([]string, bool) {
	rest, ok := strings.CutPrefix(s, h.tree.Prefix()+"/")
	if !ok || rest == "" {
		return nil, false
	}
	return strings.Split(rest, "/"), true
}

// mayWrite says whether id may publish to topic (never a filter: mochi
// refuses wildcards in topic names before it asks).
func (h *authHook) mayWrite(id Identity, topic string) bool {
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
// now (CONTRACT §9), and acknowledges it all the same, as Mosquitto does;
// a reply it publishes retained goes on unretained.
// Refused in OnACLCheck, a QoS 1 publish would cost the connection (all
// MQTT 3.1.1 allows besides an acknowledgement), and the bridge would
// send it again after each reconnect: a bridge whose list still names a
// device that moved away would be cut off for all its devices.
func (h *authHook) OnPublish(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	id, ok := h.identity(cl)
	if !ok || id.Role != RoleBridge {
		return pk, nil
	}
	t, err := h.tree.Parse(pk.TopicName)
	if err != nil || t.DeviceID == "" {
		return pk, nil
	}
	if h.serves(id.ID, t.DeviceID) {
		if t.Kind == topics.KindReplies && pk.FixedHeader.Retain && len(pk.Payload) > 0 {
			// Replies are not retained (CONTRACT §3). Retained, one stayed
			// on the device's topic after the device changed hands: a
			// user's own bridge planted replies of its making that the
			// next owner's watcher read on every subscription. (An empty
			// one only clears what an older broker kept.)
			pk.FixedHeader.Retain = false
		}
		return pk, nil
	}
	h.noisy.Warn(id.ID, "mqtt publish for a device the bridge does not serve dropped", "bridge_id", id.ID,
		"device_id", t.DeviceID, "topic", pk.TopicName, "client_id", cl.ID)
	return pk, packets.CodeSuccessIgnore
}

// serves asks the accounts whether the bridge serves the device now.
func (h *authHook) serves(bridgeID, deviceID string) bool {
	if h.accounts == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), accountsTimeout)
	defer cancel()
	return h.accounts.BridgeServesDevice(ctx, bridgeID, deviceID)
}

// mayWill says whether id may leave a Will on topic. A bridge's Will is its
// own state topic ("offline"); a user may not publish at all.
func (h *authHook) mayWill(id Identity, topic string) bool {
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
func (h *authHook) mayRead(id Identity, filter string) bool {
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
		// devices/{an id they own}/… ; a wildcard device is refused, and
		// so is a filter that matches none of the device's topics: any
		// other was let in, and a watcher's token subscribed to
		// devices/DEV/x1, x2, … until the server ran out of memory.
		if !userFilter(levels) {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), accountsTimeout)
		defer cancel()
		return h.accounts != nil && h.accounts.UserOwnsDevice(ctx, id.ID, levels[1])
	}
	return false
}

// OnSubscribe hands mochi a user's filter that ends in "+/#" with one "+"
// less (plusHash), as OnUnsubscribe does when the user takes it back.
func (h *authHook) OnSubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	return h.plusHash(cl, pk)
}

// OnUnsubscribe: see OnSubscribe.
func (h *authHook) OnUnsubscribe(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	return h.plusHash(cl, pk)
}

// plusHash rewrites the filters of a user's SUBSCRIBE or UNSUBSCRIBE that
// end in a run of "+" and then "#" to the same with one "+" less. "#"
// stands for no level too (MQTT 3.1.1 §4.7.1.2), so devices/DEV/+/#
// matches devices/DEV/status, as it does on Mosquitto and NATS; mochi
// matches it only past the "+" level, and a watcher on it read a
// device's commands and none of its status, settings or replies, live or
// retained (docs/reliability.md, bug 345). Mochi matches P/+/# as P/+/+/#
// should, and P/# as P/+/# should plus P itself, which is never a topic
// of the device that a user may read (mayRead refuses it at delivery), as
// only a filter a user may hold is rewritten: its first levels, which the
// rewrite keeps, are those of a topic of the device. One such filter and
// the rewritten one, both held, are one subscription.
func (h *authHook) plusHash(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	id, ok := h.identity(cl)
	if !ok || id.Role != RoleUser {
		return pk
	}
	var filters packets.Subscriptions
	for i, sub := range pk.Filters {
		levels, ok := h.below(sub.Filter)
		n := len(levels)
		if !ok || n < 4 || levels[n-1] != "#" || levels[n-2] != "+" || !userFilter(levels) {
			continue
		}
		if filters == nil {
			filters = slices.Clone(pk.Filters)
		}
		filters[i].Filter = h.tree.Prefix() + "/" + strings.Join(append(levels[:n-2:n-2], "#"), "/")
	}
	if filters != nil {
		pk.Filters = filters
	}
	return pk
}

// userFilter says whether a user who owns the device the levels below the
// prefix name may hold them as a filter.
func userFilter(levels []string) bool {
	return len(levels) >= 3 && levels[0] == "devices" && topics.ValidDeviceID(levels[1]) && matchesDeviceTopic(levels[2:])
}

// deviceTopics are the shapes of a device's topics below devices/{id}; an
// op level is any of topics.ValidOp.
var deviceTopics = [][]string{{"replies"}, {"status"}, {"settings"}, {"commands", opLevel}}

const opLevel = "\x00op"

// matchesDeviceTopic says whether the filter whose levels below
// devices/{id} are f matches at least one of the device's topics: the
// filters a user may hold are then a few dozen a device.
func matchesDeviceTopic(f []string) bool {
	for _, shape := range deviceTopics {
		if filterMatches(f, shape) {
			return true
		}
	}
	return false
}

func filterMatches(f, shape []string) bool {
	for i, l := range f {
		switch {
		case l == "#":
			return i == len(f)-1
		case i >= len(shape):
			return false
		case l == "+":
		case shape[i] == opLevel:
			if !topics.ValidOp(l) {
				return false
			}
		case l != shape[i]:
			return false
		}
	}
	return len(f) == len(shape)
}

// OnSessionEstablish notes the client whose session cl takes over, and
// drops from that session's queue what cl may not read now. The old
// client object is replaced by cl in mochi's client map once the session
// is established; an offline one never reports a disconnect again, so its
// identity is dropped then (not now: until then mochi still queues
// messages for it, checking the ACL).
func (h *authHook) OnSessionEstablish(cl *mqtt.Client, pk packets.Packet) {
	existing, ok := h.clients.Get(cl.ID)
	if !ok || existing == cl {
		return
	}
	h.mu.Lock()
	h.replaced[cl] = existing
	h.mu.Unlock()
	if h.takenOver != nil && !existing.Closed() {
		h.takenOver(cl, existing)
	}
	if !pk.Connect.Clean { // a clean start discards the queue anyway
		h.dropUnreadable(cl, existing)
	}
}

// dropUnreadable drops each message queued in existing's session that cl
// may not read now. Mochi checks the ACL when it queues a message, and
// resends the queue to the client taking the session over without a
// check: a device that moved to another bridge, or was unbound, in the
// meantime would have its messages delivered where they no longer belong
// (CONTRACT §9), and twice for a command once the server resends it to
// the device's new bridge.
func (h *authHook) dropUnreadable(cl, existing *mqtt.Client) {
	id, known := h.identity(cl)
	may := map[string]bool{} // topic → whether cl may read it; asked once each
	n := 0
	for _, p := range existing.State.Inflight.GetAll(false) {
		if p.FixedHeader.Type != packets.Publish {
			continue // an acknowledgement on its way, not a message
		}
		ok, asked := may[p.TopicName]
		if !asked {
			ok = known && h.mayRead(id, p.TopicName)
			may[p.TopicName] = ok
		}
		if !ok {
			h.drop(existing, p)
			n++
		}
	}
	if n > 0 {
		h.log.Info("mqtt queued messages dropped: the client may no longer read them",
			"client_id", cl.ID, "messages", n)
	}
}

// OnSessionEstablished forgets the client object cl replaced, and closes
// cl if its account's credentials changed since its login began: it was
// not yet among the clients the change closed (bug 300).
func (h *authHook) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	h.mu.Lock()
	h.dropReplaced(cl)
	began, checked := h.checked[cl]
	delete(h.checked, cl)
	id, known := h.ids[cl]
	stale := checked && known && h.changed[id] > began
	deleted := stale && h.gone[id]
	h.mu.Unlock()
	if stale && h.kick != nil {
		h.kick(cl, id, deleted)
	}
}

func (h *authHook) dropReplaced(cl *mqtt.Client) {
	if old, ok := h.replaced[cl]; ok {
		h.forget(old)
		delete(h.replaced, cl)
	}
}

// OnDisconnect forgets a client whose session ends with its connection.
// A persistent session keeps its identity: mochi checks the ACL for each
// message it queues for it while it is offline.
func (h *authHook) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropReplaced(cl)
	if expire || cl.IsTakenOver() {
		h.forget(cl)
	}
}

// OnClientExpired forgets a persistent session mochi has given up on.
func (h *authHook) OnClientExpired(cl *mqtt.Client) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.forget(cl)
}
