package broker

import (
	"context"
	"errors"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// maxInflight bounds the commands published and not yet acknowledged by
// the MQTT broker: past it the outbox waits for PUBACKs.
const maxInflight = 4096

// maxPending bounds the accepted commands the outbox holds in memory while
// it cannot publish; past it they are dropped from memory and read back
// from the store (where they are queued) when it can.
const maxPending = 10000

// enqueue hands a command that is on disk as queued to the outbox. The
// store's callbacks call it in commit order, so each device's commands
// arrive in the order of their ids.
func (b *Broker) enqueue(c companion.Command) {
	b.mu.Lock()
	if !b.ready || b.scan || len(b.pending) >= maxPending || b.opts.Dispatcher != nil {
		// It is queued on disk: the outbox's next read of the store
		// finds it, in its order.
		b.scan = true
		b.pending = nil
	} else {
		b.pending = append(b.pending, c)
	}
	b.mu.Unlock()
	b.wake()
}

// outbox publishes accepted commands in acceptance order. It takes them
// from memory as they are accepted (enqueue) and reads the queued ones from
// the store when memory is not the whole story: after start, after every
// (re)connect, when it fell behind, and every few seconds as a safety net.
// The first pass after start also republishes every command that was sent
// but is not final: a broker that restarted with us (the embedded one) lost
// those not yet delivered, and also the final replies it had acknowledged
// to the bridge but not yet handed to us. The bridge drops an id it has
// queued or running, and answers one it has finished with its final reply
// again (see pendingFromStore).
func (b *Broker) outbox() {
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	// held fires when the first repeat held back (holdRepeat) may go.
	held := time.NewTimer(time.Hour)
	held.Stop()
	defer held.Stop()
	firstPass := true
	for {
		select {
		case <-b.quit:
			return
		case <-b.kick:
		case <-b.connected:
			b.mu.Lock()
			b.scan = true
			b.mu.Unlock()
		case <-tick.C:
			b.mu.Lock()
			b.scan = true
			b.forgetRepeats(time.Now())
			b.mu.Unlock()
		case <-held.C:
			b.mu.Lock()
			b.releaseHeld(time.Now())
			b.mu.Unlock()
		}
		if !b.client.IsConnectionOpen() || !b.Ready() {
			continue
		}
		if !b.dispatching() {
			// Another replica publishes. Should this one take over, its
			// first pass sends every open command again: the last
			// dispatcher's may not have gone out.
			b.mu.Lock()
			b.resend, b.pending = make(map[string]bool), nil
			clear(b.lastOut) // the next dispatcher names its own
			// The repeats stay spaced should this replica dispatch
			// again: what it sent went out whoever dispatched since
			// (bug 100). None is held until then.
			clear(b.held)
			b.mu.Unlock()
			firstPass = true
			continue
		}
		b.mu.Lock()
		devices, scan, pending := b.resend, b.scan || firstPass, b.pending
		b.resend, b.scan, b.pending = make(map[string]bool), false, nil
		for _, c := range pending {
			// Taken: a cancel from now on follows it (see Cancel).
			if b.flying[c.ID] == nil {
				b.flying[c.ID] = &outgoing{}
			}
		}
		b.mu.Unlock()
		cmds := pending
		if scan || len(devices) > 0 {
			b.mu.Lock()
			b.landed = make(map[string]bool)
			b.mu.Unlock()
			var err error
			if cmds, err = b.pendingFromStore(firstPass, devices, pending); err != nil {
				b.log.Warn("outbox: reading queued commands failed; will retry", "err", err)
				b.mu.Lock()
				// No pass follows that would clear it: left, it kept
				// every command answered from now on (land), for as
				// long as this replica did not dispatch.
				b.landed = nil
				for d := range devices {
					b.resend[d] = true
				}
				b.scan = true
				b.mu.Unlock()
				continue
			}
		}
		all := firstPass
		firstPass = false
		// A device whose bridge (re)connected gets every open command
		// again, also those on their way: they may have gone to a broker
		// session that was not the bridge's.
		again := func(c companion.Command) bool { return all || devices[c.DeviceID] }
		ok := b.publish(cmds, again)
		b.mu.Lock()
		b.landed = nil
		if at, waiting := b.firstHeld(); waiting {
			held.Reset(time.Until(at))
		}
		b.mu.Unlock()
		if !ok {
			return
		}
	}
}

// pendingFromStore returns every queued command, oldest first, together
// with the sent but not final commands of the given devices (of every
// device with all set), so that each device's commands go out in order;
// then those of pending that the store did not have yet when it was read
// (accepted since).
//
// Delivered and in-progress commands go out again too: their final reply
// may be lost for good (the bridge's final reply was acknowledged by a broker
// that then died, or by the embedded broker of a server killed before it
// stored the reply). A bridge that finished the command answers the repeat
// with its final reply; one that has it queued or running drops it.
//
// For some devices it reads only theirs and the queued ones
// (QueuedCommandsWith): each device back online has a pass of its own
// when they come one at a time, and the store may hold many more open
// commands, for bridges that are away. The queued commands held for a
// bridge away are left out (heldAway).
func (b *Broker) pendingFromStore(all bool, devices map[string]bool, pending []companion.Command) ([]companion.Command, error) {
	var (
		open []companion.Command
		err  error
	)
	if all {
		open, err = b.st.OpenCommands(context.Background())
	} else {
		ids := make([]string, 0, len(devices))
		for d := range devices {
			ids = append(ids, d)
		}
		open, err = b.st.QueuedCommandsWith(context.Background(), ids, b.heldAway())
	}
	if err != nil {
		return nil, err
	}
	cmds := open[:0]
	seen := make(map[string]bool, len(open))
	for _, c := range open {
		if c.State == companion.StateQueued || all || devices[c.DeviceID] {
			cmds = append(cmds, c)
			seen[c.ID] = true
		}
	}
	for _, c := range pending {
		if !seen[c.ID] {
			cmds = append(cmds, c)
		}
	}
	return cmds, nil
}

// inflight is a published command awaiting its PUBACK.
type inflight struct {
	cmd companion.Command
	tok mqtt.Token
}

// outgoing is a command of the flying set.
type outgoing struct {
	published bool
	acked     time.Time // when the MQTT broker acknowledged it; zero before
	// mayBeOut: a publish of it failed for want of its PUBACK, and the
	// broker may have it all the same (a PUBACK lost with a connection, or
	// a node): it expires as a sent one does, with the grace, and is
	// withdrawn when it does (see expire).
	mayBeOut bool
}

// sentDelay is how long after its PUBACK a command waits for the bridge's
// first reply before "sent" is written for it. Most commands are answered
// sooner, and their later state makes "sent" redundant on disk: one write
// fewer per command. Until then the command reads queued, and it expires
// as a sent one would (see expiredAt).
const sentDelay = 500 * time.Millisecond

// sentFlushEvery is how often the "sent" writes that came due are handed to
// the store. Often, so that each flush is small: flushed once a second, a
// second's worth of them (thousands under load) went into one commit that
// every command accepted meanwhile waited behind.
const sentFlushEvery = sentDelay / 10

// sentLoop runs flushSent every sentFlushEvery until the broker closes.
func (b *Broker) sentLoop() {
	tick := time.NewTicker(sentFlushEvery)
	defer tick.Stop()
	for {
		select {
		case <-b.quit:
			return
		case <-tick.C:
			b.flushSent()
		}
	}
}

// publish hands cmds to the MQTT broker in order, without waiting for their
// PUBACKs: confirm takes those. It skips commands already on their way,
// unless again says to send them again, and it reports false when the
// broker is closing.
//
// A command that paho fails at once did not go out: it, and every later
// command of its device, goes again in the next pass, in order. Paho does
// so when its writer has been stuck for its write timeout (30 s) on a
// connection that is still up, and the commands after it then went out
// first once the writer moved again; the bridge, which runs what arrives
// while its device is idle, ran them before it (docs/reliability.md,
// bug 8).
func (b *Broker) publish(cmds []companion.Command, again func(companion.Command) bool) bool {
	const unread = "\x00"          // no bridge id: the store did not answer
	bridges := map[string]string{} // device → the bridge serving it, for this pass
	held := map[string]bool{}      // devices with a command that did not go out in this pass
	before := map[string]string{}  // device → its command before, in this pass
	online := b.onlineReader(context.Background(), true)
	for _, c := range cmds {
		// Now, not when the pass began: a pass can wait long for room
		// among the commands in flight (acks) or for paho.
		now := b.now()
		// The TTL bounds delivery: a command the bridge has is never
		// expired, and its repeat fetches its final reply. One that may
		// have gone out (expiredAt: within ExpiryGrace of its TTL) goes
		// again: its final reply may have been lost (a broker that
		// acknowledged it and died with it, bug 1), and the bridge answers
		// the repeat from its record, or, never having had it, "expired"
		// at once without running it (it checks the TTL as it takes a
		// command in). Left alone, it read expired once the grace was
		// over, however it had ended on the device.
		undelivered := c.State == companion.StateQueued || c.State == companion.StateSent
		if undelivered && now.After(c.ExpiresAt) {
			b.mu.Lock()
			if o := b.flying[c.ID]; o != nil && !o.published && !o.mayBeOut {
				delete(b.flying, c.ID) // taken from memory only: it never went out
			}
			b.mu.Unlock()
			if b.expiredAt(c, now, online.read) {
				b.expire(context.Background(), c.ID, online)
				continue
			}
		}
		bridge, ok := bridges[c.DeviceID]
		if !ok {
			var err error
			if bridge, err = b.st.DeviceBridge(context.Background(), c.DeviceID); err != nil {
				b.log.Error("reading a device's bridge; its commands wait", "device_id", c.DeviceID, "err", err)
				bridge = unread
			}
			bridges[c.DeviceID] = bridge
		}
		if bridge == "" {
			// No bridge serves the device: its commands wait queued until
			// one does (DeviceMoved), those sent to the bridge it left too
			// (CONTRACT §9). That bridge's session drops them (see
			// DeviceMoved): none is on its way, and no "sent" is written.
			b.mu.Lock()
			delete(b.flying, c.ID)
			b.mu.Unlock()
			if c.State == companion.StateSent {
				b.requeue(c.ID)
			}
			continue
		}
		if bridge != unread && !held[c.DeviceID] && b.holdForAway(c.DeviceID, bridge) {
			// Its bridge is away (its Will was the last word from it):
			// its commands wait queued here, not in the MQTT broker's
			// session for the bridge, where they would pile up for as
			// long as it stays away (mochi copies and sorts a client's
			// whole queue every second; Mosquitto drops past its
			// max_queued_messages). Those sent stay sent. The bridge's
			// "online" sends them all (bridgeOnline); held for the rest
			// of the pass, none goes out before one held.
			held[c.DeviceID] = true
		}
		if b.isMoving(c.DeviceID) {
			held[c.DeviceID] = true // a move of the device is under way (PrepareMove)
		}
		if bridge == unread || held[c.DeviceID] {
			// The store did not say which bridge serves the device: its
			// commands wait, as they are, for the next pass. Or one of its
			// commands did not go out, or its bridge is away: those after
			// it wait for the next pass (resend, or the bridge's return).
			b.mu.Lock()
			if o := b.flying[c.ID]; o != nil && !o.published && !o.mayBeOut {
				delete(b.flying, c.ID)
			}
			b.mu.Unlock()
			continue
		}
		b.mu.Lock()
		// The command this one runs after: the one before it in this pass
		// or, first in the pass, the newest one published before that
		// has not ended. Every command considered here from now on went
		// out, or has gone, or will go again before the device's next ones.
		after := before[c.DeviceID]
		if last := b.lastOut[c.DeviceID]; after == "" && last < c.ID {
			after = last
		}
		before[c.DeviceID] = c.ID
		if after != "" {
			b.named[after] = true
		}
		if b.lastOut[c.DeviceID] < c.ID {
			b.lastOut[c.DeviceID] = c.ID
		}
		if ended, ok := b.landed[c.ID]; ok && (ended || !again(c)) {
			// Ended since the store was read; or answered, or written
			// sent: the bridge has it, and it goes only as a repeat.
			b.mu.Unlock()
			continue
		}
		o := b.flying[c.ID]
		repeat := again(c) && (c.State != companion.StateQueued || o != nil && o.published)
		if repeat && b.holdRepeat(c.DeviceID, c.ID, time.Now()) {
			// Sent again a moment ago: it goes later, if it has not
			// ended by then.
			b.mu.Unlock()
			continue
		}
		if o == nil {
			o = &outgoing{}
			b.flying[c.ID] = o
		}
		skip := o.published && !again(c)
		o.published = true
		b.mu.Unlock()
		if skip {
			continue // on its way already
		}
		topic, err := b.tree.Command(c.DeviceID, c.Op)
		if err != nil {
			b.log.Error("command with an unpublishable topic", "command_id", c.ID, "err", err)
			b.land(c.ID)
			continue
		}
		msg, err := fastjson.Marshal(topics.Command{
			ID:        c.ID,
			Op:        c.Op,
			DeviceID:  c.DeviceID,
			CreatedAt: c.CreatedAt.UTC(),
			ExpiresAt: c.ExpiresAt.UTC(),
			Payload:   c.Payload,
			After:     after,
		})
		if err != nil {
			b.log.Error("command that cannot be encoded", "command_id", c.ID, "err", err)
			b.land(c.ID)
			continue
		}
		tok := b.client.Publish(topic, 1, false, msg)
		if err := failedAtOnce(tok); err != nil {
			b.log.Warn("publishing a command failed; it and its device's later commands go again", "command_id", c.ID, "err", err)
			held[c.DeviceID] = true
			b.mu.Lock()
			if b.lastOut[c.DeviceID] == c.ID {
				// It goes again, after the same one.
				if b.lastOut[c.DeviceID] = after; after == "" {
					delete(b.lastOut, c.DeviceID)
				}
			}
			if o.mayBeOut {
				o.published = false // an earlier publish may be out: it stays so
			} else {
				delete(b.flying, c.ID)
			}
			b.resend[c.DeviceID] = true
			b.mu.Unlock()
			continue
		}
		select {
		case b.acks <- inflight{cmd: c, tok: tok}:
		case <-b.quit:
			return false
		}
	}
	return true
}

// holdForAway reports whether the bridge's last word taken in was its
// Will; if so, the device's queued commands wait for it, and the outbox's
// reads of the store leave them out until it is back (heldAway).
func (b *Broker) holdForAway(deviceID, bridgeID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.away[bridgeID] {
		b.awayDevices[deviceID] = bridgeID
	}
	return b.away[bridgeID]
}

// fullReadEvery is how often the outbox's read of the queued commands
// leaves none out (heldAway): should a device's move pass this server by,
// its commands held for the bridge it left wait no longer than that.
const fullReadEvery = time.Minute

// heldAway returns the devices whose queued commands the outbox's read of
// the store leaves out: those held for a bridge still away (holdForAway),
// which go with the bridge's "online" (bridgeOnline) or the device's move
// (resendDevice). A bridge away for a day may have tens of thousands:
// read and decoded each pass, every 5 s, and, with replicas, on every
// command accepted. Once every fullReadEvery it returns none.
func (b *Broker) heldAway() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if now.Sub(b.lastFullRead) >= fullReadEvery {
		b.lastFullRead = now
		clear(b.awayDevices) // those still held come back in this pass
		return nil
	}
	skip := make([]string, 0, len(b.awayDevices))
	for d, bridge := range b.awayDevices {
		if !b.away[bridge] {
			delete(b.awayDevices, d)
			continue
		}
		skip = append(skip, d)
	}
	return skip
}

