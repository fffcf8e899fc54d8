package postgres_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/storetest"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPostgresRestoredDump restores a pg_dump older than events a client
// has seen, into a new PostgreSQL server (a lost one replaced) and into a
// new database on the same server, and runs the restored store on: a
// client that resumes with the id of an event the restored store forgot,
// or with one from before the dump, must be told it missed events, and a
// client that reads from the head must see the events made after the
// restore. Before, the events' place in the log (the transaction id of the
// server that wrote them) of a dump restored into a new server was ahead of
// that server's transactions: the restored store's new events took the
// place of the restored ones and were hidden until the new server's
// transactions caught up, and a client past them skipped them silently.
func TestPostgresRestoredDump(t *testing.T) {
	if _, err := exec.LookPath("pg_dump"); err != nil {
		t.Skip("no pg_dump:", err)
	}
	if _, err := exec.LookPath("pg_restore"); err != nil {
		t.Skip("no pg_restore:", err)
	}
	lost := pgtest.Start(t)
	for _, tt := range []struct {
		name    string
		into    func(t *testing.T) string // the DSN of a new, empty database to restore into
		oldDump bool                      // a dump of a build before events_log: the migration makes it
	}{
		{"NewServer", func(t *testing.T) string { return pgtest.Start(t).NewDatabase(t) }, false},
		{"SameServer", func(t *testing.T) string { return lost.NewDatabase(t) }, false},
		{"NewServerOldDump", func(t *testing.T) string { return pgtest.Start(t).NewDatabase(t) }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx := t.Context()
			env := &testEnv{srv: lost}
			dsn, s := env.boundStore(t)
			create := func(s interface {
				CreateCommand(context.Context, companion.Command, int, *companion.Idempotency) (companion.Command, bool, error)
			}, n int) {
				t.Helper()
				for range n {
					_, _, err := s.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", ExpiresAt: time.Now().Add(time.Hour)}, 0, nil)
					require.NoError(t, err)
				}
			}
			// The lost server has run for a while: its transaction ids
			// are well ahead of a new server's.
			burnXids(t, dsn, 2000)
			create(s, 3)
			before, err := s.EventsHead(ctx)
			require.NoError(t, err)
			dump := filepath.Join(t.TempDir(), "companion.dump")
			out, err := exec.CommandContext(ctx, "pg_dump", "-Fc", "-f", dump, "--dbname", dsn).CombinedOutput()
			require.NoError(t, err, "pg_dump: %s", out)
			create(s, 5) // a client saw these, then the database was lost
			evs, _, err := s.Events(ctx, "u1", before, 100)
			require.NoError(t, err)
			require.Len(t, evs, 5)
			seen := evs[len(evs)-1].ID
			require.NoError(t, s.Close())

			restored := tt.into(t)
			out, err = exec.CommandContext(ctx, "pg_restore", "--no-owner", "--exit-on-error", "--dbname", restored, dump).CombinedOutput()
			require.NoError(t, err, "pg_restore: %s", out)
			if tt.oldDump {
				conn, err := pgx.Connect(ctx, restored)
				require.NoError(t, err)
				_, err = conn.Exec(ctx, `UPDATE events_log SET table_oid = 'events_log'::regclass::oid`)
				require.NoError(t, err)
				require.NoError(t, conn.Close(ctx))
			}
			s2 := env.open(t, restored)
			head, err := s2.EventsHead(ctx)
			require.NoError(t, err)
			create(s2, 2)
			evs, _, err = s2.Events(ctx, "u1", head, 100)
			require.NoError(t, err)
			assert.Len(t, evs, 2, "a client reading from the head as the restored store opened sees the events made since")
			// The restored server runs on past the client's id.
			burnXids(t, restored, 2500)
			create(s2, 20)

			past, err := s2.EventsPastEnd(ctx, seen)
			require.NoError(t, err)
			purged, err := s2.EventsPurgedAfter(ctx, seen)
			require.NoError(t, err)
			if !past && !purged {
				evs, _, err := s2.Events(ctx, "u1", seen, 100)
				require.NoError(t, err)
				assert.Len(t, evs, 22, "a client at %s, an event the restored database forgot, resumes with the events made since the restore, or is told it missed events", seen)
			}
			purged, err = s2.EventsPurgedAfter(ctx, before)
			require.NoError(t, err)
			assert.True(t, purged, "a client at %s, before the dump, is not told that what it saw after it was undone", before)

			evs, _, err = s2.Events(ctx, "u1", "", 100)
			require.NoError(t, err)
			assert.GreaterOrEqual(t, len(evs), 3+22, "the log from its start")
		})
	}
}

// burnXids runs n transactions that take a transaction id each on the
// database of dsn.
func burnXids(t *testing.T, dsn string, n int) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	for range n {
		_, err := conn.Exec(t.Context(), `SELECT pg_current_xact_id()`)
		require.NoError(t, err)
	}
}

// TestPostgresRestoredEventsConformance runs the event log's conformance
// tests on databases taken for restored ones, whose log's places are
// moved on past the transaction ids (bug 428).
func TestPostgresRestoredEventsConformance(t *testing.T) {
	env := &testEnv{srv: pgtest.Start(t)}
	storetest.RunEvents(t, func(t *testing.T) companion.Store {
		dsn := env.newDB(t)
		require.NoError(t, env.open(t, dsn).Close())
		conn, err := pgx.Connect(t.Context(), dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		_, err = conn.Exec(t.Context(), `UPDATE events_log SET table_oid = 0`) // as a restore leaves it
		require.NoError(t, err)
		s := env.open(t, dsn)
		var off int64
		require.NoError(t, conn.QueryRow(t.Context(), `SELECT xid_offset FROM events_log`).Scan(&off))
		require.Positive(t, off, "the offset of a restored database")
		// The purge mark a restore puts at the move resets every cursor
		// before it, "" too (TestPostgresRestoredDump checks it); these
		// tests start from a log with nothing purged.
		_, err = conn.Exec(t.Context(), `UPDATE events_purged SET xid = '0', id = 0`)
		require.NoError(t, err)
		return s
	})
}
