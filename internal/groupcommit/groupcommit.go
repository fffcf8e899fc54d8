// Package groupcommit groups the writes of many goroutines to one bbolt
// file into shared transactions: one commit (one pair of fsyncs) for all the
// writes that arrived while the previous commit was on its way to the disk.
//
// bbolt's own Batch does the same with a timer: a batch waits up to
// MaxBatchDelay (10 ms) for company unless MaxBatchSize writers arrive first,
// so a writer on a quiet file, or one of a few dozen on a busy one, waits
// for the timer. Here a single committer goroutine takes whatever is queued
// the moment the last commit ends: alone, a write costs one fsync and no
// wait; under load, each commit carries everything that queued up during
// the one before it.
//
// Under load a commit may also linger: when the last commit carried more
// than one write, the committer waits up to Options.Linger before it takes
// the next group. A commit costs its two fsyncs and the pages of
// every bucket it touches whatever it carries, so that fewer, larger
// commits cost less CPU per write; a lone write on a quiet file still
// commits at once. (Kafka's producers call the same thing linger.ms.)
// The lingering is not idle: each write runs in the group's open
// transaction as it is queued, so that when the linger ends only the
// commit is left to do, and the group's writes do not add to its wait.
//
// Writes may also be handed over without waiting (Go): their done callback
// runs after the commit, in the order the writes were queued, on a goroutine
// of the committer's, so a caller such as an MQTT handler can acknowledge
// a message once it is on disk without blocking on the fsync.
package groupcommit

import (
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
)

// MaxOps bounds the writes in one transaction, so that one commit stays
// short whatever the backlog.
const MaxOps = 2000

// MmapReserve is the address space to map a committer's bbolt file with
// from the start (bolt.Options.InitialMmapSize): 1 GiB, or 128 MiB where
// addresses are 32 bits (linux/arm). bbolt maps the file again, larger,
// whenever it outgrows the mapping, and for that a commit waits until every
// read transaction has ended; a file that grows past the reservation is
// still mapped again.
const MmapReserve = 1 << (27 + 3*(strconv.IntSize/64)) // 1<<30 on 64 bits, 1<<27 on 32

// ErrClosed is the answer to writes after Close.
var ErrClosed = errors.New("groupcommit: closed")

// PanicError is the outcome of a write whose fn panicked: the write fails
// alone, as one that returns an error does, and the others of its group
// commit. Do panics with it in its caller, as bolt's Update would; Go's
// done gets it. (Left to run its course on the committer's goroutine, the
// panic ended the process and every write queued with it, out of reach of
// the recover of the caller, such as the API's that answers 500.)
type PanicError struct {
	Value any    // what fn panicked with
	Stack []byte // fn's goroutine when it panicked
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("groupcommit: write panicked: %v\n%s", e.Value, e.Stack)
}

// CommitError is the outcome of every write of a group whose commit
// failed: bbolt could not write or sync the file (a full disk, a file
// size limit or quota, an I/O error). bbolt rolled the transaction back
// (and forget undid what it left of it), so none of the group's writes is
// kept, and the next group commits as usual once the file can be written
// again.
type CommitError struct {
	Err error // bbolt's
}

func (e *CommitError) Error() string { return "groupcommit: commit: " + e.Err.Error() }

func (e *CommitError) Unwrap() error { return e.Err }

type op struct {
	fn   func(tx *bolt.Tx) error
	done func(error)
	err  error
}

// Committer runs writes to one bbolt file in grouped transactions. Create
// it with New; Close stops it.
type Committer struct {
	db   *bolt.DB
	opts Options

	mu      sync.Mutex
	queue   []*op
	closed  bool
	wake    chan struct{}
	results chan []*op
	quit    chan struct{}
	wg      sync.WaitGroup

	commits, ops atomic.Int64
	failures     atomic.Int64                // commits tried that failed (Stats.Failed)
	failed       atomic.Pointer[CommitError] // the last commit's error; nil once one succeeds

	ahead *zeroFill // nil unless Options.Preallocate; used by the commit loop only

	// busy is when the group under way took its first write, as clock
	// read it, plus 1; 0 between groups: how long the disk has kept it
	// (Busy).
	busy  atomic.Int64
	clock func() time.Duration // sinceStart; tests step it
	stall *time.Timer          // calls Options.OnStall; nil without it

	cramped atomic.Bool // the zeros ahead could not be written when last tried (Cramped)
}

