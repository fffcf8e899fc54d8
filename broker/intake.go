package broker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/internal/retry"
	"github.com/devicecompanion/companion/topics"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// served reports whether a message about deviceID may be taken in: the
// device is served by a bridge, by bridgeID when the message names one
// (a status does). bridge is the device's, as read (err when the read
// failed: the message is dropped). The broker's rights keep a bridge to
// the devices it serves; what slips past them (a broker without them, a
// race with a move) is dropped here, and logged (CONTRACT §9).
func (b *Broker) served(deviceID, bridgeID, bridge string, err error) bool {
	if err != nil {
		b.log.Error("reading a device's bridge; message dropped", "device_id", deviceID, "err", err)
		return false
	}
	switch {
	case bridge == "":
		b.noisy.Warn("unserved\x00"+deviceID, "message for a device no bridge serves; dropped", "device_id", deviceID, "bridge_id", bridgeID)
		return false
	case bridgeID != "" && bridge != bridgeID:
		b.noisy.Warn("not its bridge\x00"+deviceID, "message from a bridge that does not serve the device; dropped", "device_id", deviceID, "bridge_id", bridgeID, "serving", bridge)
		return false
	}
	return true
}

// DeviceMoved says a device changed bridges, or lost its bridge: those of
// its commands the bridge it left had fail (failLeft), and the others go
// again, to whichever bridge serves it now (those of a device no bridge
// serves wait queued). Only the dispatcher publishes: a replica that does
// not dispatch tells it (tellMoved), whichever replica the move came to.
// The commands fail first, so that no pass of the outbox sends them to the
// new bridge.
func (b *Broker) DeviceMoved(deviceID string) {
	b.failLeft(context.Background(), deviceID)
	b.resendDevice(deviceID)
	b.goOwned(func() {
		b.publishUnserved(deviceID)
		// The settings its old bridge left retained name no bridge: taken
		// in again as the server subscribes anew (a restart, a broker
		// back), they read as the device's, with the old bridge's seq, and
		// the new bridge's reports, its clock behind, were refused for up
		// to a day (docs/reliability.md, bug 244). Cleared, the new
		// bridge's are the next. One goroutine for all: a bulk move
		// starts one per device.
		b.clearDropped(deviceID, "settings", b.tree.Settings)
		// A reply the bridge it left published retained, which Mosquitto
		// and NATS keep (the embedded broker does not): a user's own
		// bridge could leave one of its making for the device's next
		// owner's watcher to read on every subscription (bug 347).
		b.clearDropped(deviceID, "replies", b.tree.Replies)
	})
	if b.opts.Dispatcher != nil && !b.dispatching() {
		b.tellMoved(deviceID)
	}
}

// resendDevice has the outbox send the device's unfinished commands again,
// if this replica dispatches, to the device's bridge of now: its first names
// none to run after (its new bridge never had the last one out).
func (b *Broker) resendDevice(deviceID string) {
	b.mu.Lock()
	b.resend[deviceID] = true
	delete(b.lastOut, deviceID)
	delete(b.awayDevices, deviceID) // read again: its bridge may be another
	// Its new bridge never had them: none is held back as a repeat.
	delete(b.repeats, deviceID)
	delete(b.held, deviceID)
	b.mu.Unlock()
	b.wake()
}

// tellMoved tells the replicas, and so the dispatcher, that a device
// changed bridges: the dispatcher sends its unfinished commands again
// (takeMoved), as DeviceMoved does on the dispatcher itself. The store
// says nothing of a move to the other replicas (its notifications are of
// commands), and without this the device's commands sent to its old
// bridge waited for the new bridge's next "online", or for retrySent a
// minute later (and only while the device read online). Should the
// dispatcher change meanwhile, the new one sends every open command again
// anyway.
func (b *Broker) tellMoved(deviceID string) {
	tok := b.client.Publish(b.moved, 1, false, []byte(deviceID))
	b.goOwned(func() {
		if err := b.waitToken(tok); err != nil && !errors.Is(err, ErrClosed) {
			b.log.Warn("telling the dispatcher of a device moved failed; its commands go with the new bridge's next online, or the retry of sent ones",
				"device_id", deviceID, "err", err)
		}
	})
}

// takeMoved takes another replica's word that a device changed bridges
// (tellMoved).
func (b *Broker) takeMoved(payload []byte) {
	id := string(payload)
	if !topics.ValidDeviceID(id) {
		b.log.Warn("bad word of a device moved", "payload", id)
		return
	}
	b.resendDevice(id)
}

// moveWordWait bounds how long a move waits for the word of the bridge a
// device leaves on the commands on their way to it (PrepareMove). A bridge
// that took a command says "delivered" deliveredDelay (a quarter of a
// second) after it took it, or its final reply sooner.
const moveWordWait = 2 * time.Second

// moveWordRecent is how recent a command's PUBACK, or its "sent", must be
// for a move to wait for the bridge's word on it: a bridge that took one
// longer ago has answered, and the word on an older one was lost.
const moveWordRecent = 10 * time.Second

// moveWordPoll is how often a move's wait reads the commands again: their
// word may come in on another replica.
const moveWordPoll = 100 * time.Millisecond

// PrepareMove is called before devices' bridge changes in the store (a
// move, or the deletion of the bridge serving them): it waits for the word
// of their bridge on their commands on their way to it, published and not
// answered (queued on disk still, or written sent) within moveWordRecent,
// for moveWordWait at most for all of them, and holds their commands in
// the outbox until release, which the caller calls once the store has the
// change (or refused it), before DeviceMoved.
//
// The bridge says "delivered" only a quarter of a second after it takes a
// command (agent's deliveredDelay), and may hand it to the device at once.
// Read queued or sent at the move, such a command went to the new bridge
// as well, and the device was handed it twice; and the bridge's word came
// too late, dropped, the broker's rights having moved with the store
// (docs/reliability.md, bug 509). Before the move the word comes in, and
// DeviceMoved fails what the bridge had (failLeft). What has no word by
// then it never had, or its word is lost: that goes to the new bridge, as
// before. Held in the outbox meanwhile, none of the device's commands goes
// to the bridge it leaves. Only the dispatcher knows what is flying: a
// replica that does not dispatch waits for the recent queued ones too, and
// reads the store again every moveWordPoll, the word coming in on the
// dispatcher (bug 554).
func (b *Broker) PrepareMove(deviceIDs ...string) (release func()) {
	b.mu.Lock()
	for _, id := range deviceIDs {
		b.moving[id]++
	}
	b.moves.Add(int32(len(deviceIDs)))
	b.mu.Unlock()
	var once sync.Once
	release = func() {
		once.Do(func() {
			b.mu.Lock()
			b.moves.Add(-int32(len(deviceIDs)))
			for _, id := range deviceIDs {
				if b.moving[id]--; b.moving[id] <= 0 {
					delete(b.moving, id)
				}
			}
			b.scan = true // what the outbox held meanwhile is queued on disk
			b.mu.Unlock()
			b.wake()
		})
	}
	ctx := context.Background()
	var ids []string
	for _, dev := range deviceIDs {
		ids = append(ids, b.onTheirWay(ctx, dev)...)
	}
	b.awaitWord(ctx, deviceIDs, ids)
	return release
}

// onTheirWay returns the device's commands on their way to its bridge
// (PrepareMove): published and unanswered, or written sent, within
// moveWordRecent.
func (b *Broker) onTheirWay(ctx context.Context, deviceID string) []string {
	open, err := b.st.CountOpen(ctx, deviceID)
	if err != nil || open == 0 {
		return nil // failLeft logs a failed read
	}
	now, real := b.now(), time.Now()
	// What is on its way only the dispatcher knows (flying): a replica
	// that does not dispatch waits for the recent queued ones too, which
	// may be (bug 554).
	blind := !b.dispatching()
	var ids []string
	q := companion.CommandQuery{DeviceID: deviceID, Limit: 100}
	for open > 0 {
		page, more, err := b.st.ListCommands(ctx, q)
		if err != nil {
			break
		}
		b.mu.Lock()
		for _, c := range page {
			if companion.IsFinal(c.State) {
				continue
			}
			open--
			o := b.flying[c.ID]
			switch {
			case c.State == companion.StateQueued && o != nil && o.published:
				if o.acked.IsZero() || real.Sub(o.acked) < moveWordRecent { // its PUBACK to come, or come
					ids = append(ids, c.ID)
				}
			case c.State == companion.StateQueued && blind:
				if now.Sub(c.CreatedAt) < moveWordRecent {
					ids = append(ids, c.ID)
				}
			case c.State == companion.StateSent:
				if now.Sub(c.UpdatedAt) < moveWordRecent {
					ids = append(ids, c.ID)
				}
			}
		}
		b.mu.Unlock()
		if !more {
			break
		}
		q.Before = page[len(page)-1].ID
	}
	return ids
}

