package gatt_test

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
)

// firmwareImage builds an MCUboot image of version of exactly size bytes.
func firmwareImage(tb testing.TB, version string, size int) []byte {
	tb.Helper()
	v, err := mcuboot.ParseVersion(version)
	if err != nil {
		tb.Fatal(err)
	}
	const overhead = 0x200 + 4 + 4 + 32 // header as Zephyr pads it, TLV info, SHA-256 TLV
	payload := randomBytes(tb, size-overhead)
	b, err := mcuboot.Build(payload, mcuboot.Options{Version: v, HeaderSize: 0x200})
	if err != nil || len(b) != size {
		tb.Fatalf("Build: %d bytes, %v", len(b), err)
	}
	return b
}

// The stock flow over the smallest MTU with the link dropping all the
// time: the upload resumes from the device's offset, the device reboots
// into the image for test and the bridge confirms it; settings saved
// before survive the reboot.
func TestOTAOverMTU23WithDrops(t *testing.T) {
	opts := sim.LinkOptions{MTU: 23, KBPS: 4000, Latency: -1, ConnectDelay: -1, DropEvery: 50 * time.Millisecond}
	d, s, n := newSimDevice(t, opts, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := d.UpdateSettings(ctx, "s1", map[string]any{"volume": 7.0, "timezone": "Europe/Paris"}); err != nil {
		t.Fatalf("UpdateSettings: %v", err)
	}
	img := firmwareImage(t, "1.4.2+7", 120<<10)
	var last int
	err := d.UpdateFirmware(ctx, "fw-1", "1.4.2+7", img, func(pct int) { last = pct })
	if err != nil {
		t.Fatalf("UpdateFirmware: %v", err)
	}
	if s.Firmware() != "1.4.2+7" || !s.FirmwareConfirmed() || last != 100 {
		t.Errorf("device runs %s (confirmed %v), progress %d; want 1.4.2+7 confirmed, 100", s.Firmware(), s.FirmwareConfirmed(), last)
	}
	if s.Boots() != 1 {
		t.Errorf("%d boots; want 1", s.Boots())
	}
	st := d.TransferStats()
	if n.Drops() < 2 || len(st) != 1 || st[0].Attempts < 2 {
		t.Errorf("drops %d, stats %+v: the upload was not cut", n.Drops(), st)
	}
	info, err := d.Info(ctx)
	if err != nil || info.FirmwareVersion != "1.4.2+7" {
		t.Errorf("Info = %+v, %v; want firmware 1.4.2+7 from the image state", info, err)
	}
	vals, _, err := d.Settings(ctx)
	if err != nil || vals["volume"] != int64(7) || vals["timezone"] != "Europe/Paris" {
		t.Errorf("settings after the reboot = %v, %v; want the saved ones", vals, err)
	}
	// The same command again finds the image running and confirmed.
	if err := d.UpdateFirmware(ctx, "fw-1", "1.4.2+7", img, nil); err != nil || s.Boots() != 1 {
		t.Errorf("UpdateFirmware again = %v, %d boots; want nil without a reboot", err, s.Boots())
	}
	t.Logf("drops %d, upload attempts %d, sent %d of %d bytes", n.Drops(), st[0].Attempts, st[0].DataBytesSent, len(img))
}

// A device that comes back on its old image fails the command with a code
// of its own, whether MCUboot refused the image or the new image crashed
// before it was confirmed; a corrupt upload (match false) fails before any
// reboot.
func TestOTAFailures(t *testing.T) {
	for _, tt := range []struct {
		name  string
		hook  func(*sim.Device)
		code  string
		boots int
	}{
		{"MCUboot refuses the image", (*sim.Device).FailNextBoot, gatt.CodeFirmwareReverted, 1},
		{"the new image crashes before confirming", (*sim.Device).CrashNextBoot, gatt.CodeFirmwareReverted, 2},
		{"corrupt upload", (*sim.Device).CorruptNextUpload, gatt.CodeChecksumMismatch, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d, s, _ := newSimDevice(t, fastLink, gatt.DeviceOptions{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			tt.hook(s)
			err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 40_000), nil)
			if code := errorCode(err); code != tt.code {
				t.Fatalf("UpdateFirmware = %v (code %q); want %s", err, code, tt.code)
			}
			if s.Firmware() != "1.0.0" || !s.FirmwareConfirmed() || s.Boots() != tt.boots {
				t.Errorf("device runs %s (confirmed %v) after %d boots; want 1.0.0 confirmed after %d", s.Firmware(), s.FirmwareConfirmed(), s.Boots(), tt.boots)
			}
			// The next update goes through.
			if err := d.UpdateFirmware(ctx, "fw-2", "2.0.1", firmwareImage(t, "2.0.1", 30_000), nil); err != nil || s.Firmware() != "2.0.1" {
				t.Errorf("the next update = %v, firmware %s", err, s.Firmware())
			}
		})
	}
	t.Run("not an MCUboot image", func(t *testing.T) {
		d, _, _ := newSimDevice(t, fastLink, gatt.DeviceOptions{})
		err := d.UpdateFirmware(context.Background(), "fw-1", "2.0.0", randomBytes(t, 5000), nil)
		if code := errorCode(err); code != gatt.CodeInvalidPayload {
			t.Errorf("UpdateFirmware(random bytes) = %v (code %q)", err, code)
		}
		err = d.UpdateFirmware(context.Background(), "fw-1", "2.0.1", firmwareImage(t, "2.0.0", 5000), nil)
		if code := errorCode(err); code != gatt.CodeInvalidPayload {
			t.Errorf("UpdateFirmware(version 2.0.0 as 2.0.1) = %v (code %q)", err, code)
		}
	})
}

