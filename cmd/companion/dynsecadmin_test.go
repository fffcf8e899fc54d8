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
// ready then, and the bridge must not blame its secret alone; once the
// account is the admin, the server must turn ready on its own, make the
// bridge's account, and the bridge run a push (docs/reliability.md, bug
// 503).
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

	// A bridge created meanwhile has no account: refused at login, it
	// must point at the server rather than only at its secret.
	f := setupFleet(t, m, "dev-1")
	refusedLogin := newLogSignal("could not make the bridge's account")
	s := sim.New(sim.Options{ID: "dev-1"})
	runBridge(t, m, mq.URL, f, []agent.Device{s}, map[string]*sim.Device{"dev-1": s}, func(o *agent.Options) {
		o.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refusedLogin), &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	select {
	case <-refusedLogin.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the bridge refused at login never said the server may not have made its account")
	}

	for _, r := range mq.Dynsec(t, map[string]any{"command": "addClientRole", "username": notAdmin.Username, "rolename": "admin"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	testenv.Eventually(t, 30*time.Second, "ready once its account is the plugin's admin", func() bool {
		return c.do("GET", "/readyz", nil).Status == 200
	})
	// The server makes the bridge's account it could not (its retry),
	// and the bridge, logging in again, runs the push.
	r = f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.Len(t, s.Texts(), 1)
}