// repeat is when a command repeated by this dispatcher may go out again,
// and how often it went.
type repeat struct {
	next time.Time
	n    int
}

// holdRepeat reports whether a repeat of a command must wait: it went out
// again less than its spacing ago. The spacing starts at RepeatSpacing and
// doubles with each repeat, up to SentRetry (maxRepeatSpacing at most). A
// repeat that waits is not dropped: its device is held, and the outbox
// sends its unfinished commands again when the time comes (releaseHeld).
// Called with mu held, with real time: the spacing is about the path, not
// the clock of commands.
//
// The spacing outlives a spell of not dispatching: a replica that loses
// the dispatcher's lock and wins it back (a PostgreSQL restart does that)
// sends every open command again, as a new dispatcher must, except those
// it sent itself within their spacing, which wait for it.
//
// Without it, every bridge "online", new dispatcher and device back online
// sent every unfinished command of the devices again, and the bridge
// answered each repeat of a finished one with its final reply. When the
// replies waited in the MQTT broker (a store down, a node failing over),
// the commands read unfinished for as long, so each such event sent them
// all again, and their answers lengthened the very queue that kept them
// unfinished (docs/reliability.md, bug 100).
func (b *Broker) holdRepeat(deviceID, id string, now time.Time) bool {
	rs := b.repeats[deviceID]
	r := rs[id]
	if r != nil && now.Add(repeatSlack).Before(r.next) {
		if at, ok := b.held[deviceID]; !ok || r.next.Before(at) {
			b.held[deviceID] = r.next
		}
		return true
	}
	if rs == nil {
		rs = make(map[string]*repeat)
		b.repeats[deviceID] = rs
	}
	if r == nil {
		r = &repeat{}
		rs[id] = r
	}
	spacing := min(b.opts.SentRetry, maxRepeatSpacing)
	if r.n < 16 && b.opts.RepeatSpacing<<r.n < spacing {
		spacing = b.opts.RepeatSpacing << r.n
	}
	r.next = now.Add(spacing)
	r.n++
	return false
}

