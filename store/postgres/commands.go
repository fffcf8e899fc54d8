package postgres

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// openStates and finalStates are the command states as SQL lists, written
// out so that the partial indexes of the schema match the queries.
const (
	openStates  = `('queued', 'sent', 'delivered', 'in_progress')`
	finalStates = `('succeeded', 'failed', 'expired', 'canceled')`
)

// notifyChannel is the channel of pg_notify that carries the id of each
// command whose state changed.
const notifyChannel = "companion_commands"

const commandColumns = `id::text, device_id, user_id, op, state, progress, error_code, error_message,
	result, payload, blob, created_at, updated_at, expires_at`

func scanCommand(row pgx.Row) (companion.Command, error) {
	return scanCommandAt(row, nil)
}

// scanCommandAt is scanCommand of a row that begins, when db is not nil,
// with a time before commandColumns, read into db.
func scanCommandAt(row pgx.Row, db *time.Time) (companion.Command, error) {
	var (
		c             companion.Command
		progress      *int32
		code, message *string
		result, pay   []byte
		err           error
	)
	if db != nil {
		err = row.Scan(db, &c.ID, &c.DeviceID, &c.UserID, &c.Op, &c.State, &progress, &code, &message,
			&result, &pay, &c.Blob, &c.CreatedAt, &c.UpdatedAt, &c.ExpiresAt)
	} else {
		err = row.Scan(&c.ID, &c.DeviceID, &c.UserID, &c.Op, &c.State, &progress, &code, &message,
			&result, &pay, &c.Blob, &c.CreatedAt, &c.UpdatedAt, &c.ExpiresAt)
	}
	if err != nil {
		return companion.Command{}, notFound(err)
	}
	if progress != nil {
		p := int(*progress)
		c.Progress = &p
	}
	if code != nil {
		c.Error = &companion.CommandError{Code: *code}
		if message != nil {
			c.Error.Message = *message
		}
	}
	if result != nil {
		c.Result = json.RawMessage(result)
	}
	if pay != nil {
		c.Payload = json.RawMessage(pay)
	}
	c.CreatedAt, c.UpdatedAt, c.ExpiresAt = c.CreatedAt.UTC(), c.UpdatedAt.UTC(), c.ExpiresAt.UTC()
	return c, nil
}

// commandArgs returns the columns of c that a write sets, from user_id on,
// in the order of commandColumns.
func commandArgs(c companion.Command) []any {
	var progress *int32
	if c.Progress != nil {
		p := int32(*c.Progress)
		progress = &p
	}
	var code, message *string
	if c.Error != nil {
		code, message = &c.Error.Code, &c.Error.Message
	}
	return []any{c.UserID, c.Op, c.State, progress, code, message, rawArg(c.Result), rawArg(c.Payload), c.Blob, c.CreatedAt, c.UpdatedAt, c.ExpiresAt}
}

// rawArg is a JSON value as a json parameter: NULL when empty.
func rawArg(v json.RawMessage) any {
	if len(v) == 0 {
		return nil
	}
	return []byte(v)
}

// compactCommand compacts the JSON values of c in new slices, so the
// caller's are not the store's; ErrInvalid when one is not JSON.
func compactCommand(c *companion.Command) error {
	for _, f := range []*json.RawMessage{&c.Payload, &c.Result} {
		if len(*f) == 0 {
			*f = nil
			continue
		}
		v, err := companion.CompactJSON(*f)
		if err != nil {
			return fmt.Errorf("%w: command JSON: %v", companion.ErrInvalid, err)
		}
		*f = v
	}
	if strings.ContainsRune(c.UserID+c.Op+c.Blob, 0) {
		return fmt.Errorf("%w: NUL byte in a command", companion.ErrInvalid)
	}
	return nil
}

// live reports whether an idempotency record made at created still
// answers repeats at now.
func live(created, now time.Time) bool {
	return now.Sub(created) < IdempotencyTTL
}

// lockIdempotencyKey takes the transaction's advisory lock of a user's
// idempotency key: of two transactions with the same key, across
// replicas, the second reads what the first stored.
func lockIdempotencyKey(ctx context.Context, tx pgx.Tx, userID, key string) error {
	h := fnv.New64a()
	h.Write([]byte(userID))
	h.Write([]byte{0})
	h.Write([]byte(key))
	_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(h.Sum64()))
	return err
}

