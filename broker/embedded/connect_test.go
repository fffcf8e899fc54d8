package embedded_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/testenv"
)

// TestConnectionWithoutConnectIsCut: a connection that does not send its
// CONNECT within ConnectTimeout is closed, whoever opened it: before, one
// that sent nothing, or a CONNECT's first bytes and no more, was kept for
// ever, each with two goroutines, a file descriptor and a 512 KiB write
// queue, so that anyone who could reach the port could take the server's
// memory or descriptors without an account. A client that did connect
// stays, idle for longer than ConnectTimeout: its keepalive governs it.
func TestConnectionWithoutConnectIsCut(t *testing.T) {
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
		ConnectTimeout: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	alice := mustDial(t, s.Addr(), "alice", "alice-token", func(o *mqtt.ClientOptions) {
		o.SetKeepAlive(30 * time.Second)
	})
	for _, tt := range []struct {
		name string
		send []byte
	}{
		{"nothing", nil},
		// A CONNECT's fixed header announcing 200 KiB, none of which comes.
		{"a CONNECT's first bytes", []byte{0x10, 0x80, 0x80, 0x0c}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", s.Addr())
			require.NoError(t, err)
			defer conn.Close()
			if tt.send != nil {
				_, err = conn.Write(tt.send)
				require.NoError(t, err)
			}
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(wait)))
			_, err = conn.Read(make([]byte, 1))
			require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the broker kept a connection that sent no CONNECT")
			require.True(t, errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err), "read: %v", err)
		})
	}
	require.True(t, alice.IsConnectionOpen(), "a connected client was cut")
	require.Equal(t, byte(1), alice.subscribe(t, tp(tree.Status("dev-1"))))
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && !op.Timeout()
}

// TestSessionsPerAccountAreBounded: one account holds at most MaxSessions
// sessions, connected or kept for a client that left (a persistent
// session, kept two weeks): past it, the account's oldest offline session
// makes room, and with none offline the connection is refused. Each
// session holds a write queue of 512 KiB: without a bound, a user's token
// (or a bridge's secret) opened sessions under client ids of its choosing
// until the server ran out of memory, and kept them two weeks.
func TestSessionsPerAccountAreBounded(t *testing.T) {
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
		MaxSessions:    3,
	})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	as := func(id string, clean bool) func(*mqtt.ClientOptions) {
		return func(o *mqtt.ClientOptions) { o.SetClientID(id).SetCleanSession(clean) }
	}

	// A persistent session left behind, with a subscription.
	kept := mustDial(t, s.Addr(), "alice", "alice-token", as("alice-kept", false))
	require.Equal(t, byte(1), kept.subscribe(t, tp(tree.Status("dev-1"))))
	kept.Disconnect(100)
	a1 := mustDial(t, s.Addr(), "alice", "alice-token", as("alice-1", true))
	mustDial(t, s.Addr(), "alice", "alice-token", as("alice-2", true))
	// A third connected one: the session left behind makes room.
	a3 := mustDial(t, s.Addr(), "alice", "alice-token", as("alice-3", true))
	// Three connected: a fourth is refused, whatever its client id.
	_, err = dial(t, s.Addr(), "alice", "alice-token", as("alice-4", true))
	require.Error(t, err, "a fourth session of one account was let in")
	// Another account is not held back, nor the same client id again.
	mustDial(t, s.Addr(), "bob", "bob-token", as("bob-1", true))
	again := mustDial(t, s.Addr(), "alice", "alice-token", as("alice-1", true))
	a1.waitLost(t)
	// A session that ends makes room, once the broker has seen it end:
	// a3's DISCONNECT is taken in as the next login may be checked.
	a3.Disconnect(100)
	var back *client
	testenv.Eventually(t, wait, "a login once a3's session ended", func() bool {
		back, err = dial(t, s.Addr(), "alice", "alice-token", as("alice-kept", false))
		return err == nil
	})
	require.False(t, back.sessionPresent, "the session left behind was kept past the bound")
	_ = again
}

