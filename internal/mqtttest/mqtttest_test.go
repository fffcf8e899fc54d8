package mqtttest_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

const wait = 10 * time.Second

var (
	tree   = topics.MustNew(topics.DefaultPrefix)
	server = mqtttest.MosquittoAccount{
		Username: "companion-server",
		Password: "server-secret",
		ACL:      []string{"topic readwrite " + tree.Prefix() + "/#"},
	}
	// bridge has the ACL docs/mosquitto.md gives a bridge.
	bridge = mqtttest.MosquittoAccount{
		Username: "bridge-1",
		Password: "bridge-secret",
		ACL: []string{
			"topic read " + tree.Prefix() + "/devices/+/commands/#",
			"topic write " + tree.AllReplies(),
			"topic write " + tree.AllStatus(),
			"topic write " + tree.AllSettings(),
			"topic write " + tp(tree.BridgeState("bridge-1")),
		},
	}
)

func tp(s string, err error) string {
	if err != nil {
		panic(err)
	}
	return s
}

type client struct {
	mqtt.Client
	msgs chan mqtt.Message
}

func dial(t *testing.T, url, id string, a mqtttest.MosquittoAccount, clean bool) (*client, error) {
	t.Helper()
	c := &client{msgs: make(chan mqtt.Message, 10000)}
	c.Client = mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(url).
		SetClientID(id).
		SetUsername(a.Username).
		SetPassword(a.Password).
		SetCleanSession(clean).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(wait).
		SetOrderMatters(true).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) { c.msgs <- m }))
	if err := mqtt.WaitTokenTimeout(c.Connect(), wait); err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		if c.IsConnected() {
			c.Disconnect(50)
		}
	})
	return c, nil
}

func mustDial(t *testing.T, url, id string, a mqtttest.MosquittoAccount, clean bool) *client {
	t.Helper()
	c, err := dial(t, url, id, a, clean)
	require.NoError(t, err, "connect as %q", a.Username)
	return c
}

func (c *client) subscribe(t *testing.T, filter string) byte {
	t.Helper()
	tok := c.Subscribe(filter, 1, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	return tok.(*mqtt.SubscribeToken).Result()[filter]
}

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

func TestFreePort(t *testing.T) {
	p := mqtttest.FreePort(t)
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	require.NoError(t, err)
	require.NoError(t, ln.Close())
}

func TestAccountsAndACL(t *testing.T) {
	m := mqtttest.StartMosquitto(t, server, bridge)

	_, err := dial(t, m.URL, "anon", mqtttest.MosquittoAccount{}, true)
	require.Error(t, err, "anonymous connect")
	_, err = dial(t, m.URL, "wrong", mqtttest.MosquittoAccount{Username: "bridge-1", Password: "nope"}, true)
	require.Error(t, err, "wrong password")

	srv := mustDial(t, m.URL, "srv", server, true)
	require.Equal(t, byte(1), srv.subscribe(t, tree.Prefix()+"/#"))
	br := mustDial(t, m.URL, "br", bridge, true)
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	// The dynamic-security plugin refuses a subscription its roles do not
	// grant (SUBACK 0x80), as the embedded broker does.
	require.Equal(t, byte(0x80), br.subscribe(t, tree.AllReplies()))
	require.Equal(t, byte(0x80), br.subscribe(t, tree.Prefix()+"/#"))

	cmd := tp(tree.Command("dev-1", topics.OpPushText))
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(tp(tree.Replies("dev-1")), 1, false, "not for bridges"), wait))
	require.Equal(t, tp(tree.Replies("dev-1")), srv.next(t).Topic())
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(cmd, 1, false, "hello"), wait))
	require.Equal(t, "hello", string(br.next(t).Payload()))
	require.Equal(t, cmd, srv.next(t).Topic()) // the server sees its own command too

	// Mosquitto 2.0.11 acknowledges a QoS 1 publish where the client may
	// not (PUBACK), drops it and keeps the 3.1.1 connection open, with the
	// project's max_queued_messages (docs/mosquitto.md, section 8). Had a
	// refused message gone through, the server would see it before the
	// marker published after it on the same connection.
	for _, forged := range []string{cmd, tp(tree.BridgeState("bridge-2"))} {
		br := mustDial(t, m.URL, "br", bridge, true)
		require.NoError(t, mqtt.WaitTokenTimeout(br.Publish(forged, 1, false, "forged"), wait), "no PUBACK for a refused publish to %q", forged)
		reply := tp(tree.Replies("dev-1"))
		require.NoError(t, mqtt.WaitTokenTimeout(br.Publish(reply, 1, false, "marker"), wait), "the connection did not last a refused publish to %q", forged)
		require.Equal(t, reply, srv.next(t).Topic(), "after a publish to %q", forged)
		require.True(t, br.IsConnectionOpen(), "a refused publish to %q closed the connection", forged)
	}

	// An account added while running can connect once AddAccount returns.
	late := mqtttest.MosquittoAccount{Username: "bridge-2", Password: "late", ACL: bridge.ACL}
	m.AddAccount(t, late)
	mustDial(t, m.URL, "late", late, true)
}

