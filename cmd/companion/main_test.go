package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/openapitest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// testLogger keeps test output readable: warnings and errors only, unless
// -v is given.
func testLogger(tb testing.TB) *slog.Logger {
	tb.Helper()
	level := slog.LevelWarn
	if testing.Verbose() {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(newTBWriter(tb), &slog.HandlerOptions{Level: level}))
}

// logSignal is an io.Writer of log lines that closes seen at the first
// line holding text: a test waits on it for what the server says only in
// its log.
type logSignal struct {
	text string
	once sync.Once
	seen chan struct{}
}

func newLogSignal(text string) *logSignal { return &logSignal{text: text, seen: make(chan struct{})} }

func (l *logSignal) Write(p []byte) (int, error) {
	if strings.Contains(string(p), l.text) {
		l.once.Do(func() { close(l.seen) })
	}
	return len(p), nil
}

// tbWriter writes log lines to the test's log until the test ends, and
// drops them after: paho can go on with a reconnect attempt that started
// before its client was closed, and its goroutine's line would panic a
// test that has completed ("Log in goroutine after … has completed").
type tbWriter struct {
	tb   testing.TB
	mu   sync.Mutex
	done bool
}

func newTBWriter(tb testing.TB) *tbWriter {
	w := &tbWriter{tb: tb}
	// Registered first, so it runs last of the test's cleanups.
	tb.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return w
}

