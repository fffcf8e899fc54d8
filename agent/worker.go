package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// deviceRunner is the agent's side of one device: its worker's wake-up, the
// commands released to it, and what its reporter is asked to publish.
type deviceRunner struct {
	id  string
	dev Device

	wake chan struct{} // a command was released to the worker
	// refused is set while the broker refuses the device's command filter
	// (SUBACK 0x80): the worker then starts none of its commands
	// (holdRefused).
	refused atomic.Bool
	// answeredOn is the connection (Agent.conn) whose SUBACK last answered
	// the device's command filter: while it is not the connection the
	// workers wait on (Agent.unanswered), the device's commands wait
	// (awaitsAnswer).
	answeredOn atomic.Uint64
	// running is set while the worker runs one of the device's commands:
	// the device's link is then the command's (release).
	running atomic.Bool
	// stop, while the worker runs one of the device's commands, stops it
	// (setRefused; guarded by smu).
	smu  sync.Mutex
	stop context.CancelCauseFunc

	rmu                                sync.Mutex
	wantStatus, forceStatus, wantSetgs bool
	offered                            deviceState // read after a command: publish as is
	known                              *topics.Status
	rwake                              chan struct{}

	// unread and settingsUnread are the reporter's own (report): its
	// last read of the device's info, or of its settings, failed. A
	// failure is said once, not at each report while it lasts (bug 457).
	unread, settingsUnread bool
}

func newDeviceRunner(d Device) *deviceRunner {
	return &deviceRunner{id: d.ID(), dev: d, wake: make(chan struct{}, 1), rwake: make(chan struct{}, 1)}
}

// setRefused notes whether the broker refused the device's command filter
// on the current connection; the worker resumes once it is granted again,
// and the reporter reads the device again. Refused, the reporter is woken
// to let the device's link go (release).
func (dr *deviceRunner) setRefused(refused bool) {
	switch was := dr.refused.Swap(refused); {
	case was && !refused:
		signal(dr.wake)
		dr.requestReport(true, true, true)
	case !was && refused:
		signal(dr.rwake)
		dr.stopRunning(errRefused)
	}
}

// Why a command is stopped (stopRunning): the broker refuses the bridge
// the device's commands, or the bridge's login.
var (
	errRefused      = errors.New("the broker refuses the device's commands to this bridge, which may no longer serve it")
	errLoginRefused = errors.New("the broker refuses the bridge's login: the server deleted it or gave it another secret, and may serve the device through another bridge")
)

// stopRunning stops the command the worker runs on the device, if any: the
// broker refuses the bridge the device's commands, which a move to another
// bridge does, and the server failed the command at the move
// (device_not_served, whether it took effect being unknown). Run on to its
// end (a firmware update, an image over a slow link: minutes), it held the
// device's link, and a device that takes one central at a time could not
// be reached by its new bridge for that long (docs/reliability.md, bug
// 504). The worker puts it back at the head of the device's queue, held
// with the others (holdRefused): a filter the broker grants again (the
// device moved back, a NATS filter refused while its leaders are elected)
// runs it again, as a restart would, and the device drops an id it has
// run. So it is when the broker refuses the bridge's login (bug 505): the
// server deleted the bridge, failing its commands, and the device may have
// been assigned to a bridge beside it.
func (dr *deviceRunner) stopRunning(why error) {
	dr.smu.Lock()
	defer dr.smu.Unlock()
	if dr.stop != nil {
		dr.stop(why)
	}
}

// keepRunning lets the running command run to its end whatever comes: a
// firmware update past its upload (updateFirmware).
func (dr *deviceRunner) keepRunning() {
	dr.smu.Lock()
	dr.stop = nil
	dr.smu.Unlock()
}

// stoppable returns a context of ctx that stopRunning cancels, and the
// function that ends it once the command has run.
func (a *Agent) stoppable(ctx context.Context, dr *deviceRunner) (context.Context, func()) {
	sctx, stop := context.WithCancelCause(ctx)
	dr.smu.Lock()
	dr.stop = stop
	dr.smu.Unlock()
	// Refused since holdRefused looked.
	if dr.refused.Load() {
		stop(errRefused)
	} else if a.loginRefused.Load() {
		stop(errLoginRefused)
	}
	return sctx, func() {
		dr.smu.Lock()
		dr.stop = nil
		dr.smu.Unlock()
		stop(nil)
	}
}

