package agent

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/topics"
)

// The spool is the bridge's durable memory, one bbolt file:
//
//	commands  id → record: every command id seen, until purged
//	queues    device id → (queueKey → id): the commands still to run, in order
//	          of acceptance (their UUIDv7 ids), then of arrival
//	outbox    seq → outboxEntry: final replies not yet acknowledged by the broker
var (
	bucketCommands = []byte("commands")
	bucketQueues   = []byte("queues")
	bucketOutbox   = []byte("outbox")
)

// States of a spooled command.
const (
	spoolQueued  = "queued"
	spoolRunning = "running"
	spoolDone    = "done"
)

// DoneRetention is how long the spool remembers a finished command id, so
// that a late repeat of it is dropped rather than run again.
const DoneRetention = 8 * 24 * time.Hour

type record struct {
	Cmd    topics.Command `json:"cmd"`
	Seq    uint64         `json:"seq,omitempty"`
	State  string         `json:"state"`
	Final  *topics.Reply  `json:"final,omitempty"`
	DoneAt time.Time      `json:"done_at,omitzero"`
}

type outboxEntry struct {
	DeviceID string       `json:"device_id"`
	Reply    topics.Reply `json:"reply"`
}

type spool struct {
	db *bolt.DB
}

func openSpool(dir string) (*spool, error) {
	db, err := bolt.Open(filepath.Join(dir, "spool.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open spool: %w", err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketCommands, bucketQueues, bucketOutbox} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("open spool: %w", err)
	}
	return &spool{db: db}, nil
}

func (s *spool) close() error { return s.db.Close() }

func u64(v uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, v)
	return b
}

// queueKey orders a device's queue. Command ids are UUIDv7, assigned by the
// server in acceptance order, so sorting by id keeps that order even when
// the broker redelivers a backlog out of order (mochi does, within a
// second). Ids of another version sort first, among themselves by arrival.
func queueKey(id string, seq uint64) []byte {
	k := make([]byte, 16, 24)
	if u, err := uuid.Parse(id); err == nil && u.Version() == 7 {
		copy(k, u[:])
	}
	return append(k, u64(seq)...)
}

func keySeq(k []byte) uint64 { return binary.BigEndian.Uint64(k[len(k)-8:]) }

func getRecord(tx *bolt.Tx, id string) (*record, error) {
	v := tx.Bucket(bucketCommands).Get([]byte(id))
	if v == nil {
		return nil, nil
	}
	var r record
	if err := json.Unmarshal(v, &r); err != nil {
		return nil, fmt.Errorf("spool record %s: %w", id, err)
	}
	return &r, nil
}

func putRecord(tx *bolt.Tx, r *record) error {
	v, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketCommands).Put([]byte(r.Cmd.ID), v)
}

func putOutbox(tx *bolt.Tx, e outboxEntry) error {
	b := tx.Bucket(bucketOutbox)
	seq, err := b.NextSequence()
	if err != nil {
		return err
	}
	v, err := json.Marshal(e)
	if err != nil {
		return err
	}
	return b.Put(u64(seq), v)
}

// Outcomes of accepting a message.
type acceptOutcome int

const (
	acceptQueued     acceptOutcome = iota + 1 // new: now in the device's queue
	acceptKnown                               // queued or running already: drop
	acceptDone                                // finished already: republish its final reply
	acceptCanceled                            // a cancel that took a queued command off its queue
	acceptCancelNoop                          // a cancel with nothing to take off
)

type acceptResult struct {
	outcome acceptOutcome
	seq     uint64        // acceptQueued
	final   *topics.Reply // acceptDone, acceptCanceled
}

