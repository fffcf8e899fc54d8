package main

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A bridge the server's broker refuses, for a wrong secret or because its
// bridge was deleted on the server, retries in vain: it says so once (not
// once an attempt) with the broker's reason and what to do, the secret to
// give or the bridge to create again. Before, it said "MQTT connect
// failed; retrying err=\"not Authorized\"" and no more, a minute after
// minute (docs/reliability.md, bug 198).
func TestABridgeTheBrokerRefusesSaysWhatToDo(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	run := func(t *testing.T, b *fleet) *testenv.Buffer {
		t.Helper()
		logs := &testenv.Buffer{}
		runLoggedBridge(t, m, b, logs)
		return logs
	}
	refusal := func(t *testing.T, logs *testenv.Buffer) {
		t.Helper()
		testenv.Eventually(t, 30*time.Second, "the refusal logged", func() bool {
			return strings.Contains(logs.String(), "MQTT connect failed")
		})
		var failed []string
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, "MQTT connect failed") {
				failed = append(failed, l)
			}
		}
		require.Len(t, failed, 1, "%s", logs.String())
		for _, want := range []string{`err="not Authorized"`, "hint=", "--bridge-secret is not the secret of --bridge-id",
			"deleted on the server", "given a new secret", "companion bridge create ID", "companion bridge secret ID"} {
			assert.Contains(t, failed[0], want)
		}
	}

	t.Run("a wrong secret", func(t *testing.T) {
		refusal(t, run(t, &fleet{bridgeID: f.bridgeID, bridgeSecret: "cbs_wrong"}))
	})
	t.Run("deleted on the server", func(t *testing.T) {
		r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "hub"})
		require.Equal(t, 201, r.Status, "%s", r.Body)
		logs := run(t, &fleet{bridgeID: "hub", bridgeSecret: r.JSON(t)["secret"].(string)})
		testenv.Eventually(t, 30*time.Second, "the hub connected", func() bool {
			return strings.Contains(logs.String(), "msg=connected")
		})
		require.Equal(t, 204, f.user.do("DELETE", "/api/v1/bridges/hub", nil).Status)
		refusal(t, logs)
	})
	t.Run("given a new secret on the server", func(t *testing.T) {
		r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "hub-2"})
		require.Equal(t, 201, r.Status, "%s", r.Body)
		logs := run(t, &fleet{bridgeID: "hub-2", bridgeSecret: r.JSON(t)["secret"].(string)})
		testenv.Eventually(t, 30*time.Second, "the hub connected", func() bool {
			return strings.Contains(logs.String(), "msg=connected")
		})
		r = f.user.do("POST", "/api/v1/bridges/hub-2/secret", nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
		refusal(t, logs)
	})
}

// runLoggedBridge runs a bridge as b, serving no device of its own, its
// log at info in logs.
func runLoggedBridge(t *testing.T, m *Main, b *fleet, logs *testenv.Buffer) {
	t.Helper()
	runBridge(t, m, m.MQTTURL(), b, nil, nil, func(o *agent.Options) {
		o.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
}
