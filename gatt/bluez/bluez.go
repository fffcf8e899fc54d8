//go:build linux

// Package bluez is the gatt.Connector for real Bluetooth adapters on Linux
// gateways: BlueZ over D-Bus. It finds devices by scanning for Zephyr's SMP
// service (gatt.ServiceUUID), which a device with MCUmgr's Bluetooth
// transport advertises, and tells them apart by the serial number of their
// Device Information Service, which is the device id.
//
// It talks D-Bus itself (godbus), on a private connection, and makes every
// call with a context: the caller's, or CallTimeout for the calls nobody
// waits on (a disconnect, discovery), so that a bluetoothd that stops
// answering costs a timeout, never a hang, and the Connector's Close ends
// whatever is left. tinygo.org/x/bluetooth, which it used before, makes
// its calls without one, and falls short on Linux besides:
//
//   - its handlers of signals index and assert the bodies of every
//     PropertiesChanged on the bus unchecked, so one malformed signal would
//     panic the bridge;
//   - its Scan can be stopped only from its own callback (StopScan is not
//     safe from another goroutine,
//     https://github.com/tinygo-org/bluetooth/issues/128), so a scan could
//     not honour a deadline;
//   - it polls for ServicesResolved for up to 10 s with no way to cancel;
//   - it reports disconnects to a central on Linux only when the central
//     itself disconnects;
//   - it hands notification values to the callback through an unbuffered
//     channel on godbus's default signal handler, which spawns a goroutine
//     per signal when the receiver is busy and so reorders them
//     (https://github.com/godbus/dbus/pull/117); SMP messages span several
//     notifications and need them in order.
//
// The package does not pair or bond, and does not reconnect: a Link's Done
// tells the caller the link is gone; the caller calls Connect again with a
// backoff, as gatt.Device does.
package bluez

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/devicecompanion/companion/gatt"
)

// D-Bus names of BlueZ.
const (
	bluezName      = "org.bluez"
	ifaceAdapter   = "org.bluez.Adapter1"
	ifaceDevice    = "org.bluez.Device1"
	ifaceChar      = "org.bluez.GattCharacteristic1"
	ifaceObjMgr    = "org.freedesktop.DBus.ObjectManager"
	ifaceProps     = "org.freedesktop.DBus.Properties"
	sigPropsChange = ifaceProps + ".PropertiesChanged"
	sigIfaceAdded  = ifaceObjMgr + ".InterfacesAdded"
	sigIfaceGone   = ifaceObjMgr + ".InterfacesRemoved"
)

// ErrClosed is returned by Connect once the Connector is closed.
var ErrClosed = errors.New("bluez: connector closed")

// ErrBusLost is returned by Connect once the connection to the system bus
// is lost (BusLost).
var ErrBusLost = errors.New("bluez: the connection to the system D-Bus was lost (dbus restarted or died); restart the bridge")

// ErrAccessDenied is what errors.Is finds in the error of New when the
// system bus's policy for org.bluez refuses this user: it refuses it
// again at every start until a person adds the user to the group the
// policy allows (SupplementaryGroups=bluetooth), so companion-bridge exits
// on it with status 2, which its unit does not restart (bug 438).
var ErrAccessDenied = errors.New("bluez: the system bus's policy for org.bluez refuses this user")

// errNoAdapter is why discovery cannot start while the Connector has no
// adapter: New found no bluetoothd, or no adapter, and none came since.
var errNoAdapter = errors.New("no Bluetooth adapter to use yet: bluetoothd is not running, or the adapter is not there (systemctl status bluetooth; bluetoothctl list)")

// ErrNoAnswer is wrapped by the error of a call that bluetoothd left
// unanswered for CallTimeout.
var ErrNoAnswer = errors.New("bluez: bluetoothd did not answer")

// UnidentifiedRetry is how long a device that advertises the SMP service
// but cannot be told apart (no DIS serial number, or one it refuses to
// read without pairing) is not connected to again.
const UnidentifiedRetry = time.Minute

// DefaultCallTimeout bounds a D-Bus call that no caller's context bounds.
// BlueZ answers such calls in milliseconds, and a disconnect once the
// controller reports it, within a connection's supervision timeout (at
// most 32 s by the Core specification, 4–6 s as centrals set it, 2 s more
// while BlueZ lets the profiles go); the bridge's shutdown waits for the
// disconnects, under systemd's TimeoutStopSec of 30 s.
const DefaultCallTimeout = 10 * time.Second

// Options configure a Connector. The zero value means defaults.
type Options struct {
	// Adapter is the BlueZ adapter to use: its name ("hci1"), object path
	// ("/org/bluez/hci1") or address ("00:1A:7D:DA:71:01"). When empty,
	// the first adapter BlueZ lists (by path). The Connector follows the
	// adapter by its address when it comes back at another path (a USB
	// adapter plugged in again).
	Adapter string
	// Logger; slog.Default() when nil.
	Logger *slog.Logger
	// CallTimeout bounds each D-Bus call no caller's context bounds;
	// DefaultCallTimeout when 0.
	CallTimeout time.Duration
	// StateFile, when set, is the file the Connector keeps the address
	// it last read each device's serial number at in, across restarts
	// (the bridge's --data directory/bluez-addresses.json): a device
	// whose bond was lost is then known to be the one asked for at once
	// after a restart too (docs/reliability.md, bug 495).
	StateFile string
}

