package main

// Faults injected into real processes (issue 4, faults 1, 2 and 9): the
// companion and companion-bridge binaries, built once per test binary, run
// on free ports and temp directories, and are killed with real signals. The
// simulated devices record every command id they execute in files
// (--sim-state), so the tests count executions across bridge processes.
//
// Helpers here are named proc… so they do not collide with the in-process
// fault tests of faults_test.go.

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// procBins holds the binaries built for this test binary.
var procBins struct {
	once              sync.Once
	companion, bridge string
	err               error
}

// procBinaries builds companion and companion-bridge once (without -race:
// they are the system under test, not the test) and returns their paths.
// They live in a temp directory named after this process; directories left
// by earlier test processes that are gone are removed.
func procBinaries(tb testing.TB) (companion, bridge string) {
	tb.Helper()
	procBins.once.Do(func() {
		removeStaleBinDirs()
		dir, err := os.MkdirTemp("", fmt.Sprintf("companion-proctest-%d-", os.Getpid()))
		if err != nil {
			procBins.err = err
			return
		}
		root, err := testenv.RepoRoot()
		if err != nil {
			procBins.err = err
			return
		}
		goBin, err := testenv.GoTool()
		if err != nil {
			procBins.err = err
			return
		}
		cmd := exec.Command(goBin, "build", "-o", dir+string(filepath.Separator), "./cmd/companion", "./cmd/companion-bridge")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			procBins.err = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		procBins.companion = filepath.Join(dir, "companion")
		procBins.bridge = filepath.Join(dir, "companion-bridge")
	})
	if procBins.err != nil {
		tb.Fatalf("build binaries: %v", procBins.err)
	}
	return procBins.companion, procBins.bridge
}

// removeProcBinaries removes the binaries procBinaries built, once the
// tests that run them are over (TestMain): left in the temp directory,
// they waited there for the next test process to remove them.
func removeProcBinaries() {
	if procBins.companion != "" {
		os.RemoveAll(filepath.Dir(procBins.companion))
	}
}

// removeStaleBinDirs removes the binary directories of test processes that
// no longer run (one killed before its TestMain removed them).
func removeStaleBinDirs() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "companion-proctest-*"))
	for _, d := range dirs {
		parts := strings.Split(filepath.Base(d), "-")
		if len(parts) < 3 {
			continue
		}
		pid, err := strconv.Atoi(parts[2])
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
			os.RemoveAll(d)
		}
	}
}

// osProc is one running process of a test. Its output goes to a log file
// that is printed (the tail) when the test fails.
type osProc struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	exited  chan struct{}
	waitErr error
}

func startProc(tb testing.TB, name, bin string, args ...string) *osProc {
	tb.Helper()
	return startProcEnv(tb, name, bin, procEnv(), args...)
}

// startProcEnv is startProc with the environment env.
func startProcEnv(tb testing.TB, name, bin string, env []string, args ...string) *osProc {
	tb.Helper()
	dir := os.Getenv(procLogDirEnv)
	if dir == "" {
		dir = tb.TempDir()
	} else {
		require.NoError(tb, os.MkdirAll(dir, 0o755))
	}
	logf, err := os.CreateTemp(dir, name+"-*.log")
	require.NoError(tb, err)
	p := &osProc{name: name, logPath: logf.Name(), exited: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	// The child writes its log to a pipe, which this process copies to
	// the file: a limit on the child's file sizes (setFileSizeLimit, a
	// full disk's stand-in) then leaves its log whole, as a log shipped
	// to another disk (journald's) is.
	out := struct{ io.Writer }{logf}
	p.cmd.Stdout, p.cmd.Stderr = out, out
	p.cmd.WaitDelay = 5 * time.Second // a child of its own holding the pipe
	p.cmd.Env = env
	testenv.EndsWithTestBinary(p.cmd)
	if err := p.cmd.Start(); err != nil {
		logf.Close()
		require.NoError(tb, err, "start %s", name)
	}
	go func() {
		p.waitErr = p.cmd.Wait() // once the pipe is drained
		logf.Close()
		close(p.exited)
	}()
	tb.Cleanup(func() {
		p.kill()
		if tb.Failed() {
			b, _ := os.ReadFile(p.logPath)
			if len(b) > 8000 {
				b = b[len(b)-8000:]
			}
			tb.Logf("%s log (tail):\n%s", name, b)
		}
	})
	return p
}

// procLogDirEnv names a directory where the processes' logs are written
// and kept after the test (make soak-cluster SOAK_LOG_DIR=…); without it
// they go to a temp dir that the test removes.
const procLogDirEnv = "PROC_LOG_DIR"

// procEnv is the environment of the processes: no COMPANION_* of the
// caller's leaks into them.
func procEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPANION_") {
			env = append(env, kv)
		}
	}
	return env
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *osProc) kill() {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// stop sends SIGTERM and waits for the process to be gone, SIGKILL after
// 15 s.
func (p *osProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(15 * time.Second):
		p.kill()
	}
}

