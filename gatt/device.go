package gatt

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/internal/retry"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

// Defaults of DeviceOptions.
const (
	DefaultConnectTimeout = 10 * time.Second
	DefaultMinBackoff     = 50 * time.Millisecond
	DefaultMaxBackoff     = 5 * time.Second
	DefaultProbeTimeout   = 2 * time.Second
	DefaultRebootTimeout  = 10 * time.Second
	// busyRetries is how often a request answered "busy" is repeated.
	busyRetries = 5
	// framingRetries is how often work whose responses lost their framing
	// (ErrFraming: a notification lost) is repeated over a new link; a
	// device that garbles an answer every time is not asked forever.
	framingRetries = 3
	// lostRetries is how often a request the device left unanswered
	// (ErrLost: it answered a later one) is asked again.
	lostRetries = 3
	// maxResets is how often the bridge resets a device that comes back
	// with the new image still pending (it did not reboot).
	maxResets = 3
	// maxOTASteps bounds the steps of an update (upload, test, reset,
	// confirm, each read back), against a device whose state does not
	// follow its answers.
	maxOTASteps = 16
)

// DeviceOptions configure a Device. The zero value of a field means its
// default.
type DeviceOptions struct {
	ID        string    // required: the device id, which the device reports as its serial number
	Connector Connector // required

	ConnectTimeout time.Duration // per attempt; default DefaultConnectTimeout
	RequestTimeout time.Duration // per SMP request; default DefaultRequestTimeout
	MinBackoff     time.Duration // first pause between connection attempts, ±50%; default DefaultMinBackoff
	MaxBackoff     time.Duration // longest pause, ±50%; default DefaultMaxBackoff
	// Window is the most requests in flight on the device, of every
	// caller together (an upload's chunks, a status read's requests); 0
	// means one less than the device's buf_count (MCUmgr parameters: its
	// buffers serve requests and responses alike, so one must stay free
	// for the answer), or 1 if it does not say; MaxWindow at most.
	Window int
	// ProbeTimeout bounds the wait for the answer to the reassembly probe
	// (Client.ProbeReassembly); default DefaultProbeTimeout.
	ProbeTimeout time.Duration
	// FragmentTimeout is the longest pause between two notifications of one
	// response (ClientOptions.FragmentTimeout); default
	// DefaultFragmentTimeout.
	FragmentTimeout time.Duration
	// QuietTimeout is how long a request waits with no notification on
	// the link before the client probes whether it was lost
	// (ClientOptions.QuietTimeout); default DefaultQuietTimeout.
	QuietTimeout time.Duration
	// RebootTimeout is how long the bridge waits, after an OS reset, for
	// the device to drop the link as it reboots; default
	// DefaultRebootTimeout.
	RebootTimeout time.Duration
	Logger        *slog.Logger
	// Observer, when set, is told of transfers and lost links, for the
	// bridge's metrics.
	Observer Observer
}

// Device is a device reached over GATT: a Zephyr device with stock MCUmgr
// and the project's groups (docs/gatt.md). It satisfies agent.Device: it
// connects on demand, learns on each connection whether the device
// reassembles requests, reconnects with backoff when the link drops,
// repeats a request the link lost (idempotent in the standard groups; the
// device drops a repeated command id in the project's) and resumes an
// upload from the offset the device holds. It is safe for concurrent use.
type Device struct {
	opts DeviceOptions
	log  *slog.Logger

	// connecting holds a token while a caller connects: one attempt at a
	// time. A channel rather than a mutex, so that a caller waiting for
	// another's connection (which may try for as long as a command's
	// context) gives up at its own deadline.
	connecting chan struct{}

	mu     sync.Mutex
	sess   *session
	closed bool
	stats  []TransferStats // of finished uploads, for tests and benchmarks
	// busyUntil is how long the device may still work on a request a
	// lost link left unanswered (an upload's slot erase:
	// Client.BusyUntil); the next connection's first request waits for
	// it (bug 471).
	busyUntil time.Time
	// swapUntil is how long the device may take to boot into an update
	// it was reset for (MCUboot's swap); Busy until it answers again
	// (bug 472).
	swapUntil time.Time
}

type session struct {
	client      *Client
	bufSize     int
	bufCount    int
	reassembles bool
}

// ErrClosed is returned by a closed Device.
var ErrClosed = errors.New("gatt: device closed")

// NewDevice checks the options; it does not connect.
func NewDevice(opts DeviceOptions) (*Device, error) {
	if !topics.ValidDeviceID(opts.ID) {
		return nil, fmt.Errorf("gatt: invalid device id %q", opts.ID)
	}
	if opts.Connector == nil {
		return nil, errors.New("gatt: no connector")
	}
	if opts.ConnectTimeout <= 0 {
		opts.ConnectTimeout = DefaultConnectTimeout
	}
	if opts.RequestTimeout <= 0 {
		opts.RequestTimeout = DefaultRequestTimeout
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = DefaultMinBackoff
	}
	if opts.MaxBackoff < opts.MinBackoff {
		opts.MaxBackoff = max(DefaultMaxBackoff, opts.MinBackoff)
	}
	if opts.ProbeTimeout <= 0 {
		opts.ProbeTimeout = DefaultProbeTimeout
	}
	if opts.RebootTimeout <= 0 {
		opts.RebootTimeout = DefaultRebootTimeout
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Observer == nil {
		opts.Observer = nopObserver{}
	}
	return &Device{opts: opts, log: opts.Logger.With("device_id", opts.ID), connecting: make(chan struct{}, 1)}, nil
}

// ID returns the device id.
func (d *Device) ID() string { return d.opts.ID }

// Close disconnects; later calls fail with ErrClosed.
func (d *Device) Close() error {
	d.mu.Lock()
	s := d.sess
	d.sess, d.closed = nil, true
	d.mu.Unlock()
	if s != nil {
		return s.client.Close()
	}
	return nil
}

// Release drops the device's link, when one is up and no request waits on
// it, and reports whether it did; the next request connects again. The
// bridge lets the link of a device it no longer serves go: a device that
// takes one central at a time is otherwise kept from its new bridge for as
// long as the link holds (docs/reliability.md, bug 486).
func (d *Device) Release() bool {
	d.mu.Lock()
	s := d.sess
	if d.closed || s == nil || !alive(s) || s.client.Working() {
		d.mu.Unlock()
		return false
	}
	d.sess = nil
	d.mu.Unlock()
	s.client.Close()
	return true
}

// TransferStats returns the costs of the uploads finished so far, oldest
// first.
func (d *Device) TransferStats() []TransferStats {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]TransferStats(nil), d.stats...)
}

// alive reports whether s still carries requests: its client has not
// given up (Client.Done) and its link is up. The link is asked too because
// the client learns of a drop on a goroutine of its own: in between, a
// session read as alive failed each request at once with ErrDisconnected,
// and retry went round again without a pause, dozens of times.
func alive(s *session) bool {
	select {
	case <-s.client.Done():
		return false
	case <-s.client.Link().Done():
		return false
	default:
		return true
	}
}

