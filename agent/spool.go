package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/internal/groupcommit"
	"github.com/devicecompanion/companion/topics"
)

// The spool is the bridge's durable memory, one bbolt file:
//
//	commands  id → record: every command id seen, until purged
//	queue     queueKey → id: the commands still to run, of every device, in
//	          order of acceptance (their UUIDv7 ids), then of arrival
//	outbox    seq → command id: final replies (in their records) not yet
//	          acknowledged by the broker
//	status    device id → the status last read from the device, so that
//	          one the bridge cannot read after a restart is reported with
//	          what was known of it (report.go)
//
// Every bucket but status (written when a device's status says something
// new) grows at its end, so a commit writes few pages however many
// devices its writes are for. (Earlier versions kept a queue bucket per
// device, "queues"; openSpool moves those into "queue".)
// spoolVersion is the version of the spool's layout this build writes
// and reads, kept in bucketMeta under keyVersion (bug 398). A spool
// without one is of the layout since 8a6c356, which is version 1. A bridge
// refuses a spool of a later version, which a newer bridge wrote: a
// bridge from before 8a6c356 started on a newer spool did not see the
// commands it held, and ran none of them. Raise it with any change of
// layout an older build would misread.
const spoolVersion = "1"

var (
	bucketMeta = []byte("meta")
	keyVersion = []byte("version")
)

// errSpoolNewer is a spool a newer bridge wrote.
type errSpoolNewer struct {
	path, version string
}

func (e *errSpoolNewer) Error() string {
	return fmt.Sprintf("spool %s: written by a newer bridge: it has version %s, this build knows %s: "+
		"the bridge has not changed it; start the newer bridge on it again, or, to go back for good, "+
		"move it aside (mv spool.db spool.db.newer) to start with an empty spool: once the bridge is online "+
		"the server sends it the unfinished commands again, and a device drops a command id it has already run",
		e.path, e.version, spoolVersion)
}

// ErrSpoolNewer is what errors.Is finds in the error of New or Run when
// the spool was written by a newer bridge, which this build refuses: it
// would refuse it again at every start until a person starts the newer
// bridge again or moves the spool aside (companion-bridge exits 65 on it,
// as on a damaged spool, and its unit does not restart it: bug 433).
var ErrSpoolNewer = errors.New("the spool was written by a newer bridge")

// Is makes errors.Is(err, ErrSpoolNewer) hold.
func (e *errSpoolNewer) Is(target error) bool { return target == ErrSpoolNewer }

// checkSpoolVersion refuses a spool of a later version than this build's
// (errSpoolNewer), and marks one of none, or an earlier, as this build's.
func checkSpoolVersion(tx *bolt.Tx, path string) error {
	if b := tx.Bucket(bucketMeta); b != nil {
		if v := b.Get(keyVersion); v != nil {
			n, err := strconv.Atoi(string(v))
			if err != nil || n < 0 {
				return &errSpoolFile{path: path, what: fmt.Sprintf("its version %q is no number", v)}
			}
			want, _ := strconv.Atoi(spoolVersion)
			if n > want {
				return &errSpoolNewer{path: path, version: string(v)}
			}
			if n == want {
				return nil
			}
		}
	}
	b, err := tx.CreateBucketIfNotExists(bucketMeta)
	if err != nil {
		return err
	}
	return b.Put(keyVersion, []byte(spoolVersion))
}

var (
	bucketCommands  = []byte("commands")
	bucketQueue     = []byte("queue")
	bucketOutbox    = []byte("outbox")
	bucketStatus    = []byte("status")
	bucketOldQueues = []byte("queues")
)

// States of a spooled command. A command is spoolRunning on disk once it
// may have started: the file says so before the command can reach its
// device (spool.start). Most are written so ahead of their turn, in writes
// the spool makes anyway: the first of a device's line when it is accepted,
// the next ones in the transaction that finishes the one before them
// (spoolLookahead). So a queued command certainly never ran, and a running
// one found after a restart may have: it runs again whatever its TTL (the
// device drops an id it has run), and a cancel leaves it alone. Earlier
// versions wrote spoolRunning when a command was claimed; it reads the same.
const (
	spoolQueued  = "queued"
	spoolRunning = "running"
	spoolDone    = "done"
)

// DoneRetention is how long the spool remembers a finished command id, so
// that a late repeat of it is dropped rather than run again. One whose
// final reply the broker has not acknowledged yet is remembered until it
// has (purge): the server sends such a command again when the bridge is
// back, however long it was away.
const DoneRetention = 8 * 24 * time.Hour

