package fakebluez

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/prop"

	"github.com/devicecompanion/companion/gatt"
)

// DeviceOptions describe a fake remote device.
type DeviceOptions struct {
	// Address is the device's MAC address, e.g. "C0:FF:EE:00:00:01".
	Address string
	// Name is the advertised local name.
	Name string
	// UUIDs are the advertised service UUIDs; gatt.ServiceUUID when nil.
	UUIDs []string
	// MTU is the ATT MTU the GattCharacteristic1 objects report; 247 when 0.
	MTU int
	// Peripheral serves the device's GATT database.
	Peripheral gatt.Peripheral
	// Advertising is whether discovery finds the device. AddDevice sets it;
	// SetAdvertising changes it.
	Advertising bool
	// NeverConnect makes Device1.Connect hang, as with a device out of
	// range, until Device1.Disconnect aborts it the way BlueZ does:
	// org.bluez.Error.Failed "le-connection-abort-by-local".
	NeverConnect bool
	// NeedsPairing makes the SMP characteristic refuse reads, writes and
	// notifications as BlueZ does for a device that requires an
	// encrypted or authenticated link the gateway has no bond for
	// (Zephyr's CONFIG_MCUMGR_TRANSPORT_BT_PERM_RW_AUTHEN):
	// org.bluez.Error.NotPermitted "Not paired".
	NeedsPairing bool
}

// Device is a fake remote device.
type Device struct {
	b    *BlueZ
	path dbus.ObjectPath
	opts DeviceOptions

	// linkMu orders a connection's start and end as the peripheral sees
	// them: Connect holds it from marking the device connected until the
	// peripheral serves, Drop from marking it disconnected until the
	// peripheral has stopped, so a Disconnect racing a Connect never
	// reaches the peripheral first. Taken before b.mu.
	linkMu sync.Mutex

	// Guarded by b.mu.
	props     *prop.Properties // nil until discovery first finds it
	rssi      int16            // of its last advertisement
	reported  int16            // the RSSI property as last announced; 0 once discovery ended (invalidated)
	connected bool
	gen       int                  // connection generation, for notifications
	pending   chan struct{}        // closed to abort a hanging Connect
	refused   chan struct{}        // closed when a Connect is answered InProgress (ConnectElsewhere)
	bondLost  string               // LoseBond's reply to Connect; "" while the bond holds
	lostLate  bool                 // LoseBondAfterConnect: Connect answered, then the link ends
	failNext  int                  // FailConnects: Connect calls left to fail
	paired    bool                 // the gateway holds a bond (LoseBond)
	chars     map[string]*gattChar // by UUID, while connected
	gattPaths []dbus.ObjectPath
}

type gattChar struct {
	path      dbus.ObjectPath
	uuid      string
	flags     []string
	props     *prop.Properties
	notifying bool
}

// AddDevice adds a device, advertising. Discovery reports it once it runs.
func (b *BlueZ) AddDevice(opts DeviceOptions) *Device {
	if opts.UUIDs == nil {
		opts.UUIDs = []string{gatt.ServiceUUID}
	}
	if opts.MTU == 0 {
		opts.MTU = 247
	}
	opts.Address = strings.ToUpper(opts.Address)
	opts.Advertising = true
	d := &Device{b: b, opts: opts, rssi: -50}
	b.mu.Lock()
	defer b.mu.Unlock()
	d.path = macPath(b.adapterPath, opts.Address)
	if _, dup := b.devices[d.path]; dup {
		b.tb.Fatalf("fakebluez: device %s added twice", opts.Address)
	}
	b.devices[d.path] = d
	b.advertiseLater(d)
	return d
}

// Path is the device's object path.
func (d *Device) Path() dbus.ObjectPath {
	d.b.mu.Lock()
	defer d.b.mu.Unlock()
	return d.path
}

// SetAdvertising starts or stops the device's advertising.
func (d *Device) SetAdvertising(on bool) {
	d.b.mu.Lock()
	d.opts.Advertising = on
	d.b.mu.Unlock()
	if on {
		d.b.advertiseLater(d)
	}
}

// Connected reports whether a central is connected.
func (d *Device) Connected() bool {
	d.b.mu.Lock()
	defer d.b.mu.Unlock()
	return d.connected
}

