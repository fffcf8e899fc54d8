//go:build soak

package main

// The soak (make soak; not part of make test): minutes of mixed load against
// the real binaries and a real Mosquitto started from the project's
// mosquitto.conf, while the server, the bridge and the broker are killed
// (SIGKILL) at random and restarted. At the end, once everything is back and
// has settled, it prints what became of every accepted command and how many
// commands a device executed twice, and fails when any accepted command was
// lost or any was executed twice.
//
//	SOAK_MINUTES=10 go test -tags soak -run '^TestSoak$' -count=1 -timeout 0 -v ./cmd/companion

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/sim"
)

const (
	soakDevices = 8
	soakWorkers = 8
	soakSettle  = 5 * time.Minute // longest wait for every command to be final
)

func soakDuration(t *testing.T) time.Duration {
	minutes := 10.0
	if v := os.Getenv("SOAK_MINUTES"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		require.NoError(t, err, "SOAK_MINUTES")
		minutes = f
	}
	return time.Duration(minutes * float64(time.Minute))
}

func TestSoak(t *testing.T) {
	duration := soakDuration(t)
	mq := mqtttest.StartMosquitto(t, serverAccount)
	c := newProcCluster(t, soakDevices)
	c.mqttURL = mq.URL
	c.serverMQTT = []string{"--mqtt-url", mq.URL, "--mqtt-username", "companion-server", "--mqtt-password", "server-secret"}
	c.startServer()
	c.setupFleet()
	admin := &client{tb: t, base: c.base(), token: c.adminToken}
	r := admin.do("PUT", "/api/v1/admin/apps/weather/1.0.0", bytes.Repeat([]byte("app"), 2000))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	c.bridgeArgs = soakBridgeArgs
	c.startBridge()

	start := time.Now()
	t.Logf("soak: %s of load on %d devices, server %s, broker %s", duration, soakDevices, c.httpAddr, mq.URL)
	load := startSoakLoad(t, c, start, []string{c.base()})

	// Chaos: kill one piece at random, leave it down a moment, restart it.
	kills := soakChaos(t, start, duration, []soakFault{
		{"server", func(down time.Duration) {
			c.server.kill()
			time.Sleep(down)
			c.launchServer()
			c.waitServer("/readyz")
		}},
		{"bridge", func(down time.Duration) {
			c.bridgeProc.kill()
			time.Sleep(down)
			c.launchBridge()
		}},
		{"broker", func(down time.Duration) {
			mq.Kill(t)
			time.Sleep(down)
			mq.Start(t)
		}},
	})
	load.finish()
	soakSettleAndReport(t, c, load, "soak", fmt.Sprintf("server %d, bridge %d, broker %d", kills["server"], kills["bridge"], kills["broker"]))
}

// soakLoad is the soak's load: soakWorkers goroutines, each sending a
// random operation to a random device, now and then, until finish. Only
// complete 202s count as accepted.
type soakLoad struct {
	start    time.Time
	mu       sync.Mutex
	accepted map[string]string // id → device
	rejected map[int]int       // status → count
	requests atomic.Int64
	refused  atomic.Int64 // no answer: server down or killed mid-request
	stop     chan struct{}
	wg       sync.WaitGroup
	hc       *http.Client
}

// startSoakLoad starts the load on c's devices. Each request goes to one
// of bases (servers sharing the work) chosen at random.
func startSoakLoad(tb testing.TB, c *procCluster, start time.Time, bases []string) *soakLoad {
	tb.Helper()
	img := base64.StdEncoding.EncodeToString(pngImage(tb, 32, 32))
	l := &soakLoad{start: start, accepted: map[string]string{}, rejected: map[int]int{},
		stop: make(chan struct{}), hc: loadClient(soakWorkers * len(bases))}
	for w := range soakWorkers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(start.UnixNano())))
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				case <-time.After(time.Duration(rng.IntN(100)) * time.Millisecond):
				}
				dev := c.devices[rng.IntN(len(c.devices))]
				method, path, body := soakOp(rng, dev, img, i)
				p := c.sendTo(l.hc, bases[rng.IntN(len(bases))], method, path, body)
				l.requests.Add(1)
				switch id := p.acceptedID(); {
				case id != "":
					l.mu.Lock()
					l.accepted[id] = dev
					l.mu.Unlock()
				case p.err != nil:
					l.refused.Add(1)
				default:
					l.mu.Lock()
					l.rejected[p.status]++
					l.mu.Unlock()
				}
			}
		}()
	}
	return l
}

