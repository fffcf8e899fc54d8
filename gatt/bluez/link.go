//go:build linux

package bluez

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/godbus/dbus/v5"
	"tinygo.org/x/bluetooth"

	"github.com/devicecompanion/companion/gatt"
)

// errOtherDevice: the device connected to has another device id.
var errOtherDevice = errors.New("bluez: another device")

// open connects to the device at path, discovers its GATT database and
// checks its DIS serial number against wantID. It owns addr, marked busy by
// pickLocked: the link keeps it, a failure releases it.
func (c *Connector) open(ctx context.Context, path dbus.ObjectPath, addr, wantID string) (*link, error) {
	mac, err := bluetooth.ParseMAC(addr)
	if err != nil {
		c.release(addr)
		return nil, err
	}
	watch, unwatch := c.watchDevice(path)
	defer unwatch()

	// BlueZ's Connect has no timeout: run it aside, and on ctx's expiry
	// ask BlueZ to disconnect, which makes it fail the pending Connect
	// ("le-connection-abort-by-local"); the goroutine then ends.
	done := make(chan connResult, 1)
	c.calls.Add(1)
	go func() {
		defer c.calls.Done()
		if err := c.connectDevice(path); err != nil {
			done <- connResult{err: err}
			return
		}
		// Connected: tinygo's Connect only reads properties and hands
		// back the Device its other calls need.
		dev, err := c.adapter.Connect(bluetooth.Address{MACAddress: bluetooth.MACAddress{MAC: mac}}, bluetooth.ConnectionParams{})
		done <- connResult{dev, err}
	}()
	var dev bluetooth.Device
	select {
	case r := <-done:
		if r.err != nil {
			c.release(addr)
			return nil, r.err
		}
		dev = r.dev
	case <-ctx.Done():
		c.abandon(path, addr, done)
		return nil, ctx.Err()
	case <-c.closing:
		c.abandon(path, addr, done)
		return nil, ErrClosed
	}

	l, err := c.setup(ctx, path, addr, dev, watch)
	if err != nil {
		dev.Disconnect()
		c.release(addr)
		return nil, err
	}
	if l.serial != wantID {
		c.log.Info("bluez: found another device", "address", addr, "device", l.serial, "want", wantID)
		l.Close()
		return nil, errOtherDevice
	}
	return l, nil
}

// connectDevice asks BlueZ to connect the device at path, unless it is
// connected already, on the Connector's own D-Bus connection. tinygo's
// Connect would make the call itself, and then watch every
// PropertiesChanged on the bus (the ones that came while the call was
// pending included) with a handler that indexes and asserts their bodies
// unchecked: a malformed one, from a buggy bluetoothd or any other process,
// would panic the bridge. Of a connected device it watches nothing.
func (c *Connector) connectDevice(path dbus.ObjectPath) error {
	obj := c.conn.Object(bluezName, path)
	if v, err := obj.GetProperty(ifaceDevice + ".Connected"); err == nil && v.Value() == true {
		return nil
	}
	err := obj.Call(ifaceDevice+".Connect", 0).Err
	var de dbus.Error
	if errors.As(err, &de) && de.Name == "org.bluez.Error.AlreadyConnected" {
		return nil
	}
	if err != nil {
		return fmt.Errorf("bluez: connect: %w", err)
	}
	return nil
}

// connResult is the outcome of tinygo's Connect.
type connResult struct {
	dev bluetooth.Device
	err error
}

// abandon cancels a pending connection attempt and cleans up after it once
// BlueZ answers.
func (c *Connector) abandon(path dbus.ObjectPath, addr string, done <-chan connResult) {
	c.calls.Add(1)
	go func() {
		defer c.calls.Done()
		defer c.release(addr)
		c.conn.Object(bluezName, path).Call(ifaceDevice+".Disconnect", 0)
		if r := <-done; r.err == nil {
			r.dev.Disconnect()
		}
	}()
}