// Connector opens GATT links to devices through BlueZ. It is safe for
// concurrent use: several devices can connect at once, sharing one
// discovery session.
type Connector struct {
	log  *slog.Logger
	opts Options
	conn *dbus.Conn // private: every call, and the signals in order
	// ctx bounds every call: Close cancels it once the links had their
	// CallTimeout to disconnect, and so ends every call left.
	ctx      context.Context
	cancel   context.CancelFunc
	sigs     chan *dbus.Signal
	wake     chan struct{} // pokes scanLoop
	closing  chan struct{}
	scanDone chan struct{}
	dispDone chan struct{}
	busLost  chan struct{} // closed when the bus connection ends under us

	mu          sync.Mutex
	adapterPath dbus.ObjectPath // of the adapter in use; changes when it comes back at another
	adapterAddr string          // of the adapter in use, upper case; it keeps it across a replug
	adapterGone bool            // the adapter in use was removed
	closed      bool
	calls       sync.WaitGroup                    // Connect calls and their cleanups
	saveMu      sync.Mutex                        // one write of Options.StateFile at a time (saveIDs)
	ids         map[string]string                 // address → device id (DIS serial)
	unknown     map[string]time.Time              // address → until when not to probe it again (errUnidentified)
	refused     map[string]int                    // address of a Paired device → its setups failed in a row (bondLost)
	busy        map[string]bool                   // addresses being probed or linked
	links       map[dbus.ObjectPath]*link         // device path → open link
	watch       map[dbus.ObjectPath]chan struct{} // device path → poked on Device1 changes
	known       map[dbus.ObjectPath]*known        // Device1 objects of the adapter
	wanted      int                               // Connect calls waiting for devices
	scanning    bool                              // discovery is on
	scanLost    bool                              // BlueZ ended discovery under scanLoop
	scanErr     error                             // why discovery could not start
	powerFailed bool                              // our power-on of the adapter failed (rfkill): tried again before discovery
	changed     chan struct{}                     // closed and replaced on news
}

// known is what the Connector knows of one Device1 object.
type known struct {
	address string
	uuids   []string
	seen    int  // times found since discovery started; 0: not found
	paired  bool // BlueZ holds a bond with it (Device1.Paired)
}

