package postgres_test

import (
	"testing"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What a write returned nil for survives a crash of PostgreSQL (kill -9
// and crash recovery): it was committed and flushed. Its own server, as
// it kills it.
func TestCommittedSurvivesCrash(t *testing.T) {
	t.Parallel() // it mostly waits, on a PostgreSQL of its own
	srv := pgtest.Start(t)
	e := &testEnv{srv: srv}
	dsn := e.newDB(t)
	s, err := postgres.Open(t.Context(), dsn, postgres.Options{MaxConns: 4, Migrate: true})
	require.NoError(t, err)
	var made []companion.Command
	for range 5 {
		c, _, err := s.CreateCommand(t.Context(), cmd("d1"), 0, nil)
		require.NoError(t, err)
		made = append(made, c)
	}
	done := make(chan error, 1)
	s.UpdateCommandAsync(made[0].ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil },
		func(_ companion.Command, err error) { done <- err })
	require.NoError(t, <-done)
	srv.Kill(t)
	require.NoError(t, s.Close())
	srv.Restart(t)

	s2 := e.open(t, dsn)
	list, _, err := s2.ListCommands(t.Context(), companion.CommandQuery{DeviceID: "d1"})
	require.NoError(t, err)
	assert.Len(t, list, len(made), "commands after the crash")
	got, err := s2.Command(t.Context(), made[0].ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, got.State, "state after the crash")
	n, err := s2.CountOpen(t.Context(), "d1")
	require.NoError(t, err)
	assert.Equal(t, len(made)-1, n, "CountOpen after the crash")
}