// TestPersistentSessionSurvivesRestart: a QoS 1 message queued for an
// offline persistent session is still there after Mosquitto restarts, so
// the project's mosquitto.conf really persists.
func TestPersistentSessionSurvivesRestart(t *testing.T) {
	m := mqtttest.StartMosquitto(t, server, bridge)
	br := mustDial(t, m.URL, "bridge-1", bridge, false)
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	br.Disconnect(50)

	srv := mustDial(t, m.URL, "srv", server, true)
	cmd := tp(tree.Command("dev-1", topics.OpPushText))
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(cmd, 1, false, "survives"), wait))
	srv.Disconnect(50)

	m.Stop(t)
	m.Start(t)

	br = mustDial(t, m.URL, "bridge-1", bridge, false)
	require.Equal(t, "survives", string(br.next(t).Payload()))
}

// TestOfflineQueueIsNotCapped: 5000 QoS 1 messages for an offline
// persistent subscriber all arrive, in order (Mosquitto's default
// max_queued_messages of 1000 would drop 4000 of them).
func TestOfflineQueueIsNotCapped(t *testing.T) {
	const n = 5000
	m := mqtttest.StartMosquitto(t, server, bridge)
	br := mustDial(t, m.URL, "bridge-1", bridge, false)
	require.Equal(t, byte(1), br.subscribe(t, tp(tree.CommandsFilter("dev-1"))))
	br.Disconnect(50)

	srv := mustDial(t, m.URL, "srv", server, true)
	cmd := tp(tree.Command("dev-1", topics.OpPushText))
	toks := make([]mqtt.Token, n)
	for i := range toks {
		toks[i] = srv.Publish(cmd, 1, false, strconv.Itoa(i))
	}
	for _, tok := range toks {
		require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	}

	br = mustDial(t, m.URL, "bridge-1", bridge, false)
	for i := 0; i < n; i++ {
		require.Equal(t, strconv.Itoa(i), string(br.next(t).Payload()), "message %d", i)
	}
	// Nothing more is queued: the next message is one published now.
	require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(cmd, 1, false, "marker"), wait))
	require.Equal(t, "marker", string(br.next(t).Payload()))
}

