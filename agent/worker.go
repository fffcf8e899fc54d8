package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion/topics"
)

// deviceRunner is the agent's side of one device: its worker's wake-up, the
// commands released to it, and what its reporter is asked to publish.
type deviceRunner struct {
	id  string
	dev Device

	wake chan struct{} // a command was released to the worker

	rmu                                sync.Mutex
	wantStatus, forceStatus, wantSetgs bool
	rwake                              chan struct{}
}

func newDeviceRunner(d Device) *deviceRunner {
	return &deviceRunner{id: d.ID(), dev: d, wake: make(chan struct{}, 1), rwake: make(chan struct{}, 1)}
}

// work runs the device's queue, in order, one command at a time.
func (a *Agent) work(ctx context.Context, dr *deviceRunner) {
	for {
		r := a.spool.claim(dr.id)
		if r == nil {
			select {
			case <-ctx.Done():
				return
			case <-dr.wake:
			}
			continue
		}
		if !a.execute(ctx, dr, r) {
			return
		}
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
// again, with the same id, after a restart.
func (a *Agent) execute(ctx context.Context, dr *deviceRunner, r *record) bool {
	c := r.Cmd
	// The command's attributes, for the few lines logged about it; not a
	// logger made With them, which formats them for every command.
	attrs := []any{"device", dr.id, "cmd", c.ID, "op", c.Op}
	log := func(level slog.Level, msg string, args ...any) {
		if a.log.Enabled(ctx, level) {
			a.log.Log(ctx, level, msg, append(attrs, args...)...)
		}
	}
	final := topics.Reply{CommandID: c.ID}
	if !c.ExpiresAt.IsZero() && a.now().After(c.ExpiresAt) {
		log(slog.LevelInfo, "command expired before it ran")
		final.State = topics.StateExpired
	} else {
		start := time.Now()
		cctx, cancel := context.WithTimeout(ctx, a.opts.CommandTimeout)
		result, err := a.runOp(cctx, dr, c)
		timedOut := errors.Is(cctx.Err(), context.DeadlineExceeded)
		cancel()
		if ctx.Err() != nil {
			log(slog.LevelInfo, "stopping; the command will run again after restart")
			return false
		}
		switch {
		case err == nil:
			final.State, final.Result = topics.StateSucceeded, result
			log(slog.LevelDebug, "command succeeded", "took", time.Since(start).Round(time.Millisecond))
		default:
			var ce *commandError
			var coded codedError
			if !errors.As(err, &ce) {
				if errors.As(err, &coded) && !timedOut {
					ce = cmdErr(coded.ErrorCode(), err.Error())
				} else if timedOut || errors.Is(err, context.DeadlineExceeded) {
					ce = cmdErr(codeTimeout, fmt.Sprintf("the command did not finish within %s", a.opts.CommandTimeout))
				} else {
					ce = cmdErr(codeDeviceError, err.Error())
				}
			}
			final.State, final.Error = topics.StateFailed, ce.reply()
			log(slog.LevelWarn, "command failed", "code", ce.Code, "err", ce.Message)
		}
	}
	final.At = a.now()
	a.settleDelivered(c.ID)
	a.finish(ctx, r, final)
	// Only these change what the status reports; the battery is read
	// every StatusInterval.
	status := c.Op == topics.OpAppInstall || c.Op == topics.OpAppUpdate || c.Op == topics.OpAppUninstall || c.Op == topics.OpOTAUpdate
	if status || c.Op == topics.OpSettingsUpdate {
		dr.requestReport(status, false, c.Op == topics.OpSettingsUpdate)
	}
	return true
}

// finish records the final reply in the spool and publishes it once it is
// on disk. It does not wait: the worker goes on with the next command
// while the spool commits, and the replies of a device go out in the order
// its commands finished. A write that fails is tried again by the outbox
// loop (a command never recorded runs again after a restart, and the
// device drops the repeat).
func (a *Agent) finish(ctx context.Context, r *record, final topics.Reply) {
	a.spool.finish(r, final, func(key uint64, err error) {
		if err == nil {
			a.publishFinal(ctx, key, r.Cmd.DeviceID, final)
			return
		}
		a.log.Error("recording the final reply failed; will retry", "device", r.Cmd.DeviceID, "cmd", r.Cmd.ID, "err", err)
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
		p.a.publishReply(p.dr.id, topics.Reply{CommandID: p.id, State: topics.StateInProgress, Progress: &pct, At: p.a.now()})
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

func resultJSON(v any) json.RawMessage {
	b, _ := json.Marshal(v)
	return b
}

// runOp does the work of one command on its device and returns its result.
func (a *Agent) runOp(ctx context.Context, dr *deviceRunner, c topics.Command) (json.RawMessage, error) {
	d := dr.dev
	prog := &progressReporter{a: a, dr: dr, id: c.ID, last: -1}
	switch c.Op {
	case topics.OpPushText:
		var p topics.PushText
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		if p.Text == "" {
			return nil, cmdErr(codeInvalidPayload, "text is empty")
		}
		return nil, d.PushText(ctx, c.ID, p.Title, p.Text)

	case topics.OpPushImage:
		var p topics.PushImage
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		prog.stage(0, 90)(0)
		data, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 90))
		if err != nil {
			return nil, err
		}
		return nil, d.PushImage(ctx, c.ID, p.ContentType, data)

	case topics.OpAppInstall, topics.OpAppUpdate:
		var p topics.AppInstall
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		if !topics.ValidAppID(p.AppID) || !topics.ValidVersion(p.Version) {
			return nil, cmdErr(codeInvalidPayload, fmt.Sprintf("app %q version %q", p.AppID, p.Version))
		}
		prog.stage(0, 90)(0)
		pkg, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 90))
		if err != nil {
			return nil, err
		}
		if err := d.InstallApp(ctx, c.ID, p.AppID, p.Version, pkg); err != nil {
			return nil, err
		}
		return resultJSON(topics.App{AppID: p.AppID, Version: p.Version}), nil

	case topics.OpAppUninstall:
		var p topics.AppUninstall
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		if !topics.ValidAppID(p.AppID) {
			return nil, cmdErr(codeInvalidPayload, fmt.Sprintf("app %q", p.AppID))
		}
		return nil, d.UninstallApp(ctx, c.ID, p.AppID)

	case topics.OpSettingsUpdate:
		var p topics.SettingsUpdate
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		if len(p.Settings) == 0 {
			return nil, cmdErr(codeInvalidPayload, "no settings to change")
		}
		_, schema, err := d.Settings(ctx)
		if err != nil {
			return nil, err
		}
		if errs := schema.Validate(p.Settings); len(errs) > 0 {
			msgs := make([]string, len(errs))
			for i, e := range errs {
				msgs[i] = e.Field + ": " + e.Message
			}
			return nil, cmdErr(codeInvalidPayload, strings.Join(msgs, "; "))
		}
		if err := d.UpdateSettings(ctx, c.ID, p.Settings); err != nil {
			return nil, err
		}
		reported, _, err := d.Settings(ctx)
		if err != nil {
			return nil, nil // done; the settings message will follow
		}
		return resultJSON(map[string]any{"reported": reported}), nil

	case topics.OpOTAUpdate:
		var p topics.OTAUpdate
		if err := decodePayload(c, &p); err != nil {
			return nil, err
		}
		if !topics.ValidVersion(p.Version) {
			return nil, cmdErr(codeInvalidPayload, fmt.Sprintf("version %q", p.Version))
		}
		prog.stage(0, 50)(0)
		image, err := a.blobs.fetch(ctx, p.Blob, prog.stage(0, 50))
		if err != nil {
			return nil, err
		}
		if err := d.UpdateFirmware(ctx, c.ID, p.Version, image, prog.stage(50, 100)); err != nil {
			return nil, err
		}
		info, err := d.Info(ctx)
		if err != nil {
			return nil, err
		}
		if info.FirmwareVersion != p.Version {
			return nil, cmdErr(codeVersionMismatch, fmt.Sprintf("the device reports firmware %q after the update to %q", info.FirmwareVersion, p.Version))
		}
		return resultJSON(map[string]string{"firmware_version": info.FirmwareVersion}), nil
	}
	return nil, cmdErr(codeInvalidPayload, fmt.Sprintf("op %q is not one this bridge runs", c.Op))
}
