package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"strconv"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// The event log (schema version 5). Each write that changes a command or
// a status appends its events in its own transaction, keyed by the
// bucket's NextSequence: bbolt has one writer at a time, so sequence
// order is commit order, and a reader at sequence n has seen every event
// up to n. An event's id is its sequence as 16 hex digits, so ids compare
// as strings in log order.
var (
	bucketEvents     = []byte("events")      // sequence (8-byte big-endian) → Event
	bucketUserEvents = []byte("user_events") // user id, sequence (8-byte big-endian)
)

// keyEventsPurged, in the meta bucket, is the sequence of the last event
// PurgeEvents deleted (8-byte big-endian), for EventsPurgedAfter: none
// before the first purge that deleted one.
var keyEventsPurged = []byte("events_purged")

// migrateTo5 makes the buckets of the event log.
func migrateTo5(tx *bolt.Tx) error {
	for _, name := range [][]byte{bucketEvents, bucketUserEvents} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return fmt.Errorf("create bucket %s: %w", name, err)
		}
	}
	return nil
}

// maxEventsPage bounds a page of Events.
const maxEventsPage = 1000

// OnEvents has fn called after each commit that appended events, so that
// a reader of the log (the API's event hub) looks at once rather than at
// its next poll. fn runs on the committer's goroutine: it must be quick
// and must not call the store. A later call replaces fn.
func (db *DB) OnEvents(fn func()) {
	db.onEvents.Store(&fn)
}

// appendEvent adds ev to the log in tx. Events of devices bound to no one
// (userID "") are dropped: nobody may see them.
func (db *DB) appendEvent(tx *bolt.Tx, ev companion.Event) error {
	if ev.UserID == "" {
		return nil
	}
	events := tx.Bucket(bucketEvents)
	seq, err := events.NextSequence()
	if err != nil {
		return err
	}
	k := binary.BigEndian.AppendUint64(nil, seq)
	if err := putJSON(events, k, ev); err != nil {
		return err
	}
	if err := tx.Bucket(bucketUserEvents).Put(append(prefix(ev.UserID), k...), nil); err != nil {
		return err
	}
	tx.OnCommit(func() {
		if fn := db.onEvents.Load(); fn != nil {
			(*fn)()
		}
	})
	return nil
}

// appendDeviceEvent adds the event of the device's new status s, for the
// user the device is bound to, when old (found: there was one) differs
// from s as a user sees it.
func (db *DB) appendDeviceEvent(tx *bolt.Tx, old companion.Status, found bool, s companion.Status) error {
	if !companion.DeviceEventDue(old, found, s) {
		return nil
	}
	b, ok, err := db.getBinding(tx, s.DeviceID)
	if err != nil || !ok {
		return err
	}
	return db.appendEvent(tx, companion.DeviceChanged(b.UserID, s))
}

// eventID is the id of the event at seq.
func eventID(seq uint64) string { return fmt.Sprintf("%016x", seq) }

// parseEventID reads a cursor: "" is 0, before every event.
func parseEventID(s string) (uint64, error) {
	if s == "" {
		return 0, nil
	}
	if len(s) != 16 {
		return 0, companion.ErrInvalidCursor
	}
	v, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		return 0, companion.ErrInvalidCursor
	}
	return v, nil
}

