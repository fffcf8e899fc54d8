package agent

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"github.com/devicecompanion/companion/topics"
)

// reportTimeout bounds one read of a device's info or settings.
const reportTimeout = 30 * time.Second

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

// report publishes a device's retained status and settings: on connect,
// after commands, and both every StatusInterval.
func (a *Agent) report(ctx context.Context, dr *deviceRunner) {
	tick := time.NewTicker(a.opts.StatusInterval)
	defer tick.Stop()
	var last *topics.Status
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			// Settings too: they may have changed on the device itself.
			dr.requestReport(true, true, true)
			continue
		case <-dr.rwake:
		}
		dr.rmu.Lock()
		status, force, settings := dr.wantStatus, dr.forceStatus, dr.wantSetgs
		dr.wantStatus, dr.forceStatus, dr.wantSetgs = false, false, false
		dr.rmu.Unlock()
		if !a.connected.Load() {
			continue // every connect asks for everything again
		}
		if status {
			last = a.publishStatus(ctx, dr, last, force)
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

// publishStatus reads the device and publishes its status when it differs
// from last, or when force. It returns what is now the last status.
func (a *Agent) publishStatus(ctx context.Context, dr *deviceRunner, last *topics.Status, force bool) *topics.Status {
	rctx, cancel := context.WithTimeout(ctx, reportTimeout)
	info, err := dr.dev.Info(rctx)
	cancel()
	var st topics.Status
	if err != nil {
		if ctx.Err() != nil {
			return last
		}
		// Unreachable: report it offline, keeping what was last known.
		a.log.Warn("reading device info failed", "device", dr.id, "err", err)
		if last != nil {
			st = *last
		}
		st.Online = false
	} else {
		battery := info.Battery
		st = topics.Status{
			Online:          true,
			Battery:         &battery,
			FirmwareVersion: info.FirmwareVersion,
			Model:           info.Model,
			Apps:            info.Apps,
		}
	}
	if st.Apps == nil {
		st.Apps = []topics.App{}
	}
	st.BridgeID = a.opts.BridgeID
	if !force && sameStatus(&st, last) {
		return last
	}
	st.At = a.now()
	st.Seq = a.nextSeq()
	topic, _ := a.tree.Status(dr.id)
	b, err := json.Marshal(st)
	if err != nil {
		return last
	}
	a.client.Publish(topic, 1, true, b)
	return &st
}

func (a *Agent) publishSettings(ctx context.Context, dr *deviceRunner) {
	rctx, cancel := context.WithTimeout(ctx, reportTimeout)
	reported, schema, err := dr.dev.Settings(rctx)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			a.log.Warn("reading device settings failed", "device", dr.id, "err", err)
		}
		return
	}
	if reported == nil {
		reported = map[string]any{}
	}
	s := topics.Settings{Reported: reported, Schema: schema, At: a.now(), Seq: a.nextSeq()}
	topic, _ := a.tree.Settings(dr.id)
	b, err := json.Marshal(s)
	if err != nil {
		return
	}
	a.client.Publish(topic, 1, true, b)
}