// CreateCommand stores c as a new queued command for c.DeviceID and returns
// it with its id, state and times set. The id is a UUIDv7 made inside the
// transaction, under the device's lock, so the ids of a device rise in
// the order of their commits (see the package doc).
//
// With idem set, a live record of (idem.UserID, idem.Key) with the same
// RequestHash returns that record's command and replay = true, and one
// with another RequestHash (or of an answer that was not a command)
// returns ErrIdemConflict; otherwise idem is stored with CommandID set, in
// the same transaction as the command. ErrQueueFull means the device
// already has maxOpen non-final commands (maxOpen <= 0: no limit).
// ErrNotOwned means c.UserID is set and the device, one of the registry,
// is not bound to that user (lockOwnBinding).
//
// With c.Desired set, the new command's transaction merges it into the
// device's desired settings (each key replaces that key's value; a value
// that is not JSON is ErrInvalid, and nothing is stored), under the
// device's queue lock: the desired settings change in the order of the
// commands' ids. A replay and a refusal record nothing. The command
// returned has no Desired, as one read back.
func (s *Store) CreateCommand(ctx context.Context, c companion.Command, maxOpen int, idem *companion.Idempotency) (cmd companion.Command, replay bool, err error) {
	type result struct {
		cmd    companion.Command
		replay bool
		err    error
	}
	ch := make(chan result, 1)
	s.createCommand(ctx, c, maxOpen, idem, func(cmd companion.Command, replay bool, err error) { ch <- result{cmd, replay, err} })
	r, err := wait(ctx, ch)
	if err != nil {
		return companion.Command{}, false, err
	}
	return r.cmd, r.replay, r.err
}

// CreateCommandAsync is CreateCommand without the wait: done gets its
// results once the command is committed. The commands of one device are
// created in the order of the calls, so their ids rise in that order.
func (s *Store) CreateCommandAsync(c companion.Command, maxOpen int, idem *companion.Idempotency, done func(cmd companion.Command, replay bool, err error)) {
	s.createCommand(context.Background(), c, maxOpen, idem, done)
}