// linkReleaser is a Device that can let its link go, connecting again at
// its next request (gatt.Device.Release).
type linkReleaser interface {
	Release() bool
}

// release lets the device's link go, unless one of its commands runs
// (one running as the broker refuses the device is stopped first,
// stopRunning), logging why once a link goes. A device
// moved to another bridge in range of both takes one central at a time,
// as most BLE peripherals do: the link the old bridge kept until it
// dropped (for good, the device in its reach) kept the new bridge from
// connecting, and every command of the moved device failed timeout there
// (docs/reliability.md, bugs 486 and 487). Nothing connects to the device
// again but a command the bridge runs, or the reporter's read once the
// bridge may serve the device again.
func (a *Agent) release(dr *deviceRunner, why string) {
	r, ok := dr.dev.(linkReleaser)
	if !ok || dr.running.Load() {
		return
	}
	if r.Release() {
		a.log.Info("let the device's link go: "+why, "device_id", dr.id)
	}
}

// releaseRefused lets the device's link go while the broker refuses the
// bridge the device's commands: the device was moved to another bridge,
// or taken off this one (bug 486); or while it refuses the bridge's login:
// the bridge was deleted, and its devices may be assigned to another
// (bug 505).
func (a *Agent) releaseRefused(dr *deviceRunner) {
	switch {
	case dr.refused.Load():
		a.release(dr, "the broker refuses its commands to this bridge, which may no longer serve it")
	case a.loginRefused.Load():
		a.release(dr, "the broker refuses the bridge's login, and another bridge may serve the device now")
	}
}

// answer notes that the broker answered the device's command filter on
// connection conn (granted or refused: setRefused first).
func (dr *deviceRunner) answer(conn uint64) {
	if dr.answeredOn.Swap(conn) != conn {
		signal(dr.wake)
	}
}

// work runs the device's queue, in order, one command at a time.
func (a *Agent) work(ctx context.Context, dr *deviceRunner) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		if !a.holdRefused(ctx, dr) {
			return
		}
		r, wait := a.spool.claim(dr.id, a.now())
		if r == nil {
			// Nothing to run, or the next command waits for the one it
			// runs after: until a command is released, or the wait ends.
			var waited <-chan time.Time
			if wait > 0 {
				if timer == nil {
					timer = time.NewTimer(wait)
				} else {
					timer.Reset(wait)
				}
				waited = timer.C
			}
			select {
			case <-ctx.Done():
				return
			case <-dr.wake:
			case <-waited:
			}
			continue
		}
		if r.gaveUp {
			a.log.Warn("the command this one runs after never came; running it without", "device_id", dr.id, "command_id", r.Cmd.ID, "after", r.Cmd.After, "waited", a.spool.afterWait)
		}
		dr.running.Store(true)
		ok := a.execute(ctx, dr, r)
		dr.running.Store(false)
		if !ok {
			return
		}
	}
}

