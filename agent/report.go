package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// reportTimeout bounds one read of a device's info or settings, unless the
// device is busy (busyDevice).
var reportTimeout = 30 * time.Second

// busyDevice is a Device that tells whether it is at work on requests it
// still has time to answer (gatt.Device.Busy): its link up, a request
// waiting within the deadline the device's own client gives it.
type busyDevice interface {
	Busy() bool
}

// errNoAnswer ends a report's read that reportTimeout bounded.
var errNoAnswer = fmt.Errorf("agent: no answer within the report's bound: %w", context.DeadlineExceeded)

// readBound is the context of one report's read of dev: it ends at
// reportTimeout, unless dev is busy then, and as soon after as it is not.
// A firmware update's first upload request waits while img_mgmt erases the
// slot, minutes for a large one on external flash, and the device answers
// the read only after it: bounded at 30 s whatever, the read failed and the
// device read offline while its update went on (docs/reliability.md, bug
// 468). A device out of reach, or silent past its requests' deadlines (its
// client times them out and drops the link), is not busy, and still reads
// offline at reportTimeout.
func readBound(ctx context.Context, dev Device) (context.Context, context.CancelFunc) {
	b, ok := dev.(busyDevice)
	if !ok {
		return context.WithTimeout(ctx, reportTimeout)
	}
	bound := reportTimeout
	rctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		t := time.NewTimer(bound)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-rctx.Done():
				return
			case <-t.C:
			}
			if !b.Busy() {
				cancel(errNoAnswer)
				return
			}
			t.Reset(min(bound, time.Second))
		}
	}()
	var once sync.Once
	return rctx, func() {
		once.Do(func() { close(done) })
		cancel(context.Canceled)
	}
}

// readError is err, a read's failure under rctx (readBound), saying so
// when the report's bound ended it.
func readError(rctx context.Context, err error) error {
	if cause := context.Cause(rctx); errors.Is(cause, errNoAnswer) && !errors.Is(err, errNoAnswer) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}

// requestReport asks the device's reporter to publish its status (when it
// changed, or always when force) and its settings.
func (dr *deviceRunner) requestReport(status, force, settings bool) {
	dr.rmu.Lock()
	dr.wantStatus = dr.wantStatus || status || force
	dr.forceStatus = dr.forceStatus || force
	dr.wantSetgs = dr.wantSetgs || settings
	dr.rmu.Unlock()
	signal(dr.rwake)
}

// offer hands the reporter the state a command read back from the device,
// to publish on the retained topics as it is.
func (dr *deviceRunner) offer(st deviceState) {
	if st.status == nil && st.settings == nil {
		return
	}
	dr.rmu.Lock()
	if st.status != nil {
		dr.offered.status = st.status
		dr.noteStatusLocked(st.status)
	}
	if st.settings != nil {
		dr.offered.settings = st.settings
	}
	dr.rmu.Unlock()
	signal(dr.rwake)
}

// noteStatus records st as the device's newest known status, unless the
// runner has one of a later seq.
func (dr *deviceRunner) noteStatus(st *topics.Status) {
	dr.rmu.Lock()
	defer dr.rmu.Unlock()
	dr.noteStatusLocked(st)
}

func (dr *deviceRunner) noteStatusLocked(st *topics.Status) {
	if st != nil && (dr.known == nil || st.Seq >= dr.known.Seq) {
		dr.known = st
	}
}

// knownStatus is the newest status the bridge has of the device, read from
// it or carried by a command's final reply; nil before the reporter or a
// command has had one.
func (dr *deviceRunner) knownStatus() *topics.Status {
	dr.rmu.Lock()
	defer dr.rmu.Unlock()
	return dr.known
}

