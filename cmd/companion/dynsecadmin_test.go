package main

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// A server whose Mosquitto account has its role on the prefix but is not
// the dynamic-security plugin's admin (made by hand rather than with
// mosquitto_ctrl dynsec init) cannot make a bridge's account nor grant it
// its devices: the bridge it creates is refused at login. It must not say
// ready then; once the account is the admin, it must turn ready on its
// own and a new bridge work (docs/reliability.md, bug 503).
func TestServerThatIsNotThePluginsAdminIsNotReady(t *testing.T) {
	notAdmin := serverAccount
	notAdmin.Admin = false
	mq := mqtttest.StartMosquitto(t, notAdmin)
	refused := newLogSignal("may not use the dynamic-security plugin")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refused), &slog.HandlerOptions{Level: slog.LevelWarn}))
	m := startServerLogging(t, mosquittoConfig(Config{}, mq), logger)
	select {
	case <-refused.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the server never said its account may not use the dynamic-security plugin")
	}
	c := newClient(t, m, "")
	r := c.do("GET", "/readyz", nil)
	require.Equal(t, 503, r.Status, "/readyz of a server that cannot make any bridge's account: %s", r.Body)
	require.Contains(t, string(r.Body), "admin")

	for _, r := range mq.Dynsec(t, map[string]any{"command": "addClientRole", "username": notAdmin.Username, "rolename": "admin"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	testenv.Eventually(t, 30*time.Second, "ready once its account is the plugin's admin", func() bool {
		return c.do("GET", "/readyz", nil).Status == 200
	})
	f := setupFleet(t, m, "dev-1")
	s := sim.New(sim.Options{ID: "dev-1"})
	runBridge(t, m, mq.URL, f, []agent.Device{s}, map[string]*sim.Device{"dev-1": s}, nil)
	r = f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
}
