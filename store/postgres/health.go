package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/devicecompanion/companion/internal/faultlog"
)

// fault is a way the database fails the store, each told once: it cannot
// be reached, it refuses new connections, it cannot write, it lacks other
// resources. A lock waited out (55P03) is no fault of the database's and
// has no run; it is said once a minute at most (lockWaited).
type fault int

const (
	faultNone        fault = iota
	faultUnreachable       // connections fail or break; the server shuts down or starts up
	faultRefused           // new connections refused: max_connections taken (53300)
	faultUnwritable        // writes refused: a full disk, an I/O error, read-only (IsUnwritable)
	faultResources         // the rest of class 53: out of memory, a configured limit
	faultLock              // a statement waited LockTimeout for a lock (55P03)
)

// faultOf says which fault err is, faultNone for an error of the
// request's own or none.
func faultOf(err error) fault {
	var pe *pgconn.PgError
	switch {
	case err == nil:
		return faultNone
	case errors.As(err, &pe) && pe.Code == "53300":
		return faultRefused
	case errors.As(err, &pe) && pe.Code == "55P03":
		return faultLock
	case IsUnwritable(err):
		return faultUnwritable
	case errors.As(err, &pe) && len(pe.Code) == 5 && pe.Code[:2] == "53":
		return faultResources
	case IsUnavailable(err):
		return faultUnreachable
	}
	return faultNone
}

// faults is what the log says of each fault: its first line, what is
// wrong, what the server does meanwhile, and what to do; and its name in
// the lines after.
var faults = map[fault]faultlog.Fault{
	faultUnreachable: {Name: "unreachable", Words: "postgres: the database cannot be reached: requests that need it are answered 503 unavailable, " +
		"and commands, replies and statuses wait, until it answers; check that PostgreSQL runs and takes connections at the --store address"},
	faultRefused: {Name: "connections refused", Words: "postgres: the database refuses new connections, its max_connections taken: requests that need a new connection " +
		"are answered 503 unavailable until one is free; raise max_connections, or end the sessions that hold them (pg_stat_activity)"},
	faultUnwritable: {Name: "cannot write", Words: "postgres: the database cannot write (its disk full, an I/O error, or the server read-only): requests that " +
		"would store something are answered 503 unavailable, and replies and statuses wait, until it can; free space on the " +
		"database server's disk, or point --store at a primary"},
	faultResources: {Name: "resources", Words: "postgres: the database lacks the resources for the store's statements: they are answered 503 unavailable " +
		"until it has them; see PostgreSQL's own log"},
}

// lockLogEvery is how often, at most, the log says that statements waited
// out a lock.
const lockLogEvery = time.Minute

// health is what the store has learnt of the database from the answers
// to its statements (tracer): the faults under way, each logged once as
// it starts, once a minute while it stands, and once as a probe finds it
// gone (internal/faultlog; Store.watch), so that an outage is a few
// lines, not one for every statement that met it. The store's callers
// (the API, the broker) then need not log it again (cmd/companion logs
// their lines of these errors at debug level).
type health struct {
	log    *slog.Logger
	faults *faultlog.Log[fault]

	mu      sync.Mutex
	locks   int       // statements that waited out a lock since lockLog
	lockLog time.Time // when that was last said

	// dials spaces the pool's new connections while attempts fail.
	dials dialGate
}

func newHealth(log *slog.Logger, cfg *pgx.ConnConfig) *health {
	database := net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))) + "/" + cfg.Database
	return &health{
		log: log.With("database", database),
		faults: faultlog.New(faultlog.Options[fault]{
			Logger: log,
			Faults: faults,
			Attrs:  []any{"database", database},
			Still:  "postgres: the database still fails the store",
			Gone:   "postgres: the database answers again",
		}),
	}
}

// probing marks the context of the store's own checks, whose outcome the
// tracer leaves to them.
type probing struct{}

// noted takes in the outcome of one statement, connection or batch.
func (h *health) noted(ctx context.Context, err error) {
	if err == nil || ctx.Value(probing{}) != nil || ctx.Err() != nil {
		return // the caller gave up: nothing of the database's
	}
	switch f := faultOf(err); f {
	case faultNone:
	case faultLock:
		h.lockWaited(err)
	default:
		h.faults.Failed(f, err)
	}
}

// lockWaited counts a statement that waited out a lock, and says so once
// a minute at most.
func (h *health) lockWaited(err error) {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.locks++
	if now.Sub(h.lockLog) >= lockLogEvery {
		h.log.Warn("postgres: statements waited "+LockTimeout.String()+" for a lock another session holds, and failed: their "+
			"requests are answered 503 unavailable; find the session (pg_blocking_pids in pg_stat_activity) and end it",
			"statements", h.locks, "err", err)
		h.lockLog, h.locks = now, 0
	}
}

// watch asks, every second while a fault stands, whether it still does
// (probe), until the store is closed. It runs on a goroutine of the
// store's (Open), and sleeps while there is none.
func (s *Store) watch() {
	s.health.faults.Watch(s.done, s.probe)
}

// probe checks whether fault f still stands: nil when it does not. A
// refusal of new connections is asked with a new connection of its own,
// a refusal to write with a write (checkWrite), the rest with a ping of
// the pool.
func (s *Store) probe(f fault) error {
	ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), probing{}, true), checkTimeout)
	defer cancel()
	switch f {
	case faultRefused:
		conn, err := pgx.ConnectConfig(ctx, s.cfg.ConnConfig.Copy())
		if err != nil {
			return err
		}
		return conn.Close(ctx)
	case faultUnwritable:
		return s.checkWrite(ctx)
	}
	return s.pool.Ping(ctx)
}

