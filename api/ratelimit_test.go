package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// limiterLog is a RateLimiter that records the keys it is asked about and
// passes the calls on to another.
type limiterLog struct {
	RateLimiter

	mu   sync.Mutex
	keys []string
}

func (l *limiterLog) Allow(ctx context.Context, key string, perSecond float64, burst int) (bool, time.Duration, error) {
	l.record("allow " + key)
	return l.RateLimiter.Allow(ctx, key, perSecond, burst)
}

func (l *limiterLog) Peek(ctx context.Context, key string, perSecond float64, burst int) (bool, time.Duration, error) {
	l.record("peek " + key)
	return l.RateLimiter.Peek(ctx, key, perSecond, burst)
}

func (l *limiterLog) record(k string) {
	l.mu.Lock()
	l.keys = append(l.keys, k)
	l.mu.Unlock()
}

func (l *limiterLog) calls() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.keys...)
}

// twoServers runs two API servers on one store, as two replicas are, each
// with opts.
func twoServers(t *testing.T, opts ...envOption) (a, b *env) {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return newEnvWith(t, db, db, opts...), newEnvWith(t, db, db, opts...)
}

// Two servers given one RateLimiter count against one budget: the burst
// is admitted once in all, whichever server takes each request.
func TestRateLimiterSharedByServers(t *testing.T) {
	shared := &limiterLog{RateLimiter: newLocalLimiter(time.Now)}
	a, b := twoServers(t, func(o *Options) {
		o.RateLimiter = shared
		o.Limits.RequestsPerSecond, o.Limits.RequestBurst = 0.001, 3
		o.Limits.RegisterPerMinute = 2
	})

	t.Run("requests per token", func(t *testing.T) {
		tok := a.user("dave") // one admin request: the admin's own bucket
		for i := range 3 {
			e := []*env{a, b}[i%2]
			require.Equal(t, http.StatusOK, e.do("GET", "/api/v1/devices", tok, nil).status, "request %d", i+1)
		}
		for name, e := range map[string]*env{"a": a, "b": b} {
			r := e.do("GET", "/api/v1/devices", tok, nil)
			require.Equal(t, http.StatusTooManyRequests, r.status, "server %s: %s", name, r.body)
			assert.Equal(t, CodeRateLimited, r.problem(t).Code)
			assert.Equal(t, "1000", r.header.Get("Retry-After"), "server %s", name)
		}
	})

	t.Run("register attempts per user", func(t *testing.T) {
		tok := b.user("erin")
		body := map[string]any{"device_id": "nope", "claim_code": "x"}
		assert.Equal(t, http.StatusUnprocessableEntity, a.do("POST", "/api/v1/devices/register", tok, body).status)
		assert.Equal(t, http.StatusUnprocessableEntity, b.do("POST", "/api/v1/devices/register", tok, body).status)
		r := a.do("POST", "/api/v1/devices/register", tok, body)
		require.Equal(t, http.StatusTooManyRequests, r.status, "%s", r.body)
		assert.Equal(t, CodeRateLimited, r.problem(t).Code)
		assert.Equal(t, "30", r.header.Get("Retry-After"), "2 a minute: one every 30 s")
	})

	// Each limit has keys of its own in the shared limiter.
	calls := shared.calls()
	for _, prefix := range []string{"allow request:user:", "allow request:admin", "allow register:"} {
		found := false
		for _, c := range calls {
			if len(c) >= len(prefix) && c[:len(prefix)] == prefix {
				found = true
			}
		}
		assert.True(t, found, "no call %q… among %q", prefix, calls)
	}
}

// The limit of requests without a valid token goes through the
// RateLimiter too: failures counted on one server are refused on the other.
func TestRateLimiterSharesSourceLimit(t *testing.T) {
	shared := &limiterLog{RateLimiter: newLocalLimiter(time.Now)}
	a, b := twoServers(t, func(o *Options) {
		o.RateLimiter = shared
		o.Limits.UnauthPerMinute = 4
	})
	for i := range 4 {
		e := []*env{a, b}[i%2]
		r := e.send(req{method: "GET", path: "/api/v1/devices", token: fmt.Sprintf("ctk_guess-%d", i)})
		require.Equal(t, http.StatusUnauthorized, r.status, "guess %d", i+1)
	}
	for name, e := range map[string]*env{"a": a, "b": b} {
		r := e.send(req{method: "GET", path: "/api/v1/devices", token: "ctk_guess-again"})
		assert.Equal(t, http.StatusTooManyRequests, r.status, "server %s: %s", name, r.body)
		assert.Equal(t, "15", r.header.Get("Retry-After"), "server %s: 4 a minute", name)
	}
	assert.Contains(t, shared.calls(), "peek unauth:127.0.0.1")
	assert.Contains(t, shared.calls(), "allow unauth:127.0.0.1")
}