type record struct {
	Cmd    topics.Command `json:"cmd"`
	Seq    uint64         `json:"seq,omitempty"`
	State  string         `json:"state"`
	Final  *topics.Reply  `json:"final,omitempty"`
	DoneAt time.Time      `json:"done_at,omitzero"`

	// In memory only. marked: the file has the command as spoolRunning
	// (guarded by spool.mu). resumed: it was found so when the spool was
	// opened, so it may have run before the restart (set by load), or its
	// worker stopped it before its end (set by requeue, in the worker
	// that reads it).
	marked  bool
	resumed bool
	// waitFor is the command this one runs after (Cmd.After) while the
	// spool has not seen it, and waitUntil how long its worker waits for
	// it, from when it first found this one next (claim); gaveUp says it
	// waited in vain. Guarded by spool.mu.
	waitFor   string
	waitUntil time.Time
	gaveUp    bool
}

// DefaultAfterWait is how long a command whose predecessor (Cmd.After) has
// not arrived waits for it before it runs anyway. A broker delivers a
// late command within its redelivery time (a NATS node's ack wait, 30 s by
// default) and the server sends an unanswered one again within a minute
// (its SentRetry); waiting longer would hold the device up for a command
// that is not coming.
const DefaultAfterWait = 2 * time.Minute

// spoolLookahead is how many of a device's commands, at the head of its
// queue, the transaction that finishes a command marks as running: the
// next one is then on disk as running before the worker claims it (the
// transaction commits while the command before it runs), and the worker
// waits for no write of its own. A restart finds about these (and the
// first of a device's line, marked as it arrived), besides the one that
// was running, marked though they never started.
const spoolLookahead = 2

type outboxEntry struct {
	DeviceID string       `json:"device_id"`
	Reply    topics.Reply `json:"reply"`
}

// spool is the bbolt file and, in memory, each device's queue as the file
// has it: the workers claim commands from memory, and the file is only
// written (in grouped transactions): when commands arrive, when they
// finish and when their final replies are acknowledged.
type spool struct {
	db *bolt.DB
	w  *groupcommit.Committer

	mu     sync.Mutex
	queues map[string][]*record // device id → released commands not yet claimed, in queue order
	// running holds the ids of claimed commands not yet finished on disk,
	// and, after opening, those that may have been running when the bridge
	// stopped (resumed). A cancel leaves them alone.
	running map[string]bool

	// afterChunk, when set, runs between purge's chunks (tests).
	afterChunk func()
	// afterClaimRead, when set, runs after claim reads the file for a
	// command that waits for its predecessor (tests).
	afterClaimRead func()
	// afterWait is how long a command waits for the one it runs after
	// (DefaultAfterWait unless the agent's options say otherwise).
	afterWait time.Duration
}

// spoolCommitLinger is how long the spool's committer waits for company
// after a commit of several writes (groupcommit.Options.Linger). Nothing waits on the
// spool but the command's own round trip, and most of the bridge's CPU went
// to commits: at 2 ms it spends a fifth less per command (make bench,
// docs/performance.md).
const spoolCommitLinger = 2 * time.Millisecond

// spoolLockWait is how long opening the spool waits for another process
// to let go of the file. A variable: tests lower it.
var spoolLockWait = 5 * time.Second

