package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"
)

// bodyIdle runs before the handlers of every route, authentication
// included, and before the answers to unknown routes: it cuts a request body
// that stalls, so that a client that sends its headers and then a body
// slowly or not at all cannot hold a handler and a connection for ever.
// http.Server.ReadTimeout cannot do that: it bounds the whole request,
// and a firmware upload over a slow link may rightly take many minutes.
// Instead every read of the body may wait at most Limits.BodyIdle for a
// byte (see idleBody); a read that waits longer fails with the 408
// body_timeout the handler answers. That alone bounds pauses, not a
// client that sends a byte just before each BodyIdle runs out: so the
// body must also average Limits.BodyMinRate once the server has waited
// BodyIdle for it in all (a read that would wait past that fails with the
// same 408). A body at that rate may take as long as it needs: a firmware
// upload over a slow link goes through.
//
// It sets the connection's read deadline (http.ResponseController), which
// a timer put off by every byte (internal/idleread) could not replace: the
// timer would also run while the handler is busy between two reads, and
// blame the client for the server's own slowness. A request without a
// body is left alone: net/http reads its connection in the background
// to notice a client that goes away, and a deadline would end that
// read, and with it the request's context (a Prefer: wait, an event
// stream).
func (s *Server) bodyIdle(c *gin.Context) {
	r := c.Request
	if r.Body == nil || r.Body == http.NoBody {
		c.Next()
		return
	}
	b := &idleBody{
		body:    r.Body,
		rc:      http.NewResponseController(c.Writer),
		idle:    s.limits.BodyIdle,
		minRate: s.limits.BodyMinRate,
		http1:   r.ProtoMajor == 1,
		cut:     &s.reads.cut,
		details: &s.bodyTimeouts,
	}
	s.reads.add(b)
	defer s.reads.remove(b)
	if b.http1 {
		// net/http reads a body the handler has not read (up to 256 KiB
		// of it, to keep the connection) when the answer is first
		// flushed: this bounds that read for a handler that answers
		// without reading (a 401).
		b.arm()
		if b.off {
			c.Next() // not net/http's connection (a test's recorder)
			return
		}
	}
	// The handlers read a copy of the request: net/http keeps the
	// original, and its handling of an unread body looks at its type.
	wrapped := *r
	wrapped.Body = b
	c.Request = &wrapped
	defer b.handlerDone(r.Context())
	c.Next()
}

// bodyTimeouts are the details of a body's 408s, worked out once from the
// limits rather than for every request.
type bodyTimeouts struct {
	stalled string // nothing came in time
	slow    string // the body fell below the least rate
}

func newBodyTimeouts(l Limits) bodyTimeouts {
	return bodyTimeouts{
		stalled: "no byte of the body came for " + seconds(l.BodyIdle),
		slow: fmt.Sprintf("the body came at less than %d bytes a second on average, after %s",
			l.BodyMinRate, seconds(l.BodyIdle)),
	}
}

// idleBody is a request body whose reads fail (408) once the client
// has sent nothing for idle, and once the client has kept its
// reads waiting longer than idle plus 1/minRate s for each byte it sent:
// its average rate, past the first idle of waiting, is below minRate. Only
// the time spent in its reads counts, not the handler's between them. Like
// any request body it is not for concurrent use.
//
// Over HTTP/1 the deadline is the connection's; it matters only while
// something reads it, so it stays set between reads and bounds net/http's
// own reads too. Once the body is done with it is cleared: at its end, or
// when net/http has read it to its end and closed it already (it does when
// the handler flushes an answer before reading), since net/http then
// reads the connection in the background. (That read clears the deadline
// as it starts, as of Go 1.26, but a read of ours after the body's end
// sets it again.) After any other error it stays, expired: the connection
// is done with, and net/http, which reads what is left of an unread body
// before it answers, fails at once and closes the connection after the
// answer instead of waiting.
//
// Over HTTP/2 the deadline is the stream's, a timer that fires whether or
// not anything reads, so it is set only for the length of each read.
type idleBody struct {
	body    io.ReadCloser
	rc      *http.ResponseController
	idle    time.Duration
	minRate int64 // bytes a second; <= 0: no minimum
	http1   bool
	cut     *atomic.Bool  // set by EndBodyReads: every read fails at once
	details *bodyTimeouts // of a read's error when the body is late
	waited  time.Duration // how long the reads have waited for the body
	got     int64         // the bytes they returned
	byRate  bool          // the deadline set last is minRate's, not idle's
	off     bool          // the connection takes no deadline
	err     error         // the first error a read returned, io.EOF included
}

