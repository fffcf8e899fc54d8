package postgres_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestRateLimiter runs the shared rate limiter's tests on one PostgreSQL
// server, each on a database of its own, with two Store values on it
// standing for two replicas.
func TestRateLimiter(t *testing.T) {
	env := &testEnv{srv: pgtest.Start(t)}
	// replicas opens two stores on one new database and a limiter on
	// each with opts.
	replicas := func(t *testing.T, opts postgres.RateLimiterOptions) (a, b *postgres.RateLimiter, dsn string) {
		dsn = env.newDB(t)
		return env.open(t, dsn).RateLimiter(opts), env.open(t, dsn).RateLimiter(opts), dsn
	}
	ctx := t.Context()

	// Burst N: N requests admitted across both replicas, the next refused
	// on either, until time refills the bucket.
	t.Run("ReplicasShareOneBudget", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		const key, rate, burst = "request:user:u1", 1.0, 5
		for i := range burst {
			l := []*postgres.RateLimiter{a, b}[i%2]
			ok, wait, err := l.Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			require.True(t, ok, "request %d of the burst refused", i+1)
			assert.Zero(t, wait)
		}
		for name, l := range map[string]*postgres.RateLimiter{"a": a, "b": b} {
			ok, wait, err := l.Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			assert.False(t, ok, "replica %s admitted request %d", name, burst+1)
			assert.Equal(t, time.Second, wait, "replica %s: retry after", name)
			ok, wait, err = l.Peek(ctx, key, rate, burst)
			require.NoError(t, err)
			assert.False(t, ok, "replica %s: Peek", name)
			assert.Equal(t, time.Second, wait, "replica %s: Peek's retry after", name)
		}
		// Another key has its own bucket.
		ok, _, err := b.Allow(ctx, "request:user:u2", rate, burst)
		require.NoError(t, err)
		assert.True(t, ok, "another key")

		clk.Add(400 * time.Millisecond)
		ok, wait, err := b.Allow(ctx, key, rate, burst)
		require.NoError(t, err)
		assert.False(t, ok, "0.4 tokens")
		assert.InDelta(t, 600*time.Millisecond, wait, float64(time.Millisecond), "retry after with 0.4 tokens")

		clk.Add(600 * time.Millisecond)
		ok, _, err = b.Allow(ctx, key, rate, burst)
		require.NoError(t, err)
		assert.True(t, ok, "a second later: one token")
		ok, _, err = a.Allow(ctx, key, rate, burst)
		require.NoError(t, err)
		assert.False(t, ok, "and only one, on the other replica too")

		// Idle for long, the bucket holds its burst and no more.
		clk.Add(time.Hour)
		admitted := 0
		for i := range 2 * burst {
			ok, _, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			if ok {
				admitted++
			}
		}
		assert.Equal(t, burst, admitted, "admitted after an hour idle")
	})

	t.Run("PeekTakesNothing", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		const key = "unauth:192.0.2.1"
		for _, l := range []*postgres.RateLimiter{a, b, a} {
			ok, _, err := l.Peek(ctx, key, 1.0/60, 2)
			require.NoError(t, err)
			require.True(t, ok, "Peek of a full bucket")
		}
		for i, want := range []bool{true, true, false} {
			ok, _, err := b.Allow(ctx, key, 1.0/60, 2)
			require.NoError(t, err)
			require.Equal(t, want, ok, "Allow #%d", i+1)
		}
		ok, wait, err := a.Peek(ctx, key, 1.0/60, 2)
		require.NoError(t, err)
		assert.False(t, ok, "Peek of an empty bucket")
		assert.Equal(t, time.Minute, wait)
	})

	// Many requests at once from both replicas: exactly the burst gets
	// through (the clock stands still, so nothing refills).
	t.Run("Concurrent", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		const key, burst, workers, each = "register:u1", 25, 8, 10
		var admitted atomic.Int64
		var wg sync.WaitGroup
		for w := range workers {
			l := []*postgres.RateLimiter{a, b}[w%2]
			wg.Go(func() {
				for range each {
					ok, wait, err := l.Allow(ctx, key, 10.0/60, burst)
					if !assert.NoError(t, err) {
						return
					}
					if ok {
						admitted.Add(1)
					} else {
						assert.Positive(t, wait)
					}
				}
			})
		}
		wg.Wait()
		assert.EqualValues(t, burst, admitted.Load(), "admitted of %d", workers*each)
	})

	// Without a clock of its own the limiter takes the database's, and the
	// replicas still share one bucket.
	t.Run("DatabaseClock", func(t *testing.T) {
		a, b, _ := replicas(t, postgres.RateLimiterOptions{})
		const key, rate, burst = "request:admin", 0.001, 3
		for i, want := range []bool{true, true, true, false, false} {
			ok, wait, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			require.Equal(t, want, ok, "request %d", i+1)
			if !ok {
				// A little has refilled between the statements.
				assert.InDelta(t, 1000*time.Second, wait, float64(10*time.Second), "retry after")
			}
		}
		ok, _, err := a.Allow(ctx, key, -1, burst)
		require.NoError(t, err)
		assert.True(t, ok, "a negative rate admits everything")
	})

	// The clock stepped back an hour (NTP setting right the database
	// server's clock): a bucket used just before counts as full, as a
	// swept one, and refills from the new time, not from the hour ahead
	// its row was written at (bug 329).
	t.Run("ClockSteppedBack", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		const key, rate, burst = "request:user:u1", 1.0, 2
		for i, want := range []bool{true, true, false} {
			ok, _, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			require.Equal(t, want, ok, "request %d before the step", i+1)
		}
		clk.Add(-time.Hour)
		ok, _, err := a.Peek(ctx, key, rate, burst)
		require.NoError(t, err)
		assert.True(t, ok, "Peek after the step: a full bucket, as a swept one")
		for i, want := range []bool{true, true, false} {
			ok, _, err := []*postgres.RateLimiter{b, a}[i%2].Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			assert.Equal(t, want, ok, "request %d after the step", i+1)
		}
		clk.Add(time.Second)
		for i, want := range []bool{true, false} {
			ok, _, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, key, rate, burst)
			require.NoError(t, err)
			assert.Equal(t, want, ok, "request %d a second after the step", i+1)
		}
	})

	// A bucket that never refills: its burst, then refusals.
	t.Run("ZeroRate", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		for i, want := range []bool{true, true, false} {
			ok, wait, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, "k", 0, 2)
			require.NoError(t, err)
			require.Equal(t, want, ok, "request %d", i+1)
			if !ok {
				assert.Equal(t, time.Hour, wait)
			}
		}
	})

	// A bucket refilling slower than an interval can count: before, every
	// Allow of it failed "interval out of range", and the API answered
	// every request 503 (bug 245).
	t.Run("RateTooSlowForAnInterval", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		for i, want := range []bool{true, true, false} {
			ok, wait, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, "request:user:u1", 1e-13, 2)
			require.NoError(t, err, "request %d", i+1)
			require.Equal(t, want, ok, "request %d", i+1)
			if !ok {
				assert.Equal(t, 365*24*time.Hour, wait, "retry after: a year at most")
			}
		}
		ok, wait, err := a.Peek(ctx, "request:user:u1", 1e-13, 2)
		require.NoError(t, err)
		assert.False(t, ok, "Peek")
		assert.Equal(t, 365*24*time.Hour, wait, "Peek's retry after")
	})

	// Keys text cannot hold, or long ones, are stored as their hash.
	t.Run("OddKeys", func(t *testing.T) {
		clk := newFakeClock()
		a, b, _ := replicas(t, postgres.RateLimiterOptions{Now: clk.Now})
		long := string(make([]byte, 300))
		for _, key := range []string{"nul\x00byte", "bad\xffutf8", long, "a" + long} {
			for i, want := range []bool{true, false} {
				ok, _, err := []*postgres.RateLimiter{a, b}[i%2].Allow(ctx, key, 1, 1)
				require.NoError(t, err, "key %q", key)
				assert.Equal(t, want, ok, "key %q, request %d", key, i+1)
			}
		}
	})

	// Rows of buckets that have refilled are deleted; such a key has a
	// full bucket, as a key never seen.
	t.Run("SweepsRefilledBuckets", func(t *testing.T) {
		clk := newFakeClock()
		a, _, dsn := replicas(t, postgres.RateLimiterOptions{Now: clk.Now, SweepInterval: time.Minute})
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		keys := func() []string {
			t.Helper()
			rows, err := conn.Query(ctx, `SELECT key FROM rate_buckets ORDER BY key`)
			require.NoError(t, err)
			ks, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			return ks
		}
		for range 2 {
			ok, _, err := a.Allow(ctx, "quick", 1, 2) // full again 2 s later
			require.NoError(t, err)
			require.True(t, ok)
		}
		ok, _, err := a.Allow(ctx, "slow", 0.01, 10) // full again 100 s later
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, []string{"quick", "slow"}, keys())

		clk.Add(30 * time.Second)
		_, _, err = a.Allow(ctx, "other", 1, 1)
		require.NoError(t, err)
		assert.Equal(t, []string{"other", "quick", "slow"}, keys(), "before the interval: no sweep")

		clk.Add(31 * time.Second)
		_, _, err = a.Allow(ctx, "last", 1, 1)
		require.NoError(t, err)
		assert.Equal(t, []string{"last", "slow"}, keys(), "after the interval")
		for i := range 2 {
			ok, _, err := a.Allow(ctx, "quick", 1, 2)
			require.NoError(t, err)
			assert.True(t, ok, "a swept key's request %d", i+1)
		}
	})

	// The clock stepped back an hour: the next Allow sweeps, and the rows
	// written before the step go (they count as full buckets, bug 329).
	// The next sweep was due at a time an hour ahead, and the rows full
	// then: the table kept every key used, for as long as the step (bug
	// 344).
	t.Run("SweepsAfterTheClockSteppedBack", func(t *testing.T) {
		clk := newFakeClock()
		a, _, dsn := replicas(t, postgres.RateLimiterOptions{Now: clk.Now, SweepInterval: time.Minute})
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		for _, key := range []string{"a", "b"} {
			_, _, err := a.Allow(ctx, key, 1, 2)
			require.NoError(t, err)
		}
		clk.Add(-time.Hour)
		_, _, err = a.Allow(ctx, "after", 1, 2)
		require.NoError(t, err)
		rows, err := conn.Query(ctx, `SELECT key FROM rate_buckets ORDER BY key`)
		require.NoError(t, err)
		ks, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		assert.Equal(t, []string{"after"}, ks, "rows after the step")
	})

	// Last, as it stops the server: the limiter's errors say the database
	// cannot be reached, which the API answers 503.
	t.Run("Unavailable", func(t *testing.T) {
		a, _, _ := replicas(t, postgres.RateLimiterOptions{})
		_, _, err := a.Allow(ctx, "k", 1, 1) // a connection in the pool
		require.NoError(t, err)
		require.NoError(t, env.srv.Stop())
		ctx, cancel := context.WithTimeout(ctx, waitFor)
		defer cancel()
		_, _, err = a.Allow(ctx, "k", 1, 1)
		assert.True(t, postgres.IsUnavailable(err), "Allow = %v; want an unavailable error", err)
		_, _, err = a.Peek(ctx, "k", 1, 1)
		assert.True(t, postgres.IsUnavailable(err), "Peek = %v; want an unavailable error", err)
	})
}

// BenchmarkRateLimiterAllow times one Allow (one round trip) from many
// callers at once, on a PostgreSQL of its own on this machine, each caller
// on a key of its own.
func BenchmarkRateLimiterAllow(b *testing.B) {
	srv := pgtest.Start(b)
	s, err := postgres.Open(context.Background(), srv.NewDatabase(b), postgres.Options{Migrate: true})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	l := s.RateLimiter(postgres.RateLimiterOptions{})
	ctx := context.Background()
	var n atomic.Int64
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		key := fmt.Sprintf("request:user:%d", n.Add(1))
		for pb.Next() {
			if _, _, err := l.Allow(ctx, key, 1e9, 100); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "allows/s")
}
