package gatt

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of ClientOptions.
const (
	DefaultRequestTimeout = 30 * time.Second
	// DefaultFragmentTimeout bounds the pause between two notifications of
	// one response. A device sends a response's notifications back to
	// back (Zephyr's smp_bt notifies them in one loop), so on a live link
	// the next comes within a few connection intervals.
	DefaultFragmentTimeout = 2 * time.Second
	// DefaultQuietTimeout is how long the link may stay quiet (no
	// notification) while a request waits before the client asks the
	// device a cheap read to learn whether the request was lost.
	DefaultQuietTimeout = 2 * time.Second
	DefaultMaxResponse  = 16 << 10
)

// ErrTimeout is returned when a response does not come within the request
// timeout. It wraps context.DeadlineExceeded, so the agent reports the
// command as timed out.
var ErrTimeout = fmt.Errorf("gatt: no response within the request timeout: %w", context.DeadlineExceeded)

// ErrFraming is returned for the requests in flight when the stream of
// responses lost its framing, as a lost notification makes it: a response
// stopped part way (its first notifications came, and no more within the
// fragment timeout), or one did not decode or claimed more than the client
// takes (a lost fragment joined it to the next response). Nothing on that
// link can be read reliably any more, so the client drops it. It wraps
// ErrDisconnected: a Device repeats the work over a new link, as after a
// drop, rather than wait out the request timeout.
var ErrFraming = fmt.Errorf("gatt: the responses lost their framing (a notification lost): %w", ErrDisconnected)

// ErrLost is returned for a request the device will never answer: it
// answered a request sent after it on the same link, and a device answers
// its requests one at a time in the order they came (Zephyr's smp_bt and
// smp.c do). The request, or its whole answer, was lost on the way; the
// device may have acted on it. The link is fine. It wraps ErrTimeout: a
// caller that does not ask again reports it as a request the device did
// not answer, without waiting out the request timeout.
var ErrLost = fmt.Errorf("gatt: the device answered a later request and not this one (the request or its answer was lost): %w", ErrTimeout)

// ClientOptions configure a Client. The zero value of a field means its
// default.
type ClientOptions struct {
	RequestTimeout time.Duration // default DefaultRequestTimeout
	// FragmentTimeout is the longest pause, once part of a response came,
	// before the next notification; default DefaultFragmentTimeout.
	FragmentTimeout time.Duration
	// QuietTimeout is how long a request waits with no notification on
	// the link before the client sends a probe (MCUmgr parameters, a
	// read): its answer, coming before the request's, shows the request
	// lost (ErrLost). Default DefaultQuietTimeout.
	QuietTimeout time.Duration
	MaxResponse  int // largest response accepted, header included; default DefaultMaxResponse
	Logger       *slog.Logger
}

// Client is the bridge's SMP client over one Link: it frames requests
// (SMP version 2; a device answering version 1 is understood too), writes
// them, reassembles notified responses and matches them to requests by
// sequence number. A request goes out in one write of at most MTU-3 bytes
// unless SetMaxRequest allows longer ones (a device that reassembles):
// those are split into consecutive writes. SetWindow bounds the requests
// in flight across all callers. When the link goes down every pending
// request fails with ErrDisconnected; when a response stops part way or the
// responses otherwise lose their framing (a notification lost), with
// ErrFraming, and the client drops the link. A request the device answered
// a later one before fails with ErrLost at once; when the link stays quiet
// with a request waiting, the client sends a probe to find out (see
// QuietTimeout). It is safe for concurrent use.
type Client struct {
	link     Link
	frag     int
	timeout  time.Duration
	fragWait time.Duration // FragmentTimeout
	quietFor time.Duration // QuietTimeout
	log      *slog.Logger
	maxReq   atomic.Int64 // the longest request message sent

	wmu sync.Mutex // the writes of one message go out together

	// slots holds a token for each request in flight (nil: no bound). A
	// request keeps its token until the device has answered it, it timed
	// out, or the link is down: the device holds a buffer for it until
	// then, even when the caller has stopped waiting.
	slots chan struct{}
	// keep is how many tokens given back are kept instead (Narrow), and
	// narrowed how many places the window lost; guarded by mu.
	keep     atomic.Int64
	narrowed int
	// spare lets the quiet probe go beside a full window of one
	// (AllowSpareProbe).
	spare atomic.Bool
	dead  chan struct{} // closed when the client fails

	// cut fires fragWait after a notification that left a response
	// unfinished; broken asks the client's goroutine to drop the link.
	cut    *time.Timer
	broken chan struct{}
	// quiet fires when a request may have waited quietFor without a
	// notification; the client's goroutine then probes (quietCheck).
	quiet *time.Timer

	mu      sync.Mutex
	seq     uint8
	pending map[uint8]*Call
	reasm   *Reassembler
	fragAt  time.Time // when the last notification that left a response unfinished came
	err     error     // once set, the client is dead
	sent    uint64    // requests written so far: a Call's n is its place in that order
	heard   time.Time // when the last notification came, or the last probe went out
	probe   *Call     // the last probe sent
	quietOn bool      // quiet is armed
	// long is the last request given more than the request timeout
	// (Call.extend): a request sent behind it while it waits is answered
	// after it, and gets its deadline and a request timeout more.
	long *Call
	// busyUntil is long's deadline when the client failed with it
	// unanswered (BusyUntil).
	busyUntil time.Time

	stop chan struct{}
	wg   sync.WaitGroup
}