// Options tune a Committer; the zero value never lingers.
type Options struct {
	// Linger is how long the committer waits for company before a commit
	// that follows one of several writes (0: never).
	Linger time.Duration
	// Begin, when set, runs at the start of every transaction, before its
	// writes: for settings bbolt keeps per transaction, such as a
	// bucket's FillPercent.
	Begin func(tx *bolt.Tx)
	// Preallocate, when set, is how much of the file past its last page in
	// use the committer keeps written with zeros (see zeroFill).
	Preallocate int64
	// OnStall, when set, is called (on a goroutine of its own) when a
	// group has waited StallAfter for its writes and commit to end: the
	// disk does not answer (a network volume gone, a failing disk
	// retrying), and every write waits with it. Busy says how long.
	OnStall    func()
	StallAfter time.Duration
	// Lasting, when set, says whether a commit's failure lasts (a full
	// disk) rather than passes (one failed sync). After a commit that
	// failed so, the committer fails the writes queued for RetryAfter
	// with the same *CommitError, without running them or trying to
	// commit (bug 342): a failed commit costs a scan of the whole file
	// (bbolt rebuilds its list of free pages), and writes that kept
	// trying on a full disk had the server spend its CPU on them. The
	// first group queued after RetryAfter tries again.
	Lasting    func(err error) bool
	RetryAfter time.Duration
}

// New starts a committer for db.
func New(db *bolt.DB, opts Options) *Committer {
	c := &Committer{
		db:      db,
		opts:    opts,
		wake:    make(chan struct{}, 1),
		results: make(chan []*op, 64),
		quit:    make(chan struct{}),
		clock:   sinceStart,
	}
	if opts.Preallocate > 0 {
		c.ahead = newZeroFill(db.Path(), opts.Preallocate)
	}
	if opts.OnStall != nil {
		c.stall = time.AfterFunc(time.Hour, opts.OnStall)
		c.stall.Stop()
	}
	c.wg.Add(2)
	go c.commitLoop()
	go c.doneLoop()
	return c
}

// Do runs fn in a shared write transaction and returns once that
// transaction is committed (or failed). fn may run more than once: when
// another write of its group fails, the group is rolled back and run again
// without it. fn must therefore reset whatever it reports on each run, and
// must not call the committer.
//
// An error from fn rolls back fn's writes only: the others of its group
// are committed, and Do returns fn's error. A panic in fn does the same,
// and Do then panics with a *PanicError.
func (c *Committer) Do(fn func(tx *bolt.Tx) error) error {
	ch := make(chan error, 1)
	c.Go(fn, func(err error) { ch <- err })
	err := <-ch
	if p, ok := err.(*PanicError); ok {
		panic(p)
	}
	return err
}

// Go queues fn like Do but returns at once; done (if not nil) is called
// with the outcome after the commit. The done callbacks of all writes run
// one at a time in the order the writes were queued, so they must not
// block for long; a write queued after Close gets ErrClosed.
func (c *Committer) Go(fn func(tx *bolt.Tx) error, done func(error)) {
	o := &op{fn: fn, done: done}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		if done != nil {
			done(ErrClosed)
		}
		return
	}
	c.queue = append(c.queue, o)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// Stats are the committer's counters since New.
type Stats struct {
	Commits int64 // write transactions committed
	Ops     int64 // writes they carried
	Failed  int64 // write transactions whose commit was tried and failed
}

// Stats returns the counters.
func (c *Committer) Stats() Stats {
	return Stats{Commits: c.commits.Load(), Ops: c.ops.Load(), Failed: c.failures.Load()}
}