// session returns the live connection, connecting (with backoff between
// attempts) until ctx is done.
func (d *Device) session(ctx context.Context) (*session, error) {
	if s, err := d.current(); s != nil || err != nil {
		return s, err
	}
	select {
	case d.connecting <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("gatt: connect to %s: %w", d.opts.ID, ctx.Err())
	}
	defer func() { <-d.connecting }()
	bo := retry.Backoff(d.opts.MinBackoff, d.opts.MaxBackoff)
	// silent is how long the device, connected, left its first request of
	// each connection unanswered, in all; a device that stays wedged ends
	// the caller's wait at a request timeout, as on a live link, not at
	// ctx's end (docs/reliability.md, bug 197).
	var silent time.Duration
	for attempts := 1; ; attempts++ {
		if s, err := d.current(); s != nil || err != nil {
			return s, err
		}
		s, err := d.connect(ctx)
		if err == nil {
			d.mu.Lock()
			if d.closed {
				d.mu.Unlock()
				s.client.Close()
				return nil, ErrClosed
			}
			d.sess = s
			d.swapUntil = time.Time{} // booted, if it was rebooting
			d.mu.Unlock()
			return s, nil
		}
		if ctx.Err() != nil || errors.Is(err, ErrNotPaired) {
			// A device that requires pairing refuses every connection
			// alike: trying until ctx's end (a command's 10 minutes)
			// failed the command timeout, its cause only in a debug log
			// (docs/reliability.md, bug 390).
			return nil, fmt.Errorf("gatt: connect to %s: %w", d.opts.ID, err)
		}
		var se *silentError
		if errors.As(err, &se) {
			silent += se.waited
			if silent >= d.opts.RequestTimeout {
				return nil, fmt.Errorf("gatt: connect to %s: the device takes the link but has left its requests unanswered for %s over %d connections, and is presumed wedged (%v): %w",
					d.opts.ID, silent.Round(time.Millisecond), attempts, err, ErrTimeout)
			}
		}
		wait := bo.NextBackOff()
		d.log.Debug("connection attempt failed", "err", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("gatt: connect to %s: %w", d.opts.ID, err)
		case <-t.C:
		}
	}
}

func (d *Device) current() (*session, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, ErrClosed
	}
	s := d.sess
	if s != nil && alive(s) {
		d.mu.Unlock()
		return s, nil
	}
	d.sess = nil
	if s != nil {
		d.busyUntil = later(d.busyUntil, s.client.BusyUntil())
	}
	d.mu.Unlock()
	if s != nil {
		d.opts.Observer.LinkLost()
		s.client.Close() // the link is down already; release it
	}
	return nil, nil
}

// Busy reports whether the device is at work on requests it still has time
// to answer: its link up, and a request of any caller (an upload's first
// request while img_mgmt erases the slot, minutes for a large one) waiting
// within its deadline (Client.Working). A device out of reach, or being
// connected to, is not busy; one that stays silent past a deadline is
// timed out, and its link dropped, by the client. The bridge's reporter
// lets a status read that waits on a busy device go on past its own bound,
// where before the device read offline behind a long erase
// (docs/reliability.md, bug 468).
func (d *Device) Busy() bool {
	d.mu.Lock()
	s, closed := d.sess, d.closed
	d.mu.Unlock()
	if !closed && s != nil && alive(s) && s.client.Working() {
		return true
	}
	// Reconnecting while the device still erases for an update whose
	// link was lost (bug 471), bounded by that request's deadline; or
	// while it reboots into an update, MCUboot swapping the images (bug
	// 472), bounded by swapTime.
	d.mu.Lock()
	defer d.mu.Unlock()
	now := time.Now()
	return !d.closed && (now.Before(d.busyUntil) || now.Before(d.swapUntil))
}

// swapTime bounds MCUboot's swap of an image of n bytes at boot, before
// the new image runs: each sector of both slots erased and written again,
// about three sector erases a sector with its scratch or move, at
// eraseTime each.
func swapTime(n int) time.Duration {
	return time.Duration((n+eraseSector-1)/eraseSector) * 3 * eraseTime
}

// rebooting notes that the device was reset into an image of n bytes: it
// reads busy (Busy) until it is connected again, or for the reboot timeout
// and the swap's. A device reset for an update read offline to the
// reporter while MCUboot swapped the images, tens of seconds for a large
// image (docs/reliability.md, bug 472).
func (d *Device) rebooting(n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.swapUntil = time.Now().Add(d.opts.RebootTimeout + swapTime(n))
}