func openSpool(dir string) (s *spool, err error) {
	path := filepath.Join(dir, "spool.db")
	if err := checkSpoolFile(path); err != nil {
		return nil, fmt.Errorf("open spool: %w", err)
	}
	_, serr := os.Stat(path)
	fresh := errors.Is(serr, os.ErrNotExist)
	if fresh {
		// A first start: a spool this open fails to make holds nothing,
		// and left behind, empty or half written (a full disk), the next
		// start would refuse it (checkSpoolFile).
		defer func() {
			if err != nil {
				_ = os.Remove(path)
			}
		}()
	}
	db, err := openBolt(path)
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("open spool: %s: another process holds it (a bridge already running on this --data?): %w", path, err)
	}
	if err != nil {
		return nil, spoolOpenError(path, err, fresh)
	}
	s = &spool{db: db, queues: map[string][]*record{}, running: map[string]bool{}, afterWait: DefaultAfterWait}
	err = db.Update(func(tx *bolt.Tx) error {
		// Before anything is written: a refusal rolls back and leaves the
		// file as it was.
		if err := checkSpoolVersion(tx, path); err != nil {
			return err
		}
		for _, b := range [][]byte{bucketCommands, bucketQueue, bucketOutbox, bucketStatus} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		err := migrateQueues(tx)
		if err == nil {
			err = s.load(tx)
		}
		if err != nil {
			// Neither writes to the file: what fails is reading it.
			return &errSpoolFile{path: path, what: err.Error()}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, spoolOpenError(path, err, fresh)
	}
	s.w = groupcommit.New(db, groupcommit.Options{Linger: spoolCommitLinger})
	return s, nil
}

// openBolt opens the spool's bbolt file, which checkSpoolFile has found
// whole. bbolt walks its tree as it opens it, and panics on what it finds
// wrong there that the check does not look at (keys out of order, a page
// reached twice): that is a damaged file too, not a crash of the bridge.
func openBolt(path string) (db *bolt.DB, err error) {
	defer func() {
		if p := recover(); p != nil {
			db, err = nil, &errSpoolFile{path: path, what: fmt.Sprintf("bbolt finds it damaged: %v", p)}
		}
	}()
	return bolt.Open(path, 0o600, &bolt.Options{
		Timeout:         spoolLockWait,
		NoFreelistSync:  true, // see store.Open
		FreelistType:    bolt.FreelistMapType,
		InitialMmapSize: groupcommit.MmapReserve, // see store.Open
	})
}

// migrateQueues moves the per-device queue buckets of earlier versions into
// the one queue, each device's commands in their order.
func migrateQueues(tx *bolt.Tx) error {
	old := tx.Bucket(bucketOldQueues)
	if old == nil {
		return nil
	}
	q := tx.Bucket(bucketQueue)
	err := old.ForEachBucket(func(dev []byte) error {
		return old.Bucket(dev).ForEach(func(_, id []byte) error {
			r, err := getRecord(tx, string(id))
			if err != nil || r == nil {
				return err
			}
			if r.Seq, err = q.NextSequence(); err != nil {
				return err
			}
			if err := q.Put(queueKey(r.Cmd.ID, r.Seq), id); err != nil {
				return err
			}
			return putRecord(tx, r)
		})
	})
	if err != nil {
		return err
	}
	return tx.DeleteBucket(bucketOldQueues)
}

// load reads the queue into memory, healing entries whose record is gone
// or done (which cannot happen). A command marked running may have run
// before the restart; so may the first of each device's queue when the
// file was written by a version that marked commands only as it claimed
// them, or not at all.
func (s *spool) load(tx *bolt.Tx) error {
	q := tx.Bucket(bucketQueue)
	var stale [][]byte
	err := q.ForEach(func(k, v []byte) error {
		r, err := getRecord(tx, string(v))
		if err != nil {
			return err
		}
		if r == nil || r.State == spoolDone {
			stale = append(stale, bytes.Clone(k))
			return nil
		}
		if r.waitFor, err = unseenAfter(tx, r.Cmd); err != nil {
			return err
		}
		dev := r.Cmd.DeviceID
		r.marked = r.State == spoolRunning
		// A command that names the one it runs after was spooled by a
		// version that marks every command before it can start: unmarked,
		// it never started (it may have waited for that one).
		if r.marked || (len(s.queues[dev]) == 0 && r.Cmd.After == "") {
			r.resumed = true
			s.running[r.Cmd.ID] = true
		}
		s.queues[dev] = append(s.queues[dev], r)
		return nil
	})
	if err != nil {
		return err
	}
	for _, k := range stale {
		if err := q.Delete(k); err != nil {
			return err
		}
	}
	return nil
}

// close finishes the writes under way and closes the file.
func (s *spool) close() error {
	s.w.Close()
	return s.db.Close()
}

func u64(v uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, v)
	return b
}

// queueKey orders the queue. Command ids are UUIDv7, assigned by the
// server in acceptance order, so sorting by id keeps that order even when
// the broker redelivers a backlog out of order (mochi does, within a
// second). Ids of another version sort first, among themselves by arrival
// (seq, from the queue bucket's sequence).
func queueKey(id string, seq uint64) []byte {
	k := make([]byte, 16, 24)
	if u, err := uuid.Parse(id); err == nil && u.Version() == 7 {
		copy(k, u[:])
	}
	return append(k, u64(seq)...)
}

func getRecord(tx *bolt.Tx, id string) (*record, error) {
	v := tx.Bucket(bucketCommands).Get([]byte(id))
	if v == nil {
		return nil, nil
	}
	var r record
	if err := fastjson.Unmarshal(v, &r); err != nil {
		return nil, fmt.Errorf("spool record %s: %w", id, err)
	}
	return &r, nil
}

func putRecord(tx *bolt.Tx, r *record) error {
	v, err := fastjson.Marshal(r)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketCommands).Put([]byte(r.Cmd.ID), v)
}

// putOutbox notes that the final reply in the record of id is owed to the
// broker.
func putOutbox(tx *bolt.Tx, id string) (uint64, error) {
	b := tx.Bucket(bucketOutbox)
	seq, err := b.NextSequence()
	if err != nil {
		return 0, err
	}
	return seq, b.Put(u64(seq), []byte(id))
}

// Outcomes of accepting a message.
type acceptOutcome int

const (
	acceptQueued     acceptOutcome = iota + 1 // new: now in the device's queue
	acceptExpired                             // new and past its TTL: done, never queued
	acceptKnown                               // queued or running already: drop
	acceptDone                                // finished already: republish its final reply
	acceptCanceled                            // a cancel that took a queued command off its queue
	acceptCancelNoop                          // a cancel with nothing to take off
)

