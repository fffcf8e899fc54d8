package gatt_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// Without reassembly every request must fit one write of MTU − 3 bytes,
// and the bridge sends none that does not: the MTU each operation needs
// then, with command ids as long as the agent's (UUIDs), is the table of
// docs/gatt.md ("Requests and writes"). One below it the operation fails
// mtu_too_small (bug 196), by the bridge's own size check, which says so,
// and names the request's size and the limit.
func TestWithoutReassemblyTheMTUBoundsEveryRequest(t *testing.T) {
	const big = 70_000 // len and off past 65535 take their longest CBOR form
	cid := func(n int) string { return "0190a000-0000-7000-8000-" + strings.Repeat("0", 11) + itoa(n%10) }
	for _, tc := range []struct {
		name string
		mtu  int // the least that works
		run  func(ctx context.Context, d *gatt.Device) error
	}{
		{"status (reads with no body)", 23, func(ctx context.Context, d *gatt.Device) error { _, err := d.Info(ctx); return err }},
		{"settings write of an int", 43, func(ctx context.Context, d *gatt.Device) error {
			return d.UpdateSettings(ctx, cid(1), map[string]any{"volume": 3.0})
		}},
		{"settings write of a long time zone", 74, func(ctx context.Context, d *gatt.Device) error {
			return d.UpdateSettings(ctx, cid(2), map[string]any{"timezone": "America/Argentina/ComodRivadavia"})
		}},
		{"short text", 62, func(ctx context.Context, d *gatt.Device) error { return d.PushText(ctx, cid(3), "", "hi") }},
		{"longest text", 110, func(ctx context.Context, d *gatt.Device) error {
			return d.PushText(ctx, cid(4), strings.Repeat("t", 128), strings.Repeat("x", 4096))
		}},
		{"uninstall", 69, func(ctx context.Context, d *gatt.Device) error {
			err := d.UninstallApp(ctx, cid(5), "weather")
			if errorCode(err) == gatt.CodeNotInstalled {
				return nil // the device had the request
			}
			return err
		}},
		{"OTA", 108, func(ctx context.Context, d *gatt.Device) error {
			return d.UpdateFirmware(ctx, cid(6), "1.1.0", firmwareImage(t, "1.1.0", big), nil)
		}},
		{"picture", 136, func(ctx context.Context, d *gatt.Device) error {
			return d.PushImage(ctx, cid(7), "image/jpeg", randomBytes(t, big))
		}},
		{"app install", 141, func(ctx context.Context, d *gatt.Device) error {
			return d.InstallApp(ctx, cid(8), "weather", "1.0.0", randomBytes(t, big))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, mtu := range []int{tc.mtu - 1, tc.mtu} {
				if mtu < 23 {
					continue // ATT's least
				}
				opts := fastLink
				opts.MTU = mtu
				d, _, _, _ := newSimPeripheral(t, opts, sim.PeripheralOptions{NoReassembly: true, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}, gatt.DeviceOptions{})
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := tc.run(ctx, d)
				cancel()
				if mtu == tc.mtu {
					if err != nil {
						t.Errorf("at MTU %d: %v; want it done", mtu, err)
					}
					continue
				}
				if code := errorCode(err); code != gatt.CodeMTUTooSmall || !strings.Contains(err.Error(), "the bridge's own check") ||
					!strings.Contains(err.Error(), "not sent") || !strings.Contains(err.Error(), "at MTU "+itoa(mtu)) {
					t.Errorf("at MTU %d: %v (code %q); want mtu_too_small by the bridge's own size check", mtu, err, code)
				}
			}
		})
	}
}