// Images of MCUboot builds other than the default go through the stock
// flow: a SHA-512 image to a device whose MCUboot checks SHA-512 (its
// image state's hashes are 64 bytes), and images padded to the slot
// (imgtool sign --pad; --confirm, as zephyr.signed.confirmed.bin) sent
// without their padding, so that the device tests the image as any other:
// one that crashes is reverted, though its trailer asked for a permanent
// swap. A SHA-512 image to a device that checks SHA-256 fails saying so.
func TestOTAImageFormats(t *testing.T) {
	const slot = 128 << 10 // the secondary slot, as the padded images are made for
	payload := randomBytes(t, 40_000)
	for _, tt := range []struct {
		name   string
		device uint16 // the hash TLV of the device's MCUboot
		opts   mcuboot.Options
		crash  bool
		code   string
	}{
		{"SHA-512 image", mcuboot.TLVSHA512, mcuboot.Options{Hash: mcuboot.TLVSHA512}, false, ""},
		{"padded image", mcuboot.TLVSHA256, mcuboot.Options{SlotSize: slot}, false, ""},
		{"padded and confirmed image", mcuboot.TLVSHA256, mcuboot.Options{SlotSize: slot, Confirm: true}, false, ""},
		{"padded and confirmed image that crashes", mcuboot.TLVSHA256, mcuboot.Options{SlotSize: slot, Confirm: true}, true, gatt.CodeFirmwareReverted},
		{"padded SHA-512 image", mcuboot.TLVSHA512, mcuboot.Options{Hash: mcuboot.TLVSHA512, SlotSize: slot, Confirm: true, MaxAlign: 16}, false, ""},
		{"SHA-512 image to a device that checks SHA-256", mcuboot.TLVSHA256, mcuboot.Options{Hash: mcuboot.TLVSHA512}, false, gatt.CodeDeviceError},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d, s, _, _ := newSimPeripheralOf(t, sim.Options{ImageHash: tt.device}, fastLink,
				sim.PeripheralOptions{MaxUpload: slot, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}, gatt.DeviceOptions{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			tt.opts.Version, tt.opts.HeaderSize = mcuboot.Version{Major: 2}, 0x200
			b := mcuboot.MustBuild(payload, tt.opts)
			img, err := mcuboot.Parse(b)
			if err != nil {
				t.Fatal(err)
			}
			if tt.crash {
				s.CrashNextBoot()
			}
			err = d.UpdateFirmware(ctx, "fw-1", "2.0.0", b, nil)
			if code := errorCode(err); code != tt.code {
				t.Fatalf("UpdateFirmware = %v (code %q); want %q", err, code, tt.code)
			}
			if st := d.TransferStats(); len(st) != 1 || st[0].DataBytesSent != img.End {
				t.Errorf("uploads %+v; want one of the %d bytes of the image without its padding (of %d)", st, img.End, len(b))
			}
			switch {
			case tt.code == "":
				if s.Firmware() != "2.0.0" || !s.FirmwareConfirmed() || s.Boots() != 1 {
					t.Errorf("device runs %s (confirmed %v) after %d boots; want 2.0.0 confirmed after 1", s.Firmware(), s.FirmwareConfirmed(), s.Boots())
				}
				info, err := d.Info(ctx)
				if err != nil || info.FirmwareVersion != "2.0.0" {
					t.Errorf("Info = %+v, %v; want firmware 2.0.0", info, err)
				}
			case tt.crash:
				if s.Firmware() != "1.0.0" || !s.FirmwareConfirmed() || s.Boots() != 2 {
					t.Errorf("device runs %s (confirmed %v) after %d boots; want 1.0.0 confirmed after 2: the image tested and reverted", s.Firmware(), s.FirmwareConfirmed(), s.Boots())
				}
			default:
				if s.Firmware() != "1.0.0" || s.Boots() != 0 || !strings.Contains(err.Error(), "SHA-512") {
					t.Errorf("device runs %s after %d boots, error %q; want 1.0.0, no reboot, the image's hash named", s.Firmware(), s.Boots(), err)
				}
			}
		})
	}
}

