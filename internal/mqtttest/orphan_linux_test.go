package mqtttest

import (
	"testing"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestMosquittoEndsWithItsTestBinary kills a test binary that has started
// Mosquitto: the broker must end with it. Before, a run of make test cut off
// by -timeout left its Mosquittos running, each on its port.
func TestMosquittoEndsWithItsTestBinary(t *testing.T) {
	testenv.EnginesEndWithTestBinary(t, func(tb testing.TB) []int {
		m := StartMosquitto(tb)
		return []int{m.cmd.Process.Pid}
	})
}