func (w *tbWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.tb.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

// startServer runs the real Main on port 0 and a temp dir (or cfg.Data).
func startServer(tb testing.TB, cfg Config) *Main {
	tb.Helper()
	return startServerLogging(tb, cfg, testLogger(tb))
}

// startServerLogging is startServer with the server's logger.
func startServerLogging(tb testing.TB, cfg Config, logger *slog.Logger) *Main {
	tb.Helper()
	if cfg.HTTP == "" {
		cfg.HTTP = "127.0.0.1:0"
	}
	if cfg.MQTTListen == "" && cfg.MQTTURL == "" {
		cfg.MQTTListen = "127.0.0.1:0"
	}
	if cfg.Data == "" {
		cfg.Data = tb.TempDir()
	}
	if cfg.AdminToken == "" {
		cfg.AdminToken = "test-admin-token"
	}
	if cfg.TopicPrefix == "" {
		cfg.TopicPrefix = topics.DefaultPrefix
	}
	if cfg.SweepInterval == 0 {
		cfg.SweepInterval = 100 * time.Millisecond
	}
	if cfg.ExpiryGrace == 0 {
		cfg.ExpiryGrace = time.Second
	}
	m := NewMain(cfg, logger)
	if err := m.Run(context.Background()); err != nil {
		m.Close()
		tb.Fatalf("start server: %v", err)
	}
	tb.Cleanup(func() { m.Close() })
	return m
}

// client is a test's view of the HTTP API.
type client struct {
	tb    testing.TB
	base  string
	token string
	hc    *http.Client
}

// newClient returns a client of m's API whose traffic is checked against
// api/openapi.json (a disagreement fails tb).
func newClient(tb testing.TB, m *Main, token string) *client {
	return &client{tb: tb, base: m.APIURL(), token: token, hc: openapitest.Client(tb, httpClientFor(m))}
}

// tlsClients holds, for a Main serving HTTPS (and mqtts), the HTTP client
// and MQTT TLS settings that trust its test CA.
var tlsClients sync.Map // *Main → *testTLS

type testTLS struct {
	http *http.Client
	mqtt *tls.Config
}

func httpClientFor(m *Main) *http.Client {
	if v, ok := tlsClients.Load(m); ok {
		return v.(*testTLS).http
	}
	return http.DefaultClient
}

func mqttTLSFor(m *Main) *tls.Config {
	if v, ok := tlsClients.Load(m); ok {
		return v.(*testTLS).mqtt
	}
	return nil
}

type response struct {
	Status int
	Header http.Header
	Body   []byte
}

func (r response) JSON(tb testing.TB) map[string]any {
	tb.Helper()
	var v map[string]any
	require.NoError(tb, json.Unmarshal(r.Body, &v), "body: %s", r.Body)
	return v
}

func (c *client) do(method, path string, body any, headers ...string) response {
	c.tb.Helper()
	var rd io.Reader
	ctype := ""
	switch b := body.(type) {
	case nil:
	case []byte:
		rd, ctype = bytes.NewReader(b), "application/octet-stream"
	default:
		js, err := json.Marshal(b)
		require.NoError(c.tb, err)
		rd, ctype = bytes.NewReader(js), "application/json"
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	require.NoError(c.tb, err)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	hc := c.hc
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	require.NoError(c.tb, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(c.tb, err)
	return response{Status: resp.StatusCode, Header: resp.Header, Body: out}
}

// fleet is what a test sets up through the admin API: a user, provisioned
// devices, a bridge, and catalog entries.
type fleet struct {
	admin        *client
	user         *client
	userID       string
	bridgeID     string
	bridgeSecret string
	claims       map[string]string
	firmware     []byte
}

func setupFleet(tb testing.TB, m *Main, devices ...string) *fleet {
	tb.Helper()
	f := &fleet{admin: newClient(tb, m, m.AdminToken()), claims: map[string]string{}}
	r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "alice"})
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	u := r.JSON(tb)
	f.userID = u["user_id"].(string)
	f.user = newClient(tb, m, u["token"].(string))

	r = f.admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-1"})
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	f.bridgeID = "bridge-1"
	f.bridgeSecret = r.JSON(tb)["secret"].(string)
	for i, id := range devices {
		code := fmt.Sprintf("CLAIM-%d-%s", i, strings.Repeat("X", 12))
		r := f.admin.do("POST", "/api/v1/admin/devices", map[string]string{"device_id": id, "claim_code": code, "model": "sim-1", "bridge_id": f.bridgeID})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
		f.claims[id] = code
	}

	f.firmware = firmwareImage(tb, "1.1.0", 64<<10) // an MCUboot image of 64 KiB
	r = f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.1.0", f.firmware)
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	for _, v := range []string{"1.0.0", "1.2.0"} {
		r = f.admin.do("PUT", "/api/v1/admin/apps/weather/"+v, bytes.Repeat([]byte(v), 1000))
		require.Equal(tb, 201, r.Status, "%s", r.Body)
	}
	return f
}

// bridge is a real agent serving simulated devices.
type bridge struct {
	agent  *agent.Agent
	sims   map[string]*sim.Device
	cancel context.CancelFunc
	done   chan struct{}
}

// startBridge runs a real bridge for the fleet with new simulated devices
// (in memory, no Bluetooth link), its spool in dataDir (a temp dir when "").
func startBridge(tb testing.TB, m *Main, mqttURL string, f *fleet, dataDir string, devices ...string) *bridge {
	tb.Helper()
	sims := map[string]*sim.Device{}
	var devs []agent.Device
	for _, id := range devices {
		s := sim.New(sim.Options{ID: id})
		sims[id] = s
		devs = append(devs, s)
	}
	return runBridge(tb, m, mqttURL, f, devs, sims, func(o *agent.Options) {
		if dataDir != "" {
			o.DataDir = dataDir
		}
	})
}

// runBridge runs a real agent as the fleet's bridge, serving devs; sims are
// the simulated devices behind them, by id. edit, when not nil, adjusts the
// agent's options. The bridge stops at the end of the test.
func runBridge(tb testing.TB, m *Main, mqttURL string, f *fleet, devs []agent.Device, sims map[string]*sim.Device, edit func(*agent.Options)) *bridge {
	tb.Helper()
	opts := agent.Options{
		MQTTURL:    mqttURL,
		Username:   f.bridgeID,
		Password:   f.bridgeSecret,
		BridgeID:   f.bridgeID,
		APIURL:     m.APIURL(),
		HTTPClient: openapitest.Client(tb, httpClientFor(m)), // its downloads checked too
		TLSConfig:  mqttTLSFor(m),
		DataDir:    tb.TempDir(),
		Devices:    devs,
		Logger:     testLogger(tb).With("component", "bridge"),
	}
	if edit != nil {
		edit(&opts)
	}
	a, err := agent.New(opts)
	require.NoError(tb, err)
	ctx, cancel := context.WithCancel(context.Background())
	b := &bridge{agent: a, sims: sims, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		a.Run(ctx)
	}()
	tb.Cleanup(b.stop)
	return b
}

func (b *bridge) stop() {
	select {
	case <-b.done:
		return
	default:
	}
	b.cancel()
	<-b.done
	b.agent.Close()
}

// waitFinal asks the server to hold the answer until the command is final.
func (c *client) waitFinal(deviceID, id string) map[string]any {
	c.tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		r := c.do("GET", "/api/v1/devices/"+deviceID+"/commands/"+id, nil, "Prefer", "wait=10")
		require.Contains(c.tb, []int{200, 202}, r.Status, "%s", r.Body)
		cmd := r.JSON(c.tb)
		if companion.IsFinal(cmd["state"].(string)) {
			return cmd
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("command %s still %s", id, cmd["state"])
		}
	}
}