// wholeWrites records every write to the SMP characteristic (its record
// is a tap of tapConnector), to check that each carries whole messages.
type wholeWrites struct {
	mu     sync.Mutex
	writes [][]byte
}

func (w *wholeWrites) record(_ gatt.Link, data []byte) ([]byte, error) {
	w.mu.Lock()
	w.writes = append(w.writes, bytes.Clone(data))
	w.mu.Unlock()
	return data, nil
}

// A device without reassembly (no CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY)
// gets every request in one write, although its buffers are larger: after
// the probe, no write holds part of a message.
func TestNoReassemblySingleWrites(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(sim.LinkOptions{MTU: 185, KBPS: 200_000, Latency: -1, ConnectDelay: -1})
	p := sim.NewPeripheral(s, sim.PeripheralOptions{NoReassembly: true, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond})
	n.Add("dev-1", p)
	rec := &wholeWrites{}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: rec.record}, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if err := d.PushText(ctx, "t1", "", "hello"); err != nil {
		t.Fatalf("PushText: %v", err)
	}
	if err := d.UpdateSettings(ctx, "s1", map[string]any{"language": "fr"}); err != nil {
		t.Fatalf("UpdateSettings: %v", err)
	}
	if err := d.PushImage(ctx, "i1", "image/png", randomBytes(t, 10_000)); err != nil {
		t.Fatalf("PushImage: %v", err)
	}
	if err := d.UpdateFirmware(ctx, "fw-1", "1.1.0", firmwareImage(t, "1.1.0", 30_000), nil); err != nil {
		t.Fatalf("UpdateFirmware: %v", err)
	}
	if s.Firmware() != "1.1.0" || len(s.Images()) != 1 {
		t.Errorf("firmware %s, %d images", s.Firmware(), len(s.Images()))
	}
	// A text longer than a write goes as an upload, a write per request.
	long := string(bytes.Repeat([]byte("x"), 400))
	if err := d.PushText(ctx, "t2", "", long); err != nil {
		t.Errorf("a text longer than a write: %v", err)
	}
	if got := s.Texts(); len(got) != 2 || got[1].Text != long {
		t.Errorf("%d texts shown", len(got))
	}

	rec.mu.Lock()
	defer rec.mu.Unlock()
	probes := 0
	for _, w := range rec.writes {
		h, err := gatt.ParseHeader(w)
		if err != nil || len(w) != gatt.HeaderSize+int(h.Len) {
			if len(w) == 185-3 && err == nil && h.Group == gatt.GroupOS && h.ID == gatt.CmdOSEcho {
				probes++ // the reassembly probe's first write, and its tail
				continue
			}
			if len(w) < gatt.HeaderSize {
				continue
			}
			t.Errorf("a write of %d bytes is not one whole message (header %+v)", len(w), h)
		}
	}
	if probes == 0 || p.Dropped() != 0 {
		t.Errorf("%d probes, %d writes dropped by the device", probes, p.Dropped())
	}
	t.Logf("%d writes, %d probes", len(rec.writes), probes)
}

