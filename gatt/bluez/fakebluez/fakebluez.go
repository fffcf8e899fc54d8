package fakebluez

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/prop"
)

// D-Bus names BlueZ uses.
const (
	busName       = "org.bluez"
	ifaceAdapter  = "org.bluez.Adapter1"
	ifaceDevice   = "org.bluez.Device1"
	ifaceService  = "org.bluez.GattService1"
	ifaceChar     = "org.bluez.GattCharacteristic1"
	ifaceObjMgr   = "org.freedesktop.DBus.ObjectManager"
	ifaceProps    = "org.freedesktop.DBus.Properties"
	AdapterPath   = dbus.ObjectPath("/org/bluez/hci0")
	AdapterAddr   = "00:1A:7D:DA:71:01"
	errFailed     = "org.bluez.Error.Failed"
	errInProgress = "org.bluez.Error.InProgress"
)

// BlueZ is a fake org.bluez on a private bus. Its methods are safe for
// concurrent use.
type BlueZ struct {
	tb      testing.TB
	conn    *dbus.Conn
	killBus func()

	mu          sync.Mutex
	objects     map[dbus.ObjectPath]*object
	adapter     *prop.Properties
	adapterPath dbus.ObjectPath // AdapterPath until Replug
	devices     map[dbus.ObjectPath]*Device
	discovering map[dbus.Sender]bool
	filters     map[dbus.Sender][]string // UUIDs of SetDiscoveryFilter
	proximity   map[dbus.Sender]bool     // SetDiscoveryFilter had RSSI or Pathloss
	calls       []string
	slowStart   time.Duration // the next StartDiscovery answers this late
	slowDone    chan struct{} // closed once it has
	changed     chan struct{} // closed and replaced when discovery starts or stops, and on each call
	wg          sync.WaitGroup
	closing     chan struct{}
	// blocked is rfkill's soft block of the adapter (SetBlocked): it
	// refuses to be powered on. Not under mu: the Powered property's
	// callback runs under the property's lock.
	blocked atomic.Bool
	unstall func() // ends Stall's connection; nil when not stalled
}

type object struct {
	props  *prop.Properties
	ifaces []string
}

// New starts a private bus (StartBus) and exports a fake BlueZ with one
// powered adapter, hci0, on it. Everything stops in tb.Cleanup.
func New(tb testing.TB) *BlueZ {
	tb.Helper()
	return newOn(tb, "")
}

// NewRefusing is New on a bus whose policy refuses every method call to
// org.bluez (AccessDenied), as a distribution's does for a user outside
// the "bluetooth" group.
func NewRefusing(tb testing.TB) *BlueZ {
	tb.Helper()
	return newOn(tb, "\n    <deny send_destination=\""+busName+"\" send_type=\"method_call\"/>")
}

func newOn(tb testing.TB, policy string) *BlueZ {
	tb.Helper()
	_, killBus := startBusWith(tb, policy)
	conn, err := dbus.ConnectSystemBus()
	if err != nil {
		tb.Fatalf("fakebluez: connect: %v", err)
	}
	b := &BlueZ{
		tb:          tb,
		conn:        conn,
		killBus:     killBus,
		objects:     map[dbus.ObjectPath]*object{},
		devices:     map[dbus.ObjectPath]*Device{},
		discovering: map[dbus.Sender]bool{},
		filters:     map[dbus.Sender][]string{},
		proximity:   map[dbus.Sender]bool{},
		changed:     make(chan struct{}),
		closing:     make(chan struct{}),
	}
	tb.Cleanup(func() {
		close(b.closing)
		// The goroutines a method call started under b.mu happen before
		// the Wait: the race detector sees no order through the bus's
		// socket, and took the Wait after a Connect the test had its
		// answer to for a race with that Connect's Add.
		b.mu.Lock()
		//lint:ignore SA2001 the empty section is the order the comment above needs
		b.mu.Unlock()
		b.wg.Wait()
		conn.Close()
	})
	if err := conn.Export(objectManager{b}, "/", ifaceObjMgr); err != nil {
		tb.Fatal(err)
	}
	b.mu.Lock()
	b.exportAdapterLocked(AdapterPath, AdapterAddr)
	b.mu.Unlock()
	// AllowReplacement: Stall hands the name to a connection that never
	// answers, with no moment of the name unowned between.
	reply, err := conn.RequestName(busName, dbus.NameFlagDoNotQueue|dbus.NameFlagAllowReplacement)
	if err != nil || reply != dbus.RequestNameReplyPrimaryOwner {
		tb.Fatalf("fakebluez: own %s: %v %v", busName, reply, err)
	}
	return b
}

