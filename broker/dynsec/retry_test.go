package dynsec_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
)

// logCount counts the driver's log records by message.
type logCount struct {
	mu sync.Mutex
	n  map[string]int
}

func (l *logCount) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCount) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logCount) WithGroup(string) slog.Handler            { return l }

func (l *logCount) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n[r.Message]++
	return nil
}

func (l *logCount) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n[msg]
}

// Changes of a bridge's secret and of a user's token while Mosquitto is
// away leave one retry of each account, the latest change's: each queued
// a retry of its own, kept until Mosquitto was back, the list growing with
// every change (docs/reliability.md, bug 363). The store's secret and
// token are the ones that work once it is back.
func TestChangesWhileMosquittoIsAwayKeepOneRetryAnAccount(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	logs := &logCount{n: map[string]int{}}
	d, cn, granted := newDriverConn(t, mq, server, dynsec.Options{Store: st, Logger: slog.New(logs)})
	require.True(t, granted)
	st.createBridge("b1", "secret-0")
	st.assign("dev-1", "b1")
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-0"))
	st.setUser("u1", "token-0")
	require.NoError(t, d.UserCreated(ctx, "u1", "token-0"))

	cn.cut.Store(true)
	const changes = 5
	for i := 1; i <= changes; i++ {
		secret, token := fmt.Sprintf("secret-%d", i), fmt.Sprintf("token-%d", i)
		st.createBridge("b1", secret)
		require.Error(t, d.BridgeSecretChanged(ctx, "b1", secret))
		st.setUser("u1", token)
		require.Error(t, d.UserTokenChanged(ctx, "u1", token))
	}
	cn.cut.Store(false)
	require.NoError(t, d.Reconcile(ctx))

	secretIs(t, mq, "b1", fmt.Sprintf("secret-%d", changes), "secret-0")
	assert.NoError(t, canConnect(mq, "app-u1", "u1", fmt.Sprintf("token-%d", changes)), "the user's latest token")
	assert.Equal(t, 2, logs.count("Mosquitto account created on retry"), "accounts made on retry")
	assert.Zero(t, logs.count("Mosquitto account not retried: the bridge was deleted or made anew, or the secret replaced, since"),
		"retries of changes a later one replaced")
}
