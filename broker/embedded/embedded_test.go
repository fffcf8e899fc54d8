package embedded_test

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

const (
	serverUser = "companion-server"
	serverPass = "server-secret"
	wait       = 5 * time.Second
)

var tree = topics.MustNew(topics.DefaultPrefix)

// fakeAccounts is the Accounts of the tests: bridges and users with
// passwords, and which user owns which device.
type fakeAccounts struct {
	mu      sync.Mutex
	bridges map[string]string          // bridge id → secret
	users   map[string]string          // user id → token
	owns    map[string]map[string]bool // user id → device ids
	serves  map[string]string          // device id → bridge id
}

func newFakeAccounts() *fakeAccounts {
	return &fakeAccounts{
		bridges: map[string]string{"bridge-1": "b1-secret", "bridge-2": "b2-secret"},
		users:   map[string]string{"alice": "alice-token", "bob": "bob-token"},
		owns: map[string]map[string]bool{
			"alice": {"dev-1": true, "dev-3": true},
			"bob":   {"dev-2": true},
		},
		serves: map[string]string{"dev-1": "bridge-1", "dev-3": "bridge-1", "dev-2": "bridge-2"},
	}
}

func (f *fakeAccounts) BridgeServesDevice(_ context.Context, bridgeID, deviceID string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.serves[deviceID] == bridgeID
}

func (f *fakeAccounts) move(deviceID, bridgeID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.serves[deviceID] = bridgeID
}

func (f *fakeAccounts) Authenticate(_ context.Context, username, password string) (embedded.Identity, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.bridges[username]; ok && s == password {
		return embedded.Identity{Role: embedded.RoleBridge, ID: username}, true
	}
	if s, ok := f.users[username]; ok && s == password {
		return embedded.Identity{Role: embedded.RoleUser, ID: username}, true
	}
	return embedded.Identity{}, false
}

func (f *fakeAccounts) UserOwnsDevice(_ context.Context, userID, deviceID string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.owns[userID][deviceID]
}

func (f *fakeAccounts) unbind(userID, deviceID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.owns[userID], deviceID)
}

func startBroker(t *testing.T, acc embedded.Accounts) *embedded.Server {
	t.Helper()
	return startBrokerWith(t, embedded.Options{Accounts: acc})
}

// startBrokerWith starts a broker of opts on a free port of loopback, with
// the server's account of the tests.
func startBrokerWith(t *testing.T, opts embedded.Options) *embedded.Server {
	t.Helper()
	opts.Listen, opts.ServerUsername, opts.ServerPassword = "127.0.0.1:0", serverUser, serverPass
	s, err := embedded.New(opts)
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// client is a paho client whose every message lands in msgs and whose
// connection loss is reported on lost.
type client struct {
	mqtt.Client
	msgs           chan mqtt.Message
	lost           chan error
	overflow       atomic.Int64
	sessionPresent bool // the CONNACK's: the broker resumed a session
}

var clientSeq atomic.Int64

func dial(t *testing.T, addr, user, pass string, mod func(*mqtt.ClientOptions)) (*client, error) {
	t.Helper()
	c := &client{msgs: make(chan mqtt.Message, 20000), lost: make(chan error, 1)}
	o := mqtt.NewClientOptions().
		AddBroker("tcp://" + addr).
		SetClientID(fmt.Sprintf("test-%d", clientSeq.Add(1))).
		SetUsername(user).
		SetPassword(pass).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(wait).
		SetOrderMatters(true).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
			select {
			case c.msgs <- m:
			default:
				c.overflow.Add(1)
			}
		}).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) {
			select {
			case c.lost <- err:
			default:
			}
		})
	if mod != nil {
		mod(o)
	}
	c.Client = mqtt.NewClient(o)
	tok := c.Connect()
	if err := mqtt.WaitTokenTimeout(tok, wait); err != nil {
		return nil, err
	}
	c.sessionPresent = tok.(*mqtt.ConnectToken).SessionPresent()
	t.Cleanup(func() {
		if c.IsConnected() {
			c.Disconnect(100)
		}
	})
	return c, nil
}

func mustDial(t *testing.T, addr, user, pass string, mod func(*mqtt.ClientOptions)) *client {
	t.Helper()
	c, err := dial(t, addr, user, pass, mod)
	require.NoError(t, err, "connect as %q", user)
	return c
}

// subscribe returns the SUBACK code for filter: the granted QoS, or 0x80.
func (c *client) subscribe(t *testing.T, filter string) byte {
	t.Helper()
	tok := c.Subscribe(filter, 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait), "subscribe %q", filter)
	code, ok := tok.(*mqtt.SubscribeToken).Result()[filter]
	require.True(t, ok, "no result for %q", filter)
	return code
}

func (c *client) publish(t *testing.T, topic string, retained bool, payload string) {
	t.Helper()
	require.NoError(t, mqtt.WaitTokenTimeout(c.Publish(topic, 1, retained, payload), wait), "publish %q", topic)
}

// handedOut returns once the broker has handed every message c published
// to its subscribers (or their sessions' queues). Mochi acknowledges a
// QoS 1 publish before it hands it out, but takes one client's packets in
// turn: once one more publish is acknowledged, those before it are out.
func (c *client) handedOut(t *testing.T) {
	t.Helper()
	c.publish(t, tp(tree.Status("dev-nobody-reads")), false, "")
}

// next returns the next message, failing the test after a few seconds.
func (c *client) next(t *testing.T) mqtt.Message {
	t.Helper()
	select {
	case m := <-c.msgs:
		return m
	case <-time.After(wait):
		t.Fatal("no message arrived")
		return nil
	}
}