// accept sends a command request and checks the 202 (or the 200 of a
// Prefer: wait that finished).
func (c *client) accept(method, path string, body any, headers ...string) map[string]any {
	c.tb.Helper()
	r := c.do(method, path, body, headers...)
	require.Contains(c.tb, []int{200, 202}, r.Status, "%s %s: %s", method, path, r.Body)
	cmd := r.JSON(c.tb)
	require.NotEmpty(c.tb, cmd["id"])
	if r.Status == 202 {
		require.Equal(c.tb, "/api/v1/devices/"+cmd["device_id"].(string)+"/commands/"+cmd["id"].(string), r.Header.Get("Location"))
	}
	return cmd
}

// pushText sends a text to the device and returns the accepted command's
// id.
func (c *client) pushText(dev, text string) string {
	c.tb.Helper()
	return c.accept("POST", "/api/v1/devices/"+dev+"/push/text", map[string]any{"text": text})["id"].(string)
}

func pngImage(tb testing.TB, w, h int) []byte {
	tb.Helper()
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	for x := 0; x < w; x++ {
		img.Set(x, x%h, color.RGBA{R: 200, A: 255})
	}
	var buf bytes.Buffer
	require.NoError(tb, png.Encode(&buf, img))
	return buf.Bytes()
}

// exerciseEveryOperation drives the twelve operations of the spec against
// one registered device and checks the device's state after each.
func exerciseEveryOperation(t *testing.T, f *fleet, b *bridge, dev string) {
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": f.claims[dev], "name": "Kitchen"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	exerciseRegistered(t, f, b, dev)
}