// maxRepeatSpacing bounds the spacing of a command's repeats, whatever
// SentRetry: a later command of its device that went out meanwhile names
// it as the one to run after, and a bridge that never had it waits
// agent.DefaultAfterWait (2 min) for it before running the later one
// without it, out of order.
const maxRepeatSpacing = time.Minute

// repeatSlack is how much sooner than its spacing says a repeat may go:
// the devices whose held repeats come due within it go out in one pass,
// and each pass reads the store's open commands.
const repeatSlack = time.Second

// releaseHeld has the outbox send again the unfinished commands of the
// devices whose held repeats may go now. Called with mu held.
func (b *Broker) releaseHeld(now time.Time) {
	for d, at := range b.held {
		if !at.After(now.Add(repeatSlack)) {
			b.resend[d] = true
			delete(b.held, d)
		}
	}
	if len(b.resend) > 0 {
		b.wake()
	}
}

// firstHeld returns the earliest time a held repeat may go, and false when
// none is held. Called with mu held.
func (b *Broker) firstHeld() (time.Time, bool) {
	var first time.Time
	for _, at := range b.held {
		if first.IsZero() || at.Before(first) {
			first = at
		}
	}
	return first, !first.IsZero()
}

// forgetRepeats forgets the repeats whose spacing ended a SentRetry ago or
// more: the command ended, or has been quiet long enough to start over.
// Called with mu held.
func (b *Broker) forgetRepeats(now time.Time) {
	for d, rs := range b.repeats {
		for id, r := range rs {
			if now.Sub(r.next) >= b.opts.SentRetry {
				delete(rs, id)
			}
		}
		if len(rs) == 0 {
			delete(b.repeats, d)
		}
	}
}

