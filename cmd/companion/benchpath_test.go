package main

// BenchmarkCommandPath measures the command path the way a user meets it and
// compares it, in the same run on the same machine, with the bare forwarder
// it is built on (benchbare_test.go). It prints CONTRACT §12's line:
//
//	bench: e2e_cps=N baseline_e2e_cps=N vs_baseline=R accept_rps=N baseline_accept_rps=N accept_p99_ms=N
//
// The project's path is the real binaries as a user runs them: `companion
// serve` on its embedded broker and bbolt, and `companion-bridge
// --sim-devices` with the simulator's defaults. The load is HTTP from this
// process on loopback: end to end, clients that each POST a text push with
// Prefer: wait=60 and send the next once it is answered; accepting, clients
// that POST without waiting. Each client has devices of its own, so that no
// two requests queue behind each other on one device.
//
// Knobs (environment): BENCH_DEVICES (200), BENCH_E2E_CLIENTS (64),
// BENCH_ACCEPT_CLIENTS (32), BENCH_SECONDS per phase (10), BENCH_PROFILE_DIR
// (when set, CPU profiles of the project's server and bridge under the end
// to end load, and their counters, are written there).

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/mqtttest"
)

type benchConfig struct {
	devices, e2eClients, acceptClients int
	phase                              time.Duration
	profileDir                         string
}

func benchConfigFromEnv(tb testing.TB) benchConfig {
	tb.Helper()
	num := func(name string, def int) int {
		v := os.Getenv(name)
		if v == "" {
			return def
		}
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			tb.Fatalf("%s=%q: want a positive number", name, v)
		}
		return n
	}
	return benchConfig{
		devices:       num("BENCH_DEVICES", 200),
		e2eClients:    num("BENCH_E2E_CLIENTS", 64),
		acceptClients: num("BENCH_ACCEPT_CLIENTS", 32),
		phase:         time.Duration(num("BENCH_SECONDS", 10)) * time.Second,
		profileDir:    os.Getenv("BENCH_PROFILE_DIR"),
	}
}

// pathTarget is one command path under load: its HTTP base, the token and
// the devices to push to.
type pathTarget struct {
	name    string
	base    string
	token   string
	devices []string
	// drain waits until every command accepted so far is final; last holds
	// the last command id accepted per device.
	drain func(last map[string]string) error
	// profile, when set, records CPU profiles and counters of the target's
	// processes while run goes.
	profile func(dir string, d time.Duration, run func()) error
	// procs are the target's processes, for their CPU time.
	procs map[string]*osProc
}

// loadResult is what one phase of load measured.
type loadResult struct {
	done     int
	elapsed  time.Duration
	lat      []time.Duration // sorted
	errs     int
	firstErr string
	last     map[string]string // device → last command id accepted
}

func (r loadResult) rate() float64 { return float64(r.done) / r.elapsed.Seconds() }

