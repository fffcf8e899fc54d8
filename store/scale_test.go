package store_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/gctune"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"
)

// scaleFleet is the population of the benchmark. Device i is dev-%07d;
// user 0 holds every hundredth device (so its devices lie all over the key
// space, as devices bound over years would), and users 1… hold the rest in
// turn, about 99 each.
type scaleFleet struct {
	devices int
	users   []scaleUser
	owned   []int // devices per user
}

type scaleUser struct {
	id    string
	token string
}

func newScaleFleet(devices int) *scaleFleet {
	f := &scaleFleet{devices: devices, users: make([]scaleUser, max(devices/100, 2))}
	for u := range f.users {
		f.users[u] = scaleUser{id: uuid.NewString(), token: fmt.Sprintf("ctk_scale-%d-%s", u, uuid.NewString())}
	}
	f.owned = make([]int, len(f.users))
	for i := range devices {
		f.owned[f.owner(i)]++
	}
	return f
}

func scaleDeviceID(i int) string { return fmt.Sprintf("dev-%07d", i) }

// owner is the index of the user holding device i.
func (f *scaleFleet) owner(i int) int {
	if i%100 == 0 {
		return 0
	}
	return 1 + i%(len(f.users)-1)
}

// hasHistory reports whether device i has finished commands: every tenth
// device has two.
func hasHistory(i int) bool { return i%10 == 0 }

const commandsPerHistory = 2