// exportAdapterLocked creates the powered Adapter1 object at path.
func (b *BlueZ) exportAdapterLocked(path dbus.ObjectPath, addr string) {
	b.adapterPath = path
	b.adapter = b.addObjectLocked(path, prop.Map{ifaceAdapter: {
		"Address":     {Value: addr, Emit: prop.EmitConst},
		"AddressType": {Value: "public", Emit: prop.EmitConst},
		"Name":        {Value: "fakebluez", Emit: prop.EmitConst},
		"Alias":       {Value: "fakebluez", Writable: true, Emit: prop.EmitTrue},
		"Powered": {Value: true, Writable: true, Emit: prop.EmitTrue, Callback: func(c *prop.Change) *dbus.Error {
			if on, _ := c.Value.(bool); on && b.blocked.Load() {
				// As BlueZ answers a power-on while rfkill blocks the
				// adapter.
				return dbus.NewError("org.bluez.Error.Blocked", []any{"Blocked through rfkill"})
			}
			return nil
		}},
		"Discoverable": {Value: false, Writable: true, Emit: prop.EmitTrue},
		"Discovering":  {Value: false, Emit: prop.EmitTrue},
		"UUIDs":        {Value: []string{}, Emit: prop.EmitTrue},
	}}, map[string]any{ifaceAdapter: adapter1{b}})
}

// Replug is the USB adapter unplugged and plugged in again, coming back
// at path (/org/bluez/hci1, say, when the kernel gave it another index),
// with its address: the connections and discovery sessions end, the
// devices' and the adapter's objects go (InterfacesRemoved), and the
// adapter comes back, powered, at path (InterfacesAdded); its devices are
// under path once discovery finds them again.
func (b *BlueZ) Replug(path dbus.ObjectPath) {
	b.Swap(path, b.adapter.GetMust(ifaceAdapter, "Address").(string))
}

// Swap is Replug with another adapter, of address addr, plugged in at path
// in place of the one pulled out: a dead USB adapter replaced.
func (b *BlueZ) Swap(path dbus.ObjectPath, addr string) {
	b.Unplug()
	b.Plug(path, addr)
}

// Unplug is the adapter pulled out (or not plugged in yet, or its driver
// not loaded): the connections and discovery sessions end, and the
// devices' and the adapter's objects go (InterfacesRemoved). BlueZ has no
// adapter until Plug.
func (b *BlueZ) Unplug() {
	b.stopAll()
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, d := range b.devices {
		if d.props != nil {
			b.removeObjectLocked(d.path)
			d.props = nil
		}
	}
	b.removeObjectLocked(b.adapterPath)
}

// Plug is an adapter of address addr plugged in at path after Unplug: its
// object comes, powered (InterfacesAdded), and the devices are under path
// once discovery finds them again.
func (b *BlueZ) Plug(path dbus.ObjectPath, addr string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	devs := map[dbus.ObjectPath]*Device{}
	for _, d := range b.devices {
		d.path = macPath(path, d.opts.Address)
		devs[d.path] = d
	}
	b.devices = devs
	b.exportAdapterLocked(path, addr)
}

// Calls lists the BlueZ methods called so far, in order, as
// "Interface.Method path" with the write type for WriteValue, e.g.
// "GattCharacteristic1.WriteValue(command) /org/bluez/hci0/dev_…/char000b".
func (b *BlueZ) Calls() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.calls)
}

func (b *BlueZ) logCall(format string, args ...any) {
	b.calls = append(b.calls, fmt.Sprintf(format, args...))
	b.notifyLocked()
}