// holdRefused waits while the broker refuses the device's command filter to
// this bridge, and returns false when ctx is done first. A broker refuses
// it for good once the device is moved to another bridge, or taken off
// this one (CONTRACT §9; the move disconnects the bridge, which then
// subscribes anew), and for a while on NATS as its leaders are elected.
// The commands the spool still holds for the device were failed by the
// server at the move, device_not_served, or go to its new bridge; run here,
// a text failed at the move showed on the device after the commands of
// its new bridge (docs/reliability.md, bug 240). Held, they run if the broker grants the filter again. What
// runs as the refusal comes is stopped and held with them (stopRunning,
// bug 504); and while the bridge is away from the broker it
// cannot know, and runs what it has. So it holds every device's commands
// while the broker refuses its login (noteLogin, bug 243), and, at start
// and on every connection, until the broker has answered the device's
// filter on the connection (unanswered, awaitsAnswer), a SUBACK that did
// not come in time included (bug 291): a bridge restarted after
// a move ran the commands its spool held for the moved device before its
// SUBSCRIBE was refused (bug 249), and one that connected again after the
// move did as its running command ended (bug 250). A bridge that cannot
// reach the broker (an attempt to connect fails, a connection is lost, or
// none is open connectTimeout after Run starts) runs them then, as one
// away from the broker does (away).
func (a *Agent) holdRefused(ctx context.Context, dr *deviceRunner) bool {
	var refused, login, waited bool // the reasons of the hold, logged once each
	// A command that ran as the broker refused the device has ended:
	// its link may go (bug 486).
	a.releaseRefused(dr)
	for dr.refused.Load() || a.loginRefused.Load() || a.awaitsAnswer(dr) {
		switch {
		case !a.spool.pending(dr.id):
		case dr.refused.Load():
			if !refused {
				refused = true
				a.log.Warn("holding the device's commands: the broker refuses them to this bridge, which may no longer serve the device",
					"device_id", dr.id)
			}
		case a.loginRefused.Load():
			if !login {
				login = true
				a.log.Debug("holding the device's commands: the broker refuses the bridge's login", "device_id", dr.id)
			}
		case !waited:
			waited = true
			a.log.Debug("waiting for the broker's answer to the subscriptions before running the device's commands", "device_id", dr.id)
		}
		select {
		case <-ctx.Done():
			return false
		case <-dr.wake:
		}
	}
	if refused || login {
		a.log.Info("the broker grants the device's commands again; running those held", "device_id", dr.id)
	}
	return true
}

// awaitsAnswer reports whether the device's commands wait for the broker's
// answer to its filter on the current connection (unanswered). A device's
// wait ends with the SUBACK of its own filter (answer), not with the whole
// round: on NATS, where each SUBSCRIBE makes a consumer, a round for a
// fleet of devices takes minutes, and a device whose filter was granted in
// the first chunk would wait for the last. Nor does the end of the first
// round end it: a filter whose SUBACK did not come in time is asked again,
// and the device's commands wait for that answer, or for the bridge to be
// away from the broker (away). The bridge is connected and cannot tell a
// busy broker from one about to refuse the filter, the device moved off
// it; run then, the commands the server failed at the move showed on the
// device (docs/reliability.md, bug 291).
func (a *Agent) awaitsAnswer(dr *deviceRunner) bool {
	conn := a.unanswered.Load()
	return conn != 0 && dr.answeredOn.Load() != conn
}

// holdAtStart ends the workers' wait at start (unanswered) when no
// connection to the broker is open startHold after Run started: the
// bridge is away from the broker, and runs what its spool holds. A
// connection open by then has its subscriptions answered within
// subscribeTimeout a chunk, or ends (onConnectionLost).
func (a *Agent) holdAtStart(ctx context.Context) {
	if sleepCtx(ctx, a.startHold) {
		a.away("no connection to the broker in time")
	}
}

// away lets the workers start commands when no connection is open (why):
// a bridge away from the broker cannot know, and runs what it has. A
// connection opened meanwhile is awaited (onConnect) and stays so.
func (a *Agent) away(why string) {
	if conn := a.unanswered.Load(); conn != 0 && !a.client.IsConnectionOpen() && a.unanswered.CompareAndSwap(conn, 0) {
		a.startCommands(why)
	}
}

