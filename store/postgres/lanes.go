package postgres

import (
	"context"
	"errors"
	"hash/fnv"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// maxBatch bounds the writes of a lane that share one transaction.
const maxBatch = 32

// job is a write queued on a lane: body in a transaction, then finish
// with its outcome once the transaction committed; or run alone (a
// barrier).
type job struct {
	ctx context.Context // the caller's, for a synchronous call; Background otherwise
	key uint16          // the device's hash: the lane, and the order of a batch's locks
	// body makes the write in tx. It may run more than once (a batch that
	// failed runs its writes again one by one): it must set what it
	// reports afresh each time.
	body   func(ctx context.Context, tx pgx.Tx) error
	finish func(err error)
	run    func() // instead of body and finish
}

// lane runs jobs in the order they were given. Its queue has no bound,
// so that giving a job never blocks, from a done func too.
type lane struct {
	mu     sync.Mutex
	jobs   []job
	closed bool
	wake   chan struct{} // capacity 1: a job or close is pending
}

func newLane() *lane {
	return &lane{wake: make(chan struct{}, 1)}
}

// add queues j; false when the lane is closed.
func (l *lane) add(j job) bool {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return false
	}
	l.jobs = append(l.jobs, j)
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
	return true
}

// close makes runLane return once every job queued has run.
func (l *lane) close() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// runLane runs the jobs of l until it is closed and empty. The writes
// waiting when the lane comes to them share a transaction, up to
// maxBatch of them: one commit (one WAL flush) for all.
func (s *Store) runLane(l *lane) {
	for {
		l.mu.Lock()
		jobs, closed := l.jobs, l.closed
		l.jobs = nil
		l.mu.Unlock()
		for i := 0; i < len(jobs); {
			if jobs[i].run != nil {
				jobs[i].run()
				i++
				continue
			}
			j := i + 1
			for j < len(jobs) && j-i < maxBatch && jobs[j].run == nil {
				j++
			}
			s.runBatch(jobs[i:j])
			i = j
		}
		if len(jobs) > 0 {
			continue
		}
		if closed {
			return
		}
		<-l.wake
	}
}

// runBatch runs the writes of batch in one transaction, each under a
// savepoint of its own so that one's refusal undoes only its own
// changes, and finishes them in their order once it committed. One that
// waited LockTimeout for a lock fails the writes after it in the batch
// with the same error, unwritten. The
// writes take their locks in the order of their devices' hashes (those
// of one device keep their order), so two batches, on two replicas, do
// not wait for each other's locks in a circle. Should the batch fail
// before COMMIT (a deadlock all the same, a lost connection), its writes
// run again one by one.
func (s *Store) runBatch(batch []job) {
	live := make([]job, 0, len(batch))
	for _, j := range batch {
		if j.ctx.Err() != nil {
			j.finish(j.ctx.Err()) // the caller is gone: write nothing
			continue
		}
		live = append(live, j)
	}
	if len(live) == 1 {
		s.runAlone(live[0])
		return
	}
	if len(live) == 0 {
		return
	}
	order := make([]int, len(live))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return int(live[a].key) - int(live[b].key) })
	ctx := context.Background()
	errs := make([]error, len(live))
	tx, err := s.pool.Begin(ctx)
	if err == nil {
		err = func() error {
			for n, i := range order {
				sp, err := tx.Begin(ctx) // SAVEPOINT
				if err != nil {
					return err
				}
				jerr := live[i].body(ctx, sp)
				if jerr == nil {
					if err := sp.Commit(ctx); err != nil { // RELEASE SAVEPOINT
						return err
					}
					continue
				}
				if retryable(jerr) {
					return jerr
				}
				if err := sp.Rollback(ctx); err != nil { // ROLLBACK TO SAVEPOINT
					return err
				}
				errs[i] = jerr
				if lockTimedOut(jerr) {
					// It waited LockTimeout for another session's
					// lock; so have the writes behind it. They fail
					// too rather than wait in turn, each as long: a
					// batch's callers wait LockTimeout at most, not
					// that times their number.
					for _, k := range order[n+1:] {
						errs[k] = jerr
					}
					break
				}
			}
			return nil
		}()
		if err != nil {
			_ = tx.Rollback(ctx)
		} else if err = tx.Commit(ctx); err != nil {
			// Whether it committed is unknown: say so rather than write
			// again.
			for _, j := range live {
				j.finish(err)
			}
			return
		}
	}
	if err != nil {
		for _, j := range live {
			s.runAlone(j)
		}
		return
	}
	for i, j := range live {
		j.finish(errs[i])
	}
}

// runAlone runs one write in a transaction of its own.
func (s *Store) runAlone(j job) {
	j.finish(s.tx(j.ctx, func(tx pgx.Tx) error { return j.body(j.ctx, tx) }))
}

// lockTimedOut reports whether err is a statement's wait for a lock that
// lasted LockTimeout (lock_not_available).
func lockTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// retryable reports whether err is one PostgreSQL resolves by aborting a
// transaction that may then run again: a deadlock, a serialization
// failure.
func retryable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40P01" || pe.Code == "40001")
}

// deviceHash is the 16 bits of a device id that pick its lane, and that
// the ids of its commands carry (see idGen).
func deviceHash(deviceID string) uint16 {
	h := fnv.New32a()
	h.Write([]byte(deviceID))
	v := h.Sum32()
	return uint16(v ^ v>>16)
}

// commandKey returns the device hash a command id carries; for an id this
// store did not make (it then names no command), the hash of the id.
func commandKey(id string) uint16 {
	u, err := uuid.Parse(id)
	if err != nil || u.Version() != 7 {
		return deviceHash(id)
	}
	return commandHash(u)
}

// submit queues j on the lane of its key; false, and nothing runs, once
// the store is closed.
func (s *Store) submit(j job) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return false
	}
	return s.lanes[int(j.key)%len(s.lanes)].add(j)
}

// barrier runs fn once every lane has run what was queued on it before,
// while every lane waits; it returns false once the store is closed.
// Barriers are queued under the write lock, so every lane has them in the
// same order: two of them cannot wait for each other.
func (s *Store) barrier(fn func(ctx context.Context)) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	var left atomic.Int32
	left.Store(int32(len(s.lanes)))
	released := make(chan struct{})
	for _, l := range s.lanes {
		l.add(job{run: func() {
			if left.Add(-1) == 0 {
				fn(context.Background())
				close(released)
				return
			}
			<-released
		}})
	}
	return true
}

// wait waits for the result a lane job sends on ch, or for ctx.
func wait[T any](ctx context.Context, ch <-chan T) (T, error) {
	select {
	case r := <-ch:
		return r, nil
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}
