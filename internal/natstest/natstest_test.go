package natstest_test

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/natstest"
)

const wait = 15 * time.Second

var (
	alice = natstest.User{
		Username: "alice", Password: "alice-secret",
		Publish:   []string{"t/#"},
		Subscribe: []string{"t/#"},
	}
	// bob may read t/bob/# and write t/bob/out only.
	bob = natstest.User{
		Username: "bob", Password: "bob-secret",
		Publish:   []string{"t/bob/out"},
		Subscribe: []string{"t/bob/#"},
	}
)

type client struct {
	mqtt.Client
	msgs chan mqtt.Message
	// seen holds what the client (or the session it resumed) received:
	// QoS 1 is at least once, and a message whose PUBACK died with a
	// node comes again, so expect and expectNone skip (and log) those.
	seen map[string]bool
}

func dial(t *testing.T, url, id string, u natstest.User, clean bool, opts ...func(*mqtt.ClientOptions)) (*client, error) {
	t.Helper()
	c := &client{msgs: make(chan mqtt.Message, 1000), seen: map[string]bool{}}
	o := mqtt.NewClientOptions().
		AddBroker(url).
		SetClientID(id).
		SetUsername(u.Username).
		SetPassword(u.Password).
		SetCleanSession(clean).
		SetAutoReconnect(false).
		SetConnectTimeout(wait).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) { c.msgs <- m })
	for _, opt := range opts {
		opt(o)
	}
	c.Client = mqtt.NewClient(o)
	if err := mqtt.WaitTokenTimeout(c.Connect(), wait); err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Disconnect(50) })
	return c, nil
}

func mustDial(t *testing.T, url, id string, u natstest.User, clean bool, opts ...func(*mqtt.ClientOptions)) *client {
	t.Helper()
	c, err := dial(t, url, id, u, clean, opts...)
	require.NoError(t, err, "connect %s as %s to %s", id, u.Username, url)
	return c
}

// subscribe returns the SUBACK's code for filter (0x80: refused).
func (c *client) subscribe(t *testing.T, filter string, qos byte) byte {
	t.Helper()
	tok := c.Subscribe(filter, qos, nil)
	require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	return tok.(*mqtt.SubscribeToken).Result()[filter]
}

// subscribeGranted subscribes until the SUBACK grants qos. While a node is
// down, NATS may need longer than its 5s JetStream API timeout to elect the
// leader of a new subscription's durable consumer (whose replicas include
// the dead node), and then refuses the subscription (0x80, the log saying
// "Unable to add JetStream consumer ... timeout"); trying again works.
func (c *client) subscribeGranted(t *testing.T, filter string, qos byte) {
	t.Helper()
	deadline := time.Now().Add(3 * wait)
	for attempt := 1; ; attempt++ {
		code := c.subscribe(t, filter, qos)
		if code == qos {
			if attempt > 1 {
				t.Logf("subscription to %s granted at attempt %d", filter, attempt)
			}
			return
		}
		require.EqualValues(t, 0x80, code)
		if time.Now().After(deadline) {
			t.Fatalf("subscription to %s refused %d times", filter, attempt)
		}
		t.Logf("subscription to %s refused (attempt %d); trying again", filter, attempt)
	}
}

func (c *client) publish(t *testing.T, topic string, retained bool, payload string) {
	t.Helper()
	require.NoError(t, mqtt.WaitTokenTimeout(c.Publish(topic, 1, retained, payload), wait))
}

func (c *client) expect(t *testing.T, topic, payload string) mqtt.Message {
	t.Helper()
	deadline := time.After(wait)
	for {
		select {
		case m := <-c.msgs:
			key := m.Topic() + "\x00" + string(m.Payload())
			if m.Topic() != topic && c.seen[key] {
				t.Logf("redelivered (dup=%v) after newer messages: %s %q", m.Duplicate(), m.Topic(), m.Payload())
				continue
			}
			require.Equal(t, topic, m.Topic())
			require.Equal(t, payload, string(m.Payload()))
			c.seen[key] = true
			return m
		case <-deadline:
			t.Fatalf("no message on %s", topic)
			return nil
		}
	}
}

