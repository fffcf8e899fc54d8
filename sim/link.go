package sim

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion/gatt"
)

// Defaults of LinkOptions.
//
// DefaultKBPS models BLE 2M PHY with data length extension: a 251-byte
// link-layer payload (247 bytes of ATT PDU plus 4 of L2CAP) takes
// (2+4+2+251+3)×8 bits / 2 Mbit/s = 1048 µs on air, then 150 µs
// inter-frame space, a 44 µs empty acknowledgement and another 150 µs:
// 1392 µs per 247 ATT bytes, 1419 kbit/s of ATT PDUs. We round down to
// 1400 kbit/s and charge every write and notification its value plus the
// 3-byte ATT header at that rate, in each direction independently.
const (
	DefaultMTU          = 247
	DefaultKBPS         = 1400
	DefaultLatency      = 7500 * time.Microsecond // one way: one 7.5 ms connection interval
	DefaultConnectDelay = 20 * time.Millisecond
)

// attHeader is the ATT opcode and handle a write or notification carries
// beside its value.
const attHeader = 3

// pacingSlack is how far the simulated air time may run ahead of the real
// clock before a writer is made to wait: waiting per write would measure
// the timer's granularity rather than the link.
const pacingSlack = 2 * time.Millisecond

// LinkOptions configure a Network. The zero value of a field means its
// default.
type LinkOptions struct {
	MTU          int           // ATT MTU of every link; default DefaultMTU
	KBPS         int           // link rate in kbit/s of ATT PDUs, each direction; default DefaultKBPS
	Latency      time.Duration // one-way delay after a PDU's air time; default DefaultLatency; negative for none
	DropEvery    time.Duration // each link drops this long after it connected; 0 never
	ConnectDelay time.Duration // time to connect; default DefaultConnectDelay; negative for none
	// MTUs, when set, are the ATT MTUs of the first links, in the order
	// they are made; later ones have MTU. A central and a device may
	// negotiate another MTU on another connection.
	MTUs []int
}

// Network is the simulated radio: a gatt.Connector that joins the bridge to
// simulated peripherals over links that model MTU, rate, latency and
// dropped connections in real time. A Network is one central (a bridge's
// radio). A peripheral takes one central at a time: connecting again
// drops the network's old link, and a Peripheral linked to another
// Network (another bridge in range) refuses the connection
// (ConnectedFrom).
type Network struct {
	opts  LinkOptions
	sched *scheduler

	mu          sync.Mutex
	peripherals map[string]gatt.Peripheral
	links       map[string]*Link
	closed      bool

	connects, drops atomic.Int64
	made            atomic.Int64 // links made, for MTUs
}

// NewNetwork returns an empty network.
func NewNetwork(opts LinkOptions) *Network {
	if opts.MTU <= 0 {
		opts.MTU = DefaultMTU
	}
	opts.MTU = max(opts.MTU, gatt.DefaultMTU)
	if opts.KBPS <= 0 {
		opts.KBPS = DefaultKBPS
	}
	if opts.Latency == 0 {
		opts.Latency = DefaultLatency
	}
	opts.Latency = max(opts.Latency, 0)
	if opts.ConnectDelay == 0 {
		opts.ConnectDelay = DefaultConnectDelay
	}
	opts.ConnectDelay = max(opts.ConnectDelay, 0)
	return &Network{opts: opts, sched: newScheduler(), peripherals: map[string]gatt.Peripheral{}, links: map[string]*Link{}}
}

// Options returns the network's options with defaults filled in.
func (n *Network) Options() LinkOptions { return n.opts }

// Capacity is the modelled rate of one direction in bytes per second of
// ATT PDUs (values plus their 3-byte headers).
func (n *Network) Capacity() float64 { return float64(n.opts.KBPS) * 1000 / 8 }

// Add makes a peripheral reachable as deviceID.
func (n *Network) Add(deviceID string, p gatt.Peripheral) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.peripherals[deviceID] = p
}

