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
	// the status of the answer and how long it took.
	Request(method, route string, status int, took time.Duration)
}

// observeRequest is the outermost middleware when Options.Requests is set:
// it sees the status of every answer, the recoverer's 500 included.
func (s *Server) observeRequest(c *gin.Context) {
	start := time.Now()
	c.Next()
	s.requests.Request(c.Request.Method, c.FullPath(), c.Writer.Status(), time.Since(start))
}
