package embedded_test

import (
	"strconv"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/topics"
)

// serverConn is what the tests use of the server's connection, whichever
// it is.
type serverConn interface {
	Publish(topic string, qos byte, retained bool, payload any) mqtt.Token
}

// connectInline connects the in-process client of s with handle as its
// default handler and onConnect as its OnConnect, and disconnects it when
// the test ends.
func connectInline(t *testing.T, s *embedded.Server, handle mqtt.MessageHandler, onConnect mqtt.OnConnectHandler) mqtt.Client {
	t.Helper()
	o := mqtt.NewClientOptions().SetClientID("companion-server").SetOrderMatters(true).SetAutoAckDisabled(true)
	o.SetDefaultPublishHandler(handle)
	o.SetOnConnectHandler(onConnect)
	c := s.NewClient(o)
	require.NoError(t, mqtt.WaitTokenTimeout(c.Connect(), wait))
	require.True(t, c.IsConnectionOpen())
	t.Cleanup(func() { c.Disconnect(0) })
	return c
}

// TestInlineClientTakesMessagesInOrder: the retained messages of a filter
// come when it is subscribed to; then every message of two bridges, each
// bridge's in its order, one handler call at a time, however many arrive
// at once; a handler that publishes to a filter of its own client does
// not block the bridges.
func TestInlineClientTakesMessagesInOrder(t *testing.T) {
	const n = 1000
	s := startBroker(t, newFakeAccounts())
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	b2 := mustDial(t, s.Addr(), "bridge-2", "b2-secret", nil)
	b1.publish(t, tp(tree.Status("dev-1")), true, "retained")

	var (
		mu      sync.Mutex
		got     = map[string][]string{}
		busy    bool
		overlap bool
	)
	all := make(chan struct{})
	var c mqtt.Client
	handle := func(_ mqtt.Client, m mqtt.Message) {
		mu.Lock()
		overlap = overlap || busy
		busy = true
		mu.Unlock()
		if m.Topic() == tp(tree.Replies("dev-1")) && string(m.Payload()) == "0" {
			// Published from the handler, to a topic this client takes.
			require.NoError(t, c.Publish(tp(tree.Settings("dev-3")), 1, false, "echo").Error())
		}
		time.Sleep(10 * time.Microsecond)
		mu.Lock()
		busy = false
		got[m.Topic()] = append(got[m.Topic()], string(m.Payload()))
		if len(got[tp(tree.Replies("dev-1"))]) == n && len(got[tp(tree.Replies("dev-2"))]) == n {
			close(all)
		}
		mu.Unlock()
		m.Ack()
	}
	connected := make(chan struct{})
	c = connectInline(t, s, handle, func(mqtt.Client) { close(connected) })
	select {
	case <-connected:
	case <-time.After(wait):
		t.Fatal("OnConnect was not called")
	}
	tok := c.SubscribeMultiple(map[string]byte{tree.AllStatus(): 1, tree.AllReplies(): 1, tree.AllSettings(): 1}, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))

	var wg sync.WaitGroup
	for _, b := range []struct {
		c   *client
		dev string
	}{{b1, "dev-1"}, {b2, "dev-2"}} {
		wg.Go(func() {
			toks := make([]mqtt.Token, n)
			for i := range toks {
				toks[i] = b.c.Publish(tp(tree.Replies(b.dev)), 1, false, strconv.Itoa(i))
			}
			for _, tok := range toks {
				require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
			}
		})
	}
	wg.Wait()
	select {
	case <-all:
	case <-time.After(wait):
		t.Fatal("not every message arrived")
	}
	mu.Lock()
	defer mu.Unlock()
	require.False(t, overlap, "two handler calls at once")
	// The retained status comes with the subscription; it may also come a
	// second time, live, when mochi had not yet passed the bridge's publish
	// on to the subscribers (it acknowledges first), as from any broker.
	status := got[tp(tree.Status("dev-1"))]
	require.NotEmpty(t, status, "no retained status")
	require.LessOrEqual(t, len(status), 2)
	for _, p := range status {
		require.Equal(t, "retained", p)
	}
	require.Equal(t, []string{"echo"}, got[tp(tree.Settings("dev-3"))])
	for _, dev := range []string{"dev-1", "dev-2"} {
		msgs := got[tp(tree.Replies(dev))]
		for i, p := range msgs {
			require.Equal(t, strconv.Itoa(i), p, "%s message %d", dev, i)
		}
	}
}