// setup waits for BlueZ to resolve the services, finds the
// characteristics, reads the serial number and registers the link.
func (c *Connector) setup(ctx context.Context, path dbus.ObjectPath, addr string, dev bluetooth.Device, watch <-chan struct{}) (*link, error) {
	obj := c.conn.Object(bluezName, path)
	for {
		connected, err := obj.GetProperty(ifaceDevice + ".Connected")
		if err != nil {
			return nil, err
		}
		if ok, _ := connected.Value().(bool); !ok {
			return nil, gatt.ErrDisconnected
		}
		resolved, err := obj.GetProperty(ifaceDevice + ".ServicesResolved")
		if err != nil {
			return nil, err
		}
		if ok, _ := resolved.Value().(bool); ok {
			break
		}
		select {
		case <-watch:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-c.closing:
			return nil, ErrClosed
		}
	}

	// Resolved: tinygo's DiscoverServices returns at once.
	services, err := dev.DiscoverServices(nil)
	if err != nil {
		return nil, fmt.Errorf("discover services: %w", err)
	}
	l := &link{
		c:         c,
		path:      path,
		addr:      addr,
		dev:       dev,
		chars:     map[string]*bluetooth.DeviceCharacteristic{},
		charPaths: map[string]dbus.ObjectPath{},
		done:      make(chan struct{}),
		subs:      map[dbus.ObjectPath]func([]byte){},
		notifyOn:  map[string]bool{},
	}
	for _, s := range services {
		chars, err := s.DiscoverCharacteristics(nil)
		if err != nil {
			return nil, fmt.Errorf("discover characteristics of %s: %w", s.UUID(), err)
		}
		for i := range chars {
			u := chars[i].UUID().String()
			if _, dup := l.chars[u]; !dup {
				l.chars[u] = &chars[i]
			}
		}
	}
	// The object paths of the characteristics, to route notifications;
	// tinygo keeps them private. Same choice as tinygo: the first in path
	// order for each UUID.
	var objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant
	if err := c.conn.Object(bluezName, "/").Call(ifaceObjMgr+".GetManagedObjects", 0).Store(&objects); err != nil {
		return nil, err
	}
	paths := make([]string, 0, len(objects))
	for p := range objects {
		if strings.HasPrefix(string(p), string(path)+"/service") {
			paths = append(paths, string(p))
		}
	}
	sort.Strings(paths)
	for _, p := range paths {
		props, ok := objects[dbus.ObjectPath(p)][ifaceChar]
		if !ok {
			continue
		}
		u, _ := props["UUID"].Value().(string)
		u = strings.ToLower(u)
		if _, dup := l.charPaths[u]; !dup {
			l.charPaths[u] = dbus.ObjectPath(p)
		}
	}

	serial, ok := l.chars[gatt.SerialNumberUUID]
	if !ok {
		return nil, fmt.Errorf("no DIS serial number characteristic: not a companion device")
	}
	buf := make([]byte, 512) // the longest attribute value
	n, err := serial.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("read serial number: %w", err)
	}
	l.serial = string(buf[:n])

	l.mtu.Store(gatt.DefaultMTU)
	mtuChar := l.chars[gatt.SMPCharUUID]
	if mtuChar == nil {
		mtuChar = serial
	}
	if mtu, err := mtuChar.GetMTU(); err == nil && mtu >= gatt.DefaultMTU {
		l.mtu.Store(int64(mtu))
	}

	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	c.ids[addr] = l.serial
	c.links[path] = l
	c.broadcastLocked()
	c.mu.Unlock()
	// A drop before the link was registered would be missed.
	if v, err := obj.GetProperty(ifaceDevice + ".Connected"); err != nil || v.Value() != true {
		l.lost()
	}
	return l, nil
}

// link is a gatt.Link over BlueZ.
type link struct {
	c         *Connector
	path      dbus.ObjectPath
	addr      string
	serial    string
	dev       bluetooth.Device
	chars     map[string]*bluetooth.DeviceCharacteristic // by UUID
	charPaths map[string]dbus.ObjectPath                 // by UUID
	mtu       atomic.Int64
	done      chan struct{}
	lostOnce  sync.Once

	mu     sync.Mutex
	closed bool // Close called
	down   bool // connection gone
	subs   map[dbus.ObjectPath]func([]byte)
	ops    sync.WaitGroup // D-Bus calls in flight

	notifyMu sync.Mutex      // one StartNotify per characteristic
	notifyOn map[string]bool // by UUID: notifications started
}

// MTU is the ATT MTU BlueZ reports for the connection.
func (l *link) MTU() int { return int(l.mtu.Load()) }

// Done is closed when the connection is lost or closed.
func (l *link) Done() <-chan struct{} { return l.done }

// lost marks the link down: Done closes and the device can be connected to
// again.
func (l *link) lost() {
	l.lostOnce.Do(func() {
		l.mu.Lock()
		l.down = true
		l.mu.Unlock()
		close(l.done)
		c := l.c
		c.mu.Lock()
		if c.links[l.path] == l {
			delete(c.links, l.path)
		}
		delete(c.busy, l.addr)
		c.broadcastLocked()
		c.mu.Unlock()
	})
}

// notified delivers a notification; called by the dispatcher, in order.
func (l *link) notified(path dbus.ObjectPath, value []byte) {
	l.mu.Lock()
	fn := l.subs[path]
	down := l.down
	l.mu.Unlock()
	if fn != nil && !down {
		fn(value)
	}
}

// Close disconnects and waits for the link's calls in flight. It may be
// called after Done closed.
func (l *link) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	wasDown := l.down
	l.mu.Unlock()
	var err error
	if !wasDown {
		// tinygo's Disconnect: Device1.Disconnect; BlueZ fails the calls
		// in flight.
		if derr := l.dev.Disconnect(); derr != nil && !isGone(derr) {
			err = fmt.Errorf("bluez: disconnect %s: %w", l.addr, derr)
		}
	}
	// The notification sessions end with the connection: BlueZ removes
	// the characteristics' objects.
	l.ops.Wait()
	l.lost()
	return err
}