func (a *Agent) startCommands(why string) {
	a.log.Debug("the devices' commands may start", "why", why)
	for _, dr := range a.order {
		signal(dr.wake)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// execute runs one command and records its final reply. It returns false
// when the agent is stopping; the command then stays in the spool and runs
// again, with the same id, after a restart. A command stopped as the broker
// refuses its device (stopRunning) goes back to the head of the device's
// queue, to run again once the worker may.
func (a *Agent) execute(ctx context.Context, dr *deviceRunner, r *record) bool {
	c := r.Cmd
	// The command's attributes, for the few lines logged about it; not a
	// logger made With them, which formats them for every command.
	attrs := []any{"device_id", dr.id, "command_id", c.ID, "op", c.Op}
	log := func(level slog.Level, msg string, args ...any) {
		if a.log.Enabled(ctx, level) {
			a.log.Log(ctx, level, msg, append(attrs, args...)...)
		}
	}
	final := topics.Reply{CommandID: c.ID}
	var state deviceState
	start := time.Now()
	// Expired means never delivered (CONTRACT §2): a command that may have
	// reached the device before a restart runs again whatever its TTL, and
	// ends with the device's answer (the device drops an id it has run).
	pastTTL := !c.ExpiresAt.IsZero() && a.ttlNow().After(c.ExpiresAt)
	if pastTTL && !r.resumed {
		log(slog.LevelInfo, "command expired before it ran")
		final.State = companion.StateExpired
	} else {
		if pastTTL {
			log(slog.LevelInfo, "command past its TTL may have run before the restart; running it again")
		}
		if !a.markStarted(ctx, r) {
			return false
		}
		sctx, done := a.stoppable(ctx, dr)
		cctx, cancel := context.WithTimeout(sctx, a.opts.CommandTimeout)
		result, changed, err := a.runOp(cctx, dr, c)
		state = changed
		timedOut := errors.Is(cctx.Err(), context.DeadlineExceeded)
		stopped := err != nil && sctx.Err() != nil // an op that ended first stands
		cancel()
		done()
		if ctx.Err() != nil {
			log(slog.LevelInfo, "stopping; the command will run again after restart")
			return false
		}
		if stopped {
			log(slog.LevelWarn, "stopped the command: "+context.Cause(sctx).Error()+
				"; it is held with the device's others, and runs again once the broker lets them run")
			a.spool.requeue(r)
			return true
		}
		switch {
		case err == nil:
			final.State, final.Result = companion.StateSucceeded, result
			log(slog.LevelDebug, "command succeeded", "took", time.Since(start).Round(time.Millisecond))
		default:
			ce := failure(err, timedOut, a.opts.CommandTimeout)
			final.State, final.Error = companion.StateFailed, ce.reply()
			log(slog.LevelWarn, "command failed", "code", ce.Code, "err", ce.Message)
		}
	}
	final.At = a.now()
	a.opts.Observer.CommandDone(c.Op, final.State, final.State != companion.StateExpired, time.Since(start))
	// What the command changed goes with its final reply, so that the
	// server stores both at once, and on the retained topics.
	final.Status, final.Settings = state.status, state.settings
	a.fitReply(c.DeviceID, &final)
	a.settleDelivered(c.ID)
	a.finish(ctx, r, final)
	dr.offer(state)
	// Only these change what the status reports (the battery is read every
	// StatusInterval); when the state could not be read after the command,
	// the reporter reads it again.
	status := c.Op == topics.OpAppInstall || c.Op == topics.OpAppUpdate || c.Op == topics.OpAppUninstall || c.Op == topics.OpOTAUpdate
	settings := c.Op == topics.OpSettingsUpdate
	if (status && state.status == nil) || (settings && state.settings == nil) {
		dr.requestReport(status, false, settings)
	}
	return true
}

// fitReply keeps a final reply within what a message carries
// (topics.MaxPayload): longer, the server refuses it, and a broker at the
// contract's packet size closes the bridge's connection, which then sends
// it again from the spool, and again. What it carries beside the command's
// state goes first: the result, then the settings and the status, which
// the reports carry too (docs/reliability.md, bug 142).
func (a *Agent) fitReply(deviceID string, r *topics.Reply) {
	for _, part := range []struct {
		name string
		drop func()
	}{
		{"result", func() { r.Result = nil }},
		{"settings", func() { r.Settings = nil }},
		{"status", func() { r.Status = nil }},
	} {
		b, err := fastjson.Marshal(r)
		if err != nil || len(b) <= topics.MaxPayload {
			return
		}
		a.log.Warn("a final reply longer than a message carries; sending it without its "+part.name,
			"device_id", deviceID, "command_id", r.CommandID, "bytes", len(b), "max", topics.MaxPayload)
		part.drop()
	}
}

// markStarted returns once the spool has the command as possibly started,
// trying again while writing it fails; false when the agent is stopping
// first (the command never started and stays queued).
func (a *Agent) markStarted(ctx context.Context, r *record) bool {
	for {
		err := a.spool.start(r)
		if err == nil {
			a.spoolWritten()
			return true
		}
		a.spoolFailed("marking a command started", err)
		a.log.Debug("marking a command as started failed; retrying", "device_id", r.Cmd.DeviceID, "command_id", r.Cmd.ID, "err", err)
		if !sleepCtx(ctx, time.Second) {
			return false
		}
	}
}

// finish records the final reply in the spool and publishes it once it is
// on disk. It does not wait: the worker goes on with the next command
// while the spool commits, and the replies of a device go out in the order
// its commands finished. A write that fails is tried again by the outbox
// loop (a command never recorded runs again after a restart, and the
// device drops the repeat).
func (a *Agent) finish(ctx context.Context, r *record, final topics.Reply) {
	a.spool.finishAt(r, final, a.stampNow(), func(key uint64, err error) {
		if err == nil {
			a.spoolWritten()
			a.publishFinal(ctx, key, r.Cmd.DeviceID, final)
			return
		}
		a.spoolFailed("recording a final reply", err)
		a.log.Debug("recording the final reply failed; will retry", "device_id", r.Cmd.DeviceID, "command_id", r.Cmd.ID, "err", err)
		a.outboxMu.Lock()
		a.unfinished = append(a.unfinished, finishJob{r, final})
		a.outboxMu.Unlock()
	})
}

// finishJob is a final reply whose write to the spool failed.
type finishJob struct {
	r     *record
	final topics.Reply
}

// progressReporter publishes in_progress replies for one command, at most
// one per 10 points.
type progressReporter struct {
	a    *Agent
	dr   *deviceRunner
	id   string
	mu   sync.Mutex
	last int
}

// stage returns a progress function that maps its stage's 0–100 into lo–hi.
func (p *progressReporter) stage(lo, hi int) func(pct int) {
	return func(pct int) {
		pct = lo + max(0, min(pct, 100))*(hi-lo)/100
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.last >= 0 && pct < p.last+10 && !(pct == 100 && p.last < 100) {
			return
		}
		p.last = pct
		p.a.settleDelivered(p.id)
		p.a.publishReply(p.dr.id, topics.Reply{CommandID: p.id, State: companion.StateInProgress, Progress: &pct, At: p.a.now()})
	}
}

func decodePayload(c topics.Command, v any) error {
	if len(c.Payload) == 0 {
		return cmdErr(codeInvalidPayload, "the command has no payload")
	}
	if err := json.Unmarshal(c.Payload, v); err != nil {
		return cmdErr(codeInvalidPayload, "payload: "+err.Error())
	}
	return nil
}

// resultJSON encodes a command's result. Results are small structs and maps
// of strings and JSON values, which always encode: an error here is a bug,
// and the command then reports no result rather than a broken one.
func resultJSON(v any) json.RawMessage {
	b, err := fastjson.Marshal(v)
	if err != nil {
		return nil
	}
	return b
}

// deviceState is what a command changed on its device, read back from it
// after the command: it travels with the final reply (CONTRACT §8) and on
// the retained status and settings topics.
type deviceState struct {
	status   *topics.Status
	settings *topics.Settings
}

// opFunc runs one op on its device and returns the command's result and
// the device's state the op changed.
type opFunc func(a *Agent, ctx context.Context, dr *deviceRunner, c topics.Command, prog *progressReporter) (json.RawMessage, deviceState, error)

// ops are the ops a bridge runs.
var ops = map[string]opFunc{
	topics.OpPushText:       (*Agent).pushText,
	topics.OpPushImage:      (*Agent).pushImage,
	topics.OpAppInstall:     (*Agent).installApp,
	topics.OpAppUpdate:      (*Agent).installApp,
	topics.OpAppUninstall:   (*Agent).uninstallApp,
	topics.OpSettingsUpdate: (*Agent).updateSettings,
	topics.OpOTAUpdate:      (*Agent).updateFirmware,
}

// runOp does the work of one command on its device and returns its result
// and what it changed.
func (a *Agent) runOp(ctx context.Context, dr *deviceRunner, c topics.Command) (json.RawMessage, deviceState, error) {
	run := ops[c.Op]
	if run == nil {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("op %q is not one this bridge runs", c.Op))
	}
	return run(a, ctx, dr, c, &progressReporter{a: a, dr: dr, id: c.ID, last: -1})
}

func (a *Agent) pushText(ctx context.Context, dr *deviceRunner, c topics.Command, _ *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.PushText
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	if p.Text == "" {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, "text is empty")
	}
	// The server takes no text or title with a control character but a
	// text's lines and tabs; a command from elsewhere on the topic is held
	// to the same, for a firmware that copies each into a C string and
	// draws it (docs/gatt.md).
	if r, at := topics.ControlChar(p.Text, topics.TextControls); at >= 0 {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("text has the control character U+%04X at byte %d", r, at))
	}
	if r, at := topics.ControlChar(p.Title, ""); at >= 0 {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("title has the control character U+%04X at byte %d (a title is one line)", r, at))
	}
	return nil, deviceState{}, dr.dev.PushText(ctx, c.ID, p.Title, p.Text)
}