// finish stops the load and waits for its workers.
func (l *soakLoad) finish() {
	close(l.stop)
	l.wg.Wait()
	l.hc.CloseIdleConnections()
}

// soakFault is one kind of fault of the chaos: fault kills a piece,
// leaves it down for down, and brings it back.
type soakFault struct {
	name  string
	fault func(down time.Duration)
}

// soakChaos injects one of faults at random every 2–12 s, each down for
// 0.2–4.2 s, until duration has passed since start, and counts them by
// name. It logs each, with when in the load it came: the timeline a run's
// expired commands are read against (soakExpired).
func soakChaos(t *testing.T, start time.Time, duration time.Duration, faults []soakFault) map[string]int {
	kills := map[string]int{}
	rng := rand.New(rand.NewPCG(1, uint64(start.UnixNano())))
	for time.Since(start) < duration {
		time.Sleep(time.Duration(2000+rng.IntN(8000)) * time.Millisecond) // the pace of the chaos, not a synchronisation
		if time.Since(start) >= duration {
			break
		}
		down := time.Duration(200+rng.IntN(4000)) * time.Millisecond
		f := faults[rng.IntN(len(faults))]
		t.Logf("chaos: %s into the load, %s down for %s", time.Since(start).Round(100*time.Millisecond), f.name, down)
		f.fault(down)
		kills[f.name]++
	}
	return kills
}

