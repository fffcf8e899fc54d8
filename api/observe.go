package api

import (
	"time"

	"github.com/gin-gonic/gin"
)

// RequestObserver is told of every request the API answered, for the
// server's metrics (internal/metrics implements it with Prometheus;
// --metrics). It is declared here, where it is called, so that the API
// imports no metrics library; Options.Requests nil means nobody counts,
// and then no middleware runs for it. Request is called on every request
// once its answer is written: it must be quick and must not block.
type RequestObserver interface {
	// Request reports one answered request: its method, its route as
	// registered (gin's FullPath: "/api/v1/devices/:id/status", never the
	// raw URL, so the routes are a bounded set; "" when no route matched),
	// the status of the answer (StatusClientGone, 499, when its client
	// hung up while it waited) and how long it took: for an event stream
	// (GET /api/v1/events), how long it took to begin, not how long it
	// stayed open, which is the client's choice and no latency
	// (docs/reliability.md, bug 273).
	Request(method, route string, status int, took time.Duration)
}

// observeRequest is the outermost middleware when Options.Requests is set:
// it sees the status of every answer, the recoverer's 500 included. A
// stream tells it when it began (ctxStreamBegan, set by streamEvents): its
// time is up to then.
func (s *Server) observeRequest(c *gin.Context) {
	start := time.Now()
	c.Next()
	took := time.Since(start)
	if began, ok := c.Get(ctxStreamBegan); ok {
		took = began.(time.Time).Sub(start)
	}
	status := c.Writer.Status()
	if c.GetBool(ctxClientGone) {
		status = StatusClientGone
	}
	s.requests.Request(c.Request.Method, c.FullPath(), status, took)
}

// StatusClientGone is the status the RequestObserver is told of a request
// whose client hung up while its handler waited on the request's context
// (a store query, the wait for an Idempotency-Key's answer, Prefer: wait):
// nginx's 499. The answer written, which nobody reads, is the 500 or 503
// of the error the wait ended with; counted as such, a client going away
// would read as the server's fault (docs/reliability.md, bug 359).
const StatusClientGone = 499

// ctxClientGone is the gin context's key set (to true) by fail when the
// request failed because its client went away.
const ctxClientGone = "companion.clientGone"

// ctxStreamBegan is the gin context's key of the time an event stream
// began: its status and headers were set, and its first bytes go out.
const ctxStreamBegan = "companion.streamBegan"
