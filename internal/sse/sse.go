// Package sse reads a Server-Sent Events stream (text/event-stream) as a
// client does: the parsing rules of the WHATWG HTML standard,
// "Interpreting an event stream" (§9.2.6), for every field it defines:
// event, data (several lines join with "\n"), id (the last event ID, kept
// from one event to the next) and retry, and comments.
//
// It is the parser only, not an EventSource: it neither connects nor
// reconnects. A client that reconnects sends LastEventID as its
// Last-Event-ID header and waits Retry before it does.
package sse

import (
	"bufio"
	"bytes"
	"io"
	"strconv"
	"strings"
	"time"
)

// MaxLine is the longest line a Reader takes; a longer one ends the
// stream with bufio.ErrTooLong.
const MaxLine = 1 << 20

// Event is one dispatched event.
type Event struct {
	// Type is the event's "event" field; "message" when it had none.
	Type string
	// ID is the stream's last event ID when the event was dispatched:
	// the event's own "id" field, or the last one before it.
	ID string
	// Data is the event's "data" lines joined with "\n".
	Data string
}

// Reader reads the events of a stream. Create it with NewReader.
type Reader struct {
	// OnComment, when set, is called from Next with the text of each
	// comment line (what follows the colon, less one leading space), in
	// the order of the stream. Comments are otherwise ignored, as the
	// standard says; a client may use them as a sign of life.
	OnComment func(text string)

	sc      *bufio.Scanner
	started bool // past the first line (and its byte order mark)
	afterCR bool // the last line ended with CR: a LF next is part of it

	typ    string       // the event type buffer
	data   bytes.Buffer // the data buffer
	lastID string       // the last event ID buffer
	retry  time.Duration
}

// NewReader returns a Reader of the stream r.
func NewReader(r io.Reader) *Reader {
	rd := &Reader{}
	rd.sc = bufio.NewScanner(r)
	rd.sc.Buffer(make([]byte, 0, 4096), MaxLine)
	rd.sc.Split(rd.splitLines)
	return rd
}

// LastEventID is the stream's last event ID so far: what a client sends
// as Last-Event-ID when it reconnects. An "id" field sets it even when
// no event is dispatched.
func (r *Reader) LastEventID() string { return r.lastID }

// Retry is the reconnection time the stream asked for in its last valid
// "retry" field, or 0 if it asked for none.
func (r *Reader) Retry() time.Duration { return r.retry }

// Next reads up to the end of the next event and returns it. At the end
// of the stream it returns io.EOF (an event the stream did not finish
// with an empty line is discarded, as the standard says), or the error
// that ended it.
func (r *Reader) Next() (Event, error) {
	for r.sc.Scan() {
		line := r.sc.Bytes()
		if !r.started {
			r.started = true
			line = bytes.TrimPrefix(line, []byte("\uFEFF"))
		}
		if len(line) == 0 {
			if ev, ok := r.dispatch(); ok {
				return ev, nil
			}
			continue
		}
		if line[0] == ':' {
			if r.OnComment != nil {
				r.OnComment(string(bytes.TrimPrefix(line[1:], []byte(" "))))
			}
			continue
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		r.field(string(field), value)
	}
	if err := r.sc.Err(); err != nil {
		return Event{}, err
	}
	return Event{}, io.EOF
}

// field processes one field of the event being read.
func (r *Reader) field(name string, value []byte) {
	switch name {
	case "event":
		r.typ = string(value)
	case "data":
		r.data.Write(value)
		r.data.WriteByte('\n')
	case "id":
		if bytes.IndexByte(value, 0) < 0 {
			r.lastID = string(value)
		}
	case "retry":
		if len(value) > 0 && strings.Trim(string(value), "0123456789") == "" {
			if ms, err := strconv.ParseInt(string(value), 10, 64); err == nil && ms <= int64(time.Duration(1<<63-1)/time.Millisecond) {
				r.retry = time.Duration(ms) * time.Millisecond
			}
		}
	}
	// Any other field is ignored.
}

// dispatch ends the event being read at an empty line: none when it has
// no data.
func (r *Reader) dispatch() (Event, bool) {
	typ := r.typ
	r.typ = ""
	if r.data.Len() == 0 {
		return Event{}, false
	}
	data := r.data.Bytes()
	ev := Event{Type: typ, ID: r.lastID, Data: string(data[:len(data)-1])}
	r.data.Reset()
	if ev.Type == "" {
		ev.Type = "message"
	}
	return ev, true
}

// splitLines is a bufio.SplitFunc for the standard's line ends: CRLF, LF
// or CR. A CR ends its line at once, so that a live stream's event is
// dispatched without waiting for the next byte; a LF right after it is
// then skipped.
func (r *Reader) splitLines(data []byte, atEOF bool) (int, []byte, error) {
	skip := 0
	if r.afterCR && len(data) > 0 && data[0] == '\n' {
		skip = 1
	}
	if i := bytes.IndexAny(data[skip:], "\r\n"); i >= 0 {
		r.afterCR = data[skip+i] == '\r'
		return skip + i + 1, data[skip : skip+i], nil
	}
	// A last line without its end is part of an unfinished event:
	// discarded, as the event is.
	return 0, nil, nil
}
