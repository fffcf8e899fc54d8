package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// RateLimiter keeps token buckets in the database, a row of rate_buckets
// per key, so that every replica on the database counts against one
// budget: the API's rate limits (api.RateLimiter) shared by replicas
// (CONTRACT §11). Make it with Store.RateLimiter. It is safe for
// concurrent use, by any number of processes on one database.
//
// Allow is one statement, one round trip: an UPSERT that refills the
// key's bucket by the time elapsed since its last use, takes a token when
// there is one and returns whether it did, under the row's lock, so that
// concurrent requests on any replica each see the last one's bucket.
// Peek is one read. A key never seen, or whose row was swept, has a full
// bucket. The buckets are not promises: the table is UNLOGGED (see
// migrations/0003_rate_buckets.sql), and a crash of PostgreSQL forgets
// them.
//
// When the database cannot be reached, Allow and Peek return its error
// (IsUnavailable tells it): the API answers it 503, as it answers every
// other request while the store is away, rather than admit requests it
// could not count.
type RateLimiter struct {
	s     *Store
	now   func() time.Time // nil: the database's clock
	sweep time.Duration
	// nextSweep is when (UnixNano, on the local clock or now) the next
	// Allow sweeps refilled rows away.
	nextSweep atomic.Int64
}

// RateLimiterOptions configure Store.RateLimiter. The zero value gives the
// defaults.
type RateLimiterOptions struct {
	// Now is the buckets' clock. nil, the default, takes the database's
	// (statement_timestamp()): one clock for every replica, whatever
	// theirs say. Tests inject their own.
	Now func() time.Time
	// SweepInterval is how often this limiter deletes the rows of buckets
	// that have refilled (a missing row stands for a full bucket, so the
	// table holds only the keys used lately); a minute when <= 0.
	SweepInterval time.Duration
}

// RateLimiter returns a limiter whose buckets are in the store's database,
// shared with every other Store on it. It has nothing to close: it goes
// with the store.
func (s *Store) RateLimiter(opts RateLimiterOptions) *RateLimiter {
	if opts.SweepInterval <= 0 {
		opts.SweepInterval = time.Minute
	}
	return &RateLimiter{s: s, now: opts.Now, sweep: opts.SweepInterval}
}

// allowSQL refills the bucket of $1 to the time $2 (NULL: the database's
// clock) at $3 tokens a second up to $4, and takes a token when it holds
// one. A key without a row starts full: it takes the first token at once.
// The clock never runs back: a row last written by a replica whose clock
// is ahead, or by a statement that began after ours and took the row's
// lock first, refills from its time, not ours. But a row written more than
// a minute ahead (stepAhead) was written before the clock stepped back: its
// bucket counts as full, as a swept one, and refills from now (with the
// row's time, a step back of an hour refused every request of a busy
// bucket for that hour, and Peek an address's: docs/reliability.md,
// bug 329). full_at is when the bucket
// will be full again, after which the row may be swept; 'infinity' for a
// bucket that takes more than 1e11 s (3,000 years) to fill, past what an
// interval holds (bug 245: every request was an error), or that never
// refills.
const allowSQL = `
WITH p AS (
	SELECT coalesce($2::timestamptz, statement_timestamp()) AS now, $3::float8 AS rate, $4::float8 AS burst
)
INSERT INTO rate_buckets AS b (key, tokens, updated_at, full_at, granted)
SELECT $1, p.burst - 1, p.now,
	CASE WHEN p.rate <= 0 THEN 'infinity' WHEN 1 / p.rate >= 1e11 THEN 'infinity' ELSE p.now + interval '1 second' / p.rate END, true
FROM p
ON CONFLICT (key) DO UPDATE SET (tokens, granted, updated_at, full_at) = (
	SELECT t.tokens, t.granted, t.at,
		CASE WHEN p.rate <= 0 THEN 'infinity' WHEN (p.burst - t.tokens) / p.rate >= 1e11 THEN 'infinity'
			ELSE t.at + interval '1 second' * ((p.burst - t.tokens) / p.rate) END
	FROM p, (
		SELECT r.level - CASE WHEN r.level >= 1 THEN 1 ELSE 0 END AS tokens, r.level >= 1 AS granted, r.at
		FROM p, (
			SELECT CASE WHEN b.updated_at > p.now + ` + stepAhead + ` THEN p.burst
					ELSE least(p.burst, b.tokens + greatest(0, extract(epoch FROM p.now - b.updated_at)::float8) * p.rate) END AS level,
				CASE WHEN b.updated_at > p.now + ` + stepAhead + ` THEN p.now ELSE greatest(b.updated_at, p.now) END AS at
			FROM p
		) AS r
	) AS t
)
RETURNING granted, tokens`

// peekSQL is the level of $1's bucket at $2, as allowSQL would refill it.
const peekSQL = `
SELECT CASE WHEN updated_at > p.now + ` + stepAhead + ` THEN $4::float8
	ELSE least($4::float8, tokens + greatest(0, extract(epoch FROM p.now - updated_at)::float8) * $3::float8) END
FROM rate_buckets, (SELECT coalesce($2::timestamptz, statement_timestamp()) AS now) AS p WHERE key = $1`

