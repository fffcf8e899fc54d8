package postgres

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

const idempotencyColumns = `user_id, key, request_hash, status, command_id, body, location, created_at`

// idempotencySelect reads the record of a user's key, and the database's
// clock: a record's age is judged by the clock that stamped it (bug 309).
const idempotencySelect = `SELECT ` + idempotencyColumns + `, statement_timestamp() FROM idempotency WHERE user_id = $1 AND key = $2`

// scanIdempotency reads a row of idempotencySelect: the record, and now
// by the database's clock.
func scanIdempotency(row pgx.Row) (r companion.Idempotency, now time.Time, err error) {
	err = row.Scan(&r.UserID, &r.Key, &r.RequestHash, &r.Status, &r.CommandID, &r.Body, &r.Location, &r.CreatedAt, &now)
	if err != nil {
		return companion.Idempotency{}, time.Time{}, notFound(err)
	}
	r.CreatedAt = r.CreatedAt.UTC()
	return r, now.UTC(), nil
}

// lockIdempotency takes the advisory lock of the user's key and reads its
// record, and now by the database's clock; found is false when there is
// none (and now then zero).
func (s *Store) lockIdempotency(ctx context.Context, tx pgx.Tx, userID, key string) (rec companion.Idempotency, now time.Time, found bool, err error) {
	if err := lockIdempotencyKey(ctx, tx, userID, key); err != nil {
		return companion.Idempotency{}, time.Time{}, false, err
	}
	rec, now, err = scanIdempotency(tx.QueryRow(ctx, idempotencySelect, userID, key))
	if errors.Is(err, companion.ErrNotFound) {
		return companion.Idempotency{}, time.Time{}, false, nil
	}
	return rec, now, err == nil, err
}

// idempotencyUpsert stores a record over any record of its key. A record
// without a CreatedAt is stamped with the database's clock: every replica
// judges a claim's minute, and a record's day, by that one clock, whatever
// its own says (bug 309). A replica 90 s ahead read another's claim of a
// moment ago as one left by a request that died, and let a repeat do the
// work a second time.
const idempotencyUpsert = `INSERT INTO idempotency (` + idempotencyColumns + `)
	VALUES ($1, $2, $3, $4, $5, $6, $7, COALESCE($8, statement_timestamp()))
	ON CONFLICT (user_id, key) DO UPDATE SET request_hash = EXCLUDED.request_hash, status = EXCLUDED.status,
		command_id = EXCLUDED.command_id, body = EXCLUDED.body, location = EXCLUDED.location, created_at = EXCLUDED.created_at`

// idempotencyArgs are the parameters of idempotencyUpsert.
func idempotencyArgs(r companion.Idempotency) []any {
	if len(r.Body) == 0 {
		r.Body = nil // no body, as the bbolt engine reads one back
	}
	var created *time.Time // the database's clock
	if !r.CreatedAt.IsZero() {
		t := pgTime(r.CreatedAt)
		created = &t
	}
	return []any{r.UserID, r.Key, r.RequestHash, r.Status, r.CommandID, r.Body, r.Location, created}
}

// queueIdempotency queues in b the storing of r over any record of its
// key.
func queueIdempotency(b *pgx.Batch, r companion.Idempotency) {
	b.Queue(idempotencyUpsert, idempotencyArgs(r)...)
}

// IdempotencyClaimTTL is how long a claim (a record with Status 0: its
// request is being worked on) holds its key. A request's work takes far
// less; a claim older than this one's request died before it answered, and
// its key is free again.
const IdempotencyClaimTTL = time.Minute

// holds reports whether rec holds its key at now: an answer for
// IdempotencyTTL, a claim for IdempotencyClaimTTL. CreateCommand holds
// every record to IdempotencyTTL (live): its own records are never claims,
// and a key that another request used, even one that never answered, is a
// conflict for a command.
func holds(rec companion.Idempotency, now time.Time) bool {
	if rec.Status == 0 {
		// A claim made more than its TTL ahead of now was made before the
		// clock stepped back, by a request gone with it; read as new, it
		// held the key for as long as the step (docs/reliability.md,
		// bug 336).
		age := now.Sub(rec.CreatedAt)
		return age < IdempotencyClaimTTL && age > -IdempotencyClaimTTL
	}
	return live(rec.CreatedAt, now)
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

// Idempotency returns the record of the user's key, or ErrNotFound when
// there is none or it no longer holds the key (an answer older than
// IdempotencyTTL, a claim older than IdempotencyClaimTTL). A record with
// Status 0 is a claim: its request has no answer yet.
func (s *Store) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	if !validID(userID) || !validID(key) {
		return companion.Idempotency{}, companion.ErrNotFound
	}
	rec, now, err := scanIdempotency(s.pool.QueryRow(ctx, idempotencySelect, userID, key))
	if err != nil {
		return companion.Idempotency{}, err
	}
	if !holds(rec, now) {
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
// replaced. The key's advisory lock orders it with every other write of
// the key, across replicas.
func (s *Store) PutIdempotency(ctx context.Context, rec companion.Idempotency) error {
	if !validID(rec.UserID) || !validID(rec.Key) || strings.ContainsRune(rec.CommandID+rec.Location, 0) {
		return fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid)
	}
	return s.tx(ctx, func(tx pgx.Tx) error {
		r, err := s.claimable(ctx, tx, rec, companion.ErrExists)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, idempotencyUpsert, idempotencyArgs(r)...)
		return err
	})
}

