package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// Submit stores a command as queued (durably) and hands it to the outbox.
// The store assigns its id. With idem set, a repeat of the same request
// returns the first command and replayed true.
func (b *Broker) Submit(ctx context.Context, c companion.Command, idem *companion.Idempotency) (companion.Command, bool, error) {
	if !topics.ValidOp(c.Op) || c.Op == topics.OpCancel || !topics.ValidDeviceID(c.DeviceID) {
		return companion.Command{}, false, fmt.Errorf("broker: bad command %q for %q", c.Op, c.DeviceID)
	}
	type result struct {
		cmd      companion.Command
		replayed bool
		err      error
	}
	ch := make(chan result, 1)
	lost := b.lost.Load()
	start := time.Now()
	b.st.CreateCommandAsync(c, b.opts.MaxOpenCommands, idem, func(cmd companion.Command, replayed bool, err error) {
		b.opts.Observer.StoreWrite(StoreWriteCreate, time.Since(start))
		// The store calls back in commit order: the outbox gets each
		// device's commands in the order of their ids.
		if err == nil && !replayed {
			b.opts.Observer.CommandState(cmd.Op, cmd.State, 0)
			b.mu.Lock()
			// Ended already (its device unbound in a write that committed
			// and was told here before this callback, as PostgreSQL's
			// lanes allow): live, a Wait would trust it and wait out its
			// time for a notify that came before it; handed to the outbox,
			// it could go out after its cancel.
			ended := b.finals.has(cmd.ID)
			// Changed by another replica already (bug 232): perhaps ended
			// there, by an unbinding; this replica heard it only as an id
			// (CommandChanged), with no one waiting here yet to read it.
			// Not live: a Wait reads the store. Nor when notifications
			// may have been lost since it was submitted (bug 253): those
			// of another replica's change of it too.
			if !ended && !b.elsewhere.has(cmd.ID) && b.lost.Load() == lost {
				b.live[cmd.ID] = true
			}
			b.mu.Unlock()
			if !ended {
				b.enqueue(cmd)
			}
		}
		ch <- result{cmd, replayed, err}
	})
	r := <-ch
	return r.cmd, r.replayed, r.err
}

func (b *Broker) wake() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// Cancel cancels a command the bridge does not have yet, and withdraws it
// from the bridge with a cancel message, which a bridge that has not
// started the command obeys; one the bridge has acknowledged can no longer
// be canceled.
func (b *Broker) Cancel(ctx context.Context, id string) (companion.Command, error) {
	start := time.Now()
	// Written whether or not the caller waits for it: PostgreSQL's lane
	// may commit it after the request's client hung up, and the caller,
	// told only the context's error, would then send no cancel to the
	// bridge, which ran the command though it read canceled; nor tell
	// the waiters (docs/reliability.md, bug 276).
	cmd, err := b.st.UpdateCommand(context.WithoutCancel(ctx), id, func(c *companion.Command) error {
		if c.State != companion.StateQueued && c.State != companion.StateSent {
			return ErrNotCancelable
		}
		c.State = companion.StateCanceled
		c.Error = &companion.CommandError{Code: "canceled", Message: "canceled by the user"}
		return nil
	})
	b.opts.Observer.StoreWrite(StoreWriteCancel, time.Since(start))
	if err != nil {
		return cmd, err
	}
	b.opts.Observer.CommandState(cmd.Op, cmd.State, sinceAccepted(b.now(), cmd.CreatedAt))
	b.notify(cmd)
	b.mu.Lock()
	// Not yet taken by the outbox: it never goes out.
	b.pending = slices.DeleteFunc(b.pending, func(c companion.Command) bool { return c.ID == id })
	b.mu.Unlock()
	// Nor does the copy an outbox pass read queued from the store before
	// the cancel and has not published yet.
	b.land(id)
	// The cancel goes whatever the outbox knows of the command: queued on
	// disk, it may still be in paho's session store, which sends it again
	// after a reconnect (its publish timed out, or another replica
	// published it); and a command no bridge ever had costs the bridge a
	// dropped cancel (see Ended).
	b.publishCancel(cmd)
	return cmd, nil
}