type result struct {
	msg Message
	err error
}

// NewClient subscribes to the SMP characteristic of link and returns a
// client. The client owns the link from then on: Close closes it.
func NewClient(ctx context.Context, link Link, opts ClientOptions) (*Client, error) {
	if opts.RequestTimeout <= 0 {
		opts.RequestTimeout = DefaultRequestTimeout
	}
	if opts.FragmentTimeout <= 0 {
		opts.FragmentTimeout = DefaultFragmentTimeout
	}
	if opts.QuietTimeout <= 0 {
		opts.QuietTimeout = DefaultQuietTimeout
	}
	if opts.MaxResponse <= 0 {
		opts.MaxResponse = DefaultMaxResponse
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if link.MTU() < DefaultMTU {
		return nil, fmt.Errorf("gatt: MTU %d is below the minimum %d", link.MTU(), DefaultMTU)
	}
	c := &Client{
		link:     link,
		frag:     link.MTU() - 3,
		timeout:  opts.RequestTimeout,
		fragWait: opts.FragmentTimeout,
		quietFor: opts.QuietTimeout,
		log:      opts.Logger,
		pending:  map[uint8]*Call{},
		reasm:    NewReassembler(opts.MaxResponse),
		stop:     make(chan struct{}),
		dead:     make(chan struct{}),
		cut:      time.NewTimer(opts.FragmentTimeout),
		quiet:    time.NewTimer(opts.QuietTimeout),
		broken:   make(chan struct{}, 1),
	}
	c.cut.Stop()
	c.quiet.Stop()
	c.maxReq.Store(int64(c.frag))
	if err := link.Subscribe(ctx, SMPCharUUID, c.onNotify); err != nil {
		return nil, fmt.Errorf("gatt: subscribe to SMP: %w", err)
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for {
			select {
			case <-link.Done():
				c.fail(ErrDisconnected)
				return
			case <-c.stop:
				return
			case <-c.cut.C:
				if !c.stalled() {
					continue
				}
				c.log.Warn("a response stopped part way: a notification was lost; dropping the link")
				c.fail(ErrFraming)
				link.Close()
				return
			case <-c.broken:
				// Here rather than where the framing broke: a link's Close
				// may wait for the notification being delivered.
				link.Close()
				return
			case <-c.quiet.C:
				if c.quietCheck() {
					c.sendProbe()
				}
			}
		}
	}()
	return c, nil
}

// MTU is the link's ATT MTU.
func (c *Client) MTU() int { return c.link.MTU() }

// Frag is the most bytes one write carries: MTU-3.
func (c *Client) Frag() int { return c.frag }

// MaxRequest is the longest request message, header included, the client
// sends: one write unless SetMaxRequest said otherwise.
func (c *Client) MaxRequest() int { return int(c.maxReq.Load()) }

// SetMaxRequest lets requests of up to n bytes go out, split across
// writes: for a device that reassembles them into buffers of n bytes.
func (c *Client) SetMaxRequest(n int) { c.maxReq.Store(int64(min(max(n, HeaderSize+1), MaxMessage))) }

// SetWindow bounds the requests in flight, of all callers together, to n
// (n < 1: no bound): a stock device loses a request that finds its SMP
// buffers taken, and every caller on the link shares them. Start waits for
// a free place. Call it before the client carries requests.
func (c *Client) SetWindow(n int) {
	if n < 1 {
		c.slots = nil
		return
	}
	c.slots = make(chan struct{}, min(n, MaxWindow))
}

// AllowSpareProbe lets the quiet probe (QuietTimeout) go out beside a lone
// request when the window is one, for a device that did not report its
// SMP buffers (no MCUmgr parameters, Zephyr's default: its buffers are then
// CONFIG_MCUMGR_TRANSPORT_NETBUF_COUNT's default 4, unless the firmware
// says otherwise), or reported two. Without it a lone request whose answer
// was lost whole waited its whole timeout, and its command failed timeout
// (docs/reliability.md, bugs 413 and 443). On a device with only two buffers the
// probe finds none while the request runs, and is dropped unanswered,
// which changes nothing; sent while the request still waits behind
// another transport's, it may take the buffer of the request's answer, and
// the request is answered rc 2 and asked again after a pause.
func (c *Client) AllowSpareProbe() { c.spare.Store(true) }

// MaxWindow is the most requests a client keeps in flight: the header's
// sequence numbers tell 256 apart. A device may report more buffers
// (buf_count); a window of them all had every request past the 256th
// refused ("256 requests in flight"), and with it any upload of more
// chunks (docs/reliability.md, bug 145).
const MaxWindow = 255

// Narrow makes the window one place smaller, down to one, for the rest of
// the link: the device answered a request rc 2 (MGMT_ERR_ENOMEM, no buffer
// for its answer), so fewer of its buffers are free than its parameters
// said (another transport of its MCUmgr, UART or a second central, draws
// on the same pool).
func (c *Client) Narrow() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.slots == nil || cap(c.slots)-c.narrowed <= 1 {
		return
	}
	c.narrowed++
	select {
	case c.slots <- struct{}{}: // a free place, taken for good
	default:
		c.keep.Add(1) // the next place given back is kept instead
	}
	c.log.Info("the device ran out of SMP buffers; fewer requests in flight", "window", cap(c.slots)-c.narrowed)
}

