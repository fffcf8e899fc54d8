package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/natstest"
	"github.com/devicecompanion/companion/topics"
)

// natsServerUser is the server's NATS user: everything under the prefix.
// (NATS's MQTT needs nothing else of it: the "$MQTT.sub.>" subjects QoS 1
// deliveries use are granted to every user by natstest.)
var natsServerUser = natstest.User{
	Username: "companion-server", Password: "server-secret",
	Publish:   []string{topics.DefaultPrefix + "/#"},
	Subscribe: []string{topics.DefaultPrefix + "/#"},
}

// natsBridgeUser is the NATS user of the fleet's bridge, as CONTRACT §3 and
// §9 have a bridge's rights: subscribe to the commands of its devices,
// publish their replies, status and settings, and its own state.
func natsBridgeUser(t *testing.T, f *fleet, devices ...string) natstest.User {
	t.Helper()
	tree := topics.MustNew(topics.DefaultPrefix)
	state, err := tree.BridgeState(f.bridgeID)
	require.NoError(t, err)
	u := natstest.User{Username: f.bridgeID, Password: f.bridgeSecret, Publish: []string{state}}
	for _, d := range devices {
		cmds, err := tree.CommandsFilter(d)
		require.NoError(t, err)
		u.Subscribe = append(u.Subscribe, cmds)
		for _, leaf := range []func(string) (string, error){tree.Replies, tree.Status, tree.Settings} {
			topic, err := leaf(d)
			require.NoError(t, err)
			u.Publish = append(u.Publish, topic)
		}
	}
	return u
}

// startOnNATS starts a three-node NATS cluster with the server's user, the
// server on it (all three nodes in --mqtt-url, the accounts left to the
// cluster's configuration: no --mqtt-dynsec), and the fleet; the bridge's
// secret, which the admin API generates and nobody can choose, is then
// given to the cluster as the bridge's NATS user (a configuration reload
// of every node), and the bridge started on all three nodes.
func startOnNATS(t *testing.T, devices ...string) (*natstest.Cluster, *Main, *fleet, *bridge) {
	t.Helper()
	cl := natstest.StartCluster(t, natstest.Options{
		Users: []natstest.User{natsServerUser},
		// A QoS 1 message whose PUBACK died with a node comes again after
		// this (NATS's default is 30s).
		AckWait: 5 * time.Second,
	})
	m := startServer(t, Config{
		MQTTURL:      cl.MQTTURL(),
		MQTTUsername: natsServerUser.Username,
		MQTTPassword: natsServerUser.Password,
		MQTTDynsec:   false,
		Limits:       api.Limits{RequestsPerSecond: -1},
	})
	require.Nil(t, m.MQTT, "nothing embedded runs with --mqtt-url")
	waitFor(t, "the server connected to the NATS cluster", 30*time.Second, m.Broker.Ready)
	f := setupFleet(t, m, devices...)
	cl.AddUser(t, natsBridgeUser(t, f, devices...))
	b := startBridge(t, m, cl.MQTTURL(), f, "", devices...)
	return cl, m, f, b
}

func TestEveryOperationOnNATSCluster(t *testing.T) {
	_, _, f, b := startOnNATS(t, "dev-1")
	exerciseEveryOperation(t, f, b, "dev-1")
}

// postText sends a text command the way a user's client would, from any
// goroutine (no require): the status and, when accepted, the command's id.
func postText(hc *http.Client, base, token, dev, text string) (int, string, error) {
	body, _ := json.Marshal(map[string]any{"text": text})
	req, err := http.NewRequest("POST", base+"/api/v1/devices/"+dev+"/push/text", bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var cmd struct {
		ID string `json:"id"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&cmd)
	return resp.StatusCode, cmd.ID, nil
}

// A broker node dies under load (CONTRACT §11: "killing any one replica or
// broker node loses nothing"): 100 text commands from 8 concurrent
// clients, and halfway the node the bridge is connected to (the server's
// too, when it is the same) gets SIGKILL. Every accepted command ends
// succeeded, and each text reaches the device exactly once.
func TestNATSNodeKilledUnderLoad(t *testing.T) {
	const (
		total   = 100
		clients = 8
		dev     = "dev-1"
	)
	cl, m, f, b := startOnNATS(t, dev)
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": f.claims[dev]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	waitOnline(t, f, true, dev)

	bridgeClient := "companion-bridge-" + f.bridgeID
	var victim int
	waitFor(t, "the bridge connected to a node", 10*time.Second, func() bool {
		victim = cl.NodeOf(t, bridgeClient)
		return victim >= 0
	})
	serverNode := cl.NodeOf(t, "companion-server") // its client id without --replica-id
	t.Logf("the bridge is on nats-%d, the server on nats-%d; killing nats-%d halfway", victim+1, serverNode+1, victim+1)

	type result struct {
		text, id string
		status   int
		err      error
	}
	jobs := make(chan int)
	results := make(chan result, total)
	var sent atomic.Int32
	halfway := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	hc := httpClientFor(m)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				text := fmt.Sprintf("load %03d", i)
				status, id, err := postText(hc, m.APIURL(), f.user.token, dev, text)
				results <- result{text: text, id: id, status: status, err: err}
				if sent.Add(1) == total/2 {
					once.Do(func() { close(halfway) })
				}
			}
		}()
	}
	go func() {
		defer close(jobs)
		for i := range total {
			jobs <- i
		}
	}()
	<-halfway
	killedAt := time.Now()
	cl.Kill(t, victim)
	wg.Wait()
	close(results)

	accepted := map[string]string{} // id → text
	var refused []string
	for res := range results {
		switch {
		case res.err != nil:
			refused = append(refused, fmt.Sprintf("%s: %v", res.text, res.err))
		case res.status == 202 || res.status == 200:
			accepted[res.id] = res.text
		default:
			refused = append(refused, fmt.Sprintf("%s: HTTP %d", res.text, res.status))
		}
	}
	t.Logf("%d accepted, %d not: %v", len(accepted), len(refused), refused)
	assert.Len(t, accepted, total, "the API accepts commands whatever the broker does (they wait queued)")

	for id, text := range accepted {
		cmd := f.user.waitFinal(dev, id)
		if !assert.Equal(t, "succeeded", cmd["state"], "%s (%s): %v", id, text, cmd) {
			continue
		}
		assert.LessOrEqual(t, b.sims[dev].Executions(id), 1, "%s (%s) executed twice", id, text)
	}
	t.Logf("every accepted command final %v after the kill", time.Since(killedAt).Round(time.Millisecond))

	count := map[string]int{}
	for _, tx := range b.sims[dev].Texts() {
		count[tx.Text]++
	}
	var twice, missing []string
	for _, text := range accepted {
		switch n := count[text]; {
		case n == 0:
			missing = append(missing, text)
		case n > 1:
			twice = append(twice, fmt.Sprintf("%s ×%d", text, n))
		}
	}
	sort.Strings(twice)
	sort.Strings(missing)
	assert.Empty(t, missing, "accepted texts that never reached the device")
	assert.Empty(t, twice, "texts the device showed more than once")
	assert.Len(t, count, len(accepted), "the device showed only accepted texts")

	// The killed node comes back and the cluster heals; commands still run.
	cl.Restart(t, victim)
	cl.WaitHealthy(t)
	cmd := f.user.accept("POST", "/api/v1/devices/"+dev+"/push/text", map[string]any{"text": "after the restart"})
	assert.Equal(t, "succeeded", f.user.waitFinal(dev, cmd["id"].(string))["state"])
}
