package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/storetest"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

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
		dsn := env.newDB(t)
		s := env.open(t, dsn)
		require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "m"}))
		_, _, err := s.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"})
		require.NoError(t, err)

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
		// LISTEN takes a moment: write until a notification comes.
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