// awaitWord waits for the word of the devices' bridges on ids, their
// commands on their way (PrepareMove), moveWordWait at most for all of
// them. A reply taken in, or "sent" written, wakes it (landAs), and it
// reads the command again: a reply that is not final notifies no Wait.
func (b *Broker) awaitWord(ctx context.Context, deviceIDs, ids []string) {
	if len(ids) == 0 {
		return
	}
	ch := make(chan struct{}, 1) // a wake pending reads every one again
	b.mu.Lock()
	for _, id := range ids {
		b.words[id] = append(b.words[id], ch)
	}
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		for _, id := range ids {
			list := slices.DeleteFunc(b.words[id], func(c chan struct{}) bool { return c == ch })
			if len(list) == 0 {
				delete(b.words, id)
			} else {
				b.words[id] = list
			}
		}
	}()
	// Without a word yet: read again now that a word wakes this, so that
	// none that came in meanwhile is missed.
	waiting := map[string]bool{}
	heard := func(id string) bool {
		c, err := b.st.Command(ctx, id)
		return err != nil || c.State != companion.StateQueued && c.State != companion.StateSent
	}
	for _, id := range ids {
		if !heard(id) {
			waiting[id] = true
		}
	}
	if len(waiting) == 0 {
		return
	}
	b.log.Info("moving a device: waiting for its bridge's word on the commands on their way to it", movedDevices(deviceIDs), "commands", len(waiting))
	t := time.NewTimer(moveWordWait)
	defer t.Stop()
	// Another replica may take the word in (its store is this one's):
	// it wakes nothing here, and is read again every moveWordPoll.
	poll := time.NewTicker(moveWordPoll)
	defer poll.Stop()
	for len(waiting) > 0 {
		select {
		case <-ch:
		case <-poll.C:
		case <-t.C:
			b.log.Info("moving a device: no word from its bridge on commands on their way to it; they go to its new bridge", movedDevices(deviceIDs), "commands", len(waiting))
			return
		case <-b.quit:
			return
		}
		for id := range waiting {
			if heard(id) {
				delete(waiting, id)
			}
		}
	}
}

// movedDevices is the log attribute naming the devices of a move: the
// device's id, or how many there are when a deleted bridge served many.
func movedDevices(deviceIDs []string) slog.Attr {
	if len(deviceIDs) == 1 {
		return slog.String("device_id", deviceIDs[0])
	}
	return slog.Int("devices", len(deviceIDs))
}

// failLeft fails the commands of a device that changed bridges that the
// bridge it left had (delivered, in progress). That bridge may have run
// them, or be running them, but what it says of them now is refused by the
// MQTT broker or dropped here (served). Sent to the device's new bridge, as
// every unfinished command is on a move, they would run again there (a text
// shown twice, a firmware flashed twice); left as they are on a device no
// bridge serves, they would read delivered until it had one, and then go to
// it. As with an unbind (companion.EndUnbound), they fail, whether they
// took effect being unknown. Those the bridge did not have yet go to the
// next one (CONTRACT §9).
func (b *Broker) failLeft(ctx context.Context, deviceID string) {
	open, err := b.st.CountOpen(ctx, deviceID)
	if err != nil {
		b.log.Error("counting a device's open commands; those its last bridge had stay as they are", "device_id", deviceID, "err", err)
		return
	}
	// Newest first, until every open command is seen: open commands are
	// mostly recent, the history behind them long.
	var had []string
	q := companion.CommandQuery{DeviceID: deviceID, Limit: 100}
	for open > 0 {
		page, more, err := b.st.ListCommands(ctx, q)
		if err != nil {
			b.log.Error("listing a device's commands; those its last bridge had stay as they are", "device_id", deviceID, "err", err)
			return
		}
		for _, c := range page {
			if !companion.IsFinal(c.State) {
				open--
			}
			if c.State == companion.StateDelivered || c.State == companion.StateInProgress {
				had = append(had, c.ID)
			}
		}
		if !more {
			break
		}
		q.Before = page[len(page)-1].ID
	}
	for _, id := range slices.Backward(had) {
		cmd, err := b.st.UpdateCommand(ctx, id, func(c *companion.Command) error {
			if c.State != companion.StateDelivered && c.State != companion.StateInProgress {
				return errStale
			}
			c.State = companion.StateFailed
			c.Error = &companion.CommandError{Code: companion.CodeDeviceNotServed, Message: "the device was taken off its bridge while the bridge had the command; whether it took effect is not known"}
			return nil
		})
		switch {
		case errors.Is(err, errStale), errors.Is(err, companion.ErrFinal), errors.Is(err, companion.ErrNotFound):
			continue
		case err != nil:
			b.log.Error("failing a command the bridge a device left had", "command_id", id, "err", err)
			continue
		}
		b.opts.Observer.CommandState(cmd.Op, cmd.State, sinceAccepted(b.now(), cmd.CreatedAt))
		b.notify(cmd)
		b.log.Info("command failed: its device left the bridge that had it", "command_id", id, "device_id", deviceID)
	}
}

// BridgesDisconnecting says the bridges are about to be disconnected by the
// broker's accounts, for a change of their rights (a device moved between
// them), and will connect again at once. NATS publishes the Will of a
// connection it closes so: taken in, every device of such a bridge read
// offline, for watchers and in the store, each time one of them moved,
// until the bridge was back a moment later. So the Will of each is held
// for Options.KickGrace, and taken in only if the bridge has not said "online"
// since. Mosquitto's plugin kicks a client without its Will, and the
// embedded broker holds it itself: the API says this only of a broker
// that publishes it (api.WillOnDisconnect). The replicas are told too:
// each holds the Will.
func (b *Broker) BridgesDisconnecting(bridgeIDs ...string) {
	for _, id := range bridgeIDs {
		if !topics.ValidBridgeID(id) {
			continue
		}
		b.noteKicked(id)
		if b.opts.Dispatcher == nil || !b.client.IsConnectionOpen() {
			continue // no replicas; or none to tell now, and no wait in the request that moved the device
		}
		// Sent before the kick, so that the replicas have it, most
		// likely, before the Will; one that has not takes the Will in
		// as before.
		if err := b.waitToken(b.client.Publish(b.kickedAt, 1, false, []byte(id))); err != nil && !errors.Is(err, ErrClosed) {
			b.log.Warn("telling the replicas of a bridge about to be disconnected failed; they take its Will in", "bridge_id", id, "err", err)
		}
	}
}

// BridgesDisconnectingWithoutWill says the bridges are about to be
// disconnected by the broker's accounts, for a change of their rights,
// without their Will, as Mosquitto's plugin does. A bridge lost just then
// (dead, or its link down and its keepalive not yet out) would have no
// Will ever, and its devices read online for ever. So a bridge online
// that has said nothing once Options.KickGrace is over is taken as lost:
// its Will, a retained "offline" on its state topic, is published for it,
// as the embedded broker does (embedded.Server.DisconnectBridge), and
// every replica takes it in. A bridge back has said "online" by then. The
// replica the device moved through does it; should it stop within the
// grace, nobody does.
func (b *Broker) BridgesDisconnectingWithoutWill(bridgeIDs ...string) {
	for _, id := range bridgeIDs {
		topic, err := b.tree.BridgeState(id)
		if err != nil {
			continue
		}
		b.mu.Lock()
		n, away := b.bridgeGen[id], b.away[id]
		b.mu.Unlock()
		if n == 0 || away {
			continue // never heard from, or gone already: there is no Will to stand in for
		}
		b.later(b.opts.KickGrace, func() {
			if !b.latestBridgeState(id, n) {
				return // it said something since
			}
			b.log.Info("bridge not back after it was disconnected for its rights; publishing its Will", "bridge_id", id)
			if err := b.waitToken(b.client.Publish(topic, 1, true, []byte(topics.BridgeOffline))); err != nil && !errors.Is(err, ErrClosed) {
				b.log.Warn("publishing the Will of a bridge not back", "bridge_id", id, "err", err)
			}
		})
	}
}

