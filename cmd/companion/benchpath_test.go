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
// process on loopback, text pushes:
//
//   - end to end (e2e_cps): clients that each POST with Prefer: wait=60 and
//     send the next once the command is final. Each client has devices of
//     its own, so that no two requests queue behind each other on one
//     device. There are as many clients as devices (200): by Little's law
//     a path whose every command crosses a simulated Bluetooth round trip
//     (15 ms at the simulator's default 7.5 ms each way) could never pass
//     64/0.015 ≈ 4,300 commands/s with 64 clients, however cheap the rest.
//   - accepting (accept_rps, accept_p99_ms): clients that POST without
//     waiting, each answered 202 once the command is on disk, to devices
//     that are registered but that no bridge serves ("parked"): the
//     figure is the server's intake alone, as a burst for a fleet whose
//     bridges are offline meets it. (With the bridges serving them, the
//     commands would also be run, and the figure would be the end-to-end
//     capacity again.)
//
// A third path runs beside them unless BENCH_BARE_SYNC=0: "durable", the
// bare forwarder with one change, each command appended to a log file and
// fdatasynced before it is published (benchbare_test.go, bareLogDirEnv).
// It keeps the promise of CONTRACT §7 that issue 8's baseline does not (a
// 202 means "on disk") and does nothing else the project does, so it says
// what that promise alone costs on this machine. Its figures are printed
// in a line of their own before the bench line:
//
//	durable: e2e_cps=N accept_rps=N accept_p99_ms=N vs_bare e2e=R accept=R project_vs_durable e2e=R accept=R
//
// All paths run at once and are measured in turn, in rounds of alternating
// order (bare, project, durable, then durable, project, bare, …), and each
// figure is over all rounds, so that a drift of this noisy machine weighs
// on all alike.
//
// Knobs (environment): BENCH_DEVICES (200), BENCH_E2E_CLIENTS (200),
// BENCH_ACCEPT_CLIENTS (32), BENCH_SECONDS per phase (10), BENCH_ROUNDS (2),
// BENCH_PROFILE_DIR (when set, CPU profiles of the project's server and
// bridge under each load of the first round, with their counters and
// allocations, are written to its e2e/ and accept/), BENCH_BARE_SYNC (0
// leaves the durable path out).

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
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
)

type benchConfig struct {
	devices, e2eClients, acceptClients, rounds int
	phase                                      time.Duration
	profileDir                                 string
	durable                                    bool // run the durable bare path too
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
		e2eClients:    num("BENCH_E2E_CLIENTS", 200),
		acceptClients: num("BENCH_ACCEPT_CLIENTS", 32),
		rounds:        num("BENCH_ROUNDS", 2),
		phase:         time.Duration(num("BENCH_SECONDS", 10)) * time.Second,
		profileDir:    os.Getenv("BENCH_PROFILE_DIR"),
		durable:       os.Getenv("BENCH_BARE_SYNC") != "0",
	}
}

// pathTarget is one command path under load.
type pathTarget struct {
	name    string
	base    string
	token   string
	devices []string // served by the path's bridge
	parked  []string // registered, served by no bridge
	procs   map[string]*osProc
	// profile, when set, records CPU profiles and counters of the target's
	// processes while run goes.
	profile func(dir string, d time.Duration, run func()) error
}

// loadResult is what one phase of load measured.
type loadResult struct {
	done     int
	elapsed  time.Duration
	lat      []time.Duration // sorted
	errs     int
	firstErr string
	cpu      map[string]time.Duration // CPU time of each process, and of the load, over the phase
	// idle and steal are the machine's, summed over its cores: time no
	// process ran, and time the hypervisor gave this machine's cores to
	// another (a noisy neighbour), over the phase.
	idle, steal time.Duration
	// segs splits each waited command's time: request to stored, stored to
	// final, final to answer (bare: only the total is known).
	segs [][3]time.Duration
}

// segments formats the medians of segs.
func (r loadResult) segments() string {
	if len(r.segs) == 0 {
		return ""
	}
	var out []string
	for i, name := range []string{"to stored", "stored to final", "final to answer"} {
		v := make([]time.Duration, len(r.segs))
		for j, s := range r.segs {
			v[j] = s[i]
		}
		slices.Sort(v)
		out = append(out, fmt.Sprintf("%s %.1f", name, ms(v[len(v)/2])))
	}
	return "; median ms " + strings.Join(out, ", ")
}

