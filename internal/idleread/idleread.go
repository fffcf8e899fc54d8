// Package idleread tells a quiet stream from a slow one: a Reader puts off
// a timer with every byte it reads, so that a timer armed with
// time.AfterFunc to cancel the request fires only once the stream has gone
// without a byte for the timer's whole duration, however long it runs.
package idleread

import (
	"io"
	"time"
)

// Reader reads R and resets Timer to Idle whenever a read returns bytes.
type Reader struct {
	R     io.Reader
	Timer *time.Timer
	Idle  time.Duration
}

func (r *Reader) Read(p []byte) (int, error) {
	n, err := r.R.Read(p)
	if n > 0 {
		r.Timer.Reset(r.Idle)
	}
	return n, err
}