// Connects and Drops count links opened and links dropped by the network
// (DropEvery or Drop; not those closed by the central).
func (n *Network) Connects() int64 { return n.connects.Load() }

// Drops counts the links the network dropped.
func (n *Network) Drops() int64 { return n.drops.Load() }

// ErrNotFound is returned by Connect for a device the network does not have.
var ErrNotFound = errors.New("sim: no such device in range")

// Connect opens a link to deviceID after the connection delay.
func (n *Network) Connect(ctx context.Context, deviceID string) (gatt.Link, error) {
	n.mu.Lock()
	p, old, closed := n.peripherals[deviceID], n.links[deviceID], n.closed
	n.mu.Unlock()
	switch {
	case closed:
		return nil, errors.New("sim: network closed")
	case p == nil:
		return nil, fmt.Errorf("%w: %q", ErrNotFound, deviceID)
	}
	if old != nil {
		old.Close()
	}
	if d := n.opts.ConnectDelay; d > 0 {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
	l := newLink(n, deviceID, p)
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil, errors.New("sim: network closed")
	}
	n.links[deviceID] = l
	n.mu.Unlock()
	connected := p.Connected
	if cp, ok := p.(interface {
		ConnectedFrom(any, int, func(string, []byte), func()) error
	}); ok {
		connected = func(mtu int, notify func(string, []byte), drop func()) error {
			return cp.ConnectedFrom(n, mtu, notify, drop)
		}
	}
	if err := connected(l.mtu, l.notify, func() { l.teardown() }); err != nil {
		n.mu.Lock()
		if n.links[deviceID] == l {
			delete(n.links, deviceID)
		}
		n.mu.Unlock()
		l.stopOnce.Do(func() { close(l.done) })
		close(l.torn)
		return nil, fmt.Errorf("sim: connect to %s: %w", deviceID, err)
	}
	n.connects.Add(1)
	l.start()
	return l, nil
}

// Drop drops deviceID's link now, as a radio would; it reports whether
// there was one.
func (n *Network) Drop(deviceID string) bool {
	n.mu.Lock()
	l := n.links[deviceID]
	n.mu.Unlock()
	if l == nil || !l.alive() {
		return false
	}
	n.drops.Add(1)
	l.teardown()
	return true
}

// Close drops every link, closes the peripherals that have a Close (a
// reboot under way ends), and stops the network's scheduler; Connect fails
// from then on.
func (n *Network) Close() {
	n.mu.Lock()
	n.closed = true
	var links []*Link
	for _, l := range n.links {
		links = append(links, l)
	}
	var closers []io.Closer
	for _, p := range n.peripherals {
		if c, ok := p.(io.Closer); ok {
			closers = append(closers, c)
		}
	}
	n.mu.Unlock()
	for _, l := range links {
		l.Close()
	}
	for _, c := range closers {
		c.Close()
	}
	n.sched.stop()
}

// Link is one simulated connection. It implements gatt.Link.
type Link struct {
	n   *Network
	id  string
	p   gatt.Peripheral
	mtu int

	up, down *wire

	subMu sync.Mutex
	subs  map[string]func([]byte)

	done      chan struct{}
	stopOnce  sync.Once
	torn      chan struct{} // closed when teardown has finished
	dropTimer *time.Timer   // guarded by runMu: start and teardown may race

	// runMu guards dead and running: a delivery runs only while the link
	// is up, and teardown waits for the one running.
	runMu   sync.Mutex
	dead    bool
	running int
	idle    *sync.Cond
}

func newLink(n *Network, id string, p gatt.Peripheral) *Link {
	mtu := n.opts.MTU
	if i := n.made.Add(1) - 1; i < int64(len(n.opts.MTUs)) {
		mtu = max(n.opts.MTUs[i], gatt.DefaultMTU)
	}
	l := &Link{n: n, id: id, p: p, mtu: mtu, subs: map[string]func([]byte){},
		done: make(chan struct{}), torn: make(chan struct{})}
	l.idle = sync.NewCond(&l.runMu)
	rate := n.Capacity()
	l.up = newWire(l, rate, n.opts.Latency)
	l.down = newWire(l, rate, n.opts.Latency)
	return l
}

