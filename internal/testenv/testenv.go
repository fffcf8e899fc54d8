// Package testenv holds what every test kit of the project needs of its
// surroundings: the repository's root (for mosquitto.conf and bin/), the go
// command, a free port, and a bounded wait for a change seen only by asking. mqtttest, pgtest and natstest build on it.
package testenv

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// RepoRoot is the directory of go.mod, found by walking up from the
// working directory (a package's directory under go test).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: run the tests inside the module")
		}
		dir = parent
	}
}

// Eventually polls cond until it holds, failing tb once timeout has passed.
// It is for state seen only by asking (the API, the store, a login): the
// poll, every 5 ms at first and every 100 ms at most, is a bounded wait for
// an observable change, not a sleep to synchronise. Wait on a channel
// wherever there is one. Unlike testify's Eventually, cond runs on the
// test's own goroutine, so it may fail the test itself (require.NoError
// inside it), which FailNow allows only there.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for pause := 5 * time.Millisecond; !cond(); pause = min(2*pause, 100*time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(pause)
	}
}

// GoTool is the go command for tests that build the project's binaries:
// $GO when set (as make passes it), else the go on PATH, where go test puts
// its own GOROOT/bin first.
func GoTool() (string, error) {
	if g := os.Getenv("GO"); g != "" {
		return g, nil
	}
	return exec.LookPath("go")
}

// ReadRepoFile returns the file at rel, a path from the repository's root,
// failing tb if it cannot be read.
func ReadRepoFile(tb testing.TB, rel string) []byte {
	tb.Helper()
	root, err := RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago, for
// a server that must be told its port before it starts (a child process,
// Mosquitto, NATS, PostgreSQL). For servers that can listen on port 0 and
// report their address, prefer that.
//
// The port is below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), where a port from listening on :0 would
// be: the kernel gives ports of that range to outgoing connections too, so
// that between FreePort and the server's bind any connection this machine
// opens (a test's HTTP client, a bridge dialing its broker) could take it,
// and the server would fail with "address already in use". Below the
// range only another listener can, and a port is not handed out twice by
// one process. Where no such range is known it falls back to :0.
func FreePort(tb testing.TB) int {
	tb.Helper()
	if p, ok := freePortIn(belowEphemeral()); ok {
		return p
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// freePortIn returns a port of [lo, hi) that no listener holds and that
// this process has not handed out, trying up to 200 at random.
func freePortIn(lo, hi int) (int, bool) {
	for range 200 {
		if hi <= lo {
			break
		}
		p := lo + rand.IntN(hi-lo)
		if !reservePort(p) {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue // another listener has it; it stays reserved
		}
		ln.Close()
		return p, true
	}
	return 0, false
}

var (
	portsMu  sync.Mutex
	reserved = map[int]bool{}
)

// reservePort reports whether p was not handed out before by this process,
// and reserves it.
func reservePort(p int) bool {
	portsMu.Lock()
	defer portsMu.Unlock()
	if reserved[p] {
		return false
	}
	reserved[p] = true
	return true
}

// belowEphemeral returns the ports FreePort picks from: up to 10,000 ports
// just below the ephemeral range, and none below 10,000, where services
// listen by convention. It returns lo == hi when the range cannot be read.
func belowEphemeral() (lo, hi int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0, 0
	}
	first, err := strconv.Atoi(f[0])
	if err != nil {
		return 0, 0
	}
	return max(10000, first-10000), max(10000, first)
}

// Buffer collects output, such as a logger's, written from many goroutines
// while a test reads it.
type Buffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *Buffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// String returns what was written so far.
func (w *Buffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// childEnv names, in a child process InChild started, the test it runs.
const childEnv = "COMPANION_TEST_CHILD"

// isChild reports whether this process is the child InChild started for
// tb's test.
func isChild(tb testing.TB) bool {
	return os.Getenv(childEnv) == tb.Name()
}

// InChild runs the test alone in a child process of the test binary and
// reports whether this is that child, where the test goes on: for faults
// the process cannot take back (a seccomp filter, testenv.FailSyscalls),
// that may end it (SIGBUS), or that the test binary's own files must not
// meet (a file size limit, testenv.LimitFileSize). In the parent the child has run, the test
// failed with its output if it failed, and the test returns. The child
// has the parent's time less a margin (-test.timeout), so that one that
// hangs fails the test with its goroutines rather than outlive it.
func InChild(t *testing.T) bool {
	t.Helper()
	if isChild(t) {
		return true
	}
	args := []string{"-test.run=^" + regexp.QuoteMeta(t.Name()) + "$", "-test.v"}
	if d, ok := t.Deadline(); ok {
		// The child times out before the parent, so that a child that
		// hangs ends, and says where, rather than outlive the parent (bug
		// 453). The margin is half the time left, at most 5 s: it must
		// cover the child's start on a loaded machine, which a tenth of a
		// short timeout did not (bug 580).
		left := time.Until(d)
		args = append(args, "-test.timeout="+(left-min(left/2, 5*time.Second)).String())
	}
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the child: %v\n%s", err, out)
	}
	t.Logf("the child:\n%s", out)
	return false
}