// soakSettleAndReport waits, with everything up and the load over, until
// every accepted command is final (at most soakSettle), prints what became
// of them under the heading name, with the kills line killed, and fails
// the test when one was lost or one ran twice.
func soakSettleAndReport(t *testing.T, c *procCluster, load *soakLoad, name, killed string) {
	t.Helper()
	loadTime := time.Since(load.start)
	t.Logf("%s: load over after %s; settling", name, loadTime.Round(time.Second))
	load.mu.Lock()
	defer load.mu.Unlock()
	accepted := load.accepted

	// Settle: everything is up; wait until every accepted command is final.
	settleStart := time.Now()
	var states map[string]string
	for {
		states = c.allStates()
		open := 0
		for id := range accepted {
			if s, ok := states[id]; !ok || !companion.IsFinal(s) {
				open++
			}
		}
		if open == 0 || time.Since(settleStart) > soakSettle {
			break
		}
		time.Sleep(2 * time.Second) // polling the API for the backlog to drain
	}
	settled := time.Since(settleStart)

	byState := map[string]int{}
	var lost []string
	for id := range accepted {
		s, ok := states[id]
		switch {
		case !ok:
			lost = append(lost, id+" (missing)")
		case !companion.IsFinal(s):
			lost = append(lost, id+" ("+s+")")
		default:
			byState[s]++
		}
	}
	executed, twice, expiredRun, inversions := 0, 0, 0, 0
	for _, dev := range c.devices {
		counts, err := sim.ReadExecLog(sim.ExecLogPath(c.simState, dev))
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		// A device runs its commands in the order they were accepted
		// (CONTRACT §2), which is the order of their ids (UUIDv7, rising
		// per device in commit order): one that ran after a newer one ran
		// out of order.
		order, err := sim.ReadExecOrder(sim.ExecLogPath(c.simState, dev))
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		newest := ""
		for _, id := range order {
			if id < newest {
				inversions++
				if inversions <= 5 {
					t.Errorf("device %s ran %s after %s, accepted after it\nthe bridge's lines of the first:\n%s\nof the second:\n%s",
						dev, id, newest, linesWith(c.bridgeProc.logPath, id), linesWith(c.bridgeProc.logPath, newest))
				}
			}
			newest = max(newest, id)
		}
		for id, n := range counts {
			executed++
			if states[id] == companion.StateExpired {
				expiredRun++ // the device ran a command the server reports expired
				if expiredRun <= 5 {
					t.Errorf("device %s ran %s, which reads expired: %s\nthe bridge's lines of it:\n%s",
						dev, id, c.user.do("GET", "/api/v1/devices/"+dev+"/commands/"+id, nil).Body, linesWith(c.bridgeProc.logPath, id))
				}
			}
			if n > 1 {
				twice++
				t.Errorf("device %s executed %s %d times", dev, id, n)
			}
		}
	}

	var rej []string
	for status, n := range load.rejected {
		rej = append(rej, fmt.Sprintf("%d×%d", n, status))
	}
	sort.Strings(rej)
	var report strings.Builder
	fmt.Fprintf(&report, "%s: %s of load, %d devices, %d load workers; settled in %s\n", name, loadTime.Round(time.Second), len(c.devices), soakWorkers, settled.Round(time.Second))
	fmt.Fprintf(&report, "kills (SIGKILL + restart): %s\n", killed)
	fmt.Fprintf(&report, "requests %d: accepted %d, no answer %d, rejected %s\n", load.requests.Load(), len(accepted), load.refused.Load(), strings.Join(append(rej, "(none)")[:max(1, len(rej))], " "))
	fmt.Fprintf(&report, "accepted   %d\n", len(accepted))
	fmt.Fprintf(&report, "succeeded  %d\n", byState[companion.StateSucceeded])
	fmt.Fprintf(&report, "failed     %d\n", byState[companion.StateFailed])
	fmt.Fprintf(&report, "expired    %d\n", byState[companion.StateExpired])
	fmt.Fprintf(&report, "canceled   %d\n", byState[companion.StateCanceled])
	fmt.Fprintf(&report, "lost       %d\n", len(lost))
	fmt.Fprintf(&report, "executed   %d distinct command ids on the devices\n", executed)
	fmt.Fprintf(&report, "executed-twice %d\n", twice)
	fmt.Fprintf(&report, "expired-but-executed %d\n", expiredRun)
	fmt.Fprintf(&report, "executed-out-of-order %d\n", inversions)
	fmt.Fprintf(&report, "waited-out-predecessor %d\n", c.linesInBridgeLogs(neverCame))
	if byState[companion.StateExpired] > 0 {
		soakExpired(&report, load, states)
	}
	fmt.Print(report.String())
	if len(lost) > 0 {
		sort.Strings(lost)
		t.Errorf("%d accepted commands lost or not final, e.g. %v", len(lost), lost[:min(10, len(lost))])
	}
	if twice > 0 {
		t.Errorf("%d commands executed twice", twice)
	}
	if inversions > 0 {
		t.Errorf("%d commands executed after a newer command of their device", inversions)
	}
	if byState[companion.StateFailed] > 0 {
		t.Logf("failed commands (a final state, not a loss): see the server's command list for their errors")
	}
}

// soakBridgeArgs has the soaks' bridge log each command it takes in, and
// the one it names to run after (topics.Command.After), for the lines a
// failed check prints (linesWith).
var soakBridgeArgs = []string{"--log-level", "debug"}

// linesWith returns the lines of the file at path that contain s.
func linesWith(path, s string) string {
	b, _ := os.ReadFile(path)
	var out strings.Builder
	for line := range strings.Lines(string(b)) {
		if strings.Contains(line, s) {
			out.WriteString(line)
		}
	}
	return out.String()
}

