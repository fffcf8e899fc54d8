package agent_test

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// An operator following a command from the server's log to the bridge's
// by its id as a field (command_id=, device_id=, as the server's lines
// name them; a log pipeline's logfmt query) found none of the bridge's
// lines: the bridge named them cmd= and device= (bug 385).
func TestBridgeLogLinesNameCommandsAsTheServerDoes(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	var logs testenv.Buffer
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev},
		logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})

	dev.FailNext(errors.New("screen broken"))
	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "x"})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateFailed {
		t.Fatalf("final state %s; want failed", r.State)
	}
	var failed string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `msg="command failed"`) {
			failed = l
		}
	}
	if failed == "" {
		t.Fatalf("no line of the failure; log:\n%s", logs.String())
	}
	for _, want := range []string{"command_id=" + c.ID, "device_id=dev-1"} {
		if !strings.Contains(failed, want) {
			t.Errorf("the bridge's line of the failure = %q; want %s in it", failed, want)
		}
	}
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, " cmd=") || strings.Contains(l, " device=") {
			t.Errorf("a line names a command or device otherwise: %q", l)
		}
	}
}
