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

// SetPurgeBatch makes the Purge methods of s delete at most n rows a
// transaction and call after (if not nil) between two of their
// transactions. Call it before s is used.
func SetPurgeBatch(s *Store, n int, after func()) {
	s.purgeBatch, s.afterPurgeBatch = n, after
}

// DeviceHash is the device's hash: a lane's batch takes its writes' locks
// in the order of their devices' hashes.
func DeviceHash(deviceID string) uint16 { return deviceHash(deviceID) }

// LaneOf returns the index of the lane that runs the device's writes on s.
func LaneOf(s *Store, deviceID string) int { return int(deviceHash(deviceID)) % len(s.lanes) }

// PoolMaxConns is the bound of s's connection pool.
func PoolMaxConns(s *Store) int32 { return s.pool.Config().MaxConns }

// SetHookListen has f called by the listeners of every store (ListenCommands,
// ListenEvents) on their new connection before it LISTENs, until the test
// ends. Only one test at a time may set it, before it starts listening.
func SetHookListen(t testing.TB, f func(ctx context.Context)) {
	testHookListen.Store(&f)
	t.Cleanup(func() { testHookListen.Store(nil) })
}
