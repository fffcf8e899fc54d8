package main

import (
	"io"
	"log/slog"
	"strings"
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
// its devices. It must not say ready then (docs/reliability.md, bug 483),
// and must not answer 201 to a bridge's creation, nor 200 to a new secret
// or token, that it cannot write on Mosquitto: 503 unavailable, nothing
// stored (bug 488); nor 201 to a user's creation, whose MQTT account a
// restart would lose for good (bug 494). A bridge refused at login (its
// account lost) must not blame its secret alone. Once the account is the
// admin, the server must turn ready on its own, and a bridge made then run
// a push. The account loses the admin role once the server has made a
// user (an operator's mistake, or a configuration written again by hand),
// so that the user's own token is tried while the server is not the admin.
func TestServerThatIsNotThePluginsAdminIsNotReady(t *testing.T) {
	mq := mqtttest.StartMosquitto(t, serverAccount)
	refused := newLogSignal("may not use the dynamic-security plugin")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refused), &slog.HandlerOptions{Level: slog.LevelWarn}))
	m := startServerLogging(t, mosquittoConfig(Config{}, mq), logger)
	c := newClient(t, m, "")
	testenv.Eventually(t, 30*time.Second, "ready as the plugin's admin", func() bool {
		return c.do("GET", "/readyz", nil).Status == 200
	})
	admin := newClient(t, m, m.AdminToken())
	r := admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "alice"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	u := r.JSON(t)
	user := newClient(t, m, u["token"].(string))
	for _, r := range mq.Dynsec(t, map[string]any{"command": "removeClientRole", "username": serverAccount.Username, "rolename": "admin"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	select {
	case <-refused.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the server never said its account may not use the dynamic-security plugin")
	}
	// The server connects again after the plugin closed its connection:
	// until then /readyz says the connection is down.
	testenv.Eventually(t, 30*time.Second, "/readyz names the admin role", func() bool {
		r = c.do("GET", "/readyz", nil)
		return r.Status == 503 && strings.Contains(string(r.Body), "admin")
	})

	// Neither the operator's bridge nor a user's own is made with a
	// secret Mosquitto will never have, nor a user with a token it will
	// never have; nor is a secret or token replaced while the old one
	// keeps working there.
	for _, tc := range []struct {
		who          *client
		method, path string
		body         any
	}{
		{admin, "POST", "/api/v1/admin/users", map[string]string{"name": "bob"}},
		{admin, "POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-1"}},
		{user, "POST", "/api/v1/bridges", map[string]string{"bridge_id": "alices-hub"}},
		{admin, "POST", "/api/v1/admin/users/" + u["user_id"].(string) + "/token", nil},
	} {
		r := tc.who.do(tc.method, tc.path, tc.body)
		require.Equal(t, 503, r.Status, "%s %s of a server that cannot write the account on Mosquitto: %s", tc.method, tc.path, r.Body)
		assert.Equal(t, "unavailable", r.JSON(t)["code"], "%s", r.Body)
		assert.Contains(t, string(r.Body), "admin")
		assert.NotEmpty(t, r.Header.Get("Retry-After"))
	}
	require.Equal(t, 200, user.do("GET", "/api/v1/devices", nil).Status, "the user's token was replaced all the same")
	r = user.do("GET", "/api/v1/bridges", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Empty(t, r.JSON(t)["bridges"], "a bridge was stored all the same")

	// A bridge whose account the server could not make (say, made before
	// and lost with a restart) is refused at login: it must point at the
	// server rather than only at its secret.
	refusedLogin := newLogSignal("could not make the bridge's account")
	lost := runBridge(t, m, mq.URL, &fleet{bridgeID: "bridge-0", bridgeSecret: "never-made"}, nil, nil, func(o *agent.Options) {
		o.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refusedLogin), &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	select {
	case <-refusedLogin.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the bridge refused at login never said the server may not have made its account")
	}
	lost.stop()

	for _, r := range mq.Dynsec(t, map[string]any{"command": "addClientRole", "username": serverAccount.Username, "rolename": "admin"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	testenv.Eventually(t, 30*time.Second, "ready once its account is the plugin's admin", func() bool {
		return c.do("GET", "/readyz", nil).Status == 200
	})
	// Bridges are made now, and one runs a push.
	f := setupFleet(t, m, "dev-1")
	s := sim.New(sim.Options{ID: "dev-1"})
	runBridge(t, m, mq.URL, f, []agent.Device{s}, map[string]*sim.Device{"dev-1": s}, nil)
	r = f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.Len(t, s.Texts(), 1)
}

// An operator makes some Mosquitto clients by hand (a monitoring client,
// the plugin's admin), which the server never touches. A bridge named as
// one got a 201 and a secret that opened nothing: it logs in under its id,
// the client's password is the operator's (docs/reliability.md, bug 500).
// Its creation must be a 409 bridge_exists saying why, nothing stored, by a
// user and by the admin alike, while other ids are made as before.
func TestBridgeNamedAsAnOperatorsMosquittoClientIsRefused(t *testing.T) {
	t.Parallel()
	mq := mqtttest.StartMosquitto(t, serverAccount)
	for _, r := range mq.Dynsec(t, map[string]any{"command": "createClient", "username": "ops-monitor", "password": "operators-own"}) {
		require.Empty(t, r.Error, "%s", r.Command)
	}
	m := startServer(t, mosquittoConfig(Config{}, mq))
	f := setupFleet(t, m)
	for _, tc := range []struct {
		who  *client
		path string
	}{{f.user, "/api/v1/bridges"}, {f.admin, "/api/v1/admin/bridges"}} {
		r := tc.who.do("POST", tc.path, map[string]string{"bridge_id": "ops-monitor"})
		require.Equal(t, 409, r.Status, "POST %s named as the operator's client: %s", tc.path, r.Body)
		assert.Equal(t, "bridge_exists", r.JSON(t)["code"])
		assert.Contains(t, string(r.Body), "MQTT broker")
	}
	r := f.user.do("GET", "/api/v1/bridges", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Empty(t, r.JSON(t)["bridges"], "a bridge was stored all the same")
	r = f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "alices-hub"})
	require.Equal(t, 201, r.Status, "a bridge of another id: %s", r.Body)
	// The operator's client is as the operator left it.
	for _, r := range mq.Dynsec(t, map[string]any{"command": "getClient", "username": "ops-monitor"}) {
		require.Empty(t, r.Error, "%s", r.Command)
		assert.NotContains(t, string(r.Data), "companion", "the server took the operator's client")
	}
}
