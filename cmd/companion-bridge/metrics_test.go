package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"

	"github.com/devicecompanion/companion/internal/metrics/metricstest"
	"github.com/devicecompanion/companion/topics"
)

// metricsRig is a bridge program run as main does, with --metrics, against
// a real MQTT broker and a real HTTP server of blobs; the test plays the
// server with a real MQTT client.
type metricsRig struct {
	tb      testing.TB
	m       *Main
	watcher mqtt.Client
	replies chan topics.Reply
	blobs   *httptest.Server
	tree    topics.Tree
}

// metricsStart runs the bridge for dev-1 with args added to its flags and
// waits until it says it is online.
func metricsStart(tb testing.TB, blob []byte, args ...string) *metricsRig {
	tb.Helper()
	url := startBroker(tb)
	r := &metricsRig{tb: tb, tree: topics.MustNew(topics.DefaultPrefix), replies: make(chan topics.Reply, 100)}
	r.blobs = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		http.ServeContent(w, req, "blob", time.Time{}, bytes.NewReader(blob))
	}))
	tb.Cleanup(r.blobs.Close)

	online := make(chan struct{}, 1)
	stateTopic, _ := r.tree.BridgeState("b1")
	repliesTopic, _ := r.tree.Replies("dev-1")
	r.watcher = mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("metrics-watcher").
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
			switch m.Topic() {
			case stateTopic:
				if string(m.Payload()) == topics.BridgeOnline {
					select {
					case online <- struct{}{}:
					default:
					}
				}
			case repliesTopic:
				if rep, err := topics.ParseReply(m.Payload()); err == nil && companion.IsFinal(rep.State) {
					r.replies <- rep
				}
			}
		}))
	if err := mqtt.WaitTokenTimeout(r.watcher.Connect(), 10*time.Second); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { r.watcher.Disconnect(100) })
	if err := mqtt.WaitTokenTimeout(r.watcher.Subscribe(r.tree.Prefix()+"/#", 1, nil), 10*time.Second); err != nil {
		tb.Fatal(err)
	}

	r.m = NewMain()
	r.m.Stderr = io.Discard
	flags := append([]string{"--mqtt-url", url, "--api-url", r.blobs.URL, "--bridge-id", "b1", "--bridge-secret", "s",
		"--data", tb.TempDir(), "--sim-devices", "dev-1", "--metrics", "127.0.0.1:0"}, args...)
	if err := r.m.ParseFlags(flags); err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := r.m.Run(ctx); err != nil {
			tb.Errorf("Run: %v", err)
		}
	})
	tb.Cleanup(func() {
		cancel()
		wg.Wait()
		r.m.Close()
	})
	select {
	case <-online:
	case <-time.After(15 * time.Second):
		tb.Fatal("the bridge did not come online")
	}
	return r
}

// metricsSend publishes a command for dev-1 and returns its id.
func (r *metricsRig) metricsSend(op string, payload any) string {
	r.tb.Helper()
	p, err := json.Marshal(payload)
	if err != nil {
		r.tb.Fatal(err)
	}
	cmd := topics.Command{ID: uuid.Must(uuid.NewV7()).String(), Op: op, DeviceID: "dev-1",
		CreatedAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour), Payload: p}
	b, err := json.Marshal(cmd)
	if err != nil {
		r.tb.Fatal(err)
	}
	topic, _ := r.tree.Command("dev-1", op)
	if err := mqtt.WaitTokenTimeout(r.watcher.Publish(topic, 1, false, b), 10*time.Second); err != nil {
		r.tb.Fatal(err)
	}
	return cmd.ID
}

// metricsFinal waits for the final replies of ids and returns their states.
func (r *metricsRig) metricsFinal(ids ...string) map[string]string {
	r.tb.Helper()
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	got := map[string]string{}
	timeout := time.After(60 * time.Second)
	for len(got) < len(want) {
		select {
		case rep := <-r.replies:
			if want[rep.CommandID] {
				got[rep.CommandID] = rep.State
			}
		case <-timeout:
			r.tb.Fatalf("final replies: got %v of %d", got, len(want))
		}
	}
	return got
}

func (r *metricsRig) metricsScrape() metricstest.Families {
	r.tb.Helper()
	addr := r.m.MetricsAddr()
	if addr == "" {
		r.tb.Fatal("the bridge serves no metrics")
	}
	return metricstest.Scrape(r.tb, "http://"+addr+"/metrics")
}

func metricsBlobRef(blob []byte) topics.Blob {
	sum := sha256.Sum256(blob)
	return topics.Blob{SHA256: hex.EncodeToString(sum[:]), Size: int64(len(blob)), URL: "/api/v1/blobs/" + hex.EncodeToString(sum[:])}
}