// WaitCalls waits until n calls listed by Calls contain substr, failing the
// test after timeout, and returns how many there are.
func (b *BlueZ) WaitCalls(substr string, n int, timeout time.Duration) int {
	b.tb.Helper()
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		b.mu.Lock()
		got := 0
		for _, c := range b.calls {
			if strings.Contains(c, substr) {
				got++
			}
		}
		changed := b.changed
		b.mu.Unlock()
		if got >= n {
			return got
		}
		select {
		case <-changed:
		case <-t.C:
			b.tb.Fatalf("fakebluez: %d calls with %q, not %d, after %v", got, substr, n, timeout)
		}
	}
}

// Exit gives up the org.bluez name without a word, as bluetoothd does when
// it exits or crashes; clients see only NameOwnerChanged.
func (b *BlueZ) Exit() {
	if _, err := b.conn.ReleaseName(busName); err != nil {
		b.tb.Errorf("fakebluez: release %s: %v", busName, err)
	}
}

// Stall makes org.bluez stop answering, as a bluetoothd that hangs (a
// deadlock, SIGSTOP, a controller wedged under it) does: the name passes,
// without a moment unowned, to a connection that takes every method call
// and answers none, and emits nothing. Clients see no NameOwnerChanged to
// an empty owner and no error: their calls wait, each listed by Calls as
// "stalled PATH". It lasts until the test ends.
func (b *BlueZ) Stall() {
	b.tb.Helper()
	hold := make(chan struct{})
	conn, err := dbus.ConnectSystemBus(dbus.WithHandler(stalled{b, hold}))
	if err != nil {
		b.tb.Fatalf("fakebluez: stall: connect: %v", err)
	}
	var once sync.Once
	end := func() {
		once.Do(func() {
			close(hold)
			conn.Close()
		})
	}
	b.tb.Cleanup(end)
	b.mu.Lock()
	b.unstall = end
	b.mu.Unlock()
	reply, err := conn.RequestName(busName, dbus.NameFlagDoNotQueue|dbus.NameFlagReplaceExisting)
	if err != nil || reply != dbus.RequestNameReplyPrimaryOwner {
		b.tb.Fatalf("fakebluez: stall: own %s: %v %v", busName, reply, err)
	}
}

// Unstall ends Stall as systemd ends a hung bluetoothd and starts it
// again (its watchdog, or systemctl restart bluetooth): the hung one
// leaves the bus (NameOwnerChanged to no owner), and the fake takes the
// name again with its objects as they were.
func (b *BlueZ) Unstall() {
	b.tb.Helper()
	b.mu.Lock()
	end := b.unstall
	b.unstall = nil
	b.mu.Unlock()
	if end == nil {
		b.tb.Fatal("fakebluez: Unstall without Stall")
	}
	end()
	b.Start()
}

// stalled is the handler of a stalled org.bluez: every method call waits
// until hold closes (the test's end), then finds no object.
type stalled struct {
	b    *BlueZ
	hold chan struct{}
}

func (s stalled) LookupObject(path dbus.ObjectPath) (dbus.ServerObject, bool) {
	s.b.mu.Lock()
	s.b.logCall("stalled %s", path)
	s.b.mu.Unlock()
	<-s.hold
	return nil, false
}

// KillBus kills the private bus daemon, as a system bus that dies or is
// restarted (systemctl restart dbus) does to its clients: every connection
// to it ends, this fake's too.
func (b *BlueZ) KillBus() { b.killBus() }

// Emit sends a signal from org.bluez with whatever body it is given, as a
// buggy bluetoothd could: for tests of what a client does with a body of
// the wrong length or types.
func (b *BlueZ) Emit(path dbus.ObjectPath, name string, body ...any) error {
	return b.conn.Emit(path, name, body...)
}

// SetPowered switches the adapter on or off, as rfkill or a user
// (bluetoothctl power off) would. Off, as BlueZ's adapter_stop does, it
// ends every connection and every client's discovery session: a client
// that wants discovery after the adapter is back must start it again.
func (b *BlueZ) SetPowered(on bool) {
	if !on {
		b.stopAll()
	}
	setProp(b.adapter, ifaceAdapter, "Powered", on)
}

// SetBlocked soft-blocks the adapter as rfkill does (on), which powers it
// off and refuses to power it on again, or unblocks it, which leaves it
// off until someone powers it on.
func (b *BlueZ) SetBlocked(on bool) {
	b.blocked.Store(on)
	if on {
		b.SetPowered(false)
	}
}

