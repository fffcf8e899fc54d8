package broker

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// A bridge whose connection flaps (a bad link, a NAT that drops its flow,
// two processes started with its id) says "offline" (its Will) and
// "online" again and again, and the server logged two info lines for each
// time: a day of a bridge flapping every few seconds was tens of
// thousands of lines. The first "offline" and "online" are logged as they
// come (a restart shows both); the next ones within the interval are
// counted, and once it is over one line says the bridge's state then,
// with how many changes were not logged, so the log's last word on the
// bridge is still what it is now (bug 455).
func TestAFlappingBridgesStateIsLoggedOnceAnInterval(t *testing.T) {
	var logs testenv.Buffer
	e := newEnvTuned(t, true, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		o.stateLogEvery = 500 * time.Millisecond
	})
	fb := connectBridge(t, e)
	fb.online(t, e, "dev-1")
	fb.online(t, e, "dev-2")
	bs, _ := tree.BridgeState("b1")
	say := func(state string) {
		t.Helper()
		require.NoError(t, mqtt.WaitTokenTimeout(fb.c.Publish(bs, 1, true, state), 5*time.Second))
	}
	const flaps = 10
	for range flaps {
		say(topics.BridgeOffline)
		say(topics.BridgeOnline)
	}
	say(topics.BridgeOffline) // and it stays away
	lines := func() int {
		return strings.Count(logs.String(), `msg="bridge offline`) + strings.Count(logs.String(), `msg="bridge online`)
	}
	// Either every change has its line (as before), or the line that
	// says the state once the interval is over has come.
	testenv.Eventually(t, 10*time.Second, "the bridge's state logged", func() bool {
		return lines() >= 2*flaps+1 || strings.Contains(logs.String(), "not_logged")
	})
	assert.LessOrEqual(t, lines(), 3, "lines of the bridge's state for %d changes:\n%s", 2*flaps+1, logs.String())
	var last string
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if strings.Contains(l, `msg="bridge offline`) || strings.Contains(l, `msg="bridge online`) {
			last = l
		}
	}
	assert.Contains(t, last, `msg="bridge offline`, "the last line says the bridge is away")
}