// TestInlineClientPublishReachesBridges: a command published by the
// in-process client reaches the bridge subscribed to it at QoS 1.
func TestInlineClientPublishReachesBridges(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	c := connectInline(t, s, nil, nil)
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	topic := tp(tree.Command("dev-1", topics.OpPushText))
	require.NoError(t, mqtt.WaitTokenTimeout(c.Publish(topic, 1, false, []byte("cmd")), wait))
	m := br.next(t)
	require.Equal(t, topic, m.Topic())
	require.Equal(t, "cmd", string(m.Payload()))
	require.Equal(t, byte(1), m.Qos())
}

// TestInlineClientDisconnect: after Disconnect nothing more is delivered
// to the handler, and publishing fails.
func TestInlineClientDisconnect(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	msgs := make(chan string, 10)
	c := connectInline(t, s, func(_ mqtt.Client, m mqtt.Message) { msgs <- string(m.Payload()) }, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(tree.AllReplies(), 1, nil), wait))
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	br.publish(t, tp(tree.Replies("dev-1")), false, "before")
	select {
	case m := <-msgs:
		require.Equal(t, "before", m)
	case <-time.After(wait):
		t.Fatal("no message before Disconnect")
	}

	c.Disconnect(0)
	require.False(t, c.IsConnectionOpen())
	require.Error(t, c.Publish(tp(tree.Command("dev-1", topics.OpPushText)), 1, false, "x").Error())
	br.publish(t, tp(tree.Replies("dev-1")), false, "after")
	// The bridge's publish is done once the broker has passed it on to
	// every subscriber: had the subscription stayed, it would be here.
	select {
	case m := <-msgs:
		t.Fatalf("message %q delivered after Disconnect", m)
	case <-time.After(100 * time.Millisecond):
	}
}

// TestInlineClientDisconnectJoinsOnConnect: Disconnect returns only once
// the OnConnect call has, so nothing of the connection's owner runs after
// it is closed.
func TestInlineClientDisconnectJoinsOnConnect(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	entered, release := make(chan struct{}), make(chan struct{})
	c := connectInline(t, s, func(mqtt.Client, mqtt.Message) {}, func(mqtt.Client) {
		close(entered)
		<-release
	})
	<-entered
	disconnected := make(chan struct{})
	go func() {
		c.Disconnect(0)
		close(disconnected)
	}()
	select {
	case <-disconnected:
		t.Fatal("Disconnect returned while OnConnect was still running")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case <-disconnected:
	case <-time.After(wait):
		t.Fatal("Disconnect did not return after OnConnect did")
	}
}

// TestInlineClientIDIsNotTaken: no network client takes over the session
// of mochi's inline client, whose subscriptions pass every access rule.
func TestInlineClientIDIsNotTaken(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	connectInline(t, s, nil, nil)
	for _, acc := range [][2]string{{"bridge-1", "b1-secret"}, {"alice", "alice-token"}, {serverUser, serverPass}} {
		_, err := dial(t, s.Addr(), acc[0], acc[1], func(o *mqtt.ClientOptions) { o.SetClientID("inline") })
		require.Error(t, err, "%s connected as the inline client", acc[0])
	}
}

// TestInlineClientTellsRetainedAsMQTTDoes: a message reads retained only
// as the retained message of the subscription made (MQTT-3.3.1-9); one
// published retained to an established subscription reads live, as from
// a broker over TCP. The intake tells a late status from the broker's
// replay so (broker.Broker.mendRetained).
func TestInlineClientTellsRetainedAsMQTTDoes(t *testing.T) {
	s := startBroker(t, newFakeAccounts())
	b1 := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	topic := tp(tree.Status("dev-1"))
	// mochi acknowledges a QoS 1 publish before it hands the message to
	// the subscribers it finds: a subscription made in between gets it
	// twice, retained and live, as QoS 1 allows. A watcher that has it
	// says the subscribers were found.
	watcher := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.NotEqual(t, byte(0x80), watcher.subscribe(t, topic))
	b1.publish(t, topic, true, "before")
	require.Equal(t, "before", string(watcher.next(t).Payload()))
	msgs := make(chan mqtt.Message, 10)
	c := connectInline(t, s, func(_ mqtt.Client, m mqtt.Message) { msgs <- m }, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(c.Subscribe(topic, 1, nil), wait))
	next := func() mqtt.Message {
		t.Helper()
		select {
		case m := <-msgs:
			return m
		case <-time.After(wait):
			t.Fatal("no message")
			return nil
		}
	}
	m := next()
	require.Equal(t, "before", string(m.Payload()))
	require.True(t, m.Retained(), "the retained message of the subscription")
	b1.publish(t, topic, true, "after")
	m = next()
	require.Equal(t, "after", string(m.Payload()))
	require.False(t, m.Retained(), "a retained publish to an established subscription")
}