// waitLost waits until the broker drops the connection.
func (c *client) waitLost(t *testing.T) {
	t.Helper()
	select {
	case <-c.lost:
	case <-time.After(wait):
		t.Fatal("the broker did not drop the connection")
	}
}

// tp unwraps a topic builder's result; the ids in these tests are valid.
func tp(s string, err error) string {
	if err != nil {
		panic(err)
	}
	return s
}

func TestConnectRefused(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	tests := []struct{ name, user, pass string }{
		{"anonymous", "", ""},
		{"username without password", "bridge-1", ""},
		{"bridge wrong secret", "bridge-1", "nope"},
		{"server wrong password", serverUser, "nope"},
		{"server username with a bridge secret", serverUser, "b1-secret"},
		{"user wrong token", "alice", "bob-token"},
		{"unknown account", "mallory", "x"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := dial(t, s.Addr(), tt.user, tt.pass, nil)
			require.Error(t, err, "connect(%q, %q) succeeded; want refused", tt.user, tt.pass)
		})
	}
}

func TestNilAccountsAdmitsOnlyServer(t *testing.T) {
	s := startBroker(t, nil)
	mustDial(t, s.Addr(), serverUser, serverPass, nil)
	_, err := dial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	require.Error(t, err)
}

func TestServerMayDoAnythingUnderPrefix(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)

	require.Equal(t, byte(0x80), srv.subscribe(t, "#"), "outside the prefix")
	require.Equal(t, byte(0x80), srv.subscribe(t, "$SYS/#"))
	require.Equal(t, byte(1), srv.subscribe(t, tree.Prefix()+"/#"))

	for _, topic := range []string{
		tp(tree.Command("dev-1", topics.OpPushText)),
		tp(tree.Replies("dev-1")),
		tp(tree.Status("dev-1")),
		tp(tree.BridgeState("bridge-9")),
	} {
		srv.publish(t, topic, false, "x")
		require.Equal(t, topic, srv.next(t).Topic())
	}
}

func TestBridgeRules(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.Prefix()+"/#"))
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)

	cmdFilter := tp(tree.CommandsFilter("dev-1"))
	subs := []struct {
		filter string
		want   byte
	}{
		{cmdFilter, 1},
		{strings.TrimSuffix(cmdFilter, "+") + "#", 1},
		{tp(tree.CommandsFilter("dev-2")), 0x80}, // bridge-2's device
		{tp(tree.CommandsFilter("dev-9")), 0x80}, // nobody's
		{tree.Prefix() + "/devices/+/commands/+", 0x80},
		{tree.Prefix() + "/devices/+/commands/#", 0x80},
		{tp(tree.Replies("dev-1")), 0x80},
		{tp(tree.Status("dev-1")), 0x80},
		{tree.AllStatus(), 0x80},
		{tree.AllReplies(), 0x80},
		{tree.AllBridgeStates(), 0x80},
		{tree.Prefix() + "/#", 0x80},
		{"#", 0x80},
	}
	for _, sub := range subs {
		if got := br.subscribe(t, sub.filter); got != sub.want {
			t.Errorf("bridge subscribe(%q) = %#x; want %#x", sub.filter, got, sub.want)
		}
	}

	// What a bridge may publish reaches the server.
	for _, topic := range []string{
		tp(tree.Replies("dev-1")),
		tp(tree.Status("dev-1")),
		tp(tree.Settings("dev-1")),
		tp(tree.BridgeState("bridge-1")),
	} {
		br.publish(t, topic, false, "ok")
		require.Equal(t, topic, srv.next(t).Topic())
	}

	// What it may not is dropped: on one connection mochi handles packets
	// in order, so had the refused ones gone through they would arrive
	// before the marker.
	cmdTopic := tp(tree.Command("dev-1", topics.OpPushText))
	br.Publish(cmdTopic, 0, false, "forged")
	br.Publish(tp(tree.BridgeState("bridge-2")), 0, false, "offline")
	br.Publish(tree.Prefix()+"/anything", 0, false, "x")
	// Nor what belongs to a device another bridge serves.
	br.Publish(tp(tree.Replies("dev-2")), 0, false, "forged")
	br.Publish(tp(tree.Status("dev-2")), 0, false, "forged")
	br.Publish(tp(tree.Settings("dev-2")), 0, false, "forged")
	marker := tp(tree.Status("dev-1"))
	br.publish(t, marker, false, "marker")
	m := srv.next(t)
	require.Equal(t, marker, m.Topic())
	require.Equal(t, "marker", string(m.Payload()))

	// At QoS 1, what belongs to another bridge's device is acknowledged
	// and dropped, as Mosquitto does: the connection stays, so a bridge
	// whose list names a device that moved away keeps serving the others.
	br.publish(t, tp(tree.Status("dev-2")), true, "forged")
	br.publish(t, marker, false, "marker 2")
	m = srv.next(t)
	require.Equal(t, marker, m.Topic())
	require.Equal(t, "marker 2", string(m.Payload()))
	require.True(t, br.IsConnectionOpen())
	late := mustDial(t, s.Addr(), serverUser, serverPass, func(o *mqtt.ClientOptions) { o.SetClientID("late-server") })
	require.Equal(t, byte(1), late.subscribe(t, tp(tree.Status("dev-2"))))
	late.publish(t, tp(tree.Status("dev-2")), false, "marker 3")
	require.Equal(t, "marker 3", string(late.next(t).Payload()), "the dropped status was retained")

	// A refused QoS 1 publish on a topic no bridge may use closes an MQTT
	// 3.1.1 connection (there is no way to say no in a PUBACK before
	// MQTT 5).
	br.Publish(cmdTopic, 1, false, "forged")
	br.waitLost(t)
}

