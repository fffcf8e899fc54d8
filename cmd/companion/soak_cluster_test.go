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
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/natstest"
)

func TestSoakCluster(t *testing.T) {
	duration := soakDuration(t)
	rig := startClusterRig(t, clusterRigOptions{replicas: 3, devices: soakDevices,
		bridgeArgs: soakBridgeArgs, serverArgs: []string{"--log-level", "debug"}})
	c := rig.c
	admin := &client{tb: t, base: c.base(), token: c.adminToken}
	r := admin.do("PUT", "/api/v1/admin/apps/weather/1.0.0", bytes.Repeat([]byte("app"), 2000))
	require.Equal(t, 201, r.Status, "%s", r.Body)

	start := time.Now()
	t.Logf("soak-cluster: %s of load on %d devices, replicas %v, NATS %s, PostgreSQL 127.0.0.1:%d",
		duration, soakDevices, rig.bases(), rig.nats.MQTTURL(), rig.pg.Port)
	load := startSoakLoad(t, c, start, rig.bases())
	if dir := os.Getenv(procLogDirEnv); dir != "" {
		stop := sampleConsumers(t, rig.nats, filepath.Join(dir, "consumers.log"))
		defer stop()
	}

	rng := rand.New(rand.NewPCG(2, uint64(start.UnixNano())))
	kills := soakChaos(t, start, duration, []soakFault{
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

// sampleConsumers writes to path, every second until stop, each JetStream
// consumer that has messages unacknowledged or waiting, as its leader's
// /jsz reads it: the MQTT subscriptions' consumers, whose
// max_ack_pending stops a subscription's deliveries while that many wait
// for their PUBACKs.
func sampleConsumers(tb testing.TB, cl *natstest.Cluster, path string) (stop func()) {
	f, err := os.Create(path)
	require.NoError(tb, err)
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer f.Close()
		hc := &http.Client{Timeout: time.Second}
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-quit:
				return
			case <-tick.C:
			}
			for i, u := range cl.MonitorURLs {
				if !cl.Running(i) {
					continue
				}
				writeConsumers(f, hc, i, u)
			}
		}
	})
	return func() { close(quit); wg.Wait() }
}

func writeConsumers(f *os.File, hc *http.Client, node int, monitor string) {
	resp, err := hc.Get(monitor + "/jsz?accounts=true&streams=true&consumers=true&config=true")
	if err != nil {
		fmt.Fprintf(f, "%s node %d: %v\n", time.Now().Format("15:04:05.000"), node, err)
		return
	}
	defer resp.Body.Close()
	var jsz struct {
		Accounts []struct {
			Streams []struct {
				Name      string `json:"name"`
				Consumers []struct {
					Name   string `json:"name"`
					Config struct {
						Filter string `json:"filter_subject"`
					} `json:"config"`
					AckPending  int `json:"num_ack_pending"`
					Pending     int `json:"num_pending"`
					Redelivered int `json:"num_redelivered"`
					Cluster     *struct {
						Leader string `json:"leader"`
					} `json:"cluster"`
				} `json:"consumer_detail"`
			} `json:"stream_detail"`
		} `json:"account_details"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
		fmt.Fprintf(f, "%s node %d: %v\n", time.Now().Format("15:04:05.000"), node, err)
		return
	}
	now := time.Now().Format("15:04:05.000")
	name := fmt.Sprintf("nats-%d", node+1) // natstest's server_name
	for _, a := range jsz.Accounts {
		for _, st := range a.Streams {
			for _, co := range st.Consumers {
				if co.Cluster != nil && co.Cluster.Leader != name {
					continue // its leader's /jsz has it
				}
				if co.AckPending == 0 && co.Pending == 0 {
					continue
				}
				fmt.Fprintf(f, "%s %s %s>%s filter=%s ack_pending=%d pending=%d redelivered=%d\n",
					now, name, st.Name, co.Name, co.Config.Filter, co.AckPending, co.Pending, co.Redelivered)
			}
		}
	}
}
