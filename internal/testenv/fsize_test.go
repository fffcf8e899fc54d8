//go:build unix

package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// fsizeRoleEnv tells a child of TestLimitFileSizeLeavesTheTestLogAlone to
// be the test that limits file sizes.
const fsizeRoleEnv = "TESTENV_FSIZE_ROLE"

// TestLimitFileSizeLeavesTheTestLogAlone runs a test that limits file
// sizes as the project's disk tests do, in a test binary started as go
// test starts one whose result it may cache: with -test.testlogfile, a
// file the testing package writes through a buffer as the test opens,
// stats and reads the environment. The binary must pass. Before, the
// limit was set in the test binary's own process: the log's buffer,
// flushed while the limit held, kept the write's EFBIG, and the binary
// ended "testing: can't write testlog.txt: file too large" with status 2
// after every test had passed (go test -run 'TestSpool|TestBridgeSpool…'
// ./agent/ failed so, now and then; bug 448). A test that calls
// LimitFileSize outside InChild's child now fails, saying so.
func TestLimitFileSizeLeavesTheTestLogAlone(t *testing.T) {
	switch os.Getenv(fsizeRoleEnv) {
	case "limit":
		if !InChild(t) {
			return
		}
		lift := LimitFileSize(t, 0)
		statMany(t)
		lift()
		return
	case "outside":
		LimitFileSize(t, 0)
		t.Error("LimitFileSize outside a child went on")
		return
	}
	run := func(role string) (string, error) {
		log := filepath.Join(t.TempDir(), "testlog.txt")
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.testlogfile="+log)
		cmd.Env = append(os.Environ(), fsizeRoleEnv+"="+role)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run("limit"); err != nil {
		t.Fatalf("the test binary of a test that limited file sizes: %v\n%s", err, out)
	}
	out, err := run("outside")
	if err == nil || !strings.Contains(out, "call it only after testenv.InChild(t)") {
		t.Errorf("a test binary whose test called LimitFileSize outside InChild's child: %v; want it failed, saying to call InChild:\n%s", err, out)
	}
}

// statMany stats enough files to fill the test log's buffer (4 KiB) twice.
func statMany(tb testing.TB) {
	dir := tb.TempDir()
	for i := range 200 {
		os.Stat(filepath.Join(dir, strings.Repeat("f", 40)+strconv.Itoa(i)))
	}
}
