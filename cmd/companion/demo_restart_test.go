package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/store"
)

// A first --demo start killed after it wrote some of the demo to the store
// and before it wrote demo.json (what an older server did, in that order;
// or demo.json deleted by hand): the next start still starts, and what the
// new demo.json holds works end to end.
func TestDemoStartsAfterAnInterruptedFirstStart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	first := startServer(t, Config{Data: dir, Demo: true})
	before := first.Demo.File
	require.NoError(t, first.Close())
	require.NoError(t, os.Remove(filepath.Join(dir, "demo.json")))

	m := NewMain(Config{Data: dir, Demo: true, HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", AdminToken: "x", TopicPrefix: "companion/v1"}, testLogger(t))
	err := m.Run(context.Background())
	t.Cleanup(func() { m.Close() })
	require.NoError(t, err)

	f := demoFileOf(t, m)
	assert.NotEqual(t, before.Token, f.Token, "the lost demo.json's token")
	assert.NotEqual(t, before.BridgeSecret, f.BridgeSecret, "the lost demo.json's bridge secret")
	// The claim codes went with the lost demo.json: the devices are the
	// demo user's already.
	user := newClient(t, m, f.Token)
	r := user.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	var got []string
	for _, d := range r.JSON(t)["devices"].([]any) {
		got = append(got, d.(map[string]any)["device_id"].(string))
	}
	assert.Equal(t, []string{"sim-001", "sim-002", "sim-003"}, got)
	demoWorks(t, m, f)
	demoQuickStartWorks(t, m, 9) // all but the register line

	// Once more on the same data: the same demo, its devices as they were.
	r = user.do("PUT", "/api/v1/devices/sim-001/settings", map[string]any{"volume": 9}, "Prefer", "wait=20")
	require.Equal(t, 200, r.Status, "%s", r.Body)
	require.NoError(t, m.Close())
	m = startServer(t, Config{Data: dir, Demo: true})
	assert.Equal(t, f.Token, demoFileOf(t, m).Token)
	settings, _, err := m.Demo.Sims[0].Settings(t.Context())
	require.NoError(t, err)
	assert.Equal(t, 9, settings["volume"], "sim-001's volume after the restart")
	demoWorks(t, m, f)
}

// A --demo start killed after it wrote its credentials (demo.json, or
// demo.pending.json before the store held them all) and part of the demo
// to the store: the next start completes the store with the file's
// credentials, which then all work, claim codes included.
func TestDemoCompletesAStartKilledAfterDemoJSON(t *testing.T) {
	t.Parallel()
	for _, file := range []string{"demo.json", demoPendingFile} {
		t.Run(file, func(t *testing.T) {
			t.Parallel()
			demoCompletesAStartKilledAfter(t, file)
		})
	}
}

func demoCompletesAStartKilledAfter(t *testing.T, file string) {
	dir := t.TempDir()
	f := newDemoFile()
	require.NoError(t, writeDemo(filepath.Join(dir, file), f))
	// The store as that start left it: the user, the bridge and the first
	// device made, nothing else.
	db, err := store.Open(filepath.Join(dir, "companion.db"), store.Options{})
	require.NoError(t, err)
	ctx := t.Context()
	require.NoError(t, db.CreateUser(ctx, companion.User{ID: f.UserID, Name: "demo", TokenHash: companion.HashSecret(f.Token)}))
	require.NoError(t, db.CreateBridge(ctx, companion.Bridge{ID: f.BridgeID, SecretHash: companion.HashSecret(f.BridgeSecret)}))
	require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "sim-001", Model: demoModel, ClaimHash: companion.HashSecret(f.Devices[0].ClaimCode), BridgeID: f.BridgeID}))
	require.NoError(t, db.Close())

	m := startServer(t, Config{Data: dir, Demo: true})
	got := demoFileOf(t, m)
	assert.Equal(t, f.Token, got.Token)
	assert.Equal(t, f.UserID, got.UserID)
	assert.Equal(t, f.BridgeSecret, got.BridgeSecret)
	assert.Equal(t, f.Devices, got.Devices)
	demoQuickStartWorks(t, m, 10)
	user := newClient(t, m, f.Token)
	for _, dev := range f.Devices[1:] {
		r := user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev.DeviceID, "claim_code": dev.ClaimCode})
		assert.Equal(t, 201, r.Status, "register %s: %s", dev.DeviceID, r.Body)
	}
	demoWorks(t, m, f)
	_, err = os.Stat(filepath.Join(dir, demoPendingFile))
	assert.ErrorIs(t, err, os.ErrNotExist, "%s once the store holds the demo", demoPendingFile)
}