// A limit that is off asks nothing of the RateLimiter.
func TestRateLimiterNotAskedForLimitsThatAreOff(t *testing.T) {
	shared := &limiterLog{RateLimiter: newLocalLimiter(time.Now)}
	e := newEnv(t, func(o *Options) {
		o.RateLimiter = shared
		o.Limits = Limits{RequestsPerSecond: -1, RegisterPerMinute: -1, UnauthPerMinute: -1}
	})
	tok := e.user("frank")
	require.Equal(t, http.StatusOK, e.do("GET", "/api/v1/devices", tok, nil).status)
	require.Equal(t, http.StatusUnauthorized, e.do("GET", "/api/v1/devices", "ctk_wrong", nil).status)
	require.Equal(t, http.StatusUnprocessableEntity, e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "nope", "claim_code": "x"}).status)
	assert.Empty(t, shared.calls())
}

// brokenLimiter fails every Allow, and every Peek when peekFails is set.
type brokenLimiter struct {
	err       error
	peekFails bool
}

func (l brokenLimiter) Allow(context.Context, string, float64, int) (bool, time.Duration, error) {
	return false, 0, l.err
}

func (l brokenLimiter) Peek(context.Context, string, float64, int) (bool, time.Duration, error) {
	if l.peekFails {
		return false, 0, l.err
	}
	return true, 0, nil
}

// A request the RateLimiter cannot count is not admitted: it is answered
// as a failure of the store is, 503 when the store cannot be reached. A
// request already refused for its token stays a 401.
func TestRateLimiterErrors(t *testing.T) {
	errDown := errors.New("the database is restarting")
	unavailable := func(err error) bool { return errors.Is(err, errDown) }
	for _, tc := range []struct {
		name      string
		err       error
		peekFails bool
		token     string // "" for a valid one
		status    int
		code      string
	}{
		{"unavailable", errDown, false, "", http.StatusServiceUnavailable, CodeUnavailable},
		{"peek unavailable", errDown, true, "", http.StatusServiceUnavailable, CodeUnavailable},
		{"other error", errors.New("bug"), false, "", http.StatusInternalServerError, CodeInternal},
		{"bad token", errDown, false, "ctk_wrong", http.StatusUnauthorized, CodeUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) {
				o.Unavailable = unavailable
				o.Limits.UnauthPerMinute = 60
			})
			tok := e.user("gail")
			// The limiter breaks once the user exists.
			e2 := newEnvWith(t, e.db, e.db, func(o *Options) {
				o.Unavailable = unavailable
				o.Limits.RequestsPerSecond, o.Limits.UnauthPerMinute = 50, 60
				o.RateLimiter = brokenLimiter{err: tc.err, peekFails: tc.peekFails}
			})
			if tc.token != "" {
				tok = tc.token
			}
			r := e2.do("GET", "/api/v1/devices", tok, nil)
			require.Equal(t, tc.status, r.status, "%s", r.body)
			assert.Equal(t, tc.code, r.problem(t).Code)
			if tc.status == http.StatusServiceUnavailable {
				assert.NotEmpty(t, r.header.Get("Retry-After"))
			}
		})
	}
}

// limiterClock is a clock the tests of localLimiter move by hand.
type limiterClock struct{ t time.Time }

func newLimiterClock() *limiterClock {
	return &limiterClock{t: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}
}

func (c *limiterClock) now() time.Time      { return c.t }
func (c *limiterClock) add(d time.Duration) { c.t = c.t.Add(d) }

func (l *localLimiter) size() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.limiters)
}

// allowNow is l.Allow of a bucket of 2 that gains one a second.
func allowNow(l *localLimiter, key string) bool {
	ok, _, _ := l.Allow(context.Background(), key, 1, 2)
	return ok
}

