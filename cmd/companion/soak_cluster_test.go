//go:build soak

package main

// The cluster soak (make soak-cluster; not part of make test): the soak's
// mixed load (soak_test.go) against CONTRACT §11's cluster as processes,
// PostgreSQL, three NATS nodes, three `companion serve` replicas on that
// one store and a bridge with simulated devices, the load spread over the
// replicas, while a replica or a NATS node is SIGKILLed and restarted, or
// PostgreSQL is (SIGKILL, then a start through its crash recovery), at
// random. One fault at a time, and the cluster healthy again before the
// next: three NATS nodes keep their data through the loss of one, not of
// two. At the end it prints the soak's summary and fails when any accepted
// command was lost or any was executed twice.
//
//	SOAK_MINUTES=10 go test -tags soak -run '^TestSoakCluster$' -count=1 -timeout 0 -v ./cmd/companion

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSoakCluster(t *testing.T) {
	duration := soakDuration(t)
	rig := startClusterRig(t, clusterRigOptions{replicas: 3, devices: soakDevices, bridgeArgs: soakBridgeArgs})
	c := rig.c
	admin := &client{tb: t, base: c.base(), token: c.adminToken}
	r := admin.do("PUT", "/api/v1/admin/apps/weather/1.0.0", bytes.Repeat([]byte("app"), 2000))
	require.Equal(t, 201, r.Status, "%s", r.Body)

	start := time.Now()
	t.Logf("soak-cluster: %s of load on %d devices, replicas %v, NATS %s, PostgreSQL 127.0.0.1:%d",
		duration, soakDevices, rig.bases(), rig.nats.MQTTURL(), rig.pg.Port)
	load := startSoakLoad(t, c, start, rig.bases())

	rng := rand.New(rand.NewPCG(2, uint64(start.UnixNano())))
	kills := soakChaos(start, duration, []soakFault{
		{"replica", func(down time.Duration) {
			rc := rig.replicas[rng.IntN(len(rig.replicas))]
			rc.server.kill()
			time.Sleep(down)
			rc.launchServer()
			rc.waitServer("/readyz")
		}},
		{"nats", func(down time.Duration) {
			i := rng.IntN(len(rig.nats.MQTTURLs))
			rig.nats.Kill(t, i)
			time.Sleep(down)
			rig.nats.Restart(t, i)
			// Every stream's replicas current again before the next fault.
			rig.nats.WaitHealthy(t)
		}},
		{"postgres", func(down time.Duration) {
			rig.pg.Kill(t)
			time.Sleep(down)
			rig.pg.Restart(t)
		}},
	})
	load.finish()
	soakSettleAndReport(t, c, load, "soak-cluster",
		fmt.Sprintf("replica %d, nats node %d, postgres %d", kills["replica"], kills["nats"], kills["postgres"]))
}
