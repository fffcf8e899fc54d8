package agent_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// syncBuffer is a log destination safe for the agent's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// goneAway is a simulated device that answers no read while away, as a
// wearable out of its gateway's radio range.
type goneAway struct {
	*sim.Device
	away atomic.Bool
}

var errOutOfReach = errors.New("le-connection-abort-by-local")

func (d *goneAway) Info(ctx context.Context) (companion.DeviceInfo, error) {
	if d.away.Load() {
		return companion.DeviceInfo{}, errOutOfReach
	}
	return d.Device.Info(ctx)
}

func (d *goneAway) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	if d.away.Load() {
		return nil, nil, errOutOfReach
	}
	return d.Device.Settings(ctx)
}

// A device out of its bridge's reach (a wearable taken out of range, one
// whose link comes and goes) failed both reads of every report, once a
// StatusInterval (a minute), and the bridge logged a warning for each:
// two a minute a device for as long as it stayed away, and as many again
// each time its link dropped; a gateway with a few hundred wearables
// away at night wrote hundreds of thousands of lines a day. The first
// failure is said (of each read, at most), the ones that follow while it
// stays away are not (at debug), and its first read after says it
// answers again (bug 457).
func TestADeviceOutOfReachIsLoggedOnceUntilItAnswers(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	var logs syncBuffer
	sd := newSim("dev-1")
	dev := &goneAway{Device: sd}
	startBridge(t, b, nil, w, bridgeConfig{
		devices:  []*sim.Device{sd},
		wrap:     func(*sim.Device) agent.Device { return dev },
		interval: 20 * time.Millisecond,
		logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})
	w.waitStatus("dev-1", "online", func(s topics.Status) bool { return s.Online })

	dev.away.Store(true)
	topic, _ := tree.Status("dev-1")
	offline := func(m message) bool {
		s, err := topics.ParseStatus(m.payload)
		return m.topic == topic && err == nil && !s.Online
	}
	const reports = 6
	w.waitFor("offline reports", func(message) bool { return w.count(offline) >= reports })
	// One; or two when it went away between the two reads of a report,
	// its settings' failing first.
	failed := strings.Count(logs.String(), "level=WARN msg=\"reading device")
	if failed < 1 || failed > 2 {
		t.Errorf("%d warnings of the device's reads failing over %d reports while away; want 1 (2 at most)\n%s", failed, reports, logs.String())
	}

	online := func(m message) bool {
		s, err := topics.ParseStatus(m.payload)
		return m.topic == topic && err == nil && s.Online
	}
	before := w.count(online)
	dev.away.Store(false)
	w.waitFor("online again", func(message) bool { return w.count(online) > before })
	if n := strings.Count(logs.String(), "the device answers again"); n != 1 {
		t.Errorf("%d lines saying the device answers again; want 1\n%s", n, logs.String())
	}
}