// noteKicked notes that the bridge is about to be disconnected.
func (b *Broker) noteKicked(bridgeID string) {
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	for id, at := range b.kicked {
		if now.Sub(at) > b.opts.KickGrace {
			delete(b.kicked, id)
		}
	}
	b.kicked[bridgeID] = now
}

// backFromKick forgets that the bridge was said to be disconnected for its
// rights (noteKicked): it says "online" again, so the Will of that
// disconnection came before this (and is held), and an "offline" after it
// is of the bridge stopped or lost since, to be taken in at once. Kept,
// it held such an "offline" for the rest of the grace, the bridge and
// its devices reading online meanwhile (docs/reliability.md, bug 224).
func (b *Broker) backFromKick(bridgeID string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.kicked, bridgeID)
}

// holdKickedWill holds the bridge's Will, its state message n, when the
// bridge was said to be disconnected for its rights within the grace: it
// is taken in once the grace is over, if the bridge has said nothing since.
// It reports whether it held it.
func (b *Broker) holdKickedWill(bridgeID string, n uint64) bool {
	b.mu.Lock()
	at, ok := b.kicked[bridgeID]
	b.mu.Unlock()
	wait := b.opts.KickGrace - time.Since(at)
	if !ok || wait <= 0 {
		return false
	}
	b.log.Info("the Will of a bridge disconnected for its rights held", "bridge_id", bridgeID, "for", wait)
	b.later(wait, func() {
		if b.latestBridgeState(bridgeID, n) {
			b.bridgeOffline(bridgeID, n, func() {}, 1)
		}
	})
	return true
}

// bridgeOffline takes a bridge's Will, the bridge's state message n
// (noteBridgeState): every device it served reads offline. What the store
// fails to take is taken again (bridgeStateAgain).
func (b *Broker) bridgeOffline(bridgeID string, n uint64, ack func(), attempt int) {
	if attempt > 1 && !b.latestBridgeState(bridgeID, n) {
		ack() // the bridge said something since: that holds now
		return
	}
	start := time.Now()
	b.st.MarkBridgeOfflineAsync(bridgeID, func(ids []string, err error) {
		b.opts.Observer.StoreWrite(StoreWriteOffline, time.Since(start))
		if err != nil {
			if b.bridgeStateAgain(bridgeID, n, attempt, func(attempt int) { b.bridgeOffline(bridgeID, n, ack, attempt) }) {
				b.log.Warn("marking a bridge's devices offline failed; taking its Will again", "bridge_id", bridgeID, "attempt", attempt, "err", err)
				return
			}
			b.log.Error("marking a bridge's devices offline", "bridge_id", bridgeID, "err", err)
			ack()
			return
		}
		defer ack()
		b.mu.Lock()
		for _, id := range ids {
			delete(b.online, id)
		}
		if b.bridgeGen[bridgeID] == n {
			b.setAway(bridgeID, true) // its devices' commands wait queued (publish)
		}
		b.mu.Unlock()
		b.logState(bridgeID, topics.BridgeOffline, len(ids))
		if len(ids) > 0 {
			b.goOwned(func() { b.publishOffline(bridgeID, n, ids) })
		}
		b.goOwned(func() { b.forgetIfDeleted(bridgeID) })
	})
}

// BridgeDeleted says the bridge was deleted: every replica forgets it
// (forgetBridge), and the MQTT broker no longer retains its state. Call it
// once the store has the deletion, after the broker's accounts closed its
// connections. It publishes without waiting.
func (b *Broker) BridgeDeleted(bridgeID string) {
	b.forgetBridge(bridgeID)
	b.goOwned(func() { b.clearBridgeState(bridgeID) })
}

// forgetIfDeleted forgets the bridge whose Will was taken in, if the store
// has no such bridge, and clears its state again: a bridge's connection
// closed as it was deleted, its Will published as BridgeDeleted cleared
// its state (the MQTT broker may retain either), or a Will retained from
// before a deletion, taken in again at a start. Kept, such a bridge read
// away for good (docs/reliability.md, bug 315).
func (b *Broker) forgetIfDeleted(bridgeID string) {
	if _, err := b.st.Bridge(context.Background(), bridgeID); !errors.Is(err, companion.ErrNotFound) {
		return
	}
	b.log.Info("the Will of a deleted bridge taken in; the bridge is forgotten", "bridge_id", bridgeID)
	b.forgetBridge(bridgeID)
	b.clearBridgeState(bridgeID)
}

// checkAway forgets the bridges taken as away that the store no longer has:
// deleted while this replica did not hear the clear of their state
// (BridgeDeleted), its MQTT connection down then, or while the store could
// not say (forgetIfDeleted).
func (b *Broker) checkAway(ctx context.Context) {
	b.mu.Lock()
	ids := make([]string, 0, len(b.away))
	for id := range b.away {
		ids = append(ids, id)
	}
	b.mu.Unlock()
	for _, id := range ids {
		if _, err := b.st.Bridge(ctx, id); errors.Is(err, companion.ErrNotFound) {
			b.log.Info("a bridge taken as away was deleted; the bridge is forgotten", "bridge_id", id)
			b.forgetBridge(id)
		}
	}
}

// forgetBridge drops what the broker keeps of a bridge: a deleted one, or
// one whose retained state was cleared (as BridgeDeleted clears it).
// Bridges come and go with their users: each one's entries stayed, and one
// away as it went counted among the bridges away (companion_bridges_away)
// for as long as the server ran (docs/reliability.md, bug 315).
func (b *Broker) forgetBridge(bridgeID string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.bridgeGen, bridgeID)
	delete(b.kicked, bridgeID)
	b.stateless.forget(bridgeID)
	b.stateMu.Lock()
	delete(b.stateLines, bridgeID)
	b.stateMu.Unlock()
	b.setAway(bridgeID, false)
	for d, bridge := range b.awayDevices {
		if bridge == bridgeID {
			delete(b.awayDevices, d)
		}
	}
}

// clearBridgeState clears the bridge's retained state on the MQTT broker:
// every replica takes the empty message in and forgets the bridge, and a
// server that starts later is not handed its last Will.
func (b *Broker) clearBridgeState(bridgeID string) {
	topic, err := b.tree.BridgeState(bridgeID)
	if err != nil {
		return
	}
	if err := b.waitToken(b.client.Publish(topic, 1, true, []byte{})); err != nil && !errors.Is(err, ErrClosed) {
		b.log.Warn("clearing the retained state of a deleted bridge", "bridge_id", bridgeID, "err", err)
	}
}

// publishOffline sets the retained status of each device a bridge's Will
// took offline to what the store now says, online: false, so that a watcher
// of devices/{id}/status, and whoever subscribes later, hears what GET
// …/status answers (CONTRACT §3): the bridge, gone, cannot say it, and its
// last retained status said online: true. The report's seq and at are
// kept: taken in again by this server, the message is a report the store
// has already. A device the bridge has reported again since, or whose
// bridge said anything since its Will (n), is left to the bridge.
//
// The bridge may be back by the time the offline status reaches the MQTT
// broker, its "online" statuses retained there already (a Will this
// server takes in late: after a restart, or delivered again after a
// reconnect; or the connection broken under the publish). Each device is
// marked (offline) before its status is read, and the intake, taking
// an online status of a marked device in, publishes the store's status
// again (repairStatus), over the offline one. One it took in before the
// offline status was out is published again here, once every offline one
// is acknowledged.
func (b *Broker) publishOffline(bridgeID string, n uint64, ids []string) {
	ctx := context.Background()
	var (
		toks []mqtt.Token
		sent []string
	)
	for _, id := range ids {
		// Not queued in paho while the connection is down: sent after a
		// reconnect, it could undo what the bridge, back, said meanwhile.
		if !b.latestBridgeState(bridgeID, n) || !b.client.IsConnectionOpen() {
			break
		}
		marked := b.markOffline(id)
		s, err := b.st.Status(ctx, id)
		if err != nil || s.Online || s.BridgeID != bridgeID {
			if !marked {
				b.takeOfflineMark(id)
			}
			continue
		}
		if tok := b.publishStatus(id, s); tok != nil {
			toks = append(toks, tok)
			sent = append(sent, id)
		}
	}
	for _, tok := range toks {
		if err := b.waitToken(tok); err != nil {
			if !errors.Is(err, ErrClosed) {
				b.log.Warn("publishing the offline status of a bridge's devices", "bridge_id", bridgeID, "err", err)
			}
			return
		}
	}
	for _, id := range sent {
		if !b.offlineMarked(id) {
			b.repairStatus(id)
		}
	}
}