type acceptResult struct {
	outcome acceptOutcome
	rec     *record       // acceptQueued: to release once its delivered reply is out
	final   *topics.Reply // acceptDone, acceptCanceled, acceptExpired
	key     uint64        // acceptExpired: the outbox key of its final reply
	// canceled is the id an acceptCanceled cancel took off its queue.
	canceled string
}

// acceptAt records a batch of parsed commands in one fsync'd transaction
// (shared with the spool's other writes), in order, and says what became of
// each. The queued ones reach their workers when released. TTLs are judged
// at ttlNow (Agent.ttlNow), records done at doneAt (Agent.stampNow); now
// stamps the replies.
func (s *spool) acceptAt(cmds []topics.Command, now, ttlNow, doneAt time.Time) ([]acceptResult, error) {
	var results []acceptResult
	err := s.w.Do(func(tx *bolt.Tx) error {
		results = make([]acceptResult, len(cmds))
		queued := map[string]int{}  // id → index of a command queued by this batch
		behind := map[string]bool{} // device → a command of this batch is queued for it
		for i, c := range cmds {
			var err error
			if c.Op == topics.OpCancel {
				results[i], err = s.acceptCancel(tx, c, now, doneAt)
				if j, ok := queued[results[i].canceled]; ok && results[i].outcome == acceptCanceled {
					// Canceled in the batch that brought it: it never runs.
					results[j] = acceptResult{outcome: acceptKnown}
				}
			} else {
				// The first of a device's line is marked running as it is
				// written: its worker takes it at once (unless it waits for
				// the command it runs after: acceptCommand).
				first := !behind[c.DeviceID] && s.lineEmpty(c.DeviceID)
				results[i], err = acceptCommand(tx, c, first, now, ttlNow, doneAt)
				if results[i].outcome == acceptQueued {
					queued[c.ID] = i
					behind[c.DeviceID] = true
				}
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, r := range results {
		if r.rec != nil && r.rec.State == spoolRunning {
			r.rec.marked = true // not yet released: no one else has it
		}
	}
	return results, nil
}

// lineEmpty reports whether no released command waits for the device's
// worker.
func (s *spool) lineEmpty(deviceID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queues[deviceID]) == 0
}

// release hands accepted commands to their devices' workers.
func (s *spool) release(recs ...*record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range recs {
		q := s.queues[r.Cmd.DeviceID]
		k := queueKey(r.Cmd.ID, r.Seq)
		// Almost always the last: ids rise with acceptance.
		i := len(q)
		for i > 0 && bytes.Compare(queueKey(q[i-1].Cmd.ID, q[i-1].Seq), k) > 0 {
			i--
		}
		s.queues[r.Cmd.DeviceID] = slices.Insert(q, i, r)
	}
}

// acceptCommand spools a new command, as running when it is the first of
// its device's line, or as done and expired when its TTL has passed by
// ttlNow.
func acceptCommand(tx *bolt.Tx, c topics.Command, first bool, now, ttlNow, doneAt time.Time) (acceptResult, error) {
	r, err := getRecord(tx, c.ID)
	if err != nil {
		return acceptResult{}, err
	}
	if r != nil {
		if r.State == spoolDone {
			return acceptResult{outcome: acceptDone, final: r.Final}, nil
		}
		return acceptResult{outcome: acceptKnown}, nil
	}
	if !c.ExpiresAt.IsZero() && ttlNow.After(c.ExpiresAt) {
		// Past its TTL as it arrives: it is never delivered (CONTRACT §2).
		// Queued, it would read "delivered" (deliveredDelay after it came
		// in, its device busy) before the worker reached it and said
		// "expired"; and marked running, the first of its line, a restart
		// would run it. So it is done as it arrives, answered "expired"
		// alone, and a repeat is answered from its record.
		final := &topics.Reply{CommandID: c.ID, State: companion.StateExpired, At: now}
		d := &record{Cmd: topics.Command{ID: c.ID, DeviceID: c.DeviceID}, State: spoolDone, Final: final, DoneAt: doneAt}
		if err := putRecord(tx, d); err != nil {
			return acceptResult{}, err
		}
		key, err := putOutbox(tx, c.ID)
		if err != nil {
			return acceptResult{}, err
		}
		return acceptResult{outcome: acceptExpired, final: final, key: key}, nil
	}
	waitFor, err := unseenAfter(tx, c)
	if err != nil {
		return acceptResult{}, err
	}
	q := tx.Bucket(bucketQueue)
	seq, err := q.NextSequence()
	if err != nil {
		return acceptResult{}, err
	}
	if err := q.Put(queueKey(c.ID, seq), []byte(c.ID)); err != nil {
		return acceptResult{}, err
	}
	nr := &record{Cmd: c, Seq: seq, State: spoolQueued, waitFor: waitFor}
	if first && waitFor == "" {
		nr.State = spoolRunning
	}
	if err := putRecord(tx, nr); err != nil {
		return acceptResult{}, err
	}
	return acceptResult{outcome: acceptQueued, rec: nr}, nil
}

// unseenAfter returns the command c runs after (c.After) when the spool
// has no record of it: c must wait for it. Commands of the same device
// come with ever larger ids, so an After that is not smaller is no
// predecessor, and is ignored.
func unseenAfter(tx *bolt.Tx, c topics.Command) (string, error) {
	if c.After == "" || c.After >= c.ID {
		return "", nil
	}
	if tx.Bucket(bucketCommands).Get([]byte(c.After)) != nil {
		return "", nil
	}
	return c.After, nil
}

// acceptCancel takes a command not yet started off its queue. A cancel for an
// id never seen leaves a tombstone, so that the command, should it still
// arrive (handlers may see messages out of order after a redelivery), is
// dropped. A cancel for a running or finished command does nothing: a
// command marked running on disk but still in its queue (marked ahead of
// its turn) has not started and can be canceled; after a restart it may
// have, and unrelease refuses it.
func (s *spool) acceptCancel(tx *bolt.Tx, c topics.Command, now, doneAt time.Time) (acceptResult, error) {
	var p topics.Cancel
	if err := json.Unmarshal(c.Payload, &p); err != nil || !topics.ValidCommandID(p.CommandID) {
		return acceptResult{outcome: acceptCancelNoop}, nil
	}
	final := &topics.Reply{CommandID: p.CommandID, State: companion.StateCanceled, At: now}
	r, err := getRecord(tx, p.CommandID)
	if err != nil {
		return acceptResult{}, err
	}
	switch {
	case r == nil:
		tomb := &record{
			Cmd:    topics.Command{ID: p.CommandID, DeviceID: c.DeviceID},
			State:  spoolDone,
			Final:  final,
			DoneAt: doneAt,
		}
		return acceptResult{outcome: acceptCancelNoop}, putRecord(tx, tomb)
	case r.State == spoolDone || !s.unrelease(r):
		return acceptResult{outcome: acceptCancelNoop}, nil
	}
	if err := tx.Bucket(bucketQueue).Delete(queueKey(r.Cmd.ID, r.Seq)); err != nil {
		return acceptResult{}, err
	}
	r.State, r.Final, r.DoneAt = spoolDone, final, doneAt
	if err := putRecord(tx, r); err != nil {
		return acceptResult{}, err
	}
	return acceptResult{outcome: acceptCanceled, final: final, canceled: r.Cmd.ID}, nil
}

// unrelease takes a command off its worker's queue before it runs, and
// reports false when it is running (or may have been) already.
func (s *spool) unrelease(r *record) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running[r.Cmd.ID] {
		return false
	}
	s.queues[r.Cmd.DeviceID] = slices.DeleteFunc(s.queues[r.Cmd.DeviceID], func(q *record) bool { return q.Cmd.ID == r.Cmd.ID })
	return true
}

// pending reports whether the device has commands released and not yet
// claimed.
func (s *spool) pending(deviceID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queues[deviceID]) > 0
}

// claim returns the first released command of the device's queue and
// takes it off (a cancel then leaves it alone), or nil when there is none.
// Before it runs, start makes sure the file has it as running.
//
// The first command also waits for the command it runs after, while the
// spool has not seen that one (record.waitFor): claim then returns nil and
// how much longer it waits. The one it waits for, once it arrives, comes
// before it in the queue (ids rise); after afterWait it runs without it
// (record.gaveUp).
func (s *spool) claim(deviceID string, now time.Time) (*record, time.Duration) {
	s.mu.Lock()
	q := s.queues[deviceID]
	if len(q) == 0 {
		s.mu.Unlock()
		return nil, 0
	}
	if r := q[0]; r.waitFor != "" {
		// Memory first: queued or running, the one it runs after is seen
		// (both are on disk). Memory is asked before the file is read:
		// finish forgets a command it ran only once the file has it done,
		// so one that memory no longer holds by then, the file has as
		// done. Asked after the read, a command finished in between read
		// as running on disk and as gone from memory, and this one waited
		// afterWait for it (docs/reliability.md, bug 103).
		held := s.holds(r.Cmd.DeviceID, r.Cmd.After)
		s.mu.Unlock()
		var (
			unseen string
			err    error
		)
		if !held {
			// The same test as at its arrival, a record of the one it
			// runs after, read with the file's lock, not the spool's; and
			// a record not done is one on disk but not yet in its queue:
			// accept commits a batch, then releases it. It is queued
			// ahead of this one in a moment (release wakes the device's
			// worker); claimed now, this one ran first
			// (docs/reliability.md, bug 102).
			err = s.db.View(func(tx *bolt.Tx) error {
				var err error
				if unseen, err = unseenAfter(tx, r.Cmd); err != nil || unseen != "" {
					return err
				}
				before, err := getRecord(tx, r.Cmd.After)
				if err == nil && before != nil && before.State != spoolDone {
					unseen = before.Cmd.ID
				}
				return err
			})
		}
		if s.afterClaimRead != nil {
			s.afterClaimRead()
		}
		s.mu.Lock()
		if err != nil || unseen != "" {
			if r.waitUntil.IsZero() {
				r.waitUntil = now.Add(s.afterWait)
			}
			if wait := r.waitUntil.Sub(now); wait > 0 {
				s.mu.Unlock()
				return nil, wait
			}
		}
		r.waitFor, r.gaveUp = "", err != nil || unseen != ""
		s.mu.Unlock()
		// Again: the queue may have changed meanwhile.
		return s.claim(deviceID, now)
	}
	defer s.mu.Unlock()
	r := q[0]
	q[0] = nil
	if len(q) == 1 {
		delete(s.queues, deviceID)
	} else {
		s.queues[deviceID] = q[1:]
	}
	s.running[r.Cmd.ID] = true
	return r, 0
}

// requeue puts a command its worker claimed, and stopped before its end,
// back at the head of its device's queue, as possibly started (resumed):
// it runs again, past its TTL too, and no cancel takes it off (bug 504).
func (s *spool) requeue(r *record) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r.resumed = true
	s.running[r.Cmd.ID] = true
	s.queues[r.Cmd.DeviceID] = slices.Insert(s.queues[r.Cmd.DeviceID], 0, r)
}

