package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/testenv"
)

// The real program, built with the real binaries, brings the whole cluster
// up in a temp directory: a device registered through replica-1 runs a
// text sent through replica-2 with Prefer: wait; a second up says the
// cluster is up and starts nothing; the shell lines up prints work as
// printed; down leaves none of its processes running.
func TestUpAndDown(t *testing.T) {
	bin := buildBinaries(t)
	// Not t.TempDir: its directories are 0700, and PostgreSQL runs as the
	// user postgres when the test runs as root.
	base, err := os.MkdirTemp("", "cluster-test")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "cluster")
	cluster := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "cluster"), append([]string{"-dir", dir, "-bin", bin}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	t.Cleanup(func() {
		// Whatever happened, nothing stays running.
		if out, err := cluster("down"); err != nil {
			t.Errorf("cleanup: cluster down: %v\n%s", err, out)
		}
		if t.Failed() {
			logs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				if len(b) > 3000 {
					b = b[len(b)-3000:]
				}
				t.Logf("%s (tail):\n%s", filepath.Base(l), b)
			}
		}
		os.RemoveAll(base)
	})

	start := time.Now()
	out, err := cluster("up")
	if err != nil {
		t.Fatalf("cluster up: %v\n%s", err, out)
	}
	t.Logf("up in %v", time.Since(start).Round(time.Millisecond))
	info, err := readInfo(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.APIURLs) != 3 || len(info.MQTTURLs) != 3 || len(info.NATSMonitorURLs) != 3 || info.AdminToken == "" || len(info.Devices) != 3 {
		t.Fatalf("cluster.json = %+v; want 3 API, MQTT and monitoring URLs, an admin token and 3 devices", info)
	}
	for _, name := range []string{"replica-1", "replica-2", "replica-3", "nats-1", "nats-2", "nats-3", "postgres", "bridge"} {
		if pid := info.PIDs[name]; !running(pid, dir) {
			t.Errorf("pids[%q] = %d: not running", name, pid)
		}
	}
	if len(info.PIDs) != 8 {
		t.Errorf("pids = %v; want 8", info.PIDs)
	}

	again, err := cluster("up")
	if err != nil || !strings.Contains(again, "already up") {
		t.Errorf("second up: %v\n%s", err, again)
	}
	if after, _ := readInfo(dir); fmt.Sprint(after.PIDs) != fmt.Sprint(info.PIDs) {
		t.Errorf("second up changed the pids: %v, was %v", after.PIDs, info.PIDs)
	}

	// A user, made through the admin API, registers a device through
	// replica-1 and sends it a text through replica-2, waiting.
	admin := client{base: info.APIURLs[0], token: info.AdminToken}
	var user struct {
		Token string `json:"token"`
	}
	admin.do(t, "POST", "/api/v1/admin/users", `{"name":"tester"}`, "", 201, &user)
	dev := info.Devices[1]
	r1 := client{base: info.APIURLs[0], token: user.Token}
	r1.do(t, "POST", "/api/v1/devices/register", fmt.Sprintf(`{"device_id":%q,"claim_code":%q}`, dev.DeviceID, dev.ClaimCode), "", 201, nil)
	r2 := client{base: info.APIURLs[1], token: user.Token}
	var cmd struct {
		State string `json:"state"`
	}
	r2.do(t, "POST", "/api/v1/devices/"+dev.DeviceID+"/push/text", `{"text":"hello through replica-2"}`, "wait=20", 200, &cmd)
	if cmd.State != "succeeded" {
		t.Errorf("push/text through replica-2 with Prefer: wait: state %q, want succeeded", cmd.State)
	}

	// The lines up prints, as printed (for the first device).
	i := strings.Index(out, "API1=")
	if i < 0 {
		t.Fatalf("up printed no shell lines:\n%s", out)
	}
	sh, err := exec.Command("sh", "-c", "set -e\n"+out[i:]).CombinedOutput()
	if err != nil || !strings.Contains(string(sh), `"state":"succeeded"`) {
		t.Errorf("the printed lines: %v; want a succeeded command at the end:\n%s", err, sh)
	}

	checkDoor(t, info, admin)

	// Pieces killed with SIGKILL start again as they were: PostgreSQL's
	// postmaster alone (its backends linger), a replica and a node. The
	// cluster then runs a command through the replica started again.
	for _, name := range []string{"postgres", "replica-2", "nats-2"} {
		if err := syscall.Kill(info.PIDs[name], syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"replica-2", "nats-2"} {
		if !waitGone(info.PIDs[name], 10*time.Second) {
			t.Fatalf("%s did not die of SIGKILL", name)
		}
	}
	if out, err := cluster("start", "bogus"); err == nil || !strings.Contains(out, "replica-1") {
		t.Errorf("start bogus: %v; want an error naming the pieces:\n%s", err, out)
	}
	out, err = cluster("start", "postgres", "replica-2", "nats-2", "replica-1")
	if err != nil {
		t.Fatalf("cluster start: %v\n%s", err, out)
	}
	t.Logf("start:\n%s", out)
	if !strings.Contains(out, "runs already") {
		t.Errorf("start of replica-1, which runs: want it said to run already:\n%s", out)
	}
	restarted, err := readInfo(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"postgres", "replica-2", "nats-2"} {
		if pid := restarted.PIDs[name]; pid == info.PIDs[name] || !running(pid, dir) {
			t.Errorf("pids[%q] = %d after start (was %d): want a new, running one", name, pid, info.PIDs[name])
		}
	}
	if restarted.PIDs["replica-1"] != info.PIDs["replica-1"] {
		t.Errorf("start changed the pid of replica-1, which ran")
	}
	cmd.State = ""
	r2.do(t, "POST", "/api/v1/devices/"+dev.DeviceID+"/push/text", `{"text":"through replica-2 started again"}`, "wait=30", 200, &cmd)
	if cmd.State != "succeeded" {
		t.Errorf("push/text through replica-2 started again: state %q, want succeeded", cmd.State)
	}
	info = restarted

	out, err = cluster("down")
	if err != nil {
		t.Fatalf("cluster down: %v\n%s", err, out)
	}
	t.Logf("down:\n%s", out)
	for name, pid := range info.PIDs {
		if live(pid) || groupLive(pid) {
			t.Errorf("%s (pid %d) still runs after down", name, pid)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, jsonName)); !os.IsNotExist(err) {
		t.Errorf("cluster.json after down: %v; want it gone", err)
	}
}

