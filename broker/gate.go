package broker

import (
	"log/slog"
	"sync"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"

	"golang.org/x/time/rate"
)

// Defaults of Options.ReportRate and Options.ReportBurst.
const (
	defaultReportRate  = 1.0
	defaultReportBurst = 10
)

// maxGated is the number of devices reportGate keeps buckets for before it
// drops the full ones (a device with none has a full bucket).
const maxGated = 10000

// reportGate bounds how often each device's statuses, and each device's
// settings, are taken in from the status and settings topics: perSecond
// with bursts of burst, one bucket per device and kind (a
// golang.org/x/time/rate Limiter, as the API's rate limits use). Each
// report taken in is a store write, and a status that changed is an event
// for the device's user; a bridge may publish as fast as its link allows,
// and intake takes every bridge's messages in one order, so one bridge
// flooding the topics of its devices would otherwise hold up every other
// bridge's replies and fill its user's event log (CONTRACT §9: a user may
// run a bridge of their own).
//
// A report over the limit is not dropped: it is held, unacknowledged, until
// the bucket has a token for it, and a newer report of the same device
// and kind that comes meanwhile takes its place (the held one is then
// acknowledged and never stored: the stores keep only the newest report
// anyway, CONTRACT §3). Newer is by the reports' seq and time
// (companion.Newer), not by which came last: one that comes after the
// held one but is older (the server's own republished status, retained
// as the store has it, or a bridge's report delayed on the way) is
// acknowledged unstored in its turn, and the held one stays. So the newest report always lands, at most
// 1/perSecond late, and the reports of one device and kind are still taken
// in the order they came. A bridge reports a device after commands that
// changed it and every StatusInterval (a minute), far below the default
// of one a second with bursts of ten.
type reportGate struct {
	perSecond float64 // negative: no limit
	burst     int
	// later runs f after d (Broker.later: not once the broker closes).
	later func(d time.Duration, f func())
	log   *slog.Logger
	// coalesced is told of each report acknowledged unstored, a newer
	// one of its device taking its place (Observer.ReportCoalesced).
	coalesced func(kind string)

	mu      sync.Mutex
	devices map[gateKey]*gated
	pruned  time.Time // when prune last ran
}

type gateKey struct {
	kind   topics.Kind
	device string
}

// gated is a device's bucket for one kind of report, and the report held
// back for it, if any.
type gated struct {
	lim *rate.Limiter
	// take and ack are the held report's: take stores it (and then
	// acknowledges it), ack acknowledges it unstored. nil when none is held.
	take func(late bool)
	ack  func()
	// seq and at are the held report's.
	seq uint64
	at  time.Time
	// warned is when a report of it was last logged as held back.
	warned time.Time
}

// gateWarnEvery is how often a device whose reports are held back is
// logged, at most.
const gateWarnEvery = time.Minute

func newReportGate(perSecond float64, burst int, later func(time.Duration, func()), log *slog.Logger, coalesced func(kind string)) *reportGate {
	return &reportGate{perSecond: perSecond, burst: max(burst, 1), later: later, log: log, coalesced: coalesced,
		devices: make(map[gateKey]*gated)}
}

// admit takes a device's report in through the gate: take runs now when
// the device's bucket of kind has a token and no report of it is held;
// otherwise the report is held (see reportGate), and take runs, late, when
// the bucket has a token for it, unless a newer report takes its place
// first, in which case ack runs instead; a report older than the one held
// (seq and at, companion.Newer) has its ack run at once. intake calls admit
// in the order the messages came; a late take reads anew what intake read
// for its batch.
func (g *reportGate) admit(kind topics.Kind, deviceID string, seq uint64, at time.Time, take func(late bool), ack func()) {
	if g.perSecond < 0 {
		take(false)
		return
	}
	now := time.Now()
	k := gateKey{kind, deviceID}
	g.mu.Lock()
	e := g.devices[k]
	if e == nil {
		if len(g.devices) >= maxGated && now.Sub(g.pruned) >= time.Second {
			g.prune(now)
		}
		e = &gated{lim: rate.NewLimiter(rate.Limit(g.perSecond), g.burst)}
		g.devices[k] = e
	}
	if e.take != nil {
		// One is held already: a newer one takes its place, and its
		// turn; an older one would lose to it in the store, and is
		// acknowledged unstored now (bug 461: the server's own
		// republished status took a newer held one's place, and the
		// device read offline until its bridge's next report).
		superseded := ack
		if companion.Newer(seq, at, e.seq, e.at, time.Now()) {
			superseded = e.ack
			e.take, e.ack, e.seq, e.at = take, ack, seq, at
		}
		g.mu.Unlock()
		superseded()
		g.coalesced(kind.String())
		return
	}
	if e.lim.AllowN(now, 1) {
		g.mu.Unlock()
		take(false)
		return
	}
	// The token it waits for is its own from now on: the next report
	// after it finds the bucket empty too, and waits behind it.
	wait := e.lim.ReserveN(now, 1).DelayFrom(now)
	e.take, e.ack, e.seq, e.at = take, ack, seq, at
	warn := now.Sub(e.warned) >= gateWarnEvery
	if warn {
		e.warned = now
	}
	g.mu.Unlock()
	if warn {
		g.log.Warn("a device's reports come faster than they are taken in; each waits its turn, and a newer one takes a waiting one's place",
			"device_id", deviceID, "kind", kind.String(), "per_second", g.perSecond, "burst", g.burst)
	}
	g.later(wait, func() {
		g.mu.Lock()
		take := e.take
		e.take, e.ack = nil, nil
		g.mu.Unlock()
		if take != nil {
			take(true)
		}
	})
}

// prune drops the buckets that are full and hold nothing back. g.mu is
// held.
func (g *reportGate) prune(now time.Time) {
	g.pruned = now
	for k, e := range g.devices {
		if e.take == nil && e.lim.TokensAt(now) >= float64(g.burst) {
			delete(g.devices, k)
		}
	}
}