func TestLocalLimiter(t *testing.T) {
	ctx := context.Background()
	clk := newLimiterClock()
	l := newLocalLimiter(clk.now)

	ok, _, err := l.Peek(ctx, "k", 1, 2)
	require.NoError(t, err)
	assert.True(t, ok, "Peek of a key never seen")
	assert.Zero(t, l.size(), "Peek makes no bucket")
	for i, want := range []bool{true, true, false} {
		ok, wait, err := l.Allow(ctx, "k", 1, 2)
		require.NoError(t, err)
		require.Equal(t, want, ok, "Allow #%d", i+1)
		if !ok {
			assert.Equal(t, time.Second, wait)
		}
	}
	ok, wait, _ := l.Peek(ctx, "k", 1, 2)
	assert.False(t, ok, "Peek of an empty bucket")
	assert.Equal(t, time.Second, wait)

	clk.add(250 * time.Millisecond)
	ok, wait, _ = l.Allow(ctx, "k", 1, 2)
	assert.False(t, ok)
	assert.Equal(t, 750*time.Millisecond, wait, "a quarter of a token")
	clk.add(750 * time.Millisecond)
	assert.True(t, allowNow(l, "k"), "a second later")
	assert.False(t, allowNow(l, "k"), "one token only")

	clk.add(time.Hour)
	assert.True(t, allowNow(l, "k"))
	assert.True(t, allowNow(l, "k"))
	assert.False(t, allowNow(l, "k"), "an hour idle refills the burst, no more")

	ok, _, _ = l.Allow(ctx, "never", 0, 1)
	assert.True(t, ok, "a zero rate still has its burst")
	ok, wait, _ = l.Allow(ctx, "never", 0, 1)
	assert.False(t, ok)
	assert.Equal(t, time.Hour, wait, "a zero rate never refills")
	ok, _, _ = l.Allow(ctx, "never", -1, 1)
	assert.True(t, ok, "a negative rate admits everything")

	// Before, the wait of a bucket this slow overflowed a Duration: a
	// negative one, and a Retry-After of 1 s (bug 245).
	ok, _, _ = l.Allow(ctx, "slow", 1e-13, 1)
	assert.True(t, ok, "a slow rate has its burst")
	ok, wait, _ = l.Allow(ctx, "slow", 1e-13, 1)
	assert.False(t, ok)
	assert.Equal(t, 365*24*time.Hour, wait, "a slow rate's wait: a year at most")
}

// The limiter's memory stays bounded: past maxBuckets keys, the buckets
// that have refilled are dropped, and only those.
func TestLocalLimiterPrunesRefilledKeys(t *testing.T) {
	clk := newLimiterClock()
	l := newLocalLimiter(clk.now)
	for i := range maxBuckets {
		require.True(t, allowNow(l, fmt.Sprint(i)))
	}
	require.True(t, allowNow(l, "busy"))
	require.True(t, allowNow(l, "busy"))
	assert.Equal(t, maxBuckets+1, l.size(), "nothing has refilled yet")

	clk.add(1500 * time.Millisecond) // the others' one token is back, not busy's two
	require.True(t, allowNow(l, "new"))
	assert.Equal(t, 2, l.size(), "left: busy and new")
	assert.True(t, allowNow(l, "busy"), "busy kept its 1.5 tokens")
	assert.False(t, allowNow(l, "busy"), "busy kept its 1.5 tokens, no more")
}

// lockedClock is a clock a test moves while the server reads it.
type lockedClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *lockedClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *lockedClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// The rate limits at CONTRACT §6's defaults, on a clock that stands
// still: a token's burst of 100 requests passes and the 101st is a 429
// rate_limited with Retry-After, on every route of the token (the event
// stream too), and a fiftieth of a second gives one more; a user's 10
// register attempts pass and the 11th is a 429, and six seconds give one
// more.
func TestRateLimitsAtTheirDefaults(t *testing.T) {
	clk := &lockedClock{t: time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)}
	e := newEnv(t, func(o *Options) {
		o.Limits = Limits{UnauthPerMinute: -1}
		o.Now = clk.now
	})
	refused := func(t *testing.T, r resp, retryAfter string) {
		t.Helper()
		require.Equal(t, 429, r.status, "%s", r.body)
		assert.Equal(t, CodeRateLimited, r.problem(t).Code)
		assert.Equal(t, retryAfter, r.header.Get("Retry-After"))
	}

	t.Run("requests", func(t *testing.T) {
		tok := e.user("rate")
		for i := range DefaultLimits.RequestBurst {
			r := e.do("GET", "/api/v1/devices", tok, nil)
			require.Equal(t, 200, r.status, "request #%d: %s", i+1, r.body)
		}
		refused(t, e.do("GET", "/api/v1/devices", tok, nil), "1")
		refused(t, e.do("GET", "/api/v1/events", tok, nil), "1")
		refused(t, e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "x"}), "1")
		clk.add(time.Second / 50)
		assert.Equal(t, 200, e.do("GET", "/api/v1/devices", tok, nil).status, "a fiftieth of a second later")
		refused(t, e.do("GET", "/api/v1/devices", tok, nil), "1")
	})

	t.Run("register", func(t *testing.T) {
		tok := e.user("register")
		attempt := func() resp {
			return e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "dev-9", "claim_code": "guess"})
		}
		for i := range DefaultLimits.RegisterPerMinute {
			r := attempt()
			require.Equal(t, 422, r.status, "attempt #%d: %s", i+1, r.body)
		}
		refused(t, attempt(), "6")
		clk.add(6 * time.Second)
		assert.Equal(t, 422, attempt().status, "six seconds later")
		refused(t, attempt(), "6")
	})
}