func (a *Agent) pushImage(ctx context.Context, dr *deviceRunner, c topics.Command, prog *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.PushImage
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	prog.stage(0, 90)(0)
	data, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 90))
	if err != nil {
		return nil, deviceState{}, err
	}
	return nil, deviceState{}, dr.dev.PushImage(ctx, c.ID, p.ContentType, data)
}

func (a *Agent) installApp(ctx context.Context, dr *deviceRunner, c topics.Command, prog *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.AppInstall
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	if !topics.ValidAppID(p.AppID) || !topics.ValidVersion(p.Version) {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("app %q version %q", p.AppID, p.Version))
	}
	prog.stage(0, 90)(0)
	pkg, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 90))
	if err != nil {
		return nil, deviceState{}, err
	}
	if err := dr.dev.InstallApp(ctx, c.ID, p.AppID, p.Version, pkg); err != nil {
		return nil, deviceState{}, err
	}
	installed := func(st *topics.Status) { st.Apps = withApp(st.Apps, p.AppID, p.Version) }
	return resultJSON(companion.App{AppID: p.AppID, Version: p.Version}), a.statusAfter(ctx, dr, installed), nil
}

// withApp is apps with appID at version (version "" removes it), in app id
// order as the device's apps are reported; apps itself is not changed.
func withApp(apps []companion.App, appID, version string) []companion.App {
	out := make([]companion.App, 0, len(apps)+1)
	for _, x := range apps {
		if x.AppID != appID {
			out = append(out, x)
		}
	}
	if version != "" {
		out = append(out, companion.App{AppID: appID, Version: version})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].AppID < out[j].AppID })
	return out
}

