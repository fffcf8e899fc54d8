package main

import (
	"io"
	"net/http"

	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/metrics/metricstest"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

// metricsScrape scrapes the server's GET /metrics over HTTP.
func metricsScrape(tb testing.TB, m *Main) metricstest.Families {
	tb.Helper()
	require.NotEmpty(tb, m.MetricsAddr(), "--metrics is off")
	return metricstest.Scrape(tb, "http://"+m.MetricsAddr()+"/metrics")
}

// metricsExpect checks one counter or gauge series of a scrape.
func metricsExpect(tb testing.TB, f metricstest.Families, want float64, name string, labels ...string) {
	tb.Helper()
	if got := f.Value(name, labels...); got != want {
		tb.Errorf("%s%q = %v; want %v\n%s", name, labels, got, want, f.Dump(name))
	}
}

// TestMetricsServer runs the real server with --metrics on a port of its
// own, sends commands through the HTTP API to a real bridge over MQTT,
// waits for them to end, and reads the figures from GET /metrics as
// Prometheus would; then restarts the server on the same data to check
// that the open commands are counted from the store.
func TestMetricsServer(t *testing.T) {
	data := t.TempDir()
	m := startServer(t, Config{Data: data, Metrics: "127.0.0.1:0"})
	f := setupFleet(t, m, "dev-1", "dev-2")
	for _, dev := range []string{"dev-1", "dev-2"} {
		r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": f.claims[dev]})
		require.Equal(t, 201, r.Status, "%s", r.Body)
	}
	// A bridge serves dev-1 only: dev-2's commands wait for it.
	b := startBridge(t, m, m.MQTTURL(), f, "", "dev-1")

	const texts = 3
	for i := range texts {
		cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello", "title": string(rune('a' + i))})
		require.Equal(t, "succeeded", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	}
	cmd := f.user.accept("DELETE", "/api/v1/devices/dev-1/apps/not-installed", nil)
	require.Equal(t, "failed", f.user.waitFinal("dev-1", cmd["id"].(string))["state"])
	cmd = f.user.accept("POST", "/api/v1/devices/dev-2/apps/install", map[string]any{"app_id": "weather"})
	waiting := cmd["id"].(string)
	require.Equal(t, 404, f.user.do("GET", "/api/v1/no/such/route", nil).Status)

	s := metricsScrape(t, m)
	metricsExpect(t, s, texts, "companion_commands_total", "op", "push.text", "state", "queued")
	metricsExpect(t, s, texts, "companion_commands_total", "op", "push.text", "state", "succeeded")
	metricsExpect(t, s, 0, "companion_commands_total", "op", "push.text", "state", "failed")
	metricsExpect(t, s, 1, "companion_commands_total", "op", "app.uninstall", "state", "queued")
	metricsExpect(t, s, 1, "companion_commands_total", "op", "app.uninstall", "state", "failed")
	metricsExpect(t, s, 1, "companion_commands_total", "op", "app.install", "state", "queued")
	metricsExpect(t, s, 1, "companion_commands_open")
	metricsExpect(t, s, 1, "companion_mqtt_connected")
	metricsExpect(t, s, 0, "companion_bridges_away")
	if got := s.Count("companion_command_duration_seconds", "op", "push.text", "state", "succeeded"); got != texts {
		t.Errorf("push.text accept-to-succeeded count = %d; want %d", got, texts)
	}
	if got := s.Count("companion_command_duration_seconds", "op", "app.uninstall", "state", "failed"); got != 1 {
		t.Errorf("app.uninstall accept-to-failed count = %d; want 1", got)
	}
	if got := s.Count("companion_store_write_duration_seconds", "write", "create_command"); got != texts+2 {
		t.Errorf("store create_command writes = %d; want %d", got, texts+2)
	}
	if got := s.Count("companion_store_write_duration_seconds", "write", "reply"); got < texts+1 {
		t.Errorf("store reply writes = %d; want at least %d (one final reply each)", got, texts+1)
	}
	// Routes as registered, never the URL: one series for every device.
	metricsExpect(t, s, texts, "companion_http_requests_total", "method", "POST", "route", "/api/v1/devices/:id/push/text", "code", "202")
	metricsExpect(t, s, 2, "companion_http_requests_total", "method", "POST", "route", "/api/v1/devices/register", "code", "201")
	metricsExpect(t, s, 1, "companion_http_requests_total", "method", "GET", "route", "unmatched", "code", "404")
	if s.Has("companion_http_requests_total", "route", "/api/v1/devices/dev-1/push/text") {
		t.Error("a series labelled with a raw URL")
	}
	if got := s.Count("companion_http_request_duration_seconds", "method", "POST", "route", "/api/v1/devices/:id/push/text"); got != texts {
		t.Errorf("push/text request durations = %d; want %d", got, texts)
	}

	// The bridge stopped is away. A new server on the same data counts
	// the command still open.
	b.stop()
	testenv.Eventually(t, 10*time.Second, "companion_bridges_away 1", func() bool {
		return metricsScrape(t, m).Value("companion_bridges_away") == 1
	})
	require.NoError(t, m.Close())
	m = startServer(t, Config{Data: data, Metrics: "127.0.0.1:0"})
	s = metricsScrape(t, m)
	metricsExpect(t, s, 1, "companion_commands_open")
	user := newClient(t, m, f.user.token)
	r := user.do("DELETE", "/api/v1/devices/dev-2/commands/"+waiting, nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	s = metricsScrape(t, m)
	metricsExpect(t, s, 0, "companion_commands_open")
	metricsExpect(t, s, 1, "companion_commands_total", "op", "app.install", "state", "canceled")
	metricsExpect(t, s, 0, "companion_commands_total", "op", "app.install", "state", "queued") // counted by the first server
	if got := s.Count("companion_command_duration_seconds", "op", "app.install", "state", "canceled"); got != 1 {
		t.Errorf("app.install accept-to-canceled count = %d; want 1", got)
	}
	if got := s.Count("companion_store_write_duration_seconds", "write", "cancel"); got != 1 {
		t.Errorf("store cancel writes = %d; want 1", got)
	}
}

// TestMetricsServerOff checks that without --metrics nothing listens.
func TestMetricsServerOff(t *testing.T) {
	m := startServer(t, Config{})
	if a := m.MetricsAddr(); a != "" {
		t.Errorf("MetricsAddr() = %q without --metrics; want none", a)
	}
	if m.Metrics != nil {
		t.Error("metrics kept without --metrics")
	}
}

// TestMetricsDemoDefault checks --demo's default address and that
// --metrics (or COMPANION_METRICS) overrides it.
func TestMetricsDemoDefault(t *testing.T) {
	tests := []struct {
		args []string
		env  string
		want string
	}{
		{[]string{"--demo"}, "", demoMetricsAddr},
		{[]string{"--demo", "--metrics", "127.0.0.1:9999"}, "", "127.0.0.1:9999"},
		{[]string{"--demo", "--metrics="}, "", ""},
		{[]string{"--demo"}, "127.0.0.1:9998", "127.0.0.1:9998"},
		{[]string{}, "", ""},
		// Another of its listeners on the demo's port: the metrics, which
		// listened first, made that one fail the start.
		{[]string{"--demo", "--http", demoMetricsAddr}, "", ""},
		{[]string{"--demo", "--mqtt-listen", ":9464"}, "", ""},
		{[]string{"--demo", "--pprof", "localhost:9464"}, "", ""},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " ")+" "+tt.env, func(t *testing.T) {
			if tt.env != "" {
				t.Setenv("COMPANION_METRICS", tt.env)
			}
			var cfg Config
			fs := newServeFlags(&cfg)
			require.NoError(t, parseFlags(fs, tt.args))
			cfg.demoMetrics(fs, slog.New(slog.DiscardHandler))
			if cfg.Metrics != tt.want {
				t.Errorf("serve %q (COMPANION_METRICS=%q): Metrics = %q; want %q", tt.args, tt.env, cfg.Metrics, tt.want)
			}
		})
	}
}

// TestMetricsOpenCommandsOnReplicas runs two replicas on one PostgreSQL
// store and one Mosquitto: the open commands gauge is the store's count on
// both, whichever replica accepted or ended the commands, and whenever the
// replica started.
func TestMetricsOpenCommandsOnReplicas(t *testing.T) {
	t.Parallel()
	pg := pgtest.Start(t)
	dsn := pg.NewDatabase(t)
	require.NoError(t, postgres.Migrate(t.Context(), dsn))
	mq := mqtttest.StartMosquitto(t, serverAccount)
	m1 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r1", Metrics: "127.0.0.1:0"}, mq)
	f := setupFleet(t, m1, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	// No bridge runs: the commands stay open until canceled.
	var ids []string
	for i := range 5 {
		cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": fmt.Sprint("msg ", i)})
		ids = append(ids, cmd["id"].(string))
	}
	m2 := startOnMosquitto(t, Config{Store: dsn, ReplicaID: "r2", Metrics: "127.0.0.1:0"}, mq)
	replicas := map[string]*Main{"r1": m1, "r2": m2}
	for name, m := range replicas {
		if got := metricsScrape(t, m).Value("companion_commands_open"); got != 5 {
			t.Errorf("companion_commands_open on %s = %v; want 5", name, got)
		}
	}

	// Three canceled through r1, two through r2.
	on2 := newClient(t, m2, f.user.token)
	for i, id := range ids {
		c := f.user
		if i >= 3 {
			c = on2
		}
		r := c.do("DELETE", "/api/v1/devices/dev-1/commands/"+id, nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
	}
	for name, m := range replicas {
		testenv.Eventually(t, 10*time.Second, "companion_commands_open at 0 on "+name, func() bool {
			return metricsScrape(t, m).Value("companion_commands_open") == 0
		})
	}
}

// closingStore is a store whose Close, once the store is closed, waits to
// be let go.
type closingStore struct {
	companion.Store
	closed, release chan struct{}
}

func (s *closingStore) Close() error {
	err := s.Store.Close()
	close(s.closed)
	<-s.release
	return err
}

// TestMetricsListenerClosesBeforeTheStore: a scrape as the server stops
// finds the metrics listener closed rather than a closed store, which it
// logged as a warning and left the open commands out of (bug 415).
func TestMetricsListenerClosesBeforeTheStore(t *testing.T) {
	var log testenv.Buffer
	m := startServerLogging(t, Config{Metrics: "127.0.0.1:0"}, slog.New(slog.NewTextHandler(&log, nil)))
	addr := m.MetricsAddr()
	metricsExpect(t, metricsScrape(t, m), 0, "companion_commands_open")

	s := &closingStore{Store: m.DB, closed: make(chan struct{}), release: make(chan struct{})}
	m.DB = s
	done := make(chan error, 1)
	go func() { done <- m.Close() }()
	<-s.closed
	r, err := http.Get("http://" + addr + "/metrics")
	if err == nil {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
		t.Errorf("GET /metrics answered %s with the store closed; want its listener closed first", r.Status)
	}
	close(s.release)
	require.NoError(t, <-done)
	require.NotContains(t, log.String(), "counting the open commands")
}