// holds reports whether command id of the device is in the spool's
// memory, queued or running: not done. Called with mu held.
func (s *spool) holds(deviceID, id string) bool {
	if s.running[id] {
		return true
	}
	return slices.ContainsFunc(s.queues[deviceID], func(r *record) bool { return r.Cmd.ID == id })
}

// claimUnserved claims every command queued for a device the bridge does
// not serve (served reports false for it), each device's in queue order,
// and returns them: no worker will claim them, and finish ends them as it
// ends any claimed command.
func (s *spool) claimUnserved(served func(deviceID string) bool) []*record {
	s.mu.Lock()
	defer s.mu.Unlock()
	var recs []*record
	for _, dev := range slices.Sorted(maps.Keys(s.queues)) {
		if served(dev) {
			continue
		}
		for _, r := range s.queues[dev] {
			s.running[r.Cmd.ID] = true
			recs = append(recs, r)
		}
		delete(s.queues, dev)
	}
	return recs
}

// start returns once the file has a claimed command as running, so that a
// restart after it reached the device finds it possibly started rather
// than never started (and neither expires it nor lets it be canceled).
// Mostly it was marked ahead of its turn and start writes nothing; else
// its write shares the spool's next commit.
func (s *spool) start(r *record) error {
	s.mu.Lock()
	marked := r.marked
	s.mu.Unlock()
	if marked {
		return nil
	}
	err := s.w.Do(func(tx *bolt.Tx) error { return putRunning(tx, r) })
	if err != nil {
		return err
	}
	s.mu.Lock()
	r.marked = true
	s.mu.Unlock()
	return nil
}