// failedAtOnce returns the error of a publish token that failed by the
// time Publish returned it, and nil for one that has not (yet).
func failedAtOnce(tok mqtt.Token) error {
	select {
	case <-tok.Done():
		return tok.Error()
	default:
		return nil
	}
}

// land forgets that a command is on its way, and keeps a pass of the
// outbox that read it from the store before from sending it: it ended
// (final, canceled, expired), or cannot be published.
func (b *Broker) land(id string) { b.landAs(id, true) }

// arrived forgets that a command is on its way because the bridge has it
// ("sent" is written, or a reply that is not final came): a pass that
// read it before sends it only as a repeat asked for, which fetches a
// final reply lost on the way. Taken as landed, such a repeat was
// skipped, and nothing asked for it again: the command stayed delivered
// (bug 248).
func (b *Broker) arrived(id string) { b.landAs(id, false) }

func (b *Broker) landAs(id string, ended bool) {
	b.mu.Lock()
	delete(b.flying, id)
	if b.landed != nil {
		b.landed[id] = b.landed[id] || ended
	}
	for _, ch := range b.words[id] {
		select {
		case ch <- struct{}{}: // a move waits for the bridge's word on it (awaitWord)
		default:
		}
	}
	b.mu.Unlock()
}

// isMoving reports whether a move of the device is under way
// (PrepareMove).
func (b *Broker) isMoving(deviceID string) bool {
	if b.moves.Load() == 0 {
		return false // no lock taken for each command published
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.moving[deviceID] > 0
}

// isFlying reports whether a command queued on disk is with the MQTT
// broker, or on its way there.
func (b *Broker) isFlying(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.flying[id] != nil
}

// confirm waits for the PUBACK of each published command, in the order
// they were published, and notes when it came (flushSent writes "sent"
// later, if still needed). A command whose publish failed stays queued on
// disk; the outbox reads it back after the reconnect.
func (b *Broker) confirm() {
	for {
		var p inflight
		select {
		case <-b.quit:
			return
		case p = <-b.acks:
		}
		if err := b.waitToken(p.tok); err != nil {
			if !errors.Is(err, ErrClosed) {
				b.log.Warn("publishing a command failed; it stays queued", "command_id", p.cmd.ID, "err", err)
			}
			// It goes out again with the next pass. The broker may have
			// it already (its PUBACK lost with a connection): it stays
			// flying, so that it expires with the grace, as a sent one,
			// and not the instant its TTL passes while the bridge may be
			// running it ("expired" means never delivered, CONTRACT §2).
			b.mu.Lock()
			if o := b.flying[p.cmd.ID]; o != nil {
				o.published, o.mayBeOut = false, true
			}
			b.scan = true
			b.mu.Unlock()
			continue
		}
		b.mu.Lock()
		if o := b.flying[p.cmd.ID]; o != nil {
			o.acked = time.Now() // real time: sentDelay is about the path, not the clock of commands
			b.unsent = append(b.unsent, p.cmd.ID)
		}
		b.mu.Unlock()
	}
}

// flushSent writes "sent" for the commands acknowledged by the MQTT broker
// sentDelay ago or more that the bridge has not answered yet. The writes
// share the store's next commit.
func (b *Broker) flushSent() {
	var ids []string
	b.mu.Lock()
	n := 0
	for _, id := range b.unsent {
		o := b.flying[id]
		if o == nil {
			n++ // answered meanwhile
			continue
		}
		if time.Since(o.acked) < sentDelay {
			break
		}
		ids = append(ids, id)
		n++
	}
	b.unsent = b.unsent[n:]
	if len(b.unsent) == 0 {
		b.unsent = nil
	}
	b.mu.Unlock()
	start := time.Now()
	for _, id := range ids {
		b.st.UpdateCommandAsync(id, func(c *companion.Command) error {
			if c.State != companion.StateQueued {
				return errStale // a reply got there first
			}
			c.State = companion.StateSent
			return nil
		}, func(c companion.Command, err error) {
			b.arrived(id)
			b.opts.Observer.StoreWrite(StoreWriteSent, time.Since(start))
			if err == nil {
				b.opts.Observer.CommandState(c.Op, c.State, sinceAccepted(b.now(), c.CreatedAt))
			}
			switch {
			case errors.Is(err, companion.ErrFinal) && c.State == companion.StateCanceled:
				b.publishCancel(c) // canceled while on its way to the broker
			case err != nil && !errors.Is(err, errStale) && !errors.Is(err, companion.ErrFinal) && !errors.Is(err, companion.ErrNotFound):
				b.log.Error("marking a command sent", "command_id", id, "err", err)
			}
		})
	}
}

// requeue writes a sent command of a device no bridge serves back to
// queued: the bridge it was sent to no longer serves the device, and it
// waits for one that does (CONTRACT §9). Its next bridge gets it as any
// queued command. The bridge it left does not get it from its session
// (the broker drops it there: TestAMovedDevicesCommandStaysInItsOldBridgesSession);
// one that bridge took before the move, its word on it refused since, is
// a race of a move left open (docs/reliability.md, bug 123).
func (b *Broker) requeue(id string) {
	b.st.UpdateCommandAsync(id, func(c *companion.Command) error {
		if c.State != companion.StateSent {
			return errStale // delivered meanwhile: failLeft's, or the next bridge's
		}
		c.State = companion.StateQueued
		return nil
	}, func(c companion.Command, err error) {
		switch {
		case err == nil:
			b.opts.Observer.CommandState(c.Op, c.State, sinceAccepted(b.now(), c.CreatedAt))
			b.notify(c)
			b.log.Info("command queued again: its device lost its bridge", "command_id", id, "device_id", c.DeviceID)
		case !errors.Is(err, errStale) && !errors.Is(err, companion.ErrFinal) && !errors.Is(err, companion.ErrNotFound):
			b.log.Error("queuing again a command of a device that lost its bridge", "command_id", id, "err", err)
		}
	})
}

// waitToken waits for a publish token, PublishTimeout at most, or until the
// broker closes.
func (b *Broker) waitToken(tok mqtt.Token) error {
	t := time.NewTimer(b.opts.PublishTimeout)
	defer t.Stop()
	select {
	case <-tok.Done():
		return tok.Error()
	case <-t.C:
		return errors.New("no PUBACK within the publish timeout")
	case <-b.quit:
		return ErrClosed
	}
}

// blobGrace is how long the retention pass keeps a blob that nothing
// references. Content is stored first (PutBlob, which also refreshes the
// time of content stored already) and the command, firmware or app
// release that references it is written a moment later, within the same
// request: a blob stored since the last pass may not be referenced yet.
// An hour is far more than a request takes, and than the clocks of
// replicas sharing a store differ by, and costs at most an hour's worth
// of unreferenced uploads on disk.
const blobGrace = time.Hour

// sweep expires commands whose TTL passed before delivery and, hourly,
// forgets idempotency keys older than a day, final commands older than
// the retention, and blobs nothing needs any more (blobGrace).
func (b *Broker) sweep() {
	tick := time.NewTicker(b.opts.SweepInterval)
	defer tick.Stop()
	lastPurge := time.Time{}
	for {
		select {
		case <-b.quit:
			return
		case <-tick.C:
		}
		ctx := context.Background()
		now := b.now()
		if !b.dispatching() {
			continue // the dispatcher sweeps
		}
		cmds, err := b.st.ExpiredCommands(ctx, now)
		if err != nil {
			b.log.Error("expiry sweep", "err", err)
			continue
		}
		online := b.onlineReader(ctx, true)
		for _, c := range cmds {
			if b.expiredAt(c, now, online.read) {
				b.expire(ctx, c.ID, online)
			}
		}
		if now.Sub(lastPurge) > time.Hour {
			if _, err := b.st.PurgeIdempotency(ctx, now.Add(-24*time.Hour)); err != nil {
				b.log.Error("purging idempotency keys", "err", err)
			}
			if n, err := b.st.PurgeCommands(ctx, now.Add(-b.opts.Retention)); err != nil {
				b.log.Error("purging old commands", "err", err)
			} else if n > 0 {
				b.log.Info("purged final commands past their retention", "count", n)
			}
			// The event log keeps companion.EventRetention, so that a
			// stream resumes without a gap for at least an hour.
			if _, err := b.st.PurgeEvents(ctx, now.Add(-companion.EventRetention)); err != nil {
				b.log.Error("purging old events", "err", err)
			}
			// A blob goes once no unfinished command, firmware or app
			// release references it: the bridge downloads only those of
			// unfinished commands (CONTRACT §9).
			if n, err := b.st.PurgeBlobs(ctx, now.Add(-blobGrace)); err != nil {
				b.log.Error("purging unneeded blobs", "err", err)
			} else if n > 0 {
				b.log.Info("purged blobs nothing needs", "count", n)
			}
			lastPurge = now
		}
	}
}

// expiredAt reports whether the server may end c as expired at now. A
// queued command expires with its TTL: it never left the store. A sent one
// (or one queued on disk that the outbox has handed to the MQTT broker) may
// already be in the bridge's hands, its reply on the way (the bridge runs
// nothing past expires_at by its own clock): it expires only ExpiryGrace
// later, so that such a reply lands first. So does one queued on disk that
// was accepted before this broker became the dispatcher: the dispatcher
// before it (a server since restarted, a replica since gone) may have
// published it (sent is written only sentDelay after the PUBACK).
//
// Past the grace, one whose device reads online (online, asked only then)
// waits on, up to expiryWaitGraces graces: its bridge is there to say what
// became of it. It goes out again (publish, retrySent), and the bridge
// answers from its record: its final reply if it ran it, "delivered" if it
// holds it, "expired" if it never had it before its TTL. Expired here
// instead, a command whose replies queued behind others in the MQTT broker
// for longer than the grace read expired although the device had run it
// (bug 99).
func (b *Broker) expiredAt(c companion.Command, now time.Time, online func(deviceID string) bool) bool {
	b.mu.Lock()
	since := b.dispatchSince
	b.mu.Unlock()
	switch {
	case c.State == companion.StateQueued && !b.isFlying(c.ID) && !c.CreatedAt.Before(since):
		return now.After(c.ExpiresAt)
	case c.State == companion.StateQueued, c.State == companion.StateSent:
		// Queued on disk but with the MQTT broker already: as good as sent.
		switch {
		case !now.After(c.ExpiresAt.Add(b.opts.ExpiryGrace)):
			return false
		case now.After(c.ExpiresAt.Add(expiryWaitGraces * b.opts.ExpiryGrace)):
			return true
		}
		return !online(c.DeviceID)
	}
	return false
}

// expiryWaitGraces bounds, in ExpiryGrace, how long past its TTL a command
// that may have gone out waits for the word of a bridge whose device reads
// online (expiredAt): a bridge that stays silent that long is broken, and
// every command ends.
const expiryWaitGraces = 10

// onlineReader reads whether devices read online, as their stored status
// says, each device once: for one pass over commands. A device never
// reported reads offline. A status the store fails to read reads as
// failed: true for the expiry passes, so that nothing expires on a failed
// read (the next pass reads it again); false for retrySent, so that
// nothing is sent again on one (the next retry reads it again).
type onlineReader struct {
	ctx    context.Context
	st     Store
	failed bool
	seen   map[string]bool
}

func (b *Broker) onlineReader(ctx context.Context, failed bool) *onlineReader {
	return &onlineReader{ctx: ctx, st: b.st, failed: failed, seen: map[string]bool{}}
}

// read reads the device's status, once.
func (o *onlineReader) read(deviceID string) bool {
	on, ok := o.seen[deviceID]
	if !ok {
		s, err := o.st.Status(o.ctx, deviceID)
		on = s.Online
		if err != nil && !errors.Is(err, companion.ErrNotFound) {
			on = o.failed
		}
		o.seen[deviceID] = on
	}
	return on
}

// known is read without a read of the store: a device not read yet reads
// online, and its command waits for the next pass.
func (o *onlineReader) known(deviceID string) bool {
	on, ok := o.seen[deviceID]
	return !ok || on
}

// errExpired is the error of an expired command, whoever expired it: the
// server (expire) or its bridge, whose reply says the state alone.
func errExpired() *companion.CommandError {
	return &companion.CommandError{Code: "expired", Message: "the command was not delivered before it expired"}
}

// expire ends a command that was not delivered in time. online says
// whether its device reads online as expiredAt read it before: expire
// reads nothing more within the store's transaction.
func (b *Broker) expire(ctx context.Context, id string, online *onlineReader) {
	now := b.now()
	start := time.Now()
	var was string
	cmd, err := b.st.UpdateCommand(ctx, id, func(c *companion.Command) error {
		if !b.expiredAt(*c, now, online.known) {
			return errStale
		}
		was = c.State
		c.State = companion.StateExpired
		c.Error = errExpired()
		return nil
	})
	b.opts.Observer.StoreWrite(StoreWriteExpire, time.Since(start))
	if err != nil {
		return
	}
	b.opts.Observer.CommandState(cmd.Op, cmd.State, sinceAccepted(now, cmd.CreatedAt))
	b.log.Info("command expired", "command_id", id, "device_id", cmd.DeviceID)
	b.mu.Lock()
	named := b.named[id]
	o := b.flying[id]
	mayBeOut := o != nil && (o.published || o.mayBeOut)
	b.mu.Unlock()
	b.notify(cmd)
	if was == companion.StateSent || named || mayBeOut {
		// It may have reached the bridge, or be on its way: withdrawn, it
		// never runs there late, and a later command that names it as the
		// one to run after (topics.Command.After) waits for it no longer.
		b.publishCancel(cmd)
	}
	// Nor does the copy an outbox pass read queued from the store before
	// it expired, and has not published yet (as for Cancel): it would
	// reach a bridge past its TTL, whose clock may let it run.
	b.land(id)
}

// retryLoop runs retrySent every SentRetry until the broker closes. Each
// run reads the sent commands of the devices that read online (the stores
// find the sent ones through their expiry index, of the queued and sent
// commands, and decode only those of online devices: a bridge away leaves
// many), so not more often: a command stays sent for two SentRetry at most
// before it goes out again.
func (b *Broker) retryLoop() {
	tick := time.NewTicker(b.opts.SentRetry)
	defer tick.Stop()
	retried := map[string]time.Time{}
	unheard := newUnheard()
	for n := 1; ; n++ {
		select {
		case <-b.quit:
			return
		case <-tick.C:
		}
		if b.dispatching() {
			sent, again, read := b.retrySent(context.Background(), retried)
			b.noteUnheard(context.Background(), unheard, sent, again, read)
		}
		b.checkStateless()
		if n%awayCheckTicks == 0 {
			b.checkAway(context.Background())
		}
		b.checkNamed(context.Background())
	}
}

// awayCheckTicks is how many SentRetry apart checkAway runs (ten minutes by
// default, within the bridges-away alert's 15 of docs/operations.md): a
// read of the store for each bridge away, of which a server with many
// users' bridges (their phones) may have thousands.
const awayCheckTicks = 10

// retrySent sends again the commands that have been sent for SentRetry or
// longer, with no word from the bridge, while their device reads online.
// A bridge says "delivered" within a moment of taking a command (even one
// queued behind others on its device), so such a command went to a broker
// that lost it where nothing told the server: every loss the server hears
// of (a bridge or a broker coming back, a device coming online, a restart)
// sends a device's unfinished commands again already, and this catches
// the rest, such as a broker that dropped a message with no session to
// hold it while the bridge's was being made anew (or whose "delivered"
// was lost). The bridge runs no command twice: it answers one it holds
// with "delivered" and one it finished with its final reply, so a repeat
// costs a message. A device that reads offline waits for its bridge
// to come back, which sends everything again; so does a command the
// retry sent: again only after another SentRetry (retried holds when, and
// forgets it once that has passed: it then holds nothing back).
//
// The store reads only the sent commands of devices whose status reads
// online (SentCommandsOnline); each device's status is read again here,
// so that one the store fails to read sends nothing again.
//
// It returns the sent commands read and those of them it sent again, and
// whether the read succeeded, for noteUnheard.
func (b *Broker) retrySent(ctx context.Context, retried map[string]time.Time) (sent, again []companion.Command, read bool) {
	sent, err := b.st.SentCommandsOnline(ctx)
	if err != nil {
		b.log.Warn("reading sent commands to send again failed", "err", err)
		return nil, nil, false
	}
	now := b.now()
	for id, at := range retried {
		if now.Sub(at) >= b.opts.SentRetry {
			delete(retried, id)
		}
	}
	online := b.onlineReader(ctx, false)
	devices := map[string]bool{}
	for _, c := range sent {
		// A command written more than a SentRetry ahead of now was sent
		// before the clock stepped back: it is as old as that at least.
		// Taken for new, it waited for the clock to catch up, an hour for
		// an hour (docs/reliability.md, bug 332).
		age := now.Sub(c.UpdatedAt)
		if (age < b.opts.SentRetry && age > -b.opts.SentRetry) || now.Sub(retried[c.ID]) < b.opts.SentRetry {
			continue
		}
		if online.read(c.DeviceID) {
			devices[c.DeviceID] = true
			retried[c.ID] = now
			again = append(again, c)
		}
	}
	if len(devices) == 0 {
		return sent, again, true
	}
	b.mu.Lock()
	for d := range devices {
		b.resend[d] = true
	}
	b.mu.Unlock()
	b.wake()
	b.log.Info("commands sent long ago to online devices with no word from their bridge; sending them again", "devices", len(devices))
	return sent, again, true
}