func (a *Agent) uninstallApp(ctx context.Context, dr *deviceRunner, c topics.Command, _ *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.AppUninstall
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	if !topics.ValidAppID(p.AppID) {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("app %q", p.AppID))
	}
	if err := dr.dev.UninstallApp(ctx, c.ID, p.AppID); err != nil {
		return nil, deviceState{}, err
	}
	removed := func(st *topics.Status) { st.Apps = withApp(st.Apps, p.AppID, "") }
	return nil, a.statusAfter(ctx, dr, removed), nil
}

func (a *Agent) updateSettings(ctx context.Context, dr *deviceRunner, c topics.Command, _ *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.SettingsUpdate
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	if len(p.Settings) == 0 {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, "no settings to change")
	}
	before, schema, err := dr.dev.Settings(ctx)
	if err != nil {
		return nil, deviceState{}, err
	}
	if errs := schema.Validate(p.Settings); len(errs) > 0 {
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Field + ": " + e.Message
		}
		return nil, deviceState{}, cmdErr(codeInvalidPayload, strings.Join(msgs, "; "))
	}
	if err := dr.dev.UpdateSettings(ctx, c.ID, p.Settings); err != nil {
		return nil, deviceState{}, err
	}
	set, err := a.readSettings(ctx, dr)
	if err != nil {
		// The device took the change: the command is done, and its final
		// reply carries the settings read before it with the change
		// applied, so that GET …/settings shows it once the command is
		// final (CONTRACT §8), as an app's or an OTA's reply carries the
		// last known status with its change (docs/reliability.md, bug
		// 226). A report follows.
		a.log.Warn("reading the settings after a change failed; they follow in a report", "device_id", dr.id, "command_id", c.ID, "err", err)
		changed := maps.Clone(before)
		if changed == nil {
			changed = map[string]any{}
		}
		maps.Copy(changed, p.Settings)
		set, err = a.settingsMessage(dr.id, changed, schema, a.nextSeq())
		if err != nil {
			return nil, deviceState{}, nil // done; the settings follow in a report
		}
	}
	return resultJSON(map[string]any{"reported": set.Reported}), deviceState{settings: &set}, nil
}

