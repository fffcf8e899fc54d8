package broker

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"
)

// outboxBatch bounds how many commands one pass publishes before it waits
// for their PUBACKs.
const outboxBatch = 500

// outbox publishes queued commands in acceptance order. It runs a pass when
// a command is accepted, after every (re)connect, and every few seconds as a
// safety net. The first pass after start also republishes every command that
// was sent but is not final: a broker that restarted with us (the embedded
// one) lost those not yet delivered, and also the final replies it had
// acknowledged to the bridge but not yet handed to us. The bridge drops an id
// it has queued or running, and answers one it has finished with its final
// reply again (see publishPending).
func (b *Broker) outbox() {
	defer b.wg.Done()
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	firstPass := true
	for {
		select {
		case <-b.quit:
			return
		case <-b.kick:
		case <-b.connected:
		case <-tick.C:
		}
		if !b.client.IsConnectionOpen() || !b.Ready() {
			continue
		}
		b.mu.Lock()
		devices := b.resend
		b.resend = make(map[string]bool)
		b.mu.Unlock()
		if err := b.publishPending(firstPass, devices); err != nil {
			b.log.Warn("outbox pass incomplete; will retry", "err", err)
			b.mu.Lock()
			for d := range devices {
				b.resend[d] = true
			}
			b.mu.Unlock()
			continue
		}
		firstPass = false
	}
}

// publishPending publishes every queued command, oldest first, together
// with the sent but not final commands of the given devices (of every device
// with all set), so that each device's commands go out in order.
//
// Delivered and in-progress commands go out again too: their final reply
// may be lost for good (the bridge's final reply was acknowledged by a broker
// that then died, or by the embedded broker of a server killed before it
// stored the reply). A bridge that finished the command answers the repeat
// with its final reply; one that has it queued or running drops it.
func (b *Broker) publishPending(all bool, devices map[string]bool) error {
	ctx := context.Background()
	states := []string{topics.StateQueued}
	if all || len(devices) > 0 {
		states = append(states, topics.StateSent, topics.StateDelivered, topics.StateInProgress)
	}
	open, err := b.st.OpenCommands(ctx, states...)
	if err != nil {
		return err
	}
	cmds := open[:0]
	for _, c := range open {
		if c.State == topics.StateQueued || all || devices[c.DeviceID] {
			cmds = append(cmds, c)
		}
	}
	for len(cmds) > 0 {
		n := min(len(cmds), outboxBatch)
		if err := b.publishBatch(ctx, cmds[:n]); err != nil {
			return err
		}
		cmds = cmds[n:]
		select {
		case <-b.quit:
			return ErrClosed
		default:
		}
	}
	return nil
}

type inflight struct {
	cmd store.Command
	tok mqtt.Token
}

func (b *Broker) publishBatch(ctx context.Context, cmds []store.Command) error {
	now := b.now()
	var pending []inflight
	for _, c := range cmds {
		// The TTL bounds delivery: a command the bridge has is never
		// expired, and its repeat fetches its final reply.
		undelivered := c.State == topics.StateQueued || c.State == topics.StateSent
		if undelivered && now.After(c.ExpiresAt) {
			b.expire(ctx, c.ID)
			continue
		}
		topic, err := b.tree.Command(c.DeviceID, c.Op)
		if err != nil {
			b.log.Error("command with an unpublishable topic", "command_id", c.ID, "err", err)
			continue
		}
		msg, err := json.Marshal(topics.Command{
			ID:        c.ID,
			Op:        c.Op,
			DeviceID:  c.DeviceID,
			CreatedAt: c.CreatedAt.UTC(),
			ExpiresAt: c.ExpiresAt.UTC(),
			Payload:   c.Payload,
		})
		if err != nil {
			return err
		}
		pending = append(pending, inflight{cmd: c, tok: b.client.Publish(topic, 1, false, msg)})
	}

	// Mark what the broker acknowledged as sent. Batch groups these writes.
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		lastErr error
	)
	sem := make(chan struct{}, 16)
	for _, p := range pending {
		if err := mqtt.WaitTokenTimeout(p.tok, b.opts.PublishTimeout); err != nil {
			mu.Lock()
			lastErr = err
			mu.Unlock()
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func(id string) {
			defer wg.Done()
			defer func() { <-sem }()
			_, err := b.st.UpdateCommand(ctx, id, func(c *store.Command) error {
				if c.State != topics.StateQueued {
					return errStale // a reply got there first, or it was canceled
				}
				c.State = topics.StateSent
				return nil
			})
			if err != nil && !errors.Is(err, errStale) && !errors.Is(err, store.ErrFinal) {
				mu.Lock()
				lastErr = err
				mu.Unlock()
			}
		}(p.cmd.ID)
	}
	wg.Wait()
	return lastErr
}

// sweep expires commands whose TTL passed before delivery and, hourly,
// forgets idempotency keys older than a day and final commands older than
// the retention.
func (b *Broker) sweep() {
	defer b.wg.Done()
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
		cmds, err := b.st.ExpiredCommands(ctx, now)
		if err != nil {
			b.log.Error("expiry sweep", "err", err)
			continue
		}
		for _, c := range cmds {
			if b.expiredAt(c, now) {
				b.expire(ctx, c.ID)
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
			lastPurge = now
		}
	}
}

// expiredAt reports whether the server may end c as expired at now. A
// queued command expires with its TTL: it never left the store. A sent one
// may already be in the bridge's hands, its delivered reply on the way (the
// bridge runs nothing past expires_at by its own clock): it expires only
// ExpiryGrace later, so that such a reply lands first.
func (b *Broker) expiredAt(c store.Command, now time.Time) bool {
	switch c.State {
	case topics.StateQueued:
		return now.After(c.ExpiresAt)
	case topics.StateSent:
		return now.After(c.ExpiresAt.Add(b.opts.ExpiryGrace))
	}
	return false
}

// expire ends a command that was not delivered in time.
func (b *Broker) expire(ctx context.Context, id string) {
	now := b.now()
	cmd, err := b.st.UpdateCommand(ctx, id, func(c *store.Command) error {
		if !b.expiredAt(*c, now) {
			return errStale
		}
		c.State = topics.StateExpired
		c.Error = &store.CommandError{Code: "expired", Message: "the command was not delivered before it expired"}
		return nil
	})
	if err != nil {
		return
	}
	b.log.Info("command expired", "command_id", id, "device_id", cmd.DeviceID)
	b.notify(cmd)
}