// Settings writes go out together, but a write the device refuses stops
// the update before commit and save, and the earlier values are written
// back, so that what the device persists is never half of an update.
func TestRefusedSettingWriteIsNotCommitted(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(sim.LinkOptions{MTU: 185, KBPS: 200_000, Latency: -1, ConnectDelay: -1})
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{NoReassembly: true}))
	rec := &wholeWrites{}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: rec.record}, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	err = d.UpdateSettings(ctx, "s1", map[string]any{"brightness": 500.0, "language": "fr", "volume": 3.0})
	if code := errorCode(err); code != gatt.CodeInvalidPayload {
		t.Fatalf("UpdateSettings with brightness 500 = %v (code %q); want %s", err, code, gatt.CodeInvalidPayload)
	}
	if err := d.UpdateSettings(ctx, "s2", map[string]any{"volume": 4.0}); err != nil {
		t.Fatalf("UpdateSettings: %v", err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var seq []uint8
	for _, w := range rec.writes {
		if h, err := gatt.ParseHeader(w); err == nil && h.Group == gatt.GroupSettings && h.Op == gatt.OpWrite {
			seq = append(seq, h.ID)
		}
	}
	// The first update: its writes, the three earlier values written back,
	// no commit, no save; the second: a write, commit, save. (The reads of
	// the values in use before each update are not counted.)
	v, c, sv := gatt.CmdSettingsValue, gatt.CmdSettingsCommit, gatt.CmdSettingsSave
	if want := []uint8{v, v, v, v, v, v, v, c, sv}; !slices.Equal(seq, want) && !slices.Equal(seq, want[1:]) && !slices.Equal(seq, want[2:]) {
		t.Errorf("settings writes %v; want %v (or fewer first writes)", seq, want)
	}
}

// The same firmware again after a corrupt upload is uploaded again: the
// slot lists the image's hash (img_mgmt reads it from the TLVs without
// checking the image), but only an upload the device matched is marked
// for test.
func TestOTARetryAfterCorruptUploadUploadsAgain(t *testing.T) {
	d, s, _ := newSimDevice(t, fastLink, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	img := firmwareImage(t, "2.0.0", 40_000)
	s.CorruptNextUpload()
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", img, nil); errorCode(err) != gatt.CodeChecksumMismatch {
		t.Fatalf("UpdateFirmware with a corrupt upload = %v (code %q); want %s", err, errorCode(err), gatt.CodeChecksumMismatch)
	}
	err := d.UpdateFirmware(ctx, "fw-2", "2.0.0", img, nil)
	if err != nil || s.Firmware() != "2.0.0" || s.Boots() != 1 {
		t.Fatalf("UpdateFirmware again = %v (code %q), firmware %s after %d boots; want nil, 2.0.0 after 1", err, errorCode(err), s.Firmware(), s.Boots())
	}
	if st := d.TransferStats(); len(st) != 2 || st[1].DataBytesSent < int64(len(img)) {
		t.Errorf("transfers %+v; want the whole image sent again", st)
	}
}

// dropFirstUpload drops the link at the first image upload request once
// armed, before the device gets it (a tap of tapConnector).
type dropFirstUpload struct {
	n     *sim.Network
	armed atomic.Bool
}

func (c *dropFirstUpload) tap(_ gatt.Link, data []byte) ([]byte, error) {
	if h, err := gatt.ParseHeader(data); err == nil && h.Group == gatt.GroupImage && h.ID == gatt.CmdImageUpload &&
		c.armed.CompareAndSwap(true, false) {
		c.n.Drop("dev-1")
		return nil, gatt.ErrDisconnected
	}
	return data, nil
}

// A link that drops during an upload is no proof that the upload ended:
// here it drops before the device got the first request, while the slot
// still lists the image of a corrupt upload, and the bridge resumes the
// upload rather than marking that image for test.
func TestOTADropDoesNotTrustTheSlot(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
	c := &dropFirstUpload{n: n}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: c.tap}, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	img := firmwareImage(t, "2.0.0", 40_000)

	s.CorruptNextUpload()
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", img, nil); errorCode(err) != gatt.CodeChecksumMismatch {
		t.Fatalf("UpdateFirmware with a corrupt upload = %v (code %q); want %s", err, errorCode(err), gatt.CodeChecksumMismatch)
	}
	c.armed.Store(true)
	if err := d.UpdateFirmware(ctx, "fw-2", "2.0.0", img, nil); err != nil || s.Firmware() != "2.0.0" {
		t.Fatalf("UpdateFirmware again = %v (code %q), firmware %s after %d boots", err, errorCode(err), s.Firmware(), s.Boots())
	}
	if n.Drops() != 1 {
		t.Errorf("%d drops; want 1", n.Drops())
	}
}

// swallowReset loses every OS reset request before the device gets it (a
// tap of tapConnector): the device neither answers nor reboots, as a
// wedged one would not.
func swallowReset(_ gatt.Link, data []byte) ([]byte, error) {
	if h, err := gatt.ParseHeader(data); err == nil && h.Group == gatt.GroupOS && h.ID == gatt.CmdOSReset {
		return nil, nil
	}
	return data, nil
}