func (s *Store) createCommand(ctx context.Context, c companion.Command, maxOpen int, idem *companion.Idempotency, done func(companion.Command, bool, error)) {
	if done == nil {
		done = func(companion.Command, bool, error) {}
	}
	if !validID(c.DeviceID) {
		done(companion.Command{}, false, fmt.Errorf("%w: command needs a device id", companion.ErrInvalid))
		return
	}
	var rec companion.Idempotency
	if idem != nil {
		if !validID(idem.UserID) || !validID(idem.Key) || strings.ContainsRune(idem.Location, 0) {
			done(companion.Command{}, false, fmt.Errorf("%w: idempotency needs a user id and a key", companion.ErrInvalid))
			return
		}
		rec = *idem
		rec.RequestHash = slices.Clone(idem.RequestHash)
		rec.Body = slices.Clone(idem.Body)
	}
	want, err := c.TakeDesired() // nil: none to record
	if err != nil {
		done(companion.Command{}, false, err)
		return
	}
	if err := compactCommand(&c); err != nil {
		done(companion.Command{}, false, err)
		return
	}
	c.ExpiresAt = pgTime(c.ExpiresAt)
	var (
		cmd    companion.Command
		replay bool
	)
	ok := s.submit(job{ctx: ctx, key: deviceHash(c.DeviceID), body: func(ctx context.Context, tx pgx.Tx) error {
		cmd, replay = companion.Command{}, false
		if idem != nil {
			old, now, found, err := s.lockIdempotency(ctx, tx, rec.UserID, rec.Key)
			if err != nil {
				return err
			}
			if found && live(old.CreatedAt, now) {
				if !bytes.Equal(old.RequestHash, rec.RequestHash) || old.CommandID == "" {
					return companion.ErrIdemConflict
				}
				cmd, err = s.command(ctx, tx, old.CommandID, false)
				if errors.Is(err, companion.ErrNotFound) {
					return fmt.Errorf("postgres: idempotency record names missing command %s: %w", old.CommandID, companion.ErrNotFound)
				}
				replay = err == nil
				return err
			}
		}
		if c.UserID != "" {
			if err := lockOwnBinding(ctx, tx, c.DeviceID, c.UserID); err != nil {
				return err
			}
		}
		last, open, db, err := lockDeviceQueue(ctx, tx, c.DeviceID)
		if err != nil {
			return err
		}
		if maxOpen > 0 && open >= maxOpen {
			return companion.ErrQueueFull
		}
		// Stamped by the database's clock when the store's is far from it
		// (bug 313), the id's time with it, and the TTL the caller gave by
		// the store's clock runs on it too (bug 314).
		off := s.offsetAt(db)
		now, id, err := s.ids.next(func() time.Time { return s.now().Add(off) }, c.DeviceID, last)
		if err != nil {
			return err
		}
		if want != nil {
			// After the queue, as every write that takes both locks
			// (Unbind, UpdateCommandWithReport) takes the settings last.
			if err := mergeDesired(ctx, tx, c.DeviceID, want, now); err != nil {
				return err
			}
		}
		nc := c
		nc.ID = id.String()
		nc.State = companion.StateQueued
		nc.CreatedAt, nc.UpdatedAt = now, now
		nc.ExpiresAt = pgTime(c.ExpiresAt.Add(off))
		// The writes go in one round trip.
		var b pgx.Batch
		b.Queue(`INSERT INTO commands (id, device_id, user_id, op, state, progress, error_code, error_message,
				result, payload, blob, created_at, updated_at, expires_at)
				VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)`,
			append([]any{nc.ID, nc.DeviceID}, commandArgs(nc)...)...)
		b.Queue(`UPDATE device_queues SET last_id = $2, open_count = open_count + 1 WHERE device_id = $1`, nc.DeviceID, nc.ID)
		// The dispatcher (another replica, perhaps) publishes it.
		b.Queue(`SELECT pg_notify($1, $2)`, notifyChannel, nc.ID)
		if err := s.queueCommandEvent(&b, nc); err != nil {
			return err
		}
		if idem != nil {
			r := rec
			r.CommandID = nc.ID // a zero CreatedAt: the database's clock (bug 309)
			queueIdempotency(&b, r)
		}
		if err := sendBatch(ctx, tx, &b); err != nil {
			return err
		}
		cmd = nc
		return nil
	}, finish: func(err error) {
		if err != nil {
			done(companion.Command{}, false, err)
			return
		}
		// Hand the caller slices of their own.
		cmd.Payload, cmd.Result = bytes.Clone(cmd.Payload), bytes.Clone(cmd.Result)
		done(cmd, replay, nil)
	}})
	if !ok {
		done(companion.Command{}, false, ErrClosed)
	}
}

