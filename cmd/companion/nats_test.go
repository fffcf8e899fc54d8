package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/natstest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// natsServerUser is the server's account on a NATS cluster: as a static
// NATS user, everything under the prefix; with the auth callout
// (natsCallout), the --mqtt-username/--mqtt-password the server's
// responder grants that. (NATS's MQTT needs nothing else of it: the
// "$MQTT.sub.>" subjects QoS 1 deliveries use are granted implicitly.)
var natsServerUser = natstest.User{
	Username: "companion-server", Password: "server-secret",
	Publish:   []string{topics.DefaultPrefix + "/#"},
	Subscribe: []string{topics.DefaultPrefix + "/#"},
}

// natsCallout returns cfg for a server on cl, a cluster started with
// natstest.Options.Callout, answering its authorization: all three nodes
// in --mqtt-url, natsServerUser's credentials as its own MQTT account,
// --nats-callout with the cluster's auth user, system user and issuer
// seed (written to a file, as --nats-issuer-seed takes it). --mqtt-dynsec
// keeps the flag's default, which --nats-callout turns off.
func natsCallout(tb testing.TB, cl *natstest.Cluster, cfg Config) Config {
	tb.Helper()
	co := cl.Callout
	require.NotNil(tb, co, "the cluster was started without natstest.Options.Callout")
	seed := filepath.Join(tb.TempDir(), "issuer.nk")
	require.NoError(tb, os.WriteFile(seed, co.IssuerSeed, 0o600))
	cfg.MQTTURL = cl.MQTTURL()
	cfg.MQTTUsername, cfg.MQTTPassword = natsServerUser.Username, natsServerUser.Password
	cfg.MQTTDynsec = true
	cfg.NATS = NATSConfig{
		URL:  co.URL,
		User: co.User, Password: co.Password,
		SystemUser: co.SystemUser, SystemPassword: co.SystemPassword,
		IssuerSeedFile: seed,
		Account:        co.Account,
	}
	return cfg
}

// startNATSCallout starts a three-node NATS cluster that sends every
// MQTT login to an auth callout, and the server on it answering them.
func startNATSCallout(t *testing.T) (*natstest.Cluster, *Main) {
	t.Helper()
	cl := natstest.StartCluster(t, natstest.Options{
		Callout: true,
		// A QoS 1 message whose PUBACK died with a node comes again after
		// this (NATS's default is 30s).
		AckWait: 5 * time.Second,
	})
	m := startServer(t, natsCallout(t, cl, Config{Limits: api.Limits{RequestsPerSecond: -1}}))
	require.Nil(t, m.MQTT, "nothing embedded runs with --mqtt-url")
	require.Nil(t, m.Dynsec, "--nats-callout turns --mqtt-dynsec off")
	require.NotNil(t, m.NATSAuth)
	testenv.Eventually(t, 30*time.Second, "the server logged in to the NATS cluster through its own callout", m.Broker.Ready)
	return cl, m
}

// startOnNATS starts a three-node NATS cluster whose MQTT logins the
// server answers (the auth callout), the server on it, the fleet, and the
// bridge on all three nodes: the bridge's rights come from the store at
// its login, as CONTRACT §3 and §9 have them.
func startOnNATS(t *testing.T, devices ...string) (*natstest.Cluster, *Main, *fleet, *bridge) {
	t.Helper()
	cl, m := startNATSCallout(t)
	f := setupFleet(t, m, devices...)
	b := startBridge(t, m, cl.MQTTURL(), f, "", devices...)
	return cl, m, f, b
}

func TestEveryOperationOnNATSCluster(t *testing.T) {
	t.Parallel()
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
	t.Parallel()
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
	testenv.Eventually(t, 10*time.Second, "the bridge connected to a node", func() bool {
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

// On NATS too a publish the server's permissions refuse is acknowledged
// and dropped (a "Publish Violation" in the node's log only): a server
// whose static NATS user may publish under companion/v1 while it runs with
// --topic-prefix acme/v1 is not ready and says what to grant, and turns
// ready once its permissions are mended (bug 459).
func TestServerThatCannotPublishUnderItsPrefixOnNATS(t *testing.T) {
	t.Parallel()
	user := natstest.User{
		Username: natsServerUser.Username, Password: natsServerUser.Password,
		Publish:   []string{"companion/v1/#"},
		Subscribe: []string{"acme/v1/#"},
	}
	cl := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{user}})
	refused := newLogSignal("MQTT self-check failed")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), refused), &slog.HandlerOptions{Level: slog.LevelWarn}))
	m := startServerLogging(t, Config{
		MQTTURL: cl.MQTTURL(), MQTTUsername: user.Username, MQTTPassword: user.Password,
		TopicPrefix: "acme/v1",
	}, logger)
	select {
	case <-refused.seen:
	case <-time.After(60 * time.Second):
		t.Fatal("the server never said it cannot publish under its prefix")
	}
	require.False(t, m.Broker.Ready(), "ready though nothing it publishes reaches anyone")
	r := newClient(t, m, "").do("GET", "/readyz", nil)
	require.Equal(t, 503, r.Status, "%s", r.Body)
	require.Contains(t, string(r.Body), "acme/v1/#")

	user.Publish = []string{"acme/v1/#"}
	cl.SetUsers(t, []natstest.User{user})
	testenv.Eventually(t, 60*time.Second, "ready once NATS lets it publish", m.Broker.Ready)
}

// A subscription the broker refuses for good (the server's NATS user
// may not subscribe under its prefix) is asked for again every second;
// the server logs it once, then once a minute, not at each attempt: the
// warning came every second for as long as the refusal lasted (bug 460).
func TestARefusedSubscriptionIsNotLoggedAtEveryAttempt(t *testing.T) {
	t.Parallel()
	user := natstest.User{
		Username: natsServerUser.Username, Password: natsServerUser.Password,
		Publish:   []string{"acme/v1/#"},
		Subscribe: []string{"companion/v1/#"},
	}
	cl := natstest.StartCluster(t, natstest.Options{Users: []natstest.User{user}})
	var lines logCount
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), &lines), &slog.HandlerOptions{Level: slog.LevelWarn}))
	startServerLogging(t, Config{
		MQTTURL: cl.MQTTURLs[0], MQTTUsername: user.Username, MQTTPassword: user.Password,
		TopicPrefix: "acme/v1",
	}, logger)
	const violation = `Subscription Violation - Subject "acme.v1.devices.*.replies"`
	testenv.Eventually(t, 60*time.Second, "the server asked five times", func() bool {
		return strings.Count(cl.Log(0), violation) >= 5
	})
	require.Less(t, lines.count("MQTT subscriptions refused"), 3, "a warning at each attempt")
}

// logCount counts the log lines holding a text.
type logCount struct {
	mu    sync.Mutex
	lines []string
}

func (l *logCount) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, string(p))
	return len(p), nil
}

func (l *logCount) count(text string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, s := range l.lines {
		if strings.Contains(s, text) {
			n++
		}
	}
	return n
}
