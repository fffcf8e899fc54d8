// Package embedded is the MQTT broker the companion server runs in-process
// when no external broker is configured (`companion serve` without
// `--mqtt-url`). It wraps mochi-mqtt v2 with the companion's authentication
// and access rules (CONTRACT §3, "Who may do what on the broker") and with
// capabilities chosen so that no QoS 1 message is dropped for a bridge whose
// persistent session is offline.
//
// It is not a durable broker: sessions, queued messages and retained messages
// live in memory and are lost when the process stops. The command broker's
// outbox republishes what was not delivered after a restart (docs/design.md);
// production deployments that want the broker to outlive the server use
// Mosquitto (mosquitto.conf, docs/mosquitto.md).
package embedded

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/logevery"
	"github.com/devicecompanion/companion/internal/mochilisten"
	"github.com/devicecompanion/companion/topics"
)

// Role is the kind of account a connected client authenticated as.
type Role int

// The roles. The zero Role is no role at all and is allowed nothing.
const (
	// RoleServer is the companion server itself: everything under the prefix.
	RoleServer Role = iota + 1
	// RoleBridge is a bridge: it reads its devices' commands and writes their
	// replies, status and settings, and its own state.
	RoleBridge
	// RoleUser is an API user watching the topics of the devices they own,
	// read-only.
	RoleUser
)