// stopAll drops every connection and ends every discovery session.
func (b *BlueZ) stopAll() {
	b.mu.Lock()
	devs := make([]*Device, 0, len(b.devices))
	for _, d := range b.devices {
		devs = append(devs, d)
	}
	b.mu.Unlock()
	for _, d := range devs {
		d.Drop()
	}
	b.mu.Lock()
	for _, d := range devs {
		if d.pending != nil {
			close(d.pending)
			d.pending = nil
		}
	}
	had := len(b.discovering) > 0
	b.discovering = map[dbus.Sender]bool{}
	b.filters = map[dbus.Sender][]string{}
	b.proximity = map[dbus.Sender]bool{}
	if had {
		setProp(b.adapter, ifaceAdapter, "Discovering", false)
		b.endDiscoveryLocked()
	}
	b.notifyLocked()
	b.mu.Unlock()
}

// Restart is bluetoothd restarted (systemctl restart bluetooth, or a crash
// and systemd's restart): its connections and discovery sessions end, it
// leaves the bus (NameOwnerChanged to no owner) and takes the name again
// with its objects as they were; a client must start discovery again.
func (b *BlueZ) Restart() {
	b.tb.Helper()
	b.stopAll()
	b.Exit()
	b.Start()
}

// Start is bluetoothd starting after Exit (or after a test's Exit before
// any client came): it takes the org.bluez name with its objects as they
// were.
func (b *BlueZ) Start() {
	b.tb.Helper()
	reply, err := b.conn.RequestName(busName, dbus.NameFlagDoNotQueue|dbus.NameFlagAllowReplacement)
	if err != nil || reply != dbus.RequestNameReplyPrimaryOwner {
		b.tb.Fatalf("fakebluez: start: own %s: %v %v", busName, reply, err)
	}
}

// WaitDiscovering waits until some client's discovery session is on (on)
// or none is (!on), failing the test after timeout.
func (b *BlueZ) WaitDiscovering(on bool, timeout time.Duration) {
	b.tb.Helper()
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		b.mu.Lock()
		now, changed := len(b.discovering) > 0, b.changed
		b.mu.Unlock()
		if now == on {
			return
		}
		select {
		case <-changed:
		case <-t.C:
			b.tb.Fatalf("fakebluez: discovery on = %v, not %v, after %v", now, on, timeout)
		}
	}
}

// notifyLocked wakes WaitDiscovering.
func (b *BlueZ) notifyLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// addObjectLocked exports an object with its properties and methods and
// announces it with InterfacesAdded.
func (b *BlueZ) addObjectLocked(path dbus.ObjectPath, props prop.Map, methods map[string]any) *prop.Properties {
	p, err := prop.Export(b.conn, path, props)
	if err != nil {
		b.tb.Errorf("fakebluez: export %s: %v", path, err)
		return nil
	}
	o := &object{props: p}
	for iface := range props {
		o.ifaces = append(o.ifaces, iface)
		if m, ok := methods[iface]; ok {
			if err := b.conn.Export(m, path, iface); err != nil {
				b.tb.Errorf("fakebluez: export %s %s: %v", path, iface, err)
			}
		}
	}
	sort.Strings(o.ifaces)
	b.objects[path] = o
	b.conn.Emit("/", ifaceObjMgr+".InterfacesAdded", path, o.all())
	return p
}

// removeObjectLocked unexports an object and announces it with
// InterfacesRemoved.
func (b *BlueZ) removeObjectLocked(path dbus.ObjectPath) {
	o, ok := b.objects[path]
	if !ok {
		return
	}
	delete(b.objects, path)
	for _, iface := range o.ifaces {
		b.conn.Export(nil, path, iface)
	}
	b.conn.Export(nil, path, ifaceProps)
	b.conn.Emit("/", ifaceObjMgr+".InterfacesRemoved", path, o.ifaces)
}

// all is the object's properties, for GetManagedObjects. A byte array (a
// characteristic's Value) is a copy: prop keeps one array for a property
// and stores a value no longer than it into it, in place, so the array the
// reply held was written by the next notification while the reply was
// encoded, after the call had returned (a data race, seen in make test,
// 2026-12-01).
func (o *object) all() map[string]map[string]dbus.Variant {
	m := map[string]map[string]dbus.Variant{}
	for _, iface := range o.ifaces {
		v, err := o.props.GetAll(iface)
		if err != nil {
			continue
		}
		for name, val := range v {
			if b, ok := val.Value().([]byte); ok {
				v[name] = dbus.MakeVariant(slices.Clone(b))
			}
		}
		m[iface] = v
	}
	return m
}

