package api

import (
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"strconv"
	"sync/atomic"

	"github.com/gin-gonic/gin"
)

// RequestIDHeader names the header that carries a request's id: every
// answer has it, and the server's log lines of the request say it as
// request_id. It is not in a problem's body (as RFC 9457's instance),
// which CONTRACT §2 has the same for an unknown device and another's. A
// user who quotes it lets the operator find the request's lines
// (docs/operations.md, "Tying a complaint to the log";
// docs/reliability.md, bug 378).
const RequestIDHeader = "X-Request-Id"

// ctxRequestID is the gin context's key of the request's id.
const ctxRequestID = "companion.requestID"

// maxRequestID is the longest X-Request-Id of a client's taken as the
// request's id.
const maxRequestID = 128

// requestIDs makes the ids of requests that bring none of their own: a
// prefix drawn at random as the server starts (so the ids of replicas and
// restarts do not meet) and a counter, with no syscall or lock per
// request.
type requestIDs struct {
	prefix string
	n      atomic.Uint64
}

func newRequestIDs() *requestIDs {
	var b [6]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return &requestIDs{prefix: hex.EncodeToString(b[:])}
}

func (r *requestIDs) next() string {
	var buf [40]byte
	out := append(buf[:0], r.prefix...)
	out = append(out, '-')
	out = strconv.AppendUint(out, r.n.Add(1), 36)
	return string(out)
}

// plainRequestID reports whether a client's X-Request-Id is one the
// server takes as the request's id: 1 to 128 of A-Z a-z 0-9 . _ : -.
// Anything else (spaces, quotes, control characters) is replaced, so
// that what the answer echoes and the log says is never the client's
// free text.
func plainRequestID(id string) bool {
	if id == "" || len(id) > maxRequestID {
		return false
	}
	for i := 0; i < len(id); i++ {
		switch b := id[i]; {
		case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9', b == '.', b == '_', b == ':', b == '-':
		default:
			return false
		}
	}
	return true
}

// requestID is the first middleware: it names the request, by the
// client's X-Request-Id when that is a plain token, else by a new id,
// and sets the answer's header before anything is written.
func (s *Server) requestID(c *gin.Context) {
	id := c.Request.Header.Get(RequestIDHeader)
	if !plainRequestID(id) {
		id = s.ids.next()
	}
	c.Set(ctxRequestID, id)
	c.Writer.Header()[RequestIDHeader] = []string{id}
	c.Next()
}

// requestIDAttr is the request_id of the request's log lines.
func requestIDAttr(c *gin.Context) slog.Attr {
	return slog.String("request_id", c.GetString(ctxRequestID))
}
