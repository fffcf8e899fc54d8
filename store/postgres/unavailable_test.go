package postgres_test

import (
	"log/slog"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

func init() {
	ownTests = append(ownTests, struct {
		name string
		run  func(t *testing.T, e *testEnv)
	}{"ReadOnlyIsUnavailable", testReadOnlyIsUnavailable})
}

// A database that takes no writes (read-only by its settings, as a
// standby is) refuses a command with an error the API answers 503
// unavailable, not 500; once it takes writes again the same store writes,
// without a reopen.
func testReadOnlyIsUnavailable(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	s := e.open(t, dsn)
	ctx := t.Context()
	_, _, err := s.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)
	admin, err := pgx.Connect(ctx, e.srv.DSN)
	require.NoError(t, err)
	defer admin.Close(ctx)
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	db := strings.TrimPrefix(u.Path, "/")
	// New sessions of the database start read-only; the store's are
	// ended, so that it makes new ones.
	setReadOnly := func(on bool) {
		t.Helper()
		v := "off"
		if on {
			v = "on"
		}
		_, err := admin.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+" SET default_transaction_read_only = "+v)
		require.NoError(t, err)
		_, err = admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`, db)
		require.NoError(t, err)
	}

	setReadOnly(true)
	for attempt := 1; ; attempt++ {
		_, _, err = s.CreateCommand(ctx, cmd("d1"), 0, nil)
		require.Error(t, err, "a command on a read-only database")
		assert.True(t, postgres.IsUnavailable(err), "IsUnavailable(%v) = false; want true", err)
		if postgres.IsUnwritable(err) {
			break
		}
		// The first calls may meet the connections that were ended.
		require.Less(t, attempt, 20, "a command on a read-only database: %v; want the refusal to write", err)
	}

	setReadOnly(false)
	for attempt := 1; ; attempt++ {
		_, _, err = s.CreateCommand(ctx, cmd("d1"), 0, nil)
		if err == nil {
			break
		}
		require.Less(t, attempt, 20, "a command once the database takes writes: %v", err)
	}
}

// A database that cannot be reached is said once in the store's log as
// the statements start failing, with what to do, and once as it answers
// again, however many statements met it; its own server, as it stops it.
func TestFaultIsLoggedOnce(t *testing.T) {
	srv := pgtest.Start(t)
	var log testenv.Buffer
	s, err := postgres.Open(t.Context(), srv.NewDatabase(t), postgres.Options{
		MaxConns: 4, Migrate: true,
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	require.NoError(t, err)
	defer s.Close()
	ctx := t.Context()
	made, _, err := s.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)

	require.NoError(t, srv.Stop())
	for range 50 {
		_, _, err = s.CreateCommand(ctx, cmd("d1"), 0, nil)
		require.True(t, postgres.IsUnavailable(err), "a command while the database is stopped: %v", err)
		_, err = s.Command(ctx, made.ID)
		require.True(t, postgres.IsUnavailable(err), "a read while the database is stopped: %v", err)
	}
	srv.Restart(t)
	testenv.Eventually(t, waitFor, "the database said to answer again", func() bool {
		return strings.Contains(log.String(), "the database answers again")
	})
	_, _, err = s.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)

	out := log.String()
	t.Logf("the store's log:\n%s", out)
	assert.Equal(t, 1, strings.Count(out, "level=ERROR"), "errors in the log")
	assert.Equal(t, 1, strings.Count(out, `level=ERROR msg="postgres: the database cannot be reached`), "the outage said")
	assert.Contains(t, out, "check that PostgreSQL runs", "what to do")
	assert.Equal(t, 1, strings.Count(out, `msg="postgres: the database answers again"`), "its end said")
	assert.Zero(t, strings.Count(out, "level=WARN"), "warnings in the log")
}