// publishStatus publishes s as the device's retained status, through
// paho; nil if it cannot be encoded.
func (b *Broker) publishStatus(deviceID string, s companion.Status) mqtt.Token {
	topic, err := b.tree.Status(deviceID)
	if err != nil {
		return nil
	}
	apps := s.Apps
	if apps == nil {
		apps = []companion.App{}
	}
	payload, err := fastjson.Marshal(topics.Status{Online: s.Online, Battery: s.Battery, FirmwareVersion: s.FirmwareVersion,
		Model: s.Model, Apps: apps, BridgeID: s.BridgeID, At: s.LastSeen, Seq: s.Seq})
	if err != nil {
		return nil
	}
	return b.client.Publish(topic, 1, true, payload)
}

// markOffline marks the device as one whose retained status
// publishOffline may set offline; it reports whether it was marked
// already.
func (b *Broker) markOffline(deviceID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	was := b.offline[deviceID]
	b.offline[deviceID] = true
	return was
}

// offlineMarked reports whether the device is marked.
func (b *Broker) offlineMarked(deviceID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.offline[deviceID]
}

// takeOfflineMark unmarks the device, and reports whether it was marked.
func (b *Broker) takeOfflineMark(deviceID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	was := b.offline[deviceID]
	delete(b.offline, deviceID)
	return was
}

// repairStatus publishes the device's status as the store has it, if
// online, as its retained status: over the offline one publishOffline
// published after the bridge had said the device was online. The bridge's
// next report (StatusInterval) would mend it too, a minute later at most.
// Not while the connection is down, as publishOffline: the bridge's own
// report then holds.
func (b *Broker) repairStatus(deviceID string) {
	b.republishStatus(deviceID, "again over the offline one", func(s companion.Status) bool { return s.Online })
}

// republishStatus publishes the device's status as the store has it, as
// its retained status, when want says so of it, and waits for the MQTT
// broker to take it; a failure is logged, saying what the publish was
// for. Not while the connection is down: queued in paho and sent after a
// reconnect, it could undo what the bridge said meanwhile.
func (b *Broker) republishStatus(deviceID, what string, want func(companion.Status) bool) {
	if !b.client.IsConnectionOpen() {
		return
	}
	s, err := b.st.Status(context.Background(), deviceID)
	if err != nil || !want(s) {
		return
	}
	tok := b.publishStatus(deviceID, s)
	if tok == nil {
		return
	}
	if err := b.waitToken(tok); err != nil && !errors.Is(err, ErrClosed) {
		b.log.Warn("publishing a device's status "+what, "device_id", deviceID, "err", err)
	}
}

// noteBridgeState counts a state message of a bridge taken in, and returns
// its number: one the store failed to take is taken again only while it is
// the bridge's latest (bridgeStateAgain).
func (b *Broker) noteBridgeState(bridgeID string) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	// One count for every bridge: a bridge forgotten (forgetBridge) and
	// made again under its id never has a number it had before.
	b.bridgeStates++
	b.bridgeGen[bridgeID] = b.bridgeStates
	return b.bridgeStates
}

// latestBridgeState reports whether the bridge's state message n is the
// latest taken in.
func (b *Broker) latestBridgeState(bridgeID string, n uint64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.bridgeGen[bridgeID] == n
}

// bridgeStateAgain has again take the bridge's state message n in once
// more after the store failed it on attempt: a little later, and
// unacknowledged meanwhile, as takeReply does with a reply. Acknowledged
// and dropped instead, a Will left the bridge's devices reading online for
// as long as it stayed away, and an "online" sent none of their commands
// again (those whose final reply a crashed broker lost stayed delivered).
// It reports false, and the caller acknowledges and drops the message,
// once a later state of the bridge came (it says what holds now: a late
// Will would undo the "online" after it) or after maxReplyAttempts.
func (b *Broker) bridgeStateAgain(bridgeID string, n uint64, attempt int, again func(attempt int)) bool {
	if attempt >= maxReplyAttempts || !b.latestBridgeState(bridgeID, n) {
		return false
	}
	b.later(replyRetryDelay(attempt), func() { again(attempt + 1) })
	return true
}

// replyRetryDelay is the pause before attempt+1: 100 ms doubling up to
// 10 s, each ±50% (the library's ExponentialBackOff, as in gatt), so that
// replicas whose store came back together do not retry in lockstep. The
// jitter is even on both sides: maxReplyAttempts still spans about ten
// minutes.
func replyRetryDelay(attempt int) time.Duration {
	bo := retry.Backoff(100*time.Millisecond, 10*time.Second)
	// A reply's attempts share no state: step to this one (the interval
	// reaches its cap at the eighth).
	for range min(attempt, 8) - 1 {
		bo.NextBackOff()
	}
	return bo.NextBackOff()
}

// later runs f after d on a goroutine Close waits for, unless the broker
// is closing by then.
func (b *Broker) later(d time.Duration, f func()) {
	time.AfterFunc(d, func() { b.goOwned(f) })
}

// takeAgain calls take a little later (replyRetryDelay) with the device's
// bridge read anew: the next attempt at a reply or report whose read or
// write the store failed, its message unacknowledged meanwhile.
func (b *Broker) takeAgain(deviceID string, attempt int, take func(bridge string, err error)) {
	b.later(replyRetryDelay(attempt), func() {
		bridge, err := b.st.DeviceBridge(context.Background(), deviceID)
		take(bridge, err)
	})
}