// Ended takes in commands that the store ended outside the broker (an
// unbind, companion.Unbound): their waiters get them, the outbox drops
// them (also a copy it read from the store before), and each is withdrawn
// from the bridge with a cancel message, which a bridge that has not
// started the command obeys. A cancel for a command no bridge ever had is
// dropped by the bridges and harmless.
func (b *Broker) Ended(cmds []companion.Command) {
	for _, cmd := range cmds {
		b.opts.Observer.CommandState(cmd.Op, cmd.State, sinceAccepted(b.now(), cmd.CreatedAt))
		b.notify(cmd)
		b.mu.Lock()
		b.pending = slices.DeleteFunc(b.pending, func(c companion.Command) bool { return c.ID == cmd.ID })
		b.mu.Unlock()
		b.land(cmd.ID)
		b.publishCancel(cmd)
	}
}

// publishCancel withdraws a canceled command from the bridge. It is best
// effort: the bridge also checks expiry, and the server ignores whatever it
// reports for a canceled command.
func (b *Broker) publishCancel(cmd companion.Command) {
	topic, err := b.tree.Command(cmd.DeviceID, topics.OpCancel)
	if err != nil {
		b.log.Error("cancel not sent: no topic for the device", "command_id", cmd.ID, "device_id", cmd.DeviceID, "err", err)
		return
	}
	payload, err := fastjson.Marshal(topics.Cancel{CommandID: cmd.ID})
	if err != nil {
		b.log.Error("cancel not sent", "command_id", cmd.ID, "err", err)
		return
	}
	msg, err := fastjson.Marshal(topics.Command{
		ID:        cmd.ID,
		Op:        topics.OpCancel,
		DeviceID:  cmd.DeviceID,
		CreatedAt: b.now().UTC(),
		ExpiresAt: cmd.ExpiresAt,
		Payload:   payload,
	})
	if err != nil {
		b.log.Error("cancel not sent", "command_id", cmd.ID, "err", err)
		return
	}
	b.client.Publish(topic, 1, false, msg)
}

// Wait returns the command once it is final, or its latest state when ctx
// ends first or the broker releases its waiters (Release, Close).
func (b *Broker) Wait(ctx context.Context, id string) (companion.Command, error) {
	ch := make(chan companion.Command, 1)
	b.mu.Lock()
	b.waiters[id] = append(b.waiters[id], ch)
	live := b.live[id]
	b.mu.Unlock()
	defer b.forget(id, ch)

	// A command accepted here and not final yet will be notified; any
	// other may be final already.
	if !live {
		cmd, err := b.st.Command(ctx, id)
		if err != nil || companion.IsFinal(cmd.State) {
			return cmd, err
		}
	}
	var cmd companion.Command
	select {
	case cmd = <-ch:
		return cmd, nil
	case <-ctx.Done():
		return b.st.Command(context.WithoutCancel(ctx), id)
	case <-b.release:
		return b.st.Command(context.WithoutCancel(ctx), id)
	}
}

// Release answers every Wait, those under way and those to come, with the
// command's latest state, as when their ctx ends. A server shutting down
// calls it before it lets its requests in flight finish: a Prefer: wait
// is then answered 202 at once instead of holding the shutdown until its
// N seconds (up to a minute) run out. The broker goes on working
// otherwise; Close releases the waiters too.
func (b *Broker) Release() {
	b.mu.Lock()
	defer b.mu.Unlock()
	select {
	case <-b.release:
	default:
		close(b.release)
	}
}

