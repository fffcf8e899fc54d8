package testenv

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

const (
	inChildRoleEnv = "TESTENV_INCHILD_ROLE"
	inChildPIDEnv  = "TESTENV_INCHILD_PID"
)

// TestInChildTellsWhereAHungChildWas runs, in a test binary given 8 s
// (-test.timeout), a test whose child (InChild) never ends. The child must
// end within the binary's time, and the test fail with the child's own
// report of where it hung (its goroutines); no child may be left running.
// Before, the child had no timeout of its own: the parent binary
// panicked at its timeout, waiting in InChild, with nothing of the child
// (its output was in a buffer nobody printed), and the child, orphaned,
// ran on for good, with whatever it had started (bug 453). The child had
// a tenth of the parent's time less; with 5 s, half a second, which a
// loaded CI machine spent starting the child, so that the parent timed out
// first (bug 580).
func TestInChildTellsWhereAHungChildWas(t *testing.T) {
	if os.Getenv(inChildRoleEnv) == "parent" {
		if !InChild(t) {
			return
		}
		if err := os.WriteFile(os.Getenv(inChildPIDEnv), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
			t.Fatal(err)
		}
		select {} // a test that never ends
	}
	pidFile := filepath.Join(t.TempDir(), "pid")
	cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.timeout=8s")
	cmd.Env = append(os.Environ(), inChildRoleEnv+"=parent", inChildPIDEnv+"="+pidFile)
	out, err := cmd.CombinedOutput()
	if b, rerr := os.ReadFile(pidFile); rerr == nil {
		if pid, _ := strconv.Atoi(string(b)); pid > 0 {
			if kerr := syscall.Kill(pid, syscall.SIGKILL); !errors.Is(kerr, syscall.ESRCH) {
				t.Errorf("the hung child (pid %d) was still running after its parent ended", pid)
			}
		}
	}
	if err == nil {
		t.Fatalf("the test binary whose child hung passed:\n%s", out)
	}
	if s := string(out); !strings.Contains(s, "the child:") || !strings.Contains(s, "TestInChildTellsWhereAHungChildWas") || strings.Count(s, "test timed out") != 1 {
		t.Errorf("the test binary whose child hung did not fail with the child's own report of it:\n%s", out)
	}
}