// lockDeviceQueue locks the device's row of device_queues, making it when
// there is none, and returns the last id the device was given (the zero
// UUID for none), how many of its commands are not final, and the
// database's clock (for stampAt).
// lockOwnBinding returns companion.ErrNotOwned unless the device is bound
// to the user, or is no device of the registry at all (a test's). The API
// checked it before it read the request's body; checked again here, under
// the binding's share lock until the command is stored, an unbind cannot
// slip in between and leave the command to the device's next owner
// (CONTRACT §9): it deletes the binding first, and so waits for this
// transaction, and then ends the command with the user's others. Taken
// before the device's queue, as Unbind takes the binding before it.
func lockOwnBinding(ctx context.Context, tx pgx.Tx, deviceID, userID string) error {
	var owner string
	err := tx.QueryRow(ctx, `SELECT user_id FROM bindings WHERE device_id = $1 FOR SHARE`, deviceID).Scan(&owner)
	switch {
	case err == nil && owner == userID:
		return nil
	case err == nil:
		return companion.ErrNotOwned
	case !errors.Is(err, pgx.ErrNoRows):
		return err
	}
	var registered bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM devices WHERE id = $1)`, deviceID).Scan(&registered); err != nil {
		return err
	}
	if registered {
		return companion.ErrNotOwned
	}
	return nil
}

func lockDeviceQueue(ctx context.Context, tx pgx.Tx, deviceID string) (uuid.UUID, int, time.Time, error) {
	for {
		var (
			last *string
			open int
			db   time.Time
		)
		err := tx.QueryRow(ctx, `SELECT last_id::text, open_count, statement_timestamp() FROM device_queues WHERE device_id = $1 FOR UPDATE`, deviceID).Scan(&last, &open, &db)
		if err == nil {
			if last == nil {
				return uuid.UUID{}, open, db, nil
			}
			u, err := uuid.Parse(*last)
			return u, open, db, err
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return uuid.UUID{}, 0, time.Time{}, err
		}
		err = tx.QueryRow(ctx, `INSERT INTO device_queues (device_id, open_count) VALUES ($1, 0) ON CONFLICT (device_id) DO NOTHING
			RETURNING statement_timestamp()`, deviceID).Scan(&db)
		if err == nil {
			return uuid.UUID{}, 0, db, nil // ours, locked by the insert
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return uuid.UUID{}, 0, time.Time{}, err
		}
		// Another transaction made it meanwhile: lock that one.
	}
}

// Command returns the command with the id, or ErrNotFound.
func (s *Store) Command(ctx context.Context, id string) (companion.Command, error) {
	if !validCommandID(id) {
		return companion.Command{}, companion.ErrNotFound
	}
	return scanCommand(s.pool.QueryRow(ctx, `SELECT `+commandColumns+` FROM commands WHERE id = $1`, id))
}

// command reads a command in tx, FOR UPDATE when lock is set.
func (s *Store) command(ctx context.Context, tx pgx.Tx, id string, lock bool) (companion.Command, error) {
	if !validCommandID(id) {
		return companion.Command{}, companion.ErrNotFound
	}
	q := `SELECT ` + commandColumns + ` FROM commands WHERE id = $1`
	if lock {
		q += ` FOR UPDATE`
	}
	return scanCommand(tx.QueryRow(ctx, q, id))
}

// UpdateCommand changes a command through fn and stores it with UpdatedAt
// set to now, keeping the device's count of open commands true. fn gets
// the stored command, locked, to change; its ID, DeviceID and CreatedAt
// are kept whatever fn does. When fn returns an error nothing is written
// and UpdateCommand returns it. A command already final is not passed to
// fn: UpdateCommand returns it with ErrFinal. A change of state is
// announced on the channel companion_commands (see ListenCommands).
//
// fn runs inside the transaction and may run more than once: it must only
// change the command it is given, and must not call the store.
func (s *Store) UpdateCommand(ctx context.Context, id string, fn func(*companion.Command) error) (companion.Command, error) {
	return s.awaitCommand(ctx, func(done func(companion.Command, error)) {
		s.updateCommandAsync(ctx, id, fn, companion.DeviceReport{}, done)
	})
}

// awaitCommand runs a lane write of a command and waits for its outcome,
// or for ctx.
func (s *Store) awaitCommand(ctx context.Context, start func(done func(companion.Command, error))) (companion.Command, error) {
	type result struct {
		cmd companion.Command
		err error
	}
	ch := make(chan result, 1)
	start(func(c companion.Command, err error) { ch <- result{c, err} })
	r, err := wait(ctx, ch)
	if err != nil {
		return companion.Command{}, err
	}
	return r.cmd, r.err
}

// UpdateCommandAsync is UpdateCommand without the wait: done (if not nil)
// gets its results once the change is committed, after the writes of the
// command's device made before.
func (s *Store) UpdateCommandAsync(id string, fn func(*companion.Command) error, done func(companion.Command, error)) {
	s.updateCommandAsync(context.Background(), id, fn, companion.DeviceReport{}, done)
}

// UpdateCommandWithReportAsync is UpdateCommandAsync that also stores the
// device's state that came with the change, in the same transaction and
// only when fn changed the command: whoever reads the command's new state
// reads that state of the device too (CONTRACT §8). The report is about the
// command's device, whatever DeviceID its Status names; a newer report
// stored already still wins, as with PutStatus and PutReportedSettings.
func (s *Store) UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	s.updateCommandAsync(context.Background(), id, fn, report, done)
}

func (s *Store) updateCommandAsync(ctx context.Context, id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error)) {
	if done == nil {
		done = func(companion.Command, error) {}
	}
	if !validCommandID(id) {
		done(companion.Command{}, companion.ErrNotFound)
		return
	}
	if st := report.Status; st != nil && st.BridgeID != "" && !validID(st.BridgeID) {
		done(companion.Command{}, fmt.Errorf("%w: status with bridge id %q", companion.ErrInvalid, st.BridgeID))
		return
	}
	if report.BridgeID != "" && !validID(report.BridgeID) {
		done(companion.Command{}, fmt.Errorf("%w: report of bridge id %q", companion.ErrInvalid, report.BridgeID))
		return
	}
	var settings *companion.ReportedSettings
	if report.Settings != nil {
		// As PutReportedSettings takes them: checked and compacted.
		rs, err := companion.NewReportedSettings(report.Settings.Reported, report.Settings.Schema, report.Settings.At, report.Settings.Seq)
		if err != nil {
			done(companion.Command{}, err)
			return
		}
		settings = &rs
	}
	var (
		out   companion.Command
		final bool
	)
	ok := s.submit(job{ctx: ctx, key: commandKey(id), body: func(ctx context.Context, tx pgx.Tx) error {
		var err error
		if out, final, err = s.updateCommand(ctx, tx, id, fn); err != nil || final {
			return err
		}
		if report.Status != nil {
			st := *report.Status
			st.DeviceID = out.DeviceID
			if _, err := s.putStatus(ctx, tx, st); err != nil {
				return err
			}
		}
		if settings != nil {
			applied, err := s.putReportedSettings(ctx, tx, out.DeviceID, report.BridgeID, *settings)
			if err != nil {
				return err
			}
			if !applied {
				return withdrawDesired(ctx, tx, companion.SupersededChange(out), out.UpdatedAt)
			}
		}
		// Bug 236: a settings change that ended without succeeding is no
		// longer desired, in the write that ends it; the settings row
		// last, after the status, as every write takes them.
		return withdrawDesired(ctx, tx, out, out.UpdatedAt)
	}, finish: func(err error) {
		switch {
		case err != nil:
			done(companion.Command{}, err)
		case final:
			done(out, companion.ErrFinal)
		default:
			done(out, nil)
		}
	}})
	if !ok {
		done(companion.Command{}, ErrClosed)
	}
}

// updateCommand is UpdateCommand inside a transaction: it returns the
// command as stored, and final true (and no change) when it was final
// already.
func (s *Store) updateCommand(ctx context.Context, tx pgx.Tx, id string, fn func(*companion.Command) error) (companion.Command, bool, error) {
	var db time.Time // the database's clock, for stampAt
	nc, err := scanCommandAt(tx.QueryRow(ctx, `SELECT statement_timestamp(), `+commandColumns+` FROM commands WHERE id = $1 FOR UPDATE`, id), &db)
	if err != nil {
		return companion.Command{}, false, err
	}
	if companion.IsFinal(nc.State) {
		return nc, true, nil
	}
	old := nc
	old.Payload, old.Result = bytes.Clone(nc.Payload), bytes.Clone(nc.Result)
	if err := fn(&nc); err != nil {
		return companion.Command{}, false, err
	}
	nc.ID, nc.DeviceID, nc.CreatedAt = old.ID, old.DeviceID, old.CreatedAt
	nc.ExpiresAt = pgTime(nc.ExpiresAt)
	nc.UpdatedAt = s.stampAt(db) // bug 313
	if err := compactCommand(&nc); err != nil {
		return companion.Command{}, false, err
	}
	// The writes go in one round trip.
	var b pgx.Batch
	b.Queue(`UPDATE commands SET user_id = $2, op = $3, state = $4, progress = $5, error_code = $6, error_message = $7,
		result = $8, payload = $9, blob = $10, created_at = $11, updated_at = $12, expires_at = $13 WHERE id = $1`,
		append([]any{nc.ID}, commandArgs(nc)...)...)
	if companion.IsFinal(nc.State) {
		b.Queue(`UPDATE device_queues SET open_count = open_count - 1 WHERE device_id = $1 AND open_count > 0`, nc.DeviceID)
	}
	if nc.State != old.State {
		b.Queue(`SELECT pg_notify($1, $2)`, notifyChannel, nc.ID)
	}
	if companion.CommandEventDue(old, nc) {
		if err := s.queueCommandEvent(&b, nc); err != nil {
			return companion.Command{}, false, err
		}
	}
	if err := sendBatch(ctx, tx, &b); err != nil {
		return companion.Command{}, false, err
	}
	return nc, false, nil
}

// sendBatch sends the statements of b in one round trip and returns the
// first error.
func sendBatch(ctx context.Context, tx pgx.Tx, b *pgx.Batch) error {
	br := tx.SendBatch(ctx, b)
	for range b.Len() {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return err
		}
	}
	return br.Close()
}

// ListCommands returns the commands q selects, newest first. It filters
// in the query, so a page holds q.Limit commands whenever that many are
// left, and more is true exactly when commands that q selects follow the
// last one returned. A Before that is not a command id is
// ErrInvalidCursor.
func (s *Store) ListCommands(ctx context.Context, q companion.CommandQuery) (page []companion.Command, more bool, err error) {
	if q.Before != "" && !validCommandID(q.Before) {
		return nil, false, companion.ErrInvalidCursor
	}
	out := make([]companion.Command, 0, pageCap(q.Limit))
	if !validID(q.DeviceID) || (q.UserID != "" && !validID(q.UserID)) || strings.ContainsRune(q.State, 0) {
		return out, false, nil
	}
	where := []string{`device_id = $1`}
	args := []any{q.DeviceID}
	add := func(cond string, arg any) {
		args = append(args, arg)
		where = append(where, strings.ReplaceAll(cond, "$?", "$"+strconv.Itoa(len(args))))
	}
	if q.UserID != "" {
		add(`user_id = $?`, q.UserID)
	}
	if q.State != "" {
		add(`state = $?`, q.State)
	}
	if q.Before != "" {
		add(`id < $?`, q.Before)
	}
	args = append(args, pageLimit(q.Limit))
	rows, err := s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE `+strings.Join(where, " AND ")+
		` ORDER BY id DESC LIMIT $`+strconv.Itoa(len(args)), args...)
	if err != nil {
		return nil, false, err
	}
	out, err = appendCommands(out, rows)
	if err != nil {
		return nil, false, err
	}
	out, more = trimPage(out, q.Limit)
	return out, more, nil
}

