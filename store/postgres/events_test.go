package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
	"github.com/devicecompanion/companion/store/storetest"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// boundStore opens a store on a new database, with device d1 provisioned
// and bound to u1.
func (e *testEnv) boundStore(t *testing.T) (dsn string, s *postgres.Store) {
	t.Helper()
	dsn = e.newDB(t)
	s = e.open(t, dsn)
	require.NoError(t, s.ProvisionDevice(t.Context(), companion.RegistryDevice{ID: "d1", Model: "m"}))
	_, _, err := s.Bind(t.Context(), companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	serve(t, s, "d1")
	return dsn, s
}

// serve makes the operator's bridge br1 (created if need be) serve each
// device (provisioned if need be): the store takes a status naming a
// bridge only from the bridge that serves its device (docs/reliability.md,
// bug 271).
func serve(t *testing.T, s *postgres.Store, devs ...string) {
	t.Helper()
	ctx := t.Context()
	if err := s.CreateBridge(ctx, companion.Bridge{ID: "br1", SecretHash: []byte("br1")}); !errors.Is(err, companion.ErrExists) {
		require.NoError(t, err, "CreateBridge(br1)")
	}
	for _, dev := range devs {
		if _, err := s.RegistryDevice(ctx, dev); errors.Is(err, companion.ErrNotFound) {
			require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "m"}))
		}
		_, err := s.AssignDevice(ctx, dev, "br1", "")
		require.NoError(t, err, "AssignDevice(%s, br1)", dev)
	}
}