// Without reassembly the settings read needs MTU 46, for its longest
// request (companion/display_timeout_s). One below, that read is not sent,
// by the bridge's own size check, and only that setting is left out: the
// others are read (bug 148).
func TestWithoutReassemblyTheMTUBoundsTheSettingsRead(t *testing.T) {
	for _, mtu := range []int{45, 46} {
		opts := fastLink
		opts.MTU = mtu
		d, _, _, _ := newSimPeripheral(t, opts, sim.PeripheralOptions{NoReassembly: true}, gatt.DeviceOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		values, schema, err := d.Settings(ctx)
		cancel()
		want := sim.DefaultSchema()
		if mtu == 45 {
			delete(want, "display_timeout_s")
		}
		if err != nil || len(schema) != len(want) || len(values) != len(want) {
			t.Errorf("at MTU %d: Settings = %v, %v, %v; want the %d settings %v", mtu, values, schema, err, len(want), slices.Sorted(maps.Keys(want)))
		}
		for name := range want {
			if _, ok := values[name]; !ok {
				t.Errorf("at MTU %d: setting %q not read", mtu, name)
			}
		}
	}
}

// At MTU 23 without reassembly nothing that changes the device fits one
// write (every request carries a command id of 36 characters): the
// message tells it is the bridge's check, not an rc 7 of the device's,
// with the request's size and the limit.
func TestRequestTooLongForOneWriteSaysItIsTheBridgesCheck(t *testing.T) {
	opts := fastLink
	opts.MTU = 23
	d, _, _, p := newSimPeripheral(t, opts, sim.PeripheralOptions{NoReassembly: true}, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := d.UninstallApp(ctx, "0190a000-0000-7000-8000-000000000001", "weather")
	const want = "gatt: the bridge's own check (no answer of the device) on group 66 command 2: " +
		"not sent: the request of 66 bytes is longer than the 20 the device takes (one ATT write at MTU 23; the bridge found no reassembly), " +
		"and over a new connection too"
	if err == nil || err.Error() != want {
		t.Errorf("UninstallApp = %v;\nwant %s", err, want)
	}
	err = d.PushText(ctx, "0190a000-0000-7000-8000-000000000002", "", "hi")
	const wantText = "gatt: the bridge's own check (no answer of the device) on group 64 command 1: " +
		"not sent: an upload request takes 64 bytes besides its data, and the device takes 20 at most (one ATT write at MTU 23; the bridge found no reassembly), " +
		"and over a new connection too"
	if err == nil || !strings.HasSuffix(err.Error(), wantText) {
		t.Errorf("PushText = %v;\nwant it to end %s", err, wantText)
	}
	if code := errorCode(err); code != gatt.CodeMTUTooSmall {
		t.Errorf("PushText: code %q; want %s", code, gatt.CodeMTUTooSmall)
	}
	if n := p.Dropped(); n != 0 {
		t.Errorf("the device dropped %d writes: a request too long was sent", n)
	}

	// With buffers smaller than the request, and reassembly, the limit is
	// the device's buffer.
	d, _, _, _ = newSimPeripheral(t, opts, sim.PeripheralOptions{BufSize: 64}, gatt.DeviceOptions{})
	err = d.UninstallApp(ctx, "0190a000-0000-7000-8000-000000000003", "weather")
	if err == nil || !strings.Contains(err.Error(), "not sent: the request of 66 bytes is longer than the 64 the device takes (its SMP buffer, buf_size 64)") {
		t.Errorf("UninstallApp with buffers of 64 = %v", err)
	}
	if code := errorCode(err); code != gatt.CodeInvalidPayload {
		t.Errorf("UninstallApp with buffers of 64: code %q; want %s (the device's buffer, not the link)", code, gatt.CodeInvalidPayload)
	}
}

// Without reassembly, a request one write at the link's MTU does not hold
// is tried once more over a new connection, which may negotiate a larger
// MTU: the command then runs, once. When the new connection's MTU is as
// small, the command fails mtu_too_small, after that one more connection
// and no other: the link, not the payload, is too small. A request longer
// than the device's SMP buffer is invalid_payload at once, whatever the
// link. Before, every such command failed invalid_payload at once, and the
// link was kept, so every later one did too (docs/reliability.md, bug 196).
func TestAnMTUTooSmallIsTriedOnceOverANewConnection(t *testing.T) {
	const cid = "0190a000-0000-7000-8000-000000000001"
	t.Run("a larger MTU next", func(t *testing.T) {
		opts := fastLink
		opts.MTU, opts.MTUs = 247, []int{23}
		d, s, n, p := newSimPeripheral(t, opts, sim.PeripheralOptions{NoReassembly: true}, gatt.DeviceOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.PushText(ctx, cid, "", "hi"); err != nil {
			t.Fatalf("PushText over MTU 23, then 247: %v", err)
		}
		if got := s.Texts(); len(got) != 1 || got[0].Text != "hi" || s.Executions(cid) != 1 {
			t.Errorf("the device shows %v, ran the command %d times; want hi, once", got, s.Executions(cid))
		}
		if c := n.Connects(); c != 2 {
			t.Errorf("%d connections; want 2", c)
		}
		if d := p.Dropped(); d != 0 {
			t.Errorf("the device dropped %d writes", d)
		}
	})
	t.Run("as small again", func(t *testing.T) {
		opts := fastLink
		opts.MTU = 23
		d, s, n, _ := newSimPeripheral(t, opts, sim.PeripheralOptions{NoReassembly: true}, gatt.DeviceOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := d.UninstallApp(ctx, cid, "weather")
		if code := errorCode(err); code != gatt.CodeMTUTooSmall || !strings.HasSuffix(err.Error(), "and over a new connection too") {
			t.Errorf("UninstallApp at MTU 23 = %v (code %q); want mtu_too_small, over a new connection too", err, code)
		}
		if c := n.Connects(); c != 2 {
			t.Errorf("%d connections; want 2: one more, no other", c)
		}
		if s.Executions(cid) != 0 {
			t.Errorf("the device ran the command")
		}
		// Reads that fit go on over the link.
		if _, err := d.Info(ctx); err != nil {
			t.Errorf("Info after: %v", err)
		}
	})
	t.Run("the device's buffer", func(t *testing.T) {
		opts := fastLink
		opts.MTU = 247
		d, _, n, _ := newSimPeripheral(t, opts, sim.PeripheralOptions{BufSize: 64, NoReassembly: true}, gatt.DeviceOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := d.UninstallApp(ctx, cid, "weather")
		if code := errorCode(err); code != gatt.CodeInvalidPayload {
			t.Errorf("UninstallApp with buffers of 64 = %v (code %q); want invalid_payload", err, code)
		}
		if c := n.Connects(); c != 1 {
			t.Errorf("%d connections; want 1", c)
		}
	})
}

// A device whose SMP buffers are shorter than a write at its MTU (MTU 498,
// and Zephyr's default CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE of 384) drops a
// longer write without a word, as smp_bt does: the bridge sends no request
// longer than the buffer, and every command runs, with reassembly or
// without. Before, the bridge bounded requests by the MTU alone: every
// upload's long requests were lost and the command failed timeout
// (docs/reliability.md, bug 179). A request too long for the buffer is
// the bridge's own check, naming the buffer.
func TestBuffersShorterThanAWriteBoundRequests(t *testing.T) {
	opts := fastLink
	opts.MTU = 498
	for _, noReasm := range []bool{false, true} {
		d, s, _, p := newSimPeripheral(t, opts, sim.PeripheralOptions{BufSize: 384, NoReassembly: noReasm}, gatt.DeviceOptions{RequestTimeout: 5 * time.Second})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if err := d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 20_000)); err != nil {
			t.Errorf("reassembly %v: PushImage: %v", !noReasm, err)
		}
		if err := d.PushText(ctx, "t-1", "", strings.Repeat("a text longer than a buffer. ", 40)); err != nil {
			t.Errorf("reassembly %v: PushText: %v", !noReasm, err)
		}
		if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil); err != nil {
			t.Errorf("reassembly %v: UpdateFirmware: %v", !noReasm, err)
		}
		if len(s.Images()) != 1 || len(s.Texts()) != 1 || s.Firmware() != "2.0.0" {
			t.Errorf("reassembly %v: the device has %d images, %d texts, firmware %s; want 1, 1, 2.0.0", !noReasm, len(s.Images()), len(s.Texts()), s.Firmware())
		}
		if n := p.Dropped(); n != 0 {
			t.Errorf("reassembly %v: the device dropped %d writes longer than its buffer", !noReasm, n)
		}
		err := d.UninstallApp(ctx, "0190a000-0000-7000-8000-000000000001", strings.Repeat("a", 380))
		if err == nil || !strings.Contains(err.Error(), "longer than the 384 the device takes (its SMP buffer, buf_size 384)") {
			t.Errorf("reassembly %v: UninstallApp of an id longer than the buffer = %v; want the bridge's check naming buf_size 384", !noReasm, err)
		}
		cancel()
	}
}

// The MCUmgr of Zephyr 2.x (2.7 LTS among them) answers in SMP
// version 1 and, without reassembly, takes the first write of the
// reassembly probe, an echo cut short, for a whole message: its echo
// decodes what came and answers rc 3, where a later smp.c answers rc 9
// before any handler runs. Only an echo answered, or an answer in version
// 2 (whose smp.c checks that a message is whole first), shows the device
// reassembles: this device gets every request in one write, and every
// operation goes through. Before, rc 3 read as reassembly, requests went
// out across writes of a device that takes each for a message, and every
// long one failed invalid_payload (bug 414).
func TestOldMCUmgrWithoutReassemblyIsNotTakenForReassembling(t *testing.T) {
	opts := fastLink
	opts.MTU = 247
	popts := sim.PeripheralOptions{OldMCUmgr: true, NoReassembly: true, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}
	d, s, _, p := newSimPeripheral(t, opts, popts, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if info, err := d.Info(ctx); err != nil || info.FirmwareVersion != "1.0.0" {
		t.Fatalf("Info = %+v, %v", info, err)
	}
	if err := d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 20_000)); err != nil {
		t.Errorf("PushImage: %v (code %q)", err, errorCode(err))
	}
	if err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil); err != nil {
		t.Errorf("UpdateFirmware: %v (code %q)", err, errorCode(err))
	}
	if len(s.Images()) != 1 || s.Firmware() != "2.0.0" || !s.FirmwareConfirmed() {
		t.Errorf("the device has %d images, firmware %s (confirmed %v); want 1, 2.0.0 confirmed", len(s.Images()), s.Firmware(), s.FirmwareConfirmed())
	}
	if n := p.Dropped(); n != 0 {
		t.Errorf("the device dropped %d writes", n)
	}
}

