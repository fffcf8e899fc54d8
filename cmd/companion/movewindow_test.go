package main

import (
	"context"
	"io"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// A device moved to another bridge just after its bridge took a command
// in, before that bridge's "delivered" had reached the server (the bridge
// says it a quarter of a second after it takes a command, agent's
// deliveredDelay): the server read the command sent (or queued, on its
// way), not had, and sent it to the new bridge too, which ran it on the
// device the old one had handed it to already (CONTRACT §7: none is
// delivered twice). The move now waits for the old bridge's word on the
// commands on their way to it: what it had fails device_not_served as a
// delivered command does (docs/reliability.md, bugs 97 and 509), and only
// what it never had goes to the new bridge. Here bridge-1's uplink stalls
// as it takes the command, so that its word is still on the way when the
// device moves, whatever the machine's speed. On the embedded broker and
// on Mosquitto.
func TestAMoveWaitsForTheWordOfTheBridgeItLeaves(t *testing.T) {
	t.Parallel()
	for _, tb := range []struct {
		name  string
		start func(*testing.T, *slog.Logger) (*Main, string)
	}{
		{"embedded", func(t *testing.T, logger *slog.Logger) (*Main, string) {
			m := startServerLogging(t, Config{}, logger)
			return m, m.MQTTURL()
		}},
		{"mosquitto", func(t *testing.T, logger *slog.Logger) (*Main, string) {
			mq := mqtttest.StartMosquitto(t, serverAccount)
			m := startServerLogging(t, mosquittoConfig(Config{}, mq), logger)
			testenv.Eventually(t, 20*time.Second, "the server connected to Mosquitto", m.Broker.Ready)
			return m, mq.URL
		}},
	} {
		t.Run(tb.name, func(t *testing.T) {
			waiting := newLogSignal("moving a device: waiting for its bridge's word")
			unheard := newLogSignal("no word from its bridge on commands on their way")
			logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), waiting, unheard), &slog.HandlerOptions{Level: slog.LevelInfo}))
			m, mqttURL := tb.start(t, logger)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			f2 := addBridge(t, f, "bridge-2")
			dev := sim.New(sim.Options{ID: "dev-1"})
			handed := &handedCount{n: map[string]int{}}
			started := make(chan string, 1)
			release := make(chan struct{})
			first := &countingDevice{Device: dev, handed: handed, started: started, release: release}
			second := &countingDevice{Device: dev, handed: handed}

			u, err := url.Parse(mqttURL)
			require.NoError(t, err)
			link := testenv.NewRelay(t, u.Host)
			viaLink := *u
			viaLink.Host = link.Addr()
			sims := map[string]*sim.Device{"dev-1": dev}
			runBridge(t, m, viaLink.String(), f, []agent.Device{first}, sims, nil)
			runBridge(t, m, mqttURL, f2, []agent.Device{second}, sims, nil)
			waitOnline(t, f, true, "dev-1")

			link.HoldUplink() // what bridge-1 says from now on waits in its uplink
			id := f.user.pushText("dev-1", "taken by bridge-1 just before the move")
			select {
			case got := <-started:
				require.Equal(t, id, got)
			case <-time.After(30 * time.Second):
				t.Fatal("bridge-1 did not hand the command to the device")
			}

			moved := make(chan int, 1)
			go func() {
				r := f.admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": f2.bridgeID})
				moved <- r.Status
			}()
			status := 0
			select {
			case <-waiting.seen: // the move waits for bridge-1's word
			case status = <-moved: // the move did not wait
			case <-time.After(30 * time.Second):
				t.Fatal("the move neither answered nor waited for bridge-1's word")
			}
			link.ReleaseUplink() // its word (its PUBACK, its "delivered") comes in
			if status == 0 {
				select {
				case status = <-moved:
				case <-time.After(30 * time.Second):
					t.Fatal("the move did not answer")
				}
			}
			require.Equal(t, 200, status)
			select {
			case <-unheard.seen:
				t.Error("the move waited out its bound, though bridge-1's word came in")
			default:
			}
			close(release)

			next := f.user.pushText("dev-1", "on bridge-2")
			assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", next)["state"])
			assert.Equal(t, 1, handed.of(id), "times the command was handed to the device, by either bridge (CONTRACT §7: none is delivered twice)")
			cmd := f.user.waitFinal("dev-1", id)
			assert.Equal(t, "failed", cmd["state"], "%v", cmd)
			if e, ok := cmd["error"].(map[string]any); assert.True(t, ok, "%v", cmd) {
				assert.Equal(t, "device_not_served", e["code"])
			}
		})
	}
}

// handedCount counts the commands handed to a device, by id.
type handedCount struct {
	mu sync.Mutex
	n  map[string]int
}

func (h *handedCount) add(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n[id]++
}

func (h *handedCount) of(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n[id]
}

// countingDevice is a bridge's link to a simulated device that counts the
// texts handed to it, the device's dropping of an id it has run aside. With
// started set, its first text says its id there and waits for release (or
// its context) before the device has it.
type countingDevice struct {
	*sim.Device
	handed  *handedCount
	started chan string
	release chan struct{}
	once    sync.Once
}

func (d *countingDevice) PushText(ctx context.Context, cmdID, title, text string) error {
	d.handed.add(cmdID)
	if d.started != nil {
		first := false
		d.once.Do(func() { first = true })
		if first {
			d.started <- cmdID
			select {
			case <-d.release:
			case <-ctx.Done():
			}
		}
	}
	return d.Device.PushText(ctx, cmdID, title, text)
}