func (r Role) String() string {
	switch r {
	case RoleServer:
		return "server"
	case RoleBridge:
		return "bridge"
	case RoleUser:
		return "user"
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// Identity is who a connected client is.
type Identity struct {
	Role Role
	// ID is the bridge id for RoleBridge, the user id for RoleUser, and ""
	// for RoleServer.
	ID string
}

// Accounts is what the broker needs to know about who may connect. It is
// implemented by the command broker, backed by the store.
//
// Both methods are called on the connection's own goroutine and should
// answer quickly; they get a context with a few seconds' deadline.
type Accounts interface {
	// Authenticate checks a client's credentials. Bridges connect with
	// username = bridge id and password = bridge secret; users with
	// username = user id and password = API token. It returns the identity
	// and true, or false for unknown accounts and wrong passwords. An
	// identity with RoleServer is refused: only Options.ServerUsername is
	// the server.
	Authenticate(ctx context.Context, username, password string) (Identity, bool)

	// UserOwnsDevice reports whether the device is bound to the user now.
	// The broker asks on every subscription and every delivery to a user,
	// so an unbind takes effect at once; it caches nothing.
	UserOwnsDevice(ctx context.Context, userID, deviceID string) bool

	// BridgeServesDevice reports whether the device is assigned to the
	// bridge now (CONTRACT §9). The broker asks on every subscription and
	// publish of a bridge and every delivery to one, so moving a device
	// moves its rights at once; it caches nothing.
	BridgeServesDevice(ctx context.Context, bridgeID, deviceID string) bool
}

// Options configure a Server. The zero value of each field means its default.
type Options struct {
	// Listen is the TCP address to listen on; default "127.0.0.1:1883".
	// Port 0 picks a free port (see Server.Addr).
	Listen string
	// TLSConfig, when set, makes the listener TLS only (mqtts://); it
	// needs Certificates.
	TLSConfig *tls.Config
	// Topics is the topic tree whose prefix the rules apply to; the zero
	// value means topics.DefaultPrefix.
	Topics topics.Tree
	// Accounts authenticates bridges and users. When nil, only the server
	// account may connect.
	Accounts Accounts
	// ServerUsername and ServerPassword are the credentials of a server
	// account, with full access under the prefix, for a companion server
	// that connects over the network. `companion serve` sets none: it
	// connects in-process (NewClient). When ServerUsername is empty there
	// is no server account. They are compared in constant time.
	ServerUsername, ServerPassword string
	// Logger receives the broker's log. Mochi's own messages are passed on
	// only at Warn level and above. Default: discard.
	Logger *slog.Logger
	// KickGrace is how long a bridge that DisconnectBridge closed has to
	// connect again before its Will is published after all; default
	// DefaultKickGrace.
	KickGrace time.Duration
	// ConnectTimeout is how long a new connection has to send its
	// CONNECT (and finish its TLS handshake); default
	// DefaultConnectTimeout. A connection that takes longer is closed
	// before it is authenticated: one that sent nothing was kept for
	// ever, with its goroutines, descriptor and write queue.
	ConnectTimeout time.Duration
	// MaxSessions is how many sessions one account (a bridge, a user)
	// may hold at once, connected or kept for a client that left;
	// default DefaultMaxSessions, negative for no bound.
	MaxSessions int
}

// DefaultConnectTimeout is the default of Options.ConnectTimeout, as long
// as the HTTP API gives a request's headers.
const DefaultConnectTimeout = 10 * time.Second

// DefaultMaxSessions is the default of Options.MaxSessions: as many as the
// event streams the HTTP API lets one user have open.
const DefaultMaxSessions = 32

// DefaultKickGrace is the default of Options.KickGrace: a bridge
// reconnects within a second or two.
const DefaultKickGrace = 10 * time.Second

// DefaultListen is the address the broker listens on unless told otherwise.
const DefaultListen = "127.0.0.1:1883"

// MaxPacketSize is the largest MQTT packet the broker accepts: the largest
// payload either side sends (topics.MaxPayload) plus 64 KiB for the fixed
// header, the topic (a prefix of up to 512 bytes and ids of up to 64) and
// MQTT 5 properties.
const MaxPacketSize = topics.MaxPayload + 64<<10

// The capabilities below decide whether a QoS 1 message can be lost; each is
// set on purpose.
const (
	// maxInflight is how many QoS 1/2 messages mochi keeps per client,
	// counting both those sent and awaiting PUBACK and those queued for an
	// offline persistent session. Beyond it mochi drops the message ("client
	// store quota reached"). 65535 is the most it allows: packet ids are 16
	// bits and every queued message holds one. The contract allows 1000
	// unfinished commands per device, so a bridge serving up to 65 devices
	// with full queues fits; the outbox resends what a drop would lose once
	// the server restarts, and the drop is logged at Warn.
	maxInflight = math.MaxUint16

	// maxWritesPending is the length of each client's outbound channel. When
	// it is full, mochi drops the message and rolls it back out of the
	// inflight store: for QoS 1 a loss. Every QoS 1 message in that channel
	// is also in the inflight store, so a channel as long as maxInflight can
	// never overflow with QoS 1 traffic. The channel is allocated up front:
	// 8 bytes a slot, 512 KiB per connection, which is affordable for the
	// handful of bridges and watchers one server has.
	maxWritesPending = maxInflight

	// maxSessionExpiry is how long (seconds) an offline persistent session
	// is kept: 14 days, twice the longest command TTL (7 days), so a bridge
	// offline for a week still finds its queue; Mosquitto's
	// persistent_client_expiration in mosquitto.conf matches it. Mochi's
	// default (MaxUint32) would keep abandoned sessions forever.
	maxSessionExpiry = 14 * 24 * 60 * 60

	// maxMessageExpiry 0 means "no maximum": mochi then expires a message
	// only when its publisher set an MQTT 5 message expiry. Mochi's default
	// of 86400 would silently drop a command queued for an offline bridge
	// after one day though command TTLs run to 7 days, and would also delete
	// retained status, settings and bridge state a day after they were
	// published. Expiry of commands is the command broker's job (and the
	// bridge drops a command past its expires_at), not the transport's.
	maxMessageExpiry = 0

	// sysTopicInterval is how often (seconds) mochi refreshes its $SYS
	// topics. Nobody may read them here, and each refresh stops the world to
	// read memory statistics, so rarely.
	sysTopicInterval = 600
)

func capabilities() *mqtt.Capabilities {
	c := mqtt.NewDefaultServerCapabilities()
	c.MaximumInflight = maxInflight
	c.MaximumClientWritesPending = maxWritesPending
	c.MaximumSessionExpiryInterval = maxSessionExpiry
	c.MaximumMessageExpiryInterval = maxMessageExpiry
	c.MaximumPacketSize = MaxPacketSize
	return c
}

// Server is a running (or ready to run) embedded broker. Create it with New,
// then Start it; Close stops it.
type Server struct {
	log       *slog.Logger
	listen    string
	tls       *tls.Config
	mochi     *mqtt.Server
	auth      *authHook
	will      *willHook
	hooks     []mqtt.Hook // the four hooks, in the order mochi calls them
	ln        *mochilisten.Listener
	tree      topics.Tree
	grace     time.Duration // Options.KickGrace
	connWait  time.Duration // Options.ConnectTimeout
	mu        sync.Mutex
	started   bool
	closed    bool
	closeErr  error                  // written before closeDone is closed
	closeDone chan struct{}          // closed once the first Close is done
	kicks     map[string]*time.Timer // bridges DisconnectBridge closed, until their grace ends
	// takeovers holds, for each bridge whose connection a login of its
	// own took over within takeoverWindow, when it last was; dups logs
	// the bridges that two processes log in as (takenOver).
	takeovers map[string]time.Time
	dups      *logevery.Log
}

// takeoverWindow is how soon a second takeover of a bridge's connection
// must follow the first for the two to be taken as two processes logging
// in as the bridge: a bridge's reconnects back off to 15 s at most.
const takeoverWindow = time.Minute

// New checks opts and builds a Server. Nothing listens until Start.
func New(opts Options) (*Server, error) {
	if opts.Listen == "" {
		opts.Listen = DefaultListen
	}
	if opts.Topics.Prefix() == "" {
		opts.Topics = topics.MustNew(topics.DefaultPrefix)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.ServerUsername != "" && opts.ServerPassword == "" {
		return nil, errors.New("embedded: ServerUsername given without ServerPassword")
	}
	if opts.ServerUsername == "" && opts.ServerPassword != "" {
		return nil, errors.New("embedded: ServerPassword given without ServerUsername")
	}

	log := opts.Logger.With("component", "mqtt-broker")
	m := mqtt.New(&mqtt.Options{
		Capabilities:           capabilities(),
		Logger:                 slog.New(minLevel{h: log.Handler(), min: slog.LevelWarn}),
		SysTopicResendInterval: sysTopicInterval,
		// The companion server's own connection (NewClient): it publishes
		// and subscribes past every ACL check, as the server account may.
		InlineClient: true,
	})
	if opts.KickGrace <= 0 {
		opts.KickGrace = DefaultKickGrace
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = DefaultConnectTimeout
	}
	if opts.MaxSessions == 0 {
		opts.MaxSessions = DefaultMaxSessions
	}
	s := &Server{log: log, listen: opts.Listen, tls: opts.TLSConfig, mochi: m, tree: opts.Topics, grace: opts.KickGrace,
		connWait: opts.ConnectTimeout, kicks: map[string]*time.Timer{}, takeovers: map[string]time.Time{}, closeDone: make(chan struct{})}
	s.auth = &authHook{
		tree:     opts.Topics,
		accounts: opts.Accounts,
		log:      log,
		noisy:    logevery.New(log, time.Minute, nil),
		clients:  m.Clients,
		ids:      map[*mqtt.Client]Identity{},
		replaced: map[*mqtt.Client]*mqtt.Client{},
		sessions: map[Identity]map[*mqtt.Client]uint64{},
		changed:  map[Identity]uint64{},
		gone:     map[Identity]bool{},
		checked:  map[*mqtt.Client]uint64{},

		maxSessions: max(opts.MaxSessions, 0),
	}
	if opts.ServerUsername != "" {
		s.auth.serverUser = companion.HashSecret(opts.ServerUsername)
		s.auth.serverPass = companion.HashSecret(opts.ServerPassword)
		s.auth.hasServer = true
	}
	s.auth.drop = s.dropQueued
	s.auth.kick = s.kickLate
	s.auth.takenOver = s.takenOver
	s.dups = logevery.New(log, time.Hour, nil)
	s.auth.discard = s.discardSession
	s.auth.connected = func(id Identity) {
		if id.Role == RoleBridge {
			s.bridgeBack(id.ID)
		}
	}
	s.will = &willHook{wills: map[*mqtt.Client]*willState{}}
	// Four hooks, one job each: who may do what, queued messages resent in
	// publish order, incoming packets kept off the ids of queued ones, the
	// Wills the server holds kept from being published. The order matters:
	// what the first drops from a queue the second does not put in order.
	s.hooks = []mqtt.Hook{
		s.auth,
		&orderHook{clients: m.Clients, seqs: map[string]map[uint16]uint64{}},
		&packetIDHook{log: log, clients: m.Clients, lastOut: map[string]uint16{}, moved: map[*mqtt.Client]movedID{}},
		s.will,
	}
	for _, h := range s.hooks {
		if err := m.AddHook(h, nil); err != nil {
			return nil, fmt.Errorf("embedded: %w", err)
		}
	}
	return s, nil
}

// Start binds the listener and starts serving. It returns once the listener
// is bound, so a client may connect to Addr as soon as it returns.
func (s *Server) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return errors.New("embedded: server is closed")
	case s.started:
		return errors.New("embedded: server already started")
	}
	ln := mochilisten.New("companion-tcp", "tcp", s.listen, s.log)
	ln.TLS = s.tls
	ln.ConnectTimeout = s.connWait
	ln.Ended = s.connectionEnded
	ln.Disconnect = func() {
		for _, cl := range s.mochi.Clients.GetAll() {
			if cl.Net.Listener == ln.ID() && !cl.Closed() {
				_ = s.mochi.DisconnectClient(cl, packets.ErrServerShuttingDown)
			}
		}
	}
	if err := s.mochi.AddListener(ln); err != nil {
		return fmt.Errorf("embedded: listen on %s: %w", s.listen, err)
	}
	if err := s.mochi.Serve(); err != nil {
		ln.Abandon()
		return fmt.Errorf("embedded: serve: %w", err)
	}
	s.ln = ln
	s.started = true
	s.log.Info("mqtt broker listening", "addr", ln.Address())
	return nil
}

func (s *Server) isStarted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.started && !s.closed
}

