package gatt_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// fastLink is a simulated link fast enough that tests are not about time.
var fastLink = sim.LinkOptions{KBPS: 200_000, Latency: -1, ConnectDelay: -1}

// newSimDevice returns a gatt.Device talking to a simulated device over a
// simulated link with opts.
func newSimDevice(tb testing.TB, opts sim.LinkOptions, dopts gatt.DeviceOptions) (*gatt.Device, *sim.Device, *sim.Network) {
	tb.Helper()
	d, s, n, _ := newSimPeripheral(tb, opts, sim.PeripheralOptions{ResetDelay: 5 * time.Millisecond, BootTime: 5 * time.Millisecond}, dopts)
	return d, s, n
}

// newSimPeripheral is newSimDevice with the peripheral's options, and the
// peripheral returned too.
func newSimPeripheral(tb testing.TB, opts sim.LinkOptions, popts sim.PeripheralOptions, dopts gatt.DeviceOptions) (*gatt.Device, *sim.Device, *sim.Network, *sim.Peripheral) {
	tb.Helper()
	return newSimPeripheralOf(tb, sim.Options{}, opts, popts, dopts)
}

// newSimPeripheralOf is newSimPeripheral with the simulated device made
// with sopts (its ID "dev-1").
func newSimPeripheralOf(tb testing.TB, sopts sim.Options, opts sim.LinkOptions, popts sim.PeripheralOptions, dopts gatt.DeviceOptions) (*gatt.Device, *sim.Device, *sim.Network, *sim.Peripheral) {
	tb.Helper()
	sopts.ID = "dev-1"
	s := sim.New(sopts)
	n := sim.NewNetwork(opts)
	p := sim.NewPeripheral(s, popts)
	n.Add("dev-1", p)
	dopts.ID, dopts.Connector = "dev-1", n
	if dopts.MinBackoff == 0 {
		dopts.MinBackoff = time.Millisecond
	}
	d, err := gatt.NewDevice(dopts)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		d.Close()
		n.Close()
	})
	return d, s, n, p
}

