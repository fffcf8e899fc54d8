package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/asyncapitest"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
	"github.com/devicecompanion/companion/topics"
)

// Two server replicas on one PostgreSQL database and one broker (CONTRACT
// §11): what the admin made through one, a user uses through the other;
// every operation runs end to end through the second while the bridge's
// server-side peer is the first; a command accepted by one is waited for
// (Prefer: wait) on the other.
func TestTwoReplicasShareOnePostgresStore(t *testing.T) {
	t.Parallel()
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

	mq := mqtttest.StartMosquitto(t, serverAccount, watcherAccount)
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

	// A device moved through the replica that does not dispatch: it tells
	// the one that does on the servers' topic of docs/asyncapi.yaml (the
	// broker's tests check what the replicas then do). It says nothing of
	// the bridges about to be disconnected: Mosquitto publishes no Will
	// for them (docs/reliability.md, bug 201; the broker's
	// TestTheWillOfABridgeDisconnectedForItsRightsIsHeld has that word).
	var log wireLog
	watch := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mq.URL).SetClientID("moved-watcher").
		SetUsername(watcherAccount.Username).SetPassword(watcherAccount.Password).
		SetDefaultPublishHandler(log.add))
	require.NoError(t, mqtt.WaitTokenTimeout(watch.Connect(), 10*time.Second))
	defer watch.Disconnect(0)
	tree := topics.MustNew(topics.DefaultPrefix)
	require.NoError(t, mqtt.WaitTokenTimeout(watch.Subscribe(tree.DevicesMoved(), 1, nil), 10*time.Second))
	testenv.Eventually(t, 20*time.Second, "a dispatcher", func() bool { return m1.pg.Dispatching() || m2.pg.Dispatching() })
	quiet := m1
	if m1.pg.Dispatching() {
		quiet = m2
	}
	admin := newClient(t, quiet, quiet.AdminToken())
	r = admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-2"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = admin.do("PUT", "/api/v1/admin/devices/dev-2/bridge", map[string]any{"bridge_id": "bridge-2"})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "the word of the move", func() bool { return log.seen(tree.DevicesMoved(), "dev-2") })
	doc := asyncapitest.Load(t)
	for _, msg := range log.all() {
		channel, err := doc.Validate(msg.topic, msg.payload, msg.retained)
		require.NoError(t, err)
		assert.Equal(t, "devicesMoved", channel)
	}
}

// With two replicas one dispatches (CONTRACT §11): commands accepted on
// either go out once each, in the order they were accepted, and when the
// dispatcher goes, the other replica takes over and what is sent to it
// still runs.
func TestReplicasPublishEachCommandOnceInOrder(t *testing.T) {
	t.Parallel()
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	require.NoError(t, postgres.Migrate(context.Background(), dsn))
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m1 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r1"}, mq)
	m2 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r2"}, mq)
	f := setupFleet(t, m1, "dev-1")
	on := []*client{f.user, newClient(t, m2, f.user.token)}
	r := on[1].do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	// Everything published on the device's command topics, as the broker
	// hands it out.
	var mu sync.Mutex
	var published []string
	watch := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(mq.URL).SetClientID("watch").
		SetUsername(serverAccount.Username).SetPassword(serverAccount.Password).
		SetOrderMatters(true))
	require.NoError(t, mqtt.WaitTokenTimeout(watch.Connect(), 10*time.Second))
	defer watch.Disconnect(0)
	require.NoError(t, mqtt.WaitTokenTimeout(watch.Subscribe("companion/v1/devices/dev-1/commands/#", 1, func(_ mqtt.Client, msg mqtt.Message) {
		var c topics.Command
		if json.Unmarshal(msg.Payload(), &c) == nil && c.Op != topics.OpCancel {
			mu.Lock()
			published = append(published, c.ID)
			mu.Unlock()
		}
	}), 10*time.Second))
	b := startBridge(t, m1, mq.URL, f, "", "dev-1")
	// Once the bridge is online: its coming online resends what is open,
	// by design (it may have missed it), which is not what is counted here.
	testenv.Eventually(t, 20*time.Second, "the device online", func() bool {
		r := on[0].do("GET", "/api/v1/devices/dev-1/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == true
	})
	// The status read online is stored before the dispatcher takes the
	// device's coming online in (and resends what is open): let it.
	time.Sleep(time.Second)

	// Both replicas accept at once, 40 each: acceptance order is the
	// order of the ids (they rise in commit order per device).
	var ids []string
	var wg sync.WaitGroup
	for _, c := range on {
		wg.Go(func() {
			for i := range 40 {
				cmd := c.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": fmt.Sprintf("t%d", i)})
				mu.Lock()
				ids = append(ids, cmd["id"].(string))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	slices.Sort(ids)
	for _, id := range ids {
		assert.Equal(t, "succeeded", on[0].waitFinal("dev-1", id)["state"])
	}
	assert.Equal(t, ids, textIDs(b.sims["dev-1"]), "the device ran them in acceptance order")
	mu.Lock()
	assert.Equal(t, ids, published, "each went out once, in acceptance order")
	mu.Unlock()

	// The dispatcher goes; the other takes over.
	var stays *Main
	var stay *client
	switch {
	case m1.pg.Dispatching():
		require.NoError(t, m1.Close())
		stays, stay = m2, on[1]
	case m2.pg.Dispatching():
		require.NoError(t, m2.Close())
		stays, stay = m1, on[0]
	default:
		t.Fatal("neither replica dispatches")
	}
	testenv.Eventually(t, 20*time.Second, "the other replica to take over", stays.pg.Dispatching)
	cmd := stay.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "after the takeover"})
	assert.Equal(t, "succeeded", stay.waitFinal("dev-1", cmd["id"].(string))["state"])
	assert.Equal(t, append(ids, cmd["id"].(string)), textIDs(b.sims["dev-1"]))
}

// /readyz asks a PostgreSQL store (CONTRACT §1: store open, MQTT
// connected): while the database is down every API request is a 503
// unavailable, and /readyz says so, naming what is missing; once the
// database is back, so is the replica.
func TestReadyzAsksPostgreSQL(t *testing.T) {
	t.Parallel() // it mostly waits
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	require.NoError(t, postgres.Migrate(t.Context(), dsn))
	m := startServer(t, Config{Store: dsn})
	testenv.Eventually(t, 10*time.Second, "the server connected to its broker", m.Broker.Ready)
	type problem struct{ Code, Detail string }
	readyz := func() (int, problem) {
		resp, err := http.Get("http://" + m.HTTPAddr() + "/readyz")
		require.NoError(t, err)
		defer resp.Body.Close()
		var p problem
		if resp.StatusCode != 200 {
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&p))
		}
		return resp.StatusCode, p
	}
	status, _ := readyz()
	require.Equal(t, 200, status)

	require.NoError(t, pg.Stop())
	status, p := readyz()
	assert.Equal(t, 503, status)
	assert.Equal(t, "not_ready", p.Code)
	assert.Contains(t, p.Detail, "PostgreSQL store cannot be reached")

	pg.Restart(t)
	testenv.Eventually(t, 10*time.Second, "/readyz 200 with the database back", func() bool {
		status, _ := readyz()
		return status == 200
	})
}