// giveBack gives a token back to the window, or keeps it (Narrow).
func (c *Client) giveBack() {
	for {
		k := c.keep.Load()
		if k == 0 {
			<-c.slots
			return
		}
		if c.keep.CompareAndSwap(k, k-1) {
			return
		}
	}
}

// Link returns the link the client speaks over.
func (c *Client) Link() Link { return c.link }

// Done is closed when the client carries no more requests: the link is
// down, or the client gave it up (ErrFraming) and is dropping it.
func (c *Client) Done() <-chan struct{} { return c.dead }

// Close fails pending requests, disconnects and waits for the client's
// goroutine.
func (c *Client) Close() error {
	c.fail(ErrDisconnected)
	c.cut.Stop()
	c.quiet.Stop()
	err := c.link.Close()
	c.mu.Lock()
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	c.mu.Unlock()
	c.wg.Wait()
	return err
}

// fail ends every pending request with err; later requests fail at once.
func (c *Client) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failLocked(err)
}

func (c *Client) failLocked(err error) {
	if c.err == nil {
		c.err = err
		close(c.dead)
	}
	if l := c.long; l != nil && c.pending[l.seq] == l {
		c.busyUntil = later(c.busyUntil, l.deadline)
	}
	for seq, call := range c.pending {
		delete(c.pending, seq)
		call.release()
		if !call.abandoned {
			call.ch <- result{err: c.err}
		}
	}
	c.reasm.Reset()
}

