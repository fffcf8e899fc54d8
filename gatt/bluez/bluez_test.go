//go:build linux

package bluez_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/gatt/bluez"
	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// testPeripheral is a small device: Zephyr's SMP service with an echoing
// SMP characteristic, DIS and battery.
type testPeripheral struct {
	serial string

	mu        sync.Mutex
	notify    func(string, []byte)
	writes    [][]byte
	connected []int // MTU of each connection
	wrote     chan struct{}
}

func newTestPeripheral(serial string) *testPeripheral {
	return &testPeripheral{serial: serial, wrote: make(chan struct{}, 1000)}
}

func (p *testPeripheral) Services() []gatt.Service {
	return []gatt.Service{
		{UUID: gatt.ServiceUUID, Characteristics: []gatt.Characteristic{{
			UUID:       gatt.SMPCharUUID,
			Properties: []string{gatt.PropWrite, gatt.PropWriteWithoutResponse, gatt.PropNotify},
		}}},
		{UUID: gatt.BatteryServiceUUID, Characteristics: []gatt.Characteristic{{
			UUID: gatt.BatteryLevelUUID, Properties: []string{gatt.PropRead, gatt.PropNotify},
		}}},
		{UUID: gatt.DeviceInfoUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.ModelNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.SerialNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.FirmwareRevUUID, Properties: []string{gatt.PropRead}},
		}},
	}
}

func (p *testPeripheral) ReadChar(uuid string) ([]byte, error) {
	switch uuid {
	case gatt.SerialNumberUUID:
		return []byte(p.serial), nil
	case gatt.ModelNumberUUID:
		return []byte("test-model"), nil
	case gatt.FirmwareRevUUID:
		return []byte("1.2.3"), nil
	case gatt.BatteryLevelUUID:
		return []byte{87}, nil
	}
	return nil, fmt.Errorf("no read of %s", uuid)
}

// WriteChar echoes each SMP write as a notification.
func (p *testPeripheral) WriteChar(uuid string, data []byte) error {
	p.mu.Lock()
	p.writes = append(p.writes, data)
	notify := p.notify
	p.mu.Unlock()
	p.wrote <- struct{}{}
	if notify != nil {
		notify(uuid, data)
	}
	return nil
}

func (p *testPeripheral) Connected(mtu int, notify func(string, []byte), drop func()) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = notify
	p.connected = append(p.connected, mtu)
	return nil
}

func (p *testPeripheral) Disconnected() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = nil
}

// burst sends n numbered notifications as fast as it can.
func (p *testPeripheral) burst(n int) {
	p.mu.Lock()
	notify := p.notify
	p.mu.Unlock()
	for i := range n {
		notify(gatt.SMPCharUUID, []byte(fmt.Sprint(i)))
	}
}

func (p *testPeripheral) Writes() [][]byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.writes)
}

