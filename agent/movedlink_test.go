package agent_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A device moved to another bridge, both in its range: the broker refuses
// the bridge it left the device's commands from the move on. That bridge
// read the device every minute on, and kept its link until it dropped;
// the device, which takes one central at a time as most BLE peripherals
// do, did not advertise, and its new bridge could not connect to it: each
// of its commands failed timeout there. The bridge it left now reads it no
// more and lets its link go; it reads it again once the broker grants its
// commands again (docs/reliability.md, bug 486).
func TestABridgeLetsTheLinkOfADeviceMovedAwayGo(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	moved := twoRadios(t, b, w)

	// The move: the broker refuses b1 the device's commands, and closes
	// its connection; b1 connects again and is refused.
	filter := mustCommandsFilter(t, "dev-1")
	hook.refuse(filter)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := moved.Info(ctx); err != nil {
		t.Fatalf("the device's new bridge could not reach it in 10 s, the bridge it left holding its link: %v", err)
	}
	moved.Close() // its link goes

	// Moved back: b1 reads it again.
	before := w.count(onlineStatus)
	hook.grant(filter)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 3)
	w.waitFor("an online status once the broker grants the device again", func(message) bool { return w.count(onlineStatus) > before })
}

// A bridge that lost its uplink (its broker out of reach) while in radio
// range of its devices, which an admin then moves to a bridge beside it:
// it kept each device's link until it dropped, and a device that takes one
// central at a time was kept from its new bridge for as long as the bridge
// was away. A bridge away from the broker for a whole status interval now
// lets the links go, and reads the devices again once back
// (docs/reliability.md, bug 487).
func TestABridgeAwayFromTheBrokerLetsItsLinksGo(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	moved := twoRadios(t, b, w)

	b.hook.away.Store(true) // away: its connections are closed unanswered
	b.dropClient(t, "companion-bridge-b1")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := moved.Info(ctx); err != nil {
		t.Fatalf("another bridge could not reach the device in 10 s, the bridge away from the broker holding its link: %v", err)
	}
	moved.Close()

	before := w.count(onlineStatus)
	b.hook.away.Store(false)
	w.waitFor("an online status once the bridge is back", func(message) bool { return w.count(onlineStatus) > before })
}

// A device moved to another bridge in range of both while the bridge it
// left runs a long command on it (a firmware update, an image over a slow
// link): the server failed the command at the move, device_not_served,
// but the bridge ran it on to its end, holding the device's link, and a
// device that takes one central at a time could not be reached by its new
// bridge for that long: the commands sent there failed timeout, or waited.
// The bridge it left now stops the command as the broker refuses it the
// device, lets the link go, and holds the command with the device's
// others; the device moved back, the command runs again there
// (docs/reliability.md, bug 504).
func TestABridgeStopsTheCommandOfADeviceMovedAway(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	started := make(chan struct{})
	moved := twoRadiosWith(t, b, w, radiosConfig{
		sim:            sim.Options{ExecDelay: 12 * time.Second}, // the device takes 12 s over each command
		requestTimeout: 30 * time.Second,
		wrap: func(d *gatt.Device) agent.Device {
			return &textStarts{Device: d, started: started}
		},
	})
	long := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "takes the device 12 s"})
	w.send(long)
	waitClosed(t, started, "the command did not start on the device")

	// The move: the broker refuses b1 the device's commands, and closes
	// its connection; b1 connects again and is refused.
	filter := mustCommandsFilter(t, "dev-1")
	hook.refuse(filter)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)
	reachedWhileHeld(t, w, moved, long.ID, "the bridge it left holding its link for a command the server failed at the move")

	// Moved back: b1 runs it again (the device drops an id it has run).
	hook.grant(filter)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 3)
	if r := w.waitFinal("dev-1", long.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the command held once the device moved back: %s reply; want succeeded", r.State)
	}
}

// A bridge deleted on the server (or given another secret) while it runs
// a long command on a device, which its user then assigns to a bridge
// beside it: the broker refuses the bridge's login from then on, and the
// server failed the command as it deleted the bridge. The bridge held the
// commands queued (bug 243) but ran the running one on to its end, its
// link kept, and the device's new bridge could not reach a device that
// takes one central at a time for that long. The bridge now stops it and
// lets the link go as the broker refuses its login, as it does when the
// broker refuses it one device, and runs it again once let in
// (docs/reliability.md, bug 505).
func TestABridgeWhoseLoginIsRefusedStopsItsCommands(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	started := make(chan struct{})
	moved := twoRadiosWith(t, b, w, radiosConfig{
		sim:            sim.Options{ExecDelay: 12 * time.Second},
		requestTimeout: 30 * time.Second,
		wrap: func(d *gatt.Device) agent.Device {
			return &textStarts{Device: d, started: started}
		},
	})
	long := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "takes the device 12 s"})
	w.send(long)
	waitClosed(t, started, "the command did not start on the device")

	b.hook.refuse.Store(true) // the bridge deleted: its logins are refused
	b.dropClient(t, "companion-bridge-b1")
	reachedWhileHeld(t, w, moved, long.ID, "the bridge whose login is refused holding its link for a command the server failed")

	b.hook.refuse.Store(false) // let in again: it runs again
	if r := w.waitFinal("dev-1", long.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the command held once the bridge is let in: %s reply; want succeeded", r.State)
	}
}