// brokeLocked fails every request with ErrFraming and has the link
// dropped.
func (c *Client) brokeLocked() {
	c.failLocked(ErrFraming)
	select {
	case c.broken <- struct{}{}:
	default:
	}
}

// stalled reports whether a response has stopped part way: the last
// notification left it unfinished, and none came for the fragment timeout.
func (c *Client) stalled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reasm.Pending() > 0 && time.Since(c.fragAt) >= c.fragWait
}

// onNotify runs on the link's notification goroutine; it never blocks.
func (c *Client) onNotify(frag []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.heard = time.Now()
	msgs, err := c.reasm.Feed(frag)
	if err != nil {
		c.log.Warn("dropping a malformed response stream", "err", err)
		c.brokeLocked()
		return
	}
	if c.reasm.Pending() > 0 {
		// The rest of this response comes at once on a live link; if it
		// does not, a notification was lost and the response can never be
		// completed: the request's whole timeout need not be waited out.
		c.fragAt = time.Now()
		c.cut.Reset(c.fragWait)
	}
	for _, m := range msgs {
		call := c.pending[m.Seq]
		if call == nil || m.Op != call.op+1 || m.Group != call.group || m.ID != call.id {
			c.log.Debug("unmatched SMP response", "seq", m.Seq, "group", m.Group, "id", m.ID)
			continue
		}
		delete(c.pending, m.Seq)
		call.release()
		if !call.abandoned {
			call.ch <- result{msg: m}
		}
		c.lostBeforeLocked(call)
	}
}

// lostBeforeLocked fails every request sent before answered that is still
// waiting: the device answers in order, so none of them will be answered.
// Each gives back its place in the window at once (the device holds no
// buffer for it any more).
func (c *Client) lostBeforeLocked(answered *Call) {
	for seq, call := range c.pending {
		if call.n > answered.n {
			continue
		}
		delete(c.pending, seq)
		call.release()
		if !call.abandoned {
			call.ch <- result{err: ErrLost}
		}
	}
}

// quietCheck reports whether to send a probe: a request someone waits for
// has had no notification on the link for quietFor (since it went out, the
// last notification, or the last probe), and no probe is on its way. It
// arms the timer again while requests wait.
func (c *Client) quietCheck() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.quietOn = false
	if c.err != nil {
		return false
	}
	var oldest time.Time
	for _, call := range c.pending {
		if call.abandoned || call.probe || call.at.IsZero() {
			continue
		}
		if oldest.IsZero() || call.at.Before(oldest) {
			oldest = call.at
		}
	}
	if oldest.IsZero() {
		return false // nobody waits; write arms the timer again
	}
	since := oldest
	if c.heard.After(since) {
		since = c.heard
	}
	probing := c.probe != nil && c.pending[c.probe.seq] == c.probe
	left := c.quietFor - time.Since(since)
	if left > 0 || probing {
		c.armQuietLocked(max(left, c.quietFor/4))
		return false
	}
	c.heard = time.Now() // the probe's own quiet time starts now
	c.armQuietLocked(c.quietFor)
	return true
}

func (c *Client) armQuietLocked(d time.Duration) {
	if !c.quietOn {
		c.quietOn = true
		c.quiet.Reset(d)
	}
}

// sendProbe sends a read of the MCUmgr parameters if the window has room
// for it (it must not take a buffer the device needs for an answer).
// Nobody waits for its answer: coming before a request's, it shows that
// request lost (onNotify). It runs on the client's goroutine.
func (c *Client) sendProbe() {
	call := &Call{c: c, op: OpRead, group: GroupOS, id: CmdOSParams, ch: make(chan result, 1), probe: true}
	if c.slots != nil {
		select {
		case c.slots <- struct{}{}:
			call.slot = true
		default:
			if !c.spare.Load() || cap(c.slots) != 1 {
				return // the window is full: the request timeout stays the bound
			}
			// Beside the lone request, outside the window (AllowSpareProbe).
		}
	}
	body, _ := EncodeBody(struct{}{})
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	if err := c.write(ctx, call, body); err != nil {
		c.log.Debug("probe not sent", "err", err)
		return
	}
	c.log.Debug("the link is quiet with a request waiting; probing", "seq", call.seq)
	// Abandoned, but kept pending (whatever the window) until answered or
	// the request timeout: only an answer matched to it tells anything.
	c.mu.Lock()
	call.abandoned = true
	call.timer.Stop()
	c.probe = call
	c.mu.Unlock()
	time.AfterFunc(c.timeout, call.forget)
}