// running reports whether the process has not exited.
func (p *osProc) running() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// procCluster is a server and a bridge as processes, on fixed ports and
// directories chosen for the test so that both can be restarted on the same
// ones.
type procCluster struct {
	tb                testing.TB
	companion, bridge string

	httpAddr, mqttAddr string
	data               string // the server's --data
	bridgeData         string // the bridge's --data
	simState           string // the bridge's --sim-state
	adminToken         string
	devices            []string
	serverArgs         []string // extra flags of the server
	bridgeArgs         []string // extra flags of the bridge
	// A shell command that moves the shell into a cgroup
	// (testenv.MemoryCgroup): the server and the bridge start in it.
	cgroup string
	// With an external broker: its URL and the server's flags for it
	// (--mqtt-url …); otherwise the server's embedded broker on mqttAddr.
	mqttURL    string
	serverMQTT []string

	server, bridgeProc *osProc
	bridgeLogs         []string // the log of every bridge process launched, in order
	user               *client
	bridgeID           string // the bridge's id; bridge-1 when empty
	bridgeSecret       string
}

func newProcCluster(tb testing.TB, devices int) *procCluster {
	tb.Helper()
	companion, bridge := procBinaries(tb)
	c := &procCluster{
		tb:         tb,
		companion:  companion,
		bridge:     bridge,
		httpAddr:   "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(tb)),
		mqttAddr:   "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(tb)),
		data:       tb.TempDir(),
		bridgeData: tb.TempDir(),
		simState:   tb.TempDir(),
		adminToken: "proc-admin-token",
	}
	for i := range devices {
		c.devices = append(c.devices, fmt.Sprintf("dev-%d", i+1))
	}
	return c
}

func (c *procCluster) base() string { return "http://" + c.httpAddr }

func (c *procCluster) brokerURL() string {
	if c.mqttURL != "" {
		return c.mqttURL
	}
	return "tcp://" + c.mqttAddr
}

// startServer starts `companion serve` on the cluster's ports and data and
// waits until /readyz answers 200.
func (c *procCluster) startServer() {
	c.tb.Helper()
	c.launchServer()
	c.waitServer("/readyz")
}

func (c *procCluster) launchServer() {
	c.tb.Helper()
	mqttArgs := c.serverMQTT
	if mqttArgs == nil {
		mqttArgs = []string{"--mqtt-listen", c.mqttAddr}
	}
	args := append([]string{"serve",
		"--http", c.httpAddr, "--data", c.data,
		"--admin-token", c.adminToken, "--log-level", "warn",
		// The load tests drive every device from one user at once, each
		// request held by Prefer: wait (make bench: 200 of them).
		"--rate-per-token", "0", "--max-open-commands", "10000", "--max-waits-per-user", "0"}, mqttArgs...)
	args = append(args, c.serverArgs...)
	c.server = c.startProc("companion", c.companion, args...)
}