// New enables the adapter (powering it on if it is off) and returns a
// Connector. Close releases it. bluetoothd not on the bus, the adapter not
// there, or its power-on refused (rfkill) is no error: the Connector logs
// it and waits, its Connect calls failing until they pass (bug 434). An
// error is a system bus it cannot reach, or bluetoothd refusing this user
// or not answering.
func New(opts Options) (*Connector, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.CallTimeout <= 0 {
		opts.CallTimeout = DefaultCallTimeout
	}
	conn, err := dbus.ConnectSystemBus(dbus.WithSignalHandler(dbus.NewSequentialSignalHandler()))
	if err != nil {
		return nil, fmt.Errorf("bluez: connect to the system bus: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Connector{
		log:      opts.Logger,
		opts:     opts,
		conn:     conn,
		ctx:      ctx,
		cancel:   cancel,
		sigs:     make(chan *dbus.Signal, 64),
		wake:     make(chan struct{}, 1),
		closing:  make(chan struct{}),
		scanDone: make(chan struct{}),
		dispDone: make(chan struct{}),
		busLost:  make(chan struct{}),
		ids:      map[string]string{},
		unknown:  map[string]time.Time{},
		refused:  map[string]int{},
		busy:     map[string]bool{},
		links:    map[dbus.ObjectPath]*link{},
		watch:    map[dbus.ObjectPath]chan struct{}{},
		known:    map[dbus.ObjectPath]*known{},
		changed:  make(chan struct{}),
	}
	c.loadIDs()
	if err := c.start(); err != nil {
		cancel()
		conn.Close()
		return nil, err
	}
	return c, nil
}

func (c *Connector) start() error {
	ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
	defer cancel()
	// All of BlueZ's property changes (of every adapter: ours may come
	// back at another path), and its objects coming and going; one
	// channel, so they arrive in order. Asked for before BlueZ's objects
	// are listed: bluetoothd, or the adapter, that comes after is seen.
	c.conn.Signal(c.sigs)
	rules := [][]dbus.MatchOption{
		{dbus.WithMatchSender(bluezName), dbus.WithMatchInterface(ifaceProps), dbus.WithMatchMember("PropertiesChanged"), dbus.WithMatchPathNamespace("/org/bluez")},
		{dbus.WithMatchSender(bluezName), dbus.WithMatchInterface(ifaceObjMgr)},
		// bluetoothd exiting takes every connection with it, silently.
		{dbus.WithMatchSender("org.freedesktop.DBus"), dbus.WithMatchMember("NameOwnerChanged"), dbus.WithMatchArg(0, bluezName)},
	}
	for _, r := range rules {
		if err := c.conn.AddMatchSignalContext(ctx, r...); err != nil {
			return fmt.Errorf("bluez: add match: %w", err)
		}
	}
	var objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant
	err := c.conn.Object(bluezName, "/").CallWithContext(ctx, ifaceObjMgr+".GetManagedObjects", 0).Store(&objects)
	// bluetoothd not running yet (at boot, or stopped), the adapter not
	// there (a USB adapter not plugged in, its driver not loaded) or
	// blocked by rfkill: the Connector starts all the same and waits for
	// it, as it rides them out once running, its devices offline until
	// then. Before, the bridge exited with status 1 and systemd started it
	// again every 2 s for as long as it lasted (docs/reliability.md,
	// bug 434).
	switch {
	case ctx.Err() != nil:
		// Hung: waited out as a running Connector does, until it answers
		// or is restarted (bug 439).
		c.log.Warn("bluez: bluetoothd did not answer; waiting for it, the devices offline until it does (systemctl status bluetooth; restart it if it hangs)",
			"after", c.opts.CallTimeout)
		c.adapterGone = true
	case err != nil && bluezAbsent(err):
		c.log.Warn("bluez: bluetoothd is not on the system bus; waiting for it, the devices offline until it comes (systemctl status bluetooth)", "err", err)
		c.adapterGone = true
	case err != nil:
		var de dbus.Error
		if errors.As(err, &de) && de.Name == "org.freedesktop.DBus.Error.AccessDenied" {
			return fmt.Errorf("%w: add it to the bluetooth group, or SupplementaryGroups=bluetooth in its systemd unit: list BlueZ's adapters: %w",
				ErrAccessDenied, err)
		}
		return fmt.Errorf("bluez: list BlueZ's adapters: %w", err)
	default:
		path, props, err := pickAdapter(c.opts.Adapter, objects)
		if err != nil {
			c.log.Warn("bluez: waiting for the adapter; the devices are offline until it comes", "err", err)
			c.adapterGone = true
			break
		}
		c.adapterPath = path
		c.adapterAddr, _ = props["Address"].Value().(string)
		c.adapterAddr = strings.ToUpper(c.adapterAddr)
		c.log.Info("bluez: using adapter", "adapter", path, "address", c.adapterAddr)
		if on, _ := props["Powered"].Value().(bool); !on {
			if err := c.powerOn(ctx, path); err != nil {
				c.powerFailed = true
				c.log.Warn("bluez: the adapter could not be powered on; trying again as devices are looked for (rfkill list)", "adapter", path, "err", err)
			}
		}
	}
	go c.dispatch()
	go c.scanLoop()
	return nil
}

// bluezAbsent reports whether err, of a call to org.bluez, says no
// bluetoothd is on the bus: none owns the name, and D-Bus could not
// start one (no .service file, or systemd's unit disabled or failing).
func bluezAbsent(err error) bool {
	var de dbus.Error
	if !errors.As(err, &de) {
		return false
	}
	return de.Name == "org.freedesktop.DBus.Error.ServiceUnknown" ||
		de.Name == "org.freedesktop.DBus.Error.NameHasNoOwner" ||
		strings.HasPrefix(de.Name, "org.freedesktop.DBus.Error.Spawn") ||
		strings.HasPrefix(de.Name, "org.freedesktop.systemd1.")
}

// lookForAdapter lists BlueZ's adapters and takes one (adapterAdded) if
// the Connector has none: bluetoothd that came on the bus after New, with
// its adapters already there, announces none of them.
func (c *Connector) lookForAdapter() {
	defer c.calls.Done()
	ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
	defer cancel()
	if err := c.findAdapter(ctx); err != nil {
		c.log.Warn("bluez: bluetoothd is on the bus but listing its adapters failed", "err", err)
	}
}

// findAdapter lists BlueZ's adapters and offers each to adapterAdded.
func (c *Connector) findAdapter(ctx context.Context) error {
	var objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant
	if err := c.conn.Object(bluezName, "/").CallWithContext(ctx, ifaceObjMgr+".GetManagedObjects", 0).Store(&objects); err != nil {
		return c.unanswered(ctx, "ObjectManager.GetManagedObjects", err)
	}
	var paths []dbus.ObjectPath
	for p, ifaces := range objects {
		if _, ok := ifaces[ifaceAdapter]; ok {
			paths = append(paths, p)
		}
	}
	sort.Slice(paths, func(i, j int) bool { return paths[i] < paths[j] })
	for _, p := range paths {
		c.adapterAdded(p, objects[p][ifaceAdapter])
	}
	return nil
}

// pickAdapter is the adapter want names (see Options.Adapter) among
// BlueZ's objects, with its properties; an error lists those there are.
func pickAdapter(want string, objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant) (dbus.ObjectPath, map[string]dbus.Variant, error) {
	var paths []dbus.ObjectPath
	for p, ifaces := range objects {
		if _, ok := ifaces[ifaceAdapter]; ok {
			paths = append(paths, p)
		}
	}
	sort.Slice(paths, func(i, j int) bool { return paths[i] < paths[j] })
	if len(paths) == 0 {
		return "", nil, errors.New("bluez: BlueZ has no Bluetooth adapter: is one plugged in and its driver loaded? (bluetoothctl list, rfkill list)")
	}
	var have []string
	for _, p := range paths {
		props := objects[p][ifaceAdapter]
		addr, _ := props["Address"].Value().(string)
		name := strings.TrimPrefix(string(p), "/org/bluez/")
		switch {
		case want == "",
			strings.Contains(want, ":") && strings.EqualFold(addr, want),
			string(p) == want, name == want:
			return p, props, nil
		}
		have = append(have, fmt.Sprintf("%s (%s)", name, addr))
	}
	return "", nil, fmt.Errorf("bluez: no adapter %q; BlueZ has %s", want, strings.Join(have, ", "))
}

// powerOn switches the adapter at path on.
func (c *Connector) powerOn(ctx context.Context, path dbus.ObjectPath) error {
	c.log.Info("bluez: powering the adapter on", "adapter", path)
	return c.setPowered(ctx, path)
}

// setPowered is powerOn without its log line.
func (c *Connector) setPowered(ctx context.Context, path dbus.ObjectPath) error {
	err := c.conn.Object(bluezName, path).CallWithContext(ctx, ifaceProps+".Set", 0,
		ifaceAdapter, "Powered", dbus.MakeVariant(true)).Err
	if err != nil {
		return fmt.Errorf("bluez: power %s on: %w", path, err)
	}
	return nil
}

// adapter is the path of the adapter in use.
func (c *Connector) adapter() dbus.ObjectPath {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.adapterPath
}

// adapterAdded follows our adapter, known by its address, to the path it
// comes back at (a USB adapter plugged in again may get another index),
// and powers it on as New does; discovery then starts there. Once ours is
// gone, an adapter of another address is taken in its place (a USB adapter
// replaced) unless Options.Adapter named ours otherwise: by its address,
// or by a name or path this one does not have. Before, the Connector kept
// asking the path it started with, and every device read offline until
// the bridge was restarted (docs/reliability.md, bug 388).
func (c *Connector) adapterAdded(path dbus.ObjectPath, props map[string]dbus.Variant) {
	addr, _ := props["Address"].Value().(string)
	c.mu.Lock()
	if !strings.EqualFold(addr, c.adapterAddr) {
		want := c.opts.Adapter
		named := want == "" || (!strings.Contains(want, ":") && (string(path) == want || string(path) == "/org/bluez/"+want))
		// None yet (New found no bluetoothd or no adapter, bug 434): one
		// named by its address is taken too.
		first := c.adapterAddr == ""
		named = named || (first && strings.Contains(want, ":") && strings.EqualFold(addr, want))
		if !c.adapterGone || !named {
			c.mu.Unlock()
			return
		}
		if first {
			c.log.Info("bluez: using adapter", "adapter", path, "address", strings.ToUpper(addr))
		} else {
			c.log.Info("bluez: using another adapter in place of the one removed", "adapter", path, "address", addr, "was", c.adapterAddr)
		}
		c.adapterAddr = strings.ToUpper(addr)
	}
	c.adapterGone = false
	old := c.adapterPath
	c.adapterPath = path
	var gone []*link
	if old != path {
		for p := range c.known {
			if !strings.HasPrefix(string(p), string(path)+"/") {
				delete(c.known, p)
			}
		}
		for _, l := range c.links {
			if !strings.HasPrefix(string(l.path), string(path)+"/") {
				gone = append(gone, l)
			}
		}
	}
	closed := c.closed
	if !closed {
		c.calls.Add(1)
	}
	c.mu.Unlock()
	for _, l := range gone {
		l.lost()
	}
	if closed {
		return
	}
	if old != "" && old != path {
		c.log.Info("bluez: the adapter is back at another path", "adapter", path, "was", old, "address", addr)
	}
	on, _ := props["Powered"].Value().(bool)
	go func() {
		defer c.calls.Done()
		if !on {
			ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
			err := c.powerOn(ctx, path)
			cancel()
			if err != nil {
				c.mu.Lock()
				c.powerFailed = true
				c.mu.Unlock()
				c.log.Warn("bluez: the adapter is back but could not be powered on; trying again as devices are looked for", "adapter", path, "err", err)
			}
		}
		c.poke()
	}()
}

// Close closes the open links and waits for the Connector's goroutines,
// including Connect attempts it abandoned, which end when BlueZ answers
// them. It gives BlueZ CallTimeout for all of it: then it ends the calls
// still waiting (a hung bluetoothd answers none), logs that it gave up on
// them, and returns. Connect calls in progress return ErrClosed.
func (c *Connector) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.closing)
	links := make([]*link, 0, len(c.links))
	for _, l := range c.links {
		links = append(links, l)
	}
	c.mu.Unlock()
	grace := time.NewTimer(c.opts.CallTimeout)
	defer grace.Stop()
	var wg sync.WaitGroup
	for _, l := range links {
		wg.Go(func() { l.Close() })
	}
	wg.Wait()
	idle := make(chan struct{})
	go func() {
		c.calls.Wait()
		close(idle)
	}()
	select {
	case <-idle:
	case <-grace.C:
		c.log.Warn("bluez: bluetoothd left a connection attempt unanswered; gave up on it to stop",
			"after", c.opts.CallTimeout, "hint", "bluetoothd may be hung: see systemctl status bluetooth, and restart it")
	}
	c.cancel()
	<-idle
	<-c.scanDone
	err := c.conn.Close() // ends the signal channel, so dispatch
	<-c.dispDone
	return err
}

