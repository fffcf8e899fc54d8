package agent_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/topics"
)

// unheardObserver counts what the agent says of replies the server did
// not hear.
type unheardObserver struct{ n atomic.Int32 }

func (o *unheardObserver) CommandDone(string, string, bool, time.Duration) {}
func (o *unheardObserver) MQTTConnected(bool)                              {}
func (o *unheardObserver) SpoolWritable(bool)                              {}
func (o *unheardObserver) ReplyUnheard()                                   { o.n.Add(1) }
func (o *unheardObserver) DevicesRefused(int)                              {}

// A bridge whose Mosquitto acl_file block misses its replies line (here
// mistyped `reply`) had every reply acknowledged and dropped: the server
// sent each command again every minute, the bridge answered each time,
// and the command read sent until its TTL passed, while neither logged a
// word. The test is the server: it sends the command again, as the server
// does while it hears nothing; the bridge must say once that its replies
// do not reach the server, naming the ACL line, and count it
// (companion_bridge_replies_unheard_total) (bug 484).
func TestABridgeWhoseRepliesTheBrokerDropsSaysSo(t *testing.T) {
	server := mqtttest.MosquittoAccount{Username: "companion-server", Password: "server-secret"}
	bridgeAcct := mqtttest.MosquittoAccount{Username: "b1", Password: testSecret}
	mq := mqtttest.StartMosquittoStatic(t, []byte(`user companion-server
topic readwrite companion/v1/#

user b1
topic read companion/v1/devices/+/commands/#
topic write companion/v1/devices/+/reply
topic write companion/v1/devices/+/status
topic write companion/v1/devices/+/settings
topic write companion/v1/bridges/b1/state
`), server, bridgeAcct)

	var mu sync.Mutex
	var replies, onlines int
	online := make(chan struct{}, 1)
	stateTopic, _ := tree.BridgeState("b1")
	repliesTopic, _ := tree.Replies("dev-1")
	srv := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mq.URL).SetClientID("companion-server").
		SetUsername(server.Username).SetPassword(server.Password).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
			mu.Lock()
			defer mu.Unlock()
			switch {
			case m.Topic() == repliesTopic:
				replies++
			case m.Topic() == stateTopic && string(m.Payload()) == topics.BridgeOnline:
				onlines++
				select {
				case online <- struct{}{}:
				default:
				}
			}
		}))
	if err := mqtt.WaitTokenTimeout(srv.Connect(), waitLong); err != nil {
		t.Fatal(err)
	}
	defer srv.Disconnect(50)
	if err := mqtt.WaitTokenTimeout(srv.Subscribe(tree.Prefix()+"/#", 1, nil), waitLong); err != nil {
		t.Fatal(err)
	}

	var log syncBuffer
	obs := &unheardObserver{}
	s := newSim("dev-1")
	a, err := agent.New(agent.Options{
		MQTTURL: mq.URL, Password: testSecret, BridgeID: "b1", DataDir: t.TempDir(),
		Devices:  []agent.Device{s},
		Logger:   slog.New(slog.NewTextHandler(io.MultiWriter(&log, tbLog{t}), nil)),
		Observer: obs,
	})
	if err != nil {
		t.Fatal(err)
	}
	a.SetUnheardSpan(0)
	done := make(chan error, 1)
	go func() { done <- a.Run(context.Background()) }()
	var stopOnce sync.Once
	stop := func() {
		stopOnce.Do(func() {
			_ = a.Close()
			<-done
		})
	}
	defer stop()
	select {
	case <-online:
	case <-time.After(waitLong):
		t.Fatal("the bridge never said online")
	}

	cmd := command(t, "dev-1", topics.OpPushText, map[string]string{"text": "hello"})
	b, _ := json.Marshal(cmd)
	topic, _ := tree.Command("dev-1", cmd.Op)
	const hint = "its replies do not reach the server"
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(log.String(), hint) {
		if time.Now().After(deadline) {
			t.Fatalf("the bridge never said its replies do not reach the server; texts shown: %d\nlog:\n%s", len(s.Texts()), log.String())
		}
		// The server sends the command again while it hears nothing;
		// each repeat waits for the text on the device, so that it comes
		// to a bridge that finished it.
		if err := mqtt.WaitTokenTimeout(srv.Publish(topic, 1, false, b), waitLong); err != nil {
			t.Fatal(err)
		}
		pollUntil(deadline, func() bool { return len(s.Texts()) > 0 })
		pollUntil(time.Now().Add(100*time.Millisecond), func() bool { return strings.Contains(log.String(), hint) })
	}
	// A few repeats more say nothing more.
	for range 3 {
		if err := mqtt.WaitTokenTimeout(srv.Publish(topic, 1, false, b), waitLong); err != nil {
			t.Fatal(err)
		}
	}
	stop()
	out := log.String()
	if n := strings.Count(out, hint); n != 1 {
		t.Errorf("lines saying %q: %d; want 1", hint, n)
	}
	for _, want := range []string{"'user b1' block", "'topic write companion/v1/devices/+/replies'"} {
		if !strings.Contains(out, want) {
			t.Errorf("the bridge's line does not name %q:\n%s", want, out)
		}
	}
	if n := obs.n.Load(); n != 1 {
		t.Errorf("commands counted unheard: %d; want 1", n)
	}
	if n := len(s.Texts()); n != 1 {
		t.Errorf("texts shown on the device: %d; want 1 (a command repeated runs once)", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if replies != 0 {
		t.Errorf("the server heard %d replies; the broker should have dropped them all", replies)
	}
}

// tbLog writes log lines to the test's log.
type tbLog struct{ t *testing.T }

func (w tbLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// pollUntil polls cond every 5 ms until it holds or deadline passes.
func pollUntil(deadline time.Time, cond func() bool) {
	for !cond() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
}