// Moving a device moves its rights at once, for a bridge that is
// connected and subscribed: the bridge it left receives nothing more of it
// and may publish nothing for it; the one it joined may.
func TestBridgeRightsFollowAMove(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.AllReplies()))
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	b2 := mustDial(t, s.Addr(), "bridge-2", "b2-secret", nil)
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-3"))))
	require.Equal(t, byte(0x80), b2.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	cmd1, cmd3 := tp(tree.Command("dev-1", topics.OpPushText)), tp(tree.Command("dev-3", topics.OpPushText))

	srv.publish(t, cmd1, false, "before")
	require.Equal(t, "before", string(b1.next(t).Payload()))

	acc.move("dev-1", "bridge-2")
	srv.publish(t, cmd1, false, "after")
	srv.publish(t, cmd3, false, "marker")
	require.Equal(t, "marker", string(b1.next(t).Payload()), "bridge-1 still got dev-1's command after the move")

	// bridge-1's reply for dev-1 is dropped (acknowledged, so that its
	// connection and its other devices stay); bridge-2's goes through.
	b1.publish(t, tp(tree.Replies("dev-1")), false, "from bridge-1")
	require.Equal(t, byte(1), b2.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	b2.publish(t, tp(tree.Replies("dev-1")), false, "from bridge-2")
	require.Equal(t, "from bridge-2", string(srv.next(t).Payload()))
	srv.publish(t, cmd1, false, "to bridge-2")
	require.Equal(t, "to bridge-2", string(b2.next(t).Payload()))
}

// DisconnectBridge closes the connections of that bridge and no other,
// and keeps its persistent session: the bridge connects again, its old
// subscriptions still there, and a subscription refused before a move is
// granted after it.
func TestDisconnectBridge(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	persistent := func(o *mqtt.ClientOptions) { o.SetClientID("bridge-1-session").SetCleanSession(false) }
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", persistent)
	b2 := mustDial(t, s.Addr(), "bridge-2", "b2-secret", nil)
	u := mustDial(t, s.Addr(), "alice", "alice-token", nil)
	cmd1, cmd2 := tp(tree.Command("dev-1", topics.OpPushText)), tp(tree.Command("dev-2", topics.OpPushText))
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	require.Equal(t, byte(0x80), b1.subscribe(t, tp(tree.CommandsFilter("dev-2"))))

	acc.move("dev-2", "bridge-1")
	require.Equal(t, 0, s.DisconnectBridge("bridge-9"))
	require.Equal(t, 1, s.DisconnectBridge("bridge-1"))
	b1.waitLost(t)
	b2.publish(t, tp(tree.BridgeState("bridge-2")), true, topics.BridgeOnline)
	require.Equal(t, byte(1), u.subscribe(t, tp(tree.DeviceFilter("dev-1"))))
	require.True(t, b2.IsConnectionOpen() && u.IsConnectionOpen(), "another client was disconnected")

	b1 = mustDial(t, s.Addr(), "bridge-1", "b1-secret", persistent)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	srv.publish(t, cmd1, false, "kept")
	require.Equal(t, "kept", string(b1.next(t).Payload()), "the session's subscription")
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-2"))))
	srv.publish(t, cmd2, false, "granted")
	require.Equal(t, "granted", string(b1.next(t).Payload()))
}

// A persistent session's queue is resent to the client that resumes it
// only where that client may read now (CONTRACT §9): a bridge whose device
// moved while it was away, a user who unbound a device, and a bridge id
// deleted and created again by another user (when the server only
// disconnects it) get nothing queued for it before. Each client then gets
// a message it may read, published after: mochi resends a session's
// queue, in order, before anything new, so whatever the queue held would
// arrive first.
func TestResumedSessionGetsOnlyWhatItMayRead(t *testing.T) {
	cmd := func(dev string) string { return tp(tree.Command(dev, topics.OpPushText)) }
	for _, tc := range []struct {
		name       string
		user, pass string
		filters    []string
		queued     string                                // topic of the message queued while away
		change     func(*fakeAccounts, *embedded.Server) // while away, after it is queued
		pass2      string                                // password on return
		marker     string                                // topic it may read after the change
		markerSub  string                                // filter subscribed to on return, if any
	}{
		{
			name: "device moved", user: "bridge-1", pass: "b1-secret", pass2: "b1-secret",
			filters: []string{tp(tree.CommandsFilter("dev-1")), tp(tree.CommandsFilter("dev-3"))},
			queued:  cmd("dev-1"),
			change: func(acc *fakeAccounts, s *embedded.Server) {
				acc.move("dev-1", "bridge-2")
				s.DisconnectBridge("bridge-1")
				s.DisconnectBridge("bridge-2")
			},
			marker: cmd("dev-3"),
		},
		{
			name: "device unbound", user: "alice", pass: "alice-token", pass2: "alice-token",
			filters: []string{tp(tree.DeviceFilter("dev-1")), tp(tree.DeviceFilter("dev-3"))},
			queued:  tp(tree.Status("dev-1")),
			change:  func(acc *fakeAccounts, _ *embedded.Server) { acc.unbind("alice", "dev-1") },
			marker:  tp(tree.Status("dev-3")),
		},
		{
			name: "bridge id reused", user: "bridge-1", pass: "b1-secret", pass2: "bob-new-secret",
			filters: []string{tp(tree.CommandsFilter("dev-1"))},
			queued:  cmd("dev-1"),
			change: func(acc *fakeAccounts, s *embedded.Server) {
				// alice deletes bridge-1 (its devices unassigned); bob
				// creates his own bridge-1 and assigns it his dev-2.
				acc.mu.Lock()
				acc.bridges["bridge-1"] = "bob-new-secret"
				acc.serves["dev-1"], acc.serves["dev-3"], acc.serves["dev-2"] = "", "", "bridge-1"
				acc.mu.Unlock()
				s.DisconnectBridge("bridge-1")
			},
			marker: cmd("dev-2"), markerSub: tp(tree.CommandsFilter("dev-2")),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			acc := newFakeAccounts()
			s := startBroker(t, acc)
			session := func(o *mqtt.ClientOptions) { o.SetClientID("persistent-" + tc.user).SetCleanSession(false) }
			c := mustDial(t, s.Addr(), tc.user, tc.pass, session)
			for _, f := range tc.filters {
				require.Equal(t, byte(1), c.subscribe(t, f), "subscribe %q", f)
			}
			c.Disconnect(100)

			srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
			srv.publish(t, tc.queued, false, "queued before the change")
			srv.handedOut(t)
			tc.change(acc, s)

			c = mustDial(t, s.Addr(), tc.user, tc.pass2, session)
			require.True(t, c.sessionPresent, "the session was not resumed")
			if tc.markerSub != "" {
				require.Equal(t, byte(1), c.subscribe(t, tc.markerSub))
			}
			srv.publish(t, tc.marker, false, "marker")
			m := c.next(t)
			require.Equal(t, tc.marker, m.Topic(), "received %q on %s", m.Payload(), m.Topic())
		})
	}
}

