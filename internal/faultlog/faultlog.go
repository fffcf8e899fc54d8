// Package faultlog says in a store's log each fault of what the store
// stands on (the bbolt file's disk, PostgreSQL's database): once as it
// starts, with what to do, once a minute while it stands, and once as it
// is gone, rather than once for every write that meets it. Both store
// engines use it (docs/reliability.md, bugs 185 and 199), and the server
// logs its own lines of the same errors at debug level.
//
// A fault that comes back within a minute of being said gone (a disk so
// nearly full that a small write fits and a larger one does not) is not
// said again at once: the log's next line of it, a minute after the last,
// says whether it still stands. An edge that flaps is then a few lines a
// minute, not two for every probe.
//
// It is not a rate limiter for other lines: what a fault's own words are,
// and which errors are which fault, is the store's to say.
package faultlog

import (
	"log/slog"
	"sync"
	"time"
)

// Fault is what the log says of one kind of fault.
type Fault struct {
	// Name is the fault= of its lines after the first.
	Name string
	// Words is its first line: what is wrong, what the server does
	// meanwhile, and what to do.
	Words string
}

// Options configures New. Logger and Faults are required; the zero value
// of the rest gives the defaults.
type Options[K comparable] struct {
	Logger *slog.Logger
	// Faults describes each kind of fault Failed is called with.
	Faults map[K]Fault
	// Attrs are on every line, to name the store ("database", host:port/name).
	Attrs []any
	// Still is the message of the line repeated while a fault stands, and
	// Gone of the line as it is found gone.
	Still, Gone string
	// Every is how often, at most, a fault is said again while it stands,
	// and how soon after it was said gone it is not said again; a minute
	// when zero.
	Every time.Duration
	// ProbeEvery is how often Watch asks whether a fault still stands; a
	// second when zero.
	ProbeEvery time.Duration
}

// Log keeps the faults under way of one store and says them. It is safe
// for concurrent use.
type Log[K comparable] struct {
	opts Options[K]
	wake chan struct{} // a fault started: Watch has something to probe

	mu     sync.Mutex
	faults map[K]*state
}

// state is what the log knows and has said of one kind of fault.
type state struct {
	standing bool
	said     bool      // the log's last line of it says it stands
	since    time.Time // when it started standing, this time
	logged   time.Time // the log's last line of it
	failures int       // failures since that line
	last     error     // the last of them
}

// New returns a Log with no fault under way.
func New[K comparable](opts Options[K]) *Log[K] {
	if opts.Every <= 0 {
		opts.Every = time.Minute
	}
	if opts.ProbeEvery <= 0 {
		opts.ProbeEvery = time.Second
	}
	return &Log[K]{opts: opts, wake: make(chan struct{}, 1), faults: map[K]*state{}}
}

// Failed takes in one failure of fault f: a write, statement or
// connection that met it. The first of a fault that does not stand yet is
// logged, at error level, with the fault's Words; the rest are counted.
func (l *Log[K]) Failed(f K, err error) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.faults[f]
	if s == nil {
		s = &state{}
		l.faults[f] = s
	}
	s.failures++
	s.last = err
	if s.standing {
		return
	}
	s.standing, s.since = true, now
	if s.logged.IsZero() || now.Sub(s.logged) >= l.opts.Every {
		l.opts.Logger.Error(l.opts.Faults[f].Words, append(l.attrs(), "err", err)...)
		s.said, s.logged, s.failures = true, now, 0
	}
	// Otherwise it was said gone less than Every ago: standing says it
	// again once Every has passed since, if it still stands.
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Stands says whether fault f is under way.
func (l *Log[K]) Stands(f K) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.faults[f]
	return s != nil && s.standing
}

// Each calls fn with the name of each kind of fault the log knows and
// whether it stands now: a gauge of each for the server's metrics.
func (l *Log[K]) Each(fn func(name string, stands bool)) {
	l.mu.Lock()
	stands := make(map[string]bool, len(l.opts.Faults))
	for f, ft := range l.opts.Faults {
		s := l.faults[f]
		stands[ft.Name] = s != nil && s.standing
	}
	l.mu.Unlock()
	for name, on := range stands {
		fn(name, on)
	}
}

// Gone ends fault f, which a probe, or a write of the store's own, found
// gone. It is logged at info level, unless the log never said that this
// run of it stood.
func (l *Log[K]) Gone(f K) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.faults[f]
	if s == nil || !s.standing {
		return
	}
	s.standing = false
	if !s.said {
		return
	}
	l.opts.Logger.Info(l.opts.Gone, append(l.attrs(), "fault", l.opts.Faults[f].Name,
		"after", now.Sub(s.since).Round(time.Second))...)
	s.said, s.logged, s.failures = false, now, 0
}

// standing returns the faults under way, and logs again those whose last
// line is Every old.
func (l *Log[K]) standing() []K {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []K
	for f, s := range l.faults {
		if !s.standing {
			continue
		}
		out = append(out, f)
		if now.Sub(s.logged) >= l.opts.Every {
			l.opts.Logger.Error(l.opts.Still, append(l.attrs(), "fault", l.opts.Faults[f].Name,
				"for", now.Sub(s.since).Round(time.Second), "failures", s.failures, "err", s.last)...)
			s.said, s.logged, s.failures = true, now, 0
		}
	}
	return out
}

func (l *Log[K]) attrs() []any {
	return append([]any(nil), l.opts.Attrs...)
}

// Watch asks probe, every ProbeEvery while a fault stands, whether it
// still does (nil: it does not), and ends those it finds gone, until done
// is closed. It sleeps while no fault stands. The store runs it on a
// goroutine of its own, and waits for it as it closes.
func (l *Log[K]) Watch(done <-chan struct{}, probe func(K) error) {
	t := time.NewTicker(l.opts.ProbeEvery)
	defer t.Stop()
	for {
		faults := l.standing()
		var wait <-chan time.Time
		if len(faults) > 0 {
			wait = t.C
		}
		select {
		case <-done:
			return
		case <-l.wake:
		case <-wait:
			for _, f := range faults {
				if probe(f) == nil {
					l.Gone(f)
				}
			}
		}
	}
}