// A device without MCUmgr parameters (CONFIG_MCUMGR_GRP_OS_MCUMGR_PARAMS
// is off in Zephyr by default) that reassembles
// (CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY) runs every operation at MTU 23,
// as one with parameters does: the bridge probes for reassembly, and for
// Zephyr's default buffer of 384 bytes (an echo of 384 bytes, whose writes
// after the first are all "r", which a device with shorter buffers drops
// whole), then 256 (bug 470). One with shorter buffers, or without
// reassembly, gets one write per request, as before. Before, without parameters the bridge never
// probed: every command but the status reads failed mtu_too_small at MTU
// 23 (bug 445).
func TestReassemblyWithoutParametersIsProbed(t *testing.T) {
	opts := fastLink
	opts.MTU = 23
	for _, tc := range []struct {
		name  string
		popts sim.PeripheralOptions
		reasm bool // what the bridge should find
	}{
		{"reassembles", sim.PeripheralOptions{NoParams: true}, true},
		{"reassembles into buffers of 200", sim.PeripheralOptions{NoParams: true, BufSize: 200}, false},
		{"no reassembly", sim.PeripheralOptions{NoParams: true, NoReassembly: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.popts.ResetDelay, tc.popts.BootTime = 5*time.Millisecond, 5*time.Millisecond
			d, s, _, _ := newSimPeripheral(t, opts, tc.popts, gatt.DeviceOptions{ProbeTimeout: 300 * time.Millisecond, RequestTimeout: 5 * time.Second})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if _, err := d.Info(ctx); err != nil {
				t.Fatalf("Info: %v", err)
			}
			errText := d.PushText(ctx, "0190a000-0000-7000-8000-000000000001", "", "hello")
			errSet := d.UpdateSettings(ctx, "0190a000-0000-7000-8000-000000000002", map[string]any{"timezone": "America/Argentina/ComodRivadavia"})
			errOTA := d.UpdateFirmware(ctx, "0190a000-0000-7000-8000-000000000003", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
			if tc.reasm {
				if errText != nil || errSet != nil || errOTA != nil {
					t.Fatalf("at MTU 23 without MCUmgr parameters, reassembling: PushText = %v; UpdateSettings = %v; UpdateFirmware = %v (codes %q %q %q); want nil",
						errText, errSet, errOTA, errorCode(errText), errorCode(errSet), errorCode(errOTA))
				}
				if len(s.Texts()) != 1 || s.Firmware() != "2.0.0" {
					t.Errorf("the device has %d texts, firmware %s; want 1, 2.0.0", len(s.Texts()), s.Firmware())
				}
				return
			}
			for what, err := range map[string]error{"PushText": errText, "UpdateSettings": errSet, "UpdateFirmware": errOTA} {
				if errorCode(err) != gatt.CodeMTUTooSmall {
					t.Errorf("%s at MTU 23, one write per request = %v (code %q); want mtu_too_small", what, err, errorCode(err))
				}
			}
			if len(s.Texts()) != 0 {
				t.Errorf("the device shows %d texts; want none", len(s.Texts()))
			}
			if _, err := d.Info(ctx); err != nil {
				t.Errorf("Info after: %v", err)
			}
		})
	}
}

// A device without MCUmgr parameters built for a large MTU (498) keeps
// Zephyr's default buffers of 384 bytes unless its firmware sets others,
// and Zephyr's smp_bt drops a write longer than its buffer without an
// answer (with reassembly too: the message is longer than a buffer). The
// bridge finds out with one echo as long as a write; a device that does
// not answer it gets requests of 384 bytes at most, and every operation
// goes through. Before, requests filled the write, and every upload, OTA
// and long text was lost request after request and failed timeout (bug
// 447). A device whose buffers hold a write keeps writes of MTU - 3.
func TestWithoutParametersALargeMTUIsBoundByTheBuffer(t *testing.T) {
	opts := fastLink
	opts.MTU = 498
	for _, tc := range []struct {
		name  string
		popts sim.PeripheralOptions
		max   int // the longest request the bridge should send
	}{
		{"buffers of 384", sim.PeripheralOptions{NoParams: true, BufSize: 384, NoReassembly: true}, 384},
		{"buffers of 384, reassembling", sim.PeripheralOptions{NoParams: true, BufSize: 384}, 384},
		{"buffers of 2475", sim.PeripheralOptions{NoParams: true, NoReassembly: true}, 495},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.popts.ResetDelay, tc.popts.BootTime = 5*time.Millisecond, 5*time.Millisecond
			var mu sync.Mutex
			longest := 0
			tap := func(_ gatt.Link, data []byte) ([]byte, error) {
				if h, err := gatt.ParseHeader(data); err == nil && h.Group == gatt.GroupOS && h.ID == gatt.CmdOSEcho {
					return data, nil // the probe of each connection
				}
				mu.Lock()
				longest = max(longest, len(data))
				mu.Unlock()
				return data, nil
			}
			s := sim.New(sim.Options{ID: "dev-1"})
			p := sim.NewPeripheral(s, tc.popts)
			d, n := tappedDevice(t, opts, p, tap)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			if _, err := d.Info(ctx); err != nil {
				t.Fatalf("Info: %v", err)
			}
			dropped, connects := p.Dropped(), n.Connects() // the probe, on a device with short buffers
			mu.Lock()
			longest = 0
			mu.Unlock()
			errImg := d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 20_000))
			errOTA := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
			if errImg != nil || errOTA != nil {
				t.Fatalf("at MTU 498 without MCUmgr parameters: PushImage = %v; UpdateFirmware = %v; want nil, nil", errImg, errOTA)
			}
			mu.Lock()
			defer mu.Unlock()
			probes := int64(0) // dropped: one a connection (the OTA's reboot makes one)
			if tc.max == 384 {
				probes = n.Connects() - connects
			}
			if longest != tc.max || p.Dropped()-dropped != probes {
				t.Errorf("the longest write was %d bytes and the device dropped %d writes; want %d, %d (the probes)", longest, p.Dropped()-dropped, tc.max, probes)
			}
		})
	}
}