// waitServer waits until path (/healthz or /readyz) answers 200.
func (c *procCluster) waitServer(path string) {
	c.tb.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(c.base() + path)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if !c.server.running() {
			c.tb.Fatalf("companion exited at start: %v", c.server.waitErr)
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("companion not ready on %s: %v", c.httpAddr, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a process we cannot signal us
	}
}

// setupFleet creates a user, a bridge and the devices (served by the
// bridge, registered to the user) through the admin API of the running
// server. The extra devices are registered too, served by a second bridge
// that never connects: their commands go to the broker and no further, as
// for a fleet whose bridge is offline.
func (c *procCluster) setupFleet(extra ...string) {
	tb := c.tb
	tb.Helper()
	admin := &client{tb: tb, base: c.base(), token: c.adminToken}
	r := admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "alice"})
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	c.user = &client{tb: tb, base: c.base(), token: r.JSON(tb)["token"].(string)}
	r = admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-1"})
	require.Equal(tb, 201, r.Status, "%s", r.Body)
	c.bridgeSecret = r.JSON(tb)["secret"].(string)
	if len(extra) > 0 {
		r = admin.do("POST", "/api/v1/admin/bridges", map[string]string{"bridge_id": "bridge-offline"})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
	}
	for i, id := range append(slices.Clip(c.devices), extra...) {
		code := fmt.Sprintf("CLAIM-%d-XXXXXXXXXXXX", i)
		bridge := "bridge-1"
		if i >= len(c.devices) {
			bridge = "bridge-offline"
		}
		r := admin.do("POST", "/api/v1/admin/devices", map[string]string{"device_id": id, "claim_code": code, "model": "sim-1", "bridge_id": bridge})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
		r = c.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": id, "claim_code": code})
		require.Equal(tb, 201, r.Status, "%s", r.Body)
	}
}

// startProc starts a process of the cluster: in its cgroup, if it has
// one, without the collector's variables of the test's environment.
func (c *procCluster) startProc(name, bin string, args ...string) *osProc {
	if c.cgroup == "" {
		return startProc(c.tb, name, bin, args...)
	}
	var env []string
	for _, kv := range procEnv() {
		if k, _, _ := strings.Cut(kv, "="); k != "GOGC" && k != "GOMEMLIMIT" && k != "AUTOMEMLIMIT" {
			env = append(env, kv)
		}
	}
	return startProcEnv(c.tb, name, "/bin/sh", env, append([]string{"-c", c.cgroup + ` && exec "$0" "$@"`, bin}, args...)...)
}

// startBridge starts companion-bridge with the cluster's devices, spool and
// simulator state, and waits until the server sees every device online.
func (c *procCluster) startBridge() {
	c.tb.Helper()
	c.launchBridge()
	for _, id := range c.devices {
		testenv.Eventually(c.tb, 20*time.Second, id+" online", func() bool {
			if !c.bridgeProc.running() {
				c.tb.Fatalf("companion-bridge exited: %v", c.bridgeProc.waitErr)
			}
			r := c.user.do("GET", "/api/v1/devices/"+id+"/status", nil)
			return r.Status == 200 && r.JSON(c.tb)["online"] == true
		})
	}
}

func (c *procCluster) launchBridge() {
	c.tb.Helper()
	args := append([]string{
		"--mqtt-url", c.brokerURL(), "--api-url", c.base(),
		"--bridge-id", cmp.Or(c.bridgeID, "bridge-1"), "--bridge-secret", c.bridgeSecret,
		"--data", c.bridgeData, "--sim-state", c.simState,
		"--sim-devices", strings.Join(c.devices, ","), "--log-level", "warn",
	}, c.bridgeArgs...)
	c.bridgeProc = c.startProc("companion-bridge", c.bridge, args...)
	c.bridgeLogs = append(c.bridgeLogs, c.bridgeProc.logPath)
}

// executions reads the simulator's execution logs: command id → count.
func (c *procCluster) executions() map[string]int {
	c.tb.Helper()
	all := map[string]int{}
	for _, id := range c.devices {
		counts, err := sim.ReadExecLog(sim.ExecLogPath(c.simState, id))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		require.NoError(c.tb, err)
		for cmd, n := range counts {
			all[cmd] += n
		}
	}
	return all
}

// checkExactlyOnce checks that every accepted command succeeded and that the
// devices executed each exactly once, and nothing else.
func (c *procCluster) checkExactlyOnce(accepted map[string]string) {
	c.tb.Helper()
	c.checkRunOnce(accepted, false)
}

