package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
)

// Two server replicas on one PostgreSQL database and one broker (CONTRACT
// §11): what the admin made through one, a user uses through the other;
// every operation runs end to end through the second while the bridge's
// server-side peer is the first; a command accepted by one is waited for
// (Prefer: wait) on the other.
func TestTwoReplicasShareOnePostgresStore(t *testing.T) {
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	// The server checks the schema and does not change it: companion
	// migrate does.
	early := NewMain(Config{Store: dsn, Data: t.TempDir(), HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0"}, testLogger(t))
	err := early.Run(context.Background())
	early.Close()
	require.ErrorIs(t, err, postgres.ErrSchemaOld)
	assert.Contains(t, err.Error(), "companion migrate")

	var out, errOut bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"migrate", "--store", dsn}, &out, &errOut), "%s", errOut.String())
	assert.Contains(t, out.String(), "up to date")

	mq := mqtttest.StartMosquitto(t, serverAccount)
	m1 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r1"}, mq)
	m2 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r2"}, mq)

	f := setupFleet(t, m1, "dev-1", "dev-2")
	b := startBridge(t, m1, mq.URL, f, "", "dev-1", "dev-2")
	on1 := f.user
	on2 := newClient(t, m2, f.user.token)

	f.user = on2
	exerciseEveryOperation(t, f, b, "dev-1")

	r := on1.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	for _, c := range []struct {
		name         string
		send, waitOn *client
	}{{"accepted on 1, waited for on 2", on1, on2}, {"accepted on 2, waited for on 1", on2, on1}} {
		cmd := c.send.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": c.name})
		got := c.waitOn.waitFinal("dev-2", cmd["id"].(string))
		assert.Equal(t, "succeeded", got["state"], c.name)
	}
	texts := b.sims["dev-2"].Texts()
	require.Len(t, texts, 2, "each command ran once")
}