func metricsExpect(tb testing.TB, f metricstest.Families, want float64, name string, labels ...string) {
	tb.Helper()
	if got := f.Value(name, labels...); got != want {
		tb.Errorf("%s%q = %v; want %v\n%s", name, labels, got, want, f.Dump(name))
	}
}

// TestMetricsBridge runs commands through the bridge program, over the
// simulated Bluetooth link to a simulated device, and reads the figures
// from its GET /metrics.
func TestMetricsBridge(t *testing.T) {
	blob := bytes.Repeat([]byte("0123456789abcdef"), 1024) // 16 KiB
	r := metricsStart(t, blob)

	ids := []string{
		r.metricsSend(topics.OpPushText, topics.PushText{Text: "one"}),
		r.metricsSend(topics.OpPushText, topics.PushText{Text: "two"}),
		r.metricsSend(topics.OpPushImage, topics.PushImage{ContentType: "image/png", Width: 1, Height: 1, Blob: metricsBlobRef(blob)}),
		r.metricsSend(topics.OpAppUninstall, topics.AppUninstall{AppID: "not-installed"}),
	}
	states := r.metricsFinal(ids...)
	wantStates := []string{"succeeded", "succeeded", "succeeded", "failed"}
	for i, id := range ids {
		if states[id] != wantStates[i] {
			t.Fatalf("command %d ended %q; want %q", i, states[id], wantStates[i])
		}
	}

	f := r.metricsScrape()
	metricsExpect(t, f, 2, "companion_bridge_commands_total", "op", "push.text", "result", "succeeded")
	metricsExpect(t, f, 1, "companion_bridge_commands_total", "op", "push.image", "result", "succeeded")
	metricsExpect(t, f, 1, "companion_bridge_commands_total", "op", "app.uninstall", "result", "failed")
	metricsExpect(t, f, 0, "companion_bridge_commands_total", "op", "push.text", "result", "failed")
	if got := f.Count("companion_bridge_command_duration_seconds", "op", "push.text"); got != 2 {
		t.Errorf("push.text run durations = %d; want 2", got)
	}
	metricsExpect(t, f, 1, "companion_bridge_mqtt_connected")
	metricsExpect(t, f, 1, "companion_bridge_devices_connected")
	metricsExpect(t, f, 1, "companion_bridge_devices")
	metricsExpect(t, f, 1, "companion_bridge_gatt_transfers_total", "kind", "image", "result", "ok")
	if got := f.Value("companion_bridge_gatt_transfer_bytes_total", "kind", "image"); got != float64(len(blob)) {
		t.Errorf("image bytes sent = %v; want %d (no link dropped)", got, len(blob))
	}
	if got := f.Count("companion_bridge_gatt_transfer_duration_seconds", "kind", "image"); got != 1 {
		t.Errorf("image transfer durations = %d; want 1", got)
	}
	if sum := f.Sum("companion_bridge_gatt_transfer_duration_seconds", "kind", "image"); sum <= 0 {
		t.Errorf("image transfer time = %v; want > 0, to derive a rate", sum)
	}
	metricsExpect(t, f, 0, "companion_bridge_gatt_link_drops_total")
}

// TestMetricsBridgeLinkDrops pushes an image over a simulated link that
// drops every half second: the transfer resumes across the drops, and each
// is counted.
func TestMetricsBridgeLinkDrops(t *testing.T) {
	blob := bytes.Repeat([]byte("drop"), 64<<10) // 256 KiB: about 1.5 s at the simulated link's 1400 kbit/s
	r := metricsStart(t, blob, "--sim-drop-every", "500ms")
	id := r.metricsSend(topics.OpPushImage, topics.PushImage{ContentType: "image/png", Width: 1, Height: 1, Blob: metricsBlobRef(blob)})
	if st := r.metricsFinal(id)[id]; st != "succeeded" {
		t.Fatalf("the push ended %q; want succeeded", st)
	}
	f := r.metricsScrape()
	if got := f.Value("companion_bridge_gatt_link_drops_total"); got < 1 {
		t.Errorf("link drops = %v; want at least 1", got)
	}
	metricsExpect(t, f, 1, "companion_bridge_gatt_transfers_total", "kind", "image", "result", "ok")
	if got := f.Value("companion_bridge_gatt_transfer_bytes_total", "kind", "image"); got < float64(len(blob)) {
		t.Errorf("image bytes sent = %v; want at least %d", got, len(blob))
	}
}

// TestMetricsBridgeOff checks that without --metrics nothing listens.
func TestMetricsBridgeOff(t *testing.T) {
	m := NewMain()
	m.Stderr = io.Discard
	if err := m.ParseFlags([]string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1"}); err != nil {
		t.Fatal(err)
	}
	if m.Config.Metrics != "" || m.MetricsAddr() != "" {
		t.Errorf("metrics on (%q) without --metrics", m.Config.Metrics)
	}
}
