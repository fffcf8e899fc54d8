package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/devicecompanion/companion/internal/testenv"
)

// setFileSizeLimit sets the process pid's RLIMIT_FSIZE soft limit (the
// hard one kept): its writes past byte n of a file then fail with EFBIG,
// as on a full disk.
func setFileSizeLimit(tb testing.TB, pid int, n uint64) {
	tb.Helper()
	var old unix.Rlimit
	require.NoError(tb, unix.Prlimit(pid, unix.RLIMIT_FSIZE, nil, &old))
	require.NoError(tb, unix.Prlimit(pid, unix.RLIMIT_FSIZE, &unix.Rlimit{Cur: n, Max: old.Max}, nil))
}

// Fault: the server's disk fills under a steady load of commands, the
// bridge running them meanwhile, and space comes back. Every request is
// a 202 or a 503 unavailable; the server stays up, accepts again once
// space is back, and every command it accepted, before, during or after,
// succeeds, run once by its device; none it refused is run. And the log
// says once that the data directory cannot be written, with what to do,
// and once that it takes writes again: not a line for every request
// refused and every reply taken again, which are at debug level (its log
// goes through a pipe, out of reach of the file size limit).
func TestProcessServerDiskFillsUnderLoad(t *testing.T) {
	c := newProcCluster(t, 4)
	c.serverArgs = []string{"--log-level", "debug"}
	c.startServer()
	c.setupFleet()
	c.startBridge()
	pid := c.server.cmd.Process.Pid

	const workers = 8
	hc := loadClient(workers)
	defer hc.CloseIdleConnections()
	var (
		mu        sync.Mutex
		accepted  = map[string]string{}
		bad       []string
		refused   atomic.Int64
		okAfter   atomic.Int64 // 202s since the limit was lifted
		lifted    atomic.Bool
		stop      = make(chan struct{})
		loaded    = make(chan struct{}) // closed at the 100th 202
		full      = make(chan struct{}) // closed at the 1000th 503
		resumed   = make(chan struct{}) // closed at the 50th 202 after the lift
		closeOnce sync.Once
		wg        sync.WaitGroup
		next      atomic.Int64
	)
	for range workers {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				i := int(next.Add(1))
				dev := c.devices[i%len(c.devices)]
				p := c.push(hc, dev, i)
				var prob struct{ Code string }
				switch {
				case p.acceptedID() != "":
					mu.Lock()
					accepted[p.acceptedID()] = dev
					if len(accepted) == 100 {
						close(loaded)
					}
					mu.Unlock()
					if lifted.Load() && okAfter.Add(1) == 50 {
						close(resumed)
					}
				case p.err == nil && p.status == 503 && json.Unmarshal(p.body, &prob) == nil && prob.Code == "unavailable":
					if refused.Add(1) == 1000 {
						close(full)
					}
				default:
					mu.Lock()
					bad = append(bad, fmt.Sprintf("%d %v %s", p.status, p.err, p.body))
					mu.Unlock()
					closeOnce.Do(func() { close(stop) })
					return
				}
			}
		})
	}
	waitOrStop := func(ch <-chan struct{}, what string) {
		t.Helper()
		select {
		case <-ch:
		case <-stop:
			wg.Wait()
			t.Fatalf("while waiting for %s: %q", what, bad)
		case <-time.After(2 * time.Minute): // a bound on a hang, not a speed
			closeOnce.Do(func() { close(stop) })
			wg.Wait()
			t.Fatalf("no %s in 2 minutes (%d accepted, %d refused)", what, len(accepted), refused.Load())
		}
	}
	waitOrStop(loaded, "the first 202s")
	setFileSizeLimit(t, pid, 0)
	waitOrStop(full, "the 503s of a full disk")
	testenv.Eventually(t, time.Minute, "a reply taken again twice", func() bool {
		return logHas(t, c, `msg="storing a reply failed; taking it again"`, "attempt=3")
	})
	status, detail := c.readyz(t)
	require.Equal(t, 503, status, "/readyz while the disk is full")
	require.Contains(t, detail, "cannot write")
	lifted.Store(true)
	setFileSizeLimit(t, pid, unix.RLIM_INFINITY)
	waitOrStop(resumed, "the 202s once space is back")
	closeOnce.Do(func() { close(stop) })
	wg.Wait()
	require.Empty(t, bad, "answers neither 202 nor 503 unavailable")
	require.True(t, c.server.running(), "the server exited")
	t.Logf("%d accepted, %d refused while the disk was full", len(accepted), refused.Load())
	c.checkExactlyOnce(accepted)
	checkStoreSaysIt(t, c, 5)
	testenv.Eventually(t, time.Minute, "the log to say the data directory takes writes again", func() bool {
		return logHas(t, c, `level=INFO msg="store: the data directory takes writes again"`)
	})
	log, err := os.ReadFile(c.server.logPath)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(string(log), `level=ERROR msg="store: the data directory cannot be written`), "the fault said once")
	require.Contains(t, string(log), "free space on its disk", "what to do")
}

// logHas says whether a line of the server's log has every one of parts.
func logHas(t *testing.T, c *procCluster, parts ...string) bool {
	t.Helper()
	log, err := os.ReadFile(c.server.logPath)
	require.NoError(t, err)
	for line := range strings.Lines(string(log)) {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
			return true
		}
	}
	return false
}
