package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/metrics"
	"github.com/devicecompanion/companion/internal/metrics/metricstest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

// metricsListen runs listen on a port of its own for the test and returns
// the URL of its metrics.
func metricsListen(tb testing.TB, listen func(addr string) (*metrics.Listener, error)) string {
	tb.Helper()
	l, err := listen("127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { l.Close() })
	return "http://" + l.Addr() + "/metrics"
}

func metricsQuiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestMetricsServer(t *testing.T) {
	var open atomic.Int64
	open.Store(5)
	s := metrics.NewServer(metrics.ServerOptions{
		OpenCommands: func(context.Context) (int, error) { return int(open.Load()), nil },
		Logger:       metricsQuiet(),
	})
	url := metricsListen(t, func(addr string) (*metrics.Listener, error) {
		return metrics.Listen(addr, s.Registry(), metricsQuiet())
	})

	s.MQTTConnected(true)
	for range 3 {
		s.CommandState(topics.OpPushText, "queued", 0)
	}
	s.CommandState(topics.OpPushText, "delivered", 10*time.Millisecond)
	s.CommandState(topics.OpPushText, "succeeded", 20*time.Millisecond)
	s.CommandState(topics.OpPushText, "succeeded", 30*time.Millisecond)
	s.CommandState(topics.OpOTAUpdate, "failed", 90*time.Second)
	s.StoreWrite(broker.StoreWriteCreate, 2*time.Millisecond)
	s.StoreWrite(broker.StoreWriteCreate, 3*time.Millisecond)
	s.ReportCoalesced("status")
	s.ReportCoalesced("status")
	s.Request("POST", "/api/v1/devices/:id/push/text", 202, time.Millisecond)
	s.Request("POST", "/api/v1/devices/:id/push/text", 202, time.Millisecond)
	s.Request("GET", "", 404, time.Millisecond)
	s.Request("BREW", "", 405, time.Millisecond)

	f := metricstest.Scrape(t, url)
	checks := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"companion_commands_total", []string{"op", "push.text", "state", "queued"}, 3},
		{"companion_commands_total", []string{"op", "push.text", "state", "delivered"}, 1},
		{"companion_commands_total", []string{"op", "push.text", "state", "succeeded"}, 2},
		{"companion_commands_total", []string{"op", "ota.update", "state", "failed"}, 1},
		{"companion_commands_total", []string{"op", "app.install", "state", "queued"}, 0},
		{"companion_commands_open", nil, 5}, // what the store counts, not what this server saw
		{"companion_mqtt_connected", nil, 1},
		{"companion_device_reports_coalesced_total", []string{"kind", "status"}, 2},
		{"companion_device_reports_coalesced_total", []string{"kind", "settings"}, 0}, // there from the start
		{"companion_http_requests_total", []string{"method", "POST", "route", "/api/v1/devices/:id/push/text", "code", "202"}, 2},
		{"companion_http_requests_total", []string{"method", "GET", "route", "unmatched", "code", "404"}, 1},
		{"companion_http_requests_total", []string{"method", "other", "route", "unmatched", "code", "405"}, 1},
	}
	for _, c := range checks {
		if got := f.Value(c.name, c.labels...); got != c.want {
			t.Errorf("%s%q = %v; want %v\n%s", c.name, c.labels, got, c.want, f.Dump(c.name))
		}
	}
	if !f.Has("companion_commands_total", "op", "app.install", "state", "queued") {
		t.Error("the series of an op that saw no command yet are absent; want them at 0")
	}
	if got := f.Count("companion_command_duration_seconds", "op", "push.text", "state", "succeeded"); got != 2 {
		t.Errorf("push.text succeeded latency count = %d; want 2", got)
	}
	if got := f.Sum("companion_command_duration_seconds", "op", "push.text", "state", "succeeded"); got < 0.049 || got > 0.051 {
		t.Errorf("push.text succeeded latency sum = %v; want 0.05", got)
	}
	if got := f.Count("companion_command_duration_seconds", "op", "ota.update", "state", "failed"); got != 1 {
		t.Errorf("ota.update failed latency count = %d; want 1", got)
	}
	if got := f.Count("companion_store_write_duration_seconds", "write", "create_command"); got != 2 {
		t.Errorf("store create_command count = %d; want 2", got)
	}
	if got := f.Count("companion_http_request_duration_seconds", "method", "POST", "route", "/api/v1/devices/:id/push/text"); got != 2 {
		t.Errorf("HTTP duration count = %d; want 2", got)
	}
	// The connection gauge follows the connection down as well as up; the
	// open commands are what the store counts now.
	s.MQTTConnected(false)
	open.Store(2)
	f = metricstest.Scrape(t, url)
	if got := f.Value("companion_mqtt_connected"); got != 0 {
		t.Errorf("companion_mqtt_connected = %v after the connection was lost; want 0", got)
	}
	if got := f.Value("companion_commands_open"); got != 2 {
		t.Errorf("companion_commands_open = %v after the store's count fell to 2; want 2", got)
	}
	for _, name := range []string{"go_goroutines", "process_cpu_seconds_total", "promhttp_metric_handler_requests_total"} {
		if f[name] == nil {
			t.Errorf("%s absent: want the Go, process and handler collectors", name)
		}
	}
}