// accept records a batch of parsed commands in one fsync'd transaction, in
// order, and says what became of each.
func (s *spool) accept(cmds []topics.Command, now time.Time) ([]acceptResult, error) {
	results := make([]acceptResult, len(cmds))
	err := s.db.Update(func(tx *bolt.Tx) error {
		for i, c := range cmds {
			var err error
			if c.Op == topics.OpCancel {
				results[i], err = acceptCancel(tx, c, now)
			} else {
				results[i], err = acceptCommand(tx, c)
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
	return results, nil
}

func acceptCommand(tx *bolt.Tx, c topics.Command) (acceptResult, error) {
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
	q, err := tx.Bucket(bucketQueues).CreateBucketIfNotExists([]byte(c.DeviceID))
	if err != nil {
		return acceptResult{}, err
	}
	seq, err := q.NextSequence()
	if err != nil {
		return acceptResult{}, err
	}
	if err := q.Put(queueKey(c.ID, seq), []byte(c.ID)); err != nil {
		return acceptResult{}, err
	}
	if err := putRecord(tx, &record{Cmd: c, Seq: seq, State: spoolQueued}); err != nil {
		return acceptResult{}, err
	}
	return acceptResult{outcome: acceptQueued, seq: seq}, nil
}

// acceptCancel takes a command not yet started off its queue. A cancel for an
// id never seen leaves a tombstone, so that the command, should it still
// arrive (handlers may see messages out of order after a redelivery), is
// dropped. A cancel for a running or finished command does nothing.
func acceptCancel(tx *bolt.Tx, c topics.Command, now time.Time) (acceptResult, error) {
	var p topics.Cancel
	if err := json.Unmarshal(c.Payload, &p); err != nil || !topics.ValidCommandID(p.CommandID) {
		return acceptResult{outcome: acceptCancelNoop}, nil
	}
	final := &topics.Reply{CommandID: p.CommandID, State: topics.StateCanceled, At: now}
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
			DoneAt: now,
		}
		return acceptResult{outcome: acceptCancelNoop}, putRecord(tx, tomb)
	case r.State != spoolQueued:
		return acceptResult{outcome: acceptCancelNoop}, nil
	}
	if q := tx.Bucket(bucketQueues).Bucket([]byte(r.Cmd.DeviceID)); q != nil {
		if err := q.Delete(queueKey(r.Cmd.ID, r.Seq)); err != nil {
			return acceptResult{}, err
		}
	}
	r.State, r.Final, r.DoneAt = spoolDone, final, now
	if err := putRecord(tx, r); err != nil {
		return acceptResult{}, err
	}
	return acceptResult{outcome: acceptCanceled, final: final}, nil
}

// claim returns the first command of the device's queue, marking it
// running, or nil when there is none or the first arrived after upTo. A command found
// running already was interrupted by a crash: it is returned again.
func (s *spool) claim(deviceID string, upTo uint64) (*record, error) {
	var out *record
	err := s.db.Batch(func(tx *bolt.Tx) error {
		out = nil
		q := tx.Bucket(bucketQueues).Bucket([]byte(deviceID))
		if q == nil {
			return nil
		}
		k, v := q.Cursor().First()
		if k == nil || keySeq(k) > upTo {
			return nil
		}
		r, err := getRecord(tx, string(v))
		if err != nil {
			return err
		}
		if r == nil || r.State == spoolDone { // cannot happen; heal it
			return q.Delete(k)
		}
		if r.State != spoolRunning {
			r.State = spoolRunning
			if err := putRecord(tx, r); err != nil {
				return err
			}
		}
		out = r
		return nil
	})
	return out, err
}

// finish records a command as done with its final reply, takes it off its
// queue and puts the reply in the outbox, in one transaction.
func (s *spool) finish(r *record, final topics.Reply) error {
	return s.db.Batch(func(tx *bolt.Tx) error {
		if q := tx.Bucket(bucketQueues).Bucket([]byte(r.Cmd.DeviceID)); q != nil {
			if err := q.Delete(queueKey(r.Cmd.ID, r.Seq)); err != nil {
				return err
			}
		}
		done := *r
		done.State, done.Final, done.DoneAt = spoolDone, &final, final.At
		if err := putRecord(tx, &done); err != nil {
			return err
		}
		return putOutbox(tx, outboxEntry{DeviceID: r.Cmd.DeviceID, Reply: final})
	})
}

// lastSeq returns the arrival seq of the last command spooled for the device.
func (s *spool) lastSeq(deviceID string) (uint64, error) {
	var seq uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		if q := tx.Bucket(bucketQueues).Bucket([]byte(deviceID)); q != nil {
			seq = q.Sequence()
		}
		return nil
	})
	return seq, err
}

type outboxItem struct {
	key uint64
	outboxEntry
}

// outbox lists the final replies not yet acknowledged, oldest first.
func (s *spool) outbox() ([]outboxItem, error) {
	var items []outboxItem
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOutbox).ForEach(func(k, v []byte) error {
			var e outboxEntry
			if err := json.Unmarshal(v, &e); err != nil {
				return fmt.Errorf("spool outbox: %w", err)
			}
			items = append(items, outboxItem{key: binary.BigEndian.Uint64(k), outboxEntry: e})
			return nil
		})
	})
	return items, err
}

func (s *spool) deleteOutbox(key uint64) error {
	return s.db.Batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketOutbox).Delete(u64(key))
	})
}

// purge forgets the ids of commands finished before cutoff and returns how
// many it forgot.
func (s *spool) purge(cutoff time.Time) (int, error) {
	var n int
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketCommands)
		var old [][]byte
		err := b.ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("spool record %s: %w", k, err)
			}
			if r.State == spoolDone && r.DoneAt.Before(cutoff) {
				old = append(old, append([]byte(nil), k...))
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range old {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		n = len(old)
		return nil
	})
	return n, err
}

// seen reports the spool state of a command id ("" when unknown). Tests use it.
func (s *spool) seen(id string) (string, error) {
	var state string
	err := s.db.View(func(tx *bolt.Tx) error {
		r, err := getRecord(tx, id)
		if r != nil {
			state = r.State
		}
		return err
	})
	return state, err
}