// newConnector returns a Connector on the fake's bus, closed in cleanup.
func newConnector(t *testing.T) *bluez.Connector {
	t.Helper()
	c, err := bluez.New(bluez.Options{Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatalf("bluez.New: %v", err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	return c
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// closeWithin fails the test if Close takes longer than d: Close waits for
// every goroutine of the Connector, so this is the leak check.
func closeWithin(t *testing.T, c *bluez.Connector, d time.Duration) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(d):
		t.Errorf("Close did not return within %v: a goroutine is stuck", d)
	}
}

func connect(t *testing.T, c *bluez.Connector, id string) gatt.Link {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := c.Connect(ctx, id)
	if err != nil {
		t.Fatalf("Connect(%q): %v", id, err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func TestConnectFindsDeviceBySerial(t *testing.T) {
	fake := fakebluez.New(t)
	pa, pb := newTestPeripheral("dev-a"), newTestPeripheral("dev-b")
	// They advertise Zephyr's SMP service, as smp_svr does (CONTRACT §10).
	zephyrSMP := []string{"8D53DC1D-1DB7-4CD3-868B-8A527460AA84"}
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:00:0A", Name: "a", UUIDs: zephyrSMP, Peripheral: pa})
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:00:0B", Name: "b", UUIDs: zephyrSMP, Peripheral: pb})
	// A device without our service: never connected to.
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:00:01", UUIDs: []string{gatt.BatteryServiceUUID}, Peripheral: newTestPeripheral("other")})
	c := newConnector(t)

	l := connect(t, c, "dev-b")
	ctx := context.Background()
	got, err := l.Read(ctx, gatt.SerialNumberUUID)
	if err != nil || string(got) != "dev-b" {
		t.Fatalf("Read(serial) = %q, %v; want dev-b", got, err)
	}
	if got, err := l.Read(ctx, gatt.BatteryLevelUUID); err != nil || !slices.Equal(got, []byte{87}) {
		t.Errorf("Read(battery) = %v, %v; want [87]", got, err)
	}
	if got := l.MTU(); got != 247 {
		t.Errorf("MTU() = %d; want 247", got)
	}
	calls := strings.Join(fake.Calls(), "\n")
	for _, want := range []string{"Adapter1.SetDiscoveryFilter", "Adapter1.StartDiscovery", "Device1.Connect /org/bluez/hci0/dev_C0_FF_EE_00_00_0B"} {
		if !strings.Contains(calls, want) {
			t.Errorf("fake BlueZ calls lack %q:\n%s", want, calls)
		}
	}
	if strings.Contains(calls, "dev_C0_FF_EE_00_00_01") {
		t.Errorf("connected to a device without the SMP service:\n%s", calls)
	}

	// Both are known now; dev-a connects while dev-b stays connected.
	la := connect(t, c, "dev-a")
	if got, _ := la.Read(ctx, gatt.SerialNumberUUID); string(got) != "dev-a" {
		t.Errorf("second link reads serial %q; want dev-a", got)
	}
}

func TestConcurrentConnects(t *testing.T) {
	fake := fakebluez.New(t)
	ids := []string{"dev-1", "dev-2", "dev-3"}
	for i, id := range ids {
		fake.AddDevice(fakebluez.DeviceOptions{Address: fmt.Sprintf("C0:FF:EE:00:01:%02X", i), Peripheral: newTestPeripheral(id)})
	}
	c := newConnector(t)
	var wg sync.WaitGroup
	links := make([]gatt.Link, len(ids))
	errs := make([]error, len(ids))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for i, id := range ids {
		wg.Go(func() { links[i], errs[i] = c.Connect(ctx, id) })
	}
	wg.Wait()
	for i, id := range ids {
		if errs[i] != nil {
			t.Errorf("Connect(%q): %v", id, errs[i])
			continue
		}
		defer links[i].Close()
		if got, err := links[i].Read(ctx, gatt.SerialNumberUUID); err != nil || string(got) != id {
			t.Errorf("link for %q reads serial %q, %v", id, got, err)
		}
	}
}

func TestMTU(t *testing.T) {
	for _, mtu := range []int{247, 185, 23} {
		t.Run(fmt.Sprint(mtu), func(t *testing.T) {
			fake := fakebluez.New(t)
			p := newTestPeripheral("dev-mtu")
			fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:02:01", MTU: mtu, Peripheral: p})
			l := connect(t, newConnector(t), "dev-mtu")
			if got := l.MTU(); got != mtu {
				t.Errorf("MTU() = %d; want %d", got, mtu)
			}
			ctx := context.Background()
			if err := l.Write(ctx, gatt.SMPCharUUID, make([]byte, mtu-3), false); err != nil {
				t.Errorf("Write of MTU-3 bytes: %v", err)
			}
			if err := l.Write(ctx, gatt.SMPCharUUID, make([]byte, mtu-2), false); err == nil {
				t.Errorf("Write of MTU-2 bytes succeeded; want an error")
			}
		})
	}
}

// The ATT MTU of a connection is exchanged once and never shrinks: an MTU
// property BlueZ announces below it (0, or 23 after 247) is not the
// link's. Taken, it failed every write the client sized to the MTU it was
// made with, for as long as the link lasted (bug 143).
func TestMTUNeverShrinks(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:02:02", MTU: 247, Peripheral: newTestPeripheral("dev-mtu")})
	l := connect(t, newConnector(t), "dev-mtu")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan int, 10)
	if err := l.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) { got <- len(b) }); err != nil {
		t.Fatalf("Subscribe: %v", err)
	}
	char := d.Path() + "/service0001/char0002"
	for _, mtu := range []uint16{0, 22, 23, 100} {
		if err := fake.Emit(char, "org.freedesktop.DBus.Properties.PropertiesChanged", "org.bluez.GattCharacteristic1",
			map[string]dbus.Variant{"MTU": dbus.MakeVariant(mtu)}, []string{}); err != nil {
			t.Fatal(err)
		}
		// The echo's notification comes after the signal went past.
		if err := l.Write(ctx, gatt.SMPCharUUID, []byte("x"), false); err != nil {
			t.Fatalf("Write after MTU %d: %v", mtu, err)
		}
		select {
		case <-got:
		case <-ctx.Done():
			t.Fatal("no notification")
		}
		if m := l.MTU(); m != 247 {
			t.Errorf("after a signal of MTU %d, MTU() = %d; want 247", mtu, m)
		}
		if err := l.Write(ctx, gatt.SMPCharUUID, make([]byte, 244), false); err != nil {
			t.Fatalf("after a signal of MTU %d, a write of 244 bytes: %v", mtu, err)
		}
		select {
		case <-got:
		case <-ctx.Done():
			t.Fatal("no notification")
		}
	}
}

func TestWrites(t *testing.T) {
	fake := fakebluez.New(t)
	p := newTestPeripheral("dev-w")
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:03:01", Peripheral: p})
	l := connect(t, newConnector(t), "dev-w")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.Write(ctx, gatt.SMPCharUUID, []byte("with"), true); err != nil {
		t.Fatalf("Write with response: %v", err)
	}
	if err := l.Write(ctx, gatt.SMPCharUUID, []byte("without"), false); err != nil {
		t.Fatalf("Write without response: %v", err)
	}
	if got := p.Writes(); len(got) != 2 || string(got[0]) != "with" || string(got[1]) != "without" {
		t.Errorf("peripheral got writes %q; want [with without]", got)
	}
	var types []string
	for _, call := range fake.Calls() {
		if strings.HasPrefix(call, "GattCharacteristic1.WriteValue") {
			types = append(types, strings.Fields(call)[0])
		}
	}
	want := []string{"GattCharacteristic1.WriteValue(request)", "GattCharacteristic1.WriteValue(command)"}
	if !slices.Equal(types, want) {
		t.Errorf("BlueZ saw writes %q; want %q", types, want)
	}
	if err := l.Write(ctx, gatt.ModelNumberUUID, []byte("x"), true); err == nil {
		t.Errorf("Write to a read-only characteristic succeeded")
	}
}

func TestNotificationsInOrder(t *testing.T) {
	fake := fakebluez.New(t)
	p := newTestPeripheral("dev-n")
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:04:01", Peripheral: p})
	l := connect(t, newConnector(t), "dev-n")
	const n = 500
	got := make(chan string, n+10)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) { got <- string(b) }); err != nil {
		t.Fatalf("Subscribe: %v", err)
	}
	go p.burst(n)
	for i := range n {
		select {
		case v := <-got:
			if v != fmt.Sprint(i) {
				t.Fatalf("notification %d is %q; want %q", i, v, fmt.Sprint(i))
			}
		case <-ctx.Done():
			t.Fatalf("got %d of %d notifications", i, n)
		}
	}
	// An echoed write comes back after the burst.
	if err := l.Write(ctx, gatt.SMPCharUUID, []byte("echo"), false); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-got:
		if v != "echo" {
			t.Errorf("echo notification %q", v)
		}
	case <-ctx.Done():
		t.Fatal("no echo notification")
	}
}

func TestConnectTimeout(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:05:01", NeverConnect: true, Peripheral: newTestPeripheral("dev-t")})
	c, err := bluez.New(bluez.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = c.Connect(ctx, "dev-t")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Connect = %v; want context.DeadlineExceeded", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("Connect returned after %v; the deadline was 500ms", el)
	}
	// Close waits for the abandoned Device1.Connect: it ends because the
	// Connector asked BlueZ to disconnect, which aborts it.
	closeWithin(t, c, 5*time.Second)
	calls := strings.Join(fake.Calls(), "\n")
	if !strings.Contains(calls, "Device1.Disconnect "+string(d.Path())) {
		t.Errorf("no Device1.Disconnect to abort the connection attempt:\n%s", calls)
	}
	if d.Connected() {
		t.Errorf("device connected after an abandoned attempt")
	}
}

func TestConnectNotFound(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:06:01", Peripheral: newTestPeripheral("someone-else")})
	c := newConnector(t)
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	if _, err := c.Connect(ctx, "dev-missing"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Connect = %v; want context.DeadlineExceeded", err)
	}
}