// poke wakes scanLoop to look at the demand for discovery.
func (c *Connector) poke() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// broadcastLocked tells waiting Connect calls something changed.
func (c *Connector) broadcastLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// Connect scans for the device with this id, connects and returns the link,
// within ctx's deadline. Devices are told apart by their DIS serial number;
// the address of each device read is remembered, so a reconnect needs no
// probing. On a timeout the error wraps ctx.Err().
func (c *Connector) Connect(ctx context.Context, deviceID string) (gatt.Link, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	c.calls.Add(1)
	defer c.calls.Done()
	c.wanted++
	if c.wanted == 1 {
		c.scanErr = nil
	}
	c.mu.Unlock()
	c.poke()
	defer func() {
		c.mu.Lock()
		c.wanted--
		c.mu.Unlock()
		c.poke()
	}()

	tried := map[dbus.ObjectPath]int{} // path → seen count when tried
	warned := map[string]bool{}        // addresses whose failed attempt this call logged
	for {
		c.mu.Lock()
		path, addr, ok := c.pickLocked(deviceID, tried)
		changed, scanErr, closed := c.changed, c.scanErr, c.closed
		c.mu.Unlock()
		if closed {
			return nil, ErrClosed
		}
		select {
		case <-c.busLost:
			if ok {
				c.release(addr)
			}
			return nil, ErrBusLost
		default:
		}
		if ok {
			l, err := c.open(ctx, path, addr, deviceID)
			if err == nil {
				return l, nil
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("bluez: connect %s (%s): %w", deviceID, addr, ctx.Err())
			}
			if errors.Is(err, errUnidentified) {
				// Not at its next advertisement, nor the one after:
				// before, a device that could not be told apart (a
				// neighbour's) was connected to at each of them, for as
				// long as the bridge looked for one of its own
				// (docs/reliability.md, bug 394).
				c.mu.Lock()
				if _, known := c.ids[addr]; !known {
					c.leaveAloneLocked(addr)
				}
				c.mu.Unlock()
				c.log.Warn("bluez: a device with the SMP service cannot be told apart; not connecting to it again for a while",
					"address", addr, "err", err, "retry_after", UnidentifiedRetry)
				continue
			}
			if lost := c.bondLost(deviceID, path, addr, err); lost != nil {
				return nil, fmt.Errorf("bluez: connect %s: %w", deviceID, lost)
			}
			switch {
			case errors.Is(err, errOtherDevice):
			case warned[addr]:
				// A device is tried again at each advertisement (bug 466):
				// one warning a call, not one each.
				c.log.Debug("bluez: connect failed again", "device_id", deviceID, "address", addr, "err", err)
			default:
				warned[addr] = true
				c.log.Warn("bluez: connect failed", "device_id", deviceID, "address", addr, "err", err)
			}
			continue
		}
		if scanErr != nil {
			return nil, fmt.Errorf("bluez: discovery: %w", scanErr)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, fmt.Errorf("bluez: device %s not found: %w", deviceID, ctx.Err())
		case <-c.closing:
			return nil, ErrClosed
		case <-c.busLost:
		}
	}
}