func TestMetricsBridge(t *testing.T) {
	connected := 2
	b := metrics.NewBridge(metrics.BridgeOptions{Devices: 3, ConnectedDevices: func() int { return connected }})
	url := metricsListen(t, func(addr string) (*metrics.Listener, error) {
		return metrics.Listen(addr, b.Registry(), metricsQuiet())
	})
	b.MQTTConnected(true)
	b.CommandDone(topics.OpPushImage, "succeeded", true, time.Second)
	b.CommandDone(topics.OpPushImage, "failed", true, time.Second)
	b.CommandDone(topics.OpPushText, "expired", false, 0)
	b.CommandDone("no.such.op", "failed", false, 0)
	b.Transfer("image", 1000, 500*time.Millisecond, false)
	b.Transfer("image", 500, 250*time.Millisecond, true)
	b.Transfer("group 99", 10, time.Millisecond, false)
	b.LinkLost()
	b.LinkLost()

	f := metricstest.Scrape(t, url)
	checks := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"companion_bridge_commands_total", []string{"op", "push.image", "result", "succeeded"}, 1},
		{"companion_bridge_commands_total", []string{"op", "push.image", "result", "failed"}, 1},
		{"companion_bridge_commands_total", []string{"op", "push.text", "result", "expired"}, 1},
		{"companion_bridge_commands_total", []string{"op", "other", "result", "failed"}, 1},
		{"companion_bridge_mqtt_connected", nil, 1},
		{"companion_bridge_gatt_transfer_bytes_total", []string{"kind", "image"}, 1500},
		{"companion_bridge_gatt_transfer_bytes_total", []string{"kind", "other"}, 10},
		{"companion_bridge_gatt_transfers_total", []string{"kind", "image", "result", "ok"}, 1},
		{"companion_bridge_gatt_transfers_total", []string{"kind", "image", "result", "failed"}, 1},
		{"companion_bridge_gatt_link_drops_total", nil, 2},
		{"companion_bridge_devices_connected", nil, 2},
		{"companion_bridge_devices", nil, 3},
	}
	for _, c := range checks {
		if got := f.Value(c.name, c.labels...); got != c.want {
			t.Errorf("%s%q = %v; want %v\n%s", c.name, c.labels, got, c.want, f.Dump(c.name))
		}
	}
	if got := f.Count("companion_bridge_command_duration_seconds", "op", "push.image"); got != 2 {
		t.Errorf("push.image duration count = %d; want 2", got)
	}
	if got := f.Count("companion_bridge_command_duration_seconds", "op", "push.text"); got != 0 {
		t.Errorf("push.text duration count = %d; want 0 (it expired: it never ran)", got)
	}
	if got := f.Sum("companion_bridge_gatt_transfer_duration_seconds", "kind", "image"); got != 0.75 {
		t.Errorf("image transfer duration sum = %v; want 0.75", got)
	}
}

// TestMetricsHotPathAllocs checks that an observer call on a hot path
// allocates nothing once its series exist.
func TestMetricsHotPathAllocs(t *testing.T) {
	s := metrics.NewServer(metrics.ServerOptions{})
	b := metrics.NewBridge(metrics.BridgeOptions{})
	s.Request("POST", "/api/v1/devices/:id/push/text", 202, time.Millisecond) // creates its series
	calls := map[string]func(){
		"CommandState": func() {
			s.CommandState(topics.OpPushText, "queued", 0)
			s.CommandState(topics.OpPushText, "succeeded", time.Millisecond)
		},
		"StoreWrite":    func() { s.StoreWrite(broker.StoreWriteReply, time.Millisecond) },
		"Request":       func() { s.Request("POST", "/api/v1/devices/:id/push/text", 202, time.Millisecond) },
		"MQTTConnected": func() { s.MQTTConnected(true) },
		"CommandDone":   func() { b.CommandDone(topics.OpPushText, "succeeded", true, time.Millisecond) },
		"Transfer":      func() { b.Transfer("firmware", 4096, time.Second, false) },
		"LinkLost":      b.LinkLost,
	}
	for name, f := range calls {
		if n := testing.AllocsPerRun(100, f); n != 0 {
			t.Errorf("%s allocates %v times a call; want 0", name, n)
		}
	}
}