// stepAhead is how far ahead of the clock a bucket's row may have been
// written and still be the clock's (a replica's clock ahead, a statement
// that waited for the row's lock): past it, the clock stepped back since.
const stepAhead = `interval '1 minute'`

// sweepSQL deletes the rows of buckets that have refilled, and those
// written before the clock stepped back, which count as full (stepAhead).
const sweepSQL = `DELETE FROM rate_buckets AS b USING (SELECT coalesce($1::timestamptz, statement_timestamp()) AS now) AS p
WHERE b.full_at <= p.now OR b.updated_at > p.now + ` + stepAhead

// Allow takes a token from key's bucket, which holds burst tokens at most
// and gains perSecond a second, when it holds one. When it holds none it
// takes nothing, and retryAfter says how long until it holds one. A
// negative perSecond admits everything; zero never refills.
func (l *RateLimiter) Allow(ctx context.Context, key string, perSecond float64, burst int) (ok bool, retryAfter time.Duration, err error) {
	if perSecond < 0 {
		return true, 0, nil
	}
	l.maybeSweep(ctx)
	var tokens float64
	for attempt := 1; ; attempt++ {
		err = l.s.pool.QueryRow(ctx, allowSQL, bucketKey(key), l.clock(), perSecond, float64(max(burst, 1))).Scan(&ok, &tokens)
		// A database whose default isolation is above READ COMMITTED
		// may refuse a conflicting upsert; once more then.
		if attempt < 5 && retryable(err) {
			continue
		}
		break
	}
	if err != nil {
		return false, 0, fmt.Errorf("postgres: rate limit: %w", err)
	}
	if ok {
		return true, 0, nil
	}
	return false, refillWait(tokens, perSecond), nil
}

// Peek says what Allow would, without taking anything.
func (l *RateLimiter) Peek(ctx context.Context, key string, perSecond float64, burst int) (ok bool, retryAfter time.Duration, err error) {
	if perSecond < 0 {
		return true, 0, nil
	}
	var tokens float64
	err = l.s.pool.QueryRow(ctx, peekSQL, bucketKey(key), l.clock(), perSecond, float64(max(burst, 1))).Scan(&tokens)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return true, 0, nil // no row: a full bucket
	case err != nil:
		return false, 0, fmt.Errorf("postgres: rate limit: %w", err)
	case tokens >= 1:
		return true, 0, nil
	}
	return false, refillWait(tokens, perSecond), nil
}

// maxRefillWait bounds refillWait: a year, well within a Duration, which
// a slower bucket's wait overflowed (bug 245).
const maxRefillWait = 365 * 24 * time.Hour

// refillWait is how long a bucket of tokens takes to hold one.
func refillWait(tokens, perSecond float64) time.Duration {
	if perSecond == 0 {
		return time.Hour
	}
	return time.Duration(min((1-tokens)/perSecond, maxRefillWait.Seconds()) * float64(time.Second))
}

// clock is the buckets' time: nil for the database's clock.
func (l *RateLimiter) clock() *time.Time {
	if l.now == nil {
		return nil
	}
	t := pgTime(l.now())
	return &t
}

// maybeSweep deletes the rows of refilled buckets, once a SweepInterval
// among the calls of this limiter. It runs on the request that comes
// first after the interval, which waits for it (a scan of the rows of the
// keys used lately); the others go on. A failed sweep is logged: the rows
// wait for the next.
func (l *RateLimiter) maybeSweep(ctx context.Context) {
	now := time.Now()
	if l.now != nil {
		now = l.now()
	}
	// A clock that went back past the last sweep sweeps at once: the next
	// was due an hour ahead after a step back of an hour, and the table
	// kept every key used meanwhile (docs/reliability.md, bug 335).
	next, at := l.nextSweep.Load(), now.UnixNano()
	if (at < next && at >= next-int64(l.sweep)) || !l.nextSweep.CompareAndSwap(next, now.Add(l.sweep).UnixNano()) {
		return
	}
	tag, err := l.s.pool.Exec(ctx, sweepSQL, l.clock())
	if err != nil {
		l.s.log.WarnContext(ctx, "postgres: sweeping refilled rate-limit buckets failed", "err", err)
		return
	}
	l.s.log.DebugContext(ctx, "postgres: swept refilled rate-limit buckets", "rows", tag.RowsAffected())
}

// maxKey bounds the keys stored as they are; longer ones are stored as
// their hash.
const maxKey = 256

// bucketKey is the row's key for key: key itself, or for one that text
// cannot hold (a NUL byte, bad UTF-8) or that is long, its SHA-256.
func bucketKey(key string) string {
	if len(key) <= maxKey && utf8.ValidString(key) && !strings.ContainsRune(key, 0) {
		return key
	}
	h := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(h[:])
}