// newTappedSim is a simulated device that resets and boots in 5 ms,
// reached through tap (tapConnector) on fastLink, with requests timing out
// after 300 ms, and a context for the test's requests.
func newTappedSim(t *testing.T, tap func(gatt.Link, []byte) ([]byte, error)) (*gatt.Device, *sim.Device, *sim.Network, context.Context) {
	t.Helper()
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: tap},
		MinBackoff: time.Millisecond, RequestTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		n.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return d, s, n, ctx
}

// A reset the device never answers fails the update with a timeout and
// drops the link, as any request that timed out does: the next command
// starts on a new connection rather than on the one the device stopped
// answering.
func TestUnansweredResetDropsTheLink(t *testing.T) {
	d, _, n, ctx := newTappedSim(t, swallowReset)

	err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
	if !errors.Is(err, gatt.ErrTimeout) {
		t.Fatalf("UpdateFirmware with the reset lost = %v; want gatt.ErrTimeout", err)
	}
	if d.Connected() {
		t.Error("the link the reset timed out on is still open")
	}
	before := n.Connects()
	if _, err := d.Info(ctx); err != nil {
		t.Fatalf("Info after the timeout: %v", err)
	}
	if got := n.Connects() - before; got != 1 {
		t.Errorf("Info after the timeout made %d connections; want 1", got)
	}
}

// A reset the device answers rc 2 (MGMT_ERR_ENOMEM: another transport of
// its MCUmgr holds the buffer its answer needs, so smp.c did not run it)
// is asked again after a pause, as every other request is (bug 117): the
// update goes on once the buffer is free. Before, the reset, which does
// not go through retry, failed the update device_error with the image
// uploaded and pending (docs/reliability.md, bug 178).
func TestResetWithNoBufferIsAskedAgain(t *testing.T) {
	d, s, _, p := newSimPeripheral(t, fastLink, sim.PeripheralOptions{BufCount: 2, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond},
		gatt.DeviceOptions{RequestTimeout: 5 * time.Second, MinBackoff: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var held atomic.Bool
	progress := func(pct int) {
		// 95: the image is uploaded and marked; the reset goes next.
		if pct == 95 && held.CompareAndSwap(false, true) {
			time.AfterFunc(300*time.Millisecond, p.HoldBuffers(1))
		}
	}
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), progress); err != nil {
		t.Fatalf("UpdateFirmware while another transport held a buffer at the reset: %v", err)
	}
	if !held.Load() || p.NoMemory() == 0 {
		t.Fatal("the reset was not answered MGMT_ERR_ENOMEM: the test shows nothing")
	}
	if s.Firmware() != "2.0.0" || !s.FirmwareConfirmed() || s.Boots() != 1 {
		t.Errorf("device runs %s (confirmed %v) after %d boots; want 2.0.0 confirmed after 1", s.Firmware(), s.FirmwareConfirmed(), s.Boots())
	}
}

// loseConfirm loses, once armed, every image state write after a reset
// before the device gets it (a tap of tapConnector): an update whose
// device rebooted into the new image and never heard the confirmation.
type loseConfirm struct {
	armed atomic.Bool
	reset atomic.Bool
}

func (c *loseConfirm) tap(_ gatt.Link, data []byte) ([]byte, error) {
	h, err := gatt.ParseHeader(data)
	if err != nil || !c.armed.Load() {
		return data, nil
	}
	switch {
	case h.Group == gatt.GroupOS && h.ID == gatt.CmdOSReset:
		c.reset.Store(true)
	case h.Group == gatt.GroupImage && h.ID == gatt.CmdImageState && h.Op == gatt.OpWrite && c.reset.Load():
		return nil, nil
	}
	return data, nil
}

// An update after one that ended between the reboot and the confirmation,
// the device running that image under test: the other slot holds the
// confirmed image MCUboot reverts to, which img_mgmt does not let an
// upload erase ("no free slot"). The bridge resets the device, MCUboot
// reverts, and the update goes on (bug 227).
func TestOTAAfterAnUnconfirmedUpdate(t *testing.T) {
	c := &loseConfirm{}
	d, s, _, ctx := newTappedSim(t, c.tap)

	c.armed.Store(true)
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil); err == nil {
		t.Fatal("UpdateFirmware with the confirmation lost = nil; want an error")
	}
	if s.Firmware() != "2.0.0" || s.FirmwareConfirmed() || s.Boots() != 1 {
		t.Fatalf("device runs %s (confirmed %v) after %d boots; want 2.0.0 under test after 1", s.Firmware(), s.FirmwareConfirmed(), s.Boots())
	}
	c.armed.Store(false)
	if err := d.UpdateFirmware(ctx, "fw-2", "3.0.0", firmwareImage(t, "3.0.0", 20_000), nil); err != nil {
		t.Fatalf("UpdateFirmware to 3.0.0 = %v (code %q); want nil", err, errorCode(err))
	}
	// The reset that reverted to 1.0.0, and the one into 3.0.0.
	if s.Firmware() != "3.0.0" || !s.FirmwareConfirmed() || s.Boots() != 3 {
		t.Errorf("device runs %s (confirmed %v) after %d boots; want 3.0.0 confirmed after 3", s.Firmware(), s.FirmwareConfirmed(), s.Boots())
	}
}

