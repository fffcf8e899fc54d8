package embedded_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// Two bridge processes started with the same id and secret (a copy of
// the gateway's unit on a second machine, a test run beside the
// service) take the bridge's client id from each other, each login
// closing the other's connection, for as long as both run. The embedded
// broker published the Will of each connection taken over: every flap
// marked every device of the bridge offline (a store write, an event to
// every watcher, a retained status each) before the "online" of the
// connection that took over brought them back, and nothing in the log
// said why. Mosquitto publishes no Will on a takeover (the client id is
// connected again) and logs it. The broker holds such a Will as it holds
// that of a bridge it disconnects itself (published only if the bridge
// is not connected once the grace is over), and says once that two
// connections log in as the bridge (bug 454).
func TestATakenOverBridgeConnectionPublishesNoWillAndIsNamedOnce(t *testing.T) {
	var logs testenv.Buffer
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
		KickGrace:      time.Minute, // no held Will published within the test
		Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	ended := make(chan struct{}, 100)
	t.Cleanup(embedded.OnConnectionEnded(func() { ended <- struct{}{} }))
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	state := tp(tree.BridgeState("bridge-1"))
	w := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), w.subscribe(t, state))
	asBridge := func(o *mqtt.ClientOptions) {
		o.SetClientID("companion-bridge-bridge-1").SetCleanSession(false).SetWill(state, topics.BridgeOffline, 1, true)
	}
	const takeovers = 6
	prev := mustDial(t, s.Addr(), "bridge-1", "b1-secret", asBridge)
	prev.publish(t, state, true, topics.BridgeOnline)
	for range takeovers {
		next := mustDial(t, s.Addr(), "bridge-1", "b1-secret", asBridge)
		prev.waitLost(t)
		select {
		case <-ended: // the connection taken over: its Will, if any, is out
		case <-time.After(wait):
			t.Fatal("the connection taken over did not end")
		}
		next.publish(t, state, true, topics.BridgeOnline)
		prev = next
	}
	// A mark after everything: what the watcher gets before it is all
	// the takeovers made it get.
	const mark = "mark"
	w.publish(t, state, false, mark)
	offline := 0
	for {
		m := w.next(t)
		if string(m.Payload()) == mark {
			break
		}
		if string(m.Payload()) == topics.BridgeOffline {
			offline++
		}
	}
	assert.Zero(t, offline, "Wills published for %d takeovers of a connected bridge", takeovers)
	named := strings.Count(logs.String(), "two connections log in as the same bridge")
	assert.Equal(t, 1, named, "lines naming the bridge's duplicate logins; the log:\n%s", logs.String())
}