// takeReplyAttempt stores a bridge's reply to a command, with the device's
// state that came with it, and once both are on disk calls ack and wakes
// those waiting for the command if it is final: what they read next
// reflects it. bridge is the device's bridge as read (err when the read
// failed); attempt counts the tries, the first one's read made by intake.
func (b *Broker) takeReplyAttempt(deviceID, bridge string, err error, r topics.Reply, ack func(), attempt int) {
	again := func() {
		b.takeAgain(deviceID, attempt, func(bridge string, err error) {
			b.takeReplyAttempt(deviceID, bridge, err, r, ack, attempt+1)
		})
	}
	if err != nil && !errors.Is(err, companion.ErrNotFound) && attempt < maxReplyAttempts {
		// As below: the store failed, the reply waits unacknowledged.
		b.log.Warn("reading a device's bridge failed; taking its reply again", "device_id", deviceID, "attempt", attempt, "err", err)
		again()
		return
	}
	if !b.served(deviceID, "", bridge, err) {
		if err != nil && !errors.Is(err, companion.ErrNotFound) {
			b.replyDropped(deviceID)
		}
		ack()
		return
	}
	// The settings are stored only if the bridge read serves the device
	// still: a move that commits before the write set their seq to 0, and
	// the old bridge's, its clock ahead, held the new bridge's off
	// (docs/reliability.md, bugs 272 and 289).
	report := companion.DeviceReport{BridgeID: bridge}
	switch {
	case r.Status != nil && r.Status.BridgeID != "" && r.Status.BridgeID != bridge:
		// As on the status topic (served): the bridge the device was
		// moved from, say. Its reply says what became of the command; its
		// status would make the device read as that bridge's.
		b.noisy.Warn("foreign status\x00"+deviceID, "reply with a status from a bridge that does not serve the device; storing the reply without it",
			"device_id", deviceID, "command_id", r.CommandID, "bridge_id", r.Status.BridgeID, "serving", bridge)
	case r.Status != nil:
		s := namedBridge(b.storeStatus(deviceID, *r.Status), bridge)
		report.Status = &s
	}
	if r.Settings != nil {
		rs, err := b.reportedSettings(deviceID, *r.Settings)
		if err != nil {
			b.noisy.Warn("bad reply settings\x00"+deviceID, "reply with settings that cannot be stored; storing the reply without them", "device_id", deviceID, "command_id", r.CommandID, "err", err)
		} else {
			report.Settings = &rs
		}
	}
	// The reply's state is stored whatever admit leaves out.
	report = b.admit(deviceID, report, "command_id", r.CommandID)
	start := time.Now()
	var from string // the state before the reply, for the Observer
	foreign := ""   // the device of the command, when it is not deviceID
	b.st.UpdateCommandWithReportAsync(r.CommandID, func(c *companion.Command) error {
		if c.DeviceID != deviceID {
			foreign = c.DeviceID
			return fmt.Errorf("%w: reply on device %s for a command of %s", errStale, deviceID, c.DeviceID)
		}
		foreign = ""
		switch {
		case companion.Rank(r.State) < companion.Rank(c.State):
			return errStale
		case r.State == c.State && r.State != companion.StateInProgress:
			return errStale
		case r.State == companion.StateInProgress && r.Progress != nil && c.Progress != nil && *r.Progress < *c.Progress:
			return errStale
		}
		from = c.State
		c.State = r.State
		if r.Progress != nil {
			p := *r.Progress
			c.Progress = &p
		}
		if r.State == companion.StateSucceeded {
			p := 100
			c.Progress = &p
		}
		if e := replyError(r); e != nil {
			c.Error = e
		}
		if len(r.Result) > 0 {
			c.Result = append(json.RawMessage(nil), r.Result...)
		}
		return nil
	}, report, func(cmd companion.Command, err error) {
		b.opts.Observer.StoreWrite(StoreWriteReply, time.Since(start))
		if err == nil && cmd.State != from {
			b.opts.Observer.CommandState(cmd.Op, cmd.State, sinceAccepted(b.now(), cmd.CreatedAt))
		}
		if err != nil && !errors.Is(err, companion.ErrNotFound) && !errors.Is(err, companion.ErrFinal) &&
			!errors.Is(err, errStale) && !errors.Is(err, companion.ErrInvalid) && !errors.Is(err, companion.ErrUnreadable) &&
			attempt < maxReplyAttempts {
			// The store failed (PostgreSQL restarting, say): the reply is
			// not acknowledged, and is taken again a little later; the
			// bridge's later replies meanwhile are ranked against it.
			b.log.Warn("storing a reply failed; taking it again", "command_id", r.CommandID, "attempt", attempt, "err", err)
			again()
			return
		}
		defer ack()
		if foreign != "" {
			// Not an answer: the command is another device's, whose bridge
			// this is not (a bridge that once served it knows its ids).
			// Taken as one, it had this replica forget the command was on
			// its way (land), so that "sent" was never written for it
			// (docs/reliability.md, bug 139).
			b.noisy.Warn("foreign reply\x00"+deviceID, "reply for a command of another device ignored", "device_id", deviceID, "command_id", r.CommandID, "command_device_id", foreign)
			return
		}
		if (err == nil || errors.Is(err, errStale)) && !companion.IsFinal(cmd.State) {
			b.arrived(r.CommandID) // the bridge has it: no "sent" to write
		} else {
			b.land(r.CommandID) // ended, or never to go
		}
		switch {
		case errors.Is(err, companion.ErrNotFound):
			b.noisy.Warn("unknown reply\x00"+deviceID, "reply for an unknown command ignored", "device_id", deviceID, "command_id", r.CommandID)
		case errors.Is(err, companion.ErrFinal), errors.Is(err, errStale):
			b.log.Debug("stale reply ignored", "command_id", r.CommandID, "state", r.State, "err", err)
			if companion.IsFinal(cmd.State) {
				// Final already (ErrFinal comes with the stored command):
				// perhaps another replica took the final reply first, or
				// the command was canceled there. Those waiting here have
				// it now, and it is no longer live here.
				b.notify(cmd)
				break
			}
			// Another replica took a later reply: this one no longer
			// follows the command's state, and must not keep it live
			// (see Wait).
			b.mu.Lock()
			delete(b.live, r.CommandID)
			b.mu.Unlock()
		case errors.Is(err, companion.ErrUnreadable):
			// The store has taken it out of the unfinished commands, and
			// logged it: nothing to store, and no use sending it again.
			b.noisy.Warn("undecodable reply\x00"+deviceID, "reply for a command whose record does not decode ignored", "device_id", deviceID, "command_id", r.CommandID, "state", r.State)
		case err != nil:
			b.log.Error("storing a reply", "command_id", r.CommandID, "err", err)
			if !errors.Is(err, companion.ErrInvalid) {
				b.replyDropped(deviceID)
			}
		case companion.IsFinal(cmd.State):
			b.notify(cmd)
		}
	})
}

// replyError is the error a command reads after its bridge's reply r:
// the bridge's own, or, for a final state the bridge said without one (or
// with one that has no code), the error that state implies. The bridge's
// word on an expiry is the state alone (agent/spool.go): the command reads
// as one the server expired (docs/reliability.md, bug 512). A `failed`
// with no code had a client that shows error.message, or tells a failure
// by error.code, show nothing (bug 555); its message, when it has one, is
// kept. A code not of the contract's form (topics.ValidErrorCode) is taken
// as none, and quoted in the message alone: served as it came, "Bad
// Code!" or 10 KB of it was the error.code a client tells a failure by
// (bug 569). Other states carry no error (topics.ParseReply drops it).
func replyError(r topics.Reply) *companion.CommandError {
	if r.Error != nil && r.Error.Code != "" {
		return &companion.CommandError{Code: r.Error.Code, Message: r.Error.Message}
	}
	var e *companion.CommandError
	switch r.State {
	case companion.StateExpired:
		e = errExpired()
	case companion.StateCanceled:
		e = &companion.CommandError{Code: "canceled", Message: "canceled by its bridge"}
	case companion.StateFailed:
		e = &companion.CommandError{Code: "device_error", Message: "failed on its bridge, which gave no reason"}
		if r.Error != nil && r.Error.BadCode != "" {
			e.Message = "failed on its bridge"
		}
	default:
		return nil
	}
	if r.Error != nil && r.Error.Message != "" {
		e.Message = r.Error.Message
	}
	if r.Error != nil && r.Error.BadCode != "" {
		e.Message += fmt.Sprintf(" (the bridge gave the error code %q, which is not a code)", r.Error.BadCode)
	}
	return e
}

// replyDropped has the device's unfinished commands sent again, once the
// store is back, after a reply of the device was dropped because the store
// failed it maxReplyAttempts times (ten minutes): the bridge answers one it
// finished with its final reply again, and one it holds with "delivered".
// Without this a command whose final reply was dropped stayed delivered
// until its bridge next came back, which a bridge that stays connected
// never does: retrySent sends again only the commands written sent. While
// the store is down the outbox's read fails and is tried again.
func (b *Broker) replyDropped(deviceID string) {
	b.mu.Lock()
	b.resend[deviceID] = true
	b.mu.Unlock()
	b.wake()
	b.log.Warn("a reply of the device was dropped; its unfinished commands go again for the bridge to answer anew", "device_id", deviceID)
}

// admit returns what of a device's report the store may take: a status or
// settings whose seq, read as a time, is more than companion.MaxSeqAhead
// past the server's clock is left out, and logged with attrs (where it came from).
// Every report the broker stores goes through it: the status and settings
// topics (takeStatus, takeSettings) and a final reply's (takeReply).
func (b *Broker) admit(deviceID string, r companion.DeviceReport, attrs ...any) companion.DeviceReport {
	limit := companion.SeqLimit(b.now())
	if r.Status != nil && r.Status.Seq > limit {
		b.log.Warn("status whose seq is far past the server's clock (is the bridge's clock wrong?); not stored",
			append([]any{"device_id", deviceID, "bridge_id", r.Status.BridgeID, "seq", r.Status.Seq}, attrs...)...)
		r.Status = nil
	}
	if r.Settings != nil && r.Settings.Seq > limit {
		b.log.Warn("settings whose seq is far past the server's clock (is the bridge's clock wrong?); not stored",
			append([]any{"device_id", deviceID, "seq", r.Settings.Seq}, attrs...)...)
		r.Settings = nil
	}
	return r
}

