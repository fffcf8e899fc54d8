package gctune_test

import (
	"fmt"
	"os"
	"os/exec"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/gctune"
	"github.com/devicecompanion/companion/internal/testenv"
)

const childEnv = "GCTUNE_TEST_CHILD"

// TestMain runs the child of the tests: Set, then what the runtime has.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		limit, err := gctune.Set()
		fmt.Printf("set=%d err=%v gogc=%d memlimit=%d\n", limit, err, debug.SetGCPercent(-1), debug.SetMemoryLimit(-1))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild runs this test binary as the child, first moved into a
// cgroup by move when it is not empty, with env for the collector's
// variables of this process.
func runChild(t *testing.T, move string, env ...string) string {
	t.Helper()
	script := `exec "$0"`
	if move != "" {
		script = move + " && " + script
	}
	cmd := exec.Command("sh", "-c", script, os.Args[0])
	cmd.Env = append(env, childEnv+"=1")
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); name != "GOGC" && name != "GOMEMLIMIT" && name != "AUTOMEMLIMIT" {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	return strings.TrimSpace(string(out))
}

// In a container or a unit with a memory limit, the binaries' collector
// target of 400 let the heap grow to five times the live one, past the
// limit, and the kernel killed the process. The collector is told of nine
// tenths of the cgroup's limit (docs/reliability.md, bug 474); GOGC and
// GOMEMLIMIT, when set, have the last word, and without a limit there is
// none.
func TestTheCgroupsMemoryLimitIsTheCollectors(t *testing.T) {
	const limit = 256 << 20
	want := int64(limit * 9 / 10)

	got := runChild(t, testenv.MemoryCgroup(t, limit))
	require.Contains(t, got, "err=<nil>")
	require.Contains(t, got, fmt.Sprintf("set=%d ", want), "a limit of %d", limit)
	require.Contains(t, got, fmt.Sprintf("gogc=%d ", gctune.Percent))
	require.Contains(t, got, fmt.Sprintf("memlimit=%d", want))

	got = runChild(t, testenv.MemoryCgroup(t, limit), "GOGC=50", "GOMEMLIMIT=100MiB")
	require.Contains(t, got, "gogc=50 ", "GOGC given")
	require.Contains(t, got, fmt.Sprintf("memlimit=%d", 100<<20), "GOMEMLIMIT given")

	got = runChild(t, "")
	require.Contains(t, got, "set=0 ", "no limit")
}
