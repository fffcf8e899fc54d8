package agent_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

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
	b := startBroker(t)
	w := newWatcher(t, b)
	var first, second syncBuffer
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}, logger: slog.New(slog.NewTextHandler(&first, nil))})
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}, logger: slog.New(slog.NewTextHandler(&second, nil))})

	const hint = "another process may log in as this bridge"
	// Each login closes the other's connection, and each bridge says
	// "online" again on the new one: six takeovers, three of each
	// bridge's connections closed. Paho's backoff between attempts grows
	// (1, 2, 4, 8 s), so more than waitBridgeState's wait.
	topic, _ := tree.BridgeState("b1")
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	for {
		b.pubs.mu.Lock()
		got, ch := b.pubs.n[topic+"\x00"+topics.BridgeOnline], b.pubs.notify
		b.pubs.mu.Unlock()
		if got >= 2+6 {
			break
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("the bridges said online %d times; waited for 8", got)
		}
	}
	n1, n2 := strings.Count(first.String(), hint), strings.Count(second.String(), hint)
	if n1+n2 == 0 || n1 > 1 || n2 > 1 {
		t.Errorf("lines saying %q: %d and %d; want one of either or both, and no more\nfirst:\n%s", hint, n1, n2, first.String())
	}
}