func randomBytes(tb testing.TB, n int) []byte {
	tb.Helper()
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func TestEveryOperationOverSimLink(t *testing.T) {
	for _, mtu := range []int{23, 247} {
		t.Run("mtu"+itoa(mtu), func(t *testing.T) {
			opts := fastLink
			opts.MTU = mtu
			d, s, _ := newSimDevice(t, opts, gatt.DeviceOptions{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()

			info, err := d.Info(ctx)
			if err != nil {
				t.Fatalf("Info: %v", err)
			}
			if info.Model != "sim-1" || info.FirmwareVersion != "1.0.0" || info.Battery != 100 || len(info.Apps) != 0 {
				t.Errorf("Info = %+v", info)
			}
			vals, schema, err := d.Settings(ctx)
			if err != nil || vals["language"] != "en" || schema["brightness"].Type == "" {
				t.Fatalf("Settings = %v, %v, %v", vals, schema, err)
			}

			if err := d.PushText(ctx, "c1", "Hi", "Hello"); err != nil {
				t.Fatalf("PushText: %v", err)
			}
			if err := d.PushText(ctx, "c1", "Hi", "Hello"); err != nil { // a repeat
				t.Fatalf("PushText again: %v", err)
			}
			if got := s.Texts(); len(got) != 1 || got[0].Text != "Hello" || s.Executions("c1") != 1 {
				t.Errorf("texts %+v, executions %d", got, s.Executions("c1"))
			}

			img := randomBytes(t, 20_000)
			if err := d.PushImage(ctx, "c2", "image/png", img); err != nil {
				t.Fatalf("PushImage: %v", err)
			}
			if got := s.Images(); len(got) != 1 || !bytes.Equal(got[0].Data, img) || got[0].ContentType != "image/png" {
				t.Errorf("images: %d", len(got))
			}
			if err := d.PushImage(ctx, "c2", "image/png", img); err != nil || len(s.Images()) != 1 {
				t.Fatalf("PushImage again: %v, %d images", err, len(s.Images()))
			}

			if err := d.InstallApp(ctx, "c3", "weather", "1.0.0", randomBytes(t, 5000)); err != nil {
				t.Fatalf("InstallApp: %v", err)
			}
			if err := d.InstallApp(ctx, "c4", "weather", "1.2.0", randomBytes(t, 5000)); err != nil {
				t.Fatalf("InstallApp update: %v", err)
			}
			info, err = d.Info(ctx)
			if err != nil || len(info.Apps) != 1 || info.Apps[0].Version != "1.2.0" {
				t.Fatalf("Info after install = %+v, %v", info, err)
			}
			if err := d.UninstallApp(ctx, "c5", "weather"); err != nil {
				t.Fatalf("UninstallApp: %v", err)
			}
			err = d.UninstallApp(ctx, "c6", "weather")
			if code := errorCode(err); code != gatt.CodeNotInstalled {
				t.Errorf("UninstallApp of a missing app = %v (code %q); want %s", err, code, gatt.CodeNotInstalled)
			}

			if err := d.UpdateSettings(ctx, "c7", map[string]any{"brightness": 80.0, "language": "de"}); err != nil {
				t.Fatalf("UpdateSettings: %v", err)
			}
			vals, _, _ = s.Settings(ctx)
			if vals["brightness"] != 80 || vals["language"] != "de" {
				t.Errorf("settings %v", vals)
			}
			err = d.UpdateSettings(ctx, "c8", map[string]any{"brightness": 500.0})
			if code := errorCode(err); code != gatt.CodeInvalidPayload {
				t.Errorf("UpdateSettings out of range = %v (code %q)", err, code)
			}

			var pcts []int
			fw := firmwareImage(t, "1.1.0", 50_000)
			if err := d.UpdateFirmware(ctx, "c9", "1.1.0", fw, func(p int) { pcts = append(pcts, p) }); err != nil {
				t.Fatalf("UpdateFirmware: %v", err)
			}
			if s.Firmware() != "1.1.0" || !s.FirmwareConfirmed() || len(pcts) < 2 || pcts[len(pcts)-1] != 100 {
				t.Errorf("firmware %s (confirmed %v), progress %v", s.Firmware(), s.FirmwareConfirmed(), pcts)
			}
			if info, _ := d.Info(ctx); info.FirmwareVersion != "1.1.0" {
				t.Errorf("Info firmware %q", info.FirmwareVersion)
			}

			s.FailNext(errors.New("flash worn out"))
			err = d.PushText(ctx, "c10", "", "x")
			if code := errorCode(err); code != gatt.CodeDeviceError {
				t.Errorf("FailNext: %v (code %q)", err, code)
			}
		})
	}
}

func errorCode(err error) string {
	var coded interface{ ErrorCode() string }
	if errors.As(err, &coded) {
		return coded.ErrorCode()
	}
	return ""
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

// A refused settings write leaves every setting as it was: the writes that
// went with it (settings_mgmt applies each at once) are put back, so the
// device neither reports them nor saves them with the next update.
func TestRefusedSettingsUpdateChangesNothing(t *testing.T) {
	d, s, _ := newSimDevice(t, fastLink, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.UpdateSettings(ctx, "s1", map[string]any{"brightness": 500.0, "language": "fr", "volume": 3.0}); errorCode(err) != gatt.CodeInvalidPayload {
		t.Fatalf("UpdateSettings with brightness 500 = %v (code %q); want %s", err, errorCode(err), gatt.CodeInvalidPayload)
	}
	vals, _, _ := s.Settings(ctx)
	if vals["brightness"] != 50 || vals["language"] != "en" || vals["volume"] != 50 {
		t.Errorf("after the refused update: %v; want brightness 50, language en, volume 50", vals)
	}
	if err := d.UpdateSettings(ctx, "s2", map[string]any{"timezone": "Europe/Paris"}); err != nil {
		t.Fatalf("UpdateSettings: %v", err)
	}
	vals, _, _ = s.Settings(ctx)
	if vals["language"] != "en" || vals["volume"] != 50 || vals["timezone"] != "Europe/Paris" {
		t.Errorf("after the next update (which saves what is in use): %v; want language en, volume 50, timezone Europe/Paris", vals)
	}
}

// unreachable is a Connector for a device out of range: each attempt
// waits for its deadline, as a connection to an absent device does. It
// tells of the first attempt on started.
type unreachable struct {
	started chan struct{}
	once    sync.Once
}

func (u *unreachable) Connect(ctx context.Context, deviceID string) (gatt.Link, error) {
	u.once.Do(func() { close(u.started) })
	<-ctx.Done()
	return nil, ctx.Err()
}

// A caller that finds another connecting waits for it only as long as its
// own context lets it: a command trying for minutes to reach a device out
// of range does not hold a status read (30 s) past its deadline.
func TestWaitForAnotherConnectionEndsWithTheContext(t *testing.T) {
	u := &unreachable{started: make(chan struct{})}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: u, ConnectTimeout: time.Second, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	long, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- d.PushText(long, "c1", "", "hello") }()
	select {
	case <-u.started:
	case <-time.After(5 * time.Second):
		t.Fatal("the first caller never tried to connect")
	}
	short, cancelShort := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancelShort()
	start := time.Now()
	_, err = d.Info(short)
	if took := time.Since(start); took > time.Second || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Info with 100 ms left = %v after %v; want the deadline's error within a second", err, took.Round(time.Millisecond))
	}
	cancel()
	<-done
}

// A text at the API's limits (4096 bytes, a title of 128) is longer than a
// request the device takes, in its SMP buffer or in one write: it goes as
// a chunked upload (group 64, command 1), and is shown once, repeats
// included.
func TestALongTextGoesAsAnUpload(t *testing.T) {
	title := strings.Repeat("ü", 64) // 128 bytes
	for _, tc := range []struct {
		name  string
		mtu   int
		popts sim.PeripheralOptions
	}{
		{"buffers of 2475", 247, sim.PeripheralOptions{}},
		{"zephyr's default buffers", 247, sim.PeripheralOptions{BufSize: 384}},
		{"no reassembly", 247, sim.PeripheralOptions{NoReassembly: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := fastLink
			opts.MTU = tc.mtu
			d, s, _, _ := newSimPeripheral(t, opts, tc.popts, gatt.DeviceOptions{})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			text := strings.Repeat("ä", 2048) // 4096 bytes
			for range 2 {
				if err := d.PushText(ctx, "long", title, text); err != nil {
					t.Fatalf("PushText: %v", err)
				}
			}
			if err := d.PushText(ctx, "short", "", "hello"); err != nil {
				t.Fatalf("PushText of a short one: %v", err)
			}
			got := s.Texts()
			if len(got) != 2 || got[0].Text != text || got[0].Title != title || got[1].Text != "hello" || s.Executions("long") != 1 {
				t.Errorf("%d texts shown; the long one executed %d times", len(got), s.Executions("long"))
			}
		})
	}
}

// batteryConnector makes its Connector's links answer a battery level read
// with level.
type batteryConnector struct {
	gatt.Connector
	level []byte
}

type batteryLink struct {
	gatt.Link
	level []byte
}

func (c *batteryConnector) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &batteryLink{Link: l, level: c.level}, nil
}

func (l *batteryLink) Read(ctx context.Context, uuid string) ([]byte, error) {
	if uuid == gatt.BatteryLevelUUID {
		return l.level, nil
	}
	return l.Link.Read(ctx, uuid)
}

// A battery level that is not one byte 0–100 (a firmware's bug: 255 for
// "unknown", two bytes, none) is unknown, and only it: the rest of the
// device's information is read. Refused whole, the device's status could
// never be read again (bug 147).
func TestABatteryLevelOutOfRangeIsUnknown(t *testing.T) {
	for _, level := range [][]byte{{0xff}, {101}, {50, 0}, {}} {
		s := sim.New(sim.Options{ID: "dev-1"})
		n := sim.NewNetwork(fastLink)
		n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
		d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &batteryConnector{Connector: n, level: level}, MinBackoff: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		info, err := d.Info(ctx)
		cancel()
		d.Close()
		n.Close()
		if err != nil || info.Battery != companion.BatteryUnknown || info.FirmwareVersion != s.Firmware() || info.Model == "" {
			t.Errorf("battery level %x: Info = %+v, %v; want the battery unknown and the rest", level, info, err)
		}
	}
}