// TestUserFiltersMatchTheirDevicesTopics: a user subscribes, within their
// own device's topics, only to filters that match one of the contract's
// topics (its commands, replies, status, settings). Any filter below the
// device was let in, and each costs the broker about a kilobyte: a
// watcher's token subscribed to devices/DEV/x1, devices/DEV/x2, … until
// the server ran out of memory (100 000 filters, 124 MiB).
func TestUserFiltersMatchTheirDevicesTopics(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	u := mustDial(t, s.Addr(), "alice", "alice-token", nil)
	dev := tree.Prefix() + "/devices/dev-1"
	for _, tt := range []struct {
		below string
		want  byte
	}{
		{"#", 1}, {"+", 1}, {"+/#", 1}, {"+/+", 1}, {"+/+/#", 1},
		{"status", 1}, {"replies", 1}, {"settings", 1}, {"status/#", 1},
		{"commands/+", 1}, {"commands/#", 1}, {"commands/push.text", 1}, {"commands/command.cancel", 1},
		{"commands/push.text/#", 1}, {"+/app.install", 1},
		{"", 0x80}, {"x1", 0x80}, {"x1/y1", 0x80}, {"x1/#", 0x80}, {"status/x", 0x80},
		{"commands", 0x80}, {"commands/nope", 0x80}, {"commands/push.text/x", 0x80},
		{"+/+/+", 0x80}, {"+/nope", 0x80},
	} {
		filter := dev + "/" + tt.below
		if tt.below == "" {
			filter = dev
		}
		if got := u.subscribe(t, filter); got != tt.want {
			t.Errorf("user subscribe(%q) = %#x; want %#x", filter, got, tt.want)
		}
	}
}

// TestRepliesAreNeverRetained: a reply a bridge publishes retained reaches
// those subscribed, and is not retained (CONTRACT §3: replies are not).
// Retained, it stayed on the device's topic after the device changed
// hands: a user's own bridge planted replies of its making (a command
// "succeeded" with the result it chose) that the device's next owner's
// watcher read on every subscription.
func TestRepliesAreNeverRetained(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tree.Prefix()+"/devices/+/replies"))
	replies := tp(tree.Replies("dev-1"))

	br.publish(t, replies, true, `{"command_id":"planted","state":"succeeded"}`)
	m := srv.next(t)
	require.Equal(t, `{"command_id":"planted","state":"succeeded"}`, string(m.Payload()), "the reply reaches the server")

	u := mustDial(t, s.Addr(), "alice", "alice-token", nil)
	require.Equal(t, byte(1), u.subscribe(t, tp(tree.DeviceFilter("dev-1"))))
	br.publish(t, replies, false, `{"command_id":"live","state":"succeeded"}`)
	m = u.next(t)
	require.Equal(t, `{"command_id":"live","state":"succeeded"}`, string(m.Payload()), "a reply was kept retained")
}

// connectPacket is an MQTT 3.1.1 CONNECT with a clean session.
func connectPacket(clientID, user, pass string) []byte {
	str := func(s string) []byte { return append([]byte{byte(len(s) >> 8), byte(len(s))}, s...) }
	body := append(str("MQTT"), 4, 0xc2, 0, 60) // level 4; username, password, clean session; keepalive 60 s
	body = append(body, str(clientID)...)
	body = append(body, str(user)...)
	body = append(body, str(pass)...)
	return append([]byte{0x10, byte(len(body))}, body...)
}

// A client that hangs up (a reset) after its CONNECT, while its login is
// checked, is forgotten: mochi, failing to write its CONNACK, tells the
// hooks nothing and keeps it among its clients. A clean session stayed two
// weeks, with its write queue of 512 KiB, and its login, never
// established, kept the login check from ever forgetting the changes of
// credentials it notes, one for each bridge deleted or given new rights
// and each user given a new token.
func TestAClientThatHangsUpBeforeItsConnackIsForgotten(t *testing.T) {
	var armed atomic.Bool
	reached, release := make(chan struct{}), make(chan struct{})
	s, err := embedded.New(embedded.Options{Listen: "127.0.0.1:0", Accounts: newFakeAccounts(),
		ServerUsername: serverUser, ServerPassword: serverPass})
	require.NoError(t, err)
	embedded.HoldLogins(s, func() {
		if armed.CompareAndSwap(true, false) {
			reached <- struct{}{}
			<-release
		}
	})
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	for i := range 10 {
		cid := fmt.Sprintf("gone-%d", i)
		armed.Store(true)
		conn, err := net.Dial("tcp", s.Addr())
		require.NoError(t, err)
		_, err = conn.Write(connectPacket(cid, "alice", "alice-token"))
		require.NoError(t, err)
		select {
		case <-reached:
		case <-time.After(wait):
			t.Fatal("the login did not reach the hold")
		}
		require.NoError(t, conn.(*net.TCPConn).SetLinger(0))
		require.NoError(t, conn.Close()) // a reset: the CONNACK cannot be written
		release <- struct{}{}
		testenv.Eventually(t, wait, "the client that hung up before its CONNACK forgotten", func() bool {
			ids, checked, _ := embedded.Admitted(s)
			return !embedded.HasClient(s, cid) && ids == 0 && checked == 0
		})
	}
	for i := range 100 {
		s.DeleteBridge(fmt.Sprintf("deleted-%d", i))
	}
	_, _, changed := embedded.Admitted(s)
	assert.LessOrEqual(t, changed, 1, "changes of credentials kept with no login under way")
	c, err := dial(t, s.Addr(), "alice", "alice-token", nil)
	require.NoError(t, err, "alice's next login")
	c.Disconnect(0)
}
