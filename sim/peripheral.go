package sim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fxamacker/cbor/v2"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/mcuboot"
)

// Defaults of PeripheralOptions. 2475 bytes is the SMP buffer Nordic
// recommends for fast DFU over Bluetooth (ten 247-byte writes plus headers);
// 250 ms is Zephyr's CONFIG_MCUMGR_GRP_OS_RESET_MS.
const (
	DefaultBufSize    = 2475
	DefaultBufCount   = 4
	DefaultMaxUpload  = 64 << 20
	DefaultResetDelay = 250 * time.Millisecond
	DefaultBootTime   = 100 * time.Millisecond
)

// PeripheralOptions configure a Peripheral. The zero value of a field means
// its default.
type PeripheralOptions struct {
	// BufSize and BufCount are the SMP buffers
	// (CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE and _COUNT), reported by MCUmgr
	// parameters; requests and responses share them.
	BufSize  int // default DefaultBufSize
	BufCount int // default DefaultBufCount
	// NoReassembly makes the device take each ATT write as a whole SMP
	// packet, as Zephyr does without CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY.
	NoReassembly bool
	// NoParams leaves out the MCUmgr parameters command (os_mgmt without
	// CONFIG_MCUMGR_GRP_OS_MCUMGR_PARAMS, Zephyr's default): its read is
	// answered rc 8, and the device does not say how many buffers it has.
	NoParams bool
	// OldMCUmgr makes it the MCUmgr of Zephyr 2.x (2.7 LTS among
	// them): it answers in SMP version 1 whatever the request's version
	// (version 2 came later; the old header has no version bits), and,
	// without reassembly, takes a message cut short for whole, its
	// handler decoding what came (an echo cut short is answered rc 3),
	// where a later smp.c answers rc 9 first.
	OldMCUmgr  bool
	MaxUpload  int           // the secondary slot's size, MCUboot's image trailer at its end; default DefaultMaxUpload
	ResetDelay time.Duration // from the answer to an OS reset to the reboot; default DefaultResetDelay
	BootTime   time.Duration // from the reboot to advertising again; default DefaultBootTime
	Logger     *slog.Logger
	// HandleTime is how long the device works on each SMP request before
	// it answers (a flash write, a busy MCU); default none. Requests
	// queue behind it in the device's buffers.
	HandleTime time.Duration
	// EraseTime is how long the device takes to erase each 4 KiB of its
	// secondary slot when an image upload starts and the slot is not
	// empty: img_mgmt erases len up front, before it answers the request
	// at off 0 (img_mgmt_upload, img_mgmt_erase_image_data, without
	// CONFIG_IMG_ERASE_PROGRESSIVELY, Zephyr's default); default none.
	EraseTime time.Duration
}

// Peripheral is a Zephyr device with the stock MCUmgr subsystem in front of
// a simulated Device (docs/gatt.md): the Device Information and Battery
// services and Zephyr's SMP service. It answers the standard groups as
// os_mgmt, img_mgmt (with MCUboot below it) and settings_mgmt do, in the
// SMP version of each request, and the project's groups (64 and up). Like
// Zephyr's smp_bt it reassembles requests split across writes (or, with
// NoReassembly, takes each write as a packet), has BufCount buffers shared
// by requests and responses (a write that finds none free is lost; a
// request whose answer finds none is answered rc 2, MGMT_ERR_ENOMEM, in its
// own buffer, as smp.c does when smp_alloc_rsp fails), and runs requests
// one at a time in arrival order. An OS reset reboots it:
// the link drops, MCUboot swaps images, and it takes connections again
// after BootTime. It implements gatt.Peripheral.
type Peripheral struct {
	dev  *Device
	opts PeripheralOptions
	log  *slog.Logger

	// connMu orders Connected and Disconnected: a connection's serving
	// goroutine has ended before the next one starts (and wg.Add never
	// races wg.Wait), whichever goroutines the link calls them from.
	connMu sync.Mutex

	mu      sync.Mutex
	notify  func(charUUID string, value []byte)
	drop    func()
	mtu     int
	queue   []packet
	inUse   int // buffers held: queued packets, the one being collected, two while one is answered
	cur     []byte
	want    int // bytes the message being collected still needs
	wake    chan struct{}
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	booting bool
	closed  bool
	// busyUntil is when an erase a disconnect cut off ends: flash does
	// not stop half way, and img_mgmt runs its request to the end, the
	// answer lost with the link; the next connection's requests wait for
	// it, as Zephyr's SMP work queue runs them after it (bug 471).
	busyUntil time.Time
	// central is the central being served (ConnectedFrom).
	central any
	image   imageUpload        // img_mgmt's upload in progress (RAM: lost at reboot)
	uploads map[uint16]*upload // the project groups', by group; kept across connections

	rebootTimer *time.Timer
	rebootWG    sync.WaitGroup
	closing     chan struct{}

	dropped  atomic.Int64
	noMemory atomic.Int64 // requests answered MGMT_ERR_ENOMEM
	erasing  atomic.Bool
}

// packet is what one buffer holds: the messages of one write, or of one
// reassembled message; corrupt is the header of a message cut short, and
// cut the body bytes of it that came.
type packet struct {
	msgs    []gatt.Message
	corrupt *gatt.Header
	cut     []byte
}

// imageUpload is img_mgmt's g_img_mgmt_state.
type imageUpload struct {
	active    bool
	off, size uint64
	sha       []byte
}

type upload struct {
	first gatt.UploadRequest
	data  []byte
}

// NewPeripheral puts dev behind the GATT profile.
func NewPeripheral(dev *Device, opts PeripheralOptions) *Peripheral {
	if opts.BufSize <= 0 {
		opts.BufSize = DefaultBufSize
	}
	opts.BufSize = min(max(opts.BufSize, 64), gatt.MaxMessage)
	if opts.BufCount <= 0 {
		opts.BufCount = DefaultBufCount
	}
	opts.BufCount = max(opts.BufCount, 2)
	if opts.MaxUpload <= 0 {
		opts.MaxUpload = DefaultMaxUpload
	}
	if opts.ResetDelay <= 0 {
		opts.ResetDelay = DefaultResetDelay
	}
	if opts.BootTime <= 0 {
		opts.BootTime = DefaultBootTime
	}
	if opts.Logger == nil {
		opts.Logger = dev.log
	}
	return &Peripheral{dev: dev, opts: opts, log: opts.Logger.With("device_id", dev.ID(), "side", "peripheral"),
		uploads: map[uint16]*upload{}, closing: make(chan struct{})}
}