// Call is a request on its way; Wait for its response.
type Call struct {
	c     *Client
	op    uint8
	group uint16
	id    uint8
	seq   uint8
	ch    chan result // buffered: one result
	timer *time.Timer // runs expire at the request timeout

	slot      bool      // holds a token of c.slots
	freed     sync.Once // gives the token back
	abandoned bool      // guarded by c.mu: nobody waits for the answer
	probe     bool      // sent by the client itself (sendProbe)
	n         uint64    // guarded by c.mu: its place in the order requests went out
	at        time.Time // guarded by c.mu: when it had gone out whole
	deadline  time.Time // guarded by c.mu: when it expires, once it went out
	version   uint8     // the SMP version of the answer, once Wait has it
}

// release gives back the call's place in the window, once.
func (call *Call) release() {
	if call.slot {
		call.freed.Do(call.c.giveBack)
	}
}

// Start sends a request (op OpRead or OpWrite) and returns without waiting
// for the response, so that several can be in flight.
func (c *Client) Start(ctx context.Context, op uint8, group uint16, id uint8, req any) (*Call, error) {
	if req == nil {
		req = struct{}{}
	}
	body, err := EncodeBody(req)
	if err != nil {
		return nil, err
	}
	if n := HeaderSize + len(body); n > c.MaxRequest() {
		return nil, tooLong(group, id, c.frag, c.MaxRequest(),
			fmt.Sprintf("not sent: the request of %d bytes is longer than the %d the device takes (%s)", n, c.MaxRequest(), requestLimit(c.frag, c.MaxRequest())))
	}
	return c.send(ctx, op, group, id, body)
}

// requestLimit says what bounds requests to maxReq bytes on a link whose
// writes carry frag bytes, for the bridge's size checks.
func requestLimit(frag, maxReq int) string {
	if maxReq != frag {
		return fmt.Sprintf("its SMP buffer, buf_size %d", maxReq)
	}
	return fmt.Sprintf("one ATT write at MTU %d; the bridge found no reassembly", frag+3)
}

// tooLong is the bridge's own refusal of a request of group and id longer
// than the device takes, maxReq bytes on a link whose writes carry frag.
// When one write bounds it (the device does not reassemble), it is the
// link's MTU that refuses it, and another connection may negotiate a
// larger one: its code is CodeMTUTooSmall, and Device.fitted tries the
// command once more over a new connection. A device's SMP buffer that
// bounds it is the same on every connection: invalid_payload, as the
// device's own rc 7.
func tooLong(group uint16, id uint8, frag, maxReq int, reason string) *Error {
	e := &Error{Group: group, ID: id, RC: RCMsgSize, Bridge: true, Reason: reason}
	if maxReq == frag {
		e.Code = CodeMTUTooSmall
	}
	return e
}