func (b *Broker) forget(id string, ch chan companion.Command) {
	b.mu.Lock()
	defer b.mu.Unlock()
	list := b.waiters[id]
	for i, c := range list {
		if c == ch {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(b.waiters, id)
	} else {
		b.waiters[id] = list
	}
}

// DispatcherChanged tells the broker that this replica started or stopped
// dispatching: a new dispatcher reads the store at once.
func (b *Broker) DispatcherChanged(dispatching bool) {
	b.log.Info("dispatcher", "dispatching", dispatching)
	b.sawDispatching(dispatching)
	if dispatching {
		b.wake()
	}
}

// CommandChanged says another replica changed command id in the shared
// store (the store's notification): those waiting here for it are
// answered if it is final now. It reads the store only when someone here
// waits. An empty id means notifications may have been lost (the store's
// listener LISTENs anew: once it starts, and after it reconnected): every
// command waited for here is read again.
func (b *Broker) CommandChanged(ctx context.Context, id string) {
	if b.opts.Dispatcher != nil {
		// Perhaps a command another replica accepted: the dispatcher reads
		// the queue again.
		b.mu.Lock()
		b.scan = true
		b.mu.Unlock()
		b.wake()
	}
	b.mu.Lock()
	var ids []string
	if id == "" {
		for w := range b.waiters {
			ids = append(ids, w)
		}
		// Another replica may have ended any of them meanwhile, unheard:
		// none is live any more, and a later Wait reads the store rather
		// than wait out its time for a notify that came before (bug 253).
		clear(b.live)
		b.lost.Add(1)
		for id := range b.named {
			b.recheck[id] = true
		}
	} else {
		// Another replica changed it, perhaps to final (it took the reply,
		// or canceled it): this replica will not see it become final, so
		// it is no longer live here. Else live leaks the ids of about half
		// the commands accepted here, and a later Wait, trusting live,
		// skips the store read and waits out its time for a command
		// already final.
		delete(b.live, id)
		// And should the store call back its acceptance here only now,
		// it is not made live again (see Submit; bug 232).
		b.elsewhere.add(id)
		if b.named[id] {
			b.recheck[id] = true // perhaps ended there, unheard here: checkNamed
		}
		if len(b.waiters[id]) > 0 {
			ids = append(ids, id)
		}
	}
	b.mu.Unlock()
	for _, id := range ids {
		cmd, err := b.st.Command(ctx, id)
		if err != nil {
			b.log.Warn("a changed command could not be read", "command_id", id, "err", err)
			continue
		}
		if companion.IsFinal(cmd.State) {
			b.notify(cmd)
		}
	}
}

// checkNamed reads the commands named as the one a later command runs
// after (named) that another replica changed (CommandChanged), and takes
// those final now as ended here (notify). One that replica ended without
// a word from the bridge (canceled there, or ended by an unbind there)
// is never heard of here otherwise: named kept its id for as long as the
// server ran (docs/reliability.md, bug 317). Those this replica took the
// final reply of meanwhile are not read: most are, each reply being taken
// by every replica.
func (b *Broker) checkNamed(ctx context.Context) {
	b.mu.Lock()
	var ids []string
	for id := range b.recheck {
		if b.named[id] {
			ids = append(ids, id)
		}
	}
	clear(b.recheck)
	b.mu.Unlock()
	for _, id := range ids {
		cmd, err := b.st.Command(ctx, id)
		switch {
		case errors.Is(err, companion.ErrNotFound): // purged
			b.mu.Lock()
			delete(b.named, id)
			b.mu.Unlock()
		case err != nil:
			b.log.Warn("a named command changed on another replica could not be read", "command_id", id, "err", err)
			b.mu.Lock()
			b.recheck[id] = true // read again next time
			b.mu.Unlock()
		case companion.IsFinal(cmd.State):
			b.notify(cmd)
		}
	}
}

// notify hands a command that became final to those waiting for it.
func (b *Broker) notify(cmd companion.Command) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if companion.IsFinal(cmd.State) {
		b.finals.add(cmd.ID)
	}
	delete(b.live, cmd.ID)
	if b.lastOut[cmd.DeviceID] == cmd.ID {
		// The bridge has it, or will hear of its end (a cancel), or never
		// will (a command of a device gone to another bridge): the next
		// command names none rather than one the bridge may wait for.
		delete(b.lastOut, cmd.DeviceID)
	}
	delete(b.named, cmd.ID)
	for _, ch := range b.waiters[cmd.ID] {
		select {
		case ch <- cmd:
		default:
		}
	}
}

// idSet holds the ids of the commands most recently added, between
// finalGeneration and twice as many: those seen final here (a reply for
// one of them is dropped at once, intake, where the store would refuse
// it), or changed by another replica (see Submit). Under mu.
type idSet struct {
	recent, older map[string]struct{}
}

// finalGeneration bounds each generation of an idSet: a few megabytes
// for both, and minutes of commands at the rates the soaks run.
const finalGeneration = 1 << 15

func (s *idSet) add(id string) {
	if s.recent == nil || len(s.recent) >= finalGeneration {
		s.older, s.recent = s.recent, make(map[string]struct{}, 1024)
	}
	s.recent[id] = struct{}{}
}

func (s *idSet) has(id string) bool {
	if _, ok := s.recent[id]; ok {
		return true
	}
	_, ok := s.older[id]
	return ok
}
