package api

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/gin-gonic/gin"
)

// bodyBudgets bound the bytes of request bodies each user's requests are
// sending at once (Limits.MaxBodyBytesPerUser). A body is read whole into
// memory before its request is handled, and the body deadlines bound how
// long it may take, not how many a user sends at once: the rate limit
// bounds how fast a user starts them, and a client that sent a few MiB of
// an image push and then a byte a minute kept its average above
// BodyMinRate for hours, holding what it had sent. Counted without a lock
// or an allocation on the way of a command: one counter a user, made on
// their first request and kept (a few words a user).
type bodyBudgets struct {
	max   int64    // the bound; <= 0 none
	users sync.Map // user id → *bodyBudget
}

// bodyBudget is one user's count of the bytes their bodies are sending.
type bodyBudget struct {
	n   atomic.Int64
	max int64
}

// ctxBodyBudget is the caller's *bodyBudget, set by Server.bodyBudget.
const ctxBodyBudget = "companion.bodies"

// bodyBudget is a middleware of the user routes: it hands readBody the
// caller's count.
func (s *Server) bodyBudget(c *gin.Context) {
	if s.bodies.max > 0 {
		id := currentUser(c).ID
		v, ok := s.bodies.users.Load(id)
		if !ok {
			v, _ = s.bodies.users.LoadOrStore(id, &bodyBudget{max: s.bodies.max})
		}
		c.Set(ctxBodyBudget, v)
	}
	c.Next()
}

// reserveBody counts n bytes more of the caller's bodies, unless the bytes
// counted already and n come to more than the bound (a body alone always
// fits). It returns the count and the bytes to take off it once the body
// is read (nil for a request that is not a user's), or why not.
func reserveBody(c *gin.Context, n int64) (*bodyBudget, int64, error) {
	v, ok := c.Get(ctxBodyBudget)
	if !ok {
		return nil, 0, nil
	}
	b := v.(*bodyBudget)
	n = min(n, b.max)
	for {
		cur := b.n.Load()
		if cur > 0 && cur+n > b.max {
			return nil, 0, &Error{Code: CodeRateLimited, RetryAfter: 1, Detail: fmt.Sprintf(
				"this account's requests are sending %d bytes of bodies to this server already, and this one's %d would pass the %d it takes at once: "+
					"nothing was done; send it again once one of them is in", cur, n, b.max)}
		}
		if b.n.CompareAndSwap(cur, cur+n) {
			return b, n, nil
		}
	}
}

// held is the bytes counted now, of every user (for the tests).
func (b *bodyBudgets) held() int64 {
	var n int64
	b.users.Range(func(_, v any) bool {
		n += v.(*bodyBudget).n.Load()
		return true
	})
	return n
}