// exerciseRegistered is exerciseEveryOperation on a device the fleet's user
// has registered already: the register again (200) and the other eleven.
func exerciseRegistered(t *testing.T, f *fleet, b *bridge, dev string) {
	u := f.user
	s := b.sims[dev]
	dp := "/api/v1/devices/" + dev

	// Register again, and list.
	r := u.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": f.claims[dev]})
	require.Equal(t, 200, r.Status, "%s", r.Body)
	r = u.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status)
	assert.Contains(t, string(r.Body), `"device_id":"`+dev+`"`)

	// Status, once the bridge has reported.
	testenv.Eventually(t, 20*time.Second, "device online", func() bool {
		r := u.do("GET", dp+"/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == true
	})
	st := u.do("GET", dp+"/status", nil).JSON(t)
	assert.Equal(t, "1.0.0", st["firmware_version"])
	assert.Equal(t, f.bridgeID, st["bridge_id"])
	assert.EqualValues(t, 100, st["battery"])

	// Text.
	cmd := u.accept("POST", dp+"/push/text", map[string]any{"title": "Hi", "text": "Hello, device"})
	assert.Equal(t, "succeeded", u.waitFinal(dev, cmd["id"].(string))["state"])
	texts := s.Texts()
	require.NotEmpty(t, texts)
	assert.Equal(t, "Hello, device", texts[len(texts)-1].Text)

	// Image.
	img := pngImage(t, 64, 32)
	cmd = u.accept("POST", dp+"/push/image", map[string]any{"image": base64.StdEncoding.EncodeToString(img), "content_type": "image/png"})
	assert.Equal(t, "succeeded", u.waitFinal(dev, cmd["id"].(string))["state"])
	imgs := s.Images()
	require.NotEmpty(t, imgs)
	assert.Equal(t, img, imgs[len(imgs)-1].Data)

	// Apps: install, update, list, uninstall. A read right after a command
	// ends reflects it, whether the end was waited for in the command's
	// own request (Prefer: wait) or in a GET of it (CONTRACT §8).
	cmd = u.accept("POST", dp+"/apps/install", map[string]any{"app_id": "weather", "version": "1.0.0"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
	assert.Equal(t, "1.0.0", s.Apps()["weather"])
	assert.JSONEq(t, `{"apps":[{"app_id":"weather","version":"1.0.0"}]}`, string(u.do("GET", dp+"/apps", nil).Body))
	cmd = u.accept("PUT", dp+"/apps/weather/update", map[string]any{})
	assert.Equal(t, "succeeded", u.waitFinal(dev, cmd["id"].(string))["state"])
	assert.Equal(t, "1.2.0", s.Apps()["weather"])
	assert.JSONEq(t, `{"apps":[{"app_id":"weather","version":"1.2.0"}]}`, string(u.do("GET", dp+"/apps", nil).Body))
	cmd = u.accept("DELETE", dp+"/apps/weather", nil, "Prefer", "wait=30")
	require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
	assert.NotContains(t, s.Apps(), "weather")
	assert.JSONEq(t, `{"apps":[]}`, string(u.do("GET", dp+"/apps", nil).Body))

	// Settings.
	testenv.Eventually(t, 20*time.Second, "settings reported", func() bool {
		r := u.do("GET", dp+"/settings", nil)
		return r.Status == 200 && r.JSON(t)["reported"].(map[string]any)["brightness"] != nil
	})
	set := u.do("GET", dp+"/settings", nil).JSON(t)
	assert.EqualValues(t, 50, set["reported"].(map[string]any)["brightness"])
	assert.Contains(t, set["schema"], "language")
	cmd = u.accept("PUT", dp+"/settings", map[string]any{"brightness": 80, "language": "de"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
	values, _, err := s.Settings(context.Background())
	require.NoError(t, err)
	assert.EqualValues(t, 80, values["brightness"])
	set = u.do("GET", dp+"/settings", nil).JSON(t)
	assert.Equal(t, "de", set["reported"].(map[string]any)["language"], "settings right after the command: %v", set)
	assert.EqualValues(t, 80, set["reported"].(map[string]any)["brightness"])
	assert.Empty(t, set["pending"])

	// OTA.
	chk := u.do("GET", dp+"/ota/check", nil).JSON(t)
	assert.Equal(t, "1.0.0", chk["current_version"])
	assert.Equal(t, "1.1.0", chk["latest_version"])
	assert.Equal(t, true, chk["update_available"])
	cmd = u.accept("POST", dp+"/ota/update", map[string]any{})
	assert.Equal(t, "succeeded", u.waitFinal(dev, cmd["id"].(string))["state"])
	assert.Equal(t, "1.1.0", s.Firmware())
	assert.Equal(t, "1.1.0", u.do("GET", dp+"/status", nil).JSON(t)["firmware_version"], "status right after the update")
	assert.Equal(t, "1.1.0", u.do("GET", dp+"/ota/check", nil).JSON(t)["current_version"])
	r = u.do("POST", dp+"/ota/update", map[string]any{})
	assert.Equal(t, 409, r.Status, "%s", r.Body)
	assert.Equal(t, false, u.do("GET", dp+"/ota/check", nil).JSON(t)["update_available"])

	// The command history holds them all, newest first.
	hist := u.do("GET", dp+"/commands?limit=200", nil).JSON(t)["commands"].([]any)
	assert.Len(t, hist, 7)
	for _, c := range hist {
		assert.Equal(t, "succeeded", c.(map[string]any)["state"])
	}
	for _, s := range b.sims {
		for _, c := range hist {
			assert.LessOrEqual(t, s.Executions(c.(map[string]any)["id"].(string)), 1)
		}
	}
}

func TestEveryOperationEmbeddedBroker(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1", "dev-2")
	b := startBridge(t, m, m.MQTTURL(), f, "", "dev-1", "dev-2")
	exerciseEveryOperation(t, f, b, "dev-1")
}

func TestIsolationBetweenUsers(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "mine"})

	r = f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "mallory"})
	require.Equal(t, 201, r.Status)
	other := newClient(t, m, r.JSON(t)["token"].(string))

	unknown := other.do("GET", "/api/v1/devices/no-such-device/status", nil)
	require.Equal(t, 404, unknown.Status)
	for _, req := range []struct{ method, path string }{
		{"GET", "/api/v1/devices/dev-1/status"},
		{"GET", "/api/v1/devices/dev-1/settings"},
		{"GET", "/api/v1/devices/dev-1/apps"},
		{"GET", "/api/v1/devices/dev-1/commands"},
		{"GET", "/api/v1/devices/dev-1/commands/" + cmd["id"].(string)},
		{"GET", "/api/v1/devices/dev-1/ota/check"},
		{"DELETE", "/api/v1/devices/dev-1/commands/" + cmd["id"].(string)},
		{"DELETE", "/api/v1/devices/dev-1"},
	} {
		r := other.do(req.method, req.path, nil)
		assert.Equal(t, 404, r.Status, "%s %s: %s", req.method, req.path, r.Body)
		assert.JSONEq(t, string(unknown.Body), strings.ReplaceAll(string(r.Body), "dev-1", "no-such-device"), "%s %s", req.method, req.path)
	}
	r = other.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "not yours"})
	assert.Equal(t, 404, r.Status)
	r = other.do("GET", "/api/v1/devices", nil)
	assert.Equal(t, 200, r.Status)
	assert.NotContains(t, string(r.Body), "dev-1")
	r = other.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	assert.Equal(t, 409, r.Status, "%s", r.Body)
}