// An update to another version while the device holds an image pending
// from an update that ended before its reboot fails as img_mgmt answers
// it, "no free slot", and says why and what clears it: the update to the
// pending version goes through (bug 228).
func TestOTAWithAnotherImagePendingSaysWhy(t *testing.T) {
	var lose atomic.Bool
	tap := func(l gatt.Link, data []byte) ([]byte, error) {
		if lose.Load() {
			return swallowReset(l, data)
		}
		return data, nil
	}
	d, s, _, ctx := newTappedSim(t, tap)

	lose.Store(true)
	pending := firmwareImage(t, "2.0.0+3", 20_000)
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0+3", pending, nil); !errors.Is(err, gatt.ErrTimeout) {
		t.Fatalf("UpdateFirmware with the reset lost = %v; want gatt.ErrTimeout", err)
	}
	lose.Store(false)
	err := d.UpdateFirmware(ctx, "fw-2", "3.0.0", firmwareImage(t, "3.0.0", 20_000), nil)
	if code := errorCode(err); code != gatt.CodeDeviceError || !strings.Contains(err.Error(), "no free slot") ||
		!strings.Contains(err.Error(), "holds firmware 2.0.0+3, to boot at the next reset") || !strings.Contains(err.Error(), "update it to 2.0.0+3, or reboot it") {
		t.Fatalf("UpdateFirmware to 3.0.0 = %v (code %q); want device_error, no free slot, saying what the other slot holds and what clears it", err, code)
	}
	if err := d.UpdateFirmware(ctx, "fw-3", "2.0.0+3", pending, nil); err != nil || s.Firmware() != "2.0.0+3" || !s.FirmwareConfirmed() {
		t.Errorf("UpdateFirmware to the pending 2.0.0+3 = %v; device runs %s (confirmed %v)", err, s.Firmware(), s.FirmwareConfirmed())
	}
}

// A stock device erases its slot for the whole image before it answers the
// request that opens the upload (img_mgmt without
// CONFIG_IMG_ERASE_PROGRESSIVELY): seconds for a large image on slow flash,
// longer than the request timeout. The bridge waits for it, in proportion
// to the image, and the update goes through (bug 259).
func TestOTAWaitsForTheSlotErase(t *testing.T) {
	popts := sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond, EraseTime: 150 * time.Millisecond}
	d, s, _, _ := newSimPeripheral(t, fastLink, popts, gatt.DeviceOptions{RequestTimeout: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The first update finds the secondary slot empty, with nothing to
	// erase; after it the slot holds the old image.
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 64<<10), nil); err != nil {
		t.Fatalf("UpdateFirmware to 2.0.0 = %v", err)
	}
	// 16 sectors of 150 ms: 2.4 s of erase, over a request timeout of 1 s.
	if err := d.UpdateFirmware(ctx, "fw-2", "2.0.1", firmwareImage(t, "2.0.1", 64<<10), nil); err != nil {
		t.Fatalf("UpdateFirmware to 2.0.1, its slot erased for 2.4 s = %v (code %q); want nil", err, errorCode(err))
	}
	if s.Firmware() != "2.0.1" || !s.FirmwareConfirmed() {
		t.Errorf("device runs %s (confirmed %v); want 2.0.1 confirmed", s.Firmware(), s.FirmwareConfirmed())
	}
}

// version1 makes every request SMP version 1, as an MCUmgr older than
// version 2 takes it (it ignores the header's version bits): the device
// answers in version 1, a group's error as MCUmgr's rc. It follows the
// messages across the writes of each link (a request split into several
// has its header in the first); the reassembly probe's second write, too
// short for a header, goes as it is.
type version1 struct {
	mu   sync.Mutex
	left map[gatt.Link]int // bytes of the message under way still to come
}

