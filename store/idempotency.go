package store

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// live reports whether rec still answers repeats at now.
func live(rec companion.Idempotency, now time.Time) bool {
	return now.Sub(rec.CreatedAt) < IdempotencyTTL
}

// Idempotency returns the record of the user's key, or ErrNotFound when
// there is none or it is older than IdempotencyTTL.
func (db *DB) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	if !validID(userID) || !validID(key) {
		return companion.Idempotency{}, companion.ErrNotFound
	}
	var rec companion.Idempotency
	if err := db.get(bucketIdempotency, idemKey(userID, key), &rec); err != nil {
		return companion.Idempotency{}, err
	}
	if !live(rec, db.now()) {
		return companion.Idempotency{}, companion.ErrNotFound
	}
	return rec, nil
}

// PutIdempotency stores the first answer to a request. CreatedAt is set to
// now when zero. It returns ErrExists when a live record of the same user
// and key exists; an expired one is replaced.
func (db *DB) PutIdempotency(ctx context.Context, rec companion.Idempotency) error {
	if !validID(rec.UserID) || !validID(rec.Key) {
		return fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid)
	}
	return db.batch(func(tx *bolt.Tx) error {
		now := db.now()
		b := tx.Bucket(bucketIdempotency)
		k := idemKey(rec.UserID, rec.Key)
		var old companion.Idempotency
		ok, err := getJSON(b, k, &old)
		if err != nil {
			return err
		}
		if ok && live(old, now) {
			return abort(companion.ErrExists)
		}
		r := rec
		if r.CreatedAt.IsZero() {
			r.CreatedAt = now
		}
		return putJSON(b, k, r)
	})
}

// PurgeIdempotency deletes the records created before olderThan and
// returns how many it deleted.
func (db *DB) PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	var n int
	err := db.update(func(tx *bolt.Tx) error {
		n = 0
		b := tx.Bucket(bucketIdempotency)
		var doomed [][]byte
		c := b.Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			var rec companion.Idempotency
			if err := fastjson.Unmarshal(v, &rec); err != nil {
				return fmt.Errorf("store: decode idempotency %q: %w", k, err)
			}
			if rec.CreatedAt.Before(olderThan) {
				doomed = append(doomed, bytes.Clone(k))
			}
		}
		// Deleting while a cursor walks the bucket skips keys; delete after.
		for _, k := range doomed {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		n = len(doomed)
		return nil
	})
	return n, err
}

// idemKey is the key of a user's idempotency record.
func idemKey(userID, k string) []byte {
	return key(userID, k)
}