// start arms the link's drop timer, unless the link is down already: the
// peripheral may end it (a reboot) as soon as it is connected.
func (l *Link) start() {
	d := l.n.opts.DropEvery
	if d <= 0 {
		return
	}
	l.runMu.Lock()
	defer l.runMu.Unlock()
	if !l.dead {
		l.dropTimer = time.AfterFunc(d, func() { l.n.Drop(l.id) })
	}
}

// run runs a delivery of the link unless the link is down.
func (l *Link) run(deliver func()) {
	l.runMu.Lock()
	if l.dead {
		l.runMu.Unlock()
		return
	}
	l.running++
	l.runMu.Unlock()
	deliver()
	l.runMu.Lock()
	l.running--
	if l.running == 0 {
		l.idle.Broadcast()
	}
	l.runMu.Unlock()
}

func (l *Link) alive() bool {
	select {
	case <-l.done:
		return false
	default:
		return true
	}
}

// teardown ends the link: writes fail, queued PDUs are lost, the
// peripheral hears of it. Every caller returns only when it is finished.
func (l *Link) teardown() {
	first := false
	l.stopOnce.Do(func() {
		first = true
		close(l.done)
	})
	if !first {
		<-l.torn
		return
	}
	// What is still on the air is lost; what is being delivered finishes.
	l.runMu.Lock()
	l.dead = true
	if l.dropTimer != nil {
		l.dropTimer.Stop()
	}
	for l.running > 0 {
		l.idle.Wait()
	}
	l.runMu.Unlock()
	l.p.Disconnected()
	l.n.mu.Lock()
	if l.n.links[l.id] == l {
		delete(l.n.links, l.id)
	}
	l.n.mu.Unlock()
	close(l.torn)
}

// MTU is the link's ATT MTU.
func (l *Link) MTU() int { return l.mtu }

// Done is closed when the link is down.
func (l *Link) Done() <-chan struct{} { return l.done }

// Close disconnects and waits until the link is down.
func (l *Link) Close() error {
	l.teardown()
	return nil
}

// Read reads a characteristic: a request and a response, each one way.
func (l *Link) Read(ctx context.Context, charUUID string) ([]byte, error) {
	if err := l.wait(ctx, 2*l.n.opts.Latency); err != nil {
		return nil, err
	}
	return l.p.ReadChar(charUUID)
}

func (l *Link) wait(ctx context.Context, d time.Duration) error {
	if !l.alive() {
		return gatt.ErrDisconnected
	}
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-l.done:
		return gatt.ErrDisconnected
	case <-t.C:
		return nil
	}
}

// Write sends one value of at most MTU-3 bytes. It returns when the value
// is on the air (within pacingSlack), or, with withResponse, when the
// peripheral has taken it and the response has come back.
func (l *Link) Write(ctx context.Context, charUUID string, data []byte, withResponse bool) error {
	if len(data) > l.mtu-attHeader {
		return fmt.Errorf("sim: write of %d bytes exceeds MTU %d - 3", len(data), l.mtu)
	}
	if !l.alive() {
		return gatt.ErrDisconnected
	}
	v := append([]byte(nil), data...)
	taken := make(chan error, 1)
	onAir := l.up.send(len(v)+attHeader, func() { taken <- l.p.WriteChar(charUUID, v) })
	if err := l.wait(ctx, time.Until(onAir)-pacingSlack); err != nil {
		return err
	}
	if !withResponse {
		return nil
	}
	select {
	case err := <-taken:
		if err != nil {
			return err
		}
	case <-l.done:
		return gatt.ErrDisconnected
	case <-ctx.Done():
		return ctx.Err()
	}
	return l.wait(ctx, l.n.opts.Latency)
}