// A message dropped from a resumed queue is forgotten by the hook that
// keeps queues in publish order: the next message, which mochi gives the
// dropped one's packet id, takes its place in the order after those
// published before it, not the dropped one's place.
func TestDroppedQueuedMessageLeavesOrder(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	session := func(o *mqtt.ClientOptions) {
		o.SetClientID("bridge-1").SetCleanSession(false).SetAutoAckDisabled(true)
	}
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", session)
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-3"))))
	br.Disconnect(100)
	cmd1, cmd3 := tp(tree.Command("dev-1", topics.OpPushText)), tp(tree.Command("dev-3", topics.OpPushText))

	srv.publish(t, cmd1, false, "moved away") // packet id 1, dropped on return
	srv.publish(t, cmd3, false, "B")          // packet id 2
	srv.handedOut(t)
	acc.move("dev-1", "bridge-2")
	br = mustDial(t, s.Addr(), "bridge-1", "b1-secret", session)
	require.Equal(t, "B", string(br.next(t).Payload()))
	srv.publish(t, cmd3, false, "C") // packet id 1 again
	require.Equal(t, "C", string(br.next(t).Payload()))
	require.Equal(t, 1, s.DisconnectBridge("bridge-1")) // B and C not acknowledged
	br.waitLost(t)
	srv.publish(t, cmd3, false, "D")
	srv.handedOut(t)

	br = mustDial(t, s.Addr(), "bridge-1", "b1-secret", session)
	var got []string
	for range 3 {
		got = append(got, string(br.next(t).Payload()))
	}
	require.Equal(t, []string{"B", "C", "D"}, got)
}

// DeleteBridge discards the bridge's sessions, connected or not: a bridge
// created again under the same id resumes no session (nothing of the old
// one's subscriptions or queue), and the queue of a session the old
// bridge still held open is not resent to anyone.
func TestDeleteBridge(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	offline := func(o *mqtt.ClientOptions) { o.SetClientID("bridge-1-offline").SetCleanSession(false) }
	online := func(o *mqtt.ClientOptions) {
		o.SetClientID("bridge-1-online").SetCleanSession(false).SetAutoAckDisabled(true)
	}
	off := mustDial(t, s.Addr(), "bridge-1", "b1-secret", offline)
	require.Equal(t, byte(1), off.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	require.Equal(t, 1, s.DisconnectBridge("bridge-1")) // closed at once, unlike a client's DISCONNECT
	off.waitLost(t)
	on := mustDial(t, s.Addr(), "bridge-1", "b1-secret", online)
	require.Equal(t, byte(1), on.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	srv.publish(t, tp(tree.Command("dev-1", topics.OpPushText)), false, "alice's note")
	on.next(t) // on its way, not acknowledged

	acc.mu.Lock()
	acc.bridges["bridge-1"] = "bob-new-secret"
	acc.serves["dev-1"], acc.serves["dev-3"], acc.serves["dev-2"] = "", "", "bridge-1"
	acc.mu.Unlock()
	require.Equal(t, 1, s.DeleteBridge("bridge-1"))
	on.waitLost(t)

	for _, mod := range []func(*mqtt.ClientOptions){offline, online} {
		c := mustDial(t, s.Addr(), "bridge-1", "bob-new-secret", mod)
		require.False(t, c.sessionPresent, "%s resumed the deleted bridge's session", clientIDOf(c))
		require.Equal(t, byte(1), c.subscribe(t, tp(tree.CommandsFilter("dev-2"))))
		srv.publish(t, tp(tree.Command("dev-2", topics.OpPushText)), false, "bob's")
		require.Equal(t, "bob's", string(c.next(t).Payload()), clientIDOf(c))
		c.Disconnect(100)
	}
	require.Equal(t, 0, s.DeleteBridge("bridge-9"))
}

// A client's SUBSCRIBE or UNSUBSCRIBE may carry a packet id that one of
// the messages on their way to it holds (the two directions pick their ids
// apart; mochi keeps both in one store and would refuse it with 0x91,
// "packet identifier in use"): a bridge back on its persistent session
// subscribes while its commands arrive. It is granted, its acknowledgement
// carries the client's id (or the token would never complete), and the
// messages on their way stay there.
func TestSubscribeOnAPacketIDInUse(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", func(o *mqtt.ClientOptions) { o.SetAutoAckDisabled(true) })
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	filter := tp(tree.CommandsFilter("dev-1"))
	require.Equal(t, byte(1), b1.subscribe(t, filter)) // the client's packet id 1
	cmd := tp(tree.Command("dev-1", topics.OpPushText))
	// The server's ids for the bridge: 1 and 2, held until acknowledged.
	srv.publish(t, cmd, false, "first")
	srv.publish(t, cmd, false, "second")
	m1, m2 := b1.next(t), b1.next(t)
	require.Equal(t, []string{"first", "second"}, []string{string(m1.Payload()), string(m2.Payload())})

	// The client's next ids, 2 and 3, meet the server's 2.
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-1"))), "a SUBSCRIBE on id 2")
	tok := b1.Unsubscribe(tp(tree.CommandsFilter("dev-1")))
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait), "an UNSUBSCRIBE")
	require.Equal(t, byte(1), b1.subscribe(t, tp(tree.CommandsFilter("dev-1"))))

	m1.Ack()
	m2.Ack()
	srv.publish(t, cmd, false, "third")
	require.Equal(t, "third", string(b1.next(t).Payload()), "after the acknowledgements, nothing of the first two comes again")
}