// logRetry logs an error that the store's own loop (the campaign,
// LISTEN) meets and tries again after: a warning, unless it is a fault
// of the database's, which health says once (debug then).
func (s *Store) logRetry(msg string, err error, args ...any) {
	level := slog.LevelWarn
	if faultOf(err) != faultNone {
		level = slog.LevelDebug
	}
	s.log.Log(context.Background(), level, msg, append(args, "err", err)...)
}

// tracer is the pgx tracer of every connection the store makes: it hands
// the outcome of each statement, batch, copy and connection attempt to
// health, so that whichever method met an error, the store knows it.
type tracer struct{ h *health }

var (
	_ pgx.QueryTracer    = tracer{}
	_ pgx.BatchTracer    = tracer{}
	_ pgx.CopyFromTracer = tracer{}
	_ pgx.ConnectTracer  = tracer{}
)

func (t tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (t tracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	t.h.noted(ctx, data.Err)
}

func (t tracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (t tracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	t.h.noted(ctx, data.Err)
}

func (t tracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	t.h.noted(ctx, data.Err)
}

func (t tracer) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	return ctx
}

func (t tracer) TraceCopyFromEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceCopyFromEndData) {
	t.h.noted(ctx, data.Err)
}

func (t tracer) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	return ctx
}

func (t tracer) TraceConnectEnd(ctx context.Context, data pgx.TraceConnectEndData) {
	t.h.noted(ctx, data.Err)
	t.h.dials.connected(ctx, data.Err)
}

// errCheckDone rolls back the check write of checkWrite.
var errCheckDone = errors.New("postgres: the check write is done")

// checkWrite writes a page of its own in a transaction that it rolls
// back: it creates a temporary table and inserts a row, which writes the
// catalog's rows and the table's first page in the database's tablespace,
// as a full disk refuses.
func (s *Store) checkWrite(ctx context.Context) error {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `CREATE TEMPORARY TABLE companion_write_check (b bytea) ON COMMIT DROP`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO companion_write_check VALUES ('\x00')`); err != nil {
			return err
		}
		return errCheckDone
	})
	if !errors.Is(err, errCheckDone) {
		return fmt.Errorf("postgres: a check write: %w", err)
	}
	return nil
}

// Faults calls fn with the name of each fault of the database the log
// says ("unreachable", "cannot write", …) and whether it stands now, for
// the server's metrics (bug 340).
func (s *Store) Faults(fn func(name string, stands bool)) {
	s.health.faults.Each(fn)
}

// CheckWrites says whether the database takes writes now. Until it
// refuses one for want of room or as read-only (IsUnwritable: its disk
// full, a standby), it returns nil without asking. After that it tries a
// write of its own (checkWrite) and returns the error while that fails;
// once one succeeds, nil again without asking until the next refusal.
// /readyz calls it: while a full disk fails every write a load balancer
// should know, and the answer follows the disk back even when the
// balancer sends nothing meanwhile. A page the database freed meanwhile
// may take the check while a larger write still does not fit: the next
// refusal makes it ask again.
func (s *Store) CheckWrites(ctx context.Context) error {
	if !s.health.faults.Stands(faultUnwritable) {
		return nil
	}
	if err := s.checkWrite(context.WithValue(ctx, probing{}, true)); err != nil {
		return err
	}
	s.health.faults.Gone(faultUnwritable)
	return nil
}

// PoolTakenError is Ping's answer when no connection of the store's pool
// came free in time, every one it may open being in use, while the
// database answers on a connection of Ping's own: the database is up, and
// the store cannot run a statement now. Statements that wait for a lock
// another session holds (a LOCK TABLE, an ALTER TABLE, or the lock one
// waits for) take the pool so, each until LockTimeout.
type PoolTakenError struct {
	Conns     int32 // the pool's connections, each in use
	LockWaits int   // the server's sessions (its application_name) waiting for a lock
}

func (e *PoolTakenError) Error() string {
	if e.LockWaits == 0 {
		return fmt.Sprintf("the PostgreSQL store's %d connections are all in use, none waiting for a lock: the database answers, "+
			"and the server has more work than its pool (pool_max_conns in --store)", e.Conns)
	}
	return fmt.Sprintf("the PostgreSQL store's %d connections are all in use, and %d of the server's sessions wait for a lock "+
		"another session holds (pg_blocking_pids in pg_stat_activity): the database answers", e.Conns, e.LockWaits)
}

// Ping says whether the store can reach the database now: a round trip on
// one of the pool's connections. When none comes free within half of
// ctx's time, the pool having every connection it may open in use, it asks
// on a connection of its own: an error there is the database's, and a
// *PoolTakenError says that the database answers, with how many of the
// server's sessions wait for a lock. /readyz calls it: a pool taken by
// statements waiting for a lock is not a database that cannot be reached.
func (s *Store) Ping(ctx context.Context) error {
	pctx := ctx
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		pctx, cancel = context.WithDeadline(ctx, time.Now().Add(time.Until(deadline)/2))
		defer cancel()
	}
	err := s.pool.Ping(pctx)
	if err == nil || ctx.Err() != nil || pctx.Err() == nil {
		return err
	}
	if st := s.pool.Stat(); st.AcquiredConns() < st.MaxConns() {
		return err // there was room for a connection, and none was made
	}
	ctx = context.WithValue(ctx, probing{}, true)
	conn, err := pgx.ConnectConfig(ctx, s.cfg.ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	taken := &PoolTakenError{Conns: s.pool.Stat().MaxConns()}
	err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND application_name = current_setting('application_name') AND wait_event_type = 'Lock'`).Scan(&taken.LockWaits)
	if err != nil {
		return err
	}
	return taken
}