// bondLost is the error for a connection attempt that failed because the
// device has lost the bond BlueZ keeps with it (it was reset, or paired
// with another central): BlueZ brings the link up, encrypts it with the
// long-term key the device no longer has, is refused ("PIN or Key
// Missing") and ends it. Connect is answered "le-connection-key-missing"
// (BlueZ ≥ 5.69, src/error.c) or AuthenticationFailed, which say so, or
// "le-connection-abort-by-local" (att_connect_cb's answer to most failures
// of the ATT connection), "br-connection-canceled" (device_remove_connection's,
// the link seen to end first), or a success with the link down a moment
// later (att_connect_cb's answer to ECONNABORTED), which say so only for a
// device BlueZ lists as Paired whose setup failed so twice in a row
// (c.refused, which a setup that works clears). Nothing but
// removing the bond and pairing again helps: before, the attempts went on
// at each advertisement until the command's 10 minutes ran out, the
// command failing timeout (docs/reliability.md, bug 463). It is nil for
// any other failure, or when the address is not deviceID's: an unknown
// device refusing so is told apart by no read, and is left alone as
// unidentified for UnidentifiedRetry.
func (c *Connector) bondLost(deviceID string, path dbus.ObjectPath, addr string, err error) error {
	if errors.Is(err, errOtherDevice) || errors.Is(err, errUnidentified) {
		return nil
	}
	var de dbus.Error
	failed := errors.As(err, &de) && de.Name == "org.bluez.Error.Failed"
	sure := errors.As(err, &de) && (de.Name == "org.bluez.Error.AuthenticationFailed" ||
		(failed && len(de.Body) > 0 && strings.Contains(fmt.Sprint(de.Body[0]), "key-missing")))
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.known[path]
	paired := k != nil && k.paired
	if !sure {
		// Connect failed, or the link ended during the setup (before the
		// services resolved, or under the serial number's read), for a
		// device BlueZ holds a bond with.
		if !paired || !(failed || errors.Is(err, gatt.ErrDisconnected) || isGone(err)) {
			delete(c.refused, addr)
			return nil
		}
		// Counted across Connect calls: BlueZ reports a device found
		// again only when its RSSI moved 8 dBm (RSSI_THRESHOLD) unless a
		// filter asks for more, so the second attempt may be the next
		// call's.
		if c.refused[addr]++; c.refused[addr] < 2 {
			return nil
		}
	}
	if id, ok := c.ids[addr]; !ok || id != deviceID {
		if !ok {
			c.leaveAloneLocked(addr)
			c.log.Warn("bluez: a device the gateway is paired with refuses the bond (reset?); not connecting to it again for a while: remove it and pair again if it is one of ours",
				"address", addr, "err", err, "fix", fmt.Sprintf("bluetoothctl remove %s; pair %s; trust %s", addr, addr, addr), "retry_after", UnidentifiedRetry)
		}
		return nil
	}
	return fmt.Errorf("%w: its bond with the gateway is lost (the device was reset, or paired with another gateway), and BlueZ's connection with the old key fails (%v): remove it and pair again (bluetoothctl remove %s, pair %s, trust %s; docs/gatt.md, \"Link security\")",
		gatt.ErrNotPaired, err, addr, addr, addr)
}

// leaveAloneLocked has pickLocked skip addr for UnidentifiedRetry, and
// forgets the addresses whose time is up: the map holds only those left
// alone within the last UnidentifiedRetry.
func (c *Connector) leaveAloneLocked(addr string) {
	now := time.Now()
	for a, until := range c.unknown {
		if now.After(until) {
			delete(c.unknown, a)
		}
	}
	c.unknown[addr] = now.Add(UnidentifiedRetry)
}

// pickLocked chooses a device to try for deviceID among those found by
// discovery: its own address if known, else one whose id is not known yet.
// It marks the address busy.
func (c *Connector) pickLocked(deviceID string, tried map[dbus.ObjectPath]int) (dbus.ObjectPath, string, bool) {
	var best, unknown dbus.ObjectPath
	paths := make([]dbus.ObjectPath, 0, len(c.known))
	for p := range c.known {
		paths = append(paths, p)
	}
	sort.Slice(paths, func(i, j int) bool { return paths[i] < paths[j] })
	for _, p := range paths {
		k := c.known[p]
		if k.seen == 0 || c.busy[k.address] || tried[p] == k.seen || !hasUUID(k.uuids, gatt.ServiceUUID) {
			continue
		}
		if until, ok := c.unknown[k.address]; ok {
			if time.Now().Before(until) {
				continue
			}
			delete(c.unknown, k.address)
		}
		id, ok := c.ids[k.address]
		switch {
		case ok && id == deviceID:
			best = p
		case !ok && unknown == "":
			unknown = p
		}
	}
	if best == "" {
		best = unknown
	}
	if best == "" {
		return "", "", false
	}
	k := c.known[best]
	tried[best] = k.seen
	c.busy[k.address] = true
	return best, k.address, true
}

// release frees an address picked by pickLocked.
func (c *Connector) release(addr string) {
	c.mu.Lock()
	delete(c.busy, addr)
	c.broadcastLocked()
	c.mu.Unlock()
}

func hasUUID(list []string, uuid string) bool {
	for _, u := range list {
		if strings.EqualFold(u, uuid) {
			return true
		}
	}
	return false
}