func TestBridgeWill(t *testing.T) {
	s, err := embedded.New(embedded.Options{Listen: "127.0.0.1:0", Accounts: newFakeAccounts(),
		ServerUsername: serverUser, ServerPassword: serverPass, KickGrace: 500 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	withWill := func(topic string) func(*mqtt.ClientOptions) {
		return func(o *mqtt.ClientOptions) { o.SetWill(topic, topics.BridgeOffline, 1, true) }
	}
	_, err = dial(t, s.Addr(), "bridge-1", "b1-secret", withWill(tp(tree.BridgeState("bridge-2"))))
	require.Error(t, err, "a Will on another bridge's state topic")
	_, err = dial(t, s.Addr(), "bridge-1", "b1-secret", withWill(tp(tree.Status("dev-1"))))
	require.Error(t, err, "a Will on a status topic")
	_, err = dial(t, s.Addr(), "alice", "alice-token", withWill(tp(tree.Status("dev-1"))))
	require.Error(t, err, "a user with a Will")

	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.AllBridgeStates()))
	own := tp(tree.BridgeState("bridge-1"))
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", withWill(own))
	br.publish(t, own, true, topics.BridgeOnline)
	require.Equal(t, topics.BridgeOnline, string(srv.next(t).Payload()))

	// Taking over the first connection's client id from another account is
	// refused; taking it over from the same account is allowed, and the
	// Will of the connection taken over is held (bug 454): the bridge is
	// connected again. The new connection gone without one of its own,
	// the held Will is published once the grace is over.
	_, err = dial(t, s.Addr(), "bridge-2", "b2-secret", func(o *mqtt.ClientOptions) { o.SetClientID(clientIDOf(br)) })
	require.Error(t, err, "bridge-2 taking over bridge-1's session")
	again := mustDial(t, s.Addr(), "bridge-1", "b1-secret", func(o *mqtt.ClientOptions) { o.SetClientID(clientIDOf(br)) })
	br.waitLost(t)
	again.Disconnect(100)
	// QoS 1 is at least once: the earlier "online" may come again first.
	for {
		m := srv.next(t)
		require.Equal(t, own, m.Topic())
		if string(m.Payload()) == topics.BridgeOffline {
			break
		}
		require.Equal(t, topics.BridgeOnline, string(m.Payload()))
	}
}

// The server's client ids (companion-server, companion-server-REPLICA)
// and a bridge's (companion-bridge-ID) belong to them, also while they are
// not connected: after a restart of the broker, a user or another bridge
// that logged in first with one (and kept a persistent session on it)
// would keep the bridge out for as long as it held it.
func TestReservedClientIDs(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	for _, c := range []struct{ name, clientID, user, pass string }{
		{"a user with a bridge's client id", "companion-bridge-bridge-1", "alice", "alice-token"},
		{"another bridge with a bridge's client id", "companion-bridge-bridge-1", "bridge-2", "b2-secret"},
		{"a user with the server's client id", "companion-server", "alice", "alice-token"},
		{"a bridge with a replica's client id", "companion-server-r2", "bridge-1", "b1-secret"},
		{"the server with a bridge's client id", "companion-bridge-bridge-1", serverUser, serverPass},
	} {
		_, err := dial(t, s.Addr(), c.user, c.pass, func(o *mqtt.ClientOptions) {
			o.SetClientID(c.clientID).SetCleanSession(false)
		})
		assert.Error(t, err, "%s: connect(%q as %q) succeeded; want refused", c.name, c.clientID, c.user)
	}
	mustDial(t, s.Addr(), "bridge-1", "b1-secret", func(o *mqtt.ClientOptions) { o.SetClientID("companion-bridge-bridge-1") })
	mustDial(t, s.Addr(), serverUser, serverPass, func(o *mqtt.ClientOptions) { o.SetClientID("companion-server-r2") })
	mustDial(t, s.Addr(), "alice", "alice-token", func(o *mqtt.ClientOptions) { o.SetClientID("companion-user-alice") })
}

func clientIDOf(c *client) string {
	r := c.OptionsReader()
	return r.ClientID()
}