// Err returns the *CommitError of the last commit when it failed, and nil
// when it succeeded (or none was made): whether the file takes writes now,
// as far as the committer has seen.
func (c *Committer) Err() error {
	if e := c.failed.Load(); e != nil {
		return e
	}
	return nil
}

// Cramped reports whether the file could not grow when the committer
// last tried: a write of its zeros ahead (Options.Preallocate) failed, and
// none has succeeded since. A commit may still succeed then, its pages
// fitting in those the file has free or zeroed, while one that needs the
// file to grow fails (bug 341). Always false without Preallocate.
func (c *Committer) Cramped() bool { return c.cramped.Load() }

// Busy returns how long the group under way has waited for its writes
// and its commit to end; 0 between groups. A disk that does not answer
// keeps it waiting (Options.OnStall).
func (c *Committer) Busy() time.Duration {
	if t := c.busy.Load(); t != 0 {
		return c.clock() - time.Duration(t-1)
	}
	return 0
}

// start is the origin of the committers' clock.
var start = time.Now()

// sinceStart is the time since start on the monotonic clock, which no
// step of the wall clock moves: a group's age read from the wall clock
// was off by any step taken during it, and /readyz said a disk that did
// not answer was ready, or one that did was not (bug 358).
func sinceStart() time.Duration { return time.Since(start) }

// working marks the group under way as begun (on) or ended (bug 339).
func (c *Committer) working(on bool) {
	if !on {
		c.busy.Store(0)
		if c.stall != nil {
			c.stall.Stop()
		}
		return
	}
	if c.busy.Load() != 0 {
		return
	}
	c.busy.Store(int64(c.clock()) + 1) // +1: 0 is between groups
	if c.stall != nil {
		c.stall.Reset(c.opts.StallAfter)
	}
}

// Close runs what is queued, stops the committer and returns once every
// done callback has run. Writes queued later fail with ErrClosed.
func (c *Committer) Close() {
	c.mu.Lock()
	first := !c.closed
	c.closed = true
	c.mu.Unlock()
	if first {
		close(c.quit)
	}
	// Every caller waits, not only the first: each may close the bbolt
	// file next.
	c.wg.Wait()
}

// take returns up to max of the queued writes, oldest first; the group
// that takes them is under way from the first (working).
func (c *Committer) take(max int) []*op {
	c.mu.Lock()
	n := min(len(c.queue), max)
	ops := c.queue[:n:n]
	c.queue = c.queue[n:]
	if len(c.queue) == 0 {
		c.queue = nil
	}
	c.mu.Unlock()
	if n > 0 {
		c.working(true)
	}
	return ops
}

// begin prepares each transaction of the committer, before its writes.
func (c *Committer) begin(tx *bolt.Tx) {
	if c.ahead != nil {
		c.cramped.Store(!c.ahead.fill(tx.Size()))
	}
	if c.opts.Begin != nil {
		c.opts.Begin(tx)
	}
}

func (c *Committer) commitLoop() {
	defer c.wg.Done()
	defer close(c.results)
	if c.ahead != nil {
		defer c.ahead.close()
	}
	var linger *time.Timer
	last := 0       // writes in the last commit
	var r time.Time // until when writes fail without a try, after a lasting failure
	for {
		if time.Now().Before(r) {
			ops := c.take(MaxOps)
			if len(ops) == 0 {
				select {
				case <-c.wake:
					continue
				case <-c.quit:
					if ops = c.take(MaxOps); len(ops) == 0 {
						return
					}
				}
			}
			c.refuse(ops)
			last = 0
			continue
		}
		g := group{db: c.db, begin: c.begin}
		if last > 1 && c.opts.Linger > 0 {
			if linger == nil {
				linger = time.NewTimer(c.opts.Linger)
			} else {
				linger.Reset(c.opts.Linger)
			}
			c.fill(&g, linger.C)
		} else {
			g.apply(c.take(MaxOps))
		}
		if len(g.taken) == 0 {
			last = 0 // quiet: the next write, alone, commits at once
			select {
			case <-c.wake:
				continue
			case <-c.quit:
				// Close set closed before quit: nothing more can queue.
				if g.apply(c.take(MaxOps)); len(g.taken) == 0 {
					return
				}
			}
		}
		if g.commit() {
			c.commits.Add(1)
			c.ops.Add(int64(len(g.live)))
			c.failed.Store(nil)
			r = time.Time{}
		} else if g.err != nil {
			c.failed.Store(g.err)
			c.failures.Add(1)
			if c.opts.Lasting != nil && c.opts.Lasting(g.err) {
				r = time.Now().Add(c.opts.RetryAfter)
			}
		}
		c.working(false)
		c.results <- g.taken
		last = len(g.taken)
	}
}