func (r loadResult) pct(p float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	return r.lat[min(len(r.lat)-1, int(float64(len(r.lat))*p))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// runLoad has clients POST text pushes to t for d. Client i pushes to the
// devices i, i+clients, i+2·clients, … in turn. With wait, each request
// holds its answer until the command is final (200); otherwise it is
// answered once accepted (202).
func runLoad(t pathTarget, clients int, d time.Duration, wait bool) loadResult {
	tr := &http.Transport{MaxIdleConnsPerHost: clients, DisableCompression: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 90 * time.Second}
	want := http.StatusAccepted
	if wait {
		want = http.StatusOK
	}
	body := []byte(`{"text":"bench"}`)
	var (
		mu  sync.Mutex
		res = loadResult{last: map[string]string{}}
		wg  sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(d)
	for i := range clients {
		var mine []string
		for j := i; j < len(t.devices); j += clients {
			mine = append(mine, t.devices[j])
		}
		if len(mine) == 0 {
			mine = []string{t.devices[i%len(t.devices)]}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			last := map[string]string{}
			errs, firstErr := 0, ""
			for n := 0; time.Now().Before(deadline); n++ {
				dev := mine[n%len(mine)]
				req, _ := http.NewRequest("POST", t.base+"/api/v1/devices/"+dev+"/push/text", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer "+t.token)
				if wait {
					req.Header.Set("Prefer", "wait=60")
				}
				t0 := time.Now()
				resp, err := hc.Do(req)
				if err != nil {
					errs++
					if firstErr == "" {
						firstErr = err.Error()
					}
					continue
				}
				var cmd struct {
					ID string `json:"id"`
				}
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != want || json.Unmarshal(raw, &cmd) != nil {
					errs++
					if firstErr == "" {
						firstErr = fmt.Sprintf("%d %s", resp.StatusCode, raw)
					}
					continue
				}
				lat = append(lat, time.Since(t0))
				last[dev] = cmd.ID
			}
			mu.Lock()
			res.lat = append(res.lat, lat...)
			res.errs += errs
			if res.firstErr == "" {
				res.firstErr = firstErr
			}
			for k, v := range last {
				res.last[k] = v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.done = len(res.lat)
	slices.Sort(res.lat)
	return res
}

// pathFigures are one target's figures.
type pathFigures struct {
	e2e, accept loadResult
	e2eCPU      map[string]time.Duration // CPU time of each process (and the load) in the end-to-end phase
}

// cpuTimes reads the CPU time (user and system) of each process so far,
// and of this one as "load".
func cpuTimes(procs map[string]*osProc) map[string]time.Duration {
	out := map[string]time.Duration{}
	for name, p := range procs {
		out[name] = procCPU(p.cmd.Process.Pid)
	}
	out["load"] = procCPU(os.Getpid())
	return out
}

// procCPU reads utime and stime of a process from /proc (clock ticks of
// 1/100 s on Linux).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command name, which is in parentheses.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

func measurePath(b *testing.B, cfg benchConfig, t pathTarget) pathFigures {
	b.Helper()
	runLoad(t, cfg.e2eClients, 2*time.Second, true) // warm up: connections, pages, caches
	var f pathFigures
	e2e := func() {
		before := cpuTimes(t.procs)
		f.e2e = runLoad(t, cfg.e2eClients, cfg.phase, true)
		after := cpuTimes(t.procs)
		f.e2eCPU = map[string]time.Duration{}
		for name, d := range after {
			f.e2eCPU[name] = d - before[name]
		}
	}
	if cfg.profileDir != "" && t.profile != nil {
		if err := t.profile(cfg.profileDir, cfg.phase, e2e); err != nil {
			b.Fatalf("%s: profile: %v", t.name, err)
		}
	} else {
		e2e()
	}
	f.accept = runLoad(t, cfg.acceptClients, cfg.phase, false)
	drainStart := time.Now()
	if err := t.drain(f.accept.last); err != nil {
		b.Fatalf("%s: drain after accepting: %v", t.name, err)
	}
	for _, r := range []struct {
		name string
		res  loadResult
	}{{"e2e", f.e2e}, {"accept", f.accept}} {
		if r.res.errs > 0 {
			b.Errorf("%s %s: %d failed requests, the first: %s", t.name, r.name, r.res.errs, r.res.firstErr)
		}
	}
	fmt.Printf("%-8s e2e: %6.0f commands/s (%d clients, p50 %.1f ms, p99 %.1f ms)  accept: %6.0f/s (%d clients, p50 %.1f ms, p99 %.1f ms); backlog of %d drained in %s\n",
		t.name, f.e2e.rate(), cfg.e2eClients, ms(f.e2e.pct(0.5)), ms(f.e2e.pct(0.99)),
		f.accept.rate(), cfg.acceptClients, ms(f.accept.pct(0.5)), ms(f.accept.pct(0.99)),
		f.accept.done, time.Since(drainStart).Round(time.Millisecond))
	var cpu []string
	for _, name := range slices.Sorted(maps.Keys(f.e2eCPU)) {
		cpu = append(cpu, fmt.Sprintf("%s %.3f", name, ms(f.e2eCPU[name])/float64(max(f.e2e.done, 1))))
	}
	fmt.Printf("%-8s e2e CPU ms per command: %s\n", t.name, strings.Join(cpu, ", "))
	return f
}

// BenchmarkCommandPath prints the bench line of CONTRACT §12. Run it alone
// and once: go test -run '^$' -bench '^BenchmarkCommandPath$' -benchtime 1x ./cmd/companion
func BenchmarkCommandPath(b *testing.B) {
	cfg := benchConfigFromEnv(b)
	for range b.N {
		bare := measurePath(b, cfg, startBarePath(b, cfg))
		proj := measurePath(b, cfg, startProjectPath(b, cfg))
		fmt.Printf("bench: e2e_cps=%.0f baseline_e2e_cps=%.0f vs_baseline=%.2f accept_rps=%.0f baseline_accept_rps=%.0f accept_p99_ms=%.1f\n",
			proj.e2e.rate(), bare.e2e.rate(), proj.e2e.rate()/bare.e2e.rate(),
			proj.accept.rate(), bare.accept.rate(), ms(proj.accept.pct(0.99)))
	}
}

func benchDevices(n int) []string {
	devs := make([]string, n)
	for i := range devs {
		devs[i] = fmt.Sprintf("dev-%d", i+1)
	}
	return devs
}

// startBarePath runs the bare forwarder's server and bridge as processes.
func startBarePath(b *testing.B, cfg benchConfig) pathTarget {
	b.Helper()
	httpAddr := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	mqttAddr := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	env := append(procEnv(), "BENCH_HTTP="+httpAddr, "BENCH_MQTT="+mqttAddr)
	startRole := func(role string) *osProc {
		return startProcEnv(b, role, self, append(env, benchRoleEnv+"="+role))
	}
	server := startRole("bare-server")
	waitHTTP(b, server, "http://"+httpAddr+"/readyz")
	bridge := startRole("bare-bridge")
	base := "http://" + httpAddr
	t := pathTarget{name: "bare", base: base, devices: benchDevices(cfg.devices),
		procs: map[string]*osProc{"server": server, "bridge": bridge}}
	// The bridge is up once a command comes back.
	eventually(b, "the bare bridge", func() bool {
		req, _ := http.NewRequest("POST", base+"/api/v1/devices/dev-1/push/text", strings.NewReader(`{"text":"up?"}`))
		req.Header.Set("Prefer", "wait=1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		discard(resp)
		return resp.StatusCode == http.StatusOK
	})
	t.drain = func(map[string]string) error {
		deadline := time.Now().Add(5 * time.Minute)
		for time.Now().Before(deadline) {
			resp, err := http.Get(base + "/bench/open")
			if err != nil {
				return err
			}
			var v struct{ Open int }
			err = json.NewDecoder(resp.Body).Decode(&v)
			discard(resp)
			if err != nil {
				return err
			}
			if v.Open == 0 {
				return nil
			}
			time.Sleep(50 * time.Millisecond) // polling another process
		}
		return fmt.Errorf("commands still open after 5 minutes")
	}
	return t
}

// startProjectPath runs `companion serve` and `companion-bridge
// --sim-devices` as a user does, each with --pprof, and registers the
// devices to a user.
func startProjectPath(b *testing.B, cfg benchConfig) pathTarget {
	b.Helper()
	c := newProcCluster(b, cfg.devices)
	serverPProf := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	bridgePProf := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	c.serverArgs = []string{"--pprof", serverPProf, "--register-per-minute", "0"}
	c.startServer()
	c.setupFleet()
	// The bridge as it runs by default: no --sim-state.
	c.bridgeArgs = []string{"--pprof", bridgePProf}
	c.simState = ""
	c.startBridge()
	t := pathTarget{name: "project", base: c.base(), token: c.user.token, devices: c.devices,
		procs: map[string]*osProc{"server": c.server, "bridge": c.bridgeProc}}
	t.drain = func(last map[string]string) error {
		for dev, id := range last {
			deadline := time.Now().Add(5 * time.Minute)
			for {
				if time.Now().After(deadline) {
					return fmt.Errorf("command %s of %s not final after 5 minutes", id, dev)
				}
				r := c.user.do("GET", "/api/v1/devices/"+dev+"/commands/"+id, nil, "Prefer", "wait=60")
				if r.Status == 200 && r.Header.Get("Preference-Applied") != "" {
					break
				}
			}
		}
		return nil
	}
	t.profile = func(dir string, d time.Duration, run func()) error {
		return profileProcs(dir, d, map[string]string{"server": serverPProf, "bridge": bridgePProf}, run)
	}
	return t
}

// profileProcs runs run while it takes a CPU profile of each process (by
// its pprof address) over the middle of the phase, and writes the profiles
// and the processes' expvar counters before and after run into dir.
func profileProcs(dir string, d time.Duration, procs map[string]string, run func()) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	vars := func(suffix string) error {
		for name, addr := range procs {
			if err := fetchTo("http://"+addr+"/debug/vars", filepath.Join(dir, name+"-vars-"+suffix+".json")); err != nil {
				return err
			}
		}
		return nil
	}
	if err := vars("before"); err != nil {
		return err
	}
	secs := max(1, int((d-2*time.Second)/time.Second))
	var wg sync.WaitGroup
	errs := make(chan error, len(procs))
	for name, addr := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Second) // past the phase's start
			errs <- fetchTo(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, secs), filepath.Join(dir, name+".pprof"))
		}()
	}
	run()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	if err := vars("after"); err != nil {
		return err
	}
	for name, addr := range procs {
		// Allocations since the process started, by where they were made.
		if err := fetchTo("http://"+addr+"/debug/pprof/allocs", filepath.Join(dir, name+"-allocs.pprof")); err != nil {
			return err
		}
	}
	for name := range procs {
		before, err1 := readCounters(filepath.Join(dir, name+"-vars-before.json"))
		after, err2 := readCounters(filepath.Join(dir, name+"-vars-after.json"))
		if err := errors.Join(err1, err2); err != nil {
			return err
		}
		var out []string
		for _, k := range slices.Sorted(maps.Keys(after)) {
			out = append(out, fmt.Sprintf("%s=%d", k, after[k]-before[k]))
		}
		fmt.Printf("profile  %s counters over the phase: %s\n", name, strings.Join(out, " "))
	}
	return nil
}

// readCounters reads the counters worth a per-command figure from a
// /debug/vars document: allocations, and the store's, spool's and MQTT
// broker's counters where the process publishes them.
func readCounters(path string) (map[string]int64, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var v map[string]json.RawMessage
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	out := map[string]int64{}
	pick := func(group string, keys ...string) {
		var g map[string]any
		if json.Unmarshal(v[group], &g) != nil {
			return
		}
		for _, k := range keys {
			if n, ok := g[k].(float64); ok {
				out[group+"."+k] = int64(n)
			}
		}
	}
	pick("memstats", "Mallocs", "NumGC")
	pick("store", "commits", "writes")
	pick("spool", "commits", "writes")
	pick("mqtt", "messages_received", "messages_sent")
	return out, nil
}

func fetchTo(url, path string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func waitHTTP(tb testing.TB, p *osProc, url string) {
	tb.Helper()
	eventually(tb, url, func() bool {
		if !p.running() {
			tb.Fatalf("%s exited: %v", p.name, p.waitErr)
		}
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		discard(resp)
		return resp.StatusCode == 200
	})
}