// expectRetained subscribes to topic on node and expects its retained
// payload. NATS reads a retained message it has not cached from its
// JetStream stream at subscribe time, and when that read fails (a
// JetStream API timeout while the cluster is busy electing leaders after a
// node died) it logs a warning and grants the subscription without the
// message; it is not lost, and the next subscription reads it. So after a
// silent wait the subscription is made again, at most three times.
func (c *client) expectRetained(t *testing.T, cl *natstest.Cluster, node int, topic, payload string) mqtt.Message {
	t.Helper()
	for attempt := 1; ; attempt++ {
		c.subscribeGranted(t, topic, 1)
		select {
		case m := <-c.msgs:
			require.Equal(t, topic, m.Topic())
			require.Equal(t, payload, string(m.Payload()))
			return m
		case <-time.After(wait):
		}
		if attempt == 3 {
			t.Fatalf("no retained message on %s after %d subscriptions; node log:\n%s", topic, attempt, cl.Log(node))
		}
		var warned []string
		for _, l := range strings.Split(cl.Log(node), "\n") {
			if strings.Contains(l, "retained") {
				warned = append(warned, l)
			}
		}
		t.Logf("no retained message on %s at subscription %d (node log on retained messages: %q); subscribing again", topic, attempt, warned)
		require.NoError(t, mqtt.WaitTokenTimeout(c.Unsubscribe(topic), wait))
	}
}

func (c *client) expectNone(t *testing.T, d time.Duration) {
	t.Helper()
	deadline := time.After(d)
	for {
		select {
		case m := <-c.msgs:
			if c.seen[m.Topic()+"\x00"+string(m.Payload())] {
				t.Logf("redelivered (dup=%v): %s %q", m.Duplicate(), m.Topic(), m.Payload())
				continue
			}
			t.Fatalf("unexpected message on %s: %q", m.Topic(), m.Payload())
		case <-deadline:
			return
		}
	}
}