// putRunning writes a queued command's record as running.
func putRunning(tx *bolt.Tx, r *record) error {
	return putRecord(tx, &record{Cmd: r.Cmd, Seq: r.Seq, State: spoolRunning})
}

// markAhead marks the first spoolLookahead commands of a device's queue
// running in tx, and returns those it marked: they are marked in memory
// once tx is committed.
func (s *spool) markAhead(tx *bolt.Tx, deviceID string) ([]*record, error) {
	s.mu.Lock()
	q := s.queues[deviceID]
	var next []*record
	for _, r := range q[:min(spoolLookahead, len(q))] {
		if r.waitFor != "" {
			break // it may wait long; those behind it wait with it
		}
		if !r.marked {
			next = append(next, r)
		}
	}
	s.mu.Unlock()
	for _, r := range next {
		if err := putRunning(tx, r); err != nil {
			return nil, err
		}
	}
	return next, nil
}

// finishAt records a command as done at doneAt (Agent.stampNow) with its
// final reply, takes it off its queue and puts the reply in the outbox, in
// one transaction shared with the spool's other writes; the transaction
// also marks the device's next commands running (markAhead). It does not
// wait: done gets the reply's outbox key once it is on disk. The done
// callbacks run one at a time, in the order of the calls.
func (s *spool) finishAt(r *record, final topics.Reply, doneAt time.Time, done func(key uint64, err error)) {
	var key uint64
	var ahead []*record
	s.w.Go(func(tx *bolt.Tx) error {
		ahead = nil // the transaction may run again (groupcommit.Committer.Do)
		if err := tx.Bucket(bucketQueue).Delete(queueKey(r.Cmd.ID, r.Seq)); err != nil {
			return err
		}
		// What a done record is for: dropping a repeat, answering it with
		// the final reply, forgetting it after DoneRetention. The payload
		// is no longer needed.
		d := &record{Cmd: topics.Command{ID: r.Cmd.ID, DeviceID: r.Cmd.DeviceID}, State: spoolDone, Final: &final, DoneAt: doneAt}
		if err := putRecord(tx, d); err != nil {
			return err
		}
		var err error
		if key, err = putOutbox(tx, r.Cmd.ID); err != nil {
			return err
		}
		ahead, err = s.markAhead(tx, r.Cmd.DeviceID)
		return err
	}, func(err error) {
		if err == nil {
			s.mu.Lock()
			delete(s.running, r.Cmd.ID)
			for _, a := range ahead {
				a.marked = true
			}
			s.mu.Unlock()
		}
		done(key, err)
	})
}