// TestStaticACLFileRefusesNoSubscription pins what docs/mosquitto.md,
// section 3, says the static alternative does not give: with a password
// file and an ACL file, Mosquitto grants every SUBSCRIBE whatever the file
// says (SUBACK with the QoS asked, never 0x80) and only withholds the
// messages; a reload (SIGHUP) of a changed file disconnects nobody. So a
// bridge never learns there that a device moved away (the agent holds a
// device's commands only on 0x80), and with docs/companion.acl.example
// every bridge reads every device's commands.
func TestStaticACLFileRefusesNoSubscription(t *testing.T) {
	root, err := testenv.RepoRoot()
	require.NoError(t, err)
	example, err := os.ReadFile(filepath.Join(root, "docs", "companion.acl.example"))
	require.NoError(t, err)
	// The example's second bridge, uncommented as an operator would.
	two := strings.NewReplacer("# user bridge-2", "user bridge-2", "# topic", "topic").Replace(string(example))
	require.Contains(t, two, "\nuser bridge-2\n")
	bridge2 := mqtttest.MosquittoAccount{Username: "bridge-2", Password: "bridge-2-secret"}
	m := mqtttest.StartMosquittoStatic(t, []byte(two), server, bridge, bridge2)

	srv, err := mqtttest.DialProbe(t, m.URL, "srv", server.Username, server.Password)
	require.NoError(t, err)
	publish := func(topic string) {
		t.Helper()
		require.NoError(t, mqtt.WaitTokenTimeout(srv.Publish(topic, 1, false, topic), wait))
	}
	subscribe := func(p *mqtttest.Probe, filter string) byte {
		t.Helper()
		tok := p.Subscribe(filter, 1, nil)
		require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
		return tok.(*mqtt.SubscribeToken).Result()[filter]
	}
	next := func(p *mqtttest.Probe) string {
		t.Helper()
		select {
		case msg := <-p.Msgs:
			return msg.Topic()
		case <-time.After(wait):
			t.Fatal("no message arrived")
			return ""
		}
	}
	cmd := func(dev string) string { return tp(tree.Command(dev, topics.OpPushText)) }

	// The example's ACL: bridge-2 reads the commands of dev-1, whichever
	// bridge serves it.
	b2, err := mqtttest.DialProbe(t, m.URL, "b2", bridge2.Username, bridge2.Password)
	require.NoError(t, err)
	require.Equal(t, byte(1), subscribe(b2, tp(tree.CommandsFilter("dev-1"))))
	publish(cmd("dev-1"))
	require.Equal(t, cmd("dev-1"), next(b2), "the example's ACL keeps no bridge to its own devices")

	// One line per device: the file withholds the messages, never the
	// subscription.
	perDevice := func(b1dev, b2dev string) []byte {
		return fmt.Appendf(nil, "user %s\ntopic readwrite %s/#\n\nuser %s\ntopic read %s\n\nuser %s\ntopic read %s\n",
			server.Username, tree.Prefix(), bridge.Username, tp(tree.CommandsFilter(b1dev)),
			bridge2.Username, tp(tree.CommandsFilter(b2dev)))
	}
	m.SetACL(t, perDevice("dev-1", "dev-2"))
	b1, err := mqtttest.DialProbe(t, m.URL, "b1", bridge.Username, bridge.Password)
	require.NoError(t, err)
	require.Equal(t, byte(1), subscribe(b1, tp(tree.CommandsFilter("dev-1"))))
	require.Equal(t, byte(1), subscribe(b1, tp(tree.CommandsFilter("dev-2"))), "a SUBSCRIBE the ACL file denies is granted, not refused (0x80)")
	require.Equal(t, byte(1), subscribe(b1, tp(tree.CommandsFilter("dev-3"))))
	publish(cmd("dev-2"))
	publish(cmd("dev-1"))
	require.Equal(t, cmd("dev-1"), next(b1), "dev-2's command went to a bridge the ACL file denies it")

	// dev-1 moves to bridge-2: the reload cuts bridge-1's delivery but
	// neither disconnects it nor refuses it the filter.
	m.SetACL(t, perDevice("dev-3", "dev-1"))
	require.Equal(t, byte(1), subscribe(b1, tp(tree.CommandsFilter("dev-1"))), "the filter of a device moved away is granted again")
	publish(cmd("dev-1"))
	publish(cmd("dev-3"))
	require.Equal(t, cmd("dev-3"), next(b1), "the command of a device moved away went to its old bridge")
	require.True(t, b1.IsConnectionOpen())
	select {
	case err := <-b1.Lost:
		t.Fatalf("the reload disconnected the bridge: %v", err)
	default:
	}

	// A QoS 1 publish the file denies is acknowledged and dropped, and the
	// connection stays open (docs/mosquitto.md, section 4).
	watcher, err := mqtttest.DialProbe(t, m.URL, "watcher", server.Username, server.Password)
	require.NoError(t, err)
	require.Equal(t, byte(1), subscribe(watcher, tree.Prefix()+"/#"))
	require.NoError(t, mqtt.WaitTokenTimeout(b1.Publish(cmd("dev-3"), 1, false, "forged"), wait), "no PUBACK for a denied publish")
	publish(cmd("dev-4"))
	require.Equal(t, cmd("dev-4"), next(watcher), "a publish the ACL file denies went through")
	require.True(t, b1.IsConnectionOpen(), "a denied publish closed the connection")
}