// takeStatus stores the status of a device a bridge serves (served: so it
// is provisioned, as the stores assign only devices of the registry), then
// calls ack. bridge is the device's bridge as intake read it for its batch
// (bug 98), or readErr. live says the broker sent it as it was published,
// not as the retained status of a subscription made.
func (b *Broker) takeStatus(deviceID string, s topics.Status, bridge string, readErr error, live bool, ack func()) {
	if s.BridgeID == "" && !s.Online && bridge == "" && readErr == nil {
		// The status of a device no bridge serves, as the store has it:
		// published by a server as the device left its bridge
		// (publishUnserved), come back.
		ack()
		return
	}
	kept := false
	if !s.Online && s.FirmwareVersion == "" {
		s, kept = b.keepKnown(deviceID, s)
	}
	st := b.storeStatus(deviceID, s)
	if b.admit(deviceID, companion.DeviceReport{Status: &st}).Status == nil {
		if live {
			// Retained by the broker all the same: the store's goes over
			// it (bug 352).
			b.goOwned(func() { b.overwriteRefusedStatus(deviceID, "over one whose seq is far past the server's clock") })
		}
		ack()
		return
	}
	dropped := func() {
		if live {
			b.goOwned(func() { b.overwriteRefusedStatus(deviceID, "over one from a bridge that does not serve the device") })
		}
	}
	b.takeReport("status", deviceID, s.BridgeID, bridge, readErr, ack, 1, dropped, func(bridge string, done func(error)) {
		st := namedBridge(st, bridge)
		start := time.Now()
		b.st.PutStatusAsync(st, func(applied bool, err error) {
			b.opts.Observer.StoreWrite(StoreWriteStatus, time.Since(start))
			if err == nil {
				b.sawDevice(deviceID, s.Online)
				if s.Online && live {
					b.heardFrom(st.BridgeID)
				}
				switch {
				case s.Online && b.takeOfflineMark(deviceID):
					b.goOwned(func() { b.repairStatus(deviceID) })
				case !applied && live:
					b.goOwned(func() { b.mendRetained(deviceID, st) })
				case kept && live:
					// The broker retains the bridge's status, which knew
					// nothing: watchers get what the store has over it.
					b.goOwned(func() {
						b.republishStatus(deviceID, "with what its bridge did not know", func(cur companion.Status) bool {
							return cur.Seq == st.Seq && cur.FirmwareVersion != ""
						})
					})
				}
			}
			done(err)
		})
	})
}

// namedBridge returns s, a status taken from bridge, the bridge serving
// the device, naming that bridge when it is online and names none: only
// the device's bridge may publish its status (CONTRACT §9; the server
// drops one naming another), so a status that leaves bridge_id out is
// that bridge's. Stored naming none, the device read online with no
// bridge, and its bridge's Will, which marks offline the devices whose
// status names it (MarkBridgeOffline), left it online for good
// (docs/reliability.md, bug 570). An offline status naming none is taken
// as it is: the server publishes one for a device that lost its bridge
// (publishUnserved), and it names no bridge to mark offline.
func namedBridge(s companion.Status, bridge string) companion.Status {
	if s.Online && s.BridgeID == "" {
		s.BridgeID = bridge
	}
	return s
}

// keepKnown fills s, an offline status that knows nothing of the device
// (no firmware version: a bridge that never read it and cannot now, as
// one a device just moved to, or one whose spool was lost), with what the
// store has of it: firmware version, model, battery and, unless s lists
// some, apps. It reports whether it did. Taken whole, such a status wiped
// them: GET …/status read no firmware version and GET …/apps no apps until
// a bridge read the device again (docs/reliability.md, bug 230). An online
// status is the device's own, read: it is taken as it is.
func (b *Broker) keepKnown(deviceID string, s topics.Status) (topics.Status, bool) {
	cur, err := b.st.Status(context.Background(), deviceID)
	if err != nil || cur.FirmwareVersion == "" {
		return s, false // nothing known, or unreadable now: s as it is
	}
	s.FirmwareVersion, s.Model, s.Battery = cur.FirmwareVersion, cur.Model, cur.Battery
	if len(s.Apps) == 0 {
		s.Apps = cur.Apps
	}
	return s, true
}

// mendRetained publishes the device's status as the store has it when
// the store holds a newer one than taken, a status published and refused
// as older: the broker retains the last status published to the topic,
// whatever its seq, and a watcher, or anyone subscribing later, read the
// older one until the bridge's next report (CONTRACT §3: an older status
// never overwrites the stored one). Such a status comes late (a repeat
// the broker delivered again, bug 104's repair overtaken by a report), or
// from a bridge whose clock went back. The server's own publish comes back
// with the store's seq, not older: nothing more is published. Only for
// live messages: the retained statuses a subscription brings are as many
// as the devices, at every reconnect, and each would cost a read.
func (b *Broker) mendRetained(deviceID string, taken companion.Status) {
	b.republishStatus(deviceID, "over an older one", func(s companion.Status) bool {
		return companion.Newer(s.Seq, s.LastSeen, taken.Seq, taken.LastSeen, b.now())
	})
}

// publishUnserved publishes the status of a device that no bridge serves
// any more, or that moved to another bridge, as the store has it (offline,
// no bridge): the broker retained the last its old bridge reported, online,
// and that bridge will not report it now (CONTRACT §9: the device reads
// offline). The new bridge's first report, if it has the device, follows.
func (b *Broker) publishUnserved(deviceID string) {
	b.republishStatus(deviceID, "of a device that lost its bridge", func(s companion.Status) bool {
		// Served again, or never reported: nothing retained to mend.
		return !s.Online && s.BridgeID == "" && !s.LastSeen.IsZero()
	})
}

// overwriteRefusedStatus publishes the device's status as the store has it
// over one the server refused, what says why, which the broker retains: a
// status whose seq is far past the server's clock (admit; bug 352), or
// one the server dropped (served): a bridge that does not serve the
// device published it, and the broker let it through. NATS
// does so with the Will of a bridge it disconnects for a move (with the
// rights of its login, the device's still), and a bridge may leave its
// Will on its device's status topic: the device's next owner, or anyone
// watching it, read that bridge's word over the server's, online with the
// firmware it made up (docs/reliability.md, bug 242). A device never
// reported has its retained status cleared.
func (b *Broker) overwriteRefusedStatus(deviceID, what string) {
	s, err := b.st.Status(context.Background(), deviceID)
	if err != nil {
		return
	}
	if s.LastSeen.IsZero() && s.Seq == 0 && s.FirmwareVersion == "" {
		b.clearDropped(deviceID, "status", b.tree.Status)
		return
	}
	b.republishStatus(deviceID, what, func(companion.Status) bool { return true })
}

// clearDropped clears the retained message on the device's topic of what
// (its settings; its status never reported), which a bridge that does not
// serve the device published and the server dropped (bug 242), or which
// the bridge it left published (DeviceMoved: its settings, and a reply
// it published retained). The empty message comes back
// to the server, which takes it as a cleared one.
func (b *Broker) clearDropped(deviceID, what string, topicOf func(string) (string, error)) {
	topic, err := topicOf(deviceID)
	if err != nil || !b.client.IsConnectionOpen() {
		return
	}
	if err := b.waitToken(b.client.Publish(topic, 1, true, []byte{})); err != nil && !errors.Is(err, ErrClosed) {
		b.log.Warn("clearing the retained "+what+" a bridge that does not serve the device published", "device_id", deviceID, "err", err)
	}
}