// checkRunOnce is checkExactlyOnce that, with unanswered set, also lets
// the devices run commands that were never answered (a server killed
// between its commit and its 202), each once.
func (c *procCluster) checkRunOnce(accepted map[string]string, unanswered bool) {
	t := c.tb
	t.Helper()
	for id, dev := range accepted {
		final := c.user.waitFinal(dev, id)
		assert.Equal(t, "succeeded", final["state"], "command %s: %v", id, final)
	}
	exec := c.executions()
	twice, missing := 0, 0
	for id := range accepted {
		switch n := exec[id]; {
		case n == 0:
			missing++
		case n > 1:
			twice++
			t.Errorf("command %s executed %d times", id, n)
		}
	}
	assert.Zero(t, missing, "accepted commands the devices never executed")
	assert.Zero(t, twice, "commands executed more than once")
	for id, n := range exec {
		if _, ok := accepted[id]; !ok {
			switch {
			case !unanswered:
				t.Errorf("the devices executed %s, which was never accepted", id)
			case n > 1:
				t.Errorf("unanswered command %s executed %d times", id, n)
			}
		}
	}
	t.Logf("%d commands accepted, %d executed, each once", len(accepted), len(exec))
}

// procPush is one push/text request from a load goroutine: it never calls
// into testing (it may run off the test goroutine).
type procPush struct {
	status int
	body   []byte
	err    error // transport error: no complete answer
}

func (c *procCluster) push(hc *http.Client, dev string, n int) procPush {
	return c.pushTo(hc, c.base(), dev, n)
}