// Addr returns the address the broker listens on (host:port), or "" before
// Start. With a Listen port of 0 it holds the port actually bound.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln == nil {
		return ""
	}
	return s.ln.Address()
}

// Close disconnects every client, stops the listener and returns once the
// accept loop and every connection's goroutine have ended, so the port is
// free when it returns. (Mochi's own Close does not wait for them.) Calling
// Close again returns the first result.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		<-s.closeDone // a Close under way
		return s.closeErr
	}
	s.closed = true
	for _, t := range s.kicks {
		t.Stop()
	}
	started := s.started
	s.mu.Unlock()
	defer close(s.closeDone)
	if !started {
		return nil
	}
	// Not under mu: mochi's Close waits for every connection's goroutine,
	// and a bridge logging in meanwhile takes mu (bridgeBack). Held, a
	// server stopped as its bridge reconnected hung for good
	// (docs/reliability.md, bug 231).
	s.closeErr = s.mochi.Close()
	s.ln.Wait()
	s.log.Info("mqtt broker stopped")
	return s.closeErr
}

// DisconnectBridge closes the connections of the bridge's clients, as
// Mosquitto's dynamic-security plugin does to the clients of a role that
// changed. Call it when the devices the bridge serves change (CONTRACT §9):
// the bridge connects again and subscribes anew under its new rights
// (a subscription refused before is granted now), and the server resends
// its devices' unfinished commands once it says it is online. Sessions
// stay (DeleteBridge discards them), and what a session queued for a
// device the bridge no longer serves is dropped when the bridge resumes
// it. A login of the bridge under way, which checked its secret before the
// call and is not connected yet, is closed once it is (kickLate): a new
// secret ends the old one's logins too (docs/reliability.md, bug 300). It
// returns how many connections it closed.
//
// The bridge's Will is not published as its connection closes, as the
// plugin kicks a client without it: published, every device of the bridge
// read offline, for watchers and in the store, each time one of them moved,
// until the bridge was back a moment later. Should the bridge not connect
// again within the grace (Options.KickGrace), its Will is published then.
func (s *Server) DisconnectBridge(bridgeID string) int {
	s.auth.credentialsChanged(Identity{Role: RoleBridge, ID: bridgeID}, false)
	n, wills := 0, 0
	for _, cl := range s.mochi.Clients.GetAll() {
		if id, ok := s.auth.identity(cl); ok && id.Role == RoleBridge && id.ID == bridgeID && !cl.Closed() {
			if s.will.hold(cl) {
				wills++
			}
			_ = s.mochi.DisconnectClient(cl, packets.ErrNotAuthorized)
			n++
		}
	}
	if wills > 0 {
		s.holdWill(bridgeID)
	}
	if n > 0 {
		s.log.Info("bridge disconnected: its devices or its secret changed", "bridge_id", bridgeID, "connections", n)
	}
	return n
}