// demo.json is there only while what it holds works: a script that reads
// it as soon as it is there registered a device before the first start
// had provisioned it, and was answered 422 invalid_claim (bug 574). On a
// first start and on the next, it is not there while the demo's records
// are written to the store, and it is once they all are.
func TestDemoJSONIsThereOnlyOnceTheDemoIsInTheStore(t *testing.T) {
	t.Parallel()
	m := startServer(t, Config{})
	seen := &filesAtProvision{Store: m.DB, dir: m.Config.Data}
	m.DB = seen
	path := filepath.Join(m.Config.Data, "demo.json")
	for _, start := range []string{"the first start", "the next start"} {
		seen.present = nil
		f, err := loadOrCreateDemo(t.Context(), m, path)
		require.NoError(t, err, start)
		require.Len(t, seen.present, len(f.Devices), "%s: devices provisioned", start)
		for _, files := range seen.present {
			assert.Equal(t, []string{demoPendingFile}, files, "%s: the demo's files while a device was provisioned", start)
		}
		b, err := os.ReadFile(path)
		require.NoError(t, err, start)
		var got DemoFile
		require.NoError(t, json.Unmarshal(b, &got))
		assert.Equal(t, f, got, start)
		_, err = os.Stat(filepath.Join(m.Config.Data, demoPendingFile))
		assert.ErrorIs(t, err, os.ErrNotExist, "%s: %s once the store holds the demo", start, demoPendingFile)
		r := newClient(t, m, f.Token).do("POST", "/api/v1/devices/register", map[string]string{"device_id": f.Devices[0].DeviceID, "claim_code": f.Devices[0].ClaimCode})
		assert.Contains(t, []int{200, 201}, r.Status, "%s: register with demo.json's claim code: %s", start, r.Body)
	}
}

// filesAtProvision records which of the demo's files are in dir each time
// a device is provisioned.
type filesAtProvision struct {
	companion.Store
	dir     string
	present [][]string
}

func (s *filesAtProvision) ProvisionDevice(ctx context.Context, d companion.RegistryDevice) error {
	var files []string
	for _, name := range []string{"demo.json", demoPendingFile} {
		if _, err := os.Stat(filepath.Join(s.dir, name)); err == nil {
			files = append(files, name)
		}
	}
	s.present = append(s.present, files)
	return s.Store.ProvisionDevice(ctx, d)
}

// demoFileOf reads the demo.json m wrote and checks it is the demo m runs.
func demoFileOf(tb testing.TB, m *Main) DemoFile {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join(m.Config.Data, "demo.json"))
	require.NoError(tb, err)
	var f DemoFile
	require.NoError(tb, json.Unmarshal(b, &f))
	require.Equal(tb, m.Demo.File, f)
	return f
}

// demoWorks checks that f's credentials log in on m: the user's token
// lists the demo devices, the bridge's secret is taken, and a text pushed
// to sim-001 through the demo bridge succeeds. sim-001 must be bound to
// the demo user.
func demoWorks(tb testing.TB, m *Main, f DemoFile) {
	tb.Helper()
	user := newClient(tb, m, f.Token)
	r := user.do("GET", "/api/v1/devices", nil)
	require.Equal(tb, 200, r.Status, "%s", r.Body)
	assert.NotEmpty(tb, r.JSON(tb)["devices"])
	// A bridge's secret reads blobs: 404 for one it need not, 401 for a
	// secret the server does not know.
	r = newClient(tb, m, f.BridgeSecret).do("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), nil)
	assert.Equal(tb, 404, r.Status, "the bridge secret: %s", r.Body)
	r = user.do("POST", "/api/v1/devices/sim-001/push/text", map[string]any{"text": "hello"}, "Prefer", "wait=20")
	require.Equal(tb, 200, r.Status, "%s", r.Body)
	assert.Equal(tb, "succeeded", r.JSON(tb)["state"], "through the demo bridge: %s", r.Body)
	// A text at the limits of CONTRACT §6 (4096 bytes, a title of 128)
	// is longer than a request the device takes at once.
	long := map[string]any{"text": strings.Repeat("é", 2048), "title": strings.Repeat("ü", 64)}
	r = user.do("POST", "/api/v1/devices/sim-001/push/text", long, "Prefer", "wait=20")
	require.Equal(tb, 200, r.Status, "%s", r.Body)
	assert.Equal(tb, "succeeded", r.JSON(tb)["state"], "a text at the limits: %s", r.Body)
}

// demoQuickStartWorks runs the curl lines m's demo prints, want of them,
// and checks each answers 2xx (and the waiting ones with a command that
// succeeded).
func demoQuickStartWorks(tb testing.TB, m *Main, want int) {
	tb.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		tb.Fatal("curl not installed: run make deps (it installs Debian's curl)")
	}
	var out bytes.Buffer
	m.Demo.PrintQuickStart(&out)
	var lines []string
	for _, l := range strings.Split(out.String(), "\n") {
		if l = strings.TrimSpace(l); strings.HasPrefix(l, "curl ") {
			lines = append(lines, l)
		}
	}
	require.Len(tb, lines, want, "%s", out.String())
	for _, l := range lines {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		b, err := exec.CommandContext(ctx, "sh", "-c", l+" -w '\\n%{http_code}'").CombinedOutput()
		cancel()
		require.NoError(tb, err, "%s: %s", l, b)
		outLines := strings.Split(strings.TrimSpace(string(b)), "\n")
		assert.Contains(tb, []string{"200", "201", "202"}, outLines[len(outLines)-1], "%s\n%s", l, b)
		if strings.Contains(l, "Prefer: wait") {
			assert.Contains(tb, string(b), `"state":"succeeded"`, "%s\n%s", l, b)
		}
	}
}

// make run twice, and a third time: each start's quick start works as
// printed, although the one before ran its OTA line and left sim-001 on
// the latest firmware (the simulated devices keep it in DATA/demo-sim, as
// the README says). The OTA line then rolls back to the firmware the
// devices start on, and the next start's updates again.
func TestDemoQuickStartWorksAgainAfterARestart(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for start := 1; start <= 3; start++ {
		m := startServer(t, Config{Data: dir, Demo: true})
		t.Logf("start %d", start)
		demoQuickStartWorks(t, m, 10)
		require.NoError(t, m.Close())
	}
}