func TestMetricsListenNotFound(t *testing.T) {
	s := metrics.NewServer(metrics.ServerOptions{})
	l, err := metrics.Listen("127.0.0.1:0", s.Registry(), metricsQuiet())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for path, want := range map[string]int{"/metrics": 200, "/": 404, "/debug/pprof/": 404} {
		resp, err := http.Get("http://" + l.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s = %d; want %d", path, resp.StatusCode, want)
		}
	}
	// Another method on /metrics is a 405 that says which it takes, as
	// docs/operations.md says (docs/reliability.md, bug 360).
	resp, err := http.Post("http://"+l.Addr()+"/metrics", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "GET, HEAD" {
		t.Errorf("POST /metrics = %d, Allow %q; want 405, Allow \"GET, HEAD\"", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

// TestMetricsOpenCommandsCount checks how the open commands gauge uses its
// count: a count is served again for ten times as long as it took, scrapes
// at once share one count, and a failed count leaves the gauge out.
func TestMetricsOpenCommandsCount(t *testing.T) {
	var (
		mu    sync.Mutex
		calls int
		fail  error
	)
	const took = 50 * time.Millisecond
	s := metrics.NewServer(metrics.ServerOptions{
		OpenCommands: func(context.Context) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			calls++
			time.Sleep(took) // a count over many open commands
			return 7, fail
		},
		Logger: metricsQuiet(),
	})
	url := metricsListen(t, func(addr string) (*metrics.Listener, error) {
		return metrics.Listen(addr, s.Registry(), metricsQuiet())
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if got := metricstest.Scrape(t, url).Value("companion_commands_open"); got != 7 {
				t.Errorf("companion_commands_open = %v; want 7", got)
			}
		})
	}
	wg.Wait()
	mu.Lock()
	if calls != 1 {
		t.Errorf("4 scrapes at once within %v counted %d times; want once", 10*took, calls)
	}
	fail = errors.New("store down")
	mu.Unlock()

	testenv.Eventually(t, 10*time.Second, "companion_commands_open left out once its count fails", func() bool {
		return !metricstest.Scrape(t, url).Has("companion_commands_open")
	})
}

// A scraper that stops reading its scrape does not hold the handler for
// ever: its answer is cut off once its write deadline passes
// (docs/reliability.md, bug 362).
func TestStalledScraperIsCutOff(t *testing.T) {
	metrics.ShortWrites(t, 200*time.Millisecond)
	reg := prometheus.NewRegistry()
	// Enough series that the scrape is more than the sockets' buffers take.
	big := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "test_big", Help: "Series to make the scrape large."}, []string{"name"})
	reg.MustRegister(big)
	for i := range 50000 {
		big.WithLabelValues(fmt.Sprintf("a-long-label-value-to-make-the-scrape-large-%06d", i)).Set(float64(i))
	}
	l, err := metrics.Listen("127.0.0.1:0", reg, metricsQuiet())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !testenv.StalledClientIsCut(t, l.Addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 2*time.Second) {
		t.Fatal("the answer to a scraper that stopped reading was not cut: its handler waited for it to read")
	}
}

// The bridge's spool gauge is 1 while its spool cannot be written, and
// 0 from the start and once it can again (docs/reliability.md, bug 422).
func TestMetricsBridgeSpool(t *testing.T) {
	b := metrics.NewBridge(metrics.BridgeOptions{Devices: 1})
	url := metricsListen(t, func(addr string) (*metrics.Listener, error) {
		return metrics.Listen(addr, b.Registry(), metricsQuiet())
	})
	for _, step := range []struct {
		call bool // whether to call SpoolWritable
		ok   bool
		want float64
	}{{false, false, 0}, {true, false, 1}, {true, true, 0}} {
		if step.call {
			b.SpoolWritable(step.ok)
		}
		f := metricstest.Scrape(t, url)
		if !f.Has("companion_bridge_spool_unwritable") {
			t.Fatalf("companion_bridge_spool_unwritable absent:\n%s", f.Dump("companion_bridge_spool_unwritable"))
		}
		if got := f.Value("companion_bridge_spool_unwritable"); got != step.want {
			t.Errorf("after SpoolWritable(%v) (called: %v): companion_bridge_spool_unwritable = %v; want %v", step.ok, step.call, got, step.want)
		}
	}
}