// claimable takes the advisory lock of rec's key and returns rec, or
// refused when a record other than
// rec's claim holds the key (PutIdempotency's rule), judged by the
// database's clock. A zero CreatedAt stays zero: the upsert stamps it
// with that clock.
func (s *Store) claimable(ctx context.Context, tx pgx.Tx, rec companion.Idempotency, refused error) (companion.Idempotency, error) {
	old, now, found, err := s.lockIdempotency(ctx, tx, rec.UserID, rec.Key)
	if err != nil || !found {
		return rec, err
	}
	r := rec
	if r.CreatedAt.IsZero() {
		r.CreatedAt = now
	}
	if holds(old, now) && !settles(old, r, now) {
		return companion.Idempotency{}, refused
	}
	return rec, nil
}

// answerIn returns work, the transaction of a write, in one with the
// storing of rec, its request's answer, over the request's claim, so
// that the work and its recorded answer commit or fail together (bug
// 308). The key's lock is taken first, as CreateCommand takes it before
// the locks of its work; a key another request holds is ErrIdemConflict.
// work's created, when not nil, says whether it did the work: the answer
// is stored only then.
func (s *Store) answerIn(ctx context.Context, rec companion.Idempotency, work func(tx pgx.Tx) error, created *bool) func(tx pgx.Tx) error {
	return func(tx pgx.Tx) error {
		r, err := s.claimable(ctx, tx, rec, companion.ErrIdemConflict)
		if err != nil {
			return err
		}
		if err := work(tx); err != nil || (created != nil && !*created) {
			return err
		}
		_, err = tx.Exec(ctx, idempotencyUpsert, idempotencyArgs(r)...)
		return err
	}
}

// answered is work in one transaction with the storing of the answer ctx
// carries (companion.WithAnswer), if any (see answerIn); without one it
// is work.
func (s *Store) answered(ctx context.Context, work func(tx pgx.Tx) error) func(tx pgx.Tx) error {
	rec, ok, err := answerOf(ctx)
	switch {
	case err != nil:
		return func(pgx.Tx) error { return err }
	case !ok:
		return work
	}
	return s.answerIn(ctx, rec, work, nil)
}

// answerOf returns the answer ctx carries (companion.WithAnswer) for the
// write that does its request's work, if any.
func answerOf(ctx context.Context) (companion.Idempotency, bool, error) {
	rec, ok := companion.AnswerOf(ctx)
	if ok && (!validID(rec.UserID) || !validID(rec.Key) || strings.ContainsRune(rec.CommandID+rec.Location, 0)) {
		return companion.Idempotency{}, false, fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid)
	}
	return rec, ok, nil
}

// PurgeIdempotency deletes the records created before olderThan (by the
// database's clock, purgeCut) and returns how many it deleted, at most purgeBatch in each transaction (as
// the bbolt engine does, bug 40): a day of keyed requests is millions of
// rows, and one DELETE of them all held their row locks and one
// transaction's worth of WAL and dead tuples until it ended.
//
// The outer WHERE checks created_at again: a record that a new request
// put over an expired one (PutIdempotency, CreateCommand: an upsert of the
// same key) after the batch's snapshot was taken is then a young record,
// and READ COMMITTED evaluates the target row's own conditions again on
// its newest version, while the subquery's are not; without it the purge
// would delete the new request's record.
func (s *Store) PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	return s.purge(ctx, `DELETE FROM idempotency WHERE created_at < `+purgeCut+` AND (user_id, key) IN (
		SELECT user_id, key FROM idempotency WHERE created_at < `+purgeCut+` LIMIT $2)`, olderThan)
}