// refuse fails ops with the last commit's error, without running them:
// the disk refuses commits for a while (Options.Lasting).
func (c *Committer) refuse(ops []*op) {
	err := c.failed.Load()
	for _, o := range ops {
		o.err = err
	}
	c.working(false)
	c.results <- ops
}

// fill applies writes to g as they are queued, until the linger ends, g
// holds MaxOps writes, or the committer closes. The writes run while the
// committer waits for company rather than after it, so the commit that
// follows starts when the linger ends.
func (c *Committer) fill(g *group, end <-chan time.Time) {
	for {
		g.apply(c.take(MaxOps - len(g.taken)))
		if len(g.taken) >= MaxOps {
			return
		}
		select {
		case <-c.wake:
		case <-end:
			// A write queued as the linger ended goes with it.
			g.apply(c.take(MaxOps - len(g.taken)))
			return
		case <-c.quit:
			return
		}
	}
}

// group is one write transaction of the committer and the writes in it.
type group struct {
	db    *bolt.DB
	begin func(tx *bolt.Tx)
	tx    *bolt.Tx     // open once a write ran
	taken []*op        // every write of the group, in queue order
	live  []*op        // the writes in tx, in order
	err   *CommitError // the commit's failure, once commit ran
}

// apply runs ops in g's transaction, beginning one when none is open. A
// write whose fn fails is set aside with its error: the transaction is
// rolled back and the writes before it run again without it, as bbolt's
// Batch does; so is one whose fn panics. A transaction that cannot begin
// fails the writes left to run.
func (g *group) apply(ops []*op) {
	g.taken = append(g.taken, ops...)
	for len(ops) > 0 {
		if g.tx == nil {
			tx, err := g.db.Begin(true)
			if err != nil {
				for _, o := range ops {
					o.err = err
				}
				return
			}
			g.tx = tx
			if g.begin != nil {
				g.begin(tx)
			}
		}
		o := ops[0]
		ops = ops[1:]
		if err := run(o.fn, g.tx); err != nil {
			o.err = err
			_ = g.tx.Rollback()
			g.tx = nil
			ops = append(slices.Clip(g.live), ops...) // again, without o
			g.live = nil
			continue
		}
		g.live = append(g.live, o)
	}
}

// run calls fn, returning a panic in it as a *PanicError.
func run(fn func(tx *bolt.Tx) error, tx *bolt.Tx) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return fn(tx)
}

// commit commits g's transaction and reports whether it did; a failed
// commit fails every write in it with a *CommitError.
func (g *group) commit() bool {
	if g.tx == nil {
		return false // nothing ran, or every write failed
	}
	id := g.tx.ID()
	err := g.tx.Commit()
	g.tx = nil
	if err != nil {
		g.err = failed(g.db, id, err)
		for _, o := range g.live {
			o.err = g.err
		}
		return false
	}
	return true
}

func (c *Committer) doneLoop() {
	defer c.wg.Done()
	for ops := range c.results {
		for _, o := range ops {
			if o.done != nil {
				o.done(o.err)
			}
		}
	}
}