// send writes a framed request of any length, split into writes.
func (c *Client) send(ctx context.Context, op uint8, group uint16, id uint8, body []byte) (*Call, error) {
	call := &Call{c: c, op: op, group: group, id: id, ch: make(chan result, 1)}
	if c.slots != nil {
		select {
		case c.slots <- struct{}{}:
			call.slot = true
		case <-c.dead:
			c.mu.Lock()
			err := c.err
			c.mu.Unlock()
			return nil, err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}

	if err := c.write(ctx, call, body); err != nil {
		return nil, err
	}
	return call, nil
}

// write frames body as call's request and writes it; call holds its place
// in the window already, and gives it back when the write fails.
func (c *Client) write(ctx context.Context, call *Call, body []byte) error {
	op, group, id := call.op, call.group, call.id
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		call.release()
		return err
	}
	if len(c.pending) >= 256 {
		c.mu.Unlock()
		call.release()
		return errors.New("gatt: 256 requests in flight")
	}
	for c.pending[c.seq] != nil {
		c.seq++
	}
	call.seq = c.seq
	c.seq++
	c.sent++
	call.n = c.sent
	c.pending[call.seq] = call
	c.mu.Unlock()

	msg := make([]byte, 0, HeaderSize+len(body))
	msg = AppendHeader(msg, Header{Op: op, Version: SMPv2, Len: uint16(len(body)), Group: group, Seq: call.seq, ID: id})
	msg = append(msg, body...)
	for off := 0; off < len(msg); off += c.frag {
		if err := c.link.Write(ctx, SMPCharUUID, msg[off:min(off+c.frag, len(msg))], false); err != nil {
			call.forget()
			if off > 0 {
				// Half a message went out: the device's stream has lost its
				// framing, so this link cannot carry another request.
				c.link.Close()
			}
			if errors.Is(err, ErrDisconnected) || c.isDead() {
				return ErrDisconnected
			}
			return err
		}
	}
	c.mu.Lock()
	call.at = time.Now()
	call.deadline = call.at.Add(c.timeout)
	if l := c.long; l != nil && l != call && c.pending[l.seq] == l && l.n < call.n {
		// Behind a request the device takes long over (an erase), and
		// answered after it: a status read timed out during an upload's
		// erase, and dropped the link under the upload (docs/reliability.md,
		// bug 444).
		call.deadline = later(call.deadline, l.deadline.Add(c.timeout))
	}
	call.timer = time.AfterFunc(time.Until(call.deadline), call.expire)
	if !call.probe {
		c.armQuietLocked(c.quietFor)
	}
	c.mu.Unlock()
	return nil
}

// Working reports whether the client waits for an answer the device still
// has time to give: a request someone waits for, out whole, before its
// deadline (a request timeout, or longer behind an upload's slot erase,
// Call.extend), on a client that has not failed. A device silent past a
// deadline is timed out, and its link dropped, by the client itself.
func (c *Client) Working() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return false
	}
	now := time.Now()
	for _, call := range c.pending {
		if !call.abandoned && !call.probe && !call.at.IsZero() && now.Before(call.deadline) {
			return true
		}
	}
	return false
}

// BusyUntil is, once the client has failed (the link lost) with a request
// given more than the request timeout still unanswered (an upload's first
// request while img_mgmt erases the slot), that request's deadline: the
// device may work on it until then, whatever became of the link. Zero
// otherwise.
func (c *Client) BusyUntil() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.busyUntil
}

func (c *Client) isDead() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err != nil
}

// Abandon stops waiting for the response: a late one is dropped. The
// request keeps its place in the window (SetWindow) until the device
// answers it or the request timeout passes, as the device still holds it.
func (call *Call) Abandon() {
	c := call.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending[call.seq] != call || call.abandoned {
		return
	}
	call.abandoned = true
	if !call.slot {
		delete(c.pending, call.seq)
		call.timer.Stop()
		return
	}
	if call.timer.Stop() {
		// Answered or not, the device is done with it by its deadline.
		time.AfterFunc(max(time.Until(call.deadline), 0), call.forget)
	} else {
		call.forgetLocked()
	}
}

