package main

// BenchmarkReplicas measures one `companion serve` replica against three
// on the cluster of CONTRACT §11, all on this machine: PostgreSQL
// (internal/pgtest), a three-node NATS cluster (internal/natstest) whose
// MQTT logins the replicas answer (--nats-callout), N replicas on that one
// store with all three nodes in --mqtt-url, and one bridge serving every
// simulated device. For each N it prints one line:
//
//	replicas: n=N accept_rps=… accept_p50_ms=… accept_p99_ms=… e2e_cps=… e2e_p50_ms=… e2e_p99_ms=… cpu_ms_per_cmd accept server=… bridge=… postgres=… nats=… e2e server=… bridge=… postgres=… nats=… pg_per_cmd accept xacts=… wal_bytes=… e2e xacts=… wal_bytes=…
//
// The load is HTTP text pushes from this process, spread round-robin over
// the replicas (client i sends its k-th request to replica (i+k) mod N):
//
//   - accepting (accept_*): BENCH_ACCEPT_CLIENTS (32) clients POST without
//     waiting, each answered 202 once the command is committed, to devices
//     that are registered but that no bridge serves, as in
//     BenchmarkCommandPath: the figure is the replicas' intake.
//   - end to end (e2e_*): BENCH_E2E_CLIENTS (64) clients POST with
//     Prefer: wait=60 to the BENCH_DEVICES (200) devices the bridge
//     serves, each client to devices of its own, and send the next once the
//     answer (the final state) is back. It runs first, after 2 s of
//     warm-up.
//
// cpu_ms_per_cmd is the CPU time (user and system, from /proc/PID/stat, so
// Linux only) each kind of process spent over the phase, divided by the
// commands the phase completed: server is the N replicas together, bridge
// the bridge, nats the three nodes, postgres every process of the server
// (the postmaster, its backends and workers, and those that ended
// meanwhile). pg_per_cmd is what PostgreSQL wrote per command over the
// phase: transactions that wrote (transaction ids assigned) and bytes of
// WAL. These are the inputs of the sizing in docs/scale-out.md.
//
// Knobs (environment): BENCH_SECONDS per phase (10), BENCH_DEVICES (200),
// BENCH_E2E_CLIENTS (64), BENCH_ACCEPT_CLIENTS (32), BENCH_REPLICAS (the
// configurations, "1,3"). Run it alone and once (make bench-cluster):
//
//	go test -run '^$' -bench '^BenchmarkReplicas$' -benchtime 1x -timeout 30m ./cmd/companion

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/natstest"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
)

// clusterRig is CONTRACT §11's cluster as processes for one test or
// benchmark: PostgreSQL, three NATS nodes whose MQTT logins the replicas
// answer (the auth callout), replicas of `companion serve` on that one
// store and all three nodes, and a bridge with simulated devices on all
// three nodes. BenchmarkReplicas and the cluster soak
// (soak_cluster_test.go) run on it.
type clusterRig struct {
	pg   *pgtest.Server
	dsn  string
	nats *natstest.Cluster
	// c is replica r1 and bridge-1: the fleet (setupFleet) and the user
	// are set up through it. replicas[0] is c; the other replicas are
	// copies of it with their own HTTP address, --data and --replica-id.
	c        *procCluster
	replicas []*procCluster
	devices  []string // served by the bridge
}

// clusterRigOptions are startClusterRig's.
type clusterRigOptions struct {
	replicas   int
	devices    int      // served by the bridge
	parked     []string // registered, served by no bridge
	bridgeArgs []string // extra flags of the bridge
	serverArgs []string // extra flags of every replica
}