// objectManager is org.freedesktop.DBus.ObjectManager at /.
type objectManager struct{ b *BlueZ }

func (om objectManager) GetManagedObjects() (map[dbus.ObjectPath]map[string]map[string]dbus.Variant, *dbus.Error) {
	b := om.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("ObjectManager.GetManagedObjects /")
	out := make(map[dbus.ObjectPath]map[string]map[string]dbus.Variant, len(b.objects))
	for path, o := range b.objects {
		out[path] = o.all()
	}
	return out, nil
}

// adapter1 is org.bluez.Adapter1 at /org/bluez/hci0.
type adapter1 struct{ b *BlueZ }

func (a adapter1) SetDiscoveryFilter(sender dbus.Sender, filter map[string]dbus.Variant) *dbus.Error {
	b := a.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("Adapter1.SetDiscoveryFilter %s", b.adapterPath)
	var uuids []string
	if v, ok := filter["UUIDs"]; ok {
		list, ok := v.Value().([]string)
		if !ok {
			return dbus.NewError("org.bluez.Error.InvalidArguments", []any{"UUIDs must be as"})
		}
		for _, u := range list {
			uuids = append(uuids, strings.ToLower(u))
		}
	}
	if v, ok := filter["Transport"]; ok {
		if t, _ := v.Value().(string); t != "le" && t != "auto" && t != "bredr" {
			return dbus.NewError("org.bluez.Error.InvalidArguments", []any{"bad Transport"})
		}
	}
	prox := false
	if v, ok := filter["RSSI"]; ok {
		r, ok := v.Value().(int16)
		if !ok || r < -127 || r > 20 {
			return dbus.NewError("org.bluez.Error.InvalidArguments", []any{"Invalid arguments in method call"})
		}
		prox = true
	}
	if v, ok := filter["Pathloss"]; ok {
		if _, ok := v.Value().(uint16); !ok {
			return dbus.NewError("org.bluez.Error.InvalidArguments", []any{"Invalid arguments in method call"})
		}
		prox = true
	}
	b.filters[sender] = uuids
	b.proximity[sender] = prox
	return nil
}

func (a adapter1) StartDiscovery(sender dbus.Sender) *dbus.Error {
	b := a.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("Adapter1.StartDiscovery %s", b.adapterPath)
	if !b.adapter.GetMust(ifaceAdapter, "Powered").(bool) {
		return dbus.NewError("org.bluez.Error.NotReady", []any{"Resource Not Ready"})
	}
	if b.discovering[sender] {
		return dbus.NewError(errInProgress, []any{"Operation already in progress"})
	}
	b.discovering[sender] = true
	b.notifyLocked()
	if len(b.discovering) == 1 {
		setProp(b.adapter, ifaceAdapter, "Discovering", true)
	}
	// Devices are found after the reply, as with a radio.
	for _, d := range b.devices {
		b.advertiseLater(d)
	}
	if slow := b.slowStart; slow > 0 {
		b.slowStart = 0
		done := b.slowDone
		b.mu.Unlock()
		t := time.NewTimer(slow)
		select {
		case <-t.C:
		case <-b.closing:
		}
		t.Stop()
		b.mu.Lock()
		defer close(done) // as the answer goes
	}
	return nil
}

// SlowNextStartDiscovery makes the next StartDiscovery answer only after
// d, its discovery session started at once, as a bluetoothd busy for a
// moment does: a client that gave up waiting has a session all the same.
// The channel is closed as it answers.
func (b *BlueZ) SlowNextStartDiscovery(d time.Duration) <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.slowStart = d
	b.slowDone = make(chan struct{})
	return b.slowDone
}

func (a adapter1) StopDiscovery(sender dbus.Sender) *dbus.Error {
	b := a.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("Adapter1.StopDiscovery %s", b.adapterPath)
	if !b.discovering[sender] {
		return dbus.NewError(errFailed, []any{"No discovery started"})
	}
	delete(b.discovering, sender)
	b.notifyLocked()
	if len(b.discovering) == 0 {
		setProp(b.adapter, ifaceAdapter, "Discovering", false)
		b.endDiscoveryLocked()
	}
	return nil
}

