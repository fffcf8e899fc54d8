package postgres

import (
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A database of schema 4 whose events its build purged kept no mark of
// them: migration 5 starts the mark just below the oldest event kept, or at
// its own transaction when none is, so that a client that resumes across
// the upgrade from before them gets its reset (docs/reliability.md, bug
// 305). A database whose log lost nothing starts with no mark.
func TestMigrationMarksTheEventsAnOldBuildPurged(t *testing.T) {
	srv := pgtest.Start(t)
	ms, err := migrations()
	require.NoError(t, err)
	// schema4 makes a database of schema 4, as companion migrate of a
	// build before migration 5 left it, with n events of which the old
	// build's purge deleted the first purged; it returns the DSN and the
	// events' cursors.
	schema4 := func(n, purged int) (string, []string) {
		t.Helper()
		dsn := srv.NewDatabase(t)
		conn, err := pgx.Connect(t.Context(), dsn)
		require.NoError(t, err)
		defer conn.Close(t.Context())
		_, err = conn.Exec(t.Context(), `CREATE TABLE schema_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`)
		require.NoError(t, err)
		for _, m := range ms[:4] {
			_, err := conn.Exec(t.Context(), m.sql)
			require.NoError(t, err, m.name)
			_, err = conn.Exec(t.Context(), `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.version, m.name)
			require.NoError(t, err)
		}
		var cursors []string
		for i := range n {
			at := time.Now()
			if i < purged {
				at = at.Add(-3 * time.Hour)
			}
			var c eventCursor
			err := conn.QueryRow(t.Context(), `INSERT INTO events (xid, user_id, device_id, at, data)
				VALUES (pg_current_xact_id(), 'u1', 'd1', $1, '{}') RETURNING xid::text::bigint, id`, at).Scan(&c.xid, &c.id)
			require.NoError(t, err)
			cursors = append(cursors, c.String())
		}
		// The purge of schema 4 (PurgeEvents before migration 5).
		_, err = conn.Exec(t.Context(), `DELETE FROM events WHERE at < $1`, time.Now().Add(-2*time.Hour))
		require.NoError(t, err)
		return dsn, cursors
	}
	purgedAfter := func(s *Store, cursor string) bool {
		t.Helper()
		purged, err := s.EventsPurgedAfter(t.Context(), cursor)
		require.NoError(t, err)
		return purged
	}
	open := func(dsn string) *Store {
		t.Helper()
		s, err := Open(t.Context(), dsn, Options{MaxConns: 2, Migrate: true})
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return s
	}

	dsn, cursors := schema4(5, 3)
	s := open(dsn)
	for _, c := range append([]string{""}, cursors[:2]...) {
		assert.True(t, purgedAfter(s, c), "EventsPurgedAfter(%s), before the events 1 to 3 schema 4 purged", c)
	}
	// The last purged may go either way: its xid is gone with it.
	for _, c := range cursors[3:] {
		assert.False(t, purgedAfter(s, c), "EventsPurgedAfter(%s), from the oldest kept on", c)
	}

	dsn, cursors = schema4(3, 3)
	s = open(dsn)
	for _, c := range append([]string{""}, cursors[:2]...) {
		assert.True(t, purgedAfter(s, c), "EventsPurgedAfter(%s), before the events schema 4 purged, all of them", c)
	}

	dsn, cursors = schema4(3, 0)
	s = open(dsn)
	for _, c := range append([]string{""}, cursors...) {
		assert.False(t, purgedAfter(s, c), "EventsPurgedAfter(%s), nothing purged", c)
	}
}