// buildBinaries builds companion, companion-bridge and this program into a
// temp directory beside a link to the repository's bin/nats-server (make
// deps builds it), and returns the directory.
func buildBinaries(t *testing.T) string {
	t.Helper()
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	nats := filepath.Join(root, "bin", "nats-server")
	if fi, err := os.Stat(nats); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		t.Fatalf("%s is missing: run make deps (it builds NATS Server from the Go module proxy into bin/)", nats)
	}
	bin := t.TempDir()
	goBin, err := testenv.GoTool()
	if err != nil {
		t.Fatalf("the go command: %v", err)
	}
	build := exec.Command(goBin, "build", "-o", bin+string(filepath.Separator), "./cmd/companion", "./cmd/companion-bridge", "./scripts/cluster")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if err := os.Symlink(nats, filepath.Join(bin, "nats-server")); err != nil {
		t.Fatal(err)
	}
	return bin
}

type client struct{ base, token string }

// do sends a JSON request and wants status; it decodes the answer into
// answer when not nil.
func (c client) do(t *testing.T, method, path, body, prefer string, status int, answer any) {
	t.Helper()
	req, err := http.NewRequest(method, c.base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Content-Type", "application/json")
	if prefer != "" {
		req.Header.Set("Prefer", prefer)
	}
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	if resp.StatusCode != status {
		t.Fatalf("%s %s%s = %d %s; want %d", method, c.base, path, resp.StatusCode, bytes.TrimSpace(b), status)
	}
	if answer != nil {
		if err := json.Unmarshal(b, answer); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
}

// checkDoor shows that the replicas answer the NATS nodes' authorization
// from the store: a bridge made through the admin API after the cluster
// came up logs in to a node with its secret at once, and gets the rights
// of its devices only; a wrong password is refused.
func checkDoor(t *testing.T, info Info, admin client) {
	t.Helper()
	mosquittoSub, err := exec.LookPath("mosquitto_sub")
	if err != nil {
		t.Fatalf("mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
	}
	var created struct {
		Secret string `json:"secret"`
	}
	admin.do(t, "POST", "/api/v1/admin/bridges", `{"bridge_id":"bridge-2"}`, "", 201, &created)
	admin.do(t, "POST", "/api/v1/admin/devices", `{"device_id":"door-001","claim_code":"door-claim-code-1","model":"sim-1","bridge_id":"bridge-2"}`, "", 201, nil)
	u, err := url.Parse(info.MQTTURLs[2])
	if err != nil {
		t.Fatal(err)
	}
	// sub subscribes as bridge-2 and returns mosquitto_sub's debug output
	// (-d: "Subscribed (mid: 1): 1" when the SUBACK grants QoS 1, 128 when
	// it refuses); -E exits once the SUBACK is in.
	sub := func(password, filter string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, mosquittoSub, "-h", u.Hostname(), "-p", u.Port(), "-V", "mqttv311",
			"-i", "companion-bridge-bridge-2", "-u", "bridge-2", "-P", password,
			"-t", filter, "-q", "1", "-d", "-E", "-W", "20").CombinedOutput()
		return string(out), err
	}
	if out, err := sub("not-the-secret", "companion/v1/devices/door-001/commands/+"); err == nil || strings.Contains(out, "Subscribed") {
		t.Errorf("bridge-2 with a wrong password: %v; want refused:\n%s", err, out)
	}
	if out, err := sub(created.Secret, "companion/v1/devices/door-001/commands/+"); err != nil || !strings.Contains(out, "Subscribed (mid: 1): 1") {
		t.Errorf("bridge-2 with its secret, its device's commands: %v; want let in and granted:\n%s", err, out)
	}
	other := "companion/v1/devices/" + info.Devices[0].DeviceID + "/commands/+"
	if out, err := sub(created.Secret, other); err != nil || !strings.Contains(out, "Subscribed (mid: 1): 128") {
		t.Errorf("bridge-2 with its secret, bridge-1's device's commands: %v; want let in and refused (128):\n%s", err, out)
	}
}