// exportLocked creates the Device1 object.
func (d *Device) exportLocked() {
	d.reported = d.rssi
	d.props = d.b.addObjectLocked(d.path, prop.Map{ifaceDevice: {
		"Address":          {Value: d.opts.Address, Emit: prop.EmitConst},
		"AddressType":      {Value: "random", Emit: prop.EmitConst},
		"Name":             {Value: d.opts.Name, Emit: prop.EmitConst},
		"Alias":            {Value: d.opts.Name, Emit: prop.EmitTrue},
		"Adapter":          {Value: d.b.adapterPath, Emit: prop.EmitConst},
		"UUIDs":            {Value: slices.Clone(d.opts.UUIDs), Emit: prop.EmitTrue},
		"RSSI":             {Value: d.rssi, Emit: prop.EmitTrue},
		"Paired":           {Value: d.paired, Emit: prop.EmitTrue},
		"Bonded":           {Value: d.paired, Emit: prop.EmitTrue},
		"Trusted":          {Value: false, Writable: true, Emit: prop.EmitTrue},
		"Blocked":          {Value: false, Writable: true, Emit: prop.EmitTrue},
		"LegacyPairing":    {Value: false, Emit: prop.EmitConst},
		"Connected":        {Value: false, Emit: prop.EmitTrue},
		"ServicesResolved": {Value: false, Emit: prop.EmitTrue},
	}}, map[string]any{ifaceDevice: device1{d}})
}

// device1 is org.bluez.Device1.
type device1 struct{ d *Device }

