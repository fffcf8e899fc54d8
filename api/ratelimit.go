package api

import (
	"context"
	"sync"
	"time"

	"github.com/gin-gonic/gin"
	"golang.org/x/time/rate"
)

// RateLimiter keeps the token buckets of the API's rate limits (CONTRACT
// §6), one bucket per key: requests per token, register attempts per user,
// requests without a valid token per source address. A key never seen, or
// idle long enough to have refilled, has a full bucket of burst tokens; a
// bucket gains perSecond tokens a second up to burst. The API never passes
// a negative perSecond (it calls nothing for a limit that is off) nor a
// burst below 1.
//
// The default, when Options.RateLimiter is nil, keeps the buckets in this
// process: each replica behind a balancer then gives a client its own
// allowance. Replicas on one PostgreSQL store share one
// (postgres.Store.RateLimiter). The API answers a RateLimiter's error as
// it answers the store's: 503 unavailable with Retry-After when
// Options.Unavailable says so, 500 otherwise. It does not admit a request
// it could not count.
type RateLimiter interface {
	// Allow takes a token from key's bucket when it holds one. When it
	// holds none it takes nothing, and retryAfter says how long until it
	// holds one.
	Allow(ctx context.Context, key string, perSecond float64, burst int) (ok bool, retryAfter time.Duration, err error)
	// Peek says what Allow would, without taking anything.
	Peek(ctx context.Context, key string, perSecond float64, burst int) (ok bool, retryAfter time.Duration, err error)
}

// limitSpec is one of the API's rate limits: the prefix that keeps its keys
// apart from the other limits' in a shared RateLimiter, and the shape of
// its buckets.
type limitSpec struct {
	prefix    string
	perSecond float64 // negative: no limit
	burst     int
}

func newLimit(prefix string, perSecond float64, burst int) limitSpec {
	return limitSpec{prefix: prefix, perSecond: perSecond, burst: max(burst, 1)}
}

// allow takes a token from key's bucket of l; a limit that is off asks
// nothing of the RateLimiter.
func (s *Server) allow(c *gin.Context, l limitSpec, key string) (bool, time.Duration, error) {
	if l.perSecond < 0 {
		return true, 0, nil
	}
	return s.limiter.Allow(c.Request.Context(), l.prefix+key, l.perSecond, l.burst)
}

// peek says whether key's bucket of l holds a token, taking nothing.
func (s *Server) peek(c *gin.Context, l limitSpec, key string) (bool, time.Duration, error) {
	if l.perSecond < 0 {
		return true, 0, nil
	}
	return s.limiter.Peek(c.Request.Context(), l.prefix+key, l.perSecond, l.burst)
}

// maxBuckets bounds localLimiter's memory: past it, full buckets (keys
// idle long enough to have refilled, which a missing key stands for) are
// dropped.
const maxBuckets = 10000

// localLimiter is the default RateLimiter: a golang.org/x/time/rate
// Limiter per key, in this process alone.
type localLimiter struct {
	now func() time.Time

	mu       sync.Mutex
	limiters map[string]*rate.Limiter
}

var _ RateLimiter = (*localLimiter)(nil)

func newLocalLimiter(now func() time.Time) *localLimiter {
	return &localLimiter{now: now, limiters: make(map[string]*rate.Limiter)}
}

// Allow implements RateLimiter.
func (l *localLimiter) Allow(_ context.Context, key string, perSecond float64, burst int) (bool, time.Duration, error) {
	ok, wait := l.take(key, perSecond, burst, true)
	return ok, wait, nil
}

// Peek implements RateLimiter.
func (l *localLimiter) Peek(_ context.Context, key string, perSecond float64, burst int) (bool, time.Duration, error) {
	ok, wait := l.take(key, perSecond, burst, false)
	return ok, wait, nil
}

// take takes a token from key's bucket when it holds one and take is set.
// The map's lock is held throughout, so that the look and the take are one.
func (l *localLimiter) take(key string, perSecond float64, burst int, take bool) (bool, time.Duration) {
	if perSecond < 0 {
		return true, 0
	}
	now := l.now()
	r, b := rate.Limit(perSecond), max(burst, 1)
	l.mu.Lock()
	defer l.mu.Unlock()
	lim := l.limiters[key]
	if lim == nil {
		if !take {
			return true, 0 // a key never seen has a full bucket
		}
		if len(l.limiters) >= maxBuckets {
			l.prune(now)
		}
		lim = rate.NewLimiter(r, b)
		l.limiters[key] = lim
	}
	if lim.Limit() != r {
		lim.SetLimitAt(now, r)
	}
	if lim.Burst() != b {
		lim.SetBurstAt(now, b)
	}
	tokens := lim.TokensAt(now)
	if tokens >= 1 {
		if take {
			lim.AllowN(now, 1)
		}
		return true, 0
	}
	if r == 0 {
		return false, time.Hour
	}
	return false, time.Duration(min((1-tokens)/perSecond, maxRefillWait.Seconds()) * float64(time.Second))
}

// maxRefillWait bounds a bucket's wait for a token: a year, well within a
// Duration, which a slower bucket's wait overflowed (bug 245).
const maxRefillWait = 365 * 24 * time.Hour

// prune drops the buckets that are full. l.mu is held.
func (l *localLimiter) prune(now time.Time) {
	for k, lim := range l.limiters {
		if lim.TokensAt(now) >= float64(lim.Burst()) {
			delete(l.limiters, k)
		}
	}
}
