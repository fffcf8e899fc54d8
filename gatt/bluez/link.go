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

	"github.com/devicecompanion/companion/gatt"
)

// errOtherDevice: the device connected to has another device id.
var errOtherDevice = errors.New("bluez: another device")

// errUnidentified: the device connected to has no device id the bridge
// can read.
var errUnidentified = errors.New("bluez: no device id to read")

// open connects to the device at path, discovers its GATT database and
// checks its DIS serial number against wantID. It owns addr, marked busy by
// pickLocked: the link keeps it, a failure releases it.
func (c *Connector) open(ctx context.Context, path dbus.ObjectPath, addr, wantID string) (*link, error) {
	watch, unwatch := c.watchDevice(path)
	defer unwatch()

	// BlueZ's Connect has no timeout: run it aside, and on ctx's expiry
	// ask BlueZ to disconnect, which makes it fail the pending Connect
	// ("le-connection-abort-by-local"); the goroutine then ends, or at the
	// Connector's Close if bluetoothd answers nothing.
	done := make(chan error, 1)
	c.calls.Add(1)
	go func() {
		defer c.calls.Done()
		done <- c.connectDevice(path)
	}()
	select {
	case err := <-done:
		if err != nil {
			c.release(addr)
			return nil, err
		}
	case <-ctx.Done():
		c.abandon(path, addr, done)
		return nil, ctx.Err()
	case <-c.closing:
		c.abandon(path, addr, done)
		return nil, ErrClosed
	}

	l, err := c.setup(ctx, path, addr, watch)
	if err != nil {
		// Aside: the caller's deadline may have passed already.
		c.calls.Add(1)
		go func() {
			defer c.calls.Done()
			defer c.release(addr)
			c.disconnect(path, addr)
		}()
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
// connected already. The call lasts as long as BlueZ takes, or until the
// Connector closes.
func (c *Connector) connectDevice(path dbus.ObjectPath) error {
	if v, err := c.getProperty(c.ctx, path, ifaceDevice+".Connected"); err == nil && v.Value() == true {
		return nil
	}
	err := c.conn.Object(bluezName, path).CallWithContext(c.ctx, ifaceDevice+".Connect", 0).Err
	var de dbus.Error
	if errors.As(err, &de) && de.Name == "org.bluez.Error.AlreadyConnected" {
		return nil
	}
	if err != nil {
		return fmt.Errorf("bluez: connect: %w", err)
	}
	return nil
}

// abandon cancels a pending connection attempt and cleans up after it once
// BlueZ answers.
func (c *Connector) abandon(path dbus.ObjectPath, addr string, done <-chan error) {
	c.calls.Add(1)
	go func() {
		defer c.calls.Done()
		defer c.release(addr)
		c.disconnect(path, addr)
		if err := <-done; err == nil {
			c.disconnect(path, addr)
		}
	}()
}

// disconnect asks BlueZ to end the connection to the device at path,
// within CallTimeout. BlueZ fails the calls in flight on it. A bluetoothd
// that does not answer is logged and given up on: the connection ends with
// its process, or at the device's supervision timeout.
func (c *Connector) disconnect(path dbus.ObjectPath, addr string) error {
	ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
	defer cancel()
	err := c.conn.Object(bluezName, path).CallWithContext(ctx, ifaceDevice+".Disconnect", 0).Err
	switch {
	case err == nil, isGone(err):
		return nil
	case ctx.Err() != nil:
		err = c.noAnswer("Device1.Disconnect")
		if errors.Is(err, ErrNoAnswer) {
			c.log.Warn("bluez: bluetoothd did not answer; gave up on the call", "call", "Device1.Disconnect", "address", addr,
				"after", c.opts.CallTimeout, "hint", "bluetoothd may be hung: see systemctl status bluetooth, and restart it")
		}
	}
	return fmt.Errorf("bluez: disconnect %s: %w", addr, err)
}

// noAnswer is the error of a call BlueZ left unanswered for CallTimeout
// (bluetoothd is hung), or ErrClosed when the Connector's Close ended it.
func (c *Connector) noAnswer(call string) error {
	if c.ctx.Err() != nil {
		return ErrClosed
	}
	return fmt.Errorf("%w: %s not answered within %s", ErrNoAnswer, call, c.opts.CallTimeout)
}

// getProperty reads one property ("Interface.Name") of BlueZ's object at
// path within ctx.
func (c *Connector) getProperty(ctx context.Context, path dbus.ObjectPath, name string) (dbus.Variant, error) {
	i := strings.LastIndex(name, ".")
	var v dbus.Variant
	err := c.conn.Object(bluezName, path).CallWithContext(ctx, ifaceProps+".Get", 0, name[:i], name[i+1:]).Store(&v)
	return v, err
}

// setup waits for BlueZ to resolve the services, finds the
// characteristics, reads the serial number and registers the link. Every
// call is bounded by ctx.
func (c *Connector) setup(ctx context.Context, path dbus.ObjectPath, addr string, watch <-chan struct{}) (*link, error) {
	for {
		connected, err := c.getProperty(ctx, path, ifaceDevice+".Connected")
		if err != nil {
			return nil, err
		}
		if ok, _ := connected.Value().(bool); !ok {
			return nil, gatt.ErrDisconnected
		}
		resolved, err := c.getProperty(ctx, path, ifaceDevice+".ServicesResolved")
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

	lctx, cancel := context.WithCancel(c.ctx)
	l := &link{
		c:         c,
		path:      path,
		addr:      addr,
		charPaths: map[string]dbus.ObjectPath{},
		ctx:       lctx,
		cancel:    cancel,
		done:      make(chan struct{}),
		subs:      map[dbus.ObjectPath]func([]byte){},
		notifyOn:  map[string]bool{},
	}
	// The characteristics, from BlueZ's objects under the device: the
	// first in path order for each UUID.
	var objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant
	if err := c.conn.Object(bluezName, "/").CallWithContext(ctx, ifaceObjMgr+".GetManagedObjects", 0).Store(&objects); err != nil {
		cancel()
		return nil, err
	}
	paths := make([]string, 0, len(objects))
	for p := range objects {
		if strings.HasPrefix(string(p), string(path)+"/service") {
			paths = append(paths, string(p))
		}
	}
	sort.Strings(paths)
	mtus := map[string]uint16{}
	for _, p := range paths {
		props, ok := objects[dbus.ObjectPath(p)][ifaceChar]
		if !ok {
			continue
		}
		u, _ := props["UUID"].Value().(string)
		u = strings.ToLower(u)
		if _, dup := l.charPaths[u]; !dup && u != "" {
			l.charPaths[u] = dbus.ObjectPath(p)
			mtus[u], _ = props["MTU"].Value().(uint16)
		}
	}

	if _, ok := l.charPaths[gatt.SerialNumberUUID]; !ok {
		cancel()
		return nil, fmt.Errorf("%w: no DIS serial number characteristic: not a companion device", errUnidentified)
	}
	serial, err := l.readValue(ctx, gatt.SerialNumberUUID)
	if err != nil {
		cancel()
		var de dbus.Error
		if errors.As(err, &de) && (de.Name == "org.bluez.Error.NotPermitted" || de.Name == "org.bluez.Error.NotAuthorized") {
			// Refused, not lost: it will be refused again.
			return nil, fmt.Errorf("%w: read serial number: %w", errUnidentified, err)
		}
		return nil, fmt.Errorf("read serial number: %w", err)
	}
	l.serial = string(serial)

	// The MTU BlueZ reports on the characteristics (BlueZ ≥ 5.62).
	l.mtu.Store(gatt.DefaultMTU)
	mtu, ok := mtus[gatt.SMPCharUUID]
	if !ok {
		mtu = mtus[gatt.SerialNumberUUID]
	}
	if mtu >= gatt.DefaultMTU {
		l.mtu.Store(int64(mtu))
	}

	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		cancel()
		return nil, ErrClosed
	}
	moved := c.ids[addr] != l.serial
	c.ids[addr] = l.serial
	delete(c.refused, addr) // bondLost: the bond holds
	// A device is at one address at a time: the addresses it was read at
	// before are left behind (a resolvable private address rotates, every
	// 15 minutes in Zephyr), unless one is in use. Before, the map held
	// each of them for as long as the bridge ran, growing by one a
	// rotation of each device, without bound over days
	// (docs/reliability.md, bug 464).
	for a, id := range c.ids {
		if id == l.serial && a != addr && !c.busy[a] {
			delete(c.ids, a)
			moved = true
		}
	}
	c.links[path] = l
	c.broadcastLocked()
	c.mu.Unlock()
	if moved {
		c.saveIDs()
	}
	// A drop before the link was registered would be missed.
	if v, err := c.getProperty(ctx, path, ifaceDevice+".Connected"); err != nil || v.Value() != true {
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
	charPaths map[string]dbus.ObjectPath // by UUID
	mtu       atomic.Int64
	ctx       context.Context // of the link's calls: Close cancels it
	cancel    context.CancelFunc
	done      chan struct{}
	lostOnce  sync.Once
	closeOnce sync.Once
	closeErr  error // of Close

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
func (l *link) lost() { l.end(false) }

// end is lost, reporting whether this call ended the link; keepBusy leaves
// the address busy, for the caller to release.
func (l *link) end(keepBusy bool) bool {
	ended := false
	l.lostOnce.Do(func() {
		ended = true
		l.mu.Lock()
		l.down = true
		l.mu.Unlock()
		close(l.done)
		l.cancel() // the calls in flight fail: the connection is gone
		c := l.c
		c.mu.Lock()
		if c.links[l.path] == l {
			delete(c.links, l.path)
		}
		if !keepBusy {
			delete(c.busy, l.addr)
		}
		c.broadcastLocked()
		c.mu.Unlock()
	})
	return ended
}

// uses reports whether path is one of the link's characteristics.
func (l *link) uses(path dbus.ObjectPath) bool {
	for _, p := range l.charPaths {
		if p == path {
			return true
		}
	}
	return false
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

// Close disconnects, ends the link's calls in flight and waits for them.
// It may be called after Done closed, and by several callers (the client
// on it, the Connector's Close): each returns once the first one's work is
// done, with its error. A bluetoothd that does not answer the disconnect
// within the Connector's CallTimeout is given up on (and logged): Close
// returns then all the same, with an error wrapping ErrNoAnswer, so that a
// hung bluetoothd cannot hold the bridge's shutdown (docs/reliability.md,
// bug 194).
func (l *link) Close() error {
	l.closeOnce.Do(func() { l.closeErr = l.close() })
	return l.closeErr
}

func (l *link) close() error {
	l.mu.Lock()
	l.closed = true
	wasDown := l.down
	l.mu.Unlock()
	var err error
	if !wasDown {
		// BlueZ fails the calls in flight; the notification sessions end
		// with the connection (BlueZ removes the characteristics'
		// objects).
		err = l.c.disconnect(l.path, l.addr)
	}
	l.cancel()
	l.ops.Wait()
	l.lost()
	return err
}

// do runs one D-Bus call of the link within ctx, ending it when the link
// closes; Close waits for it.
func (l *link) do(ctx context.Context, f func(context.Context) error) error {
	l.mu.Lock()
	if l.closed || l.down {
		l.mu.Unlock()
		return gatt.ErrDisconnected
	}
	l.ops.Add(1)
	l.mu.Unlock()
	defer l.ops.Done()
	if err := ctx.Err(); err != nil {
		return err
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(l.ctx, cancel)()
	err := f(cctx)
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return ctx.Err()
	case l.ctx.Err() != nil:
		return fmt.Errorf("%w: %v", gatt.ErrDisconnected, err)
	}
	return l.mapErr(err)
}

// mapErr turns the errors of a connection gone into gatt.ErrDisconnected.
func (l *link) mapErr(err error) error {
	select {
	case <-l.done:
		return fmt.Errorf("%w: %v", gatt.ErrDisconnected, err)
	default:
	}
	if notPaired(err) {
		return fmt.Errorf("%w (BlueZ: %v): pair the gateway with it and trust it (bluetoothctl pair %s, trust %s; docs/gatt.md, \"Link security\")",
			gatt.ErrNotPaired, err, l.addr, l.addr)
	}
	if isGone(err) {
		// The signal may not have arrived yet: ask.
		ctx, cancel := context.WithTimeout(l.ctx, l.c.opts.CallTimeout)
		v, perr := l.c.getProperty(ctx, l.path, ifaceDevice+".Connected")
		cancel()
		if perr != nil || v.Value() != true {
			l.lost()
			return fmt.Errorf("%w: %v", gatt.ErrDisconnected, err)
		}
	}
	return fmt.Errorf("bluez: %w", err)
}

// notPaired reports whether err is BlueZ refusing a characteristic's
// access for want of pairing: the ATT errors insufficient authentication,
// encryption or key size ("Not paired"), or insufficient authorization.
func notPaired(err error) bool {
	var de dbus.Error
	if !errors.As(err, &de) {
		return false
	}
	switch de.Name {
	case "org.bluez.Error.NotAuthorized", "org.bluez.Error.AuthenticationFailed":
		return true
	case "org.bluez.Error.NotPermitted":
		return len(de.Body) > 0 && strings.Contains(fmt.Sprint(de.Body[0]), "Not paired")
	}
	return false
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

// char is the object path of a characteristic of the device.
func (l *link) char(uuid string) (dbus.ObjectPath, error) {
	p, ok := l.charPaths[strings.ToLower(uuid)]
	if !ok {
		return "", fmt.Errorf("bluez: device %s has no characteristic %s", l.serial, uuid)
	}
	return p, nil
}

// readValue reads a characteristic's value within ctx.
func (l *link) readValue(ctx context.Context, charUUID string) ([]byte, error) {
	p, err := l.char(charUUID)
	if err != nil {
		return nil, err
	}
	var out []byte
	err = l.c.conn.Object(bluezName, p).CallWithContext(ctx, ifaceChar+".ReadValue", 0, map[string]any{}).Store(&out)
	return out, err
}

// Read reads a characteristic's value.
func (l *link) Read(ctx context.Context, charUUID string) ([]byte, error) {
	if _, err := l.char(charUUID); err != nil {
		return nil, err
	}
	var out []byte
	err := l.do(ctx, func(ctx context.Context) error {
		var err error
		out, err = l.readValue(ctx, charUUID)
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
	p, err := l.char(charUUID)
	if err != nil {
		return err
	}
	if max := l.MTU() - 3; len(data) > max {
		return fmt.Errorf("bluez: write of %d bytes over MTU %d (at most %d)", len(data), l.MTU(), max)
	}
	typ := "command"
	if withResponse {
		typ = "request"
	}
	return l.do(ctx, func(ctx context.Context) error {
		return l.c.conn.Object(bluezName, p).CallWithContext(ctx, ifaceChar+".WriteValue", 0, data, map[string]any{"type": typ}).Err
	})
}

// Subscribe enables notifications of a characteristic; fn gets the values
// in order, on the Connector's signal goroutine. A second Subscribe to the
// same characteristic replaces fn.
func (l *link) Subscribe(ctx context.Context, charUUID string, fn func([]byte)) error {
	u := strings.ToLower(charUUID)
	path, err := l.char(u)
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.subs[path] = fn
	l.mu.Unlock()
	err = l.do(ctx, func(ctx context.Context) error {
		l.notifyMu.Lock()
		defer l.notifyMu.Unlock()
		if l.notifyOn[u] {
			return nil
		}
		// The values come in order through the Connector's signals.
		if err := l.c.conn.Object(bluezName, path).CallWithContext(ctx, ifaceChar+".StartNotify", 0).Err; err != nil {
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