// startClusterRig starts PostgreSQL (migrated), the NATS cluster, the
// replicas answering its authorization (each waited for until ready), the
// fleet and the bridge, waited for until every device it serves reads
// online and takes a command. The bridge's rights come from the store at
// its login; natstest's max_ack_pending (64) lets one session subscribe
// for 1,023 devices (docs/scale-out.md), so one bridge serves them all.
func startClusterRig(tb testing.TB, o clusterRigOptions) *clusterRig {
	tb.Helper()
	r := &clusterRig{pg: pgtest.Start(tb)}
	r.dsn = r.pg.NewDatabase(tb)
	if err := postgres.Migrate(context.Background(), r.dsn); err != nil {
		tb.Fatalf("migrate: %v", err)
	}
	r.nats = natstest.StartCluster(tb, natstest.Options{
		Callout: true,
		// A QoS 1 message whose PUBACK died with a node comes again after
		// this (NATS's default is 30s), as docs/scale-out.md advises.
		AckWait: 5 * time.Second,
	})

	c := newProcCluster(tb, o.devices)
	r.devices = c.devices
	c.mqttURL = r.nats.MQTTURL()
	c.serverMQTT = clusterCalloutFlags(tb, r.nats)
	c.bridgeArgs = o.bridgeArgs
	r.c = c
	for i := range max(1, o.replicas) {
		rc := c
		if i > 0 {
			cp := *c
			cp.httpAddr = "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(tb))
			cp.data = tb.TempDir()
			cp.server = nil
			rc = &cp
		}
		rc.serverArgs = []string{"--store", r.dsn, "--replica-id", fmt.Sprintf("r%d", i+1), "--register-per-minute", "0"}
		rc.serverArgs = append(rc.serverArgs, o.serverArgs...)
		rc.startServer()
		r.replicas = append(r.replicas, rc)
	}
	c.setupFleet(o.parked...)
	r.startBridge(tb, c)
	return r
}

// clusterCalloutFlags are a replica's flags for cl, a cluster started
// with natstest.Options.Callout: all three nodes in --mqtt-url,
// natsServerUser's credentials as its own MQTT account (which its
// callout grants), and the callout's (natsCallout's, as flags).
func clusterCalloutFlags(tb testing.TB, cl *natstest.Cluster) []string {
	tb.Helper()
	co := cl.Callout
	seed := filepath.Join(tb.TempDir(), "issuer.nk")
	if err := os.WriteFile(seed, co.IssuerSeed, 0o600); err != nil {
		tb.Fatal(err)
	}
	return []string{"--mqtt-url", cl.MQTTURL(),
		"--mqtt-username", natsServerUser.Username, "--mqtt-password", natsServerUser.Password,
		"--mqtt-dynsec=false",
		"--nats-callout", co.URL,
		"--nats-callout-user", co.User, "--nats-callout-password", co.Password,
		"--nats-system-user", co.SystemUser, "--nats-system-password", co.SystemPassword,
		"--nats-issuer-seed", seed,
		"--nats-account", co.Account,
	}
}

// clusterBridgeStart bounds the wait for a started bridge's devices to
// read online. NATS makes a session's QoS 1 subscriptions (each a durable
// JetStream consumer with three replicas) one after another, and reads
// nothing else of that connection meanwhile: a bridge's first connect
// with 200 devices took 18 s on a busy 2-core machine
// (TestManySubscriptions), and its devices read online only after it.
const clusterBridgeStart = 3 * time.Minute

// startBridge starts c's bridge and waits until its devices read online
// and a command to each comes back final. NATS may refuse new QoS 1
// subscriptions for a while after a start (until JetStream's leaders are
// elected); the bridge asks again for those by itself (agent/subscribe.go),
// so the probe waits rather than restarting it.
func (r *clusterRig) startBridge(tb testing.TB, c *procCluster) {
	tb.Helper()
	c.launchBridge()
	problem := r.waitOnline(tb, c)
	if problem == "" {
		problem = r.probe(c.devices)
	}
	if problem != "" {
		tb.Fatalf("the bridge's commands do not get through NATS: %s", problem)
	}
}

// waitOnline waits up to clusterBridgeStart until every device of c's
// bridge reads online; it returns what did not, or "".
func (r *clusterRig) waitOnline(tb testing.TB, c *procCluster) string {
	tb.Helper()
	start := time.Now()
	for _, id := range c.devices {
		for {
			if !c.bridgeProc.running() {
				tb.Fatalf("companion-bridge exited: %v", c.bridgeProc.waitErr)
			}
			resp := c.user.do("GET", "/api/v1/devices/"+id+"/status", nil)
			if resp.Status == 200 && resp.JSON(tb)["online"] == true {
				break
			}
			if time.Since(start) > clusterBridgeStart {
				return fmt.Sprintf("%s not online %v after the bridge started", id, clusterBridgeStart)
			}
			time.Sleep(100 * time.Millisecond) // polling the API; the bridge is another process
		}
	}
	tb.Logf("the bridge's %d devices online %v after it started", len(c.devices), time.Since(start).Round(time.Millisecond))
	return ""
}