// Subscribe enables notifications of a characteristic.
func (l *Link) Subscribe(ctx context.Context, charUUID string, fn func([]byte)) error {
	if err := l.wait(ctx, 2*l.n.opts.Latency); err != nil {
		return err
	}
	l.subMu.Lock()
	defer l.subMu.Unlock()
	l.subs[charUUID] = fn
	return nil
}

// notify is the peripheral's side: it queues a notification on the down
// wire; one the central has not subscribed to is lost, as in GATT.
func (l *Link) notify(charUUID string, value []byte) {
	if !l.alive() {
		return
	}
	v := append([]byte(nil), value...)
	l.down.send(len(v)+attHeader, func() {
		l.subMu.Lock()
		fn := l.subs[charUUID]
		l.subMu.Unlock()
		if fn != nil {
			fn(v)
		}
	})
}

// wire is one direction of a link: PDUs take their air time one after
// another, then arrive after the latency, in order. Their arrivals are
// events of the network's scheduler.
type wire struct {
	link        *Link
	bytesPerSec float64
	latency     time.Duration

	mu   sync.Mutex
	free time.Time // when the air is free for the next PDU
}

func newWire(l *Link, bytesPerSec float64, latency time.Duration) *wire {
	return &wire{link: l, bytesPerSec: bytesPerSec, latency: latency}
}

// send books size bytes of air time and schedules deliver for their
// arrival; it returns when the PDU has finished going out. The scheduler
// keeps the order of one wire's PDUs: their arrival times never decrease.
func (w *wire) send(size int, deliver func()) time.Time {
	air := time.Duration(float64(size) / w.bytesPerSec * float64(time.Second))
	w.mu.Lock()
	now := time.Now()
	if w.free.Before(now) {
		w.free = now
	}
	w.free = w.free.Add(air)
	onAir := w.free
	w.link.n.sched.add(onAir.Add(w.latency), w.link, deliver)
	w.mu.Unlock()
	return onAir
}

// scheduler runs the deliveries of every link of a network at their
// arrival times, on one goroutine with one timer, rather than a goroutine
// and a timer per direction of each link. Deliveries must not block: they
// hand a PDU to a peripheral or to a central's notification handler.
type scheduler struct {
	mu      sync.Mutex
	events  eventHeap
	seq     uint64
	started bool
	stopped bool
	wake    chan struct{}
	quit    chan struct{}
	done    chan struct{}
}

type event struct {
	at      time.Time
	seq     uint64 // order of scheduling, among events due at once
	link    *Link
	deliver func()
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = event{}
	*h = old[:len(old)-1]
	return e
}

func newScheduler() *scheduler {
	return &scheduler{wake: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// add schedules deliver on link at at; the scheduler's goroutine starts
// with the first event.
func (s *scheduler) add(at time.Time, l *Link, deliver func()) {
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return
	}
	s.seq++
	heap.Push(&s.events, event{at: at, seq: s.seq, link: l, deliver: deliver})
	first := s.events[0].seq == s.seq
	if !s.started {
		s.started = true
		go s.run()
	}
	s.mu.Unlock()
	if first {
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

func (s *scheduler) run() {
	defer close(s.done)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var due []event
	for {
		s.mu.Lock()
		now := time.Now()
		wait := time.Duration(-1)
		for len(s.events) > 0 {
			if d := s.events[0].at.Sub(now); d > 0 {
				wait = d
				break
			}
			due = append(due, heap.Pop(&s.events).(event))
		}
		s.mu.Unlock()
		for i, e := range due {
			e.link.run(e.deliver)
			due[i] = event{}
		}
		due = due[:0]
		var timer <-chan time.Time
		if wait >= 0 {
			t.Reset(wait)
			timer = t.C
		}
		select {
		case <-s.quit:
			return
		case <-s.wake:
		case <-timer:
		}
	}
}

// stop ends the scheduler's goroutine; events still queued are lost.
func (s *scheduler) stop() {
	s.mu.Lock()
	started := s.started
	if !s.stopped {
		s.stopped = true
		close(s.quit)
	}
	s.mu.Unlock()
	if started {
		<-s.done
	}
}
