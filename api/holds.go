package api

import (
	"fmt"
	"sync"

	"github.com/gin-gonic/gin"
)

// Requests that hold a connection and a goroutine of the server for long,
// event streams and requests held by Prefer: wait, are bounded per user
// (Limits.MaxStreamsPerUser, MaxWaitsPerUser): the rate limit bounds how
// fast a user starts them, not how many are open, and at 50 a second for
// a wait of 60 s one user held 3,000. The counts are this process's, as
// the default RateLimiter's buckets are: behind a balancer each replica
// gives a user its own.

// Retry-After of the 429s past those bounds. A held wait ends within
// MaxWait, usually much sooner; a stream ends when its client closes it,
// and 2 s is the pace at which an EventSource comes back (the stream's
// "retry: 2000").
const (
	waitsRetryAfter   = 1
	streamsRetryAfter = 2
)

// holds counts what each key (a kind and a user) holds open.
type holds struct {
	mu sync.Mutex
	n  map[string]int
}

// take counts one more hold of key, unless key holds limit already; a
// negative limit is none. release gives the hold back, once.
func (h *holds) take(key string, limit int) (release func(), ok bool) {
	if limit < 0 {
		return func() {}, true
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n[key] >= limit {
		return nil, false
	}
	if h.n == nil {
		h.n = map[string]int{}
	}
	h.n[key]++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.n[key]--; h.n[key] <= 0 {
				delete(h.n, key)
			}
		})
	}, true
}

// waitSlot bounds the requests of one user that Prefer: wait holds at
// once: a route's middleware, before its handler does anything, so that a
// request refused past the bound has created nothing and may be sent
// again as it is. A request without a wait, or with wait=0, holds nothing
// and is not counted.
func (s *Server) waitSlot(c *gin.Context) {
	if n, wants := s.preferWait(c.Request); !wants || n == 0 {
		c.Next()
		return
	}
	limit := s.limits.MaxWaitsPerUser
	release, ok := s.held.take("wait:"+currentUser(c).ID, limit)
	if !ok {
		s.fail(c, &Error{Code: CodeTooManyWaits, RetryAfter: waitsRetryAfter, Detail: fmt.Sprintf(
			"%d requests of this account are held by Prefer: wait already, the most this server holds at once; "+
				"nothing was done: send this one again once one of them is answered, or without Prefer: wait", limit)})
		return
	}
	defer release()
	c.Next()
}

// streamSlot takes a place among the user's open event streams, or
// answers why not.
func (s *Server) streamSlot(userID string) (release func(), err error) {
	limit := s.limits.MaxStreamsPerUser
	release, ok := s.held.take("stream:"+userID, limit)
	if !ok {
		return nil, &Error{Code: CodeTooManyStreams, RetryAfter: streamsRetryAfter, Detail: fmt.Sprintf(
			"this account has %d event streams open on this server, the most it may: close one first "+
				"(one stream without device_id carries the events of all your devices)", limit)}
	}
	return release, nil
}
