package testenv

import (
	"os/exec"
	"testing"
)

// TestAnEngineEndsWithItsTestBinary starts a process as the test kits start
// their engines and kills the test binary under it: the process must end
// too. Before, an engine whose test binary died without its cleanups (a
// -timeout panic) ran on: two Mosquittos outlived the runs of make test
// that timed out.
func TestAnEngineEndsWithItsTestBinary(t *testing.T) {
	EnginesEndWithTestBinary(t, func(tb testing.TB) []int {
		cmd := exec.Command("sleep", "600")
		EndsWithTestBinary(cmd)
		if err := cmd.Start(); err != nil {
			tb.Fatal(err)
		}
		return []int{cmd.Process.Pid}
	})
}
