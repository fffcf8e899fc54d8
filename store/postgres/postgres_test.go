package postgres_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
	"github.com/devicecompanion/companion/store/storetest"

	"github.com/jackc/pgx/v5"
)

// TestPostgres runs every test of the package against one PostgreSQL
// server, each subtest on a database of its own.
func TestPostgres(t *testing.T) {
	srv := pgtest.Start(t)
	env := &testEnv{srv: srv}
	t.Run("Conformance", func(t *testing.T) {
		// A schema of its own for each store, in one database: much
		// quicker to make than a database.
		dsn := env.newDB(t)
		admin, err := pgx.Connect(t.Context(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer admin.Close(context.Background())
		n := 0
		storetest.Run(t, func(t *testing.T) companion.Store {
			n++
			schema := fmt.Sprintf("s%d", n)
			if _, err := admin.Exec(t.Context(), "CREATE SCHEMA "+schema); err != nil {
				t.Fatal(err)
			}
			return env.open(t, dsn+"&search_path="+schema)
		})
	})
	for _, tt := range ownTests {
		t.Run(tt.name, func(t *testing.T) { tt.run(t, env) })
	}
}

// testEnv is the server the tests share.
type testEnv struct {
	srv *pgtest.Server
}

// newDB returns the DSN of a new, empty database.
func (e *testEnv) newDB(t *testing.T) string {
	t.Helper()
	return e.srv.NewDatabase(t)
}

// open opens a store on the database of dsn, closed when the test ends.
func (e *testEnv) open(t *testing.T, dsn string) *postgres.Store {
	t.Helper()
	return e.openWith(t, dsn, postgres.Options{})
}

func (e *testEnv) openWith(t *testing.T, dsn string, opts postgres.Options) *postgres.Store {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if opts.MaxConns == 0 {
		opts.MaxConns = 8
	}
	opts.Migrate = true
	s, err := postgres.Open(t.Context(), dsn, opts)
	if err != nil {
		t.Fatalf("Open = %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close = %v", err)
		}
	})
	return s
}

var ownTests []struct {
	name string
	run  func(t *testing.T, e *testEnv)
}

// waitFor bounds the waits of the tests.
const waitFor = 20 * time.Second