// scanLoop runs discovery while some Connect call waits for a device. It
// starts it again when BlueZ ended it (discoveryLost).
func (c *Connector) scanLoop() {
	defer close(c.scanDone)
	again := false
	// failed is the failure last logged, until discovery works again:
	// the same failure at every attempt of every device (an adapter off
	// for the night) is logged once, not at each one (docs/reliability.md,
	// bug 395).
	failed := ""
	for {
		if !again {
			select {
			case <-c.closing:
				return
			case <-c.wake:
			}
		}
		again = false
		if !c.demand() {
			continue
		}
		err := c.startDiscovery()
		c.mu.Lock()
		c.scanErr = err
		c.broadcastLocked()
		c.mu.Unlock()
		if err != nil {
			if err.Error() != failed {
				failed = err.Error()
				c.log.Warn("bluez: discovery failed; devices cannot be found until it works (logged again only if the failure changes)", "err", err,
					"adapter", c.adapter())
			}
			continue
		}
		if failed != "" {
			c.log.Info("bluez: discovery works again", "adapter", c.adapter(), "failed_with", failed)
			failed = ""
		}
		lost := false
		for c.demand() {
			if lost = c.takeScanLost(); lost {
				break
			}
			select {
			case <-c.closing:
			case <-c.wake:
			}
		}
		if lost {
			again = true // without StopDiscovery: BlueZ has none of ours
			continue
		}
		c.stopDiscovery()
		select {
		case <-c.closing:
			return
		default:
		}
	}
}

// takeScanLost reports, once, that BlueZ ended discovery under scanLoop.
func (c *Connector) takeScanLost() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	lost := c.scanLost
	c.scanLost = false
	return lost
}

// discoveryLost is told that BlueZ ended discovery without being asked:
// powering the adapter off ends every discovery session (BlueZ's
// adapter_stop), as do the adapter's removal and bluetoothd's exit. No
// signal says so to the session's owner; scanLoop, told, starts discovery
// again while a Connect call waits, which before waited for a device no
// discovery would find, for as long as any Connect call waited
// (docs/reliability.md, bug 387).
func (c *Connector) discoveryLost(why string) {
	c.mu.Lock()
	if c.scanning {
		c.scanning = false
		c.scanLost = true
		for _, k := range c.known {
			k.seen = 0
		}
		c.log.Info("bluez: discovery ended; starting it again", "why", why, "adapter", c.adapterPath)
	}
	c.mu.Unlock()
	c.poke()
}

func (c *Connector) demand() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.wanted > 0 && !c.closed
}

// startDiscovery starts discovery, each call within CallTimeout.
func (c *Connector) startDiscovery() error {
	ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
	defer cancel()
	c.mu.Lock()
	path, powerFailed := c.adapterPath, c.powerFailed
	gone := c.adapterGone
	c.mu.Unlock()
	if path == "" {
		// None since New: bluetoothd may have come, or answered again
		// after a hang, without a word (bug 439).
		if err := c.findAdapter(ctx); err != nil {
			return fmt.Errorf("%w: %w", errNoAdapter, err)
		}
		c.mu.Lock()
		path, powerFailed = c.adapterPath, c.powerFailed
		c.mu.Unlock()
		if path == "" {
			return errNoAdapter
		}
	}
	if powerFailed && !gone {
		// Our power-on failed (rfkill blocked it): again, now that a
		// device is looked for; an unblock does not power the adapter
		// on (bug 434).
		if err := c.setPowered(ctx, path); err != nil {
			return c.unanswered(ctx, "Properties.Set(Powered)", err)
		}
		c.mu.Lock()
		c.powerFailed = false
		c.mu.Unlock()
		c.log.Info("bluez: the adapter is powered on", "adapter", path)
	}
	ad := c.conn.Object(bluezName, path)
	// RSSI, at its lowest (-127 dBm: no device is left out for it), makes
	// BlueZ announce each advertisement of a device it knows as an RSSI
	// change: without an RSSI or Pathloss filter it announces only changes
	// of 8 dBm or more (RSSI_THRESHOLD, src/device.c; doc/org.bluez.Adapter.rst,
	// SetDiscoveryFilter). A device whose connection attempt failed is
	// tried again at its next advertisement announced; before, one whose
	// RSSI held steady was not found again until discovery started anew,
	// its Connect call running out its time "not found" (docs/reliability.md,
	// bug 466).
	filter := map[string]any{"Transport": "le", "UUIDs": []string{gatt.ServiceUUID}, "RSSI": int16(-127)}
	if err := ad.CallWithContext(ctx, ifaceAdapter+".SetDiscoveryFilter", 0, filter).Err; err != nil {
		return fmt.Errorf("SetDiscoveryFilter: %w", c.unanswered(ctx, "Adapter1.SetDiscoveryFilter", err))
	}
	var objects map[dbus.ObjectPath]map[string]map[string]dbus.Variant
	if err := c.conn.Object(bluezName, "/").CallWithContext(ctx, ifaceObjMgr+".GetManagedObjects", 0).Store(&objects); err != nil {
		return fmt.Errorf("GetManagedObjects: %w", c.unanswered(ctx, "ObjectManager.GetManagedObjects", err))
	}
	c.mu.Lock()
	for path, ifaces := range objects {
		if props, ok := ifaces[ifaceDevice]; ok {
			c.addKnownLocked(path, props)
		}
	}
	// Before the call: devices may be reported before its reply. A loss
	// of an earlier session, not taken by scanLoop, is no loss of this
	// one.
	c.scanning, c.scanLost = true, false
	c.mu.Unlock()
	err := ad.CallWithContext(ctx, ifaceAdapter+".StartDiscovery", 0).Err
	var de dbus.Error
	if errors.As(err, &de) && de.Name == "org.bluez.Error.InProgress" {
		// BlueZ has a discovery session of ours already: one whose
		// StartDiscovery it answered after CallTimeout. It is on, and
		// StopDiscovery ends it when no one waits. Before, this was a
		// failure at every call, and the session was never stopped
		// (docs/reliability.md, bug 392).
		c.log.Debug("bluez: discovery was on already", "adapter", ad.Path())
		return nil
	}
	if err != nil {
		c.mu.Lock()
		c.scanning = false
		c.mu.Unlock()
		return fmt.Errorf("StartDiscovery: %w", c.unanswered(ctx, "Adapter1.StartDiscovery", err))
	}
	return nil
}