// probe sends one text to each of devices, through the replicas in turn,
// and waits for it to be final; it returns what failed, or "".
func (r *clusterRig) probe(devices []string) string {
	bases := r.bases()
	hc := loadClient(32)
	defer hc.CloseIdleConnections()
	var (
		mu     sync.Mutex
		failed []string
		wg     sync.WaitGroup
		sem    = make(chan struct{}, 32)
	)
	for i, dev := range devices {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			req, _ := http.NewRequest("POST", bases[i%len(bases)]+"/api/v1/devices/"+dev+"/push/text", strings.NewReader(`{"text":"probe"}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Authorization", "Bearer "+r.c.user.token)
			req.Header.Set("Prefer", "wait=20")
			resp, err := hc.Do(req)
			status := 0
			if err == nil {
				status = resp.StatusCode
				discard(resp)
			}
			if status != http.StatusOK {
				mu.Lock()
				failed = append(failed, fmt.Sprintf("%s: %d %v", dev, status, err))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(failed) == 0 {
		return ""
	}
	slices.Sort(failed)
	return fmt.Sprintf("%d of %d probe commands not final in 20 s, e.g. %v", len(failed), len(devices), failed[:min(3, len(failed))])
}

// bases are the replicas' API URLs.
func (r *clusterRig) bases() []string {
	var out []string
	for _, rc := range r.replicas {
		out = append(out, rc.base())
	}
	return out
}

// clusterCPU reads the CPU time so far of each kind of process of the
// rig: server (the replicas), bridge, nats (the nodes), postgres (its
// process group, with the children it has reaped) and load (this
// process).
func (r *clusterRig) clusterCPU() map[string]time.Duration {
	out := map[string]time.Duration{"load": procCPU(os.Getpid())}
	for _, rc := range r.replicas {
		out["server"] += procCPU(rc.server.cmd.Process.Pid)
	}
	out["bridge"] = procCPU(r.c.bridgeProc.cmd.Process.Pid)
	for i := range natstest.Nodes {
		if pid := r.nats.PID(i); pid != 0 {
			out["nats"] += procCPU(pid)
		}
	}
	out["postgres"] = clusterPostgresCPU(r.pg)
	return out
}

// clusterPostgresCPU is the CPU time of every process of a pgtest server:
// the postmaster (its pid is the first line of postmaster.pid) and its
// children, the backends and workers (each in a session of its own, so
// found by their parent); a child that has ended is counted in the
// postmaster's cutime and cstime.
func clusterPostgresCPU(pg *pgtest.Server) time.Duration {
	b, err := os.ReadFile(filepath.Join(pg.Dir, "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	pm := strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0])
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var total time.Duration
	for _, p := range stats {
		pid := filepath.Base(filepath.Dir(p))
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// pid (comm) state ppid … utime(14) stime(15) cutime(16) cstime(17)
		f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
		if len(f) < 15 || (pid != pm && f[1] != pm) {
			continue
		}
		ticks := func(i int) time.Duration {
			n, _ := strconv.ParseInt(f[i], 10, 64)
			return time.Duration(n) * 10 * time.Millisecond
		}
		total += ticks(11) + ticks(12)
		if pid == pm {
			total += ticks(13) + ticks(14)
		}
	}
	return total
}

// clusterPGCounters reads PostgreSQL's count of transaction ids assigned
// (the next one to be; only transactions that write get one) and its WAL
// position in bytes.
func clusterPGCounters(tb testing.TB, dsn string) (xids, walBytes int64) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		tb.Fatalf("postgres counters: %v", err)
	}
	defer conn.Close(context.Background())
	err = conn.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
		pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&xids, &walBytes)
	if err != nil {
		tb.Fatalf("postgres counters: %v", err)
	}
	return xids, walBytes
}

// clusterPhase is one phase's figures.
type clusterPhase struct {
	res            loadResult // its cpu: each kind's CPU time over the phase
	xids, walBytes int64      // PostgreSQL's, over the phase
}

func (p clusterPhase) perCommand(v int64) float64 { return float64(v) / float64(max(p.res.done, 1)) }

// measure runs one phase of load on the rig and reads the CPU time and
// PostgreSQL's counters around it.
func (r *clusterRig) measure(tb testing.TB, token string, devs []string, clients int, d time.Duration, wait bool) clusterPhase {
	tb.Helper()
	x0, w0 := clusterPGCounters(tb, r.pg.DSN)
	before := r.clusterCPU()
	res := runLoad(r.bases(), token, devs, clients, d, wait)
	after := r.clusterCPU()
	x1, w1 := clusterPGCounters(tb, r.pg.DSN)
	res.cpu = map[string]time.Duration{}
	for k, v := range after {
		res.cpu[k] = v - before[k]
	}
	return clusterPhase{res: res, xids: x1 - x0, walBytes: w1 - w0}
}

// clusterReplicaCounts reads BENCH_REPLICAS: the numbers of replicas to
// measure, "1,3" unless set.
func clusterReplicaCounts(tb testing.TB) []int {
	tb.Helper()
	v := os.Getenv("BENCH_REPLICAS")
	if v == "" {
		return []int{1, 3}
	}
	var ns []int
	for _, s := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			tb.Fatalf("BENCH_REPLICAS=%q: want numbers of replicas such as 1,3", v)
		}
		ns = append(ns, n)
	}
	return ns
}

// clusterLine formats a configuration's line (see the file's comment).
func clusterLine(n int, accept, e2e clusterPhase) string {
	var b strings.Builder
	fmt.Fprintf(&b, "replicas: n=%d accept_rps=%.0f accept_p50_ms=%.1f accept_p99_ms=%.1f e2e_cps=%.0f e2e_p50_ms=%.1f e2e_p99_ms=%.1f cpu_ms_per_cmd",
		n, accept.res.rate(), ms(accept.res.pct(0.5)), ms(accept.res.pct(0.99)),
		e2e.res.rate(), ms(e2e.res.pct(0.5)), ms(e2e.res.pct(0.99)))
	for _, p := range []struct {
		name string
		ph   clusterPhase
	}{{"accept", accept}, {"e2e", e2e}} {
		fmt.Fprintf(&b, " %s", p.name)
		for _, kind := range []string{"server", "bridge", "postgres", "nats"} {
			fmt.Fprintf(&b, " %s=%.3f", kind, ms(p.ph.res.cpu[kind])/float64(max(p.ph.res.done, 1)))
		}
	}
	fmt.Fprintf(&b, " pg_per_cmd accept xacts=%.2f wal_bytes=%.0f e2e xacts=%.2f wal_bytes=%.0f",
		accept.perCommand(accept.xids), accept.perCommand(accept.walBytes), e2e.perCommand(e2e.xids), e2e.perCommand(e2e.walBytes))
	return b.String()
}

func BenchmarkReplicas(b *testing.B) {
	cfg := benchConfigFromEnv(b)
	if os.Getenv("BENCH_E2E_CLIENTS") == "" {
		cfg.e2eClients = 64
	}
	var lines []string
	for _, n := range clusterReplicaCounts(b) {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			for range b.N {
				parked := parkedDevices(cfg)
				r := startClusterRig(b, clusterRigOptions{replicas: n, devices: cfg.devices, parked: parked})
				token := r.c.user.token
				runLoad(r.bases(), token, r.devices, cfg.e2eClients, 2*time.Second, true) // warm up: connections, consumers, caches
				e2e := r.measure(b, token, r.devices, cfg.e2eClients, cfg.phase, true)
				accept := r.measure(b, token, parked, cfg.acceptClients, cfg.phase, false)
				for _, p := range []struct {
					name string
					res  loadResult
				}{{"e2e", e2e.res}, {"accept", accept.res}} {
					if p.res.errs > 0 {
						b.Errorf("n=%d %s: %d failed requests, the first: %s", n, p.name, p.res.errs, p.res.firstErr)
					}
				}
				line := clusterLine(n, accept, e2e)
				fmt.Println(line)
				lines = append(lines, line)
			}
		})
	}
	fmt.Printf("over %s per phase; %d devices, accept %d clients, e2e %d clients\n", cfg.phase, cfg.devices, cfg.acceptClients, cfg.e2eClients)
	for _, l := range lines {
		fmt.Println(l)
	}
}