func (r loadResult) rate() float64 { return float64(r.done) / r.elapsed.Seconds() }

func (r loadResult) pct(p float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	return r.lat[min(len(r.lat)-1, int(float64(len(r.lat))*p))]
}

// add merges another round's result of the same phase into r.
func (r *loadResult) add(o loadResult) {
	r.done += o.done
	r.elapsed += o.elapsed
	r.lat = append(r.lat, o.lat...)
	slices.Sort(r.lat)
	r.segs = append(r.segs, o.segs...)
	r.errs += o.errs
	if r.firstErr == "" {
		r.firstErr = o.firstErr
	}
	if r.cpu == nil {
		r.cpu = map[string]time.Duration{}
	}
	for k, v := range o.cpu {
		r.cpu[k] += v
	}
	r.idle += o.idle
	r.steal += o.steal
}

// machine formats the machine's idle and stolen shares of the phase.
func (r loadResult) machine() string {
	all := float64(r.elapsed) * float64(runtime.NumCPU())
	return fmt.Sprintf("idle %.0f%%, steal %.0f%%", 100*float64(r.idle)/all, 100*float64(r.steal)/all)
}

// cpuPerCommand formats the CPU time per command of each process.
func (r loadResult) cpuPerCommand() string {
	var out []string
	for _, name := range slices.Sorted(maps.Keys(r.cpu)) {
		out = append(out, fmt.Sprintf("%s %.3f", name, ms(r.cpu[name])/float64(max(r.done, 1))))
	}
	return strings.Join(out, ", ")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// runLoad has clients POST text pushes to devs for d, as token, spread
// round-robin over bases: client i pushes to the devices i, i+clients,
// i+2·clients, … in turn, its k-th request to bases[(i+k) mod len(bases)].
// With wait, each request holds its answer until the command is final
// (200); otherwise it is answered once accepted (202). The result's cpu is
// left to the caller, who knows the processes.
func runLoad(bases []string, token string, devs []string, clients int, d time.Duration, wait bool) loadResult {
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
		res loadResult
		wg  sync.WaitGroup
	)
	start := time.Now()
	deadline := start.Add(d)
	for i := range clients {
		var mine []string
		for j := i; j < len(devs); j += clients {
			mine = append(mine, devs[j])
		}
		if len(mine) == 0 {
			mine = []string{devs[i%len(devs)]}
		}
		wg.Go(func() {
			var lat []time.Duration
			var segs [][3]time.Duration
			errs, firstErr := 0, ""
			for k := 0; time.Now().Before(deadline); k++ {
				base := bases[(i+k)%len(bases)]
				req, _ := http.NewRequest("POST", base+"/api/v1/devices/"+mine[k%len(mine)]+"/push/text", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer "+token)
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
					ID        string    `json:"id"`
					CreatedAt time.Time `json:"created_at"`
					UpdatedAt time.Time `json:"updated_at"`
				}
				raw, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != want || json.Unmarshal(raw, &cmd) != nil || cmd.ID == "" {
					errs++
					if firstErr == "" {
						firstErr = fmt.Sprintf("%s: %d %s", base, resp.StatusCode, raw)
					}
					continue
				}
				t1 := time.Now()
				lat = append(lat, t1.Sub(t0))
				if wait && !cmd.CreatedAt.IsZero() {
					// Where the time went, by the server's clock (the same
					// machine's): until the command was stored, until its
					// final state was, and until the answer arrived.
					segs = append(segs, [3]time.Duration{cmd.CreatedAt.Sub(t0), cmd.UpdatedAt.Sub(cmd.CreatedAt), t1.Sub(cmd.UpdatedAt)})
				}
			}
			mu.Lock()
			res.lat = append(res.lat, lat...)
			res.segs = append(res.segs, segs...)
			res.errs += errs
			if res.firstErr == "" {
				res.firstErr = firstErr
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.done = len(res.lat)
	slices.Sort(res.lat)
	return res
}

// load runs runLoad on t and measures the CPU time of t's processes, and
// of this one, over it.
func (t pathTarget) load(devs []string, clients int, d time.Duration, wait bool) loadResult {
	before := cpuTimes(t.procs)
	idle, steal := machineTimes()
	res := runLoad([]string{t.base}, t.token, devs, clients, d, wait)
	after := cpuTimes(t.procs)
	idle2, steal2 := machineTimes()
	res.idle, res.steal = idle2-idle, steal2-steal
	res.cpu = map[string]time.Duration{}
	for name, d := range after {
		res.cpu[name] = d - before[name]
	}
	return res
}

// pathFigures are one target's figures.
type pathFigures struct {
	e2e, accept loadResult
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

// machineTimes reads the idle (with I/O wait) and stolen time of all the
// machine's cores so far, from the first line of /proc/stat (clock ticks
// of 1/100 s).
func machineTimes() (idle, steal time.Duration) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal …
	if len(f) < 9 {
		return 0, 0
	}
	tick := func(i int) time.Duration {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		return time.Duration(n) * 10 * time.Millisecond
	}
	return tick(4) + tick(5), tick(8)
}

// measurePath runs one round of load on t: a warm-up, the end-to-end phase
// (under the profiler when asked) and the accepting phase.
func measurePath(b *testing.B, cfg benchConfig, t pathTarget, profile bool) pathFigures {
	b.Helper()
	t.load(t.devices, cfg.e2eClients, 2*time.Second, true) // warm up: connections, pages, caches
	var f pathFigures
	phase := func(name string, run func()) {
		if !profile || t.profile == nil {
			run()
			return
		}
		if err := t.profile(filepath.Join(cfg.profileDir, name), cfg.phase, run); err != nil {
			b.Fatalf("%s: profile: %v", t.name, err)
		}
	}
	phase("e2e", func() { f.e2e = t.load(t.devices, cfg.e2eClients, cfg.phase, true) })
	phase("accept", func() { f.accept = t.load(t.parked, cfg.acceptClients, cfg.phase, false) })
	for _, r := range []struct {
		name string
		res  loadResult
	}{{"e2e", f.e2e}, {"accept", f.accept}} {
		if r.res.errs > 0 {
			b.Errorf("%s %s: %d failed requests, the first: %s", t.name, r.name, r.res.errs, r.res.firstErr)
		}
	}
	printFigures(t.name, cfg, f)
	return f
}

func printFigures(name string, cfg benchConfig, f pathFigures) {
	fmt.Printf("%-8s e2e: %6.0f commands/s (%d clients, p50 %.1f ms, p99 %.1f ms)  accept: %6.0f/s (%d clients, p50 %.1f ms, p99 %.1f ms)\n",
		name, f.e2e.rate(), cfg.e2eClients, ms(f.e2e.pct(0.5)), ms(f.e2e.pct(0.99)),
		f.accept.rate(), cfg.acceptClients, ms(f.accept.pct(0.5)), ms(f.accept.pct(0.99)))
	fmt.Printf("%-8s CPU ms per command: e2e %s; accept %s%s\n", name, f.e2e.cpuPerCommand(), f.accept.cpuPerCommand(), f.e2e.segments())
	fmt.Printf("%-8s machine: e2e %s; accept %s\n", name, f.e2e.machine(), f.accept.machine())
}

// BenchmarkCommandPath prints the bench line of CONTRACT §12. Run it alone
// and once: go test -run '^$' -bench '^BenchmarkCommandPath$' -benchtime 1x ./cmd/companion
func BenchmarkCommandPath(b *testing.B) {
	cfg := benchConfigFromEnv(b)
	for range b.N {
		targets := []pathTarget{startBarePath(b, cfg, false), startProjectPath(b, cfg)}
		if cfg.durable {
			targets = append(targets, startBarePath(b, cfg, true))
		}
		sum := make([]pathFigures, len(targets))
		for r := range cfg.rounds {
			fmt.Printf("round %d\n", r+1)
			order := make([]int, len(targets))
			for i := range order {
				order[i] = i
			}
			if r%2 == 1 {
				slices.Reverse(order)
			}
			for _, i := range order {
				f := measurePath(b, cfg, targets[i], r == 0 && cfg.profileDir != "")
				sum[i].e2e.add(f.e2e)
				sum[i].accept.add(f.accept)
			}
		}
		fmt.Printf("over %d rounds of %s per phase\n", cfg.rounds, cfg.phase)
		for i, t := range targets {
			printFigures(t.name, cfg, sum[i])
		}
		bare, proj := sum[0], sum[1]
		if cfg.durable {
			d := sum[2]
			fmt.Printf("durable: e2e_cps=%.0f accept_rps=%.0f accept_p99_ms=%.1f vs_bare e2e=%.2f accept=%.2f project_vs_durable e2e=%.2f accept=%.2f\n",
				d.e2e.rate(), d.accept.rate(), ms(d.accept.pct(0.99)),
				d.e2e.rate()/bare.e2e.rate(), d.accept.rate()/bare.accept.rate(),
				proj.e2e.rate()/d.e2e.rate(), proj.accept.rate()/d.accept.rate())
		}
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

// parkedDevices are the devices of the accepting load: twice as many as
// its clients, registered, served by no bridge.
func parkedDevices(cfg benchConfig) []string {
	devs := make([]string, 2*cfg.acceptClients)
	for i := range devs {
		devs[i] = fmt.Sprintf("parked-%d", i+1)
	}
	return devs
}

// startBarePath runs the bare forwarder's server and bridge as processes;
// durable, the server syncs each command to a log before it publishes it.
func startBarePath(b *testing.B, cfg benchConfig, durable bool) pathTarget {
	b.Helper()
	httpAddr := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	mqttAddr := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	self, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	devices := benchDevices(cfg.devices)
	env := append(procEnv(), "BENCH_HTTP="+httpAddr, "BENCH_MQTT="+mqttAddr, "BENCH_DEVICE_IDS="+strings.Join(devices, ","))
	name := "bare"
	if durable {
		name = "durable"
		env = append(env, bareLogDirEnv+"="+b.TempDir())
	}
	startRole := func(role string) *osProc {
		return startProcEnv(b, role, self, append(env, benchRoleEnv+"="+role))
	}
	server := startRole("bare-server")
	waitHTTP(b, server, "http://"+httpAddr+"/readyz")
	bridge := startRole("bare-bridge")
	base := "http://" + httpAddr
	t := pathTarget{name: name, base: base, devices: devices, parked: parkedDevices(cfg),
		procs: map[string]*osProc{"server": server, "bridge": bridge}}
	// The bridge is up once a command comes back.
	testenv.Eventually(b, 20*time.Second, "the bare bridge", func() bool {
		req, _ := http.NewRequest("POST", base+"/api/v1/devices/"+devices[len(devices)-1]+"/push/text", strings.NewReader(`{"text":"up?"}`))
		req.Header.Set("Prefer", "wait=1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false
		}
		discard(resp)
		return resp.StatusCode == http.StatusOK
	})
	return t
}

// startProjectPath runs `companion serve` and `companion-bridge
// --sim-devices` as a user does, each with --pprof, and registers the
// devices, and the parked ones, to a user.
func startProjectPath(b *testing.B, cfg benchConfig) pathTarget {
	b.Helper()
	c := newProcCluster(b, cfg.devices)
	parked := parkedDevices(cfg)
	serverPProf := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	bridgePProf := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(b))
	c.serverArgs = []string{"--pprof", serverPProf, "--register-per-minute", "0"}
	c.startServer()
	c.setupFleet(parked...)
	// The bridge as it runs by default: no --sim-state.
	c.bridgeArgs = []string{"--pprof", bridgePProf}
	c.simState = ""
	c.startBridge()
	t := pathTarget{name: "project", base: c.base(), token: c.user.token, devices: c.devices, parked: parked,
		procs: map[string]*osProc{"server": c.server, "bridge": c.bridgeProc}}
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
			// Where the goroutines wait, once, then the CPU profile.
			if err := fetchTo("http://"+addr+"/debug/pprof/goroutine?debug=1", filepath.Join(dir, name+"-goroutines.txt")); err != nil {
				errs <- err
				return
			}
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
		fmt.Printf("profile  %s %s counters over the phase: %s\n", filepath.Base(dir), name, strings.Join(out, " "))
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
	pick("store", "commits", "writes", "pages")
	pick("spool", "commits", "writes", "pages")
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
	testenv.Eventually(tb, 20*time.Second, url, func() bool {
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