// Device returns the simulated device behind the peripheral.
func (p *Peripheral) Device() *Device { return p.dev }

// Dropped counts the writes the device lost for want of a buffer, or
// because they broke the framing of a message.
func (p *Peripheral) Dropped() int64 { return p.dropped.Load() }

// Erasing reports whether the device is erasing its secondary slot for an
// upload (EraseTime), whether or not the link that asked is still up.
func (p *Peripheral) Erasing() bool { return p.erasing.Load() }

// NoMemory counts the requests the device answered rc 2 (MGMT_ERR_ENOMEM)
// for want of a buffer for the answer.
func (p *Peripheral) NoMemory() int64 { return p.noMemory.Load() }

// HoldBuffers takes n of the device's SMP buffers, as another transport
// of its MCUmgr does (UART, a second central: Zephyr's buffers are one
// pool), until release is called.
func (p *Peripheral) HoldBuffers(n int) (release func()) {
	p.mu.Lock()
	p.inUse += n
	p.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			p.inUse -= n
			p.mu.Unlock()
		})
	}
}

// Close stops a reboot under way and waits for it. The network closes the
// peripherals it has; close others yourself.
func (p *Peripheral) Close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.closing)
		if p.rebootTimer != nil && p.rebootTimer.Stop() {
			p.rebootWG.Done()
		}
	}
	p.mu.Unlock()
	p.rebootWG.Wait()
	return nil
}

// Services lists the profile's services: Zephyr's SMP characteristic has
// write without response and notify only.
func (p *Peripheral) Services() []gatt.Service {
	return []gatt.Service{
		{UUID: gatt.ServiceUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.SMPCharUUID, Properties: []string{gatt.PropWriteWithoutResponse, gatt.PropNotify}},
		}},
		{UUID: gatt.BatteryServiceUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.BatteryLevelUUID, Properties: []string{gatt.PropRead, gatt.PropNotify}},
		}},
		{UUID: gatt.DeviceInfoUUID, Characteristics: []gatt.Characteristic{
			{UUID: gatt.ModelNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.SerialNumberUUID, Properties: []string{gatt.PropRead}},
			{UUID: gatt.FirmwareRevUUID, Properties: []string{gatt.PropRead}},
		}},
	}
}

// ReadChar answers reads of the Device Information and Battery services.
func (p *Peripheral) ReadChar(charUUID string) ([]byte, error) {
	info, err := p.dev.Info(context.Background())
	if err != nil {
		return nil, err
	}
	switch charUUID {
	case gatt.ModelNumberUUID:
		return []byte(info.Model), nil
	case gatt.SerialNumberUUID:
		return []byte(p.dev.ID()), nil
	case gatt.FirmwareRevUUID:
		return []byte(info.FirmwareVersion), nil
	case gatt.BatteryLevelUUID:
		return []byte{byte(info.Battery)}, nil
	}
	return nil, fmt.Errorf("sim: characteristic %s is not readable", charUUID)
}