func TestUserRules(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	// A retained status published before the user subscribes. The PUBACK
	// comes before mochi hands the message to subscribers, so wait until
	// the server has it: else the user could get it twice, retained and live.
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.AllStatus()))
	br.publish(t, tp(tree.Status("dev-1")), true, `{"online":true}`)
	srv.next(t)

	u := mustDial(t, s.Addr(), "alice", "alice-token", nil)
	subs := []struct {
		filter string
		want   byte
	}{
		{tp(tree.DeviceFilter("dev-1")), 1},
		{tp(tree.DeviceFilter("dev-3")), 1},
		{tp(tree.DeviceFilter("dev-2")), 0x80}, // bob's
		{tp(tree.Status("dev-2")), 0x80},
		{tree.AllStatus(), 0x80},
		{tree.Prefix() + "/devices/#", 0x80},
		{tree.Prefix() + "/#", 0x80},
		{tree.AllBridgeStates(), 0x80},
	}
	for _, sub := range subs {
		if got := u.subscribe(t, sub.filter); got != sub.want {
			t.Errorf("user subscribe(%q) = %#x; want %#x", sub.filter, got, sub.want)
		}
	}

	m := u.next(t)
	require.Equal(t, tp(tree.Status("dev-1")), m.Topic(), "the retained status")
	require.Equal(t, `{"online":true}`, string(m.Payload()))

	br.publish(t, tp(tree.Status("dev-1")), true, `{"online":false}`)
	m = u.next(t)
	require.Equal(t, `{"online":false}`, string(m.Payload()))

	// After an unbind, nothing more of dev-1 reaches alice, even on the
	// subscription she already has; dev-3 (published after) still does.
	acc.unbind("alice", "dev-1")
	br.publish(t, tp(tree.Status("dev-1")), true, "after unbind")
	br.publish(t, tp(tree.Status("dev-3")), true, "dev-3")
	m = u.next(t)
	require.Equal(t, tp(tree.Status("dev-3")), m.Topic())
	require.Equal(t, byte(0x80), u.subscribe(t, tp(tree.DeviceFilter("dev-1"))))

	// A user never publishes.
	statusTopic := tp(tree.Status("dev-3"))
	u.Publish(statusTopic, 1, false, "forged")
	u.waitLost(t)
}

// TestOfflineQueue: QoS 1 commands published while a bridge with a
// persistent session is away all arrive when it returns, once each and in
// order, including those that mochi would lose to a packet id clash.
// TestOfflineQueue runs for both of the server's connections: a paho
// client over TCP (a broker of its own) and the in-process one.
func TestOfflineQueue(t *testing.T) {
	for _, inline := range []bool{false, true} {
		t.Run(map[bool]string{false: "tcp", true: "inline"}[inline], func(t *testing.T) {
			testOfflineQueue(t, inline)
		})
	}
}

func testOfflineQueue(t *testing.T, inline bool) {
	const n = 2000
	s := startBroker(t, newFakeAccounts())
	var srv serverConn
	if inline {
		srv = connectInline(t, s, nil, nil)
	} else {
		srv = mustDial(t, s.Addr(), serverUser, serverPass, nil)
	}
	persistent := func(autoAck bool) func(*mqtt.ClientOptions) {
		return func(o *mqtt.ClientOptions) {
			o.SetClientID("bridge-1").SetCleanSession(false).SetAutoAckDisabled(!autoAck)
		}
	}

	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", persistent(true))
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	br.Disconnect(100)

	topic := tp(tree.Command("dev-1", topics.OpPushText))
	toks := make([]mqtt.Token, n)
	for i := range toks {
		toks[i] = srv.Publish(topic, 1, false, strconv.Itoa(i))
	}
	for _, tok := range toks {
		require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	}

	// First return: the bridge takes a few messages without acknowledging
	// them and publishes QoS 1 replies, whose packet ids (1, 2, …) are the
	// ids of the unacknowledged commands. Then it goes away again.
	br = mustDial(t, s.Addr(), "bridge-1", "b1-secret", persistent(false))
	for i := 0; i < 10; i++ {
		m := br.next(t)
		require.Equal(t, strconv.Itoa(i), string(m.Payload()), "message %d", i)
		br.publish(t, tp(tree.Replies("dev-1")), false, "reply")
	}
	br.Disconnect(100)

	// Second return, acknowledging: everything, in order, once.
	br = mustDial(t, s.Addr(), "bridge-1", "b1-secret", persistent(true))
	for i := 0; i < n; i++ {
		m := br.next(t)
		require.Equal(t, strconv.Itoa(i), string(m.Payload()), "message %d", i)
	}
	// Anything duplicated would have been resent before this marker.
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(topic, 1, false, "marker"), wait))
	require.Equal(t, "marker", string(br.next(t).Payload()))
	require.Zero(t, br.overflow.Load())
}

func TestCloseWaits(t *testing.T) {
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
	})
	require.NoError(t, err)
	require.Equal(t, "", s.Addr())
	require.NoError(t, s.Start())
	addr := s.Addr()

	c := mustDial(t, addr, serverUser, serverPass, nil)
	// A connection that never sends CONNECT must not hold Close up.
	raw, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer raw.Close()

	done := make(chan error, 1)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(wait):
		t.Fatal("Close did not return")
	}
	c.waitLost(t)
	require.NoError(t, s.Close(), "a second Close")

	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err, "the port is still taken after Close")
	require.NoError(t, ln.Close())

	// Close has waited for these goroutines to finish their work; give
	// the scheduler a moment to retire them.
	for _, frame := range []string{"internal/mochilisten.(*Listener)", "mochi-mqtt/server/v2.(*Server).attachClient"} {
		deadline := time.Now().Add(time.Second)
		for len(stacksWith(frame)) > 0 && time.Now().Before(deadline) {
			runtime.Gosched()
		}
		require.Empty(t, stacksWith(frame), "goroutines left running after Close")
	}
	require.Error(t, s.Start(), "Start after Close")
}

func stacksWith(frame string) []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var found []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, frame) {
			found = append(found, g)
		}
	}
	return found
}

func TestNewValidates(t *testing.T) {
	_, err := embedded.New(embedded.Options{ServerUsername: "x"})
	require.Error(t, err)
	_, err = embedded.New(embedded.Options{ServerPassword: "x"})
	require.Error(t, err)
	s, err := embedded.New(embedded.Options{})
	require.NoError(t, err)
	require.NoError(t, s.Close(), "Close before Start")
}