// A device without MCUmgr parameters whose firmware set
// CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE to 256 (a firmware short of RAM) was
// probed for Zephyr's default of 384 bytes alone: reassembling at MTU 23,
// it got one write per request and every command failed mtu_too_small; at
// MTU 498 it got requests of 384 bytes, each dropped whole, and every upload
// failed timeout. The bridge now probes 256 bytes after 384, and bounds the
// requests by what the device answered (bug 470).
func TestWithoutParametersBuffersOf256AreFound(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mtu   int
		popts sim.PeripheralOptions
	}{
		{"MTU 23, reassembling", 23, sim.PeripheralOptions{NoParams: true, BufSize: 256}},
		{"MTU 498", 498, sim.PeripheralOptions{NoParams: true, BufSize: 256, NoReassembly: true}},
		{"MTU 498, reassembling", 498, sim.PeripheralOptions{NoParams: true, BufSize: 256}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.popts.ResetDelay, tc.popts.BootTime = 5*time.Millisecond, 5*time.Millisecond
			opts := fastLink
			opts.MTU = tc.mtu
			var mu sync.Mutex
			longest := 0 // the longest request, its writes added up
			var msg []byte
			want, echo := 0, false
			tap := func(_ gatt.Link, data []byte) ([]byte, error) {
				mu.Lock()
				defer mu.Unlock()
				if want == 0 {
					h, err := gatt.ParseHeader(data)
					if err != nil {
						return data, nil
					}
					want, msg = gatt.HeaderSize+int(h.Len), nil
					echo = h.Group == gatt.GroupOS && h.ID == gatt.CmdOSEcho // the probes of each connection
				}
				msg = append(msg, data...)
				if len(msg) >= want {
					if !echo {
						longest = max(longest, len(msg))
					}
					want = 0
				}
				return data, nil
			}
			s := sim.New(sim.Options{ID: "dev-1"})
			d, _ := tappedDevice(t, opts, sim.NewPeripheral(s, tc.popts), tap)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			if _, err := d.Info(ctx); err != nil {
				t.Fatalf("Info: %v", err)
			}
			errText := d.PushText(ctx, "0190a000-0000-7000-8000-000000000001", "", "hello")
			errImg := d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 20_000))
			errOTA := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
			if errText != nil || errImg != nil || errOTA != nil {
				t.Fatalf("at MTU %d without MCUmgr parameters, buffers of 256: PushText = %v; PushImage = %v; UpdateFirmware = %v (codes %q %q %q); want nil",
					tc.mtu, errText, errImg, errOTA, errorCode(errText), errorCode(errImg), errorCode(errOTA))
			}
			mu.Lock()
			defer mu.Unlock()
			if longest > 256 || longest < 200 {
				t.Errorf("the longest request was %d bytes; want up to the device's 256", longest)
			}
		})
	}
}