// BenchmarkStoreScale measures the store at the scale of issue 8: one bbolt
// file holding a million devices of 10,000 users (one of them holding
// 10,000), each device with a reported status and every tenth with two
// finished commands, read through the real HTTP API on a loopback port by
// concurrent clients. It prints the p50 and p99 of each kind of request and
// the bytes of the file per device and per finished command.
//
// It lives in store, not in api or cmd/companion, because building such a
// store in a minute needs the store's test-only bulk path
// (ProvisionDevices in export_test.go), which only the store's own test
// binary can see.
//
// Run it alone and once (make bench-scale):
//
//	go test -run '^$' -bench '^BenchmarkStoreScale$' -benchtime 1x -timeout 30m ./store
//
// Knobs (environment): SCALE_DEVICES (1000000; users are a hundredth of
// that, and one user holds a hundredth of the devices), SCALE_CLIENTS
// (concurrent HTTP clients, 4), SCALE_CPUPROFILE (a file for a CPU profile
// of the requests only, not of building the store). The requests are served
// at the server binary's GOGC of 400 unless GOGC is set.
func BenchmarkStoreScale(b *testing.B) {
	devices := envInt(b, "SCALE_DEVICES", 1_000_000)
	clients := envInt(b, "SCALE_CLIENTS", 4)
	f := newScaleFleet(devices)

	path := filepath.Join(b.TempDir(), "companion.db")
	db, err := store.Open(path, store.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()

	start := time.Now()
	buildFleet(b, db, f)
	built := time.Since(start)
	fileDevices, dataDevices := sizes(b, db)

	start = time.Now()
	commands := addHistory(b, db, f)
	history := time.Since(start)
	fileAll, dataAll := sizes(b, db)
	fmt.Printf("scale: built %d devices, %d users, %d statuses in %.1fs; %d finished commands in %.1fs\n",
		f.devices, len(f.users), f.devices, built.Seconds(), commands, history.Seconds())
	fmt.Printf("scale: file %d bytes with the fleet (%d in use), %d with the commands (%d in use)\n",
		fileDevices, dataDevices, fileAll, dataAll)

	// The server binary collects garbage at GOGC=400 unless GOGC is set
	// (gctune.Percent): serve the API the same way.
	gogc := os.Getenv("GOGC")
	if gogc == "" {
		gogc = strconv.Itoa(gctune.Percent)
		defer debug.SetGCPercent(debug.SetGCPercent(gctune.Percent))
	}
	base := serveAPI(b, db)
	load := &scaleLoad{fleet: f, base: base, clients: clients}
	big := f.owned[0]
	stopProfile := func() {}
	if path := os.Getenv("SCALE_CPUPROFILE"); path != "" {
		stopProfile = cpuProfile(b, path)
	}
	b.ResetTimer()
	results := []scaleResult{
		// The user holding the most devices walks all of them with the cursor.
		load.run(b, "list50", 4*clients, func(c *scaleClient, _ int) error { return c.walk(0, 50) }),
		load.run(b, "list200", 16*clients, func(c *scaleClient, _ int) error { return c.walk(0, 200) }),
		// Ordinary users (about 99 devices) list theirs.
		load.run(b, "user_list50", 1000*clients, func(c *scaleClient, _ int) error { return c.walk(1+c.rng.IntN(len(f.users)-1), 50) }),
		load.run(b, "user_list200", 1000*clients, func(c *scaleClient, _ int) error { return c.walk(1+c.rng.IntN(len(f.users)-1), 200) }),
		// Any user reads the status of one of their devices.
		load.run(b, "status", 5000*clients, func(c *scaleClient, _ int) error { return c.status(c.rng.IntN(f.devices)) }),
	}
	b.StopTimer()
	stopProfile()

	byKind := map[string]scaleResult{}
	for _, r := range results {
		byKind[r.kind] = r
		fmt.Printf("scale: %-12s requests=%-6d clients=%d req_per_s=%.0f p50_ms=%.2f p99_ms=%.2f max_ms=%.2f gcs=%d alloc_kb_per_req=%.0f other_processes_cpu=%.0f%%\n",
			r.kind, len(r.lat), clients, r.rate(), ms(r.pct(0.50)), ms(r.pct(0.99)), ms(r.lat[len(r.lat)-1]),
			r.gcs, float64(r.allocated)/1024/float64(len(r.lat)), 100*r.others)
		b.ReportMetric(ms(r.pct(0.99)), r.kind+"_p99_ms")
	}
	perDevice := float64(fileDevices) / float64(f.devices)
	perCommand := float64(fileAll-fileDevices) / float64(commands)
	b.ReportMetric(perDevice, "bytes/device")
	b.ReportMetric(perCommand, "bytes/command")
	fmt.Printf("scale: devices=%d users=%d big_user_devices=%d clients=%d gogc=%s list50_p99_ms=%.2f list200_p99_ms=%.2f user_list50_p99_ms=%.2f user_list200_p99_ms=%.2f status_p99_ms=%.2f bytes_per_device=%.0f bytes_per_command=%.0f\n",
		f.devices, len(f.users), big, clients, gogc,
		ms(byKind["list50"].pct(0.99)), ms(byKind["list200"].pct(0.99)),
		ms(byKind["user_list50"].pct(0.99)), ms(byKind["user_list200"].pct(0.99)),
		ms(byKind["status"].pct(0.99)), perDevice, perCommand)
}

// buildFleet writes the users, the registry, the bindings and a status for
// every device: the registry through the bulk path, the rest through the
// store's own API with many writers at once, which the store groups into
// shared transactions.
func buildFleet(tb testing.TB, db *store.DB, f *scaleFleet) {
	tb.Helper()
	ctx := context.Background()
	now := time.Now().UTC()
	err := each(len(f.users), 1, func(u int) error {
		h := sha256.Sum256([]byte(f.users[u].token))
		return db.CreateUser(ctx, companion.User{ID: f.users[u].id, Name: fmt.Sprintf("user %d", u), TokenHash: h[:]})
	})
	if err != nil {
		tb.Fatalf("users: %v", err)
	}

	const chunk = 50_000
	for lo := 0; lo < f.devices; lo += chunk {
		ds := make([]companion.RegistryDevice, 0, chunk)
		for i := lo; i < min(lo+chunk, f.devices); i++ {
			h := sha256.Sum256([]byte("claim-" + strconv.Itoa(i)))
			ds = append(ds, companion.RegistryDevice{ID: scaleDeviceID(i), Model: "cm-1", ClaimHash: h[:], CreatedAt: now})
		}
		if err := db.ProvisionDevices(ds); err != nil {
			tb.Fatalf("provision: %v", err)
		}
	}

	err = each(f.devices, 2000, func(i int) error {
		_, _, err := db.Bind(ctx, companion.Binding{
			DeviceID: scaleDeviceID(i),
			UserID:   f.users[f.owner(i)].id,
			Name:     fmt.Sprintf("Kitchen display %d", i),
			BoundAt:  now,
		})
		return err
	})
	if err != nil {
		tb.Fatalf("bind: %v", err)
	}

	err = eachAsync(f.devices, 4000, func(i int, done func(error)) {
		battery := i % 101
		db.PutStatusAsync(companion.Status{
			DeviceID:        scaleDeviceID(i),
			Online:          i%3 != 0,
			Battery:         &battery,
			FirmwareVersion: "1.4.2",
			Model:           "cm-1",
			Apps:            []companion.App{{AppID: "com.example.clock", Version: "1.2.0"}, {AppID: "com.example.weather", Version: "2.0.1"}},
			BridgeID:        fmt.Sprintf("bridge-%04d", i/1000),
			LastSeen:        now,
			Seq:             uint64(now.UnixNano()),
		}, func(_ bool, err error) { done(err) })
	})
	if err != nil {
		tb.Fatalf("status: %v", err)
	}
}

// addHistory gives every tenth device two text pushes, accepted and then
// succeeded, and returns how many commands it wrote.
func addHistory(tb testing.TB, db *store.DB, f *scaleFleet) int {
	tb.Helper()
	payload, err := json.Marshal(topics.PushText{Text: "Meeting moved to 3 pm, room 4B", Title: "Calendar"})
	if err != nil {
		tb.Fatal(err)
	}
	var ids []int
	for i := range f.devices {
		if hasHistory(i) {
			for range commandsPerHistory {
				ids = append(ids, i)
			}
		}
	}
	expires := time.Now().Add(24 * time.Hour)
	err = eachAsync(len(ids), 4000, func(n int, done func(error)) {
		i := ids[n]
		c := companion.Command{DeviceID: scaleDeviceID(i), UserID: f.users[f.owner(i)].id, Op: topics.OpPushText, Payload: payload, ExpiresAt: expires}
		db.CreateCommandAsync(c, 1000, nil, func(cmd companion.Command, _ bool, err error) {
			if err != nil {
				done(err)
				return
			}
			db.UpdateCommandAsync(cmd.ID, func(c *companion.Command) error {
				c.State = companion.StateSucceeded
				return nil
			}, func(_ companion.Command, err error) { done(err) })
		})
	})
	if err != nil {
		tb.Fatalf("commands: %v", err)
	}
	return len(ids)
}

// sizes returns the size of the bbolt file and the part of it in use.
func sizes(tb testing.TB, db *store.DB) (file, data int64) {
	tb.Helper()
	fi, err := os.Stat(db.Path())
	if err != nil {
		tb.Fatal(err)
	}
	data, err = db.DataSize()
	if err != nil {
		tb.Fatal(err)
	}
	return fi.Size(), data
}

// serveAPI serves the real API over db on a loopback port and returns its
// base URL. The rate limit is off: the load comes from a few tokens.
func serveAPI(tb testing.TB, db *store.DB) string {
	tb.Helper()
	srv, err := api.New(api.Options{
		Store:    db,
		Commands: noCommands{},
		Limits:   api.Limits{RequestsPerSecond: -1},
		Logger:   slog.New(slog.DiscardHandler),
	})
	if err != nil {
		tb.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	tb.Cleanup(func() {
		_ = hs.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			tb.Errorf("serve: %v", err)
		}
	})
	return "http://" + ln.Addr().String()
}

// noCommands is the command broker of a read-only benchmark: none is sent.
type noCommands struct{}

var errNoCommands = errors.New("scale benchmark: no commands")

func (noCommands) Submit(context.Context, companion.Command, *companion.Idempotency) (companion.Command, bool, error) {
	return companion.Command{}, false, errNoCommands
}

func (noCommands) Cancel(context.Context, string) (companion.Command, error) {
	return companion.Command{}, errNoCommands
}

func (noCommands) Wait(context.Context, string) (companion.Command, error) {
	return companion.Command{}, errNoCommands
}

func (noCommands) DeviceMoved(string)                        {}
func (noCommands) PrepareMove(...string) func()              { return func() {} }
func (noCommands) BridgesDisconnecting(...string)            {}
func (noCommands) BridgesDisconnectingWithoutWill(...string) {}
func (noCommands) BridgeDeleted(string)                      {}

func (noCommands) Ended([]companion.Command) {}

// scaleLoad runs jobs on concurrent HTTP clients.
type scaleLoad struct {
	fleet   *scaleFleet
	base    string
	clients int
}

type scaleResult struct {
	kind    string
	lat     []time.Duration // every request's, sorted
	elapsed time.Duration
	// others is the share of the machine's CPU that other processes used
	// during the phase (-1 when unknown): a figure taken while it is high
	// measures the neighbours as much as the store.
	others float64
	// gcs and allocated are the garbage collections and the bytes
	// allocated in this process (server and clients) during the phase.
	gcs       uint32
	allocated uint64
}

func (r scaleResult) rate() float64 { return float64(len(r.lat)) / r.elapsed.Seconds() }

func (r scaleResult) pct(p float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	return r.lat[min(len(r.lat)-1, int(float64(len(r.lat))*p))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// run has the clients take jobs 0…jobs-1 in turn, each one or more
// requests, and returns every request's latency.
func (l *scaleLoad) run(tb testing.TB, kind string, jobs int, job func(c *scaleClient, j int) error) scaleResult {
	tb.Helper()
	transport := &http.Transport{MaxIdleConnsPerHost: l.clients, DisableCompression: true}
	defer transport.CloseIdleConnections()
	var (
		next atomic.Int64
		mu   sync.Mutex
		lat  []time.Duration
		errs []error
		wg   sync.WaitGroup
	)
	var mem0, mem1 runtime.MemStats
	runtime.ReadMemStats(&mem0)
	cpu0 := readCPU()
	start := time.Now()
	for k := range l.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &scaleClient{load: l, http: &http.Client{Transport: transport}, rng: rand.New(rand.NewPCG(uint64(k), 8))}
			var err error
			for err == nil {
				j := int(next.Add(1)) - 1
				if j >= jobs {
					break
				}
				err = job(c, j)
			}
			mu.Lock()
			defer mu.Unlock()
			lat = append(lat, c.lat...)
			if err != nil {
				errs = append(errs, err)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	others := readCPU().othersSince(cpu0, elapsed)
	runtime.ReadMemStats(&mem1)
	if err := errors.Join(errs...); err != nil {
		tb.Fatalf("%s: %v", kind, err)
	}
	slices.Sort(lat)
	return scaleResult{kind: kind, lat: lat, elapsed: elapsed, others: others,
		gcs: mem1.NumGC - mem0.NumGC, allocated: mem1.TotalAlloc - mem0.TotalAlloc}
}

// scaleClient is one client of the load; it records the latency of each of
// its requests, from sending it to reading the last byte of the answer.
type scaleClient struct {
	load *scaleLoad
	http *http.Client
	rng  *rand.Rand
	lat  []time.Duration
}

func (c *scaleClient) get(path, token string) ([]byte, error) {
	req, err := http.NewRequest(http.MethodGet, c.load.base+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	start := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	c.lat = append(c.lat, time.Since(start))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %d %s", path, resp.StatusCode, body)
	}
	return body, nil
}

// walk lists every device of user u, limit to a page, and checks that it
// saw them all. It reads of each page only the count of devices and the
// cursor, without decoding the rest: on a 2-core machine, the CPU the
// clients spend is taken from the server.
func (c *scaleClient) walk(u, limit int) error {
	f := c.load.fleet
	cursor, seen := "", 0
	for {
		path := "/api/v1/devices?limit=" + strconv.Itoa(limit)
		if cursor != "" {
			path += "&cursor=" + cursor
		}
		body, err := c.get(path, f.users[u].token)
		if err != nil {
			return err
		}
		seen += bytes.Count(body, []byte(`"bound_at":`))
		i := bytes.LastIndex(body, []byte(`"next_cursor":`))
		if i < 0 {
			return fmt.Errorf("GET %s: no next_cursor in %.200s", path, body)
		}
		var next *string
		if err := json.NewDecoder(bytes.NewReader(body[i+len(`"next_cursor":`):])).Decode(&next); err != nil {
			return fmt.Errorf("GET %s: next_cursor: %w", path, err)
		}
		if next == nil {
			break
		}
		cursor = *next
	}
	if seen != f.owned[u] {
		return fmt.Errorf("user %d: listed %d devices; want %d", u, seen, f.owned[u])
	}
	return nil
}

// status reads the status of device i as its owner.
func (c *scaleClient) status(i int) error {
	f := c.load.fleet
	_, err := c.get("/api/v1/devices/"+scaleDeviceID(i)+"/status", f.users[f.owner(i)].token)
	return err
}

// each calls fn(0…n-1) on workers goroutines and returns the first error.
func each(n, workers int, fn func(i int) error) error {
	var (
		next atomic.Int64
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
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
				if err := fn(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// eachAsync starts fn(0…n-1) with at most inflight unfinished at a time,
// waits for all of them to call done, and returns the first error.
func eachAsync(n, inflight int, fn func(i int, done func(error))) error {
	slots := make(chan struct{}, inflight)
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for i := range n {
		slots <- struct{}{}
		wg.Add(1)
		fn(i, func(err error) {
			if err != nil {
				once.Do(func() { first = err })
			}
			<-slots
			wg.Done()
		})
	}
	wg.Wait()
	return first
}

// cpuProfile starts a CPU profile written to path and returns the function
// that stops it.
func cpuProfile(tb testing.TB, path string) (stop func()) {
	tb.Helper()
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		tb.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			tb.Error(err)
		}
	}
}

// cpuTimes are the CPU time of the whole machine (all CPUs, busy only) and
// of this process, from Linux's /proc; ok is false elsewhere.
type cpuTimes struct {
	machine, self time.Duration
	ok            bool
}

// clockTick is Linux's USER_HZ, the unit of /proc's CPU times.
const clockTick = 10 * time.Millisecond

func readCPU() cpuTimes {
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	fields := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal …
	if len(fields) < 9 || fields[0] != "cpu" {
		return cpuTimes{}
	}
	var busy int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} {
		n, err := strconv.ParseInt(fields[i], 10, 64)
		if err != nil {
			return cpuTimes{}
		}
		busy += n
	}
	self, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return cpuTimes{}
	}
	// The fields after the command name, which is in parentheses: state
	// is the first, utime and stime the 12th and 13th.
	i := strings.LastIndexByte(string(self), ')')
	rest := strings.Fields(string(self)[i+1:])
	if i < 0 || len(rest) < 13 {
		return cpuTimes{}
	}
	utime, err1 := strconv.ParseInt(rest[11], 10, 64)
	stime, err2 := strconv.ParseInt(rest[12], 10, 64)
	if err1 != nil || err2 != nil {
		return cpuTimes{}
	}
	return cpuTimes{machine: time.Duration(busy) * clockTick, self: time.Duration(utime+stime) * clockTick, ok: true}
}

// othersSince is the share of the machine's CPUs (0–1) that processes other
// than this one kept busy since then, over elapsed; -1 when unknown.
func (now cpuTimes) othersSince(then cpuTimes, elapsed time.Duration) float64 {
	if !now.ok || !then.ok || elapsed <= 0 {
		return -1
	}
	others := (now.machine - then.machine) - (now.self - then.self)
	return max(0, float64(others)/(float64(elapsed)*float64(runtime.NumCPU())))
}

func envInt(tb testing.TB, name string, def int) int {
	tb.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		tb.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}
