package embedded_test

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/embedded"
)

type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A bridge (a user may run their own) that publishes in a loop on the
// topics of a device it does not serve had the broker log a warning for
// each publish dropped: one client's loop filled the operator's log. The
// line is logged once a minute per bridge, saying how many it left out
// (bug 390).
func TestABridgesDroppedPublishesAreLoggedOnceAMinute(t *testing.T) {
	var logs logBuffer
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
		Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	srv := mustDial(t, s.Addr(), serverUser, serverPass, nil)
	require.Equal(t, byte(1), srv.subscribe(t, tp(tree.Status("dev-1"))))
	br := mustDial(t, s.Addr(), "bridge-1", "b1-secret", nil)
	const n = 100
	var toks []mqtt.Token
	for i := 0; i < n; i++ {
		toks = append(toks, br.Publish(tp(tree.Status("dev-2")), 1, false, `{}`)) // bridge-2's device
	}
	for _, tok := range toks {
		require.NoError(t, mqtt.WaitTokenTimeout(tok, wait))
	}
	br.publish(t, tp(tree.Status("dev-1")), false, `{}`)
	require.Equal(t, tp(tree.Status("dev-1")), srv.next(t).Topic())

	got := strings.Count(logs.String(), "mqtt publish for a device the bridge does not serve dropped")
	assert.Equal(t, 1, got, "lines for %d publishes dropped; log:\n%s", n, logs.String())
}

// Anyone who reaches the MQTT listener could have the broker log a line
// for every CONNECT it refused: a client retrying a wrong password in a
// loop, or a scanner, wrote as fast as it connected. The first refusal of
// a source address and reason is logged, the next ones once a minute with
// their count (bug 391).
func TestRefusedLoginsAreLoggedOnceAMinutePerSource(t *testing.T) {
	var logs logBuffer
	s, err := embedded.New(embedded.Options{
		Listen:         "127.0.0.1:0",
		Accounts:       newFakeAccounts(),
		ServerUsername: serverUser,
		ServerPassword: serverPass,
		Logger:         slog.New(slog.NewTextHandler(&logs, nil)),
	})
	require.NoError(t, err)
	require.NoError(t, s.Start())
	t.Cleanup(func() { require.NoError(t, s.Close()) })

	const n = 50
	for i := 0; i < n; i++ {
		_, err := dial(t, s.Addr(), "bridge-1", "wrong", nil)
		require.Error(t, err)
	}
	got := 0
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `msg="mqtt connect refused"`) && strings.Contains(l, `reason="bad credentials"`) {
			got++
		}
	}
	assert.Equal(t, 1, got, "lines for %d refused logins; log:\n%s", n, logs.String())
	// A refusal of another reason is its own line.
	_, err = dial(t, s.Addr(), "", "", nil)
	require.Error(t, err)
	assert.Contains(t, logs.String(), `reason=anonymous`)
}