// do runs a blocking tinygo call within ctx. On ctx's expiry it returns;
// the call ends when BlueZ answers, and Close waits for it.
func (l *link) do(ctx context.Context, f func() error) error {
	l.mu.Lock()
	if l.closed || l.down {
		l.mu.Unlock()
		return gatt.ErrDisconnected
	}
	l.ops.Add(1)
	l.mu.Unlock()
	if err := ctx.Err(); err != nil {
		l.ops.Done()
		return err
	}
	if ctx.Done() == nil {
		defer l.ops.Done()
		return l.mapErr(f())
	}
	ch := make(chan error, 1)
	go func() {
		defer l.ops.Done()
		ch <- f()
	}()
	select {
	case err := <-ch:
		return l.mapErr(err)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// mapErr turns the errors of a connection gone into gatt.ErrDisconnected.
func (l *link) mapErr(err error) error {
	if err == nil {
		return nil
	}
	select {
	case <-l.done:
		return fmt.Errorf("%w: %v", gatt.ErrDisconnected, err)
	default:
	}
	if isGone(err) {
		// The signal may not have arrived yet: ask.
		v, perr := l.c.conn.Object(bluezName, l.path).GetProperty(ifaceDevice + ".Connected")
		if perr != nil || v.Value() != true {
			l.lost()
			return fmt.Errorf("%w: %v", gatt.ErrDisconnected, err)
		}
	}
	return fmt.Errorf("bluez: %w", err)
}

// isGone reports whether err is BlueZ saying the connection or its objects
// are gone.
func isGone(err error) bool {
	var de dbus.Error
	if !errors.As(err, &de) {
		return false
	}
	switch de.Name {
	case "org.bluez.Error.NotConnected",
		"org.freedesktop.DBus.Error.UnknownObject",
		"org.freedesktop.DBus.Error.UnknownMethod",
		"org.freedesktop.DBus.Error.NoReply":
		return true
	case "org.bluez.Error.Failed":
		return len(de.Body) > 0 && strings.Contains(fmt.Sprint(de.Body[0]), "Not connected")
	}
	return false
}

func (l *link) char(uuid string) (*bluetooth.DeviceCharacteristic, error) {
	ch, ok := l.chars[strings.ToLower(uuid)]
	if !ok {
		return nil, fmt.Errorf("bluez: device %s has no characteristic %s", l.serial, uuid)
	}
	return ch, nil
}

// Read reads a characteristic's value.
func (l *link) Read(ctx context.Context, charUUID string) ([]byte, error) {
	ch, err := l.char(charUUID)
	if err != nil {
		return nil, err
	}
	var out []byte
	err = l.do(ctx, func() error {
		buf := make([]byte, 512)
		n, err := ch.Read(buf)
		out = buf[:n]
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Write writes one value of at most MTU-3 bytes: a write request when
// withResponse, else a write command.
func (l *link) Write(ctx context.Context, charUUID string, data []byte, withResponse bool) error {
	ch, err := l.char(charUUID)
	if err != nil {
		return err
	}
	if max := l.MTU() - 3; len(data) > max {
		return fmt.Errorf("bluez: write of %d bytes over MTU %d (at most %d)", len(data), l.MTU(), max)
	}
	return l.do(ctx, func() error {
		var err error
		if withResponse {
			_, err = ch.Write(data)
		} else {
			_, err = ch.WriteWithoutResponse(data)
		}
		return err
	})
}

// Subscribe enables notifications of a characteristic; fn gets the values
// in order, on the Connector's signal goroutine. A second Subscribe to the
// same characteristic replaces fn.
func (l *link) Subscribe(ctx context.Context, charUUID string, fn func([]byte)) error {
	u := strings.ToLower(charUUID)
	if _, err := l.char(u); err != nil {
		return err
	}
	path, ok := l.charPaths[u]
	if !ok {
		return fmt.Errorf("bluez: no object path for characteristic %s", u)
	}
	l.mu.Lock()
	l.subs[path] = fn
	l.mu.Unlock()
	err := l.do(ctx, func() error {
		l.notifyMu.Lock()
		defer l.notifyMu.Unlock()
		if l.notifyOn[u] {
			return nil
		}
		// StartNotify on the Connector's own connection, not through
		// tinygo's EnableNotifications: the values come in order through
		// the Connector's signals, and tinygo's handler of them indexes
		// and asserts the body of every PropertiesChanged on the bus
		// unchecked, so a malformed one would panic the bridge.
		if err := l.c.conn.Object(bluezName, path).Call(ifaceChar+".StartNotify", 0).Err; err != nil {
			return err
		}
		l.notifyOn[u] = true
		return nil
	})
	if err != nil {
		l.mu.Lock()
		delete(l.subs, path)
		l.mu.Unlock()
	}
	return err
}
