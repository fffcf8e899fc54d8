package postgres

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// dialGate spaces the pool's new connections while the database does not
// take them. Without it, while PostgreSQL refused connections (its
// max_connections taken, starting up or shutting down) or could not be
// reached, every request that found no idle connection tried one of its
// own: against a database with its connections taken, a backend forked,
// was refused and ended for each request, at the rate the clients sent
// them, times the replicas, which is load on the database when it has
// none to spare (docs/reliability.md, bug 579).
//
// Once an attempt has failed, the pool makes one at a time, dialSpacing
// apart at least; a request that needs a new connection meanwhile fails at
// once with the last attempt's error (a 503 unavailable with Retry-After,
// as it was). A connection made, by the pool or by the store's own checks
// (Store.probe, Ping), opens the gate again. So the database is tried ten
// times a second at most, and the store takes requests again within
// dialSpacing of the database's return. Connections the pool holds are
// not touched: a request that finds one idle runs as before.
type dialGate struct {
	mu     sync.Mutex
	failed error     // the last attempt's, any of the store's, nil once one succeeds
	trying bool      // an attempt the gate let through is under way
	next   time.Time // when the next one may start
}

// dialSpacing is the least time between the pool's attempts to connect
// while they fail.
const dialSpacing = 100 * time.Millisecond

// heldError is a new connection not tried, the last attempt having
// failed. It wraps that attempt's error: IsUnavailable and the fault it is
// (faultOf) are that error's.
type heldError struct{ err error }

func (e *heldError) Error() string {
	return "postgres: no new connection tried while the last attempt failed: " + e.err.Error()
}

func (e *heldError) Unwrap() error { return e.err }

// admit says whether a new connection of the pool's may be tried now:
// attempt when it is the gate's one attempt, which must call done as it
// ends; an error, the last attempt's, when none may be.
func (g *dialGate) admit() (attempt bool, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.failed == nil:
		return false, nil
	case g.trying || time.Now().Before(g.next):
		return false, &heldError{g.failed}
	}
	g.trying = true
	return true, nil
}

// connected takes the outcome of an attempt to connect, any of the
// store's (tracer.TraceConnectEnd). One given up by its caller, or failed
// by no fault of the database's (faultOf), says nothing of the database.
func (g *dialGate) connected(ctx context.Context, err error) {
	if err != nil && (ctx.Err() != nil || faultOf(err) == faultNone) {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.failed = err
}

// done ends the gate's attempt.
func (g *dialGate) done() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.trying = false
	g.next = time.Now().Add(dialSpacing)
}

// beforeConnect is the pool's BeforeConnect: it asks the gate, and gives
// the gate's one attempt a tracer that ends it.
func (h *health) beforeConnect(_ context.Context, cfg *pgx.ConnConfig) error {
	attempt, err := h.dials.admit()
	if attempt {
		cfg.Tracer = attemptTracer{tracer{h}}
	}
	return err
}

// attemptTracer is the tracer of the connection the gate let the pool try
// (dialGate), which tells it how the attempt ended.
type attemptTracer struct{ tracer }

func (t attemptTracer) TraceConnectEnd(ctx context.Context, data pgx.TraceConnectEndData) {
	t.tracer.TraceConnectEnd(ctx, data)
	t.h.dials.done()
}