// report publishes a device's retained status and settings: on connect,
// after commands, and both every StatusInterval.
//
// The status last read from the device is kept in the spool: a device the
// bridge cannot read is reported offline with what was known of it, also
// after a restart. The server stores a status whole, so a blank one would
// put the device's firmware version, model, battery and apps out of its
// records until the device is back in reach.
func (a *Agent) report(ctx context.Context, dr *deviceRunner) {
	tick := time.NewTicker(a.opts.StatusInterval)
	defer tick.Stop()
	last, err := a.spool.lastStatus(dr.id)
	if err != nil {
		a.log.Warn("reading the device's last known status failed", "device_id", dr.id, "err", err)
	}
	dr.noteStatus(last)
	// kept is what the spool has, once its write has succeeded: a write
	// that failed (a full disk) is tried again at the next pass, not only
	// when the status changes again (docs/reliability.md, bug 174).
	kept := last
	var keeping *topics.Status // being written; one write at a time
	keptErr := make(chan error, 1)
	hold := false // a write just failed: wait for the next pass
	away := 0     // ticks in a row that found the bridge away from the broker
	for {
		if keeping == nil && !hold && last != nil && last.Online && !sameStatus(last, kept) {
			keeping = last
			a.spool.keepStatus(dr.id, *last, func(err error) { keptErr <- err })
		}
		hold = false
		select {
		case <-ctx.Done():
			return
		case err := <-keptErr:
			if err != nil {
				a.spoolFailed("keeping a device's status", err)
				hold = true
			} else {
				a.spoolWritten()
				kept = keeping
			}
			keeping = nil
			continue
		case <-tick.C:
			// Away from the broker for a whole interval: the device may
			// have been moved to another bridge meanwhile (an admin moves
			// the devices of a bridge that lost its uplink to one beside
			// it), and a device that takes one central at a time is kept
			// from it while this bridge holds its link
			// (docs/reliability.md, bug 487). The reporter reads no device
			// while away; a command the bridge runs from its spool
			// connects again.
			if a.connected.Load() {
				away = 0
			} else if away++; away >= 2 {
				a.release(dr, "the bridge is away from the broker, and another bridge may serve the device now")
			}
			// Settings too: they may have changed on the device itself.
			dr.requestReport(true, true, true)
			continue
		case <-dr.rwake:
		}
		dr.rmu.Lock()
		status, force, settings := dr.wantStatus, dr.forceStatus, dr.wantSetgs
		offered := dr.offered
		dr.wantStatus, dr.forceStatus, dr.wantSetgs = false, false, false
		dr.offered = deviceState{}
		dr.rmu.Unlock()
		if dr.refused.Load() || a.loginRefused.Load() {
			// The broker refuses the bridge the device's commands: it
			// was moved to another bridge, or taken off this one, whose
			// reports the server drops (CONTRACT §9). Read, it was
			// connected to every minute, its link kept, and a device
			// that takes one central at a time was kept from its new
			// bridge (docs/reliability.md, bug 486). A grant asks for
			// everything again (setRefused). So when the broker refuses
			// the bridge's login: deleted, its devices may be another's
			// (bug 505); every connect asks for everything again.
			a.releaseRefused(dr)
			continue
		}
		if !a.connected.Load() {
			continue // every connect asks for everything again
		}
		if st := offered.status; st != nil && !status {
			a.publish(dr, a.tree.Status, st)
			last = st
		}
		if set := offered.settings; set != nil && !settings {
			a.publish(dr, a.tree.Settings, set)
		}
		if status {
			last = a.publishStatus(ctx, dr, last, force)
			dr.noteStatus(last)
		}
		if settings {
			a.publishSettings(ctx, dr)
		}
	}
}

func sameStatus(a, b *topics.Status) bool {
	return a != nil && b != nil && a.Online == b.Online && a.FirmwareVersion == b.FirmwareVersion &&
		a.Model == b.Model && a.BridgeID == b.BridgeID &&
		((a.Battery == nil) == (b.Battery == nil) && (a.Battery == nil || *a.Battery == *b.Battery)) &&
		slices.Equal(a.Apps, b.Apps)
}

// readStatus reads the device's status. Its seq is taken before the read,
// so that of two reads the one that started later wins, whichever ends
// last.
func (a *Agent) readStatus(ctx context.Context, dr *deviceRunner) (topics.Status, error) {
	seq := a.nextSeq()
	rctx, cancel := readBound(ctx, dr.dev)
	info, err := dr.dev.Info(rctx)
	cancel()
	if err != nil {
		return topics.Status{}, readError(rctx, err)
	}
	var battery *int // unknown: companion.BatteryUnknown
	if info.Battery >= 0 {
		battery = &info.Battery
	}
	st := topics.Status{
		Online:          true,
		Battery:         battery,
		FirmwareVersion: info.FirmwareVersion,
		Model:           info.Model,
		Apps:            a.nameableApps(dr.id, info.Apps),
		BridgeID:        a.opts.BridgeID,
		At:              a.stampNow(),
		Seq:             seq,
	}
	return st, nil
}

// nameableApps is the device's apps list as the server takes it: an app id
// the device hands over as a C string loses its terminator, and an app
// whose id is still not one of the contract's (an app put on the device by
// other means) is left out and logged. The server refuses a status with
// such an id whole, and with it the final reply that carries one: the
// command would never end, and the device's status never change again.
func (a *Agent) nameableApps(deviceID string, apps []companion.App) []companion.App {
	out := make([]companion.App, 0, len(apps))
	for _, app := range apps {
		app.AppID = strings.TrimRight(app.AppID, "\x00")
		if !topics.ValidAppID(app.AppID) {
			a.log.Warn("the device lists an app whose id the server cannot take; leaving it out", "device_id", deviceID, "app_id", app.AppID)
			continue
		}
		out = append(out, app)
	}
	return out
}

// readSettings reads the device's settings and schema, with a seq taken
// before the read (see readStatus).
func (a *Agent) readSettings(ctx context.Context, dr *deviceRunner) (topics.Settings, error) {
	seq := a.nextSeq()
	rctx, cancel := readBound(ctx, dr.dev)
	reported, schema, err := dr.dev.Settings(rctx)
	cancel()
	if err != nil {
		return topics.Settings{}, readError(rctx, err)
	}
	return a.settingsMessage(dr.id, reported, schema, seq)
}