func (v *version1) tap(l gatt.Link, data []byte) ([]byte, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.left == nil {
		v.left = map[gatt.Link]int{}
	}
	if n := v.left[l]; n > 0 {
		v.left[l] = max(n-len(data), 0)
		return data, nil
	}
	h, err := gatt.ParseHeader(data)
	if err != nil {
		return data, nil
	}
	v.left[l] = max(gatt.HeaderSize+int(h.Len)-len(data), 0)
	data = bytes.Clone(data)
	data[0] &^= 3 << 3
	return data, nil
}

// noSlotAs is a Connector whose links hand the bridge img_mgmt's "no free
// slot" to an upload (version 2's {"err": {"group": 1, "rc": 9}}) as an
// older MCUmgr answers it, in SMP version 1: rc.
type noSlotAs struct {
	gatt.Connector
	rc int
}

type noSlotLink struct {
	gatt.Link
	rc int
}

func (c *noSlotAs) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &noSlotLink{Link: l, rc: c.rc}, nil
}

func (l *noSlotLink) Subscribe(ctx context.Context, uuid string, fn func([]byte)) error {
	return l.Link.Subscribe(ctx, uuid, func(b []byte) {
		h, err := gatt.ParseHeader(b)
		var st gatt.Status
		if err == nil && gatt.HeaderSize+int(h.Len) == len(b) && h.Group == gatt.GroupImage && h.ID == gatt.CmdImageUpload &&
			gatt.DecodeBody(b[gatt.HeaderSize:], &st) == nil && st.Err != nil && st.Err.RC == gatt.ImgErrNoFreeSlot {
			body, _ := gatt.EncodeBody(map[string]int{"rc": l.rc})
			h.Version, h.Len = gatt.SMPv1, uint16(len(body))
			b = append(gatt.AppendHeader(nil, h), body...)
		}
		fn(b)
	})
}

// A device that answers in SMP version 1 (an MCUmgr older than version 2,
// Zephyr before 3.3) says "no free slot" to an upload with an rc of its
// own: rc 5 (ENOENT) in Zephyr 3.0 to 3.2, rc 2 (ENOMEM) in the MCUmgr
// library of Zephyr 2.x, and rc 6 (EBADSTATE) where img_mgmt translates
// version 2's error 9. With the other slot pending, the update fails with
// the same explanation as over version 2: the pending version named, and
// what clears it. Before, it said only "device answered rc 5 (not found)"
// (or rc 2, "no memory", after five repeats as of a device short of
// buffers).
func TestOTAWithAnotherImagePendingSaysWhyInVersion1(t *testing.T) {
	for _, rc := range []int{gatt.RCNotFound, gatt.RCNoMemory, gatt.RCBadState} {
		t.Run("rc "+itoa(rc), func(t *testing.T) {
			var lose atomic.Bool
			s := sim.New(sim.Options{ID: "dev-1"})
			n := sim.NewNetwork(fastLink)
			n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}))
			tap := func(l gatt.Link, data []byte) ([]byte, error) {
				if lose.Load() {
					return swallowReset(l, data)
				}
				return data, nil
			}
			d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: &noSlotAs{Connector: n, rc: rc}, tap: tap},
				MinBackoff: time.Millisecond, RequestTimeout: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				d.Close()
				n.Close()
			})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			lose.Store(true)
			pending := firmwareImage(t, "2.0.0+3", 20_000)
			if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0+3", pending, nil); !errors.Is(err, gatt.ErrTimeout) {
				t.Fatalf("UpdateFirmware with the reset lost = %v; want gatt.ErrTimeout", err)
			}
			lose.Store(false)
			err = d.UpdateFirmware(ctx, "fw-2", "3.0.0", firmwareImage(t, "3.0.0", 20_000), nil)
			if code := errorCode(err); code != gatt.CodeDeviceError || !strings.Contains(err.Error(), "rc "+itoa(rc)) ||
				!strings.Contains(err.Error(), "holds firmware 2.0.0+3, to boot at the next reset") || !strings.Contains(err.Error(), "update it to 2.0.0+3, or reboot it") {
				t.Fatalf("UpdateFirmware to 3.0.0 = %v (code %q); want device_error, rc %d, saying what the other slot holds and what clears it", err, code, rc)
			}
			if err := d.UpdateFirmware(ctx, "fw-3", "2.0.0+3", pending, nil); err != nil || s.Firmware() != "2.0.0+3" || !s.FirmwareConfirmed() {
				t.Errorf("UpdateFirmware to the pending 2.0.0+3 = %v; device runs %s (confirmed %v)", err, s.Firmware(), s.FirmwareConfirmed())
			}
		})
	}
}