func (b *idleBody) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	start := b.arm()
	n, err := b.body.Read(p)
	b.waited += time.Since(start)
	b.got += int64(n)
	switch {
	case err == nil:
		if !b.http1 {
			b.set(time.Time{})
		}
	case err == io.EOF, errors.Is(err, http.ErrBodyReadAfterClose):
		b.err = err
		b.set(time.Time{})
	default:
		if errors.Is(err, os.ErrDeadlineExceeded) {
			switch {
			case b.cut.Load():
				err = errShuttingDown
			case b.byRate:
				err = &Error{Code: CodeBodyTimeout, Detail: b.details.slow}
			default:
				err = &Error{Code: CodeBodyTimeout, Detail: b.details.stalled}
			}
		}
		b.err = err
		if !b.http1 {
			b.set(time.Time{})
		}
	}
	return n, err
}

// Close closes the body. Over HTTP/1 net/http then reads what is left of
// it, up to 256 KiB, to keep the connection: the deadline bounds that
// read. Nothing reads the body after that, and the deadline is cleared.
func (b *idleBody) Close() error {
	if b.err == nil && b.http1 {
		b.arm()
	}
	err := b.body.Close()
	if b.err == nil || b.err == io.EOF {
		b.err = http.ErrBodyReadAfterClose
	}
	b.set(time.Time{})
	return err
}

// handlerDone runs when the handler has returned. Over HTTP/1 net/http
// reads a body the handler left unfinished (up to 256 KiB, to keep the
// connection) before it writes the answer: the deadline, set again here,
// bounds that read to idle in all, after which the connection is closed
// once answered. Not when ctx, the request's, has ended: over HTTP/1 that
// means a read of the connection failed (net/http's own, of the body, when
// the handler answered before it read), and the expired deadline makes
// the next one fail at once.
func (b *idleBody) handlerDone(ctx context.Context) {
	if b.err == nil && b.http1 && ctx.Err() == nil {
		b.arm()
	}
}

// arm sets the deadline of the next wait for the body (see window), and
// returns when it did.
func (b *idleBody) arm() time.Time {
	now := time.Now()
	d, byRate := b.window()
	b.byRate = byRate
	b.set(now.Add(d))
	return now
}

// window is how long the next wait for the body may last, and whether
// minRate, not idle, sets it: the client may keep the reads waiting idle
// plus 1/minRate s for each byte it has sent, in all.
func (b *idleBody) window() (time.Duration, bool) {
	if b.minRate <= 0 {
		return b.idle, false
	}
	// In seconds, as a float: a long body's allowance is no Duration.
	left := b.idle.Seconds() + float64(b.got)/float64(b.minRate) - b.waited.Seconds()
	if left < b.idle.Seconds() {
		return max(time.Duration(left*float64(time.Second)), 0), true
	}
	return b.idle, false
}

func (b *idleBody) set(deadline time.Time) {
	if b.off {
		return
	}
	// http.ErrNotSupported: the writer is not net/http's. Any other error
	// (the connection is closed) the next read returns anyway.
	if err := b.rc.SetReadDeadline(deadline); err != nil {
		b.off = true
		return
	}
	// Set, then looked at: either this sees the cut, or the cut's own
	// deadline comes after this one (bodyReads.end).
	if b.cut.Load() {
		b.rc.SetReadDeadline(time.Now())
	}
}

// errShuttingDown is the answer to a request whose body was still being
// read when the server began to shut down.
var errShuttingDown = &Error{Code: CodeUnavailable, Detail: "the server is shutting down; send the request again"}

// bodyReads are the request bodies being read, so that a shutdown can
// end them (EndBodyReads).
type bodyReads struct {
	cut   atomic.Bool
	mu    sync.Mutex
	reads map[*idleBody]struct{}
}

func (r *bodyReads) add(b *idleBody) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reads == nil {
		r.reads = make(map[*idleBody]struct{})
	}
	r.reads[b] = struct{}{}
}

// remove runs once the handler and net/http's reads of b are done: b's
// deadline is not to be set after that (over HTTP/2 its stream is gone).
func (r *bodyReads) remove(b *idleBody) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.reads, b)
}

// end makes every read of a body, under way or to come, fail at once.
func (r *bodyReads) end() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cut.Store(true)
	for b := range r.reads {
		b.rc.SetReadDeadline(time.Now())
	}
}

// EndBodyReads is for a shutdown: the reads of request bodies, those
// under way and those to come, fail at once, and their requests are
// answered 503 unavailable. A body the client sends slowly or not at all
// holds nothing durable, and http.Server.Shutdown waited for it: a
// stalled upload kept a SIGTERM waiting out its limit, and the shutdown
// then failed (docs/reliability.md, bug 325). A request whose body has
// been read, a command being stored or sent, goes on to its answer.
func (s *Server) EndBodyReads() { s.reads.end() }

// seconds is d as "60 s", or "0.5 s".
func seconds(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + " s"
}