func TestDropAndReconnect(t *testing.T) {
	fake := fakebluez.New(t)
	p := newTestPeripheral("dev-d")
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:07:01", Peripheral: p})
	c := newConnector(t)
	l := connect(t, c, "dev-d")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan string, 10)
	if err := l.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) { got <- string(b) }); err != nil {
		t.Fatal(err)
	}

	d.Drop()
	select {
	case <-l.Done():
	case <-ctx.Done():
		t.Fatal("Done not closed after the connection dropped")
	}
	if err := l.Write(ctx, gatt.SMPCharUUID, []byte("late"), false); !errors.Is(err, gatt.ErrDisconnected) {
		t.Errorf("Write after the drop = %v; want gatt.ErrDisconnected", err)
	}
	if _, err := l.Read(ctx, gatt.SerialNumberUUID); !errors.Is(err, gatt.ErrDisconnected) {
		t.Errorf("Read after the drop = %v; want gatt.ErrDisconnected", err)
	}
	if err := l.Close(); err != nil {
		t.Errorf("Close after the drop: %v", err)
	}

	// The bridge reconnects: a new scan finds the known address again.
	l2 := connect(t, c, "dev-d")
	if err := l2.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) { got <- string(b) }); err != nil {
		t.Fatal(err)
	}
	if err := l2.Write(ctx, gatt.SMPCharUUID, []byte("again"), true); err != nil {
		t.Fatalf("Write after reconnect: %v", err)
	}
	select {
	case v := <-got:
		if v != "again" {
			t.Errorf("notification after reconnect %q; want again", v)
		}
	case <-ctx.Done():
		t.Fatal("no notification after reconnect")
	}
	if n := strings.Count(strings.Join(fake.Calls(), "\n"), "Device1.Connect"); n != 2 {
		t.Errorf("%d Device1.Connect calls; want 2 (no probing on reconnect)", n)
	}

	// Closing disconnects, and the device is free again.
	if err := l2.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	select {
	case <-l2.Done():
	default:
		t.Error("Done not closed by Close")
	}
	if d.Connected() {
		t.Error("device still connected after Close")
	}
}

// TestSMPEchoOverSimPeripheral runs the SMP client over BlueZ (fake) to the
// simulator's peripheral, found by Zephyr's SMP service UUID: a device that
// reassembles takes a request split across writes, one that does not
// answers the probe rc 9 and gets single writes.
func TestSMPEchoOverSimPeripheral(t *testing.T) {
	fake := fakebluez.New(t)
	dev := sim.New(sim.Options{ID: "sim-1"})
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:08:01", MTU: 23, Peripheral: sim.NewPeripheral(dev, sim.PeripheralOptions{})})
	plain := sim.New(sim.Options{ID: "sim-2"})
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:08:02", MTU: 23, Peripheral: sim.NewPeripheral(plain, sim.PeripheralOptions{NoReassembly: true})})
	conn := newConnector(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	client, err := gatt.NewClient(ctx, connect(t, conn, "sim-1"), gatt.ClientOptions{})
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer client.Close()
	if ok, err := client.ProbeReassembly(ctx, time.Second); !ok || err != nil {
		t.Fatalf("ProbeReassembly = %v, %v; want true", ok, err)
	}
	client.SetMaxRequest(sim.DefaultBufSize)
	// Longer than one write at MTU 23: split and reassembled both ways.
	msg := strings.Repeat("hello over bluez ", 10)
	got, err := client.Echo(ctx, msg)
	if err != nil || got != msg {
		t.Fatalf("Echo = %q, %v; want %q", got, err, msg)
	}

	c2, err := gatt.NewClient(ctx, connect(t, conn, "sim-2"), gatt.ClientOptions{})
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	defer c2.Close()
	if ok, err := c2.ProbeReassembly(ctx, time.Second); ok || err != nil {
		t.Fatalf("ProbeReassembly of a device without reassembly = %v, %v; want false", ok, err)
	}
	if got, err := c2.Echo(ctx, "hi"); err != nil || got != "hi" {
		t.Fatalf("Echo after the probe = %q, %v; want hi", got, err)
	}
}

func TestBluetoothdExit(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:09:01", Peripheral: newTestPeripheral("dev-x")})
	l := connect(t, newConnector(t), "dev-x")
	fake.Exit()
	select {
	case <-l.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed after bluetoothd left the bus")
	}
	if err := l.Write(context.Background(), gatt.SMPCharUUID, []byte("x"), false); !errors.Is(err, gatt.ErrDisconnected) {
		t.Errorf("Write = %v; want gatt.ErrDisconnected", err)
	}
}

// gatedPeripheral is a testPeripheral whose connections take until the
// test opens the gate: a connection attempt that is under way.
type gatedPeripheral struct {
	*testPeripheral
	entered, gate chan struct{}
}

func (p *gatedPeripheral) Connected(mtu int, notify func(string, []byte), drop func()) error {
	close(p.entered)
	<-p.gate
	return p.testPeripheral.Connected(mtu, notify, drop)
}

// A signal from org.bluez with a body too short or of other types than
// BlueZ's (a buggy bluetoothd) is ignored: no handler of the bridge's, nor
// of a library's under it, may panic on one. The link, its notifications and
// a connection under way when they came go on.
func TestMalformedSignalsAreIgnored(t *testing.T) {
	fake := fakebluez.New(t)
	p := newTestPeripheral("dev-m")
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0A:01", Peripheral: p})
	c := newConnector(t)
	l := connect(t, c, "dev-m")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan string, 10)
	if err := l.Subscribe(ctx, gatt.SMPCharUUID, func(b []byte) { got <- string(b) }); err != nil {
		t.Fatalf("Subscribe: %v", err)
	}
	slow := &gatedPeripheral{testPeripheral: newTestPeripheral("dev-slow"), entered: make(chan struct{}), gate: make(chan struct{})}
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0A:02", Peripheral: slow})
	type result struct {
		l   gatt.Link
		err error
	}
	connected := make(chan result, 1)
	go func() {
		l, err := c.Connect(ctx, "dev-slow")
		connected <- result{l, err}
	}()
	select {
	case <-slow.entered:
	case <-ctx.Done():
		t.Fatal("no connection attempt to dev-slow")
	}

	const (
		propsChanged = "org.freedesktop.DBus.Properties.PropertiesChanged"
		added        = "org.freedesktop.DBus.ObjectManager.InterfacesAdded"
		removed      = "org.freedesktop.DBus.ObjectManager.InterfacesRemoved"
	)
	char := d.Path() + "/service0001/char0002"
	for _, s := range []struct {
		path dbus.ObjectPath
		name string
		body []any
	}{
		{d.Path(), propsChanged, nil},
		{d.Path(), propsChanged, []any{int32(7)}},
		{d.Path(), propsChanged, []any{"org.bluez.Device1"}},
		{d.Path(), propsChanged, []any{"org.bluez.Device1", "Connected"}},
		{char, propsChanged, []any{"org.bluez.GattCharacteristic1"}},
		{char, propsChanged, []any{"org.bluez.GattCharacteristic1", []string{"Value"}}},
		{fakebluez.AdapterPath, propsChanged, []any{"org.bluez.Adapter1"}},
		{"/", added, nil},
		{"/", added, []any{d.Path()}},
		{"/", added, []any{"not a path", int32(1)}},
		{"/", removed, nil},
		{"/", removed, []any{d.Path()}},
		{"/", removed, []any{d.Path(), "org.bluez.Device1"}},
	} {
		if err := fake.Emit(s.path, s.name, s.body...); err != nil {
			t.Fatalf("Emit %s %v: %v", s.name, s.body, err)
		}
	}

	// The dispatcher takes signals in order: the echo's notification comes
	// after it went past every one above.
	if err := l.Write(ctx, gatt.SMPCharUUID, []byte("after"), false); err != nil {
		t.Fatalf("Write after the malformed signals: %v", err)
	}
	select {
	case v := <-got:
		if v != "after" {
			t.Errorf("notification %q; want after", v)
		}
	case <-ctx.Done():
		t.Fatal("no notification after the malformed signals")
	}
	select {
	case <-l.Done():
		t.Error("the link is down after the malformed signals")
	default:
	}
	close(slow.gate)
	r := <-connected
	if r.err != nil {
		t.Fatalf("Connect(dev-slow), under way when the signals came: %v", r.err)
	}
	defer r.l.Close()
	if got, err := r.l.Read(ctx, gatt.SerialNumberUUID); err != nil || string(got) != "dev-slow" {
		t.Errorf("Read(serial) of dev-slow = %q, %v", got, err)
	}
}