// takeReport takes a device's status or settings in (what names which),
// once its bridge is read: bridge, or readErr. If a bridge serves the
// device (bridgeID, when set, must be that one), put stores the report
// (given that bridge, which the store checks serves the device still) and
// calls done with the store's error; then ack. A read of the bridge or
// a write that the store fails is tried again a little later, the message
// unacknowledged meanwhile, as a reply's is (takeReplyAttempt), up to
// maxReplyAttempts: dropped, as it was, the device read as its report
// before said until its bridge's next one, up to a minute later (the
// bridge reports every StatusInterval), and while PostgreSQL restarted,
// an "online" lost so left a device reading offline (docs/reliability.md,
// bug 101). A later report of the device taken meanwhile is not undone:
// the stores keep the highest seq. dropped, when set, is called for a
// report dropped because no bridge, or another, serves the device.
func (b *Broker) takeReport(what, deviceID, bridgeID, bridge string, readErr error, ack func(), attempt int, dropped func(), put func(bridge string, done func(error))) {
	again := func() {
		b.takeAgain(deviceID, attempt, func(bridge string, err error) {
			b.takeReport(what, deviceID, bridgeID, bridge, err, ack, attempt+1, dropped, put)
		})
	}
	if readErr != nil && !errors.Is(readErr, companion.ErrNotFound) && attempt < maxReplyAttempts {
		b.log.Warn("reading a device's bridge failed; taking its "+what+" again", "device_id", deviceID, "attempt", attempt, "err", readErr)
		again()
		return
	}
	if !b.served(deviceID, bridgeID, bridge, readErr) {
		if readErr == nil && dropped != nil {
			dropped()
		}
		ack()
		return
	}
	put(bridge, func(err error) {
		if err != nil && !errors.Is(err, companion.ErrInvalid) && !errors.Is(err, companion.ErrNotFound) && attempt < maxReplyAttempts {
			b.log.Warn("storing a device's "+what+" failed; taking it again", "device_id", deviceID, "attempt", attempt, "err", err)
			again() // with its bridge read anew, as a reply's
			return
		}
		if err != nil {
			b.log.Error("storing a device's "+what, "device_id", deviceID, "err", err)
		}
		ack()
	})
}

// sawDevice notes whether a device is online. The first time a device is
// seen online after start, or after it went offline, its bridge has just
// (re)subscribed: commands sent earlier may have reached a broker that had no
// session for the bridge (a first connection, a broker restarted without its
// queue, an expired session) and been dropped. The outbox publishes them
// again; the bridge drops any it already has.
func (b *Broker) sawDevice(deviceID string, online bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !online {
		delete(b.online, deviceID)
		return
	}
	if b.online[deviceID] {
		return
	}
	b.online[deviceID] = true
	b.resend[deviceID] = true
	b.wake()
}

// setAway takes the bridge as away or back, and tells the observer how
// many are away when that changed. b.mu is held.
func (b *Broker) setAway(bridgeID string, away bool) {
	if b.away[bridgeID] == away {
		return
	}
	if away {
		b.away[bridgeID] = true
	} else {
		delete(b.away, bridgeID)
	}
	b.opts.Observer.BridgesAway(len(b.away))
}

// heardFrom takes a device's status as its bridge published it (not
// retained) as word that the bridge is there: one taken as away (its Will
// the last of its state messages) is back. Its Will came after it was back,
// or its "online" was lost: left away, its devices' commands waited for its
// next "online", which a bridge that stays connected never sends, until
// they expired. Those held go now.
func (b *Broker) heardFrom(bridgeID string) {
	b.heardLive(bridgeID)
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.away[bridgeID] {
		return
	}
	b.setAway(bridgeID, false)
	for d, bridge := range b.awayDevices {
		if bridge == bridgeID {
			b.resend[d] = true
			delete(b.awayDevices, d)
		}
	}
	b.wake()
	b.log.Warn("a bridge taken as away reported a device: it is back; its devices' held commands go", "bridge_id", bridgeID)
}

// bridgeOnline takes a bridge's "online": the bridge has just connected and
// subscribed (it says so only after its SUBACK). Its devices' commands that
// are not final go out again. Without this, a broker that crashed (SIGKILL,
// power loss) between its autosaves takes with it the commands it had
// acknowledged to us but not yet handed to the bridge, and the final replies
// it had acknowledged to the bridge but not yet handed to us; no Will fires
// in a crash, so sawDevice would see no device come back online, and those
// commands would stay sent or delivered forever. The bridge drops the ids it
// has queued or running and answers those it finished with their final reply.
//
// It is the bridge's state message n (noteBridgeState); the store failing,
// it is taken again (bridgeStateAgain).
func (b *Broker) bridgeOnline(bridgeID string, n uint64, ack func(), attempt int) {
	b.mu.Lock()
	latest := b.bridgeGen[bridgeID] == n
	if latest {
		// Back: its devices' commands held queued go out with the
		// resend below, or with the outbox's next read of the store.
		b.setAway(bridgeID, false)
	}
	b.mu.Unlock()
	if attempt > 1 && !latest {
		ack() // the bridge said something since: that holds now
		return
	}
	ids, err := b.st.ServedDevices(context.Background(), bridgeID)
	if err != nil {
		if b.bridgeStateAgain(bridgeID, n, attempt, func(attempt int) { b.bridgeOnline(bridgeID, n, ack, attempt) }) {
			b.log.Warn("listing a bridge's devices failed; taking its online again", "bridge_id", bridgeID, "attempt", attempt, "err", err)
			return
		}
		b.log.Error("listing a bridge's devices; their commands are not sent again", "bridge_id", bridgeID, "err", err)
		ack()
		return
	}
	ack()
	if len(ids) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, id := range ids {
		b.resend[id] = true
	}
	b.wake()
	b.logState(bridgeID, topics.BridgeOnline, len(ids))
}

// stateLines is what logState has to say of a bridge: when it last logged
// a line of each state, and the changes it counted since.
type stateLines struct {
	logged          map[string]time.Time // by state
	devices         map[string]int       // by state, its latest count of devices
	offline, online int                  // changes not logged
}

// logState logs a change of the bridge's state (its Will taken in, its
// "online"): each state's line at once if none of it was logged within
// the interval (Options.stateLogEvery, a minute), so that a restart shows
// both; those that follow within it are only counted, and once it is over
// the bridge's state then is logged with their counts. A bridge whose
// connection flaps (a bad link, two processes started with its id) had
// two info lines a flap, tens of thousands a day; and a line only
// counted would leave the log's last word on the bridge other than its
// state now (docs/reliability.md, bug 455). b.mu may be held.
func (b *Broker) logState(bridgeID, state string, devices int) {
	every := b.opts.stateLogEvery
	if every <= 0 {
		every = time.Minute
	}
	now := time.Now()
	b.stateMu.Lock()
	l := b.stateLines[bridgeID]
	if l == nil {
		l = &stateLines{logged: map[string]time.Time{}, devices: map[string]int{}}
		b.stateLines[bridgeID] = l
	}
	pending := l.offline+l.online > 0
	if !pending && now.Sub(l.logged[state]) >= every {
		l.logged[state] = now
		b.stateMu.Unlock()
		b.stateLine(bridgeID, state, devices)
		return
	}
	if !pending {
		// The first counted: the line of the bridge's state is due
		// once the interval of the line of this one is over.
		b.later(every-now.Sub(l.logged[state]), func() { b.flushState(bridgeID) })
	}
	if state == topics.BridgeOffline {
		l.offline++
	} else {
		l.online++
	}
	l.devices[state] = devices
	b.stateMu.Unlock()
}

// flushState logs the bridge's state once the interval of the changes
// logState counted is over, with their counts. The state is the broker's
// (away or not), not the last change counted: the line of a Will comes
// once the store has taken it, and may follow that of the "online" after
// it.
func (b *Broker) flushState(bridgeID string) {
	b.mu.Lock()
	state := topics.BridgeOnline
	if b.away[bridgeID] {
		state = topics.BridgeOffline
	}
	b.mu.Unlock()
	b.stateMu.Lock()
	l := b.stateLines[bridgeID]
	if l == nil || l.offline+l.online == 0 {
		b.stateMu.Unlock()
		return
	}
	offline, online, devices := l.offline, l.online, l.devices[state]
	l.offline, l.online = 0, 0
	l.logged[state] = time.Now()
	b.stateMu.Unlock()
	b.stateLine(bridgeID, state, devices, "offline_not_logged", offline, "online_not_logged", online)
}

