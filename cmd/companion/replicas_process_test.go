package main

import (
	"context"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

// Two `companion serve` replicas on one PostgreSQL and one Mosquitto take
// load through both; the first, which dispatches (it campaigned first), is
// SIGKILLed halfway (CONTRACT §11). Every command either replica accepted
// succeeds, and each runs once on its device.
func TestProcessReplicaKilledUnderLoad(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	c, _, dsn := newPostgresProcCluster(t)

	// The second replica: its own address and data, the same store,
	// broker and admin token.
	second := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(t))
	args := append([]string{"serve", "--http", second, "--data", t.TempDir(),
		"--admin-token", c.adminToken, "--log-level", "warn",
		"--rate-per-token", "0", "--max-open-commands", "10000",
		"--store", dsn, "--replica-id", "r2"}, c.serverMQTT...)
	r2 := startProc(t, "companion-r2", c.companion, args...)
	testenv.Eventually(t, 20*time.Second, "replica 2 ready", func() bool {
		if !r2.running() {
			t.Fatalf("replica 2 exited: %v", r2.waitErr)
		}
		resp, err := http.Get("http://" + second + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	c.startBridge()

	bases := []string{c.base(), "http://" + second}
	const perReplica = 150
	var (
		mu       sync.Mutex
		accepted = map[string]string{}
		wg       sync.WaitGroup
		sent     = make(chan struct{}, 2*perReplica)
	)
	for r, base := range bases {
		for w := range 4 {
			wg.Go(func() {
				hc := loadClient(1)
				defer hc.CloseIdleConnections()
				for i := w; i < perReplica; i += 4 {
					dev := c.devices[i%len(c.devices)]
					p := c.pushTo(hc, base, dev, r*perReplica+i)
					sent <- struct{}{}
					if id := p.acceptedID(); id != "" {
						mu.Lock()
						accepted[id] = dev
						mu.Unlock()
					}
				}
			})
		}
	}
	for range perReplica {
		<-sent // halfway through the load
	}
	c.server.kill()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	t.Logf("replica 1 killed under load; %d of %d requests accepted", len(accepted), 2*perReplica)
	require.Greater(t, len(accepted), perReplica, "replica 2 accepted its share")
	c.user = &client{tb: t, base: "http://" + second, token: c.user.token, hc: http.DefaultClient}
	// A request replica 1 committed but did not answer before the kill
	// may run too (once): its client saw no 202.
	c.checkRunOnce(accepted, true)
}

// PostgreSQL restarted under load: requests it refuses meanwhile get 503
// unavailable, no 202; every command accepted before or after succeeds,
// each once.
func TestProcessPostgresRestartedUnderLoad(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	c, pg, _ := newPostgresProcCluster(t)
	c.startBridge()

	const n = 300
	var (
		mu       sync.Mutex
		refused  = map[int]int{} // status → count (0: no answer)
		accepted = map[string]string{}
		wg       sync.WaitGroup
		sent     = make(chan struct{}, n)
	)
	for w := range 4 {
		wg.Go(func() {
			hc := loadClient(1)
			defer hc.CloseIdleConnections()
			for i := w; i < n; i += 4 {
				dev := c.devices[i%len(c.devices)]
				p := c.push(hc, dev, i)
				sent <- struct{}{}
				mu.Lock()
				if id := p.acceptedID(); id != "" {
					accepted[id] = dev
				} else {
					refused[p.status]++
				}
				mu.Unlock()
			}
		})
	}
	for range n / 3 {
		<-sent
	}
	pg.Restart(t)
	wg.Wait()

	// Once it is back, requests are taken again within a moment (the
	// store tries a new connection 100 ms after the last that failed, bug
	// 579), and then every one.
	hc := loadClient(1)
	defer hc.CloseIdleConnections()
	deadline := time.Now().Add(5 * time.Second)
	for i := 0; ; i++ {
		p := c.push(hc, c.devices[0], 2*n+i)
		if id := p.acceptedID(); id != "" {
			accepted[id] = c.devices[0]
			break
		}
		require.Equal(t, 503, p.status, "a request as PostgreSQL came back: %v %s", p.err, p.body)
		require.True(t, time.Now().Before(deadline), "requests still refused 5 s after PostgreSQL came back: %d %s", p.status, p.body)
		time.Sleep(20 * time.Millisecond)
	}
	for i := range 40 {
		dev := c.devices[i%len(c.devices)]
		p := c.push(hc, dev, n+i)
		id := p.acceptedID()
		require.NotEmpty(t, id, "after the restart: %d %v %s", p.status, p.err, p.body)
		accepted[id] = dev
	}

	mu.Lock()
	defer mu.Unlock()
	t.Logf("PostgreSQL restarted under load; %d of %d requests accepted; refused by status: %v", len(accepted), n+40, refused)
	assert.Zero(t, refused[500], "requests the outage refused are 503 unavailable, not 500")
	// A commit whose answer the restart cut off reads as refused to its
	// client; such a command may run (once).
	c.checkRunOnce(accepted, true)
}

// newPostgresProcCluster is a procCluster whose server (replica r1) keeps
// its state in a PostgreSQL of the test's own and uses a Mosquitto of the
// test's own, started, with the fleet set up; the bridge is not started.
func newPostgresProcCluster(t *testing.T) (*procCluster, *pgtest.Server, string) {
	t.Helper()
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	return newPostgresProcClusterOn(t, dsn), pg, dsn
}

// newPostgresProcClusterOn is newPostgresProcCluster on the database of
// dsn, which it migrates, with the server's extra flags.
func newPostgresProcClusterOn(t *testing.T, dsn string, flags ...string) *procCluster {
	t.Helper()
	require.NoError(t, postgres.Migrate(context.Background(), dsn))
	mq := mqtttest.StartMosquitto(t, serverAccount)

	c := newProcCluster(t, 4)
	c.mqttURL = mq.URL
	c.serverMQTT = []string{"--mqtt-url", mq.URL, "--mqtt-username", serverAccount.Username, "--mqtt-password", serverAccount.Password}
	c.serverArgs = append([]string{"--store", dsn, "--replica-id", "r1"}, flags...)
	c.startServer()
	c.setupFleet()
	return c
}
