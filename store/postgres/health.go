package postgres

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// health is what the store has learnt of the database from the answers
// to its statements (tracer): whether its last refusal to write still
// stands.
type health struct {
	// unwritable is set when PostgreSQL refuses a write for want of
	// room or as read-only (IsUnwritable), and cleared by a check write
	// that succeeds (CheckWrites).
	unwritable atomic.Bool
}

// noted takes in the outcome of one statement, connection or batch.
func (h *health) noted(err error) {
	if IsUnwritable(err) {
		h.unwritable.Store(true)
	}
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

func (t tracer) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	t.h.noted(data.Err)
}

func (t tracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (t tracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	t.h.noted(data.Err)
}

func (t tracer) TraceBatchEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	t.h.noted(data.Err)
}

func (t tracer) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	return ctx
}

func (t tracer) TraceCopyFromEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceCopyFromEndData) {
	t.h.noted(data.Err)
}

func (t tracer) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	return ctx
}

func (t tracer) TraceConnectEnd(_ context.Context, data pgx.TraceConnectEndData) {
	t.h.noted(data.Err)
}

// errCheckDone rolls back the check write of CheckWrites.
var errCheckDone = errors.New("postgres: the check write is done")

// CheckWrites says whether the database takes writes now. Until it
// refuses one for want of room or as read-only (IsUnwritable: its disk
// full, a standby), it returns nil without asking. After that it writes
// a page of its own in a transaction that it rolls back (it creates a
// temporary table and inserts a row: the catalog's rows and the table's
// first page, in the database's tablespace, which a full disk refuses),
// and returns the error while that fails; once one succeeds, nil again
// without asking until the next refusal. /readyz calls it: while a full
// disk fails every write a load balancer should know, and the answer
// follows the disk back even when the balancer sends nothing meanwhile.
// A page the database freed meanwhile may take the check while a larger
// write still does not fit: the next refusal makes it ask again.
func (s *Store) CheckWrites(ctx context.Context) error {
	if !s.health.unwritable.Load() {
		return nil
	}
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
	s.health.unwritable.Store(false)
	return nil
}