// soakOp picks a request: mostly texts (some with the shortest TTL), then
// settings, images and app installs.
func soakOp(rng *rand.Rand, dev, img string, i int) (method, path string, body any) {
	dp := "/api/v1/devices/" + dev
	switch n := rng.IntN(100); {
	case n < 50:
		return "POST", dp + "/push/text", map[string]any{"text": fmt.Sprintf("soak %d", i)}
	case n < 60:
		return "POST", dp + "/push/text", map[string]any{"text": fmt.Sprintf("soak %d (short TTL)", i), "ttl_seconds": 60}
	case n < 80:
		return "PUT", dp + "/settings", map[string]any{"brightness": rng.IntN(101)}
	case n < 90:
		return "POST", dp + "/push/image", map[string]any{"image": img, "content_type": "image/png"}
	default:
		return "POST", dp + "/apps/install", map[string]any{"app_id": "weather", "version": "1.0.0"}
	}
}

// sendTo sends one request of the soak's user to the server at base.
func (c *procCluster) sendTo(hc *http.Client, base, method, path string, body any) procPush {
	js, _ := json.Marshal(body)
	req, err := http.NewRequest(method, base+path, bytes.NewReader(js))
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
	var buf bytes.Buffer
	_, err = buf.ReadFrom(resp.Body)
	return procPush{status: resp.StatusCode, body: buf.Bytes(), err: err}
}

// allStates lists every command of every device through the API: id → state.
func (c *procCluster) allStates() map[string]string {
	c.tb.Helper()
	states := map[string]string{}
	for _, dev := range c.devices {
		cursor := ""
		for {
			r := c.user.do("GET", "/api/v1/devices/"+dev+"/commands?limit=200&cursor="+cursor, nil)
			require.Equal(c.tb, 200, r.Status, "%s", r.Body)
			var page struct {
				Commands []struct {
					ID    string `json:"id"`
					State string `json:"state"`
				} `json:"commands"`
				NextCursor string `json:"next_cursor"`
			}
			require.NoError(c.tb, json.Unmarshal(r.Body, &page))
			for _, cmd := range page.Commands {
				states[cmd.ID] = cmd.State
			}
			if page.NextCursor == "" {
				break
			}
			cursor = page.NextCursor
		}
	}
	return states
}

// neverCame is in the bridge's log line of a command whose predecessor
// (topics.Command.After) did not come within agent.DefaultAfterWait: the
// device's queue stood still that long behind it.
const neverCame = "the command this one runs after never came"

// linesInBridgeLogs counts the lines with s in the logs of every bridge
// process the cluster launched.
func (c *procCluster) linesInBridgeLogs(s string) int {
	n := 0
	for _, path := range c.bridgeLogs {
		b, _ := os.ReadFile(path)
		n += strings.Count(string(b), s)
	}
	return n
}

// soakExpired writes, per device, how many of its commands expired and
// when in the load the first and last of them were accepted (an id's
// UUIDv7 time): read against the chaos's timeline in the log, it says
// which outage a device's queue stood still through.
func soakExpired(w *strings.Builder, load *soakLoad, states map[string]string) {
	type span struct {
		n           int
		first, last time.Duration
	}
	spans := map[string]*span{}
	for id, dev := range load.accepted {
		if states[id] != companion.StateExpired {
			continue
		}
		u, err := uuid.Parse(id)
		if err != nil {
			continue
		}
		sec, nsec := u.Time().UnixTime()
		at := time.Unix(sec, nsec).Sub(load.start)
		sp := spans[dev]
		if sp == nil {
			sp = &span{first: at, last: at}
			spans[dev] = sp
		}
		sp.n++
		sp.first, sp.last = min(sp.first, at), max(sp.last, at)
	}
	devs := make([]string, 0, len(spans))
	for dev := range spans {
		devs = append(devs, dev)
	}
	sort.Strings(devs)
	for _, dev := range devs {
		sp := spans[dev]
		fmt.Fprintf(w, "expired on %s: %d, accepted %s–%s into the load\n", dev, sp.n, sp.first.Round(100*time.Millisecond), sp.last.Round(100*time.Millisecond))
	}
}