// appendCommands appends the commands of rows to out and closes rows.
func appendCommands(out []companion.Command, rows pgx.Rows) ([]companion.Command, error) {
	defer rows.Close()
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// OpenCommands returns the non-final commands whose state is one of states
// (every non-final command when none is given), oldest first.
func (s *Store) OpenCommands(ctx context.Context, states ...string) ([]companion.Command, error) {
	out := []companion.Command{}
	var want []string
	for _, st := range states {
		if companion.ValidState(st) && !companion.IsFinal(st) {
			want = append(want, st)
		}
	}
	var (
		rows pgx.Rows
		err  error
	)
	switch {
	case len(states) == 0:
		rows, err = s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE state IN `+openStates+` ORDER BY id`)
	case len(want) == 0:
		return out, nil
	case len(want) == 1 && want[0] == companion.StateQueued:
		rows, err = s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE state = 'queued' ORDER BY id`)
	default:
		rows, err = s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE state IN `+openStates+` AND state = ANY($1) ORDER BY id`, want)
	}
	if err != nil {
		return nil, err
	}
	return appendCommands(out, rows)
}

// QueuedCommandsWith returns every queued command but those of the
// devices in skip, and the other non-final commands of deviceIDs, oldest
// first, from one query: the queued ones through their index, the
// devices' through theirs, and no other open command.
func (s *Store) QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error) {
	if deviceIDs == nil {
		deviceIDs = []string{}
	}
	if skip == nil {
		skip = []string{}
	}
	rows, err := s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE state = 'queued' AND device_id <> ALL($2) AND device_id <> ALL($1)
		UNION ALL SELECT `+commandColumns+` FROM commands WHERE device_id = ANY($1) AND state IN ('queued', 'sent', 'delivered', 'in_progress')
		ORDER BY id`, deviceIDs, skip)
	if err != nil {
		return nil, err
	}
	return appendCommands([]companion.Command{}, rows)
}