func TestRestartKeepsEverything(t *testing.T) {
	dir := t.TempDir()
	m := startServer(t, Config{Data: dir})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	// No bridge yet: commands wait.
	var ids []string
	for i := 0; i < 5; i++ {
		cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": fmt.Sprintf("msg %d", i)})
		ids = append(ids, cmd["id"].(string))
	}
	require.NoError(t, m.Close())

	// Same data, new process (new ports).
	m2 := startServer(t, Config{Data: dir})
	user := newClient(t, m2, f.user.token)
	r = user.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status)
	assert.Contains(t, string(r.Body), "dev-1")
	for _, id := range ids {
		r := user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
	}
	f.user = user
	b := startBridge(t, m2, m2.MQTTURL(), f, "", "dev-1")
	for _, id := range ids {
		assert.Equal(t, "succeeded", user.waitFinal("dev-1", id)["state"])
	}
	texts := b.sims["dev-1"].Texts()
	require.Len(t, texts, 5)
	for i, tx := range texts {
		assert.Equal(t, fmt.Sprintf("msg %d", i), tx.Text, "commands run in acceptance order")
	}
}

// The tests that mostly wait (for NATS clusters, PostgreSQL, timeouts,
// processes of their own) call t.Parallel: go test runs them together,
// after every other test of the package has ended, which takes minutes
// off make test on two cores. A test that changes the process's own state
// (t.Setenv, a package variable) must not, and none of them may depend on
// the CPU time it gets. What cannot be taken back, or reaches the test
// binary's own files (a seccomp filter, a file size limit), runs in a
// child process of its own (testenv.InChild).
func TestMain(m *testing.M) {
	if runBenchRole() {
		return
	}
	code := m.Run()
	removeProcBinaries()
	os.Exit(code)
}