// takenOver is told of cl's login, which takes over the session of
// existing, a client still connected under the client id. Of a bridge's
// own login, the Will of the connection taken over is held as
// DisconnectBridge holds one (holdWill): published, every device of the
// bridge read offline, for watchers and in the store, until the new
// connection's "online" a moment later, at every takeover; and two
// bridge processes started with the same id and secret take the
// connection from each other for as long as both run. Mosquitto
// publishes no Will on a takeover either. A takeover following another
// within takeoverWindow is logged as such, once an hour a bridge: the
// operator has two processes to find (docs/reliability.md, bug 454).
func (s *Server) takenOver(cl, existing *mqtt.Client) {
	id, ok := s.auth.identity(cl)
	old, known := s.auth.identity(existing)
	if !ok || !known || id != old || id.Role != RoleBridge {
		return
	}
	if s.will.hold(existing) {
		s.holdWill(id.ID)
	}
	now := time.Now()
	s.mu.Lock()
	last, again := s.takeovers[id.ID]
	again = again && now.Sub(last) < takeoverWindow
	for b, at := range s.takeovers {
		if now.Sub(at) >= takeoverWindow {
			delete(s.takeovers, b)
		}
	}
	s.takeovers[id.ID] = now
	s.mu.Unlock()
	if !again {
		s.log.Info("a login of the bridge took over its connection still open", "bridge_id", id.ID,
			"client_id", cl.ID, "remote", cl.Net.Remote, "taken_over_remote", existing.Net.Remote)
		return
	}
	s.dups.Warn(id.ID, "two connections log in as the same bridge, each closing the other: "+
		"two bridge processes run with its --bridge-id and secret; stop one", "bridge_id", id.ID,
		"client_id", cl.ID, "remote", cl.Net.Remote, "taken_over_remote", existing.Net.Remote)
}

