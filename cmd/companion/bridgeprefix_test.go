package main

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A bridge run with another --topic-prefix than the server's, on
// Mosquitto with the rights the server writes: the broker refuses every
// device's command filter, drops its "online" and statuses, and every
// command reads sent. The bridge said only that the broker refused the
// commands of some devices, as of a device moved away; it must say that
// it refuses them all, naming its prefix, and count them in its metrics
// (bug 485).
func TestABridgeOnAnotherPrefixSaysSo(t *testing.T) {
	t.Run("Mosquitto", func(t *testing.T) {
		m, mq := startWithMosquitto(t, t.TempDir())
		bridgeOnAnotherPrefix(t, m, mq.URL)
	})
	t.Run("NATS", func(t *testing.T) {
		cl, m := startNATSCallout(t)
		bridgeOnAnotherPrefix(t, m, cl.MQTTURL())
	})
}

// bridgeOnAnotherPrefix runs a bridge of two devices on acme/v1 beside the
// server m on companion/v1, and waits for it to name --topic-prefix.
func bridgeOnAnotherPrefix(t *testing.T, m *Main, url string) {
	f := setupFleet(t, m, "dev-1", "dev-2")
	said := newLogSignal("--topic-prefix")
	logger := slog.New(slog.NewTextHandler(io.MultiWriter(newTBWriter(t), said), &slog.HandlerOptions{Level: slog.LevelWarn}))
	devs, sims := []agent.Device{}, map[string]*sim.Device{}
	for _, id := range []string{"dev-1", "dev-2"} {
		s := sim.New(sim.Options{ID: id})
		devs, sims[id] = append(devs, s), s
	}
	obs := &refusedObserver{}
	runBridge(t, m, url, f, devs, sims, func(o *agent.Options) {
		o.Topics = topics.MustNew("acme/v1")
		o.Logger = logger
		o.Observer = obs
	})
	select {
	case <-said.seen:
	case <-time.After(60 * time.Second):
		t.Fatal("the bridge never said that the broker refuses every device's commands, naming --topic-prefix")
	}
	if n := obs.n.Load(); n != 2 {
		t.Errorf("devices refused, as the metrics have it: %d; want 2", n)
	}
}

// refusedObserver keeps the bridge's last count of devices refused
// (companion_bridge_devices_refused).
type refusedObserver struct{ n atomic.Int64 }

func (o *refusedObserver) CommandDone(string, string, bool, time.Duration) {}
func (o *refusedObserver) MQTTConnected(bool)                              {}
func (o *refusedObserver) SpoolWritable(bool)                              {}
func (o *refusedObserver) ReplyUnheard()                                   {}
func (o *refusedObserver) DevicesRefused(n int)                            { o.n.Store(int64(n)) }