// reachedWhileHeld wants the device's new bridge (moved, closed after) to
// reach dev-1 within 5 s, which the old one holding its link (held, in a
// failure) keeps it from, and the old one's command id stopped, not
// answered final.
func reachedWhileHeld(t *testing.T, w *watcher, moved *gatt.Device, id, held string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := moved.Info(ctx); err != nil {
		t.Fatalf("the device's new bridge could not reach it in 5 s, %s: %v", held, err)
	}
	if rs := w.replies("dev-1", id); len(rs) > 0 && companion.IsFinal(rs[len(rs)-1].State) {
		t.Errorf("the stopped command was answered %s; want it held", rs[len(rs)-1].State)
	}
	moved.Close()
}

// textStarts is a device whose PushText closes started as it begins.
type textStarts struct {
	*gatt.Device
	once    sync.Once
	started chan struct{}
}

func (d *textStarts) PushText(ctx context.Context, cmdID, title, text string) error {
	d.once.Do(func() { close(d.started) })
	return d.Device.PushText(ctx, cmdID, title, text)
}

// onlineStatus matches dev-1's statuses that say online.
func onlineStatus(m message) bool {
	st, _ := tree.Status("dev-1")
	s, err := topics.ParseStatus(m.payload)
	return m.topic == st && err == nil && s.Online
}

// twoRadios runs bridge b1 with one simulated device, dev-1, over a GATT
// link of its own radio (a sim.Network), reading it every 50 ms, and
// returns a gatt.Device on a second radio in range of the same device
// (another bridge's), once b1 has read it online.
func twoRadios(t *testing.T, b *testBroker, w *watcher) *gatt.Device {
	t.Helper()
	return twoRadiosWith(t, b, w, radiosConfig{})
}

// radiosConfig is what twoRadiosWith changes of twoRadios' setup.
type radiosConfig struct {
	sim sim.Options // dev-1's; its ID is set
	// requestTimeout is the gatt.Devices' (default 1 s).
	requestTimeout time.Duration
	// wrap, when set, stands between the bridge and its gatt.Device.
	wrap func(*gatt.Device) agent.Device
}

// twoRadiosWith is twoRadios with the device, its GATT requests and the
// bridge's side of it as cfg says.
func twoRadiosWith(t *testing.T, b *testBroker, w *watcher, cfg radiosConfig) *gatt.Device {
	t.Helper()
	cfg.sim.ID = "dev-1"
	if cfg.requestTimeout == 0 {
		cfg.requestTimeout = time.Second
	}
	sd := sim.New(cfg.sim)
	p := sim.NewPeripheral(sd, sim.PeripheralOptions{})
	fast := sim.LinkOptions{KBPS: 200_000, Latency: -1, ConnectDelay: -1}
	radio1, radio2 := sim.NewNetwork(fast), sim.NewNetwork(fast)
	radio1.Add("dev-1", p)
	radio2.Add("dev-1", p)
	device := func(n *sim.Network) *gatt.Device {
		d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: n, MinBackoff: time.Millisecond, MaxBackoff: 50 * time.Millisecond,
			RequestTimeout: cfg.requestTimeout})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	old, other := device(radio1), device(radio2)
	t.Cleanup(func() {
		old.Close()
		other.Close()
		radio1.Close()
		radio2.Close()
		p.Close()
	})
	startBridge(t, b, nil, w, bridgeConfig{
		devices: []*sim.Device{sd},
		wrap: func(*sim.Device) agent.Device {
			if cfg.wrap != nil {
				return cfg.wrap(old)
			}
			return old
		},
		interval: 50 * time.Millisecond,
	})
	w.waitStatus("dev-1", "online", func(s topics.Status) bool { return s.Online })
	return other
}

// A firmware update running when the broker refuses the bridge its device
// (moved away) is stopped as any command is (bug 504) while it uploads,
// but not once the image is marked for test: stopped between the device's
// reboot into it and its confirmation, the device ran an image nobody
// confirmed, which MCUboot reverts at its next reset, and its new bridge
// read a firmware version that would not last. That part takes a reboot's
// time, seconds, and runs to its end.
func TestAFirmwareUpdateMarkedForTestIsNotStopped(t *testing.T) {
	b, hook := startSubscribeBroker(t)
	w := newWatcher(t, b)
	bs := startBlobServer(t)
	dev := &markedOTA{Device: newSim("dev-1"), marked: make(chan struct{}), release: make(chan struct{}), stopped: make(chan struct{})}
	startBridge(t, b, bs, w, bridgeConfig{
		devices: []*sim.Device{dev.Device},
		wrap:    func(*sim.Device) agent.Device { return dev },
	})
	c := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "2.0.0", Blob: bs.add(firmwareImage(t, "2.0.0", []byte("new firmware")))})
	w.send(c)
	waitClosed(t, dev.marked, "the firmware update did not reach its test phase")

	hook.refuse(mustCommandsFilter(t, "dev-1"))
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2) // the refusal taken in
	select {
	case <-dev.stopped:
		t.Fatal("a firmware update marked for test on the device was stopped as the broker refused the device: MCUboot reverts it at the next reset, and nobody confirms it")
	default:
	}
	close(dev.release)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("the firmware update: %s reply (%+v); want succeeded", r.State, r.Error)
	}
}

// markedOTA is a device whose firmware update says it is past its upload
// (progress 95: the image marked for test, the device rebooting), then
// waits for release before it ends.
type markedOTA struct {
	*sim.Device
	marked, release, stopped chan struct{}
}

func (d *markedOTA) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	progress(95)
	close(d.marked)
	select {
	case <-d.release:
	case <-ctx.Done():
		close(d.stopped)
		return ctx.Err()
	}
	return d.Device.UpdateFirmware(ctx, cmdID, version, image, nil)
}