// unanswered is err, or noAnswer when ctx ended first.
func (c *Connector) unanswered(ctx context.Context, call string, err error) error {
	if ctx.Err() != nil {
		return c.noAnswer(call)
	}
	return err
}

func (c *Connector) stopDiscovery() {
	c.mu.Lock()
	c.scanning = false
	for _, k := range c.known {
		k.seen = 0
	}
	path := c.adapterPath
	c.mu.Unlock()
	if path == "" {
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
	defer cancel()
	ad := c.conn.Object(bluezName, path)
	if err := ad.CallWithContext(ctx, ifaceAdapter+".StopDiscovery", 0).Err; err != nil {
		c.log.Debug("bluez: StopDiscovery", "err", c.unanswered(ctx, "Adapter1.StopDiscovery", err))
		if ctx.Err() != nil {
			return
		}
	}
	ad.CallWithContext(ctx, ifaceAdapter+".SetDiscoveryFilter", 0, map[string]any{})
}

// addKnownLocked records a Device1 object of our adapter. A device already
// connected counts as found: it does not advertise while connected.
func (c *Connector) addKnownLocked(path dbus.ObjectPath, props map[string]dbus.Variant) *known {
	if c.adapterPath == "" || !strings.HasPrefix(string(path), string(c.adapterPath)+"/") {
		return nil
	}
	k := c.known[path]
	if k == nil {
		k = &known{}
		c.known[path] = k
	}
	if v, ok := props["Address"].Value().(string); ok {
		k.address = strings.ToUpper(v)
	}
	if v, ok := props["UUIDs"].Value().([]string); ok {
		k.uuids = v
	}
	if v, ok := props["Paired"].Value().(bool); ok {
		k.paired = v
	}
	if conn, _ := props["Connected"].Value().(bool); conn && c.links[path] == nil {
		k.seen++
	}
	return k
}

// dispatch handles BlueZ's signals in the order they come. A signal whose
// body does not have the arguments and types BlueZ sends (a buggy
// bluetoothd) is logged and ignored: a panic here would end the bridge.
func (c *Connector) dispatch() {
	defer close(c.dispDone)
	for sig := range c.sigs {
		if !c.handle(sig) {
			c.log.Warn("bluez: ignoring a malformed signal", "signal", sig.Name, "path", sig.Path, "body", fmt.Sprintf("%#v", sig.Body))
		}
	}
	// godbus closes the signal channel when the connection ends: Close
	// closed it, or the bus went away (docs/reliability.md, bug 391).
	select {
	case <-c.closing:
		return
	default:
	}
	c.log.Error("bluez: the connection to the system D-Bus was lost; BlueZ cannot be reached on it again",
		"hint", "the D-Bus daemon restarted or died; the bridge must be restarted (systemd does it)")
	close(c.busLost)
	c.mu.Lock()
	links := make([]*link, 0, len(c.links))
	for _, l := range c.links {
		links = append(links, l)
	}
	c.broadcastLocked()
	c.mu.Unlock()
	for _, l := range links {
		l.lost()
	}
}

// BusLost is closed when the Connector's connection to the system bus
// ends under it: the D-Bus daemon restarted or died. BlueZ cannot be
// reached on that connection again, and every Connect fails ErrBusLost;
// the bridge exits so that its service manager starts it anew.
func (c *Connector) BusLost() <-chan struct{} { return c.busLost }

// handle acts on one signal; it reports false for one whose body is not
// what BlueZ sends.
func (c *Connector) handle(sig *dbus.Signal) bool {
	switch sig.Name {
	case sigIfaceAdded:
		if len(sig.Body) < 2 {
			return false
		}
		path, ok := sig.Body[0].(dbus.ObjectPath)
		ifaces, ok2 := sig.Body[1].(map[string]map[string]dbus.Variant)
		if !ok || !ok2 {
			return false
		}
		if props, ok := ifaces[ifaceAdapter]; ok {
			c.adapterAdded(path, props)
		}
		props, ok := ifaces[ifaceDevice]
		if !ok {
			return true
		}
		c.mu.Lock()
		if k := c.addKnownLocked(path, props); k != nil && c.scanning {
			k.seen++
			c.broadcastLocked()
		}
		c.mu.Unlock()
	case sigIfaceGone:
		if len(sig.Body) < 2 {
			return false
		}
		path, ok := sig.Body[0].(dbus.ObjectPath)
		ifaces, ok2 := sig.Body[1].([]string)
		if !ok || !ok2 {
			return false
		}
		if hasUUID(ifaces, ifaceAdapter) {
			c.mu.Lock()
			ours := path == c.adapterPath
			c.adapterGone = c.adapterGone || ours
			c.mu.Unlock()
			if ours {
				c.discoveryLost("the adapter was removed")
			}
		}
		if hasUUID(ifaces, ifaceChar) {
			c.charRemoved(path)
		}
		if !hasUUID(ifaces, ifaceDevice) {
			return true
		}
		c.mu.Lock()
		delete(c.known, path)
		l := c.links[path]
		c.mu.Unlock()
		if l != nil {
			l.lost()
		}
	case "org.freedesktop.DBus.NameOwnerChanged":
		if len(sig.Body) < 3 {
			return false
		}
		name, ok := sig.Body[0].(string)
		owner, ok2 := sig.Body[2].(string)
		if !ok || !ok2 {
			return false
		}
		if name != bluezName {
			return true
		}
		if owner != "" {
			// bluetoothd (back) on the bus, with no discovery of ours.
			c.discoveryLost("bluetoothd is new on the bus")
			c.mu.Lock()
			look := (c.adapterAddr == "" || c.adapterGone) && !c.closed
			if look {
				c.calls.Add(1)
			}
			c.mu.Unlock()
			if look {
				c.log.Info("bluez: bluetoothd is on the bus")
				go c.lookForAdapter()
			}
			return true
		}
		c.log.Warn("bluez: bluetoothd left the bus")
		c.discoveryLost("bluetoothd left the bus")
		c.mu.Lock()
		links := make([]*link, 0, len(c.links))
		for _, l := range c.links {
			links = append(links, l)
		}
		c.known = map[dbus.ObjectPath]*known{}
		c.mu.Unlock()
		for _, l := range links {
			l.lost()
		}
	case sigPropsChange:
		if len(sig.Body) < 2 {
			return false
		}
		iface, ok := sig.Body[0].(string)
		changes, ok2 := sig.Body[1].(map[string]dbus.Variant)
		if !ok || !ok2 {
			return false
		}
		switch iface {
		case ifaceAdapter:
			if sig.Path == c.adapter() {
				c.adapterChanged(changes)
			}
		case ifaceDevice:
			c.deviceChanged(sig.Path, changes)
		case ifaceChar:
			c.charChanged(sig.Path, changes)
		}
	}
	return true
}

// adapterChanged follows the adapter's Powered: off ends discovery; on
// again, discovery may start.
func (c *Connector) adapterChanged(changes map[string]dbus.Variant) {
	if on, ok := changes["Powered"].Value().(bool); ok {
		if on {
			c.mu.Lock()
			c.powerFailed = false
			c.mu.Unlock()
			c.poke()
		} else {
			c.discoveryLost("the adapter was powered off")
		}
	}
}

func (c *Connector) deviceChanged(path dbus.ObjectPath, changes map[string]dbus.Variant) {
	c.mu.Lock()
	l := c.links[path]
	if w := c.watch[path]; w != nil {
		select {
		case w <- struct{}{}:
		default:
		}
	}
	if k := c.known[path]; k != nil {
		if v, ok := changes["UUIDs"].Value().([]string); ok {
			k.uuids = v
		}
		if v, ok := changes["Paired"].Value().(bool); ok {
			k.paired = v
		}
		// A device found again by discovery changes RSSI (or its
		// advertising data).
		_, rssi := changes["RSSI"]
		_, md := changes["ManufacturerData"]
		_, sd := changes["ServiceData"]
		// A device connected by someone else (the connection another
		// client of BlueZ had in progress when the bridge's Connect was
		// answered InProgress) advertises no more: it is found by its
		// connection, as at the start of discovery (docs/reliability.md,
		// bug 393).
		conn, _ := changes["Connected"].Value().(bool)
		if c.scanning && (rssi || md || sd || (conn && l == nil)) {
			k.seen++
			c.broadcastLocked()
		}
	}
	c.mu.Unlock()
	if connected, ok := changes["Connected"].Value().(bool); ok && !connected && l != nil {
		l.lost()
	}
}

// charRemoved is told that BlueZ removed a characteristic's object. One
// a link uses, while the device stays connected, is BlueZ rediscovering
// the device's services after it indicated Service Changed (a firmware
// that changed its GATT table): the objects come back, but the
// notification sessions on them are gone, and BlueZ drops the reads and
// writes in flight on them unanswered (src/gatt-client.c,
// btd_gatt_client_service_removed). Before, the link read as up while no
// answer of the device came over it: each request waited out its timeout,
// and each command failed timeout, until a request timeout dropped the
// link (docs/reliability.md, bug 465). The link ends (its calls in flight
// fail gatt.ErrDisconnected, and the caller asks again over a new one, as
// after any drop), and so does the connection, so that the next one has
// its services resolved, and its notifications asked for, anew: reused,
// it could be set up while BlueZ had the objects half exported again.
func (c *Connector) charRemoved(path dbus.ObjectPath) {
	c.mu.Lock()
	var l *link
	for dev, dl := range c.links {
		if strings.HasPrefix(string(path), string(dev)+"/") {
			l = dl
			break
		}
	}
	if l == nil || !l.uses(path) || c.closed {
		c.mu.Unlock()
		return
	}
	c.calls.Add(1)
	c.mu.Unlock()
	if !l.end(true) {
		c.calls.Done() // lost already: its connection ends, or ended, otherwise
		return
	}
	go func() {
		defer c.calls.Done()
		defer c.release(l.addr) // kept busy from end until the connection is gone
		ctx, cancel := context.WithTimeout(c.ctx, c.opts.CallTimeout)
		v, err := c.getProperty(ctx, l.path, ifaceDevice+".Connected")
		cancel()
		if err == nil && v.Value() != true {
			return // the connection ended, and took the objects with it
		}
		c.log.Info("bluez: BlueZ rediscovers the device's services (it indicated Service Changed); reconnecting",
			"address", l.addr, "device", l.serial)
		c.disconnect(l.path, l.addr)
	}()
}

func (c *Connector) charChanged(path dbus.ObjectPath, changes map[string]dbus.Variant) {
	c.mu.Lock()
	var l *link
	for dev, dl := range c.links {
		if strings.HasPrefix(string(path), string(dev)+"/") {
			l = dl
			break
		}
	}
	c.mu.Unlock()
	if l == nil {
		return
	}
	if v, ok := changes["MTU"].Value().(uint16); ok {
		// The ATT MTU is exchanged once per connection and never shrinks;
		// one announced below the link's (0, say) is not taken: the
		// client sized its writes to the link's when it was made, and
		// every one would fail (docs/reliability.md, bug 143).
		for {
			cur := l.mtu.Load()
			if int64(v) <= cur || l.mtu.CompareAndSwap(cur, int64(v)) {
				break
			}
		}
	}
	if v, ok := changes["Value"].Value().([]byte); ok {
		l.notified(path, v)
	}
}

// watchDevice returns a channel poked on each change of the device's
// Device1 properties, and a function to stop.
func (c *Connector) watchDevice(path dbus.ObjectPath) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	c.mu.Lock()
	c.watch[path] = ch
	c.mu.Unlock()
	return ch, func() {
		c.mu.Lock()
		if c.watch[path] == ch {
			delete(c.watch, path)
		}
		c.mu.Unlock()
	}
}