// settingsMessage is a device's settings as the bridge sends them, with
// seq: what JSON cannot carry left out, and an error when they take more
// than a message carries.
func (a *Agent) settingsMessage(deviceID string, reported map[string]any, schema topics.Schema, seq uint64) (topics.Settings, error) {
	if reported == nil {
		reported = map[string]any{}
	}
	reported, schema = a.encodableSettings(deviceID, reported, schema)
	set := topics.Settings{Reported: reported, Schema: schema, At: a.stampNow(), Seq: seq}
	if b, err := fastjson.Marshal(set); err == nil && len(b) > topics.MaxPayload {
		// A device may answer each setting's read with up to 16 KiB, and
		// declare 256 of them: published, the message is refused by the
		// server and by a broker at the contract's packet size, which
		// closes the bridge's connection (docs/reliability.md, bug 142).
		return topics.Settings{}, fmt.Errorf("agent: the device's settings take %d bytes as a message, more than the %d one carries", len(b), topics.MaxPayload)
	}
	return set, nil
}

// encodableSettings is the device's settings without those JSON cannot
// carry, spec or value: the firmware declares its own schema, and a
// default it gives as a CBOR float NaN or infinity decodes. Left in, the
// settings message could not be encoded, nor the final reply that carries
// it, nor its spool record: the command that read them back never ended
// (docs/reliability.md, bug 141). They are left out, with their values,
// and logged, as the server leaves out the settings it cannot describe.
func (a *Agent) encodableSettings(deviceID string, reported map[string]any, schema topics.Schema) (map[string]any, topics.Schema) {
	var bad []string
	for name, spec := range schema {
		if _, err := fastjson.Marshal(spec); err != nil {
			bad = append(bad, name)
		}
	}
	for name, v := range reported {
		if _, err := fastjson.Marshal(v); err != nil && !slices.Contains(bad, name) {
			bad = append(bad, name)
		}
	}
	if bad == nil {
		return reported, schema
	}
	slices.Sort(bad)
	a.log.Warn("the device declares settings whose spec or value JSON cannot carry (a NaN or infinite number); leaving them out",
		"device_id", deviceID, "settings", bad)
	reported, schema = maps.Clone(reported), maps.Clone(schema)
	for _, name := range bad {
		delete(reported, name)
		delete(schema, name)
	}
	return reported, schema
}

// publish publishes a device's retained status or settings on the topic
// topicOf gives.
func (a *Agent) publish(dr *deviceRunner, topicOf func(deviceID string) (string, error), v any) {
	topic, err := topicOf(dr.id)
	if err != nil {
		a.log.Error("no topic for a device", "device_id", dr.id, "err", err)
		return
	}
	b, err := fastjson.Marshal(v)
	if err != nil {
		a.log.Error("encoding a report", "device_id", dr.id, "err", err)
		return
	}
	if len(b) > topics.MaxPayload {
		a.log.Error("a report longer than a message carries; not sent", "device_id", dr.id, "topic", topic, "bytes", len(b), "max", topics.MaxPayload)
		return
	}
	a.client.Publish(topic, 1, true, b)
}

// publishStatus reads the device and publishes its status when it differs
// from last, or when force. It returns what is now the last status. A
// device it cannot read is reported offline, with what was last known.
func (a *Agent) publishStatus(ctx context.Context, dr *deviceRunner, last *topics.Status, force bool) *topics.Status {
	st, err := a.readStatus(ctx, dr)
	if err != nil {
		if ctx.Err() != nil {
			return last
		}
		if dr.unread {
			a.log.Debug("reading device info failed", "device_id", dr.id, "err", err)
		} else {
			dr.unread = true
			a.log.Warn("reading device info failed; the device reads offline until it answers", "device_id", dr.id, "err", err)
		}
		// What a command changed, when this read was asked for before
		// the reporter took its status (bug 229).
		if k := dr.knownStatus(); k != nil && (last == nil || k.Seq > last.Seq) {
			st = *k
		} else if last != nil {
			st = *last
		}
		st.Online = false
		if st.Apps == nil {
			st.Apps = []companion.App{}
		}
		st.BridgeID = a.opts.BridgeID
		st.At, st.Seq = a.stampNow(), a.nextSeq()
	} else if dr.unread {
		dr.unread = false
		a.log.Info("the device answers again", "device_id", dr.id)
	}
	if !force && sameStatus(&st, last) {
		return last
	}
	a.publish(dr, a.tree.Status, st)
	return &st
}

func (a *Agent) publishSettings(ctx context.Context, dr *deviceRunner) {
	s, err := a.readSettings(ctx, dr)
	if err != nil {
		switch {
		case ctx.Err() != nil:
		case dr.unread || dr.settingsUnread:
			// Said already: the device is out of reach, or its
			// settings unreadable, since a report before.
			a.log.Debug("reading device settings failed", "device_id", dr.id, "err", err)
		default:
			a.log.Warn("reading device settings failed", "device_id", dr.id, "err", err)
		}
		dr.settingsUnread = ctx.Err() == nil
		return
	}
	dr.settingsUnread = false
	a.publish(dr, a.tree.Settings, s)
}
