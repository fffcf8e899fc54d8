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
	// the status of the answer and how long it took: for an event stream
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
	s.requests.Request(c.Request.Method, c.FullPath(), c.Writer.Status(), took)
}

// ctxStreamBegan is the gin context's key of the time an event stream
// began: its status and headers were set, and its first bytes go out.
const ctxStreamBegan = "companion.streamBegan"