// extend gives the device d more than the request timeout to answer the
// call, which is still waiting. The requests sent after it, which the
// device answers after it, get its new deadline and a request timeout
// more: those waiting now, and those sent while it waits.
func (call *Call) extend(d time.Duration) {
	c := call.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending[call.seq] != call || !call.timer.Stop() {
		return
	}
	call.deadline = time.Now().Add(c.timeout + d)
	call.timer.Reset(time.Until(call.deadline))
	c.long = call
	for _, p := range c.pending {
		if p.n <= call.n || p.timer == nil || p.probe {
			continue // before it, or not out whole yet (write sees c.long)
		}
		if dl := call.deadline.Add(c.timeout); dl.After(p.deadline) && p.timer.Stop() {
			p.deadline = dl
			p.timer.Reset(time.Until(dl))
		}
	}
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// forget drops the request and gives its place back: it failed to go
// out, or the device did not answer it within the request timeout.
func (call *Call) forget() {
	call.c.mu.Lock()
	defer call.c.mu.Unlock()
	call.forgetLocked()
}

// expire ends the request when the device has not answered it within the
// request timeout, whether or not its caller waits for it: it gives back
// its place in the window, and a caller that waits gets ErrTimeout. Before,
// only a caller's Wait saw the timeout; on a link that stalled (up, and
// nothing answered), a caller waiting in Start for a place held by
// requests no one was waiting on yet (an upload filling its window, a
// status read beside it) waited until its own context ended: minutes for
// a command (docs/reliability.md, bug 181).
func (call *Call) expire() {
	c := call.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pending[call.seq] != call {
		return // answered, failed or forgotten already
	}
	delete(c.pending, call.seq)
	call.release()
	if !call.abandoned {
		call.ch <- result{err: ErrTimeout}
	}
}

func (call *Call) forgetLocked() {
	c := call.c
	if c.pending[call.seq] == call {
		delete(c.pending, call.seq)
	}
	if call.timer != nil {
		call.timer.Stop()
	}
	call.release()
}

// Wait waits for the response and decodes its body into resp (which may be
// nil). A response with a non-zero rc, or a group's error, is returned as
// an *Error.
func (call *Call) Wait(ctx context.Context, resp any) error {
	var r result
	select {
	case r = <-call.ch:
		call.timer.Stop()
		call.version = r.msg.Version
	case <-ctx.Done():
		call.Abandon()
		return ctx.Err()
	}
	if r.err != nil {
		return r.err
	}
	var st Status
	if err := DecodeBody(r.msg.Body, &st); err != nil {
		// Most likely a lost fragment joined the head of this response to
		// the next one: the stream cannot be trusted. (A device that
		// encodes garbage fails the same way every time it is asked.)
		c := call.c
		c.mu.Lock()
		c.brokeLocked()
		c.mu.Unlock()
		return fmt.Errorf("%w: response to group %d command %d: %v", ErrFraming, call.group, call.id, err)
	}
	if st.Err != nil && st.Err.RC != 0 {
		return &Error{Group: st.Err.Group, ID: call.id, GroupRC: st.Err.RC, Reason: st.Reason}
	}
	if st.RC != RCOK {
		return &Error{Group: call.group, ID: call.id, RC: st.RC, Reason: st.Reason}
	}
	if resp != nil {
		if err := DecodeBody(r.msg.Body, resp); err != nil {
			return fmt.Errorf("gatt: response to group %d command %d: %w", call.group, call.id, err)
		}
	}
	return nil
}

// Do sends a request and waits for its response.
func (c *Client) Do(ctx context.Context, op uint8, group uint16, id uint8, req, resp any) error {
	call, err := c.Start(ctx, op, group, id, req)
	if err != nil {
		return err
	}
	return call.Wait(ctx, resp)
}

// Params asks the device for its SMP buffer size and count (OS group,
// MCUmgr parameters).
func (c *Client) Params(ctx context.Context) (ParamsResponse, error) {
	var p ParamsResponse
	err := c.Do(ctx, OpRead, GroupOS, CmdOSParams, nil, &p)
	return p, err
}

// Echo sends d to the device and returns its answer (OS group, echo).
func (c *Client) Echo(ctx context.Context, d string) (string, error) {
	var r EchoResponse
	err := c.Do(ctx, OpWrite, GroupOS, CmdOSEcho, EchoRequest{D: d}, &r)
	return r.R, err
}

// ProbeReassembly finds out whether the device joins a request split
// across writes (Zephyr: CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY), which
// nothing it reports says. It sends an echo one byte longer than a write:
// the header and most of the body in the first write, 1 byte in the
// second. A device that reassembles answers it (or answers rc 8 if it has
// no echo: either way it read the whole message). One that does not takes
// the first write as a message cut short and answers rc 9 (ECORRUPT), and
// drops the 1-byte write, too short for a header, without an answer.
//
// That holds for an answer in SMP version 2, whose smp.c checks that a
// message is whole before anything else. An MCUmgr older than version 2
// answers in version 1, and the one of Zephyr 2.x (2.7 LTS among them)
// has no such check: it hands the message cut short to its handler, whose
// decoder answers rc 3 (or rc 1), and its handler lookup rc 8. So an answer
// in version 1 shows reassembly only when it is the echo itself; a refusal
// leaves the device one write per request, which every MCUmgr takes
// (docs/reliability.md, bug 414).
func (c *Client) ProbeReassembly(ctx context.Context, timeout time.Duration) (bool, error) {
	// The message is one write and k more bytes, 1 ≤ k < 8: too few for
	// a header, so a device that does not reassemble drops them.
	var body []byte
	for k := 1; k < HeaderSize && body == nil; k++ {
		body = echoOf(c.frag + k)
	}
	if body == nil {
		return false, fmt.Errorf("gatt: no reassembly probe fits writes of %d bytes", c.frag)
	}
	call, err := c.probeEcho(ctx, body, timeout)
	if call == nil {
		return false, err
	}
	var e *Error
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &e) && e.RC == RCCorrupt:
		return false, nil
	case errors.As(err, &e) && call.version >= SMPv2:
		return true, nil // it parsed the whole message to refuse it
	case errors.As(err, &e):
		return false, nil // an older MCUmgr may refuse a message cut short so
	case errors.Is(err, ErrTimeout):
		return false, nil
	}
	return false, err
}