func (a *Agent) updateFirmware(ctx context.Context, dr *deviceRunner, c topics.Command, prog *progressReporter) (json.RawMessage, deviceState, error) {
	var p topics.OTAUpdate
	if err := decodePayload(c, &p); err != nil {
		return nil, deviceState{}, err
	}
	if !topics.ValidVersion(p.Version) {
		return nil, deviceState{}, cmdErr(codeInvalidPayload, fmt.Sprintf("version %q", p.Version))
	}
	prog.stage(0, 50)(0)
	image, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 50))
	if err != nil {
		return nil, deviceState{}, err
	}
	device := prog.stage(50, 100)
	progress := func(pct int) {
		if pct >= 90 {
			// The upload done (90: gatt.Device's last chunk
			// acknowledged; then 92 marked, 95 reset, 98 confirmed),
			// the image is marked for test and the device reboots into
			// it: stopped before its confirmation, the device would run
			// an image nobody confirms, reverted at its next reset
			// (docs/reliability.md, bug 504). That part takes a
			// reboot's time, and runs on.
			dr.keepRunning()
		}
		device(pct)
	}
	if err := dr.dev.UpdateFirmware(ctx, c.ID, p.Version, image, progress); err != nil {
		return nil, deviceState{}, err
	}
	// UpdateFirmware returning nil means the device runs the image and has
	// confirmed it: a status read that fails now does not undo the update,
	// and failing the command would report an update that happened as
	// failed. The reply then carries the last known status with the new
	// version (knownStatusWith), and a report follows. A read that succeeds
	// with another version is a mismatch all the same.
	st, err := a.readStatus(ctx, dr)
	if err != nil {
		a.log.Warn("reading the status after a firmware update failed; it follows in a report", "device_id", dr.id, "command_id", c.ID, "err", err)
		return resultJSON(map[string]string{"firmware_version": p.Version}), a.knownStatusWith(dr, func(st *topics.Status) { st.FirmwareVersion = p.Version }), nil
	}
	if st.FirmwareVersion != p.Version {
		return nil, deviceState{status: &st}, cmdErr(codeVersionMismatch, fmt.Sprintf("the device reports firmware %q after the update to %q", st.FirmwareVersion, p.Version))
	}
	return resultJSON(map[string]string{"firmware_version": st.FirmwareVersion}), deviceState{status: &st}, nil
}

// knownStatusWith is the device's last known status with what a command
// that succeeded changed (change: the firmware version an update
// confirmed, an app installed or removed), for the final reply of a
// command whose status read failed: the server stores it with the
// command's end, so that GET …/status and GET …/apps show the change once
// the command is final (CONTRACT §8), and the reporter keeps it, so that a
// report of the device out of reach does not put the old state back.
// Without a last known status there is nothing to carry: the status
// follows in a report.
func (a *Agent) knownStatusWith(dr *deviceRunner, change func(*topics.Status)) deviceState {
	seq := a.nextSeq()
	// The runner's, not the spool's: the reporter keeps a status in the
	// spool after it has taken it, and a command that changed the device
	// just before this one is not there yet (bug 229).
	last := dr.knownStatus()
	if last == nil {
		var err error
		if last, err = a.spool.lastStatus(dr.id); err != nil || last == nil {
			return deviceState{}
		}
	}
	st := *last
	change(&st)
	st.Online, st.BridgeID = true, a.opts.BridgeID
	st.At, st.Seq = a.stampNow(), seq
	return deviceState{status: &st}
}

// statusAfter reads the device's status after a command that changed it;
// when the read fails the command is still done, its final reply carries
// the last known status with change applied (docs/reliability.md, bug
// 212), and the status follows in a report.
func (a *Agent) statusAfter(ctx context.Context, dr *deviceRunner, change func(*topics.Status)) deviceState {
	st, err := a.readStatus(ctx, dr)
	if err != nil {
		a.log.Warn("reading the status after a change failed; it follows in a report", "device_id", dr.id, "err", err)
		return a.knownStatusWith(dr, change)
	}
	return deviceState{status: &st}
}