func TestSubjects(t *testing.T) {
	for in, want := range map[string][]string{
		"a/b":                            {"a.b"},
		"a/+/c":                          {"a.*.c"},
		"a/#":                            {"a.>", "a"},
		"#":                              {">"},
		"companion/v1/x/push.text":       {"companion.v1.x.push//text"},
		"companion/v1/devices/+/#":       {"companion.v1.devices.*.>", "companion.v1.devices.*"},
		"companion/v1/bridges/b-1/state": {"companion.v1.bridges.b-1.state"},
		"$app/#":                         {"$app.>", "$app"},
	} {
		got, err := natstest.Subjects(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "/a", "a//b", "a/", "$MQTT/x", "$MQTT", "a/#/b", "a/b+", "a b"} {
		_, err := natstest.Subjects(bad)
		assert.Error(t, err, "%q", bad)
	}
}

// One cluster for the whole story: messages cross nodes, retained
// messages outlive the node they were published on, and permissions hold.
func TestCluster(t *testing.T) {
	c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice, bob}, AckWait: 5 * time.Second})
	require.Len(t, c.MQTTURLs, 3)
	require.Len(t, c.MonitorURLs, 3)
	assert.Equal(t, strings.Join(c.MQTTURLs, ","), c.MQTTURL())
	conf, err := os.ReadFile(c.ConfigPath(0))
	require.NoError(t, err)
	t.Logf("nats-1.conf:\n%s", conf)

	// QoS 1 across nodes: subscribed on node 1, published on node 2.
	sub := mustDial(t, c.MQTTURLs[0], "sub", alice, false)
	assert.Equal(t, 0, c.NodeOf(t, "sub"))
	assert.Equal(t, -1, c.NodeOf(t, "nobody"))
	require.EqualValues(t, 1, sub.subscribe(t, "t/#", 1))
	pub := mustDial(t, c.MQTTURLs[1], "pub", alice, true)
	pub.publish(t, "t/a/push.text", false, "hello")
	m := sub.expect(t, "t/a/push.text", "hello")
	assert.EqualValues(t, 1, m.Qos())
	assert.False(t, m.Retained())

	// A retained message, then node 1 dies: node 3 still has it.
	pub.publish(t, "t/status", true, "online")
	sub.expect(t, "t/status", "online")
	c.Kill(t, 0)
	assert.False(t, c.Running(0))
	// Node 1 may have led JetStream's meta group: a new subscription
	// needs a leader, which the survivors elect within seconds.
	c.WaitHealthy(t)
	late := mustDial(t, c.MQTTURLs[2], "late", alice, true)
	m = late.expectRetained(t, c, 2, "t/status", "online")
	assert.True(t, m.Retained(), "a retained message read at subscribe time")

	// The persistent session of "sub" (made on the dead node) resumes on
	// node 3 and gets what was published for it meanwhile.
	pub.publish(t, "t/while-away", false, "queued")
	sub.Disconnect(0)
	sub2 := mustDial(t, c.MQTTURLs[2], "sub", alice, false)
	sub2.seen = sub.seen
	assert.Equal(t, 2, c.NodeOf(t, "sub"))
	sub2.expect(t, "t/while-away", "queued")

	// Permissions: bob reads t/bob/# only and writes t/bob/out only.
	b := mustDial(t, c.MQTTURLs[1], "bob", bob, true)
	assert.EqualValues(t, 0x80, b.subscribe(t, "t/#", 1), "bob may not subscribe to t/#")
	assert.EqualValues(t, 0x80, b.subscribe(t, "t/status", 1), "bob may not subscribe to t/status")
	b.subscribeGranted(t, "t/bob/#", 1)
	b.expectNone(t, 300*time.Millisecond)
	// A publish bob may not make is dropped (MQTT 3.1.1 has no negative
	// PUBACK; NATS acknowledges it and delivers nothing).
	b.publish(t, "t/forbidden", false, "nope")
	b.publish(t, "t/bob/out", false, "mine")
	b.expect(t, "t/bob/out", "mine")
	sub2.expect(t, "t/bob/out", "mine")
	sub2.expectNone(t, 500*time.Millisecond)

	// Node 1 comes back with its store; SetUsers reloads every node.
	c.Restart(t, 0)
	assert.True(t, c.Running(0))
	carol := natstest.User{Username: "carol", Password: "carol-secret", Subscribe: []string{"t/status"}}
	_, err = dial(t, c.MQTTURLs[0], "carol-early", carol, true)
	require.Error(t, err, "carol is not a user yet")
	c.AddUser(t, carol)
	for i, url := range c.MQTTURLs {
		cc := mustDial(t, url, fmt.Sprintf("carol-%d", i), carol, true)
		cc.subscribeGranted(t, "t/status", 1)
		cc.expect(t, "t/status", "online")
	}
	_, err = dial(t, c.MQTTURLs[0], "alice-wrong", natstest.User{Username: "alice", Password: "wrong"}, true)
	require.Error(t, err, "a wrong password is refused")
}

func TestMissingUserRefused(t *testing.T) {
	c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice}})
	_, err := dial(t, c.MQTTURLs[0], "anon", natstest.User{}, true)
	require.Error(t, err, "nobody anonymous")
	_, err = dial(t, c.MQTTURLs[1], "mallory", natstest.User{Username: "mallory", Password: "x"}, true)
	require.Error(t, err)
}