// echoOf is the body of an OS echo whose message, header included, is
// total bytes long, or nil when none is.
func echoOf(total int) []byte {
	for n := total - HeaderSize - 3; n >= 0; n-- {
		b, err := EncodeBody(EchoRequest{D: strings.Repeat("r", n)})
		if err != nil {
			return nil
		}
		if HeaderSize+len(b) == total {
			return b
		}
		if HeaderSize+len(b) < total {
			return nil
		}
	}
	return nil
}

// ZephyrBufSize is the SMP buffer of a Zephyr device whose firmware keeps
// CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE's default.
const ZephyrBufSize = 384

// ZephyrBufSizes are the SMP buffers the bridge probes a device that does
// not report its own for, longest first: Zephyr's default, and the 256
// bytes of a firmware short of RAM (docs/reliability.md, bug 470).
var ZephyrBufSizes = []int{ZephyrBufSize, 256}

// ProbeBuffer finds out whether the device takes a request of size bytes:
// for a device that does not report its buffers (no MCUmgr parameters). It
// sends an OS echo of that length, in one write when it fits one, across
// writes otherwise (to a device that reassembles, ProbeReassembly). A
// device whose buffer holds it answers (an echo whose answer does not fit
// its buffer is answered rc 7, and one without echo rc 8: either way it
// took the message). One whose buffer is shorter drops a write longer than
// it (Zephyr's smp_bt: "SMP packet len > net_buf len"), or the first write
// of a message longer than it (smp_reassembly_collect: -ENOSR), and takes
// each later write as the start of a message: every one of them is "r"
// bytes, a header claiming 0x7272 bytes, which it drops too, so nothing
// reaches a handler and there is no answer.
func (c *Client) ProbeBuffer(ctx context.Context, size int, timeout time.Duration) (bool, error) {
	body := echoOf(size)
	if body == nil {
		return false, fmt.Errorf("gatt: no buffer probe of %d bytes over writes of %d", size, c.frag)
	}
	call, err := c.probeEcho(ctx, body, timeout)
	if call == nil {
		return false, err
	}
	var e *Error
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &e):
		return e.RC != RCCorrupt, nil
	case errors.Is(err, ErrTimeout):
		return false, nil
	}
	return false, err
}

// probeEcho sends body as an echo whose answer is waited for timeout
// rather than the request timeout, and waits for it: a probe's silence is
// its answer. call is nil when the echo could not be sent.
func (c *Client) probeEcho(ctx context.Context, body []byte, timeout time.Duration) (*Call, error) {
	call, err := c.send(ctx, OpWrite, GroupOS, CmdOSEcho, body)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.pending[call.seq] == call && call.timer.Stop() {
		call.deadline = time.Now().Add(timeout)
		call.timer.Reset(timeout)
	}
	c.mu.Unlock()
	return call, call.Wait(ctx, nil)
}