// stateLine is the line of a bridge's state.
func (b *Broker) stateLine(bridgeID, state string, devices int, counts ...any) {
	args := append([]any{"bridge_id", bridgeID, "devices", devices}, counts...)
	if state == topics.BridgeOffline {
		b.log.Info("bridge offline; its devices' commands wait queued until it is back", args...)
		return
	}
	b.log.Info("bridge online; resending its devices' unfinished commands", args...)
}

// takeSettings stores the settings a device a bridge serves reported (as
// takeStatus), then calls ack.
func (b *Broker) takeSettings(deviceID string, s topics.Settings, bridge string, readErr error, live bool, ack func()) {
	r, err := b.reportedSettings(deviceID, s)
	if err != nil {
		b.log.Warn("settings that cannot be stored", "device_id", deviceID, "err", err)
		ack()
		return
	}
	if b.admit(deviceID, companion.DeviceReport{Settings: &r}).Settings == nil {
		if live {
			// Retained by the broker all the same: the store's go over
			// them (bug 352).
			b.goOwned(func() { b.mendRetainedSettings(deviceID, r) })
		}
		ack()
		return
	}
	dropped := func() {
		if live {
			b.goOwned(func() { b.clearDropped(deviceID, "settings", b.tree.Settings) })
		}
	}
	b.takeReport("settings", deviceID, "", bridge, readErr, ack, 1, dropped, func(bridge string, done func(error)) {
		start := time.Now()
		// The store takes them only if the bridge read serves the device
		// still: a move may commit before the write (docs/reliability.md,
		// bug 272).
		b.st.PutReportedSettingsAsync(deviceID, bridge, r.Reported, r.Schema, r.At, r.Seq, func(applied bool, err error) {
			b.opts.Observer.StoreWrite(StoreWriteSettings, time.Since(start))
			if err == nil && !applied && live {
				b.goOwned(func() { b.mendRetainedSettings(deviceID, r) })
			}
			done(err)
		})
	})
}

// mendRetainedSettings publishes the device's settings as the store has
// them when the store holds newer ones than taken, settings published and
// refused as older, or as from far past the server's clock (bug 352): the
// broker retains the last settings published to the topic, whatever their
// seq, and whoever subscribed later read settings GET …/settings did not,
// until the bridge's next report (docs/reliability.md, bug 348). As
// mendRetained for a status: the server's own publish comes back with the
// store's seq, not older, and nothing more is published; only for live
// messages. Settings of seq 0 (none reported, or none since the device
// moved) are cleared instead, as a move clears them (bug 244): published,
// they would read as the device's once taken in again.
func (b *Broker) mendRetainedSettings(deviceID string, taken companion.ReportedSettings) {
	topic, err := b.tree.Settings(deviceID)
	if err != nil || !b.client.IsConnectionOpen() {
		return
	}
	s, err := b.st.Settings(context.Background(), deviceID)
	if err != nil || !companion.Newer(s.Seq, s.At, taken.Seq, taken.At, b.now()) {
		return
	}
	if s.Seq == 0 {
		b.clearDropped(deviceID, "settings", b.tree.Settings)
		return
	}
	schema := s.Schema
	if len(schema) == 0 {
		schema = json.RawMessage("{}")
	}
	payload, err := fastjson.Marshal(struct {
		Reported map[string]json.RawMessage `json:"reported"`
		Schema   json.RawMessage            `json:"schema"`
		At       time.Time                  `json:"at"`
		Seq      uint64                     `json:"seq"`
	}{s.Reported, schema, s.At, s.Seq})
	if err != nil {
		return
	}
	if err := b.waitToken(b.client.Publish(topic, 1, true, payload)); err != nil && !errors.Is(err, ErrClosed) {
		b.log.Warn("publishing a device's settings over older ones", "device_id", deviceID, "err", err)
	}
}

// storeStatus is a device's status message as the store keeps it. An app
// the device lists more than once is kept once, as it is first listed,
// and logged: a device has one version of an app installed, and GET
// …/apps listed it twice (docs/reliability.md, bug 149).
func (b *Broker) storeStatus(deviceID string, s topics.Status) companion.Status {
	apps := make([]companion.App, 0, len(s.Apps))
	listed := make(map[string]int, len(s.Apps)) // times listed, up to 2 (a map: bug 144)
	var dups []string
	for _, a := range s.Apps {
		switch listed[a.AppID] {
		case 0:
			apps = append(apps, companion.App{AppID: a.AppID, Version: a.Version})
		case 1:
			dups = append(dups, a.AppID)
		default:
			continue
		}
		listed[a.AppID]++
	}
	if dups != nil {
		b.noisy.Warn("dup apps\x00"+deviceID, "the device lists an app more than once; keeping the first", "device_id", deviceID, "app_ids", dups)
	}
	return companion.Status{
		DeviceID:        deviceID,
		Online:          s.Online,
		Battery:         s.Battery,
		FirmwareVersion: s.FirmwareVersion,
		Model:           s.Model,
		Apps:            apps,
		BridgeID:        s.BridgeID,
		LastSeen:        s.At,
		Seq:             s.Seq,
	}
}

// reportedSettings is a device's settings message as the store keeps it.
// The settings of its schema the server can neither describe nor check
// (topics.Schema.Usable) are left out, with their values, and logged: a
// device's firmware declares its own schema. A default that is not a value
// of its setting is taken out (topics.Schema.ValidDefaults), and logged.
// What the message's parser left out, or found, against the rules of a
// setting (topics.SettingsFlaws) is logged here (docs/reliability.md, bug
// 567).
func (b *Broker) reportedSettings(deviceID string, s topics.Settings) (companion.ReportedSettings, error) {
	b.warnSettingsFlaws(deviceID, s.Flaws)
	schema, unusable := s.Schema.Usable()
	if unusable != nil {
		b.noisy.Warn("unusable settings\x00"+deviceID, "a device declared settings this server cannot describe (a type other than int, bool, string, enum and "+
			"timezone, an enum of no values, a min above its max, a negative max_len); leaving them out",
			"device_id", deviceID, "settings", unusable)
	}
	schema, noDefault := schema.ValidDefaults()
	if noDefault != nil {
		b.noisy.Warn("no default\x00"+deviceID, "a device declared settings whose default is not one of their values; serving them without a default",
			"device_id", deviceID, "settings", noDefault)
	}
	reported := make(map[string]json.RawMessage, len(s.Reported))
	for k, v := range s.Reported {
		if _, declared := s.Schema[k]; declared && len(unusable) > 0 {
			if _, usable := schema[k]; !usable {
				// Left out with its spec (a lookup: slices.Contains on
				// unusable made a message of 8,000 such settings cost
				// 64 million comparisons, bug 144).
				continue
			}
		}
		raw, err := fastjson.Marshal(v)
		if err != nil {
			return companion.ReportedSettings{}, fmt.Errorf("setting %q: %w", k, err)
		}
		reported[k] = raw
	}
	schemaJSON, err := fastjson.Marshal(schema)
	if err != nil {
		return companion.ReportedSettings{}, fmt.Errorf("schema: %w", err)
	}
	return companion.NewReportedSettings(reported, schemaJSON, s.At, s.Seq)
}

// warnSettingsFlaws logs what a device's settings report broke of the
// rules of a setting, each kind once a minute per device.
func (b *Broker) warnSettingsFlaws(deviceID string, f topics.SettingsFlaws) {
	for _, w := range []struct {
		key, msg string
		settings []string
	}{
		{"setting names", "a device reported settings under names no setting has (empty, blank, or with a control character); leaving them out", f.NotNames},
		{"setting values", "a device reported settings at values no setting holds (null, an object, an array, a number JSON cannot write); leaving the values out", f.NoValues},
		{"enum values", "a device declared enum settings naming a value more than once, or one that is empty, blank or with a control character; keeping each value once", f.EnumValues},
		{"unfit settings", "a device reported settings at values outside their own schema; serving them as reported", f.Unfit},
	} {
		if w.settings != nil {
			b.noisy.Warn(w.key+"\x00"+deviceID, w.msg, "device_id", deviceID, "settings", w.settings)
		}
	}
}