// Events returns the user's events after the cursor (every user's with
// userID ""), oldest first; see companion.Store. It reads the user's
// index, so a user's resume reads only that user's events.
func (db *DB) Events(ctx context.Context, userID, after string, limit int) ([]companion.Event, string, error) {
	from, err := parseEventID(after)
	if err != nil {
		return nil, "", err
	}
	if limit <= 0 || limit > maxEventsPage {
		limit = maxEventsPage
	}
	out := []companion.Event{}
	next := from
	err = db.bolt.View(func(tx *bolt.Tx) error {
		events := tx.Bucket(bucketEvents)
		// Nothing past the sequence is committed: the next call starts
		// there, whatever it skipped of other users' events.
		next = max(from, events.Sequence())
		start := binary.BigEndian.AppendUint64(nil, from+1)
		add := func(k, v []byte) error {
			var ev companion.Event
			if err := fastjson.Unmarshal(v, &ev); err != nil {
				return fmt.Errorf("store: decode event %x: %w", k, err)
			}
			seq := binary.BigEndian.Uint64(k)
			ev.ID = eventID(seq)
			out = append(out, ev)
			if len(out) == limit {
				next = seq
			}
			return nil
		}
		if userID == "" {
			c := events.Cursor()
			for k, v := c.Seek(start); k != nil && len(out) < limit; k, v = c.Next() {
				if err := add(k, v); err != nil {
					return err
				}
			}
			return nil
		}
		if !validID(userID) {
			return nil
		}
		p := prefix(userID)
		c := tx.Bucket(bucketUserEvents).Cursor()
		for k, _ := c.Seek(append(bytes.Clone(p), start...)); k != nil && bytes.HasPrefix(k, p) && len(out) < limit; k, _ = c.Next() {
			seqKey := k[len(p):]
			v := events.Get(seqKey)
			if v == nil {
				continue // purged meanwhile: cannot be, in one transaction
			}
			if err := add(seqKey, v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, "", err
	}
	return out, eventID(next), nil
}

// EventsHead returns the cursor of the last event committed.
func (db *DB) EventsHead(ctx context.Context) (string, error) {
	var seq uint64
	err := db.bolt.View(func(tx *bolt.Tx) error {
		seq = tx.Bucket(bucketEvents).Sequence()
		return nil
	})
	return eventID(seq), err
}

// EventsPastEnd reports whether the cursor after is past the bucket's
// sequence: no event has had that id yet, in this file (it survives a
// purge of the events, not the file's deletion).
func (db *DB) EventsPastEnd(ctx context.Context, after string) (bool, error) {
	seq, err := parseEventID(after)
	if err != nil {
		return false, err
	}
	var past bool
	err = db.bolt.View(func(tx *bolt.Tx) error {
		past = seq > tx.Bucket(bucketEvents).Sequence()
		return nil
	})
	return past, err
}

// EventsPurgedAfter reports whether PurgeEvents deleted an event after
// the cursor after (docs/reliability.md, bug 274).
func (db *DB) EventsPurgedAfter(ctx context.Context, after string) (bool, error) {
	seq, err := parseEventID(after)
	if err != nil {
		return false, err
	}
	var purged bool
	err = db.bolt.View(func(tx *bolt.Tx) error {
		purged = eventsPurged(tx) > seq
		return nil
	})
	return purged, err
}

// eventsPurged returns the sequence of the last event PurgeEvents
// deleted, 0 for none: the mark (keyEventsPurged), or the one before the
// first event the log keeps (the sequence when it keeps none) when that
// is higher. Sequences run from 1 without a gap (NextSequence) and only
// PurgeEvents deletes events, so every event before the first kept was
// purged, by this build or by one from before the mark (8b0d0c9), whose
// purges kept none: a file it purged, upgraded, or taken back to it for a
// while, had no mark or a stale one, and a client that resumed across the
// upgrade from before the events it purged got no reset
// (docs/reliability.md, bug 304).
func eventsPurged(tx *bolt.Tx) uint64 {
	var mark uint64
	if v := tx.Bucket(bucketMeta).Get(keyEventsPurged); len(v) == 8 {
		mark = binary.BigEndian.Uint64(v)
	}
	events := tx.Bucket(bucketEvents)
	if k, _ := events.Cursor().First(); len(k) == 8 {
		return max(mark, binary.BigEndian.Uint64(k)-1)
	}
	return max(mark, events.Sequence())
}

// PurgeEvents deletes the events older than olderThan, oldest first, at
// most purgeBatch of them in each write transaction. Events made after now
// (while the clock ran ahead) are stepped over, a bounded number a
// transaction (resumable.walk), as PurgeCommands steps over such commands:
// those that follow them in the log are older.
func (db *DB) PurgeEvents(ctx context.Context, olderThan time.Time) (int, error) {
	now := db.now()
	var at resumable
	return db.purgeInBatches(ctx, func(tx *bolt.Tx, batch int) (int, bool, error) {
		events, byUser := tx.Bucket(bucketEvents), tx.Bucket(bucketUserEvents)
		type doomed struct {
			k    []byte
			user string
		}
		var gone []doomed
		more, err := at.walk(events.Cursor(), batch, func() bool { return len(gone) == batch }, func(k, v []byte) (bool, error) {
			var ev companion.Event
			if err := fastjson.Unmarshal(v, &ev); err != nil {
				return false, fmt.Errorf("store: decode event %x: %w", k, err)
			}
			if !ev.At.Before(olderThan) {
				return !ev.At.After(now), nil // made ahead: step over
			}
			gone = append(gone, doomed{bytes.Clone(k), ev.UserID})
			return false, nil
		})
		if err != nil {
			return 0, false, err
		}
		var last []byte
		for _, d := range gone {
			if err := events.Delete(d.k); err != nil {
				return 0, false, err
			}
			if err := byUser.Delete(append(prefix(d.user), d.k...)); err != nil {
				return 0, false, err
			}
			if bytes.Compare(d.k, last) > 0 {
				last = d.k
			}
		}
		if last != nil {
			// The last deleted, for EventsPurgedAfter: never lowered.
			meta := tx.Bucket(bucketMeta)
			if old := meta.Get(keyEventsPurged); bytes.Compare(last, old) > 0 {
				if err := meta.Put(keyEventsPurged, last); err != nil {
					return 0, false, err
				}
			}
		}
		return len(gone), more, nil
	})
}