// With Options.Callout, the static users still log in, in the account
// the callout's clients go to (with JetStream: QoS 1 works), and the
// service gets what it needs; nobody else gets in while no service
// answers.
func TestCalloutMode(t *testing.T) {
	c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice}, Callout: true})
	co := c.Callout
	require.NotNil(t, co)
	assert.Equal(t, strings.Join(c.ClientURLs, ","), co.URL)
	assert.NotEmpty(t, co.User)
	assert.NotEmpty(t, co.SystemUser)
	assert.Equal(t, "COMPANION", co.Account)
	kp, err := nkeys.FromSeed(co.IssuerSeed)
	require.NoError(t, err)
	pub, err := kp.PublicKey()
	require.NoError(t, err)
	assert.Equal(t, co.Issuer, pub)
	assert.True(t, nkeys.IsValidPublicAccountKey(pub))
	conf, err := os.ReadFile(c.ConfigPath(0))
	require.NoError(t, err)
	assert.Contains(t, string(conf), "auth_callout")

	sub := mustDial(t, c.MQTTURLs[0], "sub", alice, true)
	require.EqualValues(t, 1, sub.subscribe(t, "t/#", 1))
	pub1 := mustDial(t, c.MQTTURLs[2], "pub", alice, true)
	pub1.publish(t, "t/x", false, "across nodes")
	sub.expect(t, "t/x", "across nodes")

	_, err = dial(t, c.MQTTURLs[1], "mallory", natstest.User{Username: "mallory", Password: "x"}, true)
	require.Error(t, err, "no service answers")
}

// A session's QoS 1 subscriptions together may have 65,535 messages
// awaiting their PUBACK, each subscription max_ack_pending of them. With
// the helper's 64 (natsconf.DefaultMaxAckPending), one client's 200
// subscriptions (a bridge's 200 devices) are all granted; with NATS's
// default of 1,024 the 64th is refused.
func TestManySubscriptions(t *testing.T) {
	filters := map[string]byte{}
	for i := range 200 {
		filters[fmt.Sprintf("t/dev-%03d/commands/+", i)] = 1
	}
	subscribeAll := func(t *testing.T, c *natstest.Cluster) map[string]byte {
		t.Helper()
		// NATS answers nothing else of the session while it makes the
		// consumers, a PINGREQ neither: on a loaded machine that took
		// longer than paho's keepalive and ping timeout (40 s), which then
		// dropped the connection ("connection lost before Subscribe
		// completed", make test, 2026-12-02). The client sends no PINGREQ.
		cl := mustDial(t, c.MQTTURLs[0], "many", alice, true, func(o *mqtt.ClientOptions) { o.SetKeepAlive(0) })
		start := time.Now()
		tok := cl.SubscribeMultiple(filters, nil)
		require.NoError(t, mqtt.WaitTokenTimeout(tok, 2*time.Minute))
		// NATS makes a session's durable consumers one after another:
		// how long this takes is what a bridge's first connect waits.
		t.Logf("SUBACK for %d filters after %v", len(filters), time.Since(start).Round(time.Millisecond))
		return tok.(*mqtt.SubscribeToken).Result()
	}
	t.Run("max_ack_pending=64", func(t *testing.T) {
		c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice}})
		conf, err := os.ReadFile(c.ConfigPath(0))
		require.NoError(t, err)
		assert.Contains(t, string(conf), "max_ack_pending: 64")
		got := subscribeAll(t, c)
		granted := 0
		for f := range filters {
			if got[f] == 1 {
				granted++
			} else {
				t.Errorf("SUBACK for %s = %#x; want 1", f, got[f])
			}
		}
		assert.Equal(t, len(filters), granted)
	})
	t.Run("NATS's default", func(t *testing.T) {
		c := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{alice}, MaxAckPending: -1})
		got := subscribeAll(t, c)
		granted := 0
		for f := range filters {
			if got[f] == 1 {
				granted++
			}
		}
		// 65,535 / 1,024: 63 subscriptions, whichever NATS took first.
		assert.Equal(t, 63, granted)
	})
}