// connect makes one attempt: connect, subscribe, check the serial number,
// learn the device's buffers and whether it reassembles requests.
func (d *Device) connect(ctx context.Context) (*session, error) {
	cctx, cancel := context.WithTimeout(ctx, d.opts.ConnectTimeout)
	defer cancel()
	link, err := d.opts.Connector.Connect(cctx, d.opts.ID)
	if err != nil {
		return nil, err
	}
	c, err := NewClient(cctx, link, ClientOptions{RequestTimeout: d.opts.RequestTimeout, FragmentTimeout: d.opts.FragmentTimeout,
		QuietTimeout: d.opts.QuietTimeout, Logger: d.log})
	if err != nil {
		link.Close()
		return nil, err
	}
	serial, err := link.Read(cctx, SerialNumberUUID)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("read serial number: %w", err)
	}
	if string(serial) != d.opts.ID {
		c.Close()
		return nil, fmt.Errorf("the device reports serial number %q, not %q", serial, d.opts.ID)
	}
	asked := time.Now()
	p, err := d.params(ctx, cctx, c)
	if err == nil && cctx.Err() != nil && ctx.Err() == nil {
		// Answered after an erase longer than the attempt's time
		// (bug 471): the probes that follow get a time of their own.
		var cancelRest context.CancelFunc
		cctx, cancelRest = context.WithTimeout(ctx, d.opts.ConnectTimeout)
		defer cancelRest()
	}
	var e *Error
	switch {
	case errors.As(err, &e) && e.RC == RCNotSupported:
		// No CONFIG_MCUMGR_GRP_OS_MCUMGR_PARAMS: one write per request,
		// one request in flight.
		p = ParamsResponse{}
	case err != nil:
		up := ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded)
		select {
		case <-link.Done():
			up = false
		default:
		}
		c.Close()
		if up {
			return nil, &silentError{waited: time.Since(asked), err: err}
		}
		return nil, fmt.Errorf("MCUmgr parameters: %w", err)
	}
	s := &session{client: c, bufSize: p.BufSize, bufCount: p.BufCount}
	switch {
	case p.BufSize > 0 && p.BufSize < c.Frag():
		// A write longer than the device's buffer, which the MTU allows,
		// is dropped by Zephyr's smp_bt without a word ("SMP packet len
		// > net_buf len"): every request is bounded by the buffer. Before,
		// a device back with an MTU above its buffers (498 and the
		// default 384) lost every long request, and each upload failed
		// timeout (docs/reliability.md, bug 179).
		c.SetMaxRequest(p.BufSize)
	case p.BufSize > c.Frag():
		// Buffers longer than a write are a hint of reassembly, not a
		// proof: Zephyr's smp_bt joins writes only with
		// CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY, which nothing reports.
		ok, err := c.ProbeReassembly(cctx, d.opts.ProbeTimeout)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("reassembly probe: %w", err)
		}
		if ok {
			s.reassembles = true
			c.SetMaxRequest(p.BufSize)
		}
	case p.BufSize == 0 && c.Frag() < ZephyrBufSize:
		// No MCUmgr parameters (Zephyr's default): the device may still
		// reassemble, into buffers of Zephyr's default size unless its
		// firmware set another. Before, such a device got one write per
		// request, and at MTU 23 every command failed mtu_too_small
		// (docs/reliability.md, bug 445).
		ok, err := c.ProbeReassembly(cctx, d.opts.ProbeTimeout)
		size := 0
		if err == nil && ok {
			size, err = d.probeBuffers(cctx, c)
		}
		if smallest := ZephyrBufSizes[len(ZephyrBufSizes)-1]; err == nil && size == 0 && c.Frag() > smallest {
			// One write per request, and writes longer than the
			// shortest of Zephyr's usual buffers: one whole write,
			// unanswered, shows a shorter buffer, which also drops the
			// reassembly probe's first write. Before, every long request
			// went in a write it dropped (docs/reliability.md, bug 473).
			if ok, err = c.ProbeBuffer(cctx, c.Frag(), d.opts.ProbeTimeout); err == nil && !ok {
				c.SetMaxRequest(smallest)
			}
		}
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("reassembly probe: %w", err)
		}
		if size > 0 {
			s.reassembles = true
			c.SetMaxRequest(size)
		}
	case p.BufSize == 0 && c.Frag() > ZephyrBufSize:
		// No MCUmgr parameters and writes longer than Zephyr's default
		// buffer: smp_bt drops a write longer than its buffer without a
		// word, and the buffer is unknown. An echo of one whole write
		// finds out; without an answer, requests are bounded by Zephyr's
		// default, as bug 179 bounds them by a reported buf_size. Before,
		// such a device lost every long request, and every upload failed
		// (docs/reliability.md, bug 447).
		ok, err := c.ProbeBuffer(cctx, c.Frag(), d.opts.ProbeTimeout)
		size := c.Frag()
		if err == nil && !ok {
			size, err = d.probeBuffers(cctx, c)
			if size == 0 {
				// Nothing answered: the shortest of Zephyr's usual
				// buffers, which loses nothing a longer one takes.
				size = ZephyrBufSizes[len(ZephyrBufSizes)-1]
			}
		}
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("buffer probe: %w", err)
		}
		c.SetMaxRequest(size)
	}
	// The status reads of the bridge's reporter and a command's requests
	// may reach the device at once: together they keep no more in flight
	// than its buffers take.
	c.SetWindow(d.window(s))
	if d.opts.Window == 0 && s.bufCount <= 2 {
		// Its buffers unknown (no MCUmgr parameters, bug 413) or two (bug
		// 443), the window is one; the probe for a lost answer may go
		// beside it. With two buffers, the probe finds both free once the
		// lone request is answered (its answer lost), none while it runs
		// (dropped, changing nothing), and, while the request waits behind
		// another transport's, its answer's: the request is answered rc 2
		// in its own buffer, not run, and asked again (smp_on_err).
		c.AllowSpareProbe()
	}
	d.log.Debug("connected", "mtu", link.MTU(), "buf_size", s.bufSize, "buf_count", s.bufCount, "reassembles", s.reassembles, "window", d.window(s))
	return s, nil
}

// probeBuffers finds the SMP buffer of a device that does not report it (no
// MCUmgr parameters): the longest of ZephyrBufSizes longer than a write
// (one write carries the shorter ones) that the device answers an echo of
// (Client.ProbeBuffer), or 0 when it answers none. Zephyr's default of 384
// bytes alone was probed before: a firmware built with buffers of 256
// (CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE, to save RAM) that reassembles got
// one write per request, and every command failed mtu_too_small at MTU 23;
// at MTU 498 it got requests of 384 bytes, which it dropped whole, and every
// upload failed (docs/reliability.md, bug 470). A probe the device's
// buffers do not hold leaves nothing behind (its writes are dropped whole,
// and those after the first are all "r", a header claiming more than any
// buffer), and costs ProbeTimeout.
func (d *Device) probeBuffers(ctx context.Context, c *Client) (int, error) {
	for _, size := range ZephyrBufSizes {
		if size <= c.Frag() && c.Frag() < ZephyrBufSize {
			break // one write carries it: no reassembly to size
		}
		ok, err := c.ProbeBuffer(ctx, size, d.opts.ProbeTimeout)
		if err != nil || ok {
			return size, err
		}
	}
	return 0, nil
}

// params reads the MCUmgr parameters, the first request of a connection,
// within cctx; or, when a lost link left the device at work on a request
// (an upload's slot erase, which neither flash nor img_mgmt stops half
// way), within that request's deadline and a request timeout more: Zephyr's
// SMP work queue runs the new connection's requests after it. Before, the
// read waited the rest of the erase, and the device was presumed wedged
// after a request timeout: an update whose link was lost during a long
// erase failed timeout, though the device would have resumed it
// (docs/reliability.md, bug 471).
func (d *Device) params(ctx, cctx context.Context, c *Client) (ParamsResponse, error) {
	d.mu.Lock()
	wait := time.Until(d.busyUntil)
	d.mu.Unlock()
	if wait <= 0 {
		return c.Params(cctx)
	}
	pctx, cancel := context.WithTimeout(ctx, wait+d.opts.RequestTimeout)
	defer cancel()
	var p ParamsResponse
	call, err := c.Start(pctx, OpRead, GroupOS, CmdOSParams, nil)
	if err != nil {
		return p, err
	}
	call.extend(wait)
	err = call.Wait(pctx, &p)
	return p, err
}

// silentError is a connection attempt on which the device took the link
// but left the first request, its MCUmgr parameters, unanswered for
// waited, until the request or the attempt timed out: a wedged MCUmgr,
// whatever the link.
type silentError struct {
	waited time.Duration
	err    error
}

func (e *silentError) Error() string {
	return fmt.Sprintf("MCUmgr parameters: no answer in %s: %v", e.waited.Round(time.Millisecond), e.err)
}

func (e *silentError) Unwrap() error { return e.err }

// window is the most requests in flight on s, of all callers together.
func (d *Device) window(s *session) int {
	switch {
	case d.opts.Window > 0:
		return min(d.opts.Window, MaxWindow)
	case s.bufCount > 1:
		return min(s.bufCount-1, MaxWindow)
	}
	return 1
}