type outboxItem struct {
	key uint64
	outboxEntry
}

// outbox lists the final replies not yet acknowledged, oldest first.
// Entries of earlier versions hold the reply itself.
func (s *spool) outbox() ([]outboxItem, error) {
	var items []outboxItem
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOutbox).ForEach(func(k, v []byte) error {
			var e outboxEntry
			if bytes.HasPrefix(v, []byte("{")) {
				if err := fastjson.Unmarshal(v, &e); err != nil {
					return fmt.Errorf("spool outbox: %w", err)
				}
			} else {
				r, err := getRecord(tx, string(v))
				if err != nil {
					return err
				}
				if r == nil || r.Final == nil {
					return nil // purged since: nothing to send
				}
				e = outboxEntry{DeviceID: r.Cmd.DeviceID, Reply: *r.Final}
			}
			items = append(items, outboxItem{key: binary.BigEndian.Uint64(k), outboxEntry: e})
			return nil
		})
	})
	return items, err
}

// deleteOutbox forgets an acknowledged final reply. It does not wait: the
// delete shares the spool's next commit, and done (if not nil) gets its
// outcome.
func (s *spool) deleteOutbox(key uint64, done func(error)) {
	s.w.Go(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOutbox).Delete(u64(key))
	}, done)
}

// lastStatus returns the status last read from the device that keepStatus
// kept, nil when none was.
func (s *spool) lastStatus(deviceID string) (*topics.Status, error) {
	var st *topics.Status
	err := s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketStatus).Get([]byte(deviceID))
		if v == nil {
			return nil
		}
		st = new(topics.Status)
		if err := fastjson.Unmarshal(v, st); err != nil {
			return fmt.Errorf("spool status of %s: %w", deviceID, err)
		}
		return nil
	})
	return st, err
}

// keepStatus keeps a status read from the device. It does not wait: the
// write shares the spool's next commit, and done gets its outcome.
func (s *spool) keepStatus(deviceID string, st topics.Status, done func(error)) {
	v, err := fastjson.Marshal(st)
	if err != nil {
		done(err)
		return
	}
	s.w.Go(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketStatus).Put([]byte(deviceID), v)
	}, done)
}

// purgeChunk is how many keys purge reads in one read transaction, and so
// the most it deletes in one write. A busy bridge holds millions of done
// records over DoneRetention; one transaction over all of them held every
// other write of the spool (intake, finishes, status) for as long as it
// took to decode them. A variable: tests lower it.
var purgeChunk = 1000

// purge forgets the ids of commands finished before cutoff and returns how
// many it forgot. It reads the records a chunk at a time, each chunk in a
// read transaction of its own (which holds up no writer), and deletes each
// chunk's old ones in a short write shared with the spool's other writes,
// so that they wait for one chunk at most. afterChunk, when set, runs
// between chunks (tests).
func (s *spool) purge(cutoff time.Time) (int, error) {
	// A record whose final reply is still owed stays, however old: the
	// server never had the reply, and sends the command again once the
	// bridge is back; forgotten, it would run a second time.
	owed, err := s.owedReplies()
	if err != nil {
		return 0, err
	}
	n := 0
	var after []byte // the last key read; nil: none yet
	for {
		old, last, err := s.oldDone(after, cutoff, owed)
		if err != nil {
			return n, err
		}
		if len(old) > 0 {
			deleted, err := s.deleteOld(old, cutoff)
			n += deleted
			if err != nil {
				return n, err
			}
		}
		if last == nil {
			break
		}
		after = last
		if s.afterChunk != nil {
			s.afterChunk()
		}
	}
	return n, s.purgeOrphans()
}

// doneAt is what purge reads of a record: not the command, whose payload
// it need not decode.
type doneAt struct {
	State  string    `json:"state"`
	DoneAt time.Time `json:"done_at,omitzero"`
}

func (d doneAt) old(cutoff time.Time) bool {
	return d.State == spoolDone && d.DoneAt.Before(cutoff)
}

