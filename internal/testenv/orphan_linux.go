package testenv

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// EndsWithTestBinary has cmd, an engine a test starts (Mosquitto,
// dbus-daemon, PostgreSQL, a NATS node, one of the project's binaries),
// killed should the test binary die without running its cleanups: a
// -timeout panic, a SIGKILL. Without it the engine ran on, holding its port
// and its directory, after the run that started it had ended. Call it
// before cmd.Start; it keeps what cmd.SysProcAttr already sets.
//
// The signal is tied to the thread that started cmd, and the Go runtime
// ends only threads locked to a goroutine (runtime.LockOSThread) that exits
// locked: start engines from ordinary goroutines.
func EndsWithTestBinary(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}

// orphanEnv names, in the child binary EnginesEndWithTestBinary starts,
// the test it runs and the file where it writes the engine's pid.
const orphanEnv = "COMPANION_TEST_ORPHAN"

// EnginesEndWithTestBinary checks that what start starts ends with the
// test binary. It runs t's test again in a child binary; there start
// starts its engines and returns their pids, and the child kills itself
// (SIGKILL: no cleanup runs). t fails if any of the pids outlives the
// child by 10 s. In the child it never returns.
func EnginesEndWithTestBinary(t *testing.T, start func(tb testing.TB) []int) {
	t.Helper()
	if name, pidFile, ok := strings.Cut(os.Getenv(orphanEnv), "="); ok && name == t.Name() {
		var b strings.Builder
		for _, pid := range start(t) {
			fmt.Fprintln(&b, pid)
		}
		if err := os.WriteFile(pidFile, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	pidFile := filepath.Join(t.TempDir(), "pids")
	cmd := exec.Command(os.Args[0], "-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.v")
	// The child's temporary directories (t.TempDir) go under one of the
	// parent's, which its cleanup removes: the child, killed, removes none.
	cmd.Env = append(os.Environ(), orphanEnv+"="+t.Name()+"="+pidFile, "TMPDIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	b, rerr := os.ReadFile(pidFile)
	if rerr != nil {
		t.Fatalf("the child started no engine (%v; it ended with %v):\n%s", rerr, err, out)
	}
	for _, f := range strings.Fields(string(b)) {
		pid, _ := strconv.Atoi(f)
		if pid <= 0 {
			t.Fatalf("the child wrote a pid %q", f)
		}
		deadline := time.Now().Add(10 * time.Second)
		for running(pid) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if running(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("process %d, started by the test binary, still ran 10 s after the binary was killed", pid)
		}
	}
}

// running reports whether pid is a process that has not exited: one that
// exists and is not a zombie waiting for its new parent to reap it.
func running(pid int) bool {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command's name, which is in parentheses and
	// may hold either.
	_, rest, ok := strings.Cut(string(stat[bytes.LastIndexByte(stat, ')')+1:]), " ")
	return ok && !strings.HasPrefix(rest, "Z") && !strings.HasPrefix(rest, "X")
}
