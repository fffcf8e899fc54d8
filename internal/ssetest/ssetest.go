// Package ssetest holds test helpers for clients of a Server-Sent Events
// stream: a Stream opened over real HTTP whose events internal/sse reads
// in the background, so that a test waits for the next one with a
// timeout instead of blocking on the connection.
//
// It is for tests only; nothing outside _test.go files should import it.
// It is not an EventSource: it neither reconnects nor sends Last-Event-ID
// of its own accord.
package ssetest

import (
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/sse"
)

// Buffer is how many events and comments a Stream holds that the test has
// not taken yet; past it the stream stops reading from the connection.
const Buffer = 10000

var (
	// ErrEnded is Next's error once the stream has ended and every event
	// before the end was taken.
	ErrEnded = errors.New("ssetest: the stream ended")
	// ErrTimeout is Next's error when no event came in time.
	ErrTimeout = errors.New("ssetest: no event in time")
)

// Event is what a stream delivered: an event, or a comment line.
type Event struct {
	sse.Event
	// Comment is a comment line's text (what follows the colon, less one
	// leading space), for a comment. A comment's ID is the stream's last
	// event ID so far, which an event without data (an id line alone)
	// sets too: what the client would send as Last-Event-ID.
	Comment string
}

// IsComment tells a comment from an event: an event always has a Type
// ("message" when the stream named none).
func (e Event) IsComment() bool { return e.Type == "" }

// Stream is a client's live stream. Create it with Open or Read.
type Stream struct {
	res  *http.Response
	ch   chan Event
	quit chan struct{} // closed by Close: the reader gives up a pending send
	done chan struct{} // closed when the reader has returned
	once sync.Once
}

// Open sends req with client, asking for text/event-stream, checks that
// the answer is 200 with that type, and reads it as Read does.
func Open(tb testing.TB, client *http.Client, req *http.Request) *Stream {
	tb.Helper()
	req.Header.Set("Accept", "text/event-stream")
	res, err := client.Do(req)
	if err != nil {
		tb.Fatalf("GET %s: %v", req.URL, err)
	}
	if ct := res.Header.Get("Content-Type"); res.StatusCode != http.StatusOK || ct != "text/event-stream" {
		res.Body.Close()
		tb.Fatalf("GET %s: %s %q; want 200 text/event-stream", req.URL, res.Status, ct)
	}
	return Read(tb, res)
}

// Read reads res's body as a stream in a goroutine of its own, whatever
// the answer's status; the test's end closes it.
func Read(tb testing.TB, res *http.Response) *Stream {
	s := &Stream{res: res, ch: make(chan Event, Buffer), quit: make(chan struct{}), done: make(chan struct{})}
	go s.read()
	tb.Cleanup(s.Close)
	return s
}

func (s *Stream) read() {
	defer close(s.done)
	defer close(s.ch)
	send := func(ev Event) bool {
		select {
		case s.ch <- ev:
			return true
		case <-s.quit:
			return false
		}
	}
	r := sse.NewReader(s.res.Body)
	r.OnComment = func(text string) { send(Event{Event: sse.Event{ID: r.LastEventID()}, Comment: text}) }
	for {
		ev, err := r.Next()
		if err != nil || !send(Event{Event: ev}) {
			return
		}
	}
}

// Events delivers the stream's events and comments in order, and is
// closed once the stream has ended and all of them were taken.
func (s *Stream) Events() <-chan Event { return s.ch }

// Done is closed when the stream has ended (the server ended it, the
// connection failed, or Close), though events may still wait in Events.
func (s *Stream) Done() <-chan struct{} { return s.done }

// Next returns the next event, passing over comments. It returns
// ErrEnded once the stream has ended, and ErrTimeout if d passes first.
func (s *Stream) Next(d time.Duration) (sse.Event, error) {
	timeout := time.NewTimer(d)
	defer timeout.Stop()
	for {
		select {
		case ev, ok := <-s.ch:
			if !ok {
				return sse.Event{}, ErrEnded
			}
			if !ev.IsComment() {
				return ev.Event, nil
			}
		case <-timeout.C:
			return sse.Event{}, ErrTimeout
		}
	}
}

// Close ends the stream and waits for its reader. It may be called more
// than once.
func (s *Stream) Close() {
	s.once.Do(func() {
		close(s.quit)
		s.res.Body.Close()
		<-s.done
	})
}
