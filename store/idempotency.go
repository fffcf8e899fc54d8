package store

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// IdempotencyClaimTTL is how long a claim (a record with Status 0: its
// request is being worked on) holds its key. A request's work takes far
// less; a claim older than this one's request died before it answered, and
// its key is free again.
const IdempotencyClaimTTL = time.Minute

// live reports whether rec still answers repeats at now. CreateCommand
// holds every record to it: its own records are never claims, and a key
// that another request used, even one that never answered, is a conflict
// for a command.
func live(rec companion.Idempotency, now time.Time) bool {
	return now.Sub(rec.CreatedAt) < IdempotencyTTL
}

// holds reports whether rec holds its key at now: an answer for
// IdempotencyTTL, a claim for IdempotencyClaimTTL.
func holds(rec companion.Idempotency, now time.Time) bool {
	if rec.Status == 0 {
		// A claim made more than its TTL ahead of now was made before the
		// clock stepped back, by a request gone with it; read as new, it
		// held the key for as long as the step (docs/reliability.md,
		// bug 336).
		age := now.Sub(rec.CreatedAt)
		return age < IdempotencyClaimTTL && age > -IdempotencyClaimTTL
	}
	return live(rec, now)
}

// Idempotency returns the record of the user's key, or ErrNotFound when
// there is none or it no longer holds the key (an answer older than
// IdempotencyTTL, a claim older than IdempotencyClaimTTL). A record with
// Status 0 is a claim: its request has no answer yet.
func (db *DB) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	if !validID(userID) || !validID(key) {
		return companion.Idempotency{}, companion.ErrNotFound
	}
	var rec companion.Idempotency
	if err := db.get(bucketIdempotency, idemKey(userID, key), &rec); err != nil {
		return companion.Idempotency{}, err
	}
	if !holds(rec, db.now()) {
		return companion.Idempotency{}, companion.ErrNotFound
	}
	return rec, nil
}

// PutIdempotency stores rec: the first answer to a request or, with Status
// 0, a claim (the request is being worked on: repeats wait for its
// answer). CreatedAt is set to now when zero. It returns ErrExists when a
// record of the same user and key holds the key (see Idempotency), with
// one exception, which lets the claimant finish: a claim is replaced by a
// record of the same request (the same RequestHash) that is its answer
// (Status not 0), or that no longer holds the key itself and has the
// claim's Body, its token (the claimant gave up, and the key is free). A record that no longer holds its key is
// replaced.
func (db *DB) PutIdempotency(ctx context.Context, rec companion.Idempotency) error {
	if !validID(rec.UserID) || !validID(rec.Key) {
		return fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid)
	}
	return db.batch(func(tx *bolt.Tx) error {
		now := db.now()
		r := rec
		if r.CreatedAt.IsZero() {
			r.CreatedAt = now
		}
		if held, err := keyHeld(tx, r, now); err != nil || held {
			return cmp.Or(err, abort(companion.ErrExists))
		}
		return putJSON(tx.Bucket(bucketIdempotency), idemKey(r.UserID, r.Key), r)
	})
}

// keyHeld reports whether a record other than r's claim holds the key of
// r at now: PutIdempotency refuses r then.
func keyHeld(tx *bolt.Tx, r companion.Idempotency, now time.Time) (bool, error) {
	var old companion.Idempotency
	ok, err := getJSON(tx.Bucket(bucketIdempotency), idemKey(r.UserID, r.Key), &old)
	if err != nil {
		return false, err
	}
	return ok && holds(old, now) && !settles(old, r, now), nil
}

// settles reports whether r is what the claimant of old puts over it: the
// answer of the same request, or the claim given up, with old's Body (a
// claim's token). A request that gave its claim up after it ran out gave
// up a repeat's claim of the key instead, and a third repeat did the work
// alongside the second (docs/reliability.md, bug 311).
func settles(old, r companion.Idempotency, now time.Time) bool {
	if old.Status != 0 || !bytes.Equal(old.RequestHash, r.RequestHash) {
		return false
	}
	return r.Status != 0 || (!holds(r, now) && bytes.Equal(old.Body, r.Body))
}

// answerOf returns the answer ctx carries (companion.WithAnswer) for the
// write that does its request's work, if any.
func answerOf(ctx context.Context) (companion.Idempotency, bool, error) {
	rec, ok := companion.AnswerOf(ctx)
	if ok && (!validID(rec.UserID) || !validID(rec.Key)) {
		return companion.Idempotency{}, false, fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid)
	}
	return rec, ok, nil
}

// answerIn returns work, the transaction of a write, in one with the
// storing of rec, its request's answer, over the request's claim, so
// that the work and its recorded answer commit or fail together (bug
// 308). A key another request holds is ErrIdemConflict, found before
// work runs (a batch commits what an aborted callback wrote). work's
// created, when not nil, says whether it did the work: the answer is
// stored only then.
func (db *DB) answerIn(rec companion.Idempotency, work func(tx *bolt.Tx) error, created *bool) func(tx *bolt.Tx) error {
	return func(tx *bolt.Tx) error {
		now := db.now()
		r := rec
		if r.CreatedAt.IsZero() {
			r.CreatedAt = now
		}
		if held, err := keyHeld(tx, r, now); err != nil || held {
			return cmp.Or(err, abort(companion.ErrIdemConflict))
		}
		if err := work(tx); err != nil || (created != nil && !*created) {
			return err
		}
		return putJSON(tx.Bucket(bucketIdempotency), idemKey(r.UserID, r.Key), r)
	}
}

// answered is work in one transaction with the storing of the answer ctx
// carries, if any (see answerIn); without one it is work.
func (db *DB) answered(ctx context.Context, work func(tx *bolt.Tx) error) func(tx *bolt.Tx) error {
	rec, ok, err := answerOf(ctx)
	switch {
	case err != nil:
		return func(*bolt.Tx) error { return abort(err) }
	case !ok:
		return work
	}
	return db.answerIn(rec, work, nil)
}

// PurgeIdempotency deletes the records created before olderThan and
// returns how many it deleted. The records are kept by user and key, not
// by time, so every one is read, a bounded number a write transaction
// (resumable.walk), each going on from where the last stopped. In one
// transaction, a day of keyed requests (millions of records at a few
// hundred a second) held the writer, and so every 202, for as long as the
// walk took.
func (db *DB) PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	var at resumable
	return db.purgeInBatches(ctx, func(tx *bolt.Tx, batch int) (int, bool, error) {
		b := tx.Bucket(bucketIdempotency)
		var doomed [][]byte
		more, err := at.walk(b.Cursor(), batch, func() bool { return len(doomed) == batch }, func(k, v []byte) (bool, error) {
			var rec companion.Idempotency
			if err := fastjson.Unmarshal(v, &rec); err != nil {
				return false, fmt.Errorf("store: decode idempotency %q: %w", k, err)
			}
			if rec.CreatedAt.Before(olderThan) {
				doomed = append(doomed, bytes.Clone(k))
			}
			return false, nil
		})
		if err != nil {
			return 0, false, err
		}
		for _, k := range doomed {
			if err := b.Delete(k); err != nil {
				return 0, false, err
			}
		}
		return len(doomed), more, nil
	})
}

// idemKey is the key of a user's idempotency record.
func idemKey(userID, k string) []byte {
	return key(userID, k)
}