// kickLate closes a client whose login checked its credentials before a
// change DisconnectBridge, DisconnectUser or DeleteBridge (deleted) was
// told of, and which they did not find connected (bugs 300 and 307), as
// they close those they find.
func (s *Server) kickLate(cl *mqtt.Client, id Identity, deleted bool) {
	if deleted {
		// As DeleteBridge closes a connection it finds: its session goes
		// too, so that a bridge made later under the id inherits nothing.
		_ = s.mochi.DisconnectClient(cl, packets.ErrNotAuthorized)
		if !endsWithConnection(cl) {
			s.discardSession(cl)
		}
		s.log.Info("mqtt client disconnected: its bridge was deleted as it logged in", "id", id.ID, "client_id", cl.ID)
		return
	}
	if id.Role == RoleBridge && s.will.hold(cl) {
		s.holdWill(id.ID)
	}
	_ = s.mochi.DisconnectClient(cl, packets.ErrNotAuthorized)
	s.log.Info("mqtt client disconnected: its account changed as it logged in", "role", id.Role, "id", id.ID, "client_id", cl.ID)
}

// holdWill publishes the Will of a bridge DisconnectBridge closed, its
// state "offline" (CONTRACT §3), once the grace has passed, unless the
// bridge has connected again by then (bridgeBack), or is connected.
func (s *Server) holdWill(bridgeID string) {
	topic, err := s.tree.BridgeState(bridgeID)
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	if t := s.kicks[bridgeID]; t != nil {
		t.Stop()
	}
	s.kicks[bridgeID] = time.AfterFunc(s.grace, func() {
		s.mu.Lock()
		delete(s.kicks, bridgeID)
		closed := s.closed
		s.mu.Unlock()
		if closed || s.bridgeConnected(bridgeID) {
			return
		}
		s.log.Info("bridge not back after it was disconnected; publishing its Will", "bridge_id", bridgeID)
		if err := s.mochi.Publish(topic, []byte(topics.BridgeOffline), true, 1); err != nil {
			s.log.Warn("publishing the Will of a bridge not back", "bridge_id", bridgeID, "err", err)
		}
	})
}

