package natstest_test

import (
	"net"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/natstest"
)

// rawConnect opens an MQTT 3.1.1 connection by hand, with a retained QoS 1
// Will, so that the test can drop it without a DISCONNECT (paho always
// sends one), as a crash would.
func rawConnect(t *testing.T, url, id string, u natstest.User, willTopic, will string) net.Conn {
	t.Helper()
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "tcp://"), wait)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	cp := packets.NewControlPacket(packets.Connect).(*packets.ConnectPacket)
	cp.ProtocolName, cp.ProtocolVersion = "MQTT", 4
	cp.CleanSession = true
	cp.ClientIdentifier = id
	cp.Keepalive = 30
	cp.WillFlag, cp.WillQos, cp.WillRetain = true, 1, true
	cp.WillTopic, cp.WillMessage = willTopic, []byte(will)
	cp.UsernameFlag, cp.Username = true, u.Username
	cp.PasswordFlag, cp.Password = true, []byte(u.Password)
	require.NoError(t, conn.SetDeadline(time.Now().Add(wait)))
	require.NoError(t, cp.Write(conn))
	p, err := packets.ReadPacket(conn)
	require.NoError(t, err)
	ack, ok := p.(*packets.ConnackPacket)
	require.True(t, ok, "got %v", p)
	require.EqualValues(t, 0, ack.ReturnCode)
	require.NoError(t, conn.SetDeadline(time.Time{}))
	return conn
}

// What NATS's MQTT does that a single Mosquitto does differently, each
// checked on a three-node cluster.
func TestMQTTSemantics(t *testing.T) {
	dollar := natstest.User{
		Username: "dollar", Password: "dollar-secret",
		Publish:   []string{"$app/x", "t/x"},
		Subscribe: []string{"#", "$app/#", "$SYS/#"},
	}
	c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice, dollar}, AckWait: 5 * time.Second})

	t.Run("WillCrossesNodes", func(t *testing.T) {
		watch := mustDial(t, c.MQTTURLs[2], "watch-a", alice, true)
		require.EqualValues(t, 1, watch.subscribe(t, "t/will/a", 1))
		conn := rawConnect(t, c.MQTTURLs[1], "willer-a", alice, "t/will/a", "gone-a")
		require.NoError(t, conn.Close())
		watch.expect(t, "t/will/a", "gone-a")
		// Read from the retained stream at subscribe time, which under
		// load can come back without it: subscribed again (expectRetained).
		late := mustDial(t, c.MQTTURLs[0], "late-a", alice, true)
		m := late.expectRetained(t, c, 0, "t/will/a", "gone-a")
		assert.True(t, m.Retained())
	})

	// A Will lives in the memory of the node the client is connected to;
	// NATS does not keep it in the session stream. When that node dies,
	// the client's connection goes with it and nobody publishes the Will.
	t.Run("WillDiesWithItsNode", func(t *testing.T) {
		watch := mustDial(t, c.MQTTURLs[2], "watch-b", alice, true)
		require.EqualValues(t, 1, watch.subscribe(t, "t/will/b", 1))
		conn := rawConnect(t, c.MQTTURLs[0], "willer-b", alice, "t/will/b", "gone-b")
		c.Kill(t, 0)
		conn.Close()
		watch.expectNone(t, 3*time.Second)
		c.Restart(t, 0)
		watch.expectNone(t, time.Second)
		t.Log("the Will of a client connected to a node killed with SIGKILL is never published")
	})

	// The same client id on another node takes over: NATS closes the older
	// connection, cluster-wide, as Mosquitto does on one broker.
	t.Run("ClientIDTakeoverAcrossNodes", func(t *testing.T) {
		lost := make(chan error, 1)
		first := mqtt.NewClient(mqtt.NewClientOptions().
			AddBroker(c.MQTTURLs[1]).SetClientID("same").
			SetUsername(alice.Username).SetPassword(alice.Password).
			SetCleanSession(false).SetAutoReconnect(false).
			SetConnectionLostHandler(func(_ mqtt.Client, err error) { lost <- err }))
		require.NoError(t, mqtt.WaitTokenTimeout(first.Connect(), wait))
		defer first.Disconnect(0)
		start := time.Now()
		second := mustDial(t, c.MQTTURLs[2], "same", alice, false)
		select {
		case err := <-lost:
			t.Logf("the first connection (nats-2) was closed %v after the second (nats-3) connected: %v", time.Since(start).Round(time.Millisecond), err)
		case <-time.After(wait):
			t.Fatal("two connections with one client id on two nodes")
		}
		assert.True(t, second.IsConnectionOpen())
		// The first client, reconnecting at once to its node, is held and
		// then refused for about a second ("flapper" jail).
		start = time.Now()
		again := mqtt.NewClient(mqtt.NewClientOptions().
			AddBroker(c.MQTTURLs[1]).SetClientID("same").
			SetUsername(alice.Username).SetPassword(alice.Password).
			SetCleanSession(false).SetAutoReconnect(false).SetConnectTimeout(wait))
		err := mqtt.WaitTokenTimeout(again.Connect(), wait)
		t.Logf("an immediate reconnect with the same id on nats-2: err=%v after %v", err, time.Since(start).Round(time.Millisecond))
		if err == nil {
			again.Disconnect(0)
		}
	})

	t.Run("QoS2", func(t *testing.T) {
		sub := mustDial(t, c.MQTTURLs[0], "q2-sub", alice, true)
		require.EqualValues(t, 2, sub.subscribe(t, "t/q2", 2))
		pub := mustDial(t, c.MQTTURLs[1], "q2-pub", alice, true)
		require.NoError(t, mqtt.WaitTokenTimeout(pub.Publish("t/q2", 2, false, "exactly once"), wait))
		m := sub.expect(t, "t/q2", "exactly once")
		assert.EqualValues(t, 2, m.Qos())
		sub.expectNone(t, 500*time.Millisecond)
	})

	// "#" does not match topics that begin with "$" [MQTT-4.7.2-1]; a
	// subscription that names the "$" level does. NATS publishes nothing
	// of its own on "$SYS/..." MQTT topics (Mosquitto does, every 10s).
	t.Run("DollarTopics", func(t *testing.T) {
		all := mustDial(t, c.MQTTURLs[0], "all", dollar, true)
		require.EqualValues(t, 1, all.subscribe(t, "#", 1))
		// "#" brings the retained messages of the earlier subtests first.
		for drained := false; !drained; {
			select {
			case m := <-all.msgs:
				require.True(t, m.Retained(), "%s %q", m.Topic(), m.Payload())
				all.seen[m.Topic()+"\x00"+string(m.Payload())] = true
			case <-time.After(500 * time.Millisecond):
				drained = true
			}
		}
		app := mustDial(t, c.MQTTURLs[1], "app", dollar, true)
		require.EqualValues(t, 1, app.subscribe(t, "$app/#", 1))
		sys := mustDial(t, c.MQTTURLs[2], "sys", dollar, true)
		require.EqualValues(t, 0, sys.subscribe(t, "$SYS/#", 0))
		pub := mustDial(t, c.MQTTURLs[2], "dollar-pub", dollar, true)
		pub.publish(t, "$app/x", false, "dollar")
		pub.publish(t, "t/x", false, "plain")
		all.expect(t, "t/x", "plain")
		app.expect(t, "$app/x", "dollar")
		all.expectNone(t, 500*time.Millisecond)
		// The internal "$MQTT/..." topics are refused whatever the rights.
		assert.EqualValues(t, 0x80, all.subscribe(t, "$MQTT/#", 1))
		sys.expectNone(t, 2*time.Second)
	})
}
