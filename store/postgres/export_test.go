package postgres

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// SetHookHeld has f called on a campaign's connection just after it took
// the dispatcher's lock, until the test ends. Only one test at a time may
// set it, before it starts campaigning.
func SetHookHeld(t testing.TB, f func(ctx context.Context, conn *pgx.Conn)) {
	testHookHeld.Store(&f)
	t.Cleanup(func() { testHookHeld.Store(nil) })
}