// WriteChar takes one write to the SMP characteristic, as smp_bt does.
func (p *Peripheral) WriteChar(charUUID string, data []byte) error {
	if charUUID != gatt.SMPCharUUID {
		return fmt.Errorf("sim: characteristic %s is not writable", charUUID)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.wake == nil {
		return gatt.ErrDisconnected
	}
	if p.opts.NoReassembly {
		p.takePacketLocked(data)
	} else {
		p.collectLocked(data)
	}
	return nil
}

// lostLocked counts a write the device could not take.
func (p *Peripheral) lostLocked(why string, n int) {
	p.dropped.Add(1)
	p.log.Warn("SMP write lost", "why", why, "bytes", n)
}

// takePacketLocked is smp_bt without reassembly: the write is a packet of
// whole messages; one cut short is answered rc 9, and fewer than 8 bytes
// left are dropped without an answer.
func (p *Peripheral) takePacketLocked(data []byte) {
	if p.inUse >= p.opts.BufCount {
		p.lostLocked("no free buffer", len(data))
		return
	}
	if len(data) > p.opts.BufSize {
		p.lostLocked("longer than a buffer", len(data))
		return
	}
	var pk packet
	for len(data) >= gatt.HeaderSize {
		h, _ := gatt.ParseHeader(data)
		end := gatt.HeaderSize + int(h.Len)
		if end > len(data) {
			pk.corrupt, pk.cut = &h, bytes.Clone(data[gatt.HeaderSize:])
			break
		}
		pk.msgs = append(pk.msgs, gatt.Message{Header: h, Body: bytes.Clone(data[gatt.HeaderSize:end])})
		data = data[end:]
	}
	if len(pk.msgs) == 0 && pk.corrupt == nil {
		return
	}
	p.inUse++
	p.queueLocked(pk)
}

// collectLocked is smp_bt with reassembly: the first write of a message
// holds its header, and the writes that follow add to it until it is whole.
// A message longer than a buffer, a write that runs past its message, or a
// new message that finds no buffer free is lost; and, as in Zephyr's
// smp_reassembly_collect, nothing of it is remembered: each write of its
// rest is taken as the first of a new message, its first 8 bytes as a
// header. Before, the simulator skipped the rest of such a message, which
// no Zephyr does (docs/reliability.md, bug 469).
func (p *Peripheral) collectLocked(data []byte) {
	if p.cur == nil {
		if len(data) < gatt.HeaderSize {
			p.lostLocked("a first write without a whole header", len(data))
			return
		}
		h, _ := gatt.ParseHeader(data)
		total := gatt.HeaderSize + int(h.Len)
		switch {
		case total > p.opts.BufSize:
			p.lostLocked("a message longer than a buffer", total)
			return
		case p.inUse >= p.opts.BufCount:
			p.lostLocked("no free buffer", total)
			return
		}
		p.inUse++
		p.cur, p.want = make([]byte, 0, total), total
	}
	if len(data) > p.want {
		p.lostLocked("a write past the message's end", len(data))
		p.cur, p.want = nil, 0
		p.inUse--
		return
	}
	p.cur = append(p.cur, data...)
	p.want -= len(data)
	if p.want > 0 {
		return
	}
	h, _ := gatt.ParseHeader(p.cur)
	p.queueLocked(packet{msgs: []gatt.Message{{Header: h, Body: p.cur[gatt.HeaderSize:]}}})
	p.cur = nil
}

func (p *Peripheral) queueLocked(pk packet) {
	p.queue = append(p.queue, pk)
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// ErrConnectedElsewhere fails a connection to a peripheral that serves
// another central already.
var ErrConnectedElsewhere = errors.New("sim: the device is connected to another central and does not advertise")

// Connected starts serving a central, unless the device is rebooting. A
// connection still served (its end never reported) ends first: one
// central at a time, as on a Zephyr device with one connection.
func (p *Peripheral) Connected(mtu int, notify func(charUUID string, value []byte), drop func()) error {
	return p.ConnectedFrom(nil, mtu, notify, drop)
}

// ConnectedFrom is Connected from central (a Network: one bridge's
// radio). A connection of the same central still served ends first (a
// Disconnect that raced a Connect in BlueZ); one of another central
// refuses this one: a Zephyr device with one connection
// (CONFIG_BT_MAX_CONN=1, most BLE peripherals) stops advertising while
// connected, and another bridge in range finds nothing to connect to until
// the link drops. Before, the second central took the device from the
// first, and a bridge that kept its link to a device moved away never
// kept the device's new bridge off it (docs/reliability.md, bug 486).
func (p *Peripheral) ConnectedFrom(central any, mtu int, notify func(charUUID string, value []byte), drop func()) error {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	p.mu.Lock()
	other := p.cancel != nil && p.central != central
	p.mu.Unlock()
	if other {
		return ErrConnectedElsewhere
	}
	p.endLocked()
	p.mu.Lock()
	if p.booting || p.closed {
		p.mu.Unlock()
		return errors.New("sim: the device is rebooting")
	}
	p.central = central
	ctx, cancel := context.WithCancel(context.Background())
	p.notify, p.drop, p.mtu, p.cancel = notify, drop, mtu, cancel
	p.queue, p.inUse, p.cur, p.want = nil, 0, nil, 0
	p.wake = make(chan struct{}, 1)
	wake := p.wake
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.serve(ctx, wake)
	}()
	return nil
}

// Disconnected stops serving: the request being run is canceled and
// requests not yet run are forgotten; uploads keep their offsets.
func (p *Peripheral) Disconnected() {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	p.endLocked()
}

// endLocked ends the connection being served, if any, and waits for its
// server; p.connMu is held.
func (p *Peripheral) endLocked() {
	p.mu.Lock()
	cancel := p.cancel
	p.notify, p.drop, p.queue, p.cancel, p.wake, p.cur, p.central = nil, nil, nil, nil, nil, nil, nil
	p.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	p.wg.Wait()
}

func (p *Peripheral) serve(ctx context.Context, wake chan struct{}) {
	for {
		p.mu.Lock()
		var pk packet
		ok := len(p.queue) > 0 && ctx.Err() == nil
		if ok {
			pk = p.queue[0]
			p.queue = p.queue[1:]
		}
		p.mu.Unlock()
		if !ok {
			select {
			case <-ctx.Done():
				return
			case <-wake:
				continue
			}
		}
		p.mu.Lock()
		busy := time.Until(p.busyUntil)
		p.mu.Unlock()
		if busy > 0 {
			// An erase the last connection cut off runs on.
			t := time.NewTimer(busy)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		n := len(pk.msgs)
		if pk.corrupt != nil {
			n++
		}
		for i := range n {
			last := i == n-1
			var alive, failed bool
			if i < len(pk.msgs) {
				m := pk.msgs[i]
				alive, failed = p.respond(ctx, m.Header, last, func() reply { return p.handle(ctx, m) })
			} else {
				cut := gatt.Message{Header: *pk.corrupt, Body: pk.cut}
				alive, failed = p.respond(ctx, *pk.corrupt, last, func() reply {
					if p.opts.OldMCUmgr {
						return p.handle(ctx, cut) // no check that the message is whole
					}
					return failRC(gatt.RCCorrupt, "message cut short")
				})
			}
			if !alive {
				return
			}
			if failed && !last {
				// smp_process_request_packet stops at a request that
				// failed in the SMP layer: the rest of the packet goes
				// with its buffer, unanswered.
				p.mu.Lock()
				p.inUse--
				p.mu.Unlock()
				break
			}
		}
	}
}

// respond runs a request and answers it, holding a response buffer while
// it does. The buffers are free again as the answer goes out (with the
// request's, after the packet's last request): Zephyr frees them when the
// notifications are sent, before the central can have read them and
// written again. It reports whether the connection is still there, and
// whether the request failed in the SMP layer (an rc answer), which ends
// its packet.
func (p *Peripheral) respond(ctx context.Context, h gatt.Header, last bool, run func() reply) (alive, failed bool) {
	p.mu.Lock()
	if p.inUse >= p.opts.BufCount {
		// No buffer for the answer: smp_alloc_rsp fails, and smp_on_err
		// answers MGMT_ERR_ENOMEM in the request's buffer, the request
		// not run.
		p.noMemory.Add(1)
		p.mu.Unlock()
		alive = p.answer(ctx, h, failRC(gatt.RCNoMemory, "")) // no rsn: smp_on_err gives none
		if last {
			p.mu.Lock()
			p.inUse--
			p.mu.Unlock()
		}
		return alive, true
	}
	p.inUse++
	p.mu.Unlock()
	if p.opts.HandleTime > 0 {
		t := time.NewTimer(p.opts.HandleTime)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
	r := run()
	p.mu.Lock()
	p.inUse--
	if last {
		p.inUse--
	}
	p.mu.Unlock()
	return p.answer(ctx, h, r), r.rc != 0
}

// reply is a handler's answer: a body, an MCUmgr rc (with no body), or a
// group's own error.
type reply struct {
	body  any
	rc    int
	group uint16
	grc   int
	rsn   string
	after func() // runs once the answer is out (a reset's reboot)
}

func ok(body any) reply { return reply{body: body} }

func failRC(rc int, rsn string) reply { return reply{rc: rc, rsn: rsn} }

func groupErr(group uint16, grc int, rsn string) reply {
	return reply{group: group, grc: grc, rsn: rsn}
}

// rcBody is an error in the rc form: smp_build_err_rsp writes rc, and
// rsn only with CONFIG_MCUMGR_SMP_VERBOSE_ERR_RESPONSE (off by default).
type rcBody struct {
	RC     int    `cbor:"rc"`
	Reason string `cbor:"rsn,omitempty"`
}

// errBody is a group's error in SMP version 2: smp_add_cmd_err writes
// {"err": {"group", "rc"}} and nothing else.
type errBody struct {
	Err gatt.GroupError `cbor:"err"`
}

// zephyrEnc encodes answers with map keys in the order of the Go struct's
// fields, which the simulator declares in the order Zephyr's handlers
// write them (gatt.EncodeBody sorts keys, as zcbor does not).
var zephyrEnc = func() cbor.EncMode {
	em, err := cbor.EncOptions{Sort: cbor.SortNone}.EncMode()
	if err != nil {
		panic(err)
	}
	return em
}()

// projectGroup reports whether g is one of the project's groups, whose
// handlers (the firmware's own) may explain an rc with rsn.
func projectGroup(g uint16) bool {
	switch g {
	case gatt.GroupText, gatt.GroupPush, gatt.GroupApps, gatt.GroupSettingsSchema:
		return true
	}
	return false
}

// answer encodes r in the request's SMP version, as zcbor does, and
// notifies it; it reports false when the connection is gone. While it is
// built it holds a response buffer.
func (p *Peripheral) answer(ctx context.Context, h gatt.Header, r reply) bool {
	// smp_make_rsp_hdr: the request's version, capped at 2; a read's
	// answer is a read response, any other op's a write response.
	version := min(h.Version, gatt.SMPv2)
	if p.opts.OldMCUmgr {
		version = gatt.SMPv1
	}
	op := gatt.OpWriteRsp
	if h.Op == gatt.OpRead {
		op = gatt.OpReadRsp
	}
	var body any = r.body
	if r.rsn != "" && (r.rc != 0 || r.grc != 0) && !projectGroup(h.Group) {
		// A stock device says no more than the code.
		p.log.Debug("SMP error", "group", h.Group, "id", h.ID, "rc", r.rc, "err", r.grc, "why", r.rsn)
		r.rsn = ""
	}
	switch {
	case r.rc != 0:
		body = rcBody{RC: r.rc, Reason: r.rsn}
	case r.grc != 0 && version == gatt.SMPv2:
		body = errBody{Err: gatt.GroupError{Group: r.group, RC: r.grc}}
	case r.grc != 0:
		body = rcBody{RC: legacyRC(r.group, r.grc), Reason: r.rsn}
	case body == nil:
		body = struct{}{}
	}
	var b []byte
	var err error
	if projectGroup(h.Group) {
		b, err = gatt.EncodeBody(body) // the project's answers hold maps: keep them in one order
	} else {
		b, err = zephyrEnc.Marshal(body)
	}
	if err != nil {
		p.log.Error("encoding a response", "err", err)
		return true
	}
	b, _ = zcborForm(nil, b)
	if gatt.HeaderSize+len(b) > p.opts.BufSize && (r.rc != gatt.RCMsgSize || r.rsn != "") {
		// Zephyr encodes the answer in one of its SMP buffers: zcbor runs
		// out of it, the handler returns MGMT_ERR_EMSGSIZE, and smp_on_err
		// answers that instead (in a buffer of its own). Sent whole, an
		// answer past 65535 bytes had a header whose 16-bit length wrapped.
		p.log.Debug("SMP answer longer than a buffer", "group", h.Group, "id", h.ID, "bytes", gatt.HeaderSize+len(b))
		return p.answer(ctx, h, failRC(gatt.RCMsgSize, ""))
	}
	p.mu.Lock()
	notify, mtu := p.notify, p.mtu
	p.mu.Unlock()
	if ctx.Err() != nil || notify == nil {
		return false
	}
	out := gatt.AppendHeader(nil, gatt.Header{Op: op, Version: version, Len: uint16(len(b)), Group: h.Group, Seq: h.Seq, ID: h.ID})
	out = append(out, b...)
	for off := 0; off < len(out); off += mtu - 3 {
		notify(gatt.SMPCharUUID, out[off:min(off+mtu-3, len(out))])
	}
	if r.after != nil {
		r.after()
	}
	return true
}

// zcborForm appends the first CBOR item of b as Zephyr's zcbor writes it
// without CONFIG_ZCBOR_CANONICAL (off by default): every map and array
// with indefinite length, closed by a break byte. It returns the rest of
// b. b is well-formed CBOR of the simulator's own encoding.
func zcborForm(out, b []byte) ([]byte, []byte) {
	major, ai := b[0]>>5, b[0]&0x1f
	head := 1
	var n uint64
	switch {
	case ai < 24:
		n = uint64(ai)
	case ai <= 27:
		size := 1 << (ai - 24)
		for _, c := range b[1 : 1+size] {
			n = n<<8 | uint64(c)
		}
		head += size
	}
	switch major {
	case 2, 3: // byte and text strings
		end := head + int(n)
		return append(out, b[:end]...), b[end:]
	case 4, 5: // arrays and maps
		out = append(out, major<<5|31)
		items := n
		if major == 5 {
			items *= 2
		}
		rest := b[head:]
		for range items {
			out, rest = zcborForm(out, rest)
		}
		return append(out, 0xff), rest
	case 6: // a tag and its item
		return zcborForm(append(out, b[:head]...), b[head:])
	}
	return append(out, b[:head]...), b[head:]
}

// legacyRC is the SMP version 1 rc of a group's error, as Zephyr's
// img_mgmt and settings_mgmt translate them; other groups' are EUNKNOWN.
func legacyRC(group uint16, grc int) int {
	switch group {
	case gatt.GroupImage:
		switch grc {
		case gatt.ImgErrNoImage, gatt.ImgErrNoTLVs:
			return gatt.RCNotFound
		case gatt.ImgErrNoFreeSlot, gatt.ImgErrCurrentVersionIsNewer, gatt.ImgErrImageAlreadyPending:
			return gatt.RCBadState
		case 15: // no free memory
			return gatt.RCNoMemory
		case 14, 19, gatt.ImgErrInvalidOffset, gatt.ImgErrInvalidLength, gatt.ImgErrInvalidImageHeader,
			gatt.ImgErrInvalidHash, 25: // invalid slot, page offset, …, flash address
			return gatt.RCInvalid
		}
	case gatt.GroupSettings:
		switch grc {
		case gatt.SettingsErrKeyTooLong:
			return gatt.RCInvalid
		case gatt.SettingsErrKeyNotFound, gatt.SettingsErrReadNotSupported:
			return gatt.RCNotFound
		}
	}
	return gatt.RCUnknown
}

// status maps the device's errors to SMP return codes.
func status(err error) reply {
	switch {
	case err == nil:
		return ok(nil)
	case errors.Is(err, ErrBadArgument), errors.Is(err, ErrBadSettings):
		return failRC(gatt.RCInvalid, err.Error())
	case errors.Is(err, ErrAppNotInstalled):
		return failRC(gatt.RCNotFound, err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return failRC(gatt.RCTimeout, err.Error())
	}
	return failRC(gatt.RCUnknown, err.Error())
}

// handle runs one request and returns the answer.
func (p *Peripheral) handle(ctx context.Context, m gatt.Message) reply {
	bad := func(err error) reply { return failRC(gatt.RCInvalid, err.Error()) }
	read, write := m.Op == gatt.OpRead, m.Op == gatt.OpWrite
	if !read && !write {
		// smp_process_request_packet: not a request (and no SMP client).
		return failRC(gatt.RCNotSupported, "not a request")
	}
	if m.Version > gatt.SMPv2 && !p.opts.OldMCUmgr { // the old header has no version bits
		return failRC(gatt.RCTooNew, "SMP version not supported")
	}
	g, id := m.Group, m.ID
	if zcborRefuses(m.Body, stockKeys(g, id, write)) {
		return failRC(gatt.RCInvalid, "a field of another type")
	}
	switch {
	case g == gatt.GroupOS && id == gatt.CmdOSEcho: // os_mgmt takes echo as a read too
		var req gatt.EchoRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil {
			return bad(err)
		}
		return ok(gatt.EchoResponse{R: req.D})

	case g == gatt.GroupOS && id == gatt.CmdOSReset && write:
		return reply{body: struct{}{}, after: p.scheduleReboot}

	case g == gatt.GroupOS && id == gatt.CmdOSParams && read && !p.opts.NoParams:
		return ok(gatt.ParamsResponse{BufSize: p.opts.BufSize, BufCount: p.opts.BufCount})

	case g == gatt.GroupImage && id == gatt.CmdImageState && read:
		return ok(zephyrImageState(p.dev.imageState()))

	case g == gatt.GroupImage && id == gatt.CmdImageState && write:
		return p.imageStateWrite(m)

	case g == gatt.GroupImage && id == gatt.CmdImageUpload && write:
		return p.imageUpload(ctx, m)

	case g == gatt.GroupImage && id == cmdImageErase && write:
		return p.imageErase(m)

	case g == gatt.GroupSettings && id == gatt.CmdSettingsValue:
		var req gatt.SettingWriteRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.Name == "" {
			return failRC(gatt.RCInvalid, "name required")
		}
		if len(req.Name) >= 32 { // CONFIG_MCUMGR_GRP_SETTINGS_NAME_LEN
			return groupErr(g, gatt.SettingsErrKeyTooLong, "")
		}
		if read {
			val, grc := p.dev.setting(req.Name)
			if grc != 0 {
				return groupErr(g, grc, req.Name)
			}
			return ok(gatt.SettingReadResponse{Val: val})
		}
		if grc := p.dev.setSetting(req.Name, req.Val); grc != 0 {
			return groupErr(g, grc, req.Name)
		}
		return ok(nil)

	case g == gatt.GroupSettings && id == gatt.CmdSettingsDelete && write:
		var req gatt.SettingReadRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.Name == "" {
			return failRC(gatt.RCInvalid, "name required")
		}
		if grc := p.dev.deleteSetting(req.Name); grc != 0 {
			return groupErr(g, grc, req.Name)
		}
		return ok(nil)

	case g == gatt.GroupSettings && id == gatt.CmdSettingsCommit && write:
		return ok(nil) // the handlers apply values as they are set

	case g == gatt.GroupSettings && id == gatt.CmdSettingsSave:
		if write {
			p.dev.saveSettings()
		} else {
			p.dev.loadSettings()
		}
		return ok(nil)

	case g == gatt.GroupSettingsSchema && id == gatt.CmdSchemaRead && read:
		return ok(gatt.SchemaResponse{Schema: DefaultSchema()})

	case g == gatt.GroupText && id == gatt.CmdTextPush && write:
		var req gatt.TextRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" || req.Text == "" {
			return bad(fmt.Errorf("text push needs cid and text: %v", err))
		}
		return status(p.dev.PushText(ctx, req.CmdID, req.Title, req.Text))

	case g == gatt.GroupApps && id == gatt.CmdAppsList && read:
		info, err := p.dev.Info(ctx)
		if err != nil {
			return status(err)
		}
		r := gatt.AppsResponse{Apps: []gatt.AppEntry{}}
		for _, a := range info.Apps {
			r.Apps = append(r.Apps, gatt.AppEntry{AppID: a.AppID, Version: a.Version})
		}
		return ok(r)

	case g == gatt.GroupApps && id == gatt.CmdAppsUninstall && write:
		var req gatt.UninstallRequest
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" || req.AppID == "" {
			return bad(fmt.Errorf("uninstall needs cid and app_id: %v", err))
		}
		return status(p.dev.UninstallApp(ctx, req.CmdID, req.AppID))

	case write && (g == gatt.GroupText && id == gatt.CmdTextUpload || g == gatt.GroupPush && id == gatt.CmdPushUpload ||
		g == gatt.GroupApps && id == gatt.CmdAppsInstall):
		var (
			req   gatt.UploadRequest
			shape uploadShape
		)
		if err := gatt.DecodeBody(m.Body, &req); err != nil || req.CmdID == "" {
			return bad(fmt.Errorf("upload needs cid, off and data: %v", err))
		}
		if err := gatt.DecodeBody(m.Body, &shape); err != nil || !shape.bytes() {
			return bad(errors.New("upload needs data, a byte string (empty in the first request)"))
		}
		return p.upload(ctx, g, req)
	}
	return failRC(gatt.RCNotSupported, fmt.Sprintf("op %d of group %d command %d", m.Op, g, id))
}

// The CBOR a stock handler's zcbor decoder of a key takes: an unsigned
// integer, a byte string, a text string, a bool.
const (
	zUint = iota
	zBytes
	zText
	zBool
)

// The keys the stock handlers decode, with zcbor_map_decode_bulk, and what
// each takes (os_mgmt_echo; img_mgmt_state_write, img_mgmt_upload;
// img_mgmt_erase; settings_mgmt_read, _write, _delete). os_mgmt_reset ignores what it
// fails to decode, and the other commands read no key.
var (
	echoKeys          = map[string]int{"d": zText}
	imageStateKeys    = map[string]int{"hash": zBytes, "confirm": zBool}
	imageUploadKeys   = map[string]int{"image": zUint, "data": zBytes, "len": zUint, "off": zUint, "sha": zBytes, "upgrade": zBool}
	imageEraseKeys    = map[string]int{"slot": zUint}
	settingsReadKeys  = map[string]int{"name": zText, "max_size": zUint}
	settingsWriteKeys = map[string]int{"name": zText, "val": zBytes}
	settingsNameKeys  = map[string]int{"name": zText}
)

// stockKeys are the keys the stock handler of group g, command id (a write
// or a read) decodes, or nil.
func stockKeys(g uint16, id uint8, write bool) map[string]int {
	switch {
	case g == gatt.GroupOS && id == gatt.CmdOSEcho:
		return echoKeys
	case g == gatt.GroupImage && id == gatt.CmdImageState && write:
		return imageStateKeys
	case g == gatt.GroupImage && id == gatt.CmdImageUpload && write:
		return imageUploadKeys
	case g == gatt.GroupImage && id == cmdImageErase && write:
		return imageEraseKeys
	case g == gatt.GroupSettings && id == gatt.CmdSettingsValue && write:
		return settingsWriteKeys
	case g == gatt.GroupSettings && id == gatt.CmdSettingsValue:
		return settingsReadKeys
	case g == gatt.GroupSettings && id == gatt.CmdSettingsDelete && write:
		return settingsNameKeys
	}
	return nil
}

// zcborRefuses reports whether zcbor_map_decode_bulk fails on body for a
// handler that decodes keys: a value of another type under a key it reads
// fails that key's decoder, and the handler answers MGMT_ERR_EINVAL, rc 3
// in either SMP version, having done nothing. Null is such a value, which
// the simulator's Go decoding took as the key's zero value: newtmgr's
// confirm {"hash": null, "confirm": true} confirmed the running image, a
// test with a null hash was answered "invalid hash", a chunk with null data
// the offset held (docs/reliability.md, bug 286). Keys the handler does
// not read are skipped, whatever they hold. A body that is not a map of
// text keys is left to the handler's own decoding, which refuses it.
func zcborRefuses(body []byte, keys map[string]int) bool {
	if keys == nil {
		return false
	}
	var fields map[string]cbor.RawMessage
	if err := gatt.DecodeBody(body, &fields); err != nil {
		return false
	}
	for k, want := range keys {
		raw, ok := fields[k]
		if !ok || len(raw) == 0 {
			continue
		}
		var fits bool
		switch want {
		case zUint:
			fits = raw[0]>>5 == 0
		case zBytes:
			fits = raw[0]>>5 == 2
		case zText:
			fits = raw[0]>>5 == 3
		case zBool:
			fits = raw[0] == 0xf4 || raw[0] == 0xf5
		}
		if !fits {
			return true
		}
	}
	return false
}

// uploadShape is the data of a project upload request as sent, checked as
// a firmware decoding it with zcbor does: a byte string, empty or not.
// Null or absent, zcbor's bstr decoder fails, and so does the request.
type uploadShape struct {
	Data cbor.RawMessage `cbor:"data"`
}

// bytes reports whether data is a byte string (CBOR major type 2).
func (u uploadShape) bytes() bool { return len(u.Data) > 0 && u.Data[0]>>5 == 2 }

// imageUploadRequest is img_mgmt's upload request, with the fields whose
// absence matters as pointers.
type imageUploadRequest struct {
	Image   *uint32 `cbor:"image"`
	Off     *uint64 `cbor:"off"`
	Len     *uint64 `cbor:"len"`
	Data    []byte  `cbor:"data"`
	SHA     []byte  `cbor:"sha"`
	Upgrade bool    `cbor:"upgrade"`
}

// imageUpload is img_mgmt_upload with img_mgmt_upload_inspect: the request
// at off 0 opens an upload (its data must begin with an MCUboot header, and
// len is required) or resumes the one of the same sha; a later one is
// written when its off is the one held, and answered with the offset held
// either way. The answer that completes the upload says whether the SHA-256
// of what was written is sha (match).
func (p *Peripheral) imageUpload(ctx context.Context, m gatt.Message) reply {
	const g = gatt.GroupImage
	var req imageUploadRequest
	if err := gatt.DecodeBody(m.Body, &req); err != nil {
		return failRC(gatt.RCInvalid, err.Error())
	}
	if req.Image != nil && *req.Image != 0 {
		return groupErr(g, 14, "one image only") // invalid slot
	}
	// img_mgmt_upload ends the upload in progress (img_mgmt_reset_upload)
	// when img_mgmt_upload_inspect refuses a request.
	refuse := func(grc int, rsn string) reply {
		p.setImageUpload(imageUpload{})
		return groupErr(g, grc, rsn)
	}
	if req.Off == nil {
		return refuse(gatt.ImgErrInvalidOffset, "off required")
	}
	p.mu.Lock()
	st := p.image
	p.mu.Unlock()
	off := *req.Off
	if off == 0 {
		if len(req.Data) < mcuboot.HeaderSize {
			return refuse(gatt.ImgErrInvalidImageHeader, "the first chunk must hold the image header")
		}
		if req.Len == nil {
			return refuse(gatt.ImgErrInvalidLength, "len required at off 0")
		}
		// img_mgmt looks at the magic and the version, nothing else of
		// the header.
		if _, err := mcuboot.ParseHeader(req.Data); err != nil {
			var fe *mcuboot.FormatError
			if errors.As(err, &fe) && fe.Field == "magic" {
				return refuse(gatt.ImgErrInvalidImageHeaderMagic, "magic mismatch")
			}
		}
		if len(req.SHA) > sha256.Size {
			return refuse(gatt.ImgErrInvalidHash, "sha longer than 32 bytes")
		}
		if len(req.SHA) > 0 && st.active && bytes.Equal(st.sha, req.SHA) {
			return ok(gatt.UploadResponse{Off: st.off}) // resume
		}
		if p.dev.secondaryInUse() {
			return refuse(gatt.ImgErrNoFreeSlot, "the secondary slot is pending or holds the image to revert to")
		}
		if *req.Len > uint64(p.opts.MaxUpload) {
			return refuse(gatt.ImgErrImageTooLarge, fmt.Sprintf("%d bytes; the slot has %d", *req.Len, p.opts.MaxUpload))
		}
		if req.Upgrade {
			// img_mgmt_vercmp: major, minor, revision; the build number
			// only with CONFIG_MCUMGR_GRP_IMG_VERSION_CMP_USE_BUILD_NUMBER
			// (off by default).
			cur, _ := mcuboot.ParseVersion(p.dev.Firmware())
			cur.Build = 0
			next := mcuboot.Version{Major: req.Data[20], Minor: req.Data[21], Revision: binary.LittleEndian.Uint16(req.Data[22:])}
			if cur.Compare(next) >= 0 {
				return refuse(gatt.ImgErrCurrentVersionIsNewer, "downgrade")
			}
		}
		if p.dev.secondaryUsed() && p.opts.EraseTime > 0 {
			// img_mgmt_erase_image_data: len, in 4 KiB sectors, before
			// the answer (docs/reliability.md, bug 259).
			d := time.Duration((*req.Len+4095)/4096) * p.opts.EraseTime
			start := time.Now()
			t := time.NewTimer(d)
			p.erasing.Store(true)
			select {
			case <-t.C:
				p.erasing.Store(false)
			case <-ctx.Done():
				// The link dropped: the erase, and the request, go on
				// to their end all the same (docs/reliability.md, bug 471).
				t.Stop()
				p.mu.Lock()
				p.busyUntil = start.Add(d)
				p.mu.Unlock()
				time.AfterFunc(time.Until(start.Add(d)), func() { p.erasing.Store(false) })
			}
		}
		p.dev.eraseSecondary()
		st = imageUpload{active: true, size: *req.Len, sha: bytes.Clone(req.SHA)}
	} else {
		if off != st.off || !st.active {
			return ok(gatt.UploadResponse{Off: st.off})
		}
		if off+uint64(len(req.Data)) > st.size {
			p.setImageUpload(imageUpload{})
			return groupErr(g, gatt.ImgErrDataOverrun, "data past len")
		}
	}
	if len(req.Data) > 0 {
		if st.off+uint64(len(req.Data)) > st.size {
			p.setImageUpload(imageUpload{})
			return groupErr(g, gatt.ImgErrDataOverrun, "data past len")
		}
		p.dev.writeSecondary(req.Data)
		st.off += uint64(len(req.Data))
		if st.off == st.size {
			p.setImageUpload(imageUpload{}) // done
			p.dev.uploadDone(p.opts.MaxUpload)
			match := len(st.sha) == sha256.Size && p.dev.secondaryMatches(st.sha)
			return ok(gatt.UploadResponse{Off: st.off, Match: &match})
		}
	}
	p.setImageUpload(st)
	return ok(gatt.UploadResponse{Off: st.off})
}

// cmdImageErase is img_mgmt's image erase (group 1, write), which the
// bridge does not use and MCUmgr's tools do ("image erase").
const cmdImageErase uint8 = 5

// imageErase is img_mgmt_erase: it erases slot ("slot", the other one by
// default) unless an image there is in use: the running one, the one to
// boot next, the one a test reverts to (error 9, no free slot); a slot
// that does not exist is error 14. An erase, or a failed one, ends the
// upload in progress (img_mgmt_reset_upload); a refusal for a slot in use
// does not. It answers an empty map. The simulator answered rc 8 before,
// as to a command it does not know (docs/reliability.md, bug 287).
func (p *Peripheral) imageErase(m gatt.Message) reply {
	const g = gatt.GroupImage
	var req struct {
		Slot *uint32 `cbor:"slot"`
	}
	if err := gatt.DecodeBody(m.Body, &req); err != nil {
		return failRC(gatt.RCInvalid, err.Error())
	}
	slot := uint32(1)
	if req.Slot != nil {
		slot = *req.Slot
	}
	switch {
	case slot == 0:
		return groupErr(g, gatt.ImgErrNoFreeSlot, "the running image")
	case slot > 1:
		p.setImageUpload(imageUpload{})
		return groupErr(g, 14, "no such slot") // invalid slot
	case p.dev.secondaryInUse():
		return groupErr(g, gatt.ImgErrNoFreeSlot, "the secondary slot is pending or holds the image to revert to")
	}
	p.dev.eraseSecondary()
	p.setImageUpload(imageUpload{})
	return ok(nil)
}

func (p *Peripheral) setImageUpload(st imageUpload) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.image = st
}

// imageStateWrite is img_mgmt_state_write: hash picks the slot (no hash
// with confirm: the running one), confirm makes it permanent, else it is
// tested at the next boot. It answers the new image state.
func (p *Peripheral) imageStateWrite(m gatt.Message) reply {
	const g = gatt.GroupImage
	var req gatt.ImageStateRequest
	if err := gatt.DecodeBody(m.Body, &req); err != nil {
		return failRC(gatt.RCInvalid, err.Error())
	}
	slot := 0
	switch {
	case len(req.Hash) == 0 && !req.Confirm:
		return groupErr(g, gatt.ImgErrInvalidHash, "a test needs a hash")
	case len(req.Hash) == 0:
	case len(req.Hash) != p.dev.hashSize():
		// IMAGE_SHA_LEN: 32 bytes, 64 in a SHA-512 build.
		return groupErr(g, gatt.ImgErrInvalidHash, "")
	default:
		if slot = p.dev.slotOfHash(req.Hash); slot < 0 {
			return groupErr(g, gatt.ImgErrHashNotFound, "")
		}
	}
	if grc := p.dev.setNextBoot(slot, req.Confirm); grc != 0 {
		return groupErr(g, grc, "")
	}
	return ok(zephyrImageState(p.dev.imageState()))
}

// imageSlotBody is one slot of the image state as img_mgmt_state_encode_slot
// writes it (single image: no "image"; CONFIG_MCUMGR_GRP_IMG_FRUGAL_LIST
// off, the default: every flag, false ones too), in its order.
type imageSlotBody struct {
	Slot      int    `cbor:"slot"`
	Version   string `cbor:"version"`
	Hash      []byte `cbor:"hash"`
	Bootable  bool   `cbor:"bootable"`
	Pending   bool   `cbor:"pending"`
	Confirmed bool   `cbor:"confirmed"`
	Active    bool   `cbor:"active"`
	Permanent bool   `cbor:"permanent"`
}

// imageStateBody is img_mgmt_state_read's answer: the slots, then
// splitStatus, always 0 (and present, the list not being frugal).
type imageStateBody struct {
	Images      []imageSlotBody `cbor:"images"`
	SplitStatus int             `cbor:"splitStatus"`
}

func zephyrImageState(slots []gatt.ImageSlot) imageStateBody {
	out := imageStateBody{Images: []imageSlotBody{}}
	for _, s := range slots {
		out.Images = append(out.Images, imageSlotBody{Slot: s.Slot, Version: s.Version, Hash: s.Hash, Bootable: s.Bootable,
			Pending: s.Pending, Confirmed: s.Confirmed, Active: s.Active, Permanent: s.Permanent})
	}
	return out
}

// scheduleReboot reboots the device ResetDelay after a reset's answer.
func (p *Peripheral) scheduleReboot() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.rebootTimer != nil {
		return
	}
	p.rebootWG.Add(1)
	p.rebootTimer = time.AfterFunc(p.opts.ResetDelay, p.reboot)
}

