package packaging

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/testenv"
)

// Both container images are scratch (packaging/docker), with no time zone
// database, and so is many a gateway's root file system. The binaries
// judge a timezone setting by the IANA database (topics.ValidTimezone):
// without one, the server answered a PUT …/settings of
// {"timezone":"Europe/Berlin"} 422 "must be an IANA time zone name such as
// Europe/Berlin", and the bridge failed invalid_payload every change to a
// zone a server with the database had taken. Each binary now carries the
// database (time/tzdata). The binaries run here in a user and mount
// namespace of their own (unshare -rm) in which the host's database, and
// the Go installation's, are empty directories (bug 577).
func TestTimeZonesWithoutTheHostsDatabase(t *testing.T) {
	bins := builtCommands(t)
	unshare := unshareRM(t, "to hide the host's time zone database with")
	goroot, err := exec.Command(goTool(t), "env", "GOROOT").Output()
	if err != nil {
		t.Fatalf("go env GOROOT: %v", err)
	}
	var hidden []string
	for _, dir := range []string{"/usr/share/zoneinfo", "/usr/share/lib/zoneinfo", "/usr/lib/locale/TZ", "/etc/zoneinfo",
		filepath.Join(strings.TrimSpace(string(goroot)), "lib", "time")} {
		if fi, err := os.Stat(dir); err == nil && fi.IsDir() {
			hidden = append(hidden, dir)
		}
	}
	empty := t.TempDir()
	// run starts bin with args where none of hidden holds anything, and
	// stops it at the end of the test.
	run := func(name string, args ...string) *lockedBuffer {
		t.Helper()
		script := `e=$0; while [ "$1" != -- ]; do mount --bind "$e" "$1" || exit 1; shift; done; shift; exec "$@"`
		full := append(append(append([]string{"-rm", "sh", "-c", script, empty}, hidden...), "--", filepath.Join(bins, name)), args...)
		cmd := exec.Command(unshare, full...)
		for _, e := range os.Environ() {
			if !strings.HasPrefix(e, "ZONEINFO=") && !strings.HasPrefix(e, "GOROOT=") && !strings.HasPrefix(e, "COMPANION_") {
				cmd.Env = append(cmd.Env, e)
			}
		}
		out := &lockedBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		t.Cleanup(func() {
			cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				cmd.Process.Kill()
				<-done
			}
			if t.Failed() {
				t.Logf("%s said:\n%s", name, out.String())
			}
		})
		return out
	}

	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	data, mqtt := t.TempDir(), free()
	run("companion", "serve", "--demo", "--http", free(), "--mqtt-listen", mqtt, "--metrics", free(), "--data", data)
	var demo struct {
		APIURL     string `json:"api_url"`
		Token      string `json:"token"`
		AdminToken string `json:"admin_token"`
		Devices    []struct {
			DeviceID  string `json:"device_id"`
			ClaimCode string `json:"claim_code"`
		} `json:"devices"`
	}
	deadline := time.Now().Add(time.Minute)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(filepath.Join(data, "demo.json"))
		if err == nil && json.Unmarshal(b, &demo) == nil && len(demo.Devices) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no demo.json after a minute (%v)", err)
		}
		<-tick.C
	}
	call := func(method, path, token string, body any, headers ...string) (int, map[string]any) {
		t.Helper()
		js, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, method, demo.APIURL+path, bytes.NewReader(js))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+token)
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		var out map[string]any
		json.NewDecoder(resp.Body).Decode(&out)
		return resp.StatusCode, out
	}
	// setZone changes the device's timezone and waits for the command to
	// end: it must succeed.
	setZone := func(dev, zone, who string) {
		t.Helper()
		status, cmd := call("PUT", "/api/v1/devices/"+dev+"/settings", demo.Token, map[string]string{"timezone": zone}, "Prefer", "wait=50")
		if status != 200 && status != 202 {
			t.Fatalf("PUT …/settings {\"timezone\":%q} through %s on a host without a time zone database = %d %v; want the change taken", zone, who, status, cmd)
		}
		if cmd["state"] != "succeeded" {
			t.Fatalf("a change of timezone to %s through %s on a host without a time zone database ended %v; want succeeded", zone, who, cmd)
		}
	}

	// The demo's bridge runs in the server's process.
	first := demo.Devices[0]
	if status, out := call("POST", "/api/v1/devices/register", demo.Token, map[string]string{"device_id": first.DeviceID, "claim_code": first.ClaimCode}); status != 201 && status != 200 {
		t.Fatalf("POST /api/v1/devices/register = %d %v", status, out)
	}
	setZone(first.DeviceID, "Europe/Berlin", "the server and its demo bridge")

	// A bridge of its own, companion-bridge.
	status, br := call("POST", "/api/v1/admin/bridges", demo.AdminToken, map[string]string{"bridge_id": "tz-bridge"})
	if status != 201 {
		t.Fatalf("POST /api/v1/admin/bridges = %d %v", status, br)
	}
	const dev, claim = "tz-001", "TZCLAIM-2026-0000"
	if status, out := call("POST", "/api/v1/admin/devices", demo.AdminToken,
		map[string]string{"device_id": dev, "claim_code": claim, "model": "sim-1", "bridge_id": "tz-bridge"}); status != 201 {
		t.Fatalf("POST /api/v1/admin/devices = %d %v", status, out)
	}
	if status, out := call("POST", "/api/v1/devices/register", demo.Token, map[string]string{"device_id": dev, "claim_code": claim}); status != 201 {
		t.Fatalf("POST /api/v1/devices/register = %d %v", status, out)
	}
	run("companion-bridge", "--mqtt-url", "tcp://"+mqtt, "--api-url", demo.APIURL, "--bridge-id", "tz-bridge",
		"--bridge-secret", br["secret"].(string), "--sim-devices", dev, "--data", t.TempDir())
	setZone(dev, "Asia/Tokyo", "companion-bridge")
}

// lockedBuffer is a process's output, written by exec's copying goroutine
// and read by the test.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