// TestPostgresEvents runs the event log's conformance tests (TestPostgres
// runs them too) and the engine's own: a reader never skips an event of a
// transaction that took its id earlier and committed later.
func TestPostgresEvents(t *testing.T) {
	env := &testEnv{srv: pgtest.Start(t)}
	t.Run("Conformance", func(t *testing.T) {
		storetest.RunEvents(t, func(t *testing.T) companion.Store { return env.open(t, env.newDB(t)) })
	})
	t.Run("LaterCommitOfEarlierID", func(t *testing.T) {
		ctx := t.Context()
		dsn, s := env.boundStore(t)

		// A transaction appends an event (its id from the sequence comes
		// first) and stays open while the store commits a later one.
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background())
		_, err = tx.Exec(ctx, `INSERT INTO events (xid, user_id, device_id, at, data)
			VALUES (pg_current_xact_id(), 'u1', 'd1', now(), '{"kind":"command","device_id":"d1","at":"2026-01-01T00:00:00Z","command":{"id":"early","op":"x","state":"queued"}}')`)
		require.NoError(t, err)
		c, _, err := s.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", ExpiresAt: time.Now().Add(time.Hour)}, 0, nil)
		require.NoError(t, err)

		evs, next, err := s.Events(ctx, "u1", "", 100)
		require.NoError(t, err)
		assert.Empty(t, evs, "an event committed while an older transaction is open shows only once that one has ended")

		require.NoError(t, tx.Commit(ctx))
		evs, next2, err := s.Events(ctx, "u1", next, 100)
		require.NoError(t, err)
		require.Len(t, evs, 2, "both, from the cursor read while the first was open")
		assert.Equal(t, "early", evs[0].Command.ID)
		assert.Equal(t, c.ID, evs[1].Command.ID)
		assert.Less(t, evs[0].ID, evs[1].ID)
		assert.Greater(t, next2, next)
	})
	t.Run("PastEndAroundOpenTransaction", func(t *testing.T) {
		ctx := t.Context()
		dsn, s := env.boundStore(t)
		create := func() {
			t.Helper()
			_, _, err := s.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", ExpiresAt: time.Now().Add(time.Hour)}, 0, nil)
			require.NoError(t, err)
		}
		create() // id 1
		pastEnd := func(xid, id uint64) bool {
			t.Helper()
			c := fmt.Sprintf("%016x-%016x", xid, id)
			past, err := s.EventsPastEnd(ctx, c)
			require.NoError(t, err, "EventsPastEnd(%q)", c)
			return past
		}

		// A transaction appends an event (id 2) and stays open, with an
		// xid at or above the xmax of the snapshots taken meanwhile (one
		// past the last transaction that ended): that xmax does not tell
		// the end. (Retried in case a transaction elsewhere on the server,
		// autovacuum's, ends with a later xid meanwhile.)
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		other, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer other.Close(context.Background())
		var tx pgx.Tx
		var xid, id uint64
		for attempt := 1; ; attempt++ {
			tx, err = conn.Begin(ctx)
			require.NoError(t, err)
			var xidText string
			require.NoError(t, tx.QueryRow(ctx, `INSERT INTO events (xid, user_id, device_id, at, data)
				VALUES (pg_current_xact_id(), 'u1', 'd1', now(), '{"kind":"command","device_id":"d1","at":"2026-01-01T00:00:00Z","command":{"id":"open","op":"x","state":"queued"}}')
				RETURNING xid::text, id`).Scan(&xidText, &id))
			xid, err = strconv.ParseUint(xidText, 10, 64)
			require.NoError(t, err)
			var xmaxText string
			require.NoError(t, other.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text`).Scan(&xmaxText))
			xmax, err := strconv.ParseUint(xmaxText, 10, 64)
			require.NoError(t, err)
			if xid >= xmax {
				break
			}
			require.NoError(t, tx.Rollback(ctx))
			require.Less(t, attempt, 10, "an open transaction's xid %d stays below the xmax %d", xid, xmax)
		}
		defer tx.Rollback(context.Background())

		assert.False(t, pastEnd(xid, id), "the id of the open transaction's event")
		assert.False(t, pastEnd(xid, 0), "the cursor before it")
		assert.True(t, pastEnd(xid, id+1), "an id the sequence has not handed out")
		assert.True(t, pastEnd(xid+1<<20, 0), "an xid no transaction has had")
		assert.True(t, pastEnd(xid+1<<20, 1), "an xid no transaction has had")
		assert.True(t, pastEnd(1<<62, 1), "an xid no transaction has had")

		// A later transaction commits an event (id 3) meanwhile: its id is
		// above the head (the open transaction holds the xmin back), and
		// not past the end.
		create()
		head, err := s.EventsHead(ctx)
		require.NoError(t, err)
		all, _, err := s.Events(ctx, "", "", 100)
		require.NoError(t, err)
		require.Len(t, all, 1, "only the event before the open transaction shows")
		evs, err := eventsInTable(ctx, other)
		require.NoError(t, err)
		require.Len(t, evs, 2, "the committed events")
		committed := evs[1]
		assert.Greater(t, committed, head, "the later event's id is above the head")
		past, err := s.EventsPastEnd(ctx, committed)
		require.NoError(t, err)
		assert.False(t, past, "EventsPastEnd(%q) of an event committed while an older transaction is open", committed)

		// Rolled back, its ids stay taken.
		require.NoError(t, tx.Rollback(ctx))
		assert.False(t, pastEnd(xid, id), "the id of a rolled back event")
		assert.True(t, pastEnd(xid, id+2), "an id the sequence has not handed out")
	})
	t.Run("ListenEvents", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		s := env.open(t, env.newDB(t))
		require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "m"}))
		_, _, err := s.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"})
		require.NoError(t, err)
		woke := make(chan struct{}, 100)
		done := make(chan error, 1)
		go func() { done <- s.ListenEvents(ctx, func() { woke <- struct{}{} }) }()
		defer func() {
			cancel()
			<-done
		}()
		// The first wake comes once LISTEN is in place (bug 252); then
		// write until a notification comes.
		select {
		case <-woke:
		case <-time.After(waitFor):
			t.Fatal("no wake once LISTEN was in place")
		}
		deadline := time.After(waitFor)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		battery := 0
		for {
			battery++
			_, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, Battery: &battery, Model: "m", LastSeen: time.Now(), Seq: uint64(battery)})
			require.NoError(t, err)
			select {
			case <-woke:
				return
			case <-tick.C:
			case <-deadline:
				t.Fatal("no notification of events")
			}
		}
	})
}

// eventsInTable returns the ids of the events committed, as cursors, in
// log order, read from the table without the readers' xmin bound.
func eventsInTable(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `SELECT xid::text, id FROM events ORDER BY xid, id`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (string, error) {
		var (
			xidText string
			id      uint64
		)
		if err := row.Scan(&xidText, &id); err != nil {
			return "", err
		}
		xid, err := strconv.ParseUint(xidText, 10, 64)
		return fmt.Sprintf("%016x-%016x", xid, id), err
	})
}