// bridgeBack drops the Will held for a bridge (holdWill): it connected
// again.
func (s *Server) bridgeBack(bridgeID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t := s.kicks[bridgeID]; t != nil {
		t.Stop()
		delete(s.kicks, bridgeID)
	}
}

// bridgeConnected reports whether a client of the bridge is connected.
func (s *Server) bridgeConnected(bridgeID string) bool {
	for _, cl := range s.mochi.Clients.GetAll() {
		if id, ok := s.auth.identity(cl); ok && id.Role == RoleBridge && id.ID == bridgeID && !cl.Closed() {
			return true
		}
	}
	return false
}

// DisconnectUser closes the connections of the user's clients: their
// token changed, and the broker, which asks the store at each login,
// refuses the old one from now on. A login under way with the old token
// is closed once connected, as DisconnectBridge does. Sessions stay. It
// returns how many connections it closed.
func (s *Server) DisconnectUser(userID string) int {
	s.auth.credentialsChanged(Identity{Role: RoleUser, ID: userID}, false)
	n := 0
	for _, cl := range s.mochi.Clients.GetAll() {
		if id, ok := s.auth.identity(cl); ok && id.Role == RoleUser && id.ID == userID && !cl.Closed() {
			_ = s.mochi.DisconnectClient(cl, packets.ErrNotAuthorized)
			n++
		}
	}
	if n > 0 {
		s.log.Info("user disconnected: their token changed", "user_id", userID, "connections", n)
	}
	return n
}

// DeleteBridge closes the connections of a bridge that no longer exists
// and discards its sessions, subscriptions and queued messages, so that a
// bridge created later under the same id (by anyone) starts with nothing of
// the old one's. Call it instead of DisconnectBridge when the bridge is
// deleted. It returns how many connections it closed.
func (s *Server) DeleteBridge(bridgeID string) int {
	// A login of the bridge under way, which checked its secret before the
	// deletion and is not connected yet, is closed once it is, its session
	// discarded (kickLate): it stayed connected as the deleted bridge
	// (docs/reliability.md, bug 307).
	s.auth.credentialsChanged(Identity{Role: RoleBridge, ID: bridgeID}, true)
	n, sessions := 0, 0
	for _, cl := range s.mochi.Clients.GetAll() {
		if id, ok := s.auth.identity(cl); !ok || id.Role != RoleBridge || id.ID != bridgeID {
			continue
		}
		if !cl.Closed() {
			_ = s.mochi.DisconnectClient(cl, packets.ErrNotAuthorized)
			n++
		}
		if !endsWithConnection(cl) && s.discardSession(cl) {
			sessions++
		}
	}
	if sessions > 0 {
		s.log.Info("bridge deleted: its sessions discarded", "bridge_id", bridgeID,
			"connections", n, "sessions", sessions)
	}
	return n
}

// testHookEnded, when set, is called as each connection ends, once mochi
// is done with it (its Will published, if it was to be): a test awaits it.
var testHookEnded atomic.Pointer[func()]

// connectionEnded ends the session of a client let in on conn whose
// session was never established: mochi, failing to write its CONNACK (the
// client hung up as its login was checked), returns without telling the
// hooks, and leaves the client among its clients. A clean session stayed
// there until it expired, two weeks later, with its write queue of 512 KiB,
// and its login, never established, kept the login check from forgetting
// the changes of credentials it notes (docs/reliability.md, bug 316). A
// persistent session stays, as any session left by a client that went.
func (s *Server) connectionEnded(conn net.Conn) {
	if h := testHookEnded.Load(); h != nil {
		(*h)()
	}
	cl := s.auth.unestablished(conn)
	if cl == nil {
		return
	}
	s.will.forget(cl)
	if endsWithConnection(cl) && !s.discardSession(cl) {
		s.auth.forgetClient(cl)
	}
	s.log.Info("mqtt client gone before its session was established", "client_id", cl.ID, "remote", cl.Net.Remote)
}

// discardSession ends cl's session as mochi ends one that expires with
// its connection (a clean session): its queue dropped, its subscriptions
// removed, the client forgotten, and the hooks told as when a persistent
// session expires. A client that has just taken over cl's id keeps its
// own. It reports whether it discarded anything.
func (s *Server) discardSession(cl *mqtt.Client) bool {
	if cur, ok := s.mochi.Clients.Get(cl.ID); !ok || cur != cl {
		return false
	}
	cl.ClearInflights()
	s.mochi.UnsubscribeClient(cl)
	s.mochi.Clients.Delete(cl.ID)
	for _, h := range s.hooks {
		if h.Provides(mqtt.OnClientExpired) {
			h.OnClientExpired(cl)
		}
	}
	return true
}