// oldDone reads up to purgeChunk records after the key after (from the
// first when nil) and returns the keys of those done before cutoff, and
// the last key it read, nil when it read to the end.
func (s *spool) oldDone(after []byte, cutoff time.Time, owed map[string]bool) (old [][]byte, last []byte, err error) {
	err = s.db.View(func(tx *bolt.Tx) error {
		old = nil
		last, err = readChunk(tx.Bucket(bucketCommands), after, func(k, v []byte) error {
			var d doneAt
			if err := fastjson.Unmarshal(v, &d); err != nil {
				return fmt.Errorf("spool record %s: %w", k, err)
			}
			if d.old(cutoff) && !owed[string(k)] {
				old = append(old, bytes.Clone(k))
			}
			return nil
		})
		return err
	})
	return old, last, err
}

// readChunk calls f with up to purgeChunk entries of b after the key
// after (from the first when nil), and returns the last key it read, nil
// when it read to the end.
func readChunk(b *bolt.Bucket, after []byte, f func(k, v []byte) error) (last []byte, err error) {
	c := b.Cursor()
	k, v := c.First()
	if after != nil {
		if k, v = c.Seek(after); bytes.Equal(k, after) {
			k, v = c.Next()
		}
	}
	for i := 0; k != nil && i < purgeChunk; k, v = c.Next() {
		i++
		if err := f(k, v); err != nil {
			return nil, err
		}
		last = bytes.Clone(k)
	}
	if k == nil {
		return nil, nil // read to the end
	}
	return last, nil
}

// deleteOld deletes the records of ids that are still done before cutoff
// (checked again: the read that found them has ended), in one write
// shared with the spool's others, and returns how many it deleted.
func (s *spool) deleteOld(ids [][]byte, cutoff time.Time) (int, error) {
	var n int
	err := s.w.Do(func(tx *bolt.Tx) error {
		n = 0 // the transaction may run again (groupcommit.Committer.Do)
		b := tx.Bucket(bucketCommands)
		for _, k := range ids {
			v := b.Get(k)
			if v == nil {
				continue
			}
			var d doneAt
			if err := fastjson.Unmarshal(v, &d); err != nil {
				return fmt.Errorf("spool record %s: %w", k, err)
			}
			if !d.old(cutoff) {
				continue
			}
			if err := b.Delete(k); err != nil {
				return err
			}
			n++
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}

// owedReplies returns the ids of the commands whose final reply is in the
// outbox, not yet acknowledged by the broker. Its entries hold the id, or,
// written by earlier versions, the reply itself. The outbox holds what the
// bridge finished and could not hand over: it grows only while the broker
// is away, and by no more than the commands the spool held then.
func (s *spool) owedReplies() (map[string]bool, error) {
	owed := map[string]bool{}
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOutbox).ForEach(func(_, v []byte) error {
			if !bytes.HasPrefix(v, []byte("{")) {
				owed[string(v)] = true
				return nil
			}
			var old struct {
				Reply struct {
					CommandID string `json:"command_id"`
				} `json:"reply"`
			}
			if err := fastjson.Unmarshal(v, &old); err == nil && old.Reply.CommandID != "" {
				owed[old.Reply.CommandID] = true
			}
			return nil
		})
	})
	return owed, err
}

// purgeOrphans forgets the final replies whose record is gone (purge keeps
// the record of a reply still owed; earlier versions did not). It
// reads the outbox a chunk at a time, as purge reads the records, and
// deletes each chunk's orphans in a write of its own.
func (s *spool) purgeOrphans() error {
	var after []byte
	for {
		var orphans [][]byte
		var last []byte
		err := s.db.View(func(tx *bolt.Tx) error {
			orphans = nil
			cmds := tx.Bucket(bucketCommands)
			var err error
			last, err = readChunk(tx.Bucket(bucketOutbox), after, func(k, v []byte) error {
				if orphan(cmds, v) {
					orphans = append(orphans, bytes.Clone(k))
				}
				return nil
			})
			return err
		})
		if err != nil {
			return err
		}
		if len(orphans) > 0 {
			err := s.w.Do(func(tx *bolt.Tx) error {
				cmds, out := tx.Bucket(bucketCommands), tx.Bucket(bucketOutbox)
				for _, k := range orphans {
					if v := out.Get(k); v == nil || !orphan(cmds, v) {
						continue // acknowledged since, or its record is back
					}
					if err := out.Delete(k); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				return err
			}
		}
		if last == nil {
			return nil
		}
		after = last
	}
}

// orphan reports whether an outbox entry names a command whose record is
// gone. Entries of earlier versions hold their reply and are never orphans.
func orphan(cmds *bolt.Bucket, v []byte) bool {
	return !bytes.HasPrefix(v, []byte("{")) && cmds.Get(v) == nil
}
