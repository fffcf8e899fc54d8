package agent_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A firmware update's first upload request is answered once img_mgmt has
// erased the slot, minutes for a large image on external flash, and the
// device answers the status read sent behind it only then. The reporter
// bounded the read at its own 30 s whatever the device did, so the device
// read offline once during every long erase, though its link was up and
// its update went on. A device busy with requests it still has time to
// answer now does not read offline; one that is gone still does (bug 468).
func TestADeviceBusyErasingForAnUpdateNeverReadsOffline(t *testing.T) {
	// 150 ms per 4 KiB: the second update's erase of the 64 KiB the first
	// left in the slot takes 2.4 s, eight report bounds.
	n, bs, w, offline := startUpdatingBridge(t,
		sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond, EraseTime: 150 * time.Millisecond},
		gatt.DeviceOptions{MinBackoff: time.Millisecond, RequestTimeout: time.Second})
	update := func(version string) {
		t.Helper()
		fw := firmwareImage(t, version, bytes.Repeat([]byte("firmware-"+version), 64<<10/len("firmware-"+version)))
		c := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: version, Blob: bs.add(fw)})
		w.send(c)
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Fatalf("update to %s: %s %+v; want succeeded", version, r.State, r.Error)
		}
		w.waitStatus("dev-1", "firmware "+version, func(s topics.Status) bool { return s.Online && s.FirmwareVersion == version })
	}
	update("2.0.0")
	before := w.count(offline)
	update("2.0.1")
	if got := w.count(offline) - before; got != 0 {
		t.Errorf("the device read offline %d times during an update whose slot erase took 2.4 s, with reads bounded at 300 ms; want 0", got)
	}

	// Gone: out of reach, its link dropped. It reads offline as before.
	n.Add("dev-1", nil)
	n.Drop("dev-1")
	w.waitFor("offline once out of reach", func(m message) bool { return offline(m) })
}

// After the upload, the device reboots into the update, and MCUboot swaps
// the images before the new one runs: tens of seconds for a large image.
// The reporter's reads found no device meanwhile, and it read offline
// once at every update. It reads busy until the swap may have ended, or
// until it answers again (bug 472).
func TestADeviceRebootingIntoItsUpdateNeverReadsOffline(t *testing.T) {
	// 1.5 s from the reboot to advertising again: five report bounds.
	n, bs, w, offline := startUpdatingBridge(t,
		sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 1500 * time.Millisecond},
		gatt.DeviceOptions{MinBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, RequestTimeout: time.Second})
	w.waitStatus("dev-1", "online", func(s topics.Status) bool { return s.Online })
	before := w.count(offline)
	fw := firmwareImage(t, "2.0.0", bytes.Repeat([]byte("firmware-2.0.0"), 64<<10/len("firmware-2.0.0")))
	c := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "2.0.0", Blob: bs.add(fw)})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("update to 2.0.0: %s %+v; want succeeded", r.State, r.Error)
	}
	w.waitStatus("dev-1", "firmware 2.0.0", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "2.0.0" })
	if got := w.count(offline) - before; got != 0 {
		t.Errorf("the device read offline %d times during an update whose reboot took 1.5 s, with reads bounded at 300 ms; want 0", got)
	}
	n.Add("dev-1", nil)
	n.Drop("dev-1")
	w.waitFor("offline once out of reach", func(m message) bool { return offline(m) })
}

// startUpdatingBridge starts a bridge of one device, dev-1, a simulated
// peripheral of popts reached through gatt with dopts, its reports read
// every 50 ms and bounded at 300 ms. It returns the device's network, the
// blob server for its updates, the watcher, and what tells its status
// offline.
func startUpdatingBridge(t *testing.T, popts sim.PeripheralOptions, dopts gatt.DeviceOptions) (*sim.Network, *blobServer, *watcher, func(message) bool) {
	t.Helper()
	t.Cleanup(agent.SetReportTimeout(300 * time.Millisecond))
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	sd := newSim("dev-1")
	n := sim.NewNetwork(sim.LinkOptions{KBPS: 200_000, Latency: -1, ConnectDelay: -1})
	n.Add("dev-1", sim.NewPeripheral(sd, popts))
	dopts.ID, dopts.Connector = "dev-1", n
	gd, err := gatt.NewDevice(dopts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		gd.Close()
		n.Close()
	})
	startBridge(t, b, bs, w, bridgeConfig{
		devices:  []*sim.Device{sd},
		wrap:     func(*sim.Device) agent.Device { return gd },
		interval: 50 * time.Millisecond,
	})
	topic, _ := tree.Status("dev-1")
	return n, bs, w, func(m message) bool {
		s, err := topics.ParseStatus(m.payload)
		return m.topic == topic && err == nil && !s.Online
	}
}