// SentCommandsOnline returns the sent commands of the devices whose
// stored status reads online, oldest first.
func (s *Store) SentCommandsOnline(ctx context.Context) ([]companion.Command, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+commandColumns+` FROM commands
		WHERE state = 'sent' AND device_id IN (SELECT device_id FROM statuses WHERE online) ORDER BY id`)
	if err != nil {
		return nil, err
	}
	return appendCommands([]companion.Command{}, rows)
}

// ExpiredCommands returns the commands still queued or sent whose
// ExpiresAt is before now, soonest first. now is by the store's clock
// plus its ClockOffset (the broker's), which the same round trip sees
// anew; a clock that stepped since it was last seen is judged by the
// database's (expiryCut), as a purge's (bug 314).
func (s *Store) ExpiredCommands(ctx context.Context, now time.Time) ([]companion.Command, error) {
	var b pgx.Batch
	b.Queue(`SELECT statement_timestamp()`)
	b.Queue(`SELECT `+commandColumns+` FROM commands
		WHERE state IN ('queued', 'sent') AND expires_at < `+expiryCut+` ORDER BY expires_at, id`, now, s.clock())
	br := s.pool.SendBatch(ctx, &b)
	defer br.Close()
	var db time.Time
	if err := br.QueryRow().Scan(&db); err != nil {
		return nil, err
	}
	s.offsetAt(db)
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	out, err := appendCommands([]companion.Command{}, rows)
	if err != nil {
		return nil, err
	}
	return out, br.Close()
}