// DisconnectBridge closes the bridge's connections without its Will, as
// Mosquitto's plugin kicks a client: a bridge that connects again within
// the grace never reads offline, and so neither do its devices, each time
// one of them moves. One that does not come back has its Will published
// once the grace is over.
func TestDisconnectBridgeHoldsItsWill(t *testing.T) {
	acc := newFakeAccounts()
	s, err := embedded.New(embedded.Options{Listen: "127.0.0.1:0", Accounts: acc,
		ServerUsername: serverUser, ServerPassword: serverPass, KickGrace: 2 * time.Second})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	state := tp(tree.BridgeState("bridge-1"))
	will := func(o *mqtt.ClientOptions) {
		o.SetClientID("bridge-1-session").SetCleanSession(false).SetWill(state, topics.BridgeOffline, 1, true)
	}
	// The watcher subscribes first: subscribed as the bridge's "online"
	// was being published, it could get it twice, live and retained.
	w := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), w.subscribe(t, state))
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", will)
	b1.publish(t, state, true, topics.BridgeOnline)
	require.Equal(t, topics.BridgeOnline, string(w.next(t).Payload()))

	require.Equal(t, 1, s.DisconnectBridge("bridge-1"))
	b1.waitLost(t)
	back := mustDial(t, s.Addr(), "bridge-1", "b1-secret", will) // within the grace
	noWill := func(d time.Duration, why string) {
		t.Helper()
		deadline := time.After(d)
		for {
			select {
			case m := <-w.msgs:
				// The "online" again is not the Will: a QoS 1 message
				// may come twice, and it did once under load in make
				// test (four packages at once).
				if string(m.Payload()) == topics.BridgeOnline {
					continue
				}
				t.Fatalf("the bridge's state read %q %s", m.Payload(), why)
			case <-deadline:
				return
			}
		}
	}
	noWill(time.Second, "as it was disconnected: its Will was published")
	back.Disconnect(250) // a clean disconnect: no Will, and none held for it
	noWill(2500*time.Millisecond, "after it came back within the grace")

	b1 = mustDial(t, s.Addr(), "bridge-1", "b1-secret", will)
	require.Equal(t, 1, s.DisconnectBridge("bridge-1"))
	b1.waitLost(t) // and not back
	require.Equal(t, topics.BridgeOffline, string(w.next(t).Payload()), "the Will of a bridge not back after the grace")
}

// A bridge that logs in while the broker closes (a server stopped as its
// bridge reconnects) does not hang Close. Close held the broker's lock
// while mochi waited for every connection's goroutine, and the login's
// took that lock to note the bridge back: SIGTERM hung the server for good
// (docs/reliability.md, bug 231). The login is held until Close has begun.
func TestCloseWhileABridgeLogsIn(t *testing.T) {
	s, err := embedded.New(embedded.Options{Listen: "127.0.0.1:0", Accounts: newFakeAccounts(),
		ServerUsername: serverUser, ServerPassword: serverPass})
	require.NoError(t, err)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	embedded.HoldLogins(s, func() {
		once.Do(func() { close(entered) })
		<-release
	})
	require.NoError(t, s.Start())
	defer s.Close()
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker("tcp://" + s.Addr()).SetClientID("bridge-1").
		SetUsername("bridge-1").SetPassword("b1-secret").SetAutoReconnect(false))
	c.Connect() // its login held
	select {
	case <-entered:
	case <-time.After(wait):
		t.Fatal("the bridge's login never came")
	}
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	testenv.Eventually(t, wait, "the broker's listener closed", func() bool {
		conn, err := net.Dial("tcp", s.Addr())
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
	close(release)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close hung with a bridge logging in")
	}
}

// holdingAccounts is fakeAccounts whose next Authenticate, once armed,
// calls hold after the credentials were checked, before it answers.
type holdingAccounts struct {
	*fakeAccounts
	armed atomic.Bool
	hold  func()
}

func (h *holdingAccounts) Authenticate(ctx context.Context, username, password string) (embedded.Identity, bool) {
	id, ok := h.fakeAccounts.Authenticate(ctx, username, password)
	if h.armed.CompareAndSwap(true, false) {
		h.hold()
	}
	return id, ok
}