func (x device1) Connect() *dbus.Error {
	d, b := x.d, x.d.b
	d.linkMu.Lock()
	b.mu.Lock()
	b.logCall("Device1.Connect %s", d.path)
	switch {
	case !b.adapter.GetMust(ifaceAdapter, "Powered").(bool):
		b.mu.Unlock()
		d.linkMu.Unlock()
		return dbus.NewError("org.bluez.Error.NotReady", []any{"Resource Not Ready"})
	case d.connected:
		b.mu.Unlock()
		d.linkMu.Unlock()
		return dbus.NewError("org.bluez.Error.AlreadyConnected", []any{"Already Connected"})
	case d.pending != nil:
		if d.refused != nil {
			close(d.refused)
			d.refused = nil
		}
		b.mu.Unlock()
		d.linkMu.Unlock()
		return dbus.NewError(errInProgress, []any{"In Progress"})
	case d.opts.NeverConnect || !d.opts.Advertising:
		abort := make(chan struct{})
		d.pending = abort
		b.mu.Unlock()
		d.linkMu.Unlock()
		select {
		case <-abort:
		case <-b.closing:
		}
		return dbus.NewError(errFailed, []any{"le-connection-abort-by-local"})
	}
	if d.failNext > 0 {
		// The controller's LE Connection Complete reported a failure
		// (0x3E, "Connection Failed to be Established", common on a busy
		// radio): the link never came up, and BlueZ's att_connect_cb
		// answers it as every failure of the ATT connection.
		d.failNext--
		b.advertiseAfter(d, readvertiseDelay) // under b.mu: see New's cleanup
		b.mu.Unlock()
		d.linkMu.Unlock()
		return dbus.NewError(errFailed, []any{"le-connection-abort-by-local"})
	}
	d.connected = true
	d.gen++
	gen := d.gen
	if d.bondLost != "" {
		// The link comes up; BlueZ, holding the device's long-term key,
		// elevates security with it (device_attach_att: "Elevating
		// security level since LTK is available"); the device, which
		// forgot the bond, refuses ("PIN or Key Missing") and the link
		// ends; Connect is answered Failed (LoseBond).
		setProp(d.props, ifaceDevice, "Connected", true)
		d.connected = false
		d.gen++
		setProp(d.props, ifaceDevice, "Connected", false)
		reply := d.bondLost
		b.advertiseAfter(d, readvertiseDelay) // under b.mu: see New's cleanup
		b.mu.Unlock()
		d.linkMu.Unlock()
		return dbus.NewError(errFailed, []any{reply})
	}
	if d.lostLate {
		// The link comes up (Connected), the encryption with the old key
		// fails and the link ends; BlueZ's att_connect_cb, handed
		// ECONNABORTED, jumps to its end with err 0 and answers the
		// pending Connect with a method return, and device_remove_connection
		// then turns Connected false (LoseBondAfterConnect).
		setProp(d.props, ifaceDevice, "Connected", true)
		b.mu.Unlock()
		d.linkMu.Unlock()
		go d.dropGen(gen) // after the reply, or before it: both happen
		return nil
	}
	// BlueZ: Connected, then the GATT objects, then ServicesResolved, then
	// the reply to Connect.
	setProp(d.props, ifaceDevice, "Connected", true)
	d.exportGATTLocked()
	p := d.opts.Peripheral
	mtu := d.opts.MTU
	b.mu.Unlock()

	if p == nil {
		d.linkMu.Unlock()
	} else {
		notify := func(charUUID string, value []byte) { d.notify(gen, charUUID, value) }
		// The device ends the connection itself when it reboots; it
		// advertises again once it is up.
		drop := func() {
			d.dropGen(gen)
			b.advertiseAfter(d, readvertiseDelay)
		}
		err := p.Connected(mtu, notify, drop)
		d.linkMu.Unlock()
		if err != nil {
			// A device that takes no connection (it is rebooting): BlueZ
			// reports the attempt failed, and discovery finds the device
			// again once it advertises.
			d.dropGen(gen)
			b.advertiseAfter(d, readvertiseDelay)
			return dbus.NewError(errFailed, []any{"le-connection-abort-by-local"})
		}
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	if d.connected && d.gen == gen {
		setProp(d.props, ifaceDevice, "ServicesResolved", true)
	}
	return nil
}

// LoseBond is the device reset (or paired with another central) while the
// gateway keeps its bond: BlueZ lists it Paired and Bonded, and each
// Connect brings the link up, fails to encrypt it with the long-term key
// the device no longer has, and ends it, answering
// org.bluez.Error.Failed with reply. BlueZ's att_connect_cb (src/device.c)
// answers a failure of the ATT connection "le-connection-abort-by-local",
// but ECONNABORTED itself, which it answers as a success
// (LoseBondAfterConnect); device_remove_connection answers
// "br-connection-canceled" when it sees the link end first;
// "le-connection-key-missing" is its answer to EBADE (src/error.c, since
// 5.69). The device advertises again after each attempt, as one looking for
// a central does (bluez/bluez pull request 1654 describes the loop). The
// Paired property stays true (bluez/bluez issue 433).
func (d *Device) LoseBond(reply string) {
	b := d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	d.bondLost, d.paired = reply, true
	if d.props != nil {
		setProp(d.props, ifaceDevice, "Paired", true)
		setProp(d.props, ifaceDevice, "Bonded", true)
	}
}

// LoseBondAfterConnect is LoseBond as BlueZ answers it when the kernel
// reports the ATT connection aborted (ECONNABORTED, its errno for a link
// the host ended: the encryption with the old key refused, "PIN or Key
// Missing"): att_connect_cb (src/device.c) takes that error to its end
// with err 0, so the pending Connect is answered a method return, though
// no ATT bearer was attached and the services are never resolved; the link
// is down a moment later (device_remove_connection: Connected false). The
// device advertises again, and the Paired property stays true.
func (d *Device) LoseBondAfterConnect() {
	b := d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	d.lostLate, d.paired = true, true
	if d.props != nil {
		setProp(d.props, ifaceDevice, "Paired", true)
		setProp(d.props, ifaceDevice, "Bonded", true)
	}
}

// FailConnects makes the next n Device1.Connect calls fail without the
// link coming up, as a connection the controller could not establish does;
// the device advertises again at once after each, its RSSI as steady as
// ever.
func (d *Device) FailConnects(n int) {
	d.b.mu.Lock()
	d.failNext = n
	d.b.mu.Unlock()
}

// ChangeServices is the device indicating Service Changed over the
// connection (a firmware that changed its GATT table, found after BlueZ
// took its cached one): BlueZ rediscovers the range, removes the service
// and characteristic objects in it (InterfacesRemoved; src/gatt-client.c,
// btd_gatt_client_service_removed), which ends every notification session
// on them and leaves the reads and writes in flight unanswered (their
// D-Bus messages dropped with the operation), and exports them again as
// discovery finds them (InterfacesAdded), at paths named by their handles,
// not notifying. ServicesResolved stays true, and Connected too: BlueZ
// turns ServicesResolved false only as the connection ends
// (src/device.c, device_remove_connection). It does nothing if no central
// is connected.
func (d *Device) ChangeServices() {
	b := d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if !d.connected {
		return
	}
	for i := len(d.gattPaths) - 1; i >= 0; i-- {
		b.removeObjectLocked(d.gattPaths[i])
	}
	d.gattPaths = nil
	d.exportGATTLocked()
}

// ConnectElsewhere starts a connection to the device on behalf of another
// client of BlueZ (bluetoothctl connect, another program): Device1.Connect
// answers org.bluez.Error.InProgress until complete connects the device.
// refused is closed once a Connect was answered so.
func (d *Device) ConnectElsewhere() (refused <-chan struct{}, complete func()) {
	b := d.b
	b.mu.Lock()
	d.pending = make(chan struct{})
	d.refused = make(chan struct{})
	r := d.refused
	b.mu.Unlock()
	return r, func() {
		b.mu.Lock()
		d.pending = nil
		b.mu.Unlock()
		if err := (device1{d}).Connect(); err != nil {
			b.tb.Errorf("fakebluez: connect elsewhere: %v", err)
		}
	}
}

func (x device1) Disconnect() *dbus.Error {
	d, b := x.d, x.d.b
	b.mu.Lock()
	b.logCall("Device1.Disconnect %s", d.path)
	if d.pending != nil {
		close(d.pending)
		d.pending = nil
		b.mu.Unlock()
		return nil
	}
	if !d.connected {
		b.mu.Unlock()
		return dbus.NewError("org.bluez.Error.NotConnected", []any{"Not Connected"})
	}
	b.mu.Unlock()
	d.Drop()
	return nil
}

// readvertiseDelay is how soon a device that ended a connection (or took
// none) is found by discovery again.
const readvertiseDelay = 20 * time.Millisecond

// dropGen is Drop for connection gen only: a later connection stays.
func (d *Device) dropGen(gen int) {
	d.b.mu.Lock()
	same := d.connected && d.gen == gen
	d.b.mu.Unlock()
	if same {
		d.Drop()
	}
}

// Drop ends the connection from the device's side, as a link loss does:
// ServicesResolved and Connected turn false (PropertiesChanged) and the
// GATT objects go away (InterfacesRemoved), and the device advertises
// again. It does nothing if no central is connected.
func (d *Device) Drop() {
	b := d.b
	d.linkMu.Lock()
	defer d.linkMu.Unlock()
	b.mu.Lock()
	if !d.connected {
		b.mu.Unlock()
		return
	}
	d.connected = false
	d.gen++
	setProp(d.props, ifaceDevice, "ServicesResolved", false)
	setProp(d.props, ifaceDevice, "Connected", false)
	for i := len(d.gattPaths) - 1; i >= 0; i-- {
		b.removeObjectLocked(d.gattPaths[i])
	}
	d.gattPaths, d.chars = nil, nil
	p := d.opts.Peripheral
	// A peripheral advertises again as its connection ends (Zephyr
	// restarts advertising on disconnect): discovery under way finds it.
	b.advertiseAfter(d, readvertiseDelay) // under b.mu: see New's cleanup
	b.mu.Unlock()
	if p != nil {
		p.Disconnected()
	}
}

// exportGATTLocked creates the GattService1 and GattCharacteristic1 objects
// of the peripheral's database, with handles numbered as BlueZ names them.
func (d *Device) exportGATTLocked() {
	d.chars = map[string]*gattChar{}
	if d.opts.Peripheral == nil {
		return
	}
	handle := 1
	for _, s := range d.opts.Peripheral.Services() {
		spath := dbus.ObjectPath(fmt.Sprintf("%s/service%04x", d.path, handle))
		handle++
		d.b.addObjectLocked(spath, prop.Map{ifaceService: {
			"UUID":     {Value: strings.ToLower(s.UUID), Emit: prop.EmitConst},
			"Device":   {Value: d.path, Emit: prop.EmitConst},
			"Primary":  {Value: true, Emit: prop.EmitConst},
			"Includes": {Value: []dbus.ObjectPath{}, Emit: prop.EmitConst},
		}}, nil)
		d.gattPaths = append(d.gattPaths, spath)
		for _, c := range s.Characteristics {
			cpath := dbus.ObjectPath(fmt.Sprintf("%s/char%04x", spath, handle))
			handle += 2 // declaration and value
			if slices.Contains(c.Properties, gatt.PropNotify) {
				handle++ // CCCD
			}
			gc := &gattChar{path: cpath, uuid: strings.ToLower(c.UUID), flags: slices.Clone(c.Properties)}
			gc.props = d.b.addObjectLocked(cpath, prop.Map{ifaceChar: {
				"UUID":      {Value: gc.uuid, Emit: prop.EmitConst},
				"Service":   {Value: spath, Emit: prop.EmitConst},
				"Value":     {Value: []byte{}, Emit: prop.EmitTrue},
				"Notifying": {Value: false, Emit: prop.EmitTrue},
				"Flags":     {Value: gc.flags, Emit: prop.EmitConst},
				"MTU":       {Value: uint16(d.opts.MTU), Emit: prop.EmitTrue},
			}}, map[string]any{ifaceChar: char1{d, gc}})
			d.gattPaths = append(d.gattPaths, cpath)
			d.chars[gc.uuid] = gc
		}
	}
}

// notify is the peripheral's notify function for connection gen: a
// PropertiesChanged of Value, if the central asked for notifications.
func (d *Device) notify(gen int, charUUID string, value []byte) {
	b := d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if !d.connected || d.gen != gen {
		return
	}
	c, ok := d.chars[strings.ToLower(charUUID)]
	if !ok || !c.notifying {
		return
	}
	setProp(c.props, ifaceChar, "Value", slices.Clone(value))
}

// char1 is org.bluez.GattCharacteristic1.
type char1 struct {
	d *Device
	c *gattChar
}

// live checks, under b.mu, that the characteristic belongs to the current
// connection.
func (x char1) liveLocked() *dbus.Error {
	if !x.d.connected || x.d.chars[x.c.uuid] != x.c {
		return dbus.NewError("org.bluez.Error.NotConnected", []any{"Not Connected"})
	}
	return nil
}

// pairingLocked is BlueZ's answer for the SMP characteristic of a device
// that needs pairing (NeedsPairing): the ATT error "insufficient
// authentication" or "insufficient encryption", as BlueZ's gatt-client
// maps it.
func (x char1) pairingLocked() *dbus.Error {
	if x.d.opts.NeedsPairing && x.c.uuid == gatt.SMPCharUUID {
		return dbus.NewError("org.bluez.Error.NotPermitted", []any{"Not paired"})
	}
	return nil
}

func (x char1) ReadValue(opts map[string]dbus.Variant) ([]byte, *dbus.Error) {
	b := x.d.b
	b.mu.Lock()
	b.logCall("GattCharacteristic1.ReadValue %s", x.c.path)
	if err := x.liveLocked(); err != nil {
		b.mu.Unlock()
		return nil, err
	}
	b.mu.Unlock()
	if err := x.pairingLocked(); err != nil {
		return nil, err
	}
	if !slices.Contains(x.c.flags, gatt.PropRead) {
		return nil, dbus.NewError("org.bluez.Error.NotPermitted", []any{"Read not permitted"})
	}
	v, err := x.d.opts.Peripheral.ReadChar(x.c.uuid)
	if err != nil {
		return nil, dbus.NewError(errFailed, []any{err.Error()})
	}
	return v, nil
}

func (x char1) WriteValue(value []byte, opts map[string]dbus.Variant) *dbus.Error {
	b := x.d.b
	typ := "request"
	if v, ok := opts["type"]; ok {
		typ, _ = v.Value().(string)
	}
	b.mu.Lock()
	b.logCall("GattCharacteristic1.WriteValue(%s) %s", typ, x.c.path)
	if err := x.liveLocked(); err != nil {
		b.mu.Unlock()
		return err
	}
	mtu := x.d.opts.MTU
	b.mu.Unlock()
	if err := x.pairingLocked(); err != nil {
		return err
	}
	need := gatt.PropWrite
	switch typ {
	case "command":
		need = gatt.PropWriteWithoutResponse
	case "request", "reliable":
	default:
		return dbus.NewError("org.bluez.Error.InvalidArguments", []any{"bad type " + typ})
	}
	if !slices.Contains(x.c.flags, need) {
		return dbus.NewError("org.bluez.Error.NotPermitted", []any{"Write not permitted"})
	}
	if len(value) > mtu-3 {
		return dbus.NewError("org.bluez.Error.InvalidValueLength", []any{"Invalid Length"})
	}
	if err := x.d.opts.Peripheral.WriteChar(x.c.uuid, slices.Clone(value)); err != nil {
		return dbus.NewError(errFailed, []any{err.Error()})
	}
	return nil
}

func (x char1) StartNotify() *dbus.Error {
	b := x.d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("GattCharacteristic1.StartNotify %s", x.c.path)
	if err := x.liveLocked(); err != nil {
		return err
	}
	if err := x.pairingLocked(); err != nil {
		return err
	}
	if !slices.Contains(x.c.flags, gatt.PropNotify) {
		return dbus.NewError("org.bluez.Error.NotSupported", []any{"Operation is not supported"})
	}
	if !x.c.notifying {
		x.c.notifying = true
		setProp(x.c.props, ifaceChar, "Notifying", true)
	}
	return nil
}

func (x char1) StopNotify() *dbus.Error {
	b := x.d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logCall("GattCharacteristic1.StopNotify %s", x.c.path)
	if err := x.liveLocked(); err != nil {
		return err
	}
	if !x.c.notifying {
		return dbus.NewError(errFailed, []any{"No notify session started"})
	}
	x.c.notifying = false
	setProp(x.c.props, ifaceChar, "Notifying", false)
	return nil
}
