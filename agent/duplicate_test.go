package agent_test

import (
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// Two bridges started with the same id and secret (a second gateway set
// up from the first one's unit file, a test run beside the service) log
// in with the same client id, and the broker closes the older connection
// at each login: each bridge's connection is closed a moment after it is
// made, over and over, as long as both run. Each bridge logged only
// "MQTT connection lost" (EOF) and "connected", as a bad network would
// have it; on the user's own bridge, whose owner has no server log to
// read, nothing named the cause. A bridge whose connection is closed soon
// after it was made, three times within a minute, says once an hour that
// another process may log in as it (bug 458).
func TestABridgeSaysAnotherProcessMayLogInAsIt(t *testing.T) {
	anotherProcessLogsIn(t, false)
}

// A broker that closes a connection with data it has not read (the
// bridge's PINGREQ, a status it was sending) resets it: Mosquitto, taking
// a bridge's connection over, did so for two of thirteen takeovers of two
// idle bridges with one id. The bridge heard "connection reset by peer"
// or "broken pipe", not EOF, and did not count those closings: a busy
// pair could take each other over for good without either saying why
// (docs/reliability.md, bug 467).
func TestABridgeSaysAnotherProcessMayLogInAsItWhenTheBrokerResets(t *testing.T) {
	anotherProcessLogsIn(t, true)
}

// anotherProcessLogsIn has another client log in as the bridge, again and
// again, each time as it has said online; with reset, the broker's close
// of the connection taken over reaches the bridge as a reset.
func anotherProcessLogsIn(t *testing.T, reset bool) {
	b := startBroker(t)
	w := newWatcher(t, b)
	var log syncBuffer
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}, logger: slog.New(slog.NewTextHandler(&log, nil))})

	// The other process is a client that logs in with the bridge's
	// client id, as a second bridge would, once the bridge has said
	// "online" on its connection, and leaves: the broker closes the
	// bridge's connection at each such login, a moment after it was
	// made, and the bridge connects again. (Two bridges started together
	// may settle with neither taking over for a while: paho's backoffs
	// grow, so a test of them waits by chance.)
	topic, _ := tree.BridgeState("b1")
	onlines := func() (int, chan struct{}) {
		b.pubs.mu.Lock()
		defer b.pubs.mu.Unlock()
		return b.pubs.n[topic+"\x00"+topics.BridgeOnline], b.pubs.notify
	}
	waitOnlines := func(want int) {
		t.Helper()
		deadline := time.NewTimer(time.Minute)
		defer deadline.Stop()
		for {
			got, ch := onlines()
			if got >= want {
				return
			}
			select {
			case <-ch:
			case <-deadline.C:
				t.Fatalf("the bridge said online %d times; waited for %d", got, want)
			}
		}
	}
	const hint = "another process may log in as this bridge"
	const closingsToHint = 3 // the agent's: three closings soon after a connect
	for i := 1; i <= closingsToHint+1; i++ {
		waitOnlines(i)
		if reset {
			cl, ok := b.srv.Clients.Get("companion-bridge-b1")
			if !ok {
				t.Fatal("the broker has no connection of the bridge")
			}
			// Closed with linger 0, the socket is reset, as one closed
			// with unread data is.
			if err := cl.Net.Conn.(*net.TCPConn).SetLinger(0); err != nil {
				t.Fatal(err)
			}
		}
		other := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(b.url).SetClientID("companion-bridge-b1").SetCleanSession(false))
		if err := mqtt.WaitTokenTimeout(other.Connect(), waitLong); err != nil {
			t.Fatal(err)
		}
		other.Disconnect(0)
	}
	waitOnlines(closingsToHint + 2)
	if n := strings.Count(log.String(), hint); n != 1 {
		t.Errorf("lines saying %q after %d logins of another process: %d; want 1\nlog:\n%s", hint, closingsToHint+1, n, log.String())
	}
}