// A status read that reaches the device while it erases its slot for an
// upload waits behind the erase: the device answers its requests one at a
// time, in the order they came. The bridge gives the request that opens
// the upload the erase's time (bug 259); a request sent behind it must get
// it too. Before, the status read timed out during the erase, the bridge
// took the device for wedged and dropped the link: the status read failed
// (the device read offline) and the update's upload ran again over a new
// connection (bug 444).
func TestAStatusReadBehindTheSlotEraseWaitsForIt(t *testing.T) {
	popts := sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond, EraseTime: 150 * time.Millisecond}
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, popts))
	var watch atomic.Bool
	opened := make(chan struct{}, 1)
	tap := func(_ gatt.Link, data []byte) ([]byte, error) {
		// The first write of the update's first upload request (its
		// header): the request at off 0, which the device answers after
		// the erase.
		h, err := gatt.ParseHeader(data)
		if err == nil && h.Group == gatt.GroupImage && h.ID == gatt.CmdImageUpload && h.Op == gatt.OpWrite && watch.CompareAndSwap(true, false) {
			opened <- struct{}{}
		}
		return data, nil
	}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: tap},
		MinBackoff: time.Millisecond, RequestTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		n.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// After the first update the secondary slot holds the old image, which
	// the next upload erases: 16 sectors of 150 ms, 2.4 s, over a request
	// timeout of 1 s.
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 64<<10), nil); err != nil {
		t.Fatalf("UpdateFirmware to 2.0.0 = %v", err)
	}
	watch.Store(true)
	ota := make(chan error, 1)
	go func() { ota <- d.UpdateFirmware(ctx, "fw-2", "2.0.1", firmwareImage(t, "2.0.1", 64<<10), nil) }()
	select {
	case <-opened:
	case err := <-ota:
		t.Fatalf("UpdateFirmware to 2.0.1 ended before its upload began: %v", err)
	}
	start := time.Now()
	_, infoErr := d.Info(ctx)
	took := time.Since(start)
	if err := <-ota; err != nil {
		t.Fatalf("UpdateFirmware to 2.0.1 with a status read behind its erase = %v (code %q); want nil", err, errorCode(err))
	}
	stats := d.TransferStats()
	if infoErr != nil || stats[len(stats)-1].Attempts != 1 {
		t.Fatalf("a status read behind the 2.4 s erase = %v after %v, the upload ran over %d connections; want nil, 1 connection",
			infoErr, took.Round(time.Millisecond), stats[len(stats)-1].Attempts)
	}
}

// A link lost while img_mgmt erases the slot for an update does not stop
// the erase: flash does not stop half way, and Zephyr's SMP work queue
// runs the request to its end, then the requests of the next connection.
// Its first, the MCUmgr parameters read, waited the rest of the erase, and
// a device that left it unanswered for a request timeout was presumed
// wedged: the update failed timeout, though the device would have
// resumed it a moment later (bug 471).
func TestALinkLostDuringTheSlotEraseResumesTheUpdate(t *testing.T) {
	popts := sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond, EraseTime: 150 * time.Millisecond}
	d, s, n, p := newSimPeripheral(t, fastLink, popts, gatt.DeviceOptions{RequestTimeout: time.Second, ConnectTimeout: 500 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// After the first update the secondary slot holds the old image, which
	// the next upload erases: 16 sectors of 150 ms, 2.4 s, over a request
	// timeout of 1 s.
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 64<<10), nil); err != nil {
		t.Fatalf("UpdateFirmware to 2.0.0 = %v", err)
	}
	connects := n.Connects()
	ota := make(chan error, 1)
	go func() { ota <- d.UpdateFirmware(ctx, "fw-2", "2.0.1", firmwareImage(t, "2.0.1", 64<<10), nil) }()
	testenv.Eventually(t, 10*time.Second, "the slot erase", p.Erasing)
	if !n.Drop("dev-1") {
		t.Fatal("no link to drop")
	}
	if err := <-ota; err != nil {
		t.Fatalf("UpdateFirmware to 2.0.1 with the link lost during its 2.4 s erase = %v (code %q); want nil", err, errorCode(err))
	}
	// One after the drop, one after the reboot: the first, waiting for
	// the erase past the connection attempt's 500 ms, went on.
	if s.Firmware() != "2.0.1" || n.Connects()-connects != 2 {
		t.Errorf("the device runs %s after %d connections; want 2.0.1 after 2", s.Firmware(), n.Connects()-connects)
	}
}