// endsWithConnection says whether mochi ends cl's session itself when its
// connection closes (a clean session). Such a session is left to mochi:
// ended here first, mochi's own cleanup would then remove by id a client
// that took the id in between.
func endsWithConnection(cl *mqtt.Client) bool {
	if cl.Properties.ProtocolVersion < 5 {
		return cl.Properties.Clean
	}
	return cl.Properties.Props.SessionExpiryInterval == 0
}

// dropQueued removes a QoS 1 or 2 message on its way to cl from cl's
// session as mochi drops one: the broker's inflight count and cl's send
// quota give it back, and the hooks hear OnQosDropped.
func (s *Server) dropQueued(cl *mqtt.Client, pk packets.Packet) {
	if !cl.State.Inflight.Delete(pk.PacketID) {
		return
	}
	atomic.AddInt64(&s.mochi.Info.Inflight, -1)
	cl.State.Inflight.IncreaseSendQuota()
	for _, h := range s.hooks {
		if h.Provides(mqtt.OnQosDropped) {
			h.OnQosDropped(cl, pk)
		}
	}
}

// Stats are the broker's message counters since Start.
type Stats struct {
	MessagesReceived int64 `json:"messages_received"` // PUBLISH packets from clients
	MessagesSent     int64 `json:"messages_sent"`     // PUBLISH packets to clients
	MessagesDropped  int64 `json:"messages_dropped"`  // dropped for a slow subscriber
	InflightDropped  int64 `json:"inflight_dropped"`  // dropped past a client's inflight quota
}

// Stats returns the broker's message counters.
func (s *Server) Stats() Stats {
	i := s.mochi.Info.Clone()
	return Stats{
		MessagesReceived: i.MessagesReceived,
		MessagesSent:     i.MessagesSent,
		MessagesDropped:  i.MessagesDropped,
		InflightDropped:  i.InflightDropped,
	}
}

// minLevel passes on records at min or above; mochi logs every connection
// and hook at Info, which is noise in the server's log.
type minLevel struct {
	h   slog.Handler
	min slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.h.Enabled(ctx, l)
}

// Handle passes r on with each packet mochi attaches (its "error
// processing packet" line) told by its kind, id and topic only: mochi
// logs the whole packet, and a CONNECT's holds its password (a bridge's
// secret, a user's API token), a PUBLISH's its payload (bug 381).
func (m minLevel) Handle(ctx context.Context, r slog.Record) error {
	packet := false
	r.Attrs(func(a slog.Attr) bool {
		_, packet = a.Value.Any().(packets.Packet)
		return !packet
	})
	if !packet {
		return m.h.Handle(ctx, r)
	}
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		if pk, ok := a.Value.Any().(packets.Packet); ok {
			a.Value = slog.StringValue(packetSummary(pk))
		}
		out.AddAttrs(a)
		return true
	})
	return m.h.Handle(ctx, out)
}

// packetSummary tells a packet without its credentials or payload.
func packetSummary(pk packets.Packet) string {
	name, ok := packets.PacketNames[pk.FixedHeader.Type]
	if !ok {
		name = "type " + strconv.Itoa(int(pk.FixedHeader.Type))
	}
	out := name
	if pk.PacketID != 0 {
		out += " id " + strconv.Itoa(int(pk.PacketID))
	}
	if pk.TopicName != "" {
		out += " topic " + strconv.Quote(pk.TopicName)
	}
	if pk.FixedHeader.Type == packets.Publish {
		out += " payload " + strconv.Itoa(len(pk.Payload)) + " bytes"
	}
	return out
}

func (m minLevel) WithAttrs(as []slog.Attr) slog.Handler {
	return minLevel{h: m.h.WithAttrs(as), min: m.min}
}

func (m minLevel) WithGroup(name string) slog.Handler {
	return minLevel{h: m.h.WithGroup(name), min: m.min}
}