// A bluetoothd that stops answering (hung, SIGSTOPped) answers no call
// and emits nothing. Every call the Connector makes is bounded: a read in
// flight ends with its context, the link's Close gives the disconnect its
// CallTimeout and says it gave up, a new Connect ends at its deadline, and
// the Connector's Close returns, ending what is left. Before, the
// disconnect and the calls on the reconnect path waited for an answer for
// good, and with them the bridge's shutdown (docs/reliability.md, bug 194).
func TestStalledBluetoothdCannotHoldClose(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0B:01", Peripheral: newTestPeripheral("dev-s")})
	other := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0B:02", Peripheral: newTestPeripheral("dev-o")})
	logs := &testenv.Buffer{}
	c, err := bluez.New(bluez.Options{Logger: slog.New(slog.NewTextHandler(logs, nil)), CallTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatalf("bluez.New: %v", err)
	}
	l := connect(t, c, "dev-s")
	lo := connect(t, c, "dev-o")
	fake.Stall()

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := l.Read(ctx, gatt.BatteryLevelUUID); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Read on a stalled bluetoothd = %v; want context.DeadlineExceeded", err)
	}
	inFlight := make(chan error, 1)
	go func() {
		_, err := l.Read(context.Background(), gatt.BatteryLevelUUID)
		inFlight <- err
	}()
	closed := make(chan error, 1)
	go func() { closed <- l.Close() }()
	select {
	case err := <-closed:
		if !errors.Is(err, bluez.ErrNoAnswer) {
			t.Errorf("link Close = %v; want an error wrapping ErrNoAnswer", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("link Close did not return on a stalled bluetoothd")
	}
	select {
	case err := <-inFlight:
		if !errors.Is(err, gatt.ErrDisconnected) {
			t.Errorf("a Read in flight at Close = %v; want gatt.ErrDisconnected", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a Read in flight at Close did not end")
	}

	// The reconnect: discovery and the connection are as stalled.
	ctx, cancel = context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	reconnected := make(chan error, 1)
	go func() {
		_, err := c.Connect(ctx, "dev-s")
		reconnected <- err
	}()
	select {
	case err := <-reconnected:
		if err == nil {
			t.Error("Connect on a stalled bluetoothd succeeded")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Connect on a stalled bluetoothd did not return")
	}
	// A link whose Close is under way, its disconnect unanswered, as the
	// Connector closes: the Connector's Close waits for it, and does not
	// end its disconnect before its CallTimeout.
	otherClosed := make(chan error, 1)
	go func() { otherClosed <- lo.Close() }()
	testenv.Eventually(t, 20*time.Second, "the other link's disconnect under way", func() bool {
		return slices.Contains(fake.Calls(), "stalled "+string(other.Path()))
	})
	closeWithin(t, c, 20*time.Second)
	select {
	case err := <-otherClosed:
		if !errors.Is(err, bluez.ErrNoAnswer) {
			t.Errorf("the other link's Close = %v; want an error wrapping ErrNoAnswer, its disconnect given its time", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the other link's Close did not return")
	}
	out := logs.String()
	for _, want := range []string{"bluetoothd did not answer; gave up on the call", "call=Device1.Disconnect",
		"address=C0:FF:EE:00:0B:01", "address=C0:FF:EE:00:0B:02", "systemctl status bluetooth"} {
		if !strings.Contains(out, want) {
			t.Errorf("the log lacks %q:\n%s", want, out)
		}
	}
}

// Discovery that BlueZ ended under the bridge, with the adapter powered
// off and on again (rfkill, bluetoothctl power off) or bluetoothd
// restarted, is started again while a device is still looked for: before,
// the Connector took it as still on for as long as any Connect waited, so
// a device that came in range then was never found (docs/reliability.md,
// bug 387).
func TestDiscoveryRestartsAfterBlueZEndsIt(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cycle func(*fakebluez.BlueZ)
	}{
		{"power off and on", func(f *fakebluez.BlueZ) { f.SetPowered(false); f.SetPowered(true) }},
		{"bluetoothd restarted", func(f *fakebluez.BlueZ) { f.Restart() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := fakebluez.New(t)
			d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0B:01", Peripheral: newTestPeripheral("dev-p")})
			d.SetAdvertising(false) // out of range for now
			c := newConnector(t)
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			res := make(chan error, 1)
			go func() {
				// As gatt.Device does: again after an error, within ctx.
				for {
					l, err := c.Connect(ctx, "dev-p")
					if err == nil {
						l.Close()
					}
					if err == nil || ctx.Err() != nil {
						res <- err
						return
					}
				}
			}()
			fake.WaitDiscovering(true, 10*time.Second)
			tc.cycle(fake)
			d.SetAdvertising(true) // in range again
			if err := <-res; err != nil {
				t.Fatalf("Connect after BlueZ ended discovery: %v", err)
			}
		})
	}
}

// connectRetrying is Connect tried again after each error within timeout,
// as gatt.Device does.
func connectRetrying(t *testing.T, c *bluez.Connector, id string, timeout time.Duration) (gatt.Link, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		l, err := c.Connect(ctx, id)
		if err == nil {
			t.Cleanup(func() { l.Close() })
			return l, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(50 * time.Millisecond): // gatt.Device's first backoff
		}
	}
}

// A USB adapter unplugged and plugged in again may come back under another
// index (/org/bluez/hci1) with its address: the bridge follows it there.
// Before, it kept asking /org/bluez/hci0, which was gone, and every
// device read offline until the bridge was restarted (docs/reliability.md,
// bug 388).
func TestAdapterReplugged(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0C:01", Peripheral: newTestPeripheral("dev-u")})
	c := newConnector(t)
	l := connect(t, c, "dev-u")
	fake.Replug("/org/bluez/hci1")
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed after the adapter was unplugged")
	}
	if _, err := connectRetrying(t, c, "dev-u", 15*time.Second); err != nil {
		t.Fatalf("Connect after the adapter came back as hci1: %v", err)
	}
	if p := d.Path(); !strings.HasPrefix(string(p), "/org/bluez/hci1/") || !d.Connected() {
		t.Errorf("device %s connected = %v; want connected under hci1", p, d.Connected())
	}
}

// The adapter is the one Options.Adapter names, by name or by address (the
// address stays when the kernel renumbers a USB adapter); by default the
// first BlueZ lists, whatever its index. Before, only hci0 could be used:
// a gateway whose adapter was hci1 could not start. One named that is not
// there is waited for, the warning naming those BlueZ has (bug 434; New
// failed with it before).
func TestAdapterChoice(t *testing.T) {
	for _, tc := range []struct {
		adapter  string
		wantWait string
	}{
		{adapter: ""},
		{adapter: "hci1"},
		{adapter: "/org/bluez/hci1"},
		{adapter: strings.ToLower(fakebluez.AdapterAddr)},
		{adapter: "hci0", wantWait: "hci1 (" + fakebluez.AdapterAddr + ")"},
	} {
		t.Run(tc.adapter, func(t *testing.T) {
			fake := fakebluez.New(t)
			fake.Replug("/org/bluez/hci1")
			fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0D:01", Peripheral: newTestPeripheral("dev-c")})
			logs := &testenv.Buffer{}
			c, err := bluez.New(bluez.Options{Adapter: tc.adapter, Logger: slog.New(slog.NewTextHandler(io.MultiWriter(logs, testWriter{t}), nil))})
			if err != nil {
				t.Fatalf("New(Adapter %q): %v", tc.adapter, err)
			}
			t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
			if tc.wantWait != "" {
				if !strings.Contains(logs.String(), "waiting for the adapter") || !strings.Contains(logs.String(), tc.wantWait) {
					t.Errorf("New(Adapter %q) logged no wait naming %q:\n%s", tc.adapter, tc.wantWait, logs.String())
				}
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				defer cancel()
				if _, err := c.Connect(ctx, "dev-c"); err == nil {
					t.Errorf("Connect through hci1 with Adapter %q succeeded", tc.adapter)
				}
				return
			}
			connect(t, c, "dev-c")
		})
	}
}

// With no adapter named, a USB adapter replaced by another (of another
// address) is used in its place; one named by its address is waited for.
func TestAdapterReplaced(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:11:01", Peripheral: newTestPeripheral("dev-s")})
	c := newConnector(t)
	l := connect(t, c, "dev-s")
	fake.Swap("/org/bluez/hci1", "00:1A:7D:DA:71:02")
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed after the adapter was pulled out")
	}
	if _, err := connectRetrying(t, c, "dev-s", 15*time.Second); err != nil {
		t.Fatalf("Connect after the adapter was replaced by another: %v", err)
	}
}

// A device that requires pairing the gateway lacks (Zephyr's SMP
// characteristic with CONFIG_MCUMGR_TRANSPORT_BT_PERM_RW_AUTHEN, the
// default with CONFIG_BT_SMP) refuses the SMP characteristic "Not paired"
// on every connection: gatt.Device says so at once, naming the cure.
// Before, it reconnected until the caller's context ended, and a command
// failed "timeout" after its 10 minutes with the cause in a debug log
// (docs/reliability.md, bug 390).
func TestDeviceThatNeedsPairing(t *testing.T) {
	fake := fakebluez.New(t)
	dev := sim.New(sim.Options{ID: "sim-p"})
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:0E:01", NeedsPairing: true,
		Peripheral: sim.NewPeripheral(dev, sim.PeripheralOptions{})})
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "sim-p", Connector: newConnector(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a command's
	defer cancel()
	_, err = d.Info(ctx)
	if ctx.Err() != nil {
		t.Fatalf("Info = %v, after the caller's whole time; want an error at once", err)
	}
	if !errors.Is(err, gatt.ErrNotPaired) || !strings.Contains(err.Error(), "bluetoothctl pair C0:FF:EE:00:0E:01") {
		t.Fatalf("Info = %v; want gatt.ErrNotPaired naming bluetoothctl pair", err)
	}
}

// A StartDiscovery that bluetoothd answered after CallTimeout (busy for a
// moment) started the session all the same; BlueZ then answers each later
// StartDiscovery of the bridge org.bluez.Error.InProgress, "Operation
// already in progress". The Connector takes that as discovery on. Before,
// it took it as a failure every time and never stopped the session: a
// device was found again only when its advertisement happened to come
// during one of those calls (docs/reliability.md, bug 392).
func TestDiscoveryAlreadyInProgress(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:10:01", Peripheral: newTestPeripheral("dev-i")})
	d.SetAdvertising(false) // not in range yet
	answered := fake.SlowNextStartDiscovery(time.Second)
	c, err := bluez.New(bluez.Options{CallTimeout: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	// Once bluetoothd has answered that first StartDiscovery, the device
	// comes in range and advertises, once a second, until the test ends.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-answered:
		case <-stop:
			return
		}
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			d.SetAdvertising(true)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	// As gatt.Device does, at its longest backoff.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for {
		l, err := c.Connect(ctx, "dev-i")
		if err == nil {
			l.Close()
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("Connect after a StartDiscovery answered late: %v", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// A device another client of BlueZ is connecting (bluetoothctl connect,
// another program) answers Device1.Connect org.bluez.Error.InProgress;
// once that connection is up, the bridge uses it. Before, the Connect
// waited for an advertisement the connected device no longer sent, until
// its time ran out (docs/reliability.md, bug 393).
func TestConnectInProgressElsewhere(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:12:01", Peripheral: newTestPeripheral("dev-e")})
	c := newConnector(t)
	// Known first: the bridge has read the device once.
	l := connect(t, c, "dev-e")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	refused, complete := d.ConnectElsewhere()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // gatt.Device's connect timeout
	defer cancel()
	res := make(chan error, 1)
	go func() {
		l, err := c.Connect(ctx, "dev-e")
		if err == nil {
			l.Close()
		}
		res <- err
	}()
	d.SetAdvertising(true) // found again, and refused: InProgress
	select {
	case <-refused:
	case <-ctx.Done():
		t.Fatal("Device1.Connect never refused InProgress")
	}
	complete() // the other client's connection is up
	if err := <-res; err != nil {
		t.Fatalf("Connect to a device another client connected: %v", err)
	}
}

// smpOnlyPeripheral is a Zephyr device with MCUmgr's SMP service and no
// Device Information Service: a neighbour's product, say, not one of the
// bridge's.
type smpOnlyPeripheral struct{ *testPeripheral }

func (p smpOnlyPeripheral) Services() []gatt.Service { return p.testPeripheral.Services()[:1] }

// A device that advertises the SMP service but cannot be told apart (no
// DIS serial number, or one it refuses to read) is probed once, and not
// again at each of its advertisements for the next minute. Before, the
// bridge connected to it again at each one, for as long as it looked for a
// device of its own: a neighbour's device was connected to over and over,
// and the bridge's own waited behind it (docs/reliability.md, bug 394).
func TestUnidentifiedDeviceNotProbedAtEachAdvertisement(t *testing.T) {
	fake := fakebluez.New(t)
	other := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:13:01", Peripheral: smpOnlyPeripheral{newTestPeripheral("")}})
	ours := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:13:02", Peripheral: newTestPeripheral("dev-o")})
	ours.SetAdvertising(false) // not in range yet
	c := newConnector(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	res := make(chan error, 1)
	go func() {
		l, err := c.Connect(ctx, "dev-o")
		if err == nil {
			l.Close()
		}
		res <- err
	}()
	// The other device is probed, found unidentifiable and let go.
	fake.WaitCalls("Device1.Disconnect "+string(other.Path()), 1, 10*time.Second)
	other.SetAdvertising(true) // it advertises again
	ours.SetAdvertising(true)  // and ours comes in range
	if err := <-res; err != nil {
		t.Fatalf("Connect: %v", err)
	}
	if n := fake.WaitCalls("Device1.Connect "+string(other.Path()), 1, time.Second); n != 1 {
		t.Errorf("the unidentifiable device was connected to %d times; want once", n)
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a test at once.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// With the adapter off (rfkill at night, bluetoothctl power off), every
// connection attempt of every device fails to start discovery, the same
// way: the bridge says so once, and once more when discovery starts again.
// Before, it logged a warning at each attempt, several a second with a few
// devices, for as long as the adapter stayed off (docs/reliability.md,
// bug 395).
func TestDiscoveryFailureLoggedOnce(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:14:01", Peripheral: newTestPeripheral("dev-l")})
	var logs syncBuffer
	c, err := bluez.New(bluez.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	fake.SetPowered(false)
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.Connect(ctx, "dev-l")
		timedOut := ctx.Err() != nil
		cancel()
		if err == nil || timedOut {
			t.Fatalf("Connect with the adapter off = %v; want the discovery's failure at once", err)
		}
	}
	fake.SetPowered(true)
	connect(t, c, "dev-l")
	out := logs.String()
	if n := strings.Count(out, "discovery failed"); n != 1 {
		t.Errorf("%d warnings of the same discovery failure over 5 attempts; want 1:\n%s", n, out)
	}
	if !strings.Contains(out, "discovery works again") {
		t.Errorf("no word that discovery works again:\n%s", out)
	}
}

// The bridge started before bluetoothd (at boot, or with it stopped),
// before its adapter (a USB adapter not plugged in yet, a driver not
// loaded) or with the adapter blocked by rfkill: New returns a Connector
// that waits for it, saying so once, and Connect finds the device once
// BlueZ and its adapter are there, as a running Connector rides the same
// out. Before, New failed, the bridge exited with status 1, and systemd
// started it again every 2 s for as long as it lasted (docs/reliability.md,
// bug 434).
func TestNewWaitsForBlueZAndTheAdapter(t *testing.T) {
	for _, tc := range []struct {
		name        string
		adapter     string // Options.Adapter
		before, fix func(*fakebluez.BlueZ)
		logged      string
	}{
		{"bluetoothd not running", "", (*fakebluez.BlueZ).Exit, (*fakebluez.BlueZ).Start, "bluetoothd is not on the system bus"},
		{"no adapter", "", (*fakebluez.BlueZ).Unplug,
			func(f *fakebluez.BlueZ) { f.Plug(fakebluez.AdapterPath, fakebluez.AdapterAddr) }, "waiting for the adapter"},
		{"adapter named by its address not there", strings.ToLower(fakebluez.AdapterAddr), (*fakebluez.BlueZ).Unplug,
			func(f *fakebluez.BlueZ) { f.Plug("/org/bluez/hci1", fakebluez.AdapterAddr) }, "waiting for the adapter"},
		{"adapter blocked by rfkill", "", func(f *fakebluez.BlueZ) { f.SetBlocked(true) },
			func(f *fakebluez.BlueZ) { f.SetBlocked(false) }, "could not be powered on"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := fakebluez.New(t)
			fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:1A:01", Peripheral: newTestPeripheral("dev-w")})
			tc.before(fake)
			logs := &testenv.Buffer{}
			c, err := bluez.New(bluez.Options{Adapter: tc.adapter, Logger: slog.New(slog.NewTextHandler(io.MultiWriter(logs, testWriter{t}), nil))})
			if err != nil {
				t.Fatalf("bluez.New with %s: %v; want a Connector that waits for it", tc.name, err)
			}
			t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
			// Devices looked for meanwhile are not found, and said once.
			for range 3 {
				ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
				_, err := c.Connect(ctx, "dev-w")
				cancel()
				if err == nil {
					t.Fatalf("Connect with %s succeeded", tc.name)
				}
			}
			if n := strings.Count(logs.String(), tc.logged); n != 1 {
				t.Errorf("the log says %q %d times; want once:\n%s", tc.logged, n, logs.String())
			}
			tc.fix(fake)
			if _, err := connectRetrying(t, c, "dev-w", 15*time.Second); err != nil {
				t.Fatalf("Connect once %s no more: %v", tc.name, err)
			}
		})
	}
}

// A bridge started while bluetoothd hangs (it owns its name on the bus and
// answers nothing) stays up, as one running rides out a hang, and finds its
// devices once bluetoothd is restarted (systemd's watchdog, or a person).
// Before, New failed after CallTimeout, "bluetoothd did not answer", and
// the bridge exited with status 1 to start again into the same hang
// (docs/reliability.md, bug 439).
func TestNewWaitsOutAHungBluetoothd(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:1B:01", Peripheral: newTestPeripheral("dev-h")})
	fake.Stall()
	logs := &testenv.Buffer{}
	c, err := bluez.New(bluez.Options{CallTimeout: 300 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.MultiWriter(logs, testWriter{t}), nil))})
	if err != nil {
		t.Fatalf("bluez.New with bluetoothd hung: %v; want a Connector that waits for it", err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	if !strings.Contains(logs.String(), "did not answer") {
		t.Errorf("New logged nothing of bluetoothd not answering:\n%s", logs.String())
	}
	fake.Unstall()
	if _, err := connectRetrying(t, c, "dev-h", 15*time.Second); err != nil {
		t.Fatalf("Connect once bluetoothd was restarted: %v", err)
	}
}

// A device reset (or paired with another gateway) forgets its bond, which
// BlueZ keeps: each connection comes up, fails to be encrypted with the
// key the device no longer has, and ends; Connect is answered Failed
// ("le-connection-abort-by-local" on most BlueZ, "le-connection-key-missing"
// where the kernel says so). A command to it must fail at once with
// gatt.ErrNotPaired naming the cure, not retry until its time is out
// (docs/reliability.md, bug 463).
func TestDeviceWhoseBondIsLost(t *testing.T) {
	for _, reply := range []string{"le-connection-abort-by-local", "le-connection-key-missing"} {
		t.Run(reply, func(t *testing.T) {
			loseBondWhileConnected(t, "sim-b", "C0:FF:EE:00:13:01", func(fd *fakebluez.Device) { fd.LoseBond(reply) })
		})
	}
}

// BlueZ's att_connect_cb answers a Connect whose ATT connection the
// kernel reports aborted (ECONNABORTED) as if it had worked: the link is
// down a moment after, the services never resolved. A device whose bond is
// lost, refused so, must fail a command at once too
// (docs/reliability.md, bug 463).
func TestDeviceWhoseBondIsLostAfterConnectIsAnswered(t *testing.T) {
	loseBondWhileConnected(t, "sim-a", "C0:FF:EE:00:16:01", (*fakebluez.Device).LoseBondAfterConnect)
}

// The bridge restarted after a device lost its bond: BlueZ keeps the bond
// (Paired), the device refuses every connection before its serial number
// can be read, and the new Connector must still know the address to be
// the device asked for, from its StateFile, and fail at once naming the
// cure, not leave it alone as unidentified until the command's time is
// out (docs/reliability.md, bug 495).
func TestDeviceWhoseBondIsLostAfterARestart(t *testing.T) {
	fake := fakebluez.New(t)
	dev := sim.New(sim.Options{ID: "sim-r"})
	fd := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:15:01",
		Peripheral: sim.NewPeripheral(dev, sim.PeripheralOptions{})})
	state := filepath.Join(t.TempDir(), "data", "bluez-addresses.json")
	newWithState := func() *bluez.Connector {
		c, err := bluez.New(bluez.Options{StateFile: state,
			Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatalf("bluez.New: %v", err)
		}
		return c
	}
	first := newWithState()
	l := connect(t, first, "sim-r")
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	closeWithin(t, first, 10*time.Second) // the bridge stops

	fd.LoseBond("le-connection-abort-by-local")
	c := newWithState() // and starts again
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "sim-r", Connector: c})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a command's
	defer cancel()
	notPairedAtOnce(ctx, t, d, "C0:FF:EE:00:15:01", "Info after a restart")
}

// A state file that cannot be parsed (a disk that lost its last write, a
// hand edit) is no reason not to start: the Connector warns, starts with
// no address known, and writes the file anew once it has read a device
// (docs/reliability.md, bug 495).
func TestDamagedStateFileIsLearntAgain(t *testing.T) {
	fake := fakebluez.New(t)
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:17:01", Peripheral: newTestPeripheral("dev-d")})
	state := filepath.Join(t.TempDir(), "bluez-addresses.json")
	if err := os.WriteFile(state, []byte(`{"C0:FF:EE:00:17:01": "dev-`), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	c, err := bluez.New(bluez.Options{StateFile: state, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatalf("bluez.New with a damaged state file: %v", err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	if !strings.Contains(logs.String(), "could not be read back") {
		t.Errorf("New logged nothing of the damaged state file:\n%s", logs.String())
	}
	if err := connect(t, c, "dev-d").Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(state)
	var ids map[string]string
	if err == nil {
		err = json.Unmarshal(b, &ids)
	}
	if err != nil || ids["C0:FF:EE:00:17:01"] != "dev-d" || len(ids) != 1 {
		t.Fatalf("state file after a read = %s, %v; want the device's address alone", b, err)
	}
}

// A device with a resolvable private address (Zephyr's CONFIG_BT_PRIVACY,
// a new one every 15 minutes) is at a new address at each reconnection
// after a rotation. The Connector's address → device id map held every
// address it had read, for as long as it ran; it must hold one per
// device, and still know the address of a device that did not move
// (docs/reliability.md, bug 464).
func TestRotatingAddressesKeepOneEntryPerDevice(t *testing.T) {
	fake := fakebluez.New(t)
	ps := newTestPeripheral("dev-s")
	still := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:14:FF", Peripheral: ps})
	c := newConnector(t)
	if err := connect(t, c, "dev-s").Close(); err != nil {
		t.Fatal(err)
	}
	pr := newTestPeripheral("dev-r")
	var old *fakebluez.Device
	const rotations = 6
	for i := range rotations {
		if old != nil {
			old.SetAdvertising(false) // that address is no more
		}
		old = fake.AddDevice(fakebluez.DeviceOptions{Address: fmt.Sprintf("C0:FF:EE:00:14:%02X", i), Peripheral: pr})
		if err := connect(t, c, "dev-r").Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := c.Addresses(); n != 2 {
		t.Errorf("the Connector holds %d addresses after %d rotations of one device beside another; want 2", n, rotations)
	}
	// The device that stayed is reconnected without a probe.
	if err := connect(t, c, "dev-s").Close(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(strings.Join(fake.Calls(), "\n"), "Device1.Connect "+string(still.Path())); n != 2 {
		t.Errorf("%d Device1.Connect calls to dev-s; want 2 (no probe on reconnect)", n)
	}
}

// A device that indicates Service Changed over the connection (its
// firmware changed its GATT table) has BlueZ remove the characteristics'
// objects and export them again, which ends the notification sessions on
// them: the SMP characteristic's answers came no more, and each command
// over the link waited out its request timeout, while the link read as up.
// The next command must be answered over a link that hears the device
// (docs/reliability.md, bug 465).
func TestServiceChangedWhileConnected(t *testing.T) {
	fake := fakebluez.New(t)
	dev := sim.New(sim.Options{ID: "sim-c"})
	fd := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:15:01",
		Peripheral: sim.NewPeripheral(dev, sim.PeripheralOptions{})})
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "sim-c", Connector: newConnector(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := d.Info(ctx); err != nil {
		t.Fatalf("Info before the services changed: %v", err)
	}
	fd.ChangeServices()
	// Within one request timeout (DefaultRequestTimeout), as on a link
	// that hears the device.
	rctx, rcancel := context.WithTimeout(ctx, gatt.DefaultRequestTimeout)
	defer rcancel()
	if _, err := d.Info(rctx); err != nil {
		t.Fatalf("Info after the device's services changed: %v", err)
	}
}

// holdingPeripheral is a testPeripheral whose SMP writes, once hold is
// set, wait for release: a request the device is still taking.
type holdingPeripheral struct {
	*testPeripheral
	hold             atomic.Bool
	entered, release chan struct{}
}

func (p *holdingPeripheral) WriteChar(uuid string, data []byte) error {
	if p.hold.Load() {
		close(p.entered)
		<-p.release
	}
	return p.testPeripheral.WriteChar(uuid, data)
}

// A write in flight as the device's services change, which BlueZ drops
// unanswered, ends at once with gatt.ErrDisconnected, and the device is
// connected to again (docs/reliability.md, bug 465).
func TestServiceChangedEndsCallsInFlight(t *testing.T) {
	fake := fakebluez.New(t)
	p := &holdingPeripheral{testPeripheral: newTestPeripheral("dev-h"), entered: make(chan struct{}), release: make(chan struct{})}
	defer close(p.release)
	fd := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:15:02", Peripheral: p})
	c := newConnector(t)
	l := connect(t, c, "dev-h")
	p.hold.Store(true)
	errc := make(chan error, 1)
	go func() { errc <- l.Write(context.Background(), gatt.SMPCharUUID, []byte("x"), true) }()
	<-p.entered
	fd.ChangeServices()
	select {
	case err := <-errc:
		if !errors.Is(err, gatt.ErrDisconnected) {
			t.Fatalf("Write in flight as the services changed = %v; want gatt.ErrDisconnected", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the write in flight as the services changed did not end")
	}
	select {
	case <-l.Done():
	default:
		t.Fatal("the link's Done is not closed")
	}
	p.hold.Store(false)
	l2 := connect(t, c, "dev-h")
	if err := l2.Write(context.Background(), gatt.SMPCharUUID, []byte("y"), true); err != nil {
		t.Fatalf("Write over the new link: %v", err)
	}
}

// After a connection attempt that failed, the device is tried again at its
// next advertisement. BlueZ announces an advertisement of a device it knows
// only as an RSSI change of 8 dBm or more, unless a discovery filter has
// RSSI: a device that stayed where it was, its RSSI steady, was not found
// again within the Connect call, which ran out its whole time, "not found".
// The failures of one Connect call are warned about once
// (docs/reliability.md, bug 466).
func TestDeviceFoundAgainAfterAFailedAttempt(t *testing.T) {
	fake := fakebluez.New(t)
	d := fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:16:01", Peripheral: newTestPeripheral("dev-f")})
	d.FailConnects(3)
	var logs syncBuffer
	c, err := bluez.New(bluez.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeWithin(t, c, 10*time.Second) })
	ctx, cancel := context.WithTimeout(context.Background(), gatt.DefaultConnectTimeout)
	defer cancel()
	l, err := c.Connect(ctx, "dev-f")
	if err != nil {
		t.Fatalf("Connect after failed attempts: %v", err)
	}
	l.Close()
	if n := strings.Count(strings.Join(fake.Calls(), "\n"), "Device1.Connect "); n != 4 {
		t.Errorf("%d Device1.Connect calls; want 4 (three failed, one that worked)", n)
	}
	if n := strings.Count(logs.String(), "connect failed"); n != 1 {
		t.Errorf("%d warnings of a failed attempt over one Connect call; want 1:\n%s", n, logs.String())
	}
}

// notPairedAtOnce wants d's Info (what, in a failure) to fail within ctx,
// a command's time, with gatt.ErrNotPaired naming the cure for addr.
func notPairedAtOnce(ctx context.Context, t *testing.T, d *gatt.Device, addr, what string) {
	t.Helper()
	_, err := d.Info(ctx)
	if ctx.Err() != nil {
		t.Fatalf("%s = %v, after the caller's whole time; want an error at once", what, err)
	}
	if !errors.Is(err, gatt.ErrNotPaired) || !strings.Contains(err.Error(), "bluetoothctl remove "+addr) {
		t.Fatalf("%s = %v; want gatt.ErrNotPaired naming bluetoothctl remove", what, err)
	}
}

// loseBondWhileConnected reads the simulated device id at addr, makes it
// lose its bond with lose, drops its link, and wants the next Info, within
// a command's time, to fail at once with gatt.ErrNotPaired.
func loseBondWhileConnected(t *testing.T, id, addr string, lose func(*fakebluez.Device)) {
	t.Helper()
	fake := fakebluez.New(t)
	fd := fake.AddDevice(fakebluez.DeviceOptions{Address: addr,
		Peripheral: sim.NewPeripheral(sim.New(sim.Options{ID: id}), sim.PeripheralOptions{})})
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: id, Connector: newConnector(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a command's
	defer cancel()
	if _, err := d.Info(ctx); err != nil {
		t.Fatalf("Info while the bond holds: %v", err)
	}
	lose(fd)
	fd.Drop()
	notPairedAtOnce(ctx, t, d, addr, "Info")
}