// A device without MCUmgr parameters with buffers of 256 bytes at an MTU
// whose writes are longer than that but shorter than Zephyr's default 384
// (300 here) took neither the reassembly probe (its first write, longer
// than a buffer, dropped) nor any long request: it got one write per
// request, of 297 bytes, each dropped whole, and every upload failed. The
// bridge now sends one echo as long as a write when it finds no
// reassembly, and bounds the requests by 256 bytes when it goes unanswered
// (bug 473).
func TestWithoutParametersBuffersShorterThanAWriteAreFound(t *testing.T) {
	for _, reasm := range []bool{false, true} {
		t.Run(fmt.Sprintf("reassembly %v", reasm), func(t *testing.T) {
			opts := fastLink
			opts.MTU = 300
			popts := sim.PeripheralOptions{NoParams: true, BufSize: 256, NoReassembly: !reasm, ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}
			d, _, _, _ := newSimPeripheral(t, opts, popts, gatt.DeviceOptions{ProbeTimeout: 300 * time.Millisecond, RequestTimeout: 2 * time.Second,
				QuietTimeout: 200 * time.Millisecond})
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			errImg := d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 20_000))
			errOTA := d.UpdateFirmware(ctx, "fw-1", "2.0.0", firmwareImage(t, "2.0.0", 20_000), nil)
			if errImg != nil || errOTA != nil {
				t.Fatalf("at MTU 300 without MCUmgr parameters, buffers of 256: PushImage = %v; UpdateFirmware = %v; want nil, nil", errImg, errOTA)
			}
		})
	}
}

// tappedDevice is dev-1, the peripheral p on a network of opts, reached
// through tap, with the probe and request timeouts of the buffer tests;
// closed, and its network, as the test ends.
func tappedDevice(t *testing.T, opts sim.LinkOptions, p *sim.Peripheral, tap func(gatt.Link, []byte) ([]byte, error)) (*gatt.Device, *sim.Network) {
	t.Helper()
	n := sim.NewNetwork(opts)
	n.Add("dev-1", p)
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: tap}, MinBackoff: time.Millisecond,
		ProbeTimeout: 300 * time.Millisecond, RequestTimeout: 2 * time.Second, QuietTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		n.Close()
	})
	return d, n
}