func (a adapter1) RemoveDevice(path dbus.ObjectPath) *dbus.Error {
	b := a.b
	b.mu.Lock()
	d, ok := b.devices[path]
	b.logCall("Adapter1.RemoveDevice %s", path)
	b.mu.Unlock()
	if !ok {
		return dbus.NewError("org.bluez.Error.DoesNotExist", []any{"Does Not Exist"})
	}
	d.Drop()
	b.mu.Lock()
	b.removeObjectLocked(path)
	d.props = nil
	b.mu.Unlock()
	return nil
}

// rssiThreshold is BlueZ's RSSI_THRESHOLD (src/device.c).
const rssiThreshold = 8

// proximityLocked reports whether a discovery session's filter has RSSI or
// Pathloss, with which BlueZ announces the RSSI of every advertisement.
func (b *BlueZ) proximityLocked() bool {
	for sender := range b.discovering {
		if b.proximity[sender] {
			return true
		}
	}
	return false
}

// endDiscoveryLocked is the last discovery session ended: BlueZ
// invalidates the RSSI of the devices it found (discovery_cleanup), so
// that the first advertisement of the next session is announced.
func (b *BlueZ) endDiscoveryLocked() {
	for _, d := range b.devices {
		d.reported = 0
	}
}

// wants reports whether any discovery session's filter lets d through.
func (b *BlueZ) wantsLocked(d *Device) bool {
	for sender := range b.discovering {
		f := b.filters[sender]
		if len(f) == 0 {
			return true
		}
		for _, u := range d.opts.UUIDs {
			if slices.Contains(f, strings.ToLower(u)) {
				return true
			}
		}
	}
	return false
}

// advertiseLater reports d to discovering clients from another goroutine:
// InterfacesAdded the first time, an RSSI change after that, as BlueZ does
// for a device it already knows.
// advertiseAfter is advertiseLater after a delay (a device rebooting).
func (b *BlueZ) advertiseAfter(d *Device, delay time.Duration) {
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
			b.advertiseLater(d)
		case <-b.closing:
		}
	}()
}

func (b *BlueZ) advertiseLater(d *Device) {
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		b.mu.Lock()
		defer b.mu.Unlock()
		if !d.opts.Advertising || len(b.discovering) == 0 || !b.wantsLocked(d) {
			return
		}
		if d.props == nil {
			d.exportLocked()
			return
		}
		d.rssi--
		if d.rssi < -90 {
			d.rssi = -40
		}
		// As BlueZ's device_set_rssi_with_delta (src/device.c): a change of
		// less than RSSI_THRESHOLD (8 dBm) is not announced, unless a
		// discovery filter has RSSI or Pathloss (the threshold is then
		// 0: each advertisement is, doc/org.bluez.Adapter.rst), or the
		// RSSI was invalidated as discovery ended (discovery_cleanup).
		delta := d.rssi - d.reported
		if delta < 0 {
			delta = -delta
		}
		if d.reported != 0 && delta < rssiThreshold && !b.proximityLocked() {
			return
		}
		d.reported = d.rssi
		setProp(d.props, ifaceDevice, "RSSI", d.rssi)
	}()
}

// setProp is p.SetMust, but a change the fake can no longer announce, its
// connection closed as the test ends, is no panic: a call still being
// answered then (a bridge's StopDiscovery as it stops) panicked, ending
// the whole test binary (seen in make test, 2026-11-30).
func setProp(p *prop.Properties, iface, name string, v any) {
	defer func() {
		if r := recover(); r != nil {
			if err, ok := r.(error); !ok || !busGone(err) {
				panic(r)
			}
		}
	}()
	p.SetMust(iface, name, v)
}

// busGone reports whether err is of a connection to a bus that is no
// more: closed as the test ends, or its daemon killed by the test
// (TestBridgeExitsWhenTheSystemBusIsLost), whose socket then answers a
// write EPIPE or ECONNRESET (seen in make test, 2026-12-01).
func busGone(err error) bool {
	return errors.Is(err, dbus.ErrClosed) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}