// CountOpen returns how many non-final commands the device has.
func (s *Store) CountOpen(ctx context.Context, deviceID string) (int, error) {
	if !validID(deviceID) {
		return 0, nil
	}
	var n int
	err := s.pool.QueryRow(ctx, `SELECT open_count FROM device_queues WHERE device_id = $1`, deviceID).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	return n, err
}

// CountAllOpen returns how many non-final commands all devices have, from
// the devices' counts.
func (s *Store) CountAllOpen(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `SELECT coalesce(sum(open_count), 0)::int FROM device_queues`).Scan(&n)
	return n, err
}

// purgeBatch bounds the deletions of one transaction of the Purge methods
// (Store.purgeBatch, set by tests, overrides it).
const purgeBatch = 1000

// purgeCut is the cutoff of a purge statement given olderThan as $1 and
// the store's clock (clock: with its ClockOffset, as the dispatcher's
// since bug 314) as $3: the time as old, by the database's clock, as
// olderThan is by the store's (its clock within a minute of the
// database's: olderThan itself). Every replica judges an age by that one
// clock, as it judges an Idempotency-Key's (bug 309): the dispatcher's
// hourly purge on a replica 2 h ahead deleted the records of keys used
// 22 h before, whose repeats then ran again, and the events a stream
// resumes from within EventRetention; one behind kept them past it
// (docs/reliability.md, bug 310).
const purgeCut = `(CASE WHEN $3::timestamptz BETWEEN statement_timestamp() - interval '1 minute' AND statement_timestamp() + interval '1 minute'
	THEN $1::timestamptz ELSE $1::timestamptz + (statement_timestamp() - $3::timestamptz) END)`

// expiryCut is purgeCut of now as $1 and the store's clock as $2.
var expiryCut = strings.ReplaceAll(purgeCut, "$3", "$2")

// purge runs del, a DELETE of at most $2 rows older than $1 (purgeCut, $3
// the store's clock), each run a transaction of its own, until it deletes
// fewer than a batch, and returns how many rows went.
func (s *Store) purge(ctx context.Context, del string, olderThan time.Time) (int, error) {
	batch := s.purgeBatch
	if batch <= 0 {
		batch = purgeBatch
	}
	total := 0
	for {
		tag, err := s.pool.Exec(ctx, del, olderThan, batch, s.clock())
		if err != nil {
			return total, err
		}
		n := int(tag.RowsAffected())
		total += n
		if n < batch {
			return total, nil
		}
		if s.afterPurgeBatch != nil {
			s.afterPurgeBatch()
		}
	}
}

// purgeCounted is purge with a statement that answers how many rows it
// deleted, rather than deleting them itself.
func (s *Store) purgeCounted(ctx context.Context, del string, olderThan time.Time) (int, error) {
	batch := s.purgeBatch
	if batch <= 0 {
		batch = purgeBatch
	}
	total := 0
	for {
		var n int
		if err := s.pool.QueryRow(ctx, del, olderThan, batch, s.clock()).Scan(&n); err != nil {
			return total, err
		}
		total += n
		if n < batch {
			return total, nil
		}
		if s.afterPurgeBatch != nil {
			s.afterPurgeBatch()
		}
	}
}

// PurgeCommands deletes final commands that last changed before olderThan
// and returns how many went, deleting at most purgeBatch in each
// transaction. Unfinished commands are never deleted.
func (s *Store) PurgeCommands(ctx context.Context, olderThan time.Time) (int, error) {
	return s.purge(ctx, `DELETE FROM commands WHERE id IN (
		SELECT id FROM commands WHERE state IN `+finalStates+` AND updated_at < `+purgeCut+` AND created_at < `+purgeCut+` LIMIT $2)`, olderThan)
}