// A login whose credentials were checked just before they changed (a
// bridge's new secret, a user's new token), and which the broker had not
// yet let in as DisconnectBridge or DisconnectUser closed the connections
// of the old ones, is closed too, wherever it was: its credentials being
// checked, or let in and not yet connected. It stayed connected with the
// old secret or token, which the change was to end, with all of its
// rights (docs/reliability.md, bug 300). Likewise a login of a bridge as
// it is deleted (bug 307).
func TestALoginAsItsCredentialsChangeIsClosedToo(t *testing.T) {
	type who struct {
		name, user, old string
		change          func(*fakeAccounts)
		disconnect      func(*embedded.Server) int
	}
	for _, w := range []who{
		{"bridge", "bridge-1", "b1-secret", func(a *fakeAccounts) { a.bridges["bridge-1"] = "b1-new" },
			func(s *embedded.Server) int { return s.DisconnectBridge("bridge-1") }},
		{"user", "alice", "alice-token", func(a *fakeAccounts) { a.users["alice"] = "alice-new" },
			func(s *embedded.Server) int { return s.DisconnectUser("alice") }},
		{"deleted bridge", "bridge-1", "b1-secret", func(a *fakeAccounts) { delete(a.bridges, "bridge-1") },
			func(s *embedded.Server) int { return s.DeleteBridge("bridge-1") }},
	} {
		for _, where := range []string{"checked", "let in"} {
			t.Run(w.name+", "+where, func(t *testing.T) {
				reached, release := make(chan struct{}), make(chan struct{})
				hold := func() {
					close(reached)
					<-release
				}
				acc := &holdingAccounts{fakeAccounts: newFakeAccounts(), hold: hold}
				s, err := embedded.New(embedded.Options{Listen: "127.0.0.1:0", Accounts: acc,
					ServerUsername: serverUser, ServerPassword: serverPass})
				require.NoError(t, err)
				var armed atomic.Bool
				if where == "let in" {
					embedded.HoldLogins(s, func() {
						if armed.CompareAndSwap(true, false) {
							hold()
						}
					})
					armed.Store(true)
				} else {
					acc.armed.Store(true)
				}
				require.NoError(t, s.Start())
				t.Cleanup(func() { require.NoError(t, s.Close()) })

				var c *client
				done := make(chan struct{})
				go func() {
					defer close(done)
					c, err = dial(t, s.Addr(), w.user, w.old, nil)
				}()
				select {
				case <-reached:
				case <-time.After(wait):
					t.Fatal("the login did not reach the hold")
				}
				acc.mu.Lock()
				w.change(acc.fakeAccounts)
				acc.mu.Unlock()
				w.disconnect(s)
				close(release)
				<-done
				if err != nil {
					return // refused: fine
				}
				select {
				case <-c.lost:
				case <-time.After(wait):
					t.Fatal("a connection made with the old credentials is still open")
				}
			})
		}
	}
}

// A user's filter that ends in "+/#" matches a topic at the level of its
// "+" too, "#" standing for no level (MQTT 3.1.1 §4.7.1.2), as Mosquitto
// and NATS have it: devices/DEV/+/# reads the device's status, settings
// and replies, devices/DEV/commands/+/# its commands, live and retained.
// Mochi matched neither (docs/reliability.md, bug 345). A filter with
// more levels than any topic of the device is still refused, and one
// unsubscribed is gone.
func TestAUserFilterEndingInPlusHashMatchesItsParentLevel(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.AllStatus()))
	br.publish(t, tp(tree.Status("dev-1")), true, `{"retained":true}`)
	srv.next(t) // the server has it: retained, not live, for the user

	u := mustDial(t, s.Addr(), "alice", "alice-token", nil)
	dev := tree.Prefix() + "/devices/dev-1"
	for _, f := range []string{dev + "/+/#", dev + "/commands/+/#", dev + "/+/+/#"} {
		require.Equal(t, byte(1), u.subscribe(t, f), f)
	}
	for _, f := range []string{dev + "/status/+/#", dev + "/commands/+/+/#", tree.Prefix() + "/devices/dev-2/+/#"} {
		assert.Equal(t, byte(0x80), u.subscribe(t, f), f)
	}
	m := u.next(t)
	assert.Equal(t, tp(tree.Status("dev-1")), m.Topic(), "the retained status on devices/dev-1/+/#")
	assert.True(t, m.Retained())

	srv.publish(t, tp(tree.Replies("dev-1")), false, `{"reply":1}`)
	srv.publish(t, tp(tree.Command("dev-1", topics.OpPushText)), false, `{"command":1}`)
	for _, want := range []string{tp(tree.Replies("dev-1")), tp(tree.Command("dev-1", topics.OpPushText))} {
		m := u.next(t)
		assert.Equal(t, want, m.Topic(), "%s", m.Payload())
		assert.False(t, m.Retained())
	}

	// Unsubscribed, each filter is gone: nothing more arrives but what the
	// last one left matches.
	require.NoError(t, mqtt.WaitTokenTimeout(u.Unsubscribe(dev+"/+/#", dev+"/commands/+/#"), wait))
	srv.publish(t, tp(tree.Status("dev-1")), false, `{"gone":true}`)
	srv.publish(t, tp(tree.Command("dev-1", topics.OpPushText)), false, `{"command":2}`)
	m = u.next(t)
	assert.Equal(t, tp(tree.Command("dev-1", topics.OpPushText)), m.Topic(), "devices/dev-1/+/+/#: %s", m.Payload())
	assert.Equal(t, `{"command":2}`, string(m.Payload()))
	select {
	case m := <-u.msgs:
		t.Errorf("a message after the last: %s %s", m.Topic(), m.Payload())
	default:
	}
}

// DisconnectBridge closing a bridge's connection as the bridge itself
// disconnects cleanly is no data race: it cleared the connection's Will
// flag in place, as mochi, on the connection's own goroutine, resets the
// Will of a clean disconnect, and go test -race failed the suite
// (docs/reliability.md, bug 462). The Will is held through a hook instead,
// which mochi calls on the connection's goroutine.
func TestDisconnectBridgeAsItDisconnectsItself(t *testing.T) {
	acc := newFakeAccounts()
	s := startBroker(t, acc)
	state := tp(tree.BridgeState("bridge-1"))
	will := func(o *mqtt.ClientOptions) {
		o.SetClientID("bridge-1-session").SetCleanSession(false).SetWill(state, topics.BridgeOffline, 1, true)
	}
	stop, kicked := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(kicked)
		for {
			select {
			case <-stop:
				return
			default:
				s.DisconnectBridge("bridge-1")
			}
		}
	}()
	for range 100 {
		if b, err := dial(t, s.Addr(), "bridge-1", "b1-secret", will); err == nil {
			b.Disconnect(0)
		}
	}
	close(stop)
	<-kicked
	// Each connection, ended one way or the other, is forgotten.
	require.Eventually(t, func() bool { return embedded.Wills(s) == 0 }, wait, 10*time.Millisecond,
		"the Will hook still knows %d connections", embedded.Wills(s))
}