// pushTo is push to the server at base (one replica of several).
func (c *procCluster) pushTo(hc *http.Client, base, dev string, n int) procPush {
	body, _ := json.Marshal(map[string]any{"text": fmt.Sprintf("message %d", n)})
	req, err := http.NewRequest("POST", base+"/api/v1/devices/"+dev+"/push/text", bytes.NewReader(body))
	if err != nil {
		return procPush{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+c.user.token)
	resp, err := hc.Do(req)
	if err != nil {
		return procPush{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return procPush{status: resp.StatusCode, body: b, err: err}
}

// acceptedID returns the id of a complete 202 answer, or "".
func (p procPush) acceptedID() string {
	if p.err != nil || p.status != 202 {
		return ""
	}
	var cmd struct{ ID string }
	if json.Unmarshal(p.body, &cmd) != nil {
		return ""
	}
	return cmd.ID
}

func loadClient(workers int) *http.Client {
	return &http.Client{
		Timeout:   30 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: workers, DisableCompression: true},
	}
}

// burst pushes n texts spread over the devices from workers goroutines and
// returns the accepted ids (id → device). Every request must get a 202.
func (c *procCluster) burst(n, workers int) map[string]string {
	t := c.tb
	t.Helper()
	hc := loadClient(workers)
	defer hc.CloseIdleConnections()
	var (
		mu       sync.Mutex
		accepted = map[string]string{}
		bad      []string
		next     atomic.Int64
		wg       sync.WaitGroup
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				dev := c.devices[i%len(c.devices)]
				p := c.push(hc, dev, i)
				mu.Lock()
				if id := p.acceptedID(); id != "" {
					accepted[id] = dev
				} else {
					bad = append(bad, fmt.Sprintf("%d %v %s", p.status, p.err, p.body))
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.Empty(t, bad, "requests of the burst not accepted")
	require.Len(t, accepted, n)
	return accepted
}

// Fault 1: the server is killed (SIGKILL) the instant it has answered 202 to
// a burst of commands. After a restart on the same data every accepted
// command is there and succeeds, each executed once by its device.
func TestProcessServerKilledAfterAccepting(t *testing.T) {
	c := newProcCluster(t, 5)
	c.startServer()
	c.setupFleet()
	c.startBridge()

	accepted := c.burst(200, 16)
	c.server.kill() // the last 202 has just arrived
	executedAtKill := len(c.executions())
	t.Logf("server killed after 200 accepted; %d executed by then", executedAtKill)

	c.startServer()
	for id, dev := range accepted {
		r := c.user.do("GET", "/api/v1/devices/"+dev+"/commands/"+id, nil)
		require.Equal(t, 200, r.Status, "accepted command %s lost: %s", id, r.Body)
	}
	c.checkExactlyOnce(accepted)
}

// Fault 2: the bridge is killed (SIGKILL) while it is executing a burst of
// commands, and restarted on the same spool and the same device state.
// Every command succeeds and each is executed exactly once.
func TestProcessBridgeKilledMidBurst(t *testing.T) {
	c := newProcCluster(t, 5)
	// A slow, small-MTU link: each command spends a while on the link, so
	// the kill finds commands half-done.
	c.bridgeArgs = []string{"--sim-mtu", "23", "--sim-kbps", "20"}
	c.startServer()
	c.setupFleet()
	c.startBridge()

	const n = 200
	done := make(chan map[string]string, 1)
	go func() {
		// burst calls require only after its goroutines are done; a failure
		// there is reported from this goroutine, which is allowed for Errorf
		// but not FailNow, so it checks by hand.
		hc := loadClient(8)
		defer hc.CloseIdleConnections()
		acc := map[string]string{}
		for i := range n {
			dev := c.devices[i%len(c.devices)]
			p := c.push(hc, dev, i)
			if id := p.acceptedID(); id != "" {
				acc[id] = dev
			} else {
				t.Errorf("push %d: %d %v %s", i, p.status, p.err, p.body)
			}
		}
		done <- acc
	}()

	testenv.Eventually(t, 30*time.Second, "a quarter of the commands executed", func() bool { return len(c.executions()) >= n/4 })
	c.bridgeProc.kill()
	executedAtKill := len(c.executions())
	t.Logf("bridge killed with %d of %d commands executed", executedAtKill, n)
	require.Less(t, executedAtKill, n, "the burst was over before the kill")

	c.startBridge()
	accepted := <-done
	require.Len(t, accepted, n)
	c.checkExactlyOnce(accepted)
}

// Fault 9: SIGTERM while many clients push. Every request that got an answer
// got a complete one (a 202 with its command; the others fail to connect or
// see the connection closed before any answer); the process exits 0; the
// store it leaves passes bbolt's consistency check and holds exactly the
// accepted commands; the next start serves them all to succeeded.
func TestProcessGracefulShutdownUnderLoad(t *testing.T) {
	c := newProcCluster(t, 5)
	c.startServer()
	c.setupFleet()
	c.startBridge()

	const workers = 24
	hc := loadClient(workers)
	defer hc.CloseIdleConnections()
	var (
		mu       sync.Mutex
		results  []procPush
		accepted atomic.Int64
		stop     = make(chan struct{})
		wg       sync.WaitGroup
		seq      atomic.Int64
	)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := c.devices[w%len(c.devices)]
			for {
				select {
				case <-stop:
					return
				default:
				}
				p := c.push(hc, dev, int(seq.Add(1)))
				mu.Lock()
				results = append(results, p)
				mu.Unlock()
				if p.acceptedID() != "" {
					accepted.Add(1)
				}
				if p.err != nil {
					// The server is going away: the refused connection is
					// the answer to the rest.
					var op *net.OpError
					if errors.As(p.err, &op) && op.Op == "dial" {
						return
					}
				}
			}
		}()
	}

	testenv.Eventually(t, 20*time.Second, "100 commands accepted under load", func() bool { return accepted.Load() >= 100 })
	termAt := time.Now()
	require.NoError(t, c.server.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-c.server.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("companion did not exit within 20 s of SIGTERM")
	}
	t.Logf("companion exited %v after SIGTERM", time.Since(termAt).Round(time.Millisecond))
	close(stop)
	wg.Wait()
	assert.NoError(t, c.server.waitErr, "exit status after SIGTERM")

	acc := map[string]string{}
	connErrs := 0
	for _, p := range results {
		switch {
		case p.err != nil:
			connErrs++
		case p.status == 202:
			id := p.acceptedID()
			require.NotEmpty(t, id, "a 202 without a complete command: %q", p.body)
			var cmd struct {
				DeviceID string `json:"device_id"`
			}
			require.NoError(t, json.Unmarshal(p.body, &cmd))
			acc[id] = cmd.DeviceID
		default:
			t.Errorf("an answer other than 202 during shutdown: %d %s", p.status, p.body)
		}
	}
	t.Logf("%d requests: %d accepted, %d without an answer (connection refused or closed)", len(results), len(acc), connErrs)

	// Nothing half-written: the file the server left is consistent.
	db, err := bolt.Open(filepath.Join(c.data, "companion.db"), 0o600, &bolt.Options{Timeout: time.Second, ReadOnly: true})
	require.NoError(t, err)
	require.NoError(t, db.View(func(tx *bolt.Tx) error {
		for err := range tx.Check() {
			return err
		}
		return nil
	}))
	require.NoError(t, db.Close())

	c.startServer()
	stored := 0
	for _, dev := range c.devices {
		cursor := ""
		for {
			r := c.user.do("GET", "/api/v1/devices/"+dev+"/commands?limit=200&cursor="+cursor, nil)
			require.Equal(t, 200, r.Status, "%s", r.Body)
			var page struct {
				Commands []struct {
					ID string `json:"id"`
				} `json:"commands"`
				NextCursor string `json:"next_cursor"`
			}
			require.NoError(t, json.Unmarshal(r.Body, &page))
			for _, cmd := range page.Commands {
				stored++
				_, ok := acc[cmd.ID]
				assert.True(t, ok, "command %s is stored but its client never got a 202", cmd.ID)
			}
			if page.NextCursor == "" {
				break
			}
			cursor = page.NextCursor
		}
	}
	assert.Equal(t, len(acc), stored, "stored commands = accepted commands")
	c.checkExactlyOnce(acc)
}

// A bridge started again (SIGTERM, then SIGKILL) finds its simulated
// devices as it left them, as a real device is across restarts of its
// bridge: the firmware an OTA installed, the apps, the settings. Before,
// they came back on their first firmware with no apps and default
// settings, and reported so, while the commands that changed them read
// succeeded.
func TestProcessBridgeRestartKeepsTheDevicesState(t *testing.T) {
	c := newProcCluster(t, 1)
	c.startServer()
	c.setupFleet()
	admin := &client{tb: t, base: c.base(), token: c.adminToken}
	r := admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.1.0", firmwareImage(t, "1.1.0", 16<<10))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = admin.do("PUT", "/api/v1/admin/apps/weather/1.0.0", bytes.Repeat([]byte("app"), 1000))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	c.startBridge()
	dev, u := c.devices[0], c.user
	for _, req := range []struct {
		method, path string
		body         any
	}{
		{"POST", "/ota/update", map[string]any{}},
		{"POST", "/apps/install", map[string]any{"app_id": "weather"}},
		{"PUT", "/settings", map[string]any{"volume": 7, "language": "fr"}},
	} {
		r := u.do(req.method, "/api/v1/devices/"+dev+req.path, req.body)
		require.Equal(t, 202, r.Status, "%s", r.Body)
		cmd := u.waitFinal(dev, r.JSON(t)["id"].(string))
		require.Equal(t, "succeeded", cmd["state"], "%s %s: %v", req.method, req.path, cmd)
	}
	check := func(when string) {
		t.Helper()
		st := u.do("GET", "/api/v1/devices/"+dev+"/status", nil).JSON(t)
		assert.Equal(t, "1.1.0", st["firmware_version"], "%s: status %v", when, st)
		apps := u.do("GET", "/api/v1/devices/"+dev+"/apps", nil)
		assert.JSONEq(t, `{"apps":[{"app_id":"weather","version":"1.0.0"}]}`, string(apps.Body), "%s: apps", when)
		s := u.do("GET", "/api/v1/devices/"+dev+"/settings", nil).JSON(t)["reported"].(map[string]any)
		assert.Equal(t, []any{float64(7), "fr"}, []any{s["volume"], s["language"]}, "%s: reported settings %v", when, s)
	}
	check("before the restarts")

	for _, kill := range []bool{false, true} {
		t.Logf("stopping the bridge, killed: %v", kill)
		if kill {
			c.bridgeProc.kill()
		} else {
			c.bridgeProc.stop()
		}
		waitOnlineProc(t, c, dev, false)
		// A report from before the stop would do: the device's state is
		// read from the bridge started again, through a status and a
		// settings report newer than the stop.
		stopped := time.Now()
		c.startBridge()
		testenv.Eventually(t, 20*time.Second, "a status and settings reported after the restart", func() bool {
			st := u.do("GET", "/api/v1/devices/"+dev+"/status", nil).JSON(t)
			seen, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(st["last_seen"]))
			return seen.After(stopped)
		})
		check("after a restart")
	}
}

// waitOnlineProc waits until the device reads online or offline.
func waitOnlineProc(t *testing.T, c *procCluster, dev string, online bool) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("%s online=%v", dev, online), func() bool {
		r := c.user.do("GET", "/api/v1/devices/"+dev+"/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == online
	})
}
