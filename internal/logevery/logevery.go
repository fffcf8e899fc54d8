// Package logevery keeps the log lines a client's traffic can make (a
// bridge's malformed messages, its publishes for devices it does not
// serve) to one a key each interval: the first is logged, the next ones
// within the interval are counted, and the first logged after it says how
// many were not. A client sending them in a loop then costs the log a
// line a minute, not one per message (docs/reliability.md, bug 379).
//
// It is for lines of what others send. A fault of the server's own is
// logged as it happens (or by internal/faultlog, for a store's).
package logevery

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// maxKeys bounds the keys kept: the keys come from what clients send
// (device ids in topics), so a client naming a new one each time must not
// grow the map without end. Past it, keys whose interval has passed are
// dropped; while every one is recent, a new key's line is counted under
// the overflow key, and logged once an interval as any other.
const maxKeys = 4096

// Log logs a line of a key at most once an interval. It is safe for
// concurrent use. The zero value is not usable: use New.
type Log struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	keys map[string]*entry
}

type entry struct {
	logged  time.Time // when a line of the key was last logged
	skipped int       // lines of the key not logged since
}

const overflow = "\x00overflow"

// New returns a Log that logs to log a line of each key at most once
// every (a minute when 0); now is the clock (time.Now when nil).
func New(log *slog.Logger, every time.Duration, now func() time.Time) *Log {
	if every <= 0 {
		every = time.Minute
	}
	if now == nil {
		now = time.Now
	}
	return &Log{log: log, every: every, now: now, keys: make(map[string]*entry)}
}

// Warn logs msg with args at warning level unless a line of key was
// logged within the interval, in which case it is only counted. A line
// logged after some were counted says how many as not_logged.
func (l *Log) Warn(key, msg string, args ...any) {
	l.Log(slog.LevelWarn, key, msg, args...)
}

// Log is Warn at the level given.
func (l *Log) Log(level slog.Level, key, msg string, args ...any) {
	l.Logged(level, key, msg, args...)
}

// Logged is Log, and reports whether the line was logged: a caller may log
// one only counted at a lower level, where each is wanted when asked for
// (docs/reliability.md, bug 493).
func (l *Log) Logged(level slog.Level, key, msg string, args ...any) bool {
	if !l.log.Enabled(context.Background(), level) {
		return false
	}
	now := l.now()
	l.mu.Lock()
	e := l.keys[key]
	if e == nil {
		if len(l.keys) >= maxKeys {
			l.prune(now)
		}
		if len(l.keys) >= maxKeys {
			key = overflow
			e = l.keys[key]
		}
		if e == nil {
			e = &entry{}
			l.keys[key] = e
		}
	}
	if !e.logged.IsZero() && now.Sub(e.logged) < l.every {
		e.skipped++
		l.mu.Unlock()
		return false
	}
	skipped := e.skipped
	e.logged, e.skipped = now, 0
	l.mu.Unlock()
	if skipped > 0 {
		args = append(args, "not_logged", skipped, "not_logged_in", l.every)
	}
	l.log.Log(context.Background(), level, msg, args...)
	return true
}

// prune drops the keys whose interval has passed: their next line is
// logged at once anyway (without the count of those not logged, which is
// lost). l.mu is held.
func (l *Log) prune(now time.Time) {
	for k, e := range l.keys {
		if now.Sub(e.logged) >= l.every {
			delete(l.keys, k)
		}
	}
}