// reboot drops the link, reboots the device (MCUboot's swap, the saved
// settings) and takes connections again after BootTime.
func (p *Peripheral) reboot() {
	defer p.rebootWG.Done()
	p.mu.Lock()
	p.booting = true
	drop := p.drop
	p.image = imageUpload{}
	p.mu.Unlock()
	if drop != nil {
		drop()
	}
	p.dev.reboot()
	t := time.NewTimer(p.opts.BootTime)
	select {
	case <-t.C:
	case <-p.closing:
		t.Stop()
	}
	p.mu.Lock()
	p.booting, p.rebootTimer = false, nil
	p.mu.Unlock()
}

// upload takes one chunk of a project group's upload (see docs/gatt.md,
// "Chunked upload") and answers the offset held.
func (p *Peripheral) upload(ctx context.Context, group uint16, req gatt.UploadRequest) reply {
	p.mu.Lock()
	u := p.uploads[group]
	p.mu.Unlock()
	if req.Off == 0 && req.Len > 0 { // the first request of an upload
		switch {
		case len(req.SHA) != sha256.Size:
			return failRC(gatt.RCInvalid, "sha must be 32 bytes of SHA-256")
		case req.Len > uint64(p.opts.MaxUpload):
			return failRC(gatt.RCNoMemory, fmt.Sprintf("%d bytes is more than the %d this device takes", req.Len, p.opts.MaxUpload))
		case p.dev.Executions(req.CmdID) > 0: // done already: say so
			return ok(gatt.UploadResponse{Off: req.Len})
		}
		if u == nil || u.first.CmdID != req.CmdID || !bytes.Equal(u.first.SHA, req.SHA) || u.first.Len != req.Len {
			first := req
			first.Data = nil
			u = &upload{first: first}
			p.mu.Lock()
			p.uploads[group] = u
			p.mu.Unlock()
		}
		if len(u.data) > 0 || len(req.Data) == 0 {
			return ok(gatt.UploadResponse{Off: uint64(len(u.data))})
		}
	} else if u == nil || u.first.CmdID != req.CmdID {
		return failRC(gatt.RCBadState, "no upload of this command in progress: start at off 0 with len and sha")
	}
	held := uint64(len(u.data))
	if req.Off != held || len(req.Data) == 0 {
		return ok(gatt.UploadResponse{Off: held})
	}
	if held+uint64(len(req.Data)) > u.first.Len {
		return failRC(gatt.RCInvalid, fmt.Sprintf("data runs past len %d", u.first.Len))
	}
	u.data = append(u.data, req.Data...)
	if uint64(len(u.data)) < u.first.Len {
		return ok(gatt.UploadResponse{Off: uint64(len(u.data))})
	}

	// Complete: check the whole, then act on it.
	p.mu.Lock()
	delete(p.uploads, group)
	p.mu.Unlock()
	if sum := sha256.Sum256(u.data); !bytes.Equal(sum[:], u.first.SHA) {
		return failRC(gatt.RCCorrupt, "the SHA-256 of the data does not match sha")
	}
	var err error
	f := u.first
	switch group {
	case gatt.GroupText:
		var b gatt.TextBody
		if err := gatt.DecodeBody(u.data, &b); err != nil || b.Text == "" {
			return failRC(gatt.RCInvalid, fmt.Sprintf("the upload is not a text's body {title?, text}: %v", err))
		}
		err = p.dev.PushText(ctx, f.CmdID, b.Title, b.Text)
	case gatt.GroupPush:
		err = p.dev.PushImage(ctx, f.CmdID, f.ContentType, u.data)
	case gatt.GroupApps:
		err = p.dev.InstallApp(ctx, f.CmdID, f.AppID, f.Version, u.data)
	}
	if err != nil {
		return status(err)
	}
	return ok(gatt.UploadResponse{Off: f.Len})
}