// retry runs fn over the live session, again over a new one whenever the
// link drops (up to framingRetries times when the client dropped it for a
// lost notification), again over the same one when the device left a
// request unanswered (ErrLost, up to lostRetries times), and again after a
// pause when the device is busy. Everything fn asks must bear repeating:
// a standard group's read or idempotent write, a project group's request
// with its cid, an upload (it resumes from the device's offset).
func (d *Device) retry(ctx context.Context, fn func(*session) error) error {
	return d.retryAdvancing(ctx, fn, nil)
}

// retryAdvancing is retry for work that advances as it goes, an upload:
// done, when set, says how far it got, and whenever it got further since
// the last failure, the counts of busy answers, lost answers and lost
// framings start again. They bound the failures of one step in a row:
// counted over a whole transfer, a few losses spread over an upload of
// thousands of requests, each recovered from, failed it part way
// (docs/reliability.md, bug 180).
func (d *Device) retryAdvancing(ctx context.Context, fn func(*session) error, done func() uint64) error {
	busy, framing, lost := 0, 0, 0
	busyWait := retry.Backoff(2*d.opts.MinBackoff, d.opts.MinBackoff<<busyRetries)
	var mark uint64
	if done != nil {
		mark = done()
	}
	for {
		s, err := d.session(ctx)
		if err != nil {
			return err
		}
		err = fn(s)
		if done != nil && done() > mark {
			mark = done()
			busy, framing, lost = 0, 0, 0
			busyWait.Reset()
		}
		var e *Error
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ErrFraming) && (framing == framingRetries || ctx.Err() != nil):
			return err
		case errors.Is(err, ErrFraming):
			// The client dropped the link; what was asked is asked again,
			// as after a drop.
			framing++
			d.log.Info("a response was lost part way; repeating over a new link", "err", err)
			continue
		case IsDisconnect(err) && ctx.Err() == nil:
			d.log.Debug("link lost; reconnecting", "err", err)
			continue
		case errors.Is(err, ErrLost) && lost < lostRetries && ctx.Err() == nil:
			// The link is fine and the device idle: what was asked is
			// asked again, as after a drop, without waiting out the
			// request timeout.
			lost++
			d.log.Info("the device left a request unanswered; asking again", "err", err)
			continue
		case errors.Is(err, ErrTimeout):
			// A device that does not answer is presumed wedged: drop the
			// link so that the next request starts on a fresh one.
			s.client.Close()
			return err
		case errors.As(err, &e) && e.Temporary() && busy < busyRetries:
			busy++
			if err := pauseBusy(ctx, s, e, busyWait); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// fitted runs a command's work, run, and once more over a new connection
// when a request of it did not fit one ATT write at the link's MTU on a
// device that does not reassemble (CodeMTUTooSmall). That request was not
// sent, and what ran before it bears repeating, as after a dropped link;
// the MTU is negotiated anew on each connection, and the client sizes its
// writes to the one its link had when it was made. Before, the command
// failed invalid_payload at once, as if its payload were wrong, and so did
// every one after it for as long as that link lasted (docs/reliability.md,
// bug 196).
func (d *Device) fitted(ctx context.Context, run func() error) error {
	err := run()
	if !tooSmallMTU(err) || ctx.Err() != nil {
		return err
	}
	d.log.Info("a request does not fit one write at the link's MTU, and the device does not reassemble; trying once more over a new connection", "err", err)
	if s, _ := d.current(); s != nil {
		s.client.Close() // the next session() connects anew
	}
	if err := run(); !tooSmallMTU(err) {
		return err
	}
	return fmt.Errorf("%w, and over a new connection too", err)
}

// tooSmallMTU reports whether err is the bridge's refusal of a request one
// write at the link's MTU does not hold (CodeMTUTooSmall).
func tooSmallMTU(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == CodeMTUTooSmall
}

// pauseBusy waits before a request the device answered e, busy or without
// a buffer for the answer (it did not run it), is asked again; for the
// latter, the link's window loses a place (Client.Narrow).
func pauseBusy(ctx context.Context, s *session, e *Error, bo interface{ NextBackOff() time.Duration }) error {
	if e.RC == RCNoMemory {
		s.client.Narrow()
	}
	t := time.NewTimer(bo.NextBackOff())
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (d *Device) do(ctx context.Context, op uint8, group uint16, id uint8, req, resp any) error {
	return d.retry(ctx, func(s *session) error { return s.client.Do(ctx, op, group, id, req, resp) })
}

// Info reads the model (Device Information) and the battery level, the
// running image's version (image state: the active slot) and the installed
// apps. The SMP requests go out first, as many as the device's window
// takes, and are answered while the characteristics are read; the rest
// follow.
func (d *Device) Info(ctx context.Context) (companion.DeviceInfo, error) {
	var info companion.DeviceInfo
	err := d.retry(ctx, func(s *session) error {
		var st ImageStateResponse
		var apps AppsResponse
		xs := []exchange{
			{op: OpRead, group: GroupImage, id: CmdImageState, resp: &st},
			{op: OpRead, group: GroupApps, id: CmdAppsList, resp: &apps},
		}
		first := min(len(xs), d.window(s))
		calls, err := d.start(ctx, s, xs[:first])
		if err != nil {
			return err
		}
		link := s.client.Link()
		model, err := link.Read(ctx, ModelNumberUUID)
		if err != nil {
			calls.abandon()
			return err
		}
		batt, err := link.Read(ctx, BatteryLevelUUID)
		if err != nil {
			calls.abandon()
			return err
		}
		if err := calls.wait(ctx); err != nil {
			return err
		}
		if err := d.pipeline(ctx, s, xs[first:]); err != nil {
			return err
		}
		battery := companion.BatteryUnknown
		if len(batt) == 1 && batt[0] <= 100 {
			battery = int(batt[0])
		} else {
			// A firmware's bug: the level is unknown, and only the level.
			// Refused whole, the device's status could never be read, and
			// it read offline with its firmware and apps of long ago
			// (docs/reliability.md, bug 147).
			d.log.Warn("the device's battery level is not one byte 0–100; reporting it unknown", "level", fmt.Sprintf("%x", batt))
		}
		fw, err := runningVersion(st)
		if err != nil {
			return err
		}
		info = companion.DeviceInfo{Model: string(model), FirmwareVersion: fw, Battery: battery, Apps: []companion.App{}}
		for _, a := range apps.Apps {
			info.Apps = append(info.Apps, companion.App{AppID: a.AppID, Version: a.Version})
		}
		sort.Slice(info.Apps, func(i, j int) bool { return info.Apps[i].AppID < info.Apps[j].AppID })
		return nil
	})
	return info, err
}

// exchange is one request of several sent together, and where its
// response goes.
type exchange struct {
	op    uint8
	group uint16
	id    uint8
	req   any
	resp  any
	call  *Call
	// own, when set, makes a refusal of this request its own: the device's
	// answer of an error, or the bridge's check that the request is longer
	// than the device takes, is kept in refused and the others go on. An
	// error the device may not give again (busy, no memory) still ends the
	// pipeline, to be repeated.
	own     bool
	refused error
}

// ownRefusal reports whether err refuses x alone (exchange.own).
func (x *exchange) ownRefusal(err error) bool {
	var e *Error
	if !x.own || !errors.As(err, &e) || e.Temporary() {
		return false
	}
	x.refused = err
	return true
}

// inFlight is a batch of exchanges whose requests have all gone out.
type inFlight []exchange

// start sends every request without waiting: they must fit the device's
// window (its SMP buffers but one).
func (d *Device) start(ctx context.Context, s *session, xs []exchange) (inFlight, error) {
	if len(xs) > d.window(s) {
		return nil, fmt.Errorf("gatt: %d requests at once, and the device takes %d", len(xs), d.window(s))
	}
	for i := range xs {
		c, err := s.client.Start(ctx, xs[i].op, xs[i].group, xs[i].id, xs[i].req)
		if err != nil {
			inFlight(xs[:i]).abandon()
			return nil, err
		}
		xs[i].call = c
	}
	return xs, nil
}

// wait waits for every response in order; after the first error the rest
// are abandoned.
func (f inFlight) wait(ctx context.Context) error {
	for i := range f {
		if err := f[i].call.Wait(ctx, f[i].resp); err != nil {
			f[i+1:].abandon()
			return err
		}
	}
	return nil
}

func (f inFlight) abandon() {
	for _, x := range f {
		if x.call != nil {
			x.call.Abandon()
		}
	}
}

// pipeline sends the requests with up to the device's window in flight
// and waits for every response, in order; the first error ends it, but a
// refusal of an exchange marked own (kept in its refused). The device
// handles its requests in the order they come, so a pipeline costs about
// one round trip per window rather than one per request.
func (d *Device) pipeline(ctx context.Context, s *session, xs []exchange) error {
	w := d.window(s)
	started := 0
	for i := range xs {
		xs[i].call, xs[i].refused = nil, nil
	}
	for i := range xs {
		for ; started < len(xs) && started < i+w; started++ {
			c, err := s.client.Start(ctx, xs[started].op, xs[started].group, xs[started].id, xs[started].req)
			if err != nil && !xs[started].ownRefusal(err) {
				inFlight(xs[i:started]).abandon()
				return err
			}
			xs[started].call = c
		}
		if xs[i].call == nil {
			continue // not sent: refused by the bridge's own check
		}
		if err := xs[i].call.Wait(ctx, xs[i].resp); err != nil && !xs[i].ownRefusal(err) {
			inFlight(xs[i+1 : started]).abandon()
			return err
		}
	}
	return nil
}

// runningVersion is the version of the active slot, as a semantic version.
func runningVersion(st ImageStateResponse) (string, error) {
	for _, sl := range st.Images {
		if sl.Active && sl.Image == 0 {
			v, err := mcuboot.ParseMCUmgrVersion(sl.Version)
			if err != nil {
				return "", fmt.Errorf("gatt: the image state's active version: %w", err)
			}
			return v.String(), nil
		}
	}
	return "", errors.New("gatt: the image state lists no active image")
}

// Settings reads the schema (group 67) and then every setting by name
// through settings_mgmt (group 3), the reads pipelined.
//
// A setting the device refuses to read (its key too long for
// settings_mgmt, not found, not readable), whose read is longer than the
// device takes, or whose value is not of its type, is left out, spec and
// value, and logged: the firmware declares its own schema, and one such
// setting failed the whole read, every setting of the device unreported
// (docs/reliability.md, bug 148). A write of it fails as of any setting
// the device does not declare.
func (d *Device) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	var values map[string]any
	var schema topics.Schema
	err := d.retry(ctx, func(s *session) error {
		var sr SchemaResponse
		if err := s.client.Do(ctx, OpRead, GroupSettingsSchema, CmdSchemaRead, nil, &sr); err != nil {
			return err
		}
		names := sortedKeys(sr.Schema)
		reads := make([]exchange, len(names))
		answers := make([]SettingReadResponse, len(names))
		for i, name := range names {
			reads[i] = exchange{op: OpRead, group: GroupSettings, id: CmdSettingsValue,
				req: SettingReadRequest{Name: SettingsPrefix + name}, resp: &answers[i], own: true}
		}
		if err := d.pipeline(ctx, s, reads); err != nil {
			return fmt.Errorf("read settings: %w", err)
		}
		vals := make(map[string]any, len(names))
		sch := make(topics.Schema, len(names))
		for i, name := range names {
			err := reads[i].refused
			if err == nil {
				var v any
				if v, err = DecodeSetting(sr.Schema[name], answers[i].Val); err == nil {
					vals[name], sch[name] = v, sr.Schema[name]
					continue
				}
			}
			d.log.Warn("a setting the device declares cannot be read; leaving it out", "setting", name, "err", err)
		}
		values, schema = vals, sch
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	return values, schema, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// EncodeSetting turns a setting's value into the bytes settings_mgmt
// carries as val, which the device's settings handler takes: an int as
// 4 bytes little endian (int32_t), a bool as one byte 0 or 1, text as its
// UTF-8 bytes. Whole numbers may come as float64 (from JSON) or int64.
func EncodeSetting(v any) ([]byte, error) { return EncodeSettingAs(v, 4) }

// EncodeSettingAs is EncodeSetting with an int of size bytes (1, 2, 4 or
// 8), little endian: the size the device gives the setting in, as its
// handler reads it back. An int64 is encoded exactly, past 2^53 too.
func EncodeSettingAs(v any, size int) ([]byte, error) {
	switch x := v.(type) {
	case bool:
		if x {
			return []byte{1}, nil
		}
		return []byte{0}, nil
	case string:
		return []byte(x), nil
	case float64:
		// -2^63 is a float64; 2^63 is the first one past int64.
		if x != math.Trunc(x) || x < math.MinInt64 || x >= math.MaxInt64 {
			return nil, fmt.Errorf("gatt: %v is not an integer of 64 bits", x)
		}
		return EncodeSettingAs(int64(x), size)
	case int:
		return EncodeSettingAs(int64(x), size)
	case int64:
		bits := 8 * size
		switch size {
		case 1, 2, 4, 8:
		default:
			return nil, fmt.Errorf("gatt: an int of %d bytes", size)
		}
		if bits < 64 && (x < -1<<(bits-1) || x >= 1<<(bits-1)) {
			return nil, fmt.Errorf("gatt: %d is not a %d-bit integer", x, bits)
		}
		return binary.LittleEndian.AppendUint64(nil, uint64(x))[:size], nil
	}
	return nil, fmt.Errorf("gatt: a setting cannot be %T", v)
}

// DecodeSetting reads the bytes of a setting of spec's type: an int of 1,
// 2, 4 or 8 bytes little endian, a bool of one byte, text as UTF-8 without
// the NULs that end it. A settings handler is C: one that gives a string
// with its terminator (strlen + 1) or its char array whole, zeros to the
// end, is common, and read as such a value was no value of its enum, its
// time zone no time zone, and a change to it stayed pending for good, the
// device never reporting the same text (docs/reliability.md, bug 576).
func DecodeSetting(spec topics.SettingSpec, b []byte) (any, error) {
	switch spec.Type {
	case topics.SettingInt:
		switch len(b) {
		case 1:
			return int64(int8(b[0])), nil
		case 2:
			return int64(int16(binary.LittleEndian.Uint16(b))), nil
		case 4:
			return int64(int32(binary.LittleEndian.Uint32(b))), nil
		case 8:
			return int64(binary.LittleEndian.Uint64(b)), nil
		}
		return nil, fmt.Errorf("gatt: an int of %d bytes", len(b))
	case topics.SettingBool:
		if len(b) != 1 || b[0] > 1 {
			return nil, fmt.Errorf("gatt: a bool of bytes %x", b)
		}
		return b[0] == 1, nil
	}
	text := strings.TrimRight(string(b), "\x00")
	if !utf8.ValidString(text) {
		return nil, errors.New("gatt: text that is not UTF-8")
	}
	return text, nil
}

// PushText shows a text (group 64).
//
// A text whose request is longer than the device takes in one (its SMP
// buffer, or one write when it does not reassemble) goes as a chunked
// upload instead (group 64, command 1; its data a TextBody): the API takes
// texts of 4096 bytes and titles of 128, and Zephyr's buffers
// are 384 bytes unless the firmware makes them larger.
func (d *Device) PushText(ctx context.Context, cmdID, title, text string) error {
	return d.fitted(ctx, func() error { return d.pushText(ctx, cmdID, title, text) })
}

// pushText is PushText, once.
func (d *Device) pushText(ctx context.Context, cmdID, title, text string) error {
	err := d.do(ctx, OpWrite, GroupText, CmdTextPush, TextRequest{CmdID: cmdID, Title: title, Text: text}, nil)
	if e := (*Error)(nil); !errors.As(err, &e) || e.RC != RCMsgSize {
		return err
	}
	// Too long for one request (the client's check, or the device's
	// EMSGSIZE): it did not run.
	body, err := EncodeBody(TextBody{Title: title, Text: text})
	if err != nil {
		return err
	}
	return d.upload(ctx, Upload{Group: GroupText, ID: CmdTextUpload, First: UploadRequest{CmdID: cmdID}, Data: body})
}

// PushImage uploads a picture to show (group 65).
func (d *Device) PushImage(ctx context.Context, cmdID, contentType string, data []byte) error {
	return d.fitted(ctx, func() error { return d.pushImage(ctx, cmdID, contentType, data) })
}

// pushImage is PushImage, once.
func (d *Device) pushImage(ctx context.Context, cmdID, contentType string, data []byte) error {
	return d.upload(ctx, Upload{Group: GroupPush, ID: CmdPushUpload,
		First: UploadRequest{CmdID: cmdID, ContentType: contentType}, Data: data})
}

// InstallApp uploads an app package, installing or updating it (group 66).
func (d *Device) InstallApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error {
	return d.fitted(ctx, func() error { return d.installApp(ctx, cmdID, appID, version, pkg) })
}

// installApp is InstallApp, once.
func (d *Device) installApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error {
	return d.upload(ctx, Upload{Group: GroupApps, ID: CmdAppsInstall,
		First: UploadRequest{CmdID: cmdID, AppID: appID, Version: version}, Data: pkg})
}

// UninstallApp removes an app (group 66); the device answers RCNotFound
// for one that is not installed.
func (d *Device) UninstallApp(ctx context.Context, cmdID, appID string) error {
	return d.fitted(ctx, func() error { return d.uninstallApp(ctx, cmdID, appID) })
}

// uninstallApp is UninstallApp, once.
func (d *Device) uninstallApp(ctx context.Context, cmdID, appID string) error {
	return d.do(ctx, OpWrite, GroupApps, CmdAppsUninstall, UninstallRequest{CmdID: cmdID, AppID: appID}, nil)
}

// UpdateSettings changes some settings through settings_mgmt: a write of
// each (sorted by name), then commit (the device's handlers apply them)
// and save (they persist). The stock group has no command id and no
// all-or-nothing write: each write is idempotent, so a repeat after a
// dropped link is harmless, and the agent checks every value against the
// device's schema before the first write. The values in use are read
// first, and put back when a write fails.
//
// An int goes in the size the device gives it in (1, 2, 4 or 8 bytes, as
// read), 4 bytes when that is not an int's: a handler of an int64_t
// refuses 4 bytes, and an 8-byte value past 2^53 goes exactly.
func (d *Device) UpdateSettings(ctx context.Context, cmdID string, values map[string]any) error {
	return d.fitted(ctx, func() error { return d.updateSettings(ctx, cmdID, values) })
}

// updateSettings is UpdateSettings, once.
func (d *Device) updateSettings(ctx context.Context, cmdID string, values map[string]any) error {
	names := sortedKeys(values)
	reads := make([]exchange, len(names))
	before := make([]SettingReadResponse, len(names))
	writes := make([]exchange, len(names))
	for i, name := range names {
		if _, err := EncodeSettingAs(values[name], 8); err != nil {
			return &Error{Group: GroupSettings, ID: CmdSettingsValue, RC: RCInvalid, Bridge: true, Reason: name + ": " + err.Error()}
		}
		reads[i] = exchange{op: OpRead, group: GroupSettings, id: CmdSettingsValue,
			req: SettingReadRequest{Name: SettingsPrefix + name}, resp: &before[i]}
	}
	// settings_mgmt hands each write to the handler's h_set at once, and
	// the writes are pipelined: when one is refused, the others of the
	// window are live already, and a live value is what the device
	// reports and what the next save persists. Skipping commit and save is
	// not enough, so the earlier values go back. (settings_mgmt's load
	// would not do: settings_load sets only the values the storage holds,
	// and one never saved stays as written.)
	if err := d.retry(ctx, func(s *session) error { return d.pipeline(ctx, s, reads) }); err != nil {
		return fmt.Errorf("read settings: %w", err)
	}
	for i, name := range names {
		size := len(before[i].Val)
		if size != 1 && size != 2 && size != 8 {
			size = 4
		}
		val, err := EncodeSettingAs(values[name], size)
		if err != nil {
			return &Error{Group: GroupSettings, ID: CmdSettingsValue, RC: RCInvalid, Bridge: true, Reason: name + ": " + err.Error()}
		}
		writes[i] = exchange{op: OpWrite, group: GroupSettings, id: CmdSettingsValue,
			req: SettingWriteRequest{Name: SettingsPrefix + name, Val: val}}
	}
	if err := d.retry(ctx, func(s *session) error { return d.pipeline(ctx, s, writes) }); err != nil {
		return d.putBackSettings(ctx, names, before, fmt.Errorf("write settings: %w", err))
	}
	if err := d.do(ctx, OpWrite, GroupSettings, CmdSettingsCommit, nil, nil); err != nil {
		return fmt.Errorf("commit settings: %w", err)
	}
	if err := d.do(ctx, OpWrite, GroupSettings, CmdSettingsSave, nil, nil); err != nil {
		return fmt.Errorf("save settings: %w", err)
	}
	return nil
}

// putBackSettings writes the values read before an update whose writes
// failed with err, every one of them: a write abandoned in flight may
// have been applied. It returns err, saying so if a value could not go
// back.
func (d *Device) putBackSettings(ctx context.Context, names []string, before []SettingReadResponse, err error) error {
	undo := make([]exchange, len(names))
	for i, name := range names {
		undo[i] = exchange{op: OpWrite, group: GroupSettings, id: CmdSettingsValue,
			req: SettingWriteRequest{Name: SettingsPrefix + name, Val: before[i].Val}}
	}
	if uerr := d.retry(ctx, func(s *session) error { return d.pipeline(ctx, s, undo) }); uerr != nil {
		return fmt.Errorf("%w (and putting the earlier values back failed: %v)", err, uerr)
	}
	return err
}

// UpdateFirmware installs an MCUboot image the way Zephyr's img_mgmt and
// MCUboot take one: upload it to the free slot (resumed from the device's
// offset after a drop; the device's match checked), mark it for test with
// its hash as the image state reports it (the value of its hash TLV,
// SHA-256 or SHA-512 as the device's MCUboot checks), reset the device
// (OS group), and
// once it runs the new image, confirm it. A device that comes back on its
// old image (MCUboot refused or reverted the new one) fails with
// CodeFirmwareReverted. Every step is decided by the image state read
// before it, so a command run again after a bridge restart takes up where
// the device is (cmdID is not needed on the device: the stock groups have
// none), but for an image the free slot holds and nothing marked yet: that
// one is uploaded again. An image padded to its slot (imgtool sign --pad)
// is uploaded without its padding: its trailer would ask MCUboot for a
// swap before the image is marked, for good with image_ok set.
func (d *Device) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	return d.fitted(ctx, func() error { return d.updateFirmware(ctx, cmdID, version, image, progress) })
}

// updateFirmware is UpdateFirmware, once.
func (d *Device) updateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	img, err := mcuboot.Parse(image)
	if err != nil {
		return &Error{Group: GroupImage, ID: CmdImageUpload, RC: RCInvalid, Bridge: true, Reason: "the firmware is not an MCUboot image: " + err.Error()}
	}
	if got := img.Header.Version.String(); got != version {
		return &Error{Group: GroupImage, ID: CmdImageUpload, RC: RCInvalid, Bridge: true, Reason: fmt.Sprintf("the image's header says version %s, not %s", got, version)}
	}
	report := func(pct int) {
		if progress != nil {
			progress(pct)
		}
	}
	resets, reverts, uploads := 0, 0, 0
	for step := 0; ; step++ {
		if step == maxOTASteps {
			return &Error{Group: GroupImage, ID: CmdImageState, RC: RCUnknown, Bridge: true, Reason: fmt.Sprintf("the image state did not move after %d steps", step)}
		}
		var st ImageStateResponse
		if err := d.do(ctx, OpRead, GroupImage, CmdImageState, nil, &st); err != nil {
			return fmt.Errorf("read the image state: %w", err)
		}
		held := slotWithHash(st, img.Hash)
		switch {
		case held != nil && held.Active && held.Confirmed:
			report(100)
			return nil
		case held != nil && held.Active:
			// It runs the image under test: MCUboot would revert it at
			// the next reset. Confirm it (no hash: the running image).
			report(98)
			if err := d.do(ctx, OpWrite, GroupImage, CmdImageState, ImageStateRequest{Confirm: true}, nil); err != nil {
				return fmt.Errorf("confirm the image: %w", err)
			}
		case resets > 0 && (held == nil || !held.Pending):
			running, _ := runningVersion(st)
			return &Error{Group: GroupImage, ID: CmdImageState, Code: CodeFirmwareReverted,
				Reason: fmt.Sprintf("after the reboot the device runs %s, not %s: MCUboot refused the new image or reverted it", running, version)}
		case held != nil && held.Pending:
			if resets == maxResets {
				return &Error{Group: GroupOS, ID: CmdOSReset, RC: RCUnknown, Bridge: true, Reason: fmt.Sprintf("the image is still pending after %d resets: the device does not reboot", resets)}
			}
			resets++
			report(95)
			if err := d.reset(ctx); err != nil {
				return err
			}
			d.rebooting(int(img.End))
		case held != nil && uploads > 0:
			// Only an image this command uploaded, the device's match
			// checked, is marked for test. The image state's hash is the
			// hash TLV img_mgmt reads from the slot without checking the
			// image: a slot that lists it may hold an upload that
			// ended with match false, or one cut short with the TLVs
			// written. Such an image falls to the default below, and the
			// upload at off 0 makes img_mgmt erase the slot.
			if err := d.do(ctx, OpWrite, GroupImage, CmdImageState, ImageStateRequest{Hash: img.Hash}, nil); err != nil {
				return fmt.Errorf("mark the image for test: %w", err)
			}
			report(92)
		case uploads > 0:
			// img_mgmt lists a slot by the one hash TLV its build reads
			// (IMAGE_TLV_SHA): SHA-256, or SHA-512 with
			// CONFIG_MCUBOOT_BOOTLOADER_USES_SHA512.
			return &Error{Group: GroupImage, ID: CmdImageState, RC: RCUnknown, Bridge: true,
				Reason: fmt.Sprintf("the device does not list the image it took; the image's hash is %s: does the device's MCUboot check that hash?", mcuboot.HashName(img.HashType))}
		case runsUnderTest(st):
			// It runs another image under test (an earlier update ended
			// between the reboot and the confirmation): the other slot
			// holds the confirmed image MCUboot reverts to, and img_mgmt
			// takes no upload into it ("no free slot") until then. A reset
			// reverts to it, as any reboot of the device would; the image
			// given up is one nobody confirmed (docs/reliability.md, bug
			// 227).
			if reverts == maxResets {
				return &Error{Group: GroupOS, ID: CmdOSReset, RC: RCUnknown, Bridge: true, Reason: fmt.Sprintf("the device still runs an image under test after %d resets: it does not reboot", reverts)}
			}
			reverts++
			if err := d.reset(ctx); err != nil {
				return err
			}
			d.rebooting(int(img.End)) // the swap back: of about this size
		default:
			uploads++
			u := Upload{Group: GroupImage, ID: CmdImageUpload, Stock: true, Data: image[:img.End],
				Progress: func(acked, total int) { report(acked * 90 / max(total, 1)) }}
			if err := d.upload(ctx, u); err != nil {
				return explainNoFreeSlot(err, st)
			}
		}
	}
}

// explainNoFreeSlot is err, an upload's, saying why when the device
// answered "no free slot" with another image pending in its other slot (an
// update that ended before its reboot): stock img_mgmt lets nothing erase
// that slot, upload into it or unmark it, and the bridge does not boot an
// image no one asked for now to clear it (docs/reliability.md, bug 228).
// A device answering in SMP version 1 (an MCUmgr before version 2) says it
// with an rc of its own: rc 5 (ENOENT) in Zephyr 3.0 to 3.2, rc 2 (ENOMEM)
// in the MCUmgr library of Zephyr 2.x, rc 6 (EBADSTATE) where img_mgmt
// translates version 2's error; it is explained the same when the image
// state shows the other slot pending, which no upload gets past (bug 411).
// Only image 0's slots count: the bridge's upload carries no "image", which
// img_mgmt takes as image 0, and looks for a free slot among that image's
// slots alone; a two-image device's image 1 (a network core's) pending did
// not stand in its way, and was named (bug 442).
func explainNoFreeSlot(err error, st ImageStateResponse) error {
	var e *Error
	if !errors.As(err, &e) || e.Bridge || e.Group != GroupImage {
		return err
	}
	switch {
	case e.GroupRC == ImgErrNoFreeSlot:
	case e.GroupRC == 0 && (e.RC == RCBadState || e.RC == RCNotFound || e.RC == RCNoMemory):
	default:
		return err
	}
	for _, sl := range st.Images {
		if !sl.Pending || sl.Active || sl.Image != 0 {
			continue
		}
		version := sl.Version
		if v, verr := mcuboot.ParseMCUmgrVersion(sl.Version); verr == nil {
			version = v.String()
		}
		return fmt.Errorf("%w: the other slot holds firmware %s, to boot at the next reset (an update that ended before "+
			"its reboot), and the device takes no other image before it has booted that one: update it to %s, or reboot it, first",
			err, version, version)
	}
	return err
}

// runsUnderTest reports whether the image state shows the running image
// not confirmed: MCUboot reverts it at the next reset. Image 0's, the one
// the bridge updates: on a two-image device, image 1 under test stands not
// in the way of image 0's upload, and resetting for it reverted another
// core's update and failed this one after three resets
// (docs/reliability.md, bug 446).
func runsUnderTest(st ImageStateResponse) bool {
	for _, s := range st.Images {
		if s.Active && !s.Confirmed && s.Image == 0 {
			return true
		}
	}
	return false
}

// slotWithHash is the slot of the image state holding the image with this
// hash, or nil.
func slotWithHash(st ImageStateResponse, hash []byte) *ImageSlot {
	for i := range st.Images {
		if string(st.Images[i].Hash) == string(hash) {
			return &st.Images[i]
		}
	}
	return nil
}

// reset asks the device to reboot (OS group) and waits until it drops the
// link: Zephyr answers first and reboots CONFIG_MCUMGR_GRP_OS_RESET_MS
// later, and what the bridge reads before that is the old image's. It is
// not repeated once the device may have run it; a reset answered busy or
// without a buffer for its answer was not run, and is asked again.
func (d *Device) reset(ctx context.Context) error {
	busyWait := retry.Backoff(2*d.opts.MinBackoff, d.opts.MinBackoff<<busyRetries)
	for busy := 0; ; busy++ {
		s, err := d.session(ctx)
		if err != nil {
			return err
		}
		err = s.client.Do(ctx, OpWrite, GroupOS, CmdOSReset, ResetRequest{}, nil)
		var e *Error
		if errors.As(err, &e) && e.Temporary() && busy < busyRetries {
			// Busy, or no buffer for the answer: the device did not run
			// it, so it is asked again, as retry asks any request. Before,
			// the update failed with its image uploaded and pending
			// (docs/reliability.md, bug 178).
			if err := pauseBusy(ctx, s, e, busyWait); err != nil {
				return err
			}
			continue
		}
		return d.awaitReboot(ctx, s, err)
	}
}

// awaitReboot takes err, the answer to a reset over s, and waits for the
// device to drop the link as it reboots.
func (d *Device) awaitReboot(ctx context.Context, s *session, err error) error {
	switch {
	case err == nil, IsDisconnect(err):
	case errors.Is(err, ErrLost):
		// The device answered the client's probe and not the reset: the
		// reset or its answer was lost, and the device may be about to
		// reboot. It is not sent again here: wait for the reboot as after
		// an answer, and the image state read next tells whether it
		// happened (a pending image is reset again).
		d.log.Info("the reset went unanswered; waiting for the reboot", "err", err)
	case errors.Is(err, ErrTimeout):
		// Not repeated (it may have run), so drop the link here as retry
		// does: the device is presumed wedged, and the next command
		// starts on a fresh link.
		s.client.Close()
		return fmt.Errorf("reset: %w", err)
	default:
		return fmt.Errorf("reset: %w", err)
	}
	t := time.NewTimer(d.opts.RebootTimeout)
	defer t.Stop()
	select {
	case <-s.client.Done():
		d.log.Debug("the device rebooted")
	case <-t.C:
		// It did not go away: the next read goes over a new link, and
		// finds the image still pending if it never rebooted.
		s.client.Close()
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// upload runs a chunked transfer to the end, across reconnects: after a
// dropped link the request at off 0 resumes it from the offset the device
// holds. When the link dropped with the last answer, img_mgmt has closed
// the upload and that request starts it again: the image state could not
// tell whether the slot's bytes matched (it lists the hash of any image
// whose TLVs are written), and only the last answer's match does.
func (d *Device) upload(ctx context.Context, u Upload) error {
	if len(u.Data) == 0 {
		return &Error{Group: u.Group, ID: u.ID, RC: RCInvalid, Bridge: true, Reason: "nothing to upload"}
	}
	t := NewTransfer(u)
	start := time.Now()
	err := d.retryAdvancing(ctx, func(s *session) error { return t.Run(ctx, s.client, d.window(s)) }, t.acked)
	st := t.Stats()
	d.opts.Observer.Transfer(groupName(u.Group), st.DataBytesSent, time.Since(start), err != nil)
	d.mu.Lock()
	d.stats = append(d.stats, st)
	if len(d.stats) > 64 {
		d.stats = d.stats[len(d.stats)-64:]
	}
	d.mu.Unlock()
	if err != nil {
		return fmt.Errorf("upload (%d bytes, %s): %w", len(u.Data), strings.ToLower(groupName(u.Group)), err)
	}
	d.log.Debug("upload done", "group", u.Group, "bytes", len(u.Data), "attempts", st.Attempts, "sent", st.DataBytesSent)
	return nil
}

func groupName(g uint16) string {
	switch g {
	case GroupImage:
		return "firmware"
	case GroupText:
		return "text"
	case GroupPush:
		return "image"
	case GroupApps:
		return "app"
	}
	return fmt.Sprintf("group %d", g)
}
