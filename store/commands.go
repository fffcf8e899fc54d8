package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/internal/groupcommit"
)

// IdempotencyTTL is how long an idempotency record answers repeats.
const IdempotencyTTL = 24 * time.Hour

// CreateCommand stores c as a new queued command for c.DeviceID and returns
// it with its id, state and times set. The id is a UUIDv7 assigned inside
// the write transaction, above every id stored (commandID), so the order of
// ids is the order of commits, across restarts too.
//
// With idem set, a live record of (idem.UserID, idem.Key) with the same
// RequestHash returns that record's command and replay = true, and one
// with another RequestHash returns ErrIdemConflict; otherwise idem is
// stored with CommandID set, in the same transaction as the command.
// ErrQueueFull means the device already has maxOpen non-final commands
// (maxOpen <= 0: no limit). ErrNotOwned means c.UserID is set and the
// device, one of the registry, is not bound to that user.
//
// With c.Desired set, the new command's transaction merges it into the
// device's desired settings (each key replaces that key's value; a value
// that is not JSON is ErrInvalid, and nothing is stored). A replay and a
// refusal record nothing: the desired settings change with the commands
// that carry them, in the order of their ids. The command returned has no
// Desired, as one read back.
//
// Writers are grouped (see batch): the command is on disk when
// CreateCommand returns nil.
func (db *DB) CreateCommand(ctx context.Context, c companion.Command, maxOpen int, idem *companion.Idempotency) (cmd companion.Command, replay bool, err error) {
	type result struct {
		cmd    companion.Command
		replay bool
		err    error
	}
	ch := make(chan result, 1)
	db.CreateCommandAsync(c, maxOpen, idem, func(cmd companion.Command, replay bool, err error) { ch <- result{cmd, replay, err} })
	r := <-ch
	return r.cmd, r.replay, r.err
}

// CreateCommandAsync is CreateCommand without the wait: done gets its
// results once the command is on disk. The done callbacks of the store's
// writes run one at a time in commit order, so the commands of one device
// reach their callbacks in the order of their ids. done must be quick and
// must not wait for another write of the store.
func (db *DB) CreateCommandAsync(c companion.Command, maxOpen int, idem *companion.Idempotency, done func(cmd companion.Command, replay bool, err error)) {
	if !validID(c.DeviceID) {
		done(companion.Command{}, false, fmt.Errorf("%w: command needs a device id", companion.ErrInvalid))
		return
	}
	var rec companion.Idempotency
	if idem != nil {
		if !validID(idem.UserID) || !validID(idem.Key) {
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
	c.Payload = cloneRaw(c.Payload)
	c.Result = cloneRaw(c.Result)
	var (
		cmd    companion.Command
		replay bool
	)
	db.batchAsync(func(tx *bolt.Tx) error {
		cmd, replay = companion.Command{}, false
		now := db.now()
		idemB := tx.Bucket(bucketIdempotency)
		if idem != nil {
			var old companion.Idempotency
			ok, err := getJSON(idemB, idemKey(rec.UserID, rec.Key), &old)
			if err != nil {
				return err
			}
			if ok && live(old, now) {
				if !bytes.Equal(old.RequestHash, rec.RequestHash) || old.CommandID == "" {
					return abort(companion.ErrIdemConflict)
				}
				found, err := getJSON(tx.Bucket(bucketCommands), []byte(old.CommandID), &cmd)
				if err != nil {
					db.logUndecodable("command", []byte(old.CommandID), err)
					return abort(fmt.Errorf("store: command %s: %w", old.CommandID, companion.ErrUnreadable))
				}
				if !found {
					return abort(fmt.Errorf("store: idempotency record names missing command %s: %w", old.CommandID, companion.ErrNotFound))
				}
				replay = true
				return nil
			}
		}
		// The device is the user's (or no device of the registry: a
		// test's). The API checked it before it read the body; checked
		// again in the write that stores the command, an unbind cannot
		// slip in between and leave the command to the device's next
		// owner (CONTRACT §9).
		if c.UserID != "" && tx.Bucket(bucketDevices).Get([]byte(c.DeviceID)) != nil {
			ok, err := db.boundTo(tx, c.DeviceID, c.UserID)
			if err != nil {
				return err
			}
			if !ok {
				return abort(companion.ErrNotOwned)
			}
		}
		full, err := addOpen(tx.Bucket(bucketOpenCount), []byte(c.DeviceID), 1, maxOpen)
		if err != nil {
			return err
		}
		if full {
			return abort(companion.ErrQueueFull)
		}
		id, err := db.commandID(tx)
		if err != nil {
			return err
		}
		nc := c
		nc.ID = id
		nc.State = companion.StateQueued
		nc.CreatedAt, nc.UpdatedAt = now, now
		if err := putJSON(tx.Bucket(bucketCommands), []byte(nc.ID), nc); err != nil {
			return err
		}
		if err := db.stageDeviceCmd(tx, nc); err != nil {
			return err
		}
		if err := tx.Bucket(bucketOpen).Put([]byte(nc.ID), []byte(nc.DeviceID)); err != nil {
			return err
		}
		if err := indexCommand(tx, companion.Command{}, nc); err != nil {
			return err
		}
		if err := db.appendEvent(tx, companion.CommandChanged(nc)); err != nil {
			return err
		}
		if err := indexBlob(tx, companion.Command{}, nc); err != nil {
			return err
		}
		// For the device's owner only: checked above, for the command.
		if want != nil {
			if err := db.mergeDesired(tx, nc.DeviceID, want); err != nil {
				return err
			}
		}
		if idem != nil {
			r := rec
			r.CommandID = nc.ID
			if r.CreatedAt.IsZero() {
				r.CreatedAt = now
			}
			if err := putJSON(idemB, idemKey(r.UserID, r.Key), r); err != nil {
				return err
			}
		}
		cmd = nc
		return nil
	}, func(err error) {
		if err != nil {
			done(companion.Command{}, false, err)
			return
		}
		// cmd may share Payload and Result with the copies made above;
		// hand the caller slices of its own.
		cmd.Payload = cloneRaw(cmd.Payload)
		cmd.Result = cloneRaw(cmd.Result)
		done(cmd, replay, nil)
	})
}

// boundTo says whether deviceID is bound to userID in tx.
func (db *DB) boundTo(tx *bolt.Tx, deviceID, userID string) (bool, error) {
	b, ok, err := db.getBinding(tx, deviceID)
	return ok && b.UserID == userID, err
}

// commandID returns the id of a new command in tx: a UUIDv7 of the clock
// (db.uuidV7), or the next one above the highest id stored when the clock
// is behind the one that made that id, so that ids rise in commit order
// across restarts too. google/uuid's V7 rises within the process only: a
// server started again after its clock went back (set by hand, or stepped
// back by NTP while it was down) made ids below those of the commands it
// had accepted before, and the outbox, the bridge and GET …/commands,
// which order a device's commands by id, put the new ones first.
func (db *DB) commandID(tx *bolt.Tx) (string, error) {
	id, err := db.uuidV7()
	if err != nil {
		return "", err
	}
	last, _ := tx.Bucket(bucketCommands).Cursor().Last()
	if last == nil || id.String() > string(last) {
		return id.String(), nil
	}
	prev, err := uuid.Parse(string(last))
	if err != nil {
		return "", fmt.Errorf("store: highest command id %q: %w", last, err)
	}
	// The 48-bit milliseconds and 12-bit rand_a of prev, plus one, with
	// the version and id's random rand_b (and variant).
	stamp := binary.BigEndian.Uint64(prev[:8]) // ms (48 bits), version (4), rand_a (12)
	next := ((stamp >> 16 << 12) | (stamp & 0xfff)) + 1
	binary.BigEndian.PutUint64(id[:8], (next>>12<<16)|0x7000|(next&0xfff))
	return id.String(), nil
}

// foldDeviceCmdsAt is how many entries device_cmds_new holds before they
// are folded into device_cmds. A new command's entry goes to the end of
// device_cmds_new, one page for a whole commit, where an entry in
// device_cmds dirties a page of its device's, one per device a commit
// writes to; folded together, a device's entries share that page. A list
// of a device's commands reads all of device_cmds_new, about 50 KiB at
// most (docs/performance.md, "The fifth pass").
const foldDeviceCmdsAt = 1024

// stageDeviceCmd adds the new command's entry to device_cmds_new, and
// folds that bucket into device_cmds, in the same transaction, once it has
// taken foldAt entries since it was last emptied. Its sequence counts
// them: it lives and rolls back with the bucket, so the count needs
// neither memory nor a walk at Open. (Purged entries stay counted until
// the fold; that only brings the fold forward.)
func (db *DB) stageDeviceCmd(tx *bolt.Tx, c companion.Command) error {
	staged := tx.Bucket(bucketDeviceCmdsNew)
	if err := staged.Put([]byte(c.ID), []byte(c.DeviceID)); err != nil {
		return err
	}
	n, err := staged.NextSequence()
	if err != nil || n < uint64(db.foldAt) {
		return err
	}
	return foldDeviceCmds(tx)
}

// migrateTo7 makes device_cmds_new, where new commands' device index
// entries wait for stageDeviceCmd to fold them.
func migrateTo7(tx *bolt.Tx) error {
	_, err := tx.CreateBucketIfNotExists(bucketDeviceCmdsNew)
	return err
}

// foldDeviceCmds moves every entry of device_cmds_new into device_cmds and
// empties it, its sequence too.
func foldDeviceCmds(tx *bolt.Tx) error {
	hist := tx.Bucket(bucketDeviceCmds)
	err := tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
		return hist.Put(key(string(dev), string(id)), nil)
	})
	if err != nil {
		return err
	}
	// Dropping the bucket frees its pages at once, rather than one
	// deletion at a time.
	if err := tx.DeleteBucket(bucketDeviceCmdsNew); err != nil {
		return err
	}
	staged, err := tx.CreateBucket(bucketDeviceCmdsNew)
	if err != nil {
		return err
	}
	staged.FillPercent = appendFill
	return nil
}

// Command returns the command with the id, or ErrNotFound. A record that
// does not decode is ErrUnreadable, with a Command of its id and, when the
// store knows it without a walk, its device (else ""): the caller can tell
// whose it is. Such a record is taken out of its device's unfinished
// commands (metUndecodable).
func (db *DB) Command(ctx context.Context, id string) (companion.Command, error) {
	if id == "" {
		return companion.Command{}, companion.ErrNotFound
	}
	var c companion.Command
	err := db.bolt.View(func(tx *bolt.Tx) error {
		ok, err := getJSON(tx.Bucket(bucketCommands), []byte(id), &c)
		switch {
		case err != nil:
			db.metUndecodable(tx, []byte(id), err)
			c = companion.Command{ID: id, DeviceID: deviceOf(tx, []byte(id))}
			return fmt.Errorf("store: command %s: %w", id, companion.ErrUnreadable)
		case !ok:
			return companion.ErrNotFound
		}
		return nil
	})
	if err != nil && !errors.Is(err, companion.ErrUnreadable) {
		return companion.Command{}, err
	}
	return c, err
}

// deviceOf returns the device of the command id from the indexes that
// are keyed by command (the open commands, the newest commands' device
// index), or "" when neither holds it: a final command whose entry was
// folded into device_cmds, keyed by device.
func deviceOf(tx *bolt.Tx, id []byte) string {
	if dev := tx.Bucket(bucketOpen).Get(id); dev != nil {
		return string(dev)
	}
	return string(tx.Bucket(bucketDeviceCmdsNew).Get(id))
}

// UpdateCommand changes a command through fn and stores it with UpdatedAt
// set to now, keeping the indexes of open commands true. fn gets a copy to
// change; its ID, DeviceID and CreatedAt are kept whatever fn does. When fn
// returns an error nothing is written and UpdateCommand returns it. A
// command already final is not passed to fn: UpdateCommand returns it with
// ErrFinal.
//
// fn runs inside the write transaction (grouped with others, see batch)
// and may run more than once: it must only change the command it is given,
// and must not call the store.
func (db *DB) UpdateCommand(ctx context.Context, id string, fn func(*companion.Command) error) (companion.Command, error) {
	type result struct {
		cmd companion.Command
		err error
	}
	ch := make(chan result, 1)
	db.UpdateCommandAsync(id, fn, func(c companion.Command, err error) { ch <- result{c, err} })
	r := <-ch
	return r.cmd, r.err
}

// UpdateCommandAsync is UpdateCommand without the wait: done (if not nil)
// gets its results once the change is on disk. The done callbacks of the
// store's writes run one at a time in the order the writes were queued;
// done must be quick and must not wait for another write of the store.
func (db *DB) UpdateCommandAsync(id string, fn func(*companion.Command) error, done func(companion.Command, error)) {
	if done == nil {
		done = func(companion.Command, error) {}
	}
	if id == "" {
		done(companion.Command{}, companion.ErrNotFound)
		return
	}
	var (
		out   companion.Command
		final bool
	)
	db.batchAsync(func(tx *bolt.Tx) error {
		var err error
		if out, final, err = db.updateCommand(tx, id, fn); err != nil || final {
			return err
		}
		return db.withdrawDesired(tx, out)
	}, func(err error) {
		switch {
		case err != nil:
			done(companion.Command{}, err)
		case final:
			done(out, companion.ErrFinal)
		default:
			done(out, nil)
		}
	})
}

// updateCommand is UpdateCommand inside a write transaction: it returns
// the command as stored, and final true (and no change) when it was final
// already. fn's error is returned wrapped by abort.
func (db *DB) updateCommand(tx *bolt.Tx, id string, fn func(*companion.Command) error) (companion.Command, bool, error) {
	cmds := tx.Bucket(bucketCommands)
	var nc companion.Command
	ok, err := getJSON(cmds, []byte(id), &nc)
	if err != nil {
		// Nothing can be written in its place: it is taken out of the
		// unfinished commands here, and the caller told.
		db.logUndecodable("command", []byte(id), err)
		if err := db.closeUndecodable(tx, []byte(id)); err != nil {
			return companion.Command{}, false, err
		}
		return companion.Command{}, false, abort(fmt.Errorf("store: command %s: %w", id, companion.ErrUnreadable))
	}
	if !ok {
		return companion.Command{}, false, abort(companion.ErrNotFound)
	}
	if companion.IsFinal(nc.State) {
		return nc, true, nil
	}
	old := nc
	if err := fn(&nc); err != nil {
		return companion.Command{}, false, abort(err)
	}
	nc.ID, nc.DeviceID, nc.CreatedAt = old.ID, old.DeviceID, old.CreatedAt
	if err := indexCommand(tx, old, nc); err != nil {
		return companion.Command{}, false, err
	}
	if err := indexBlob(tx, old, nc); err != nil {
		return companion.Command{}, false, err
	}
	nc.UpdatedAt = db.now()
	if err := putJSON(cmds, []byte(id), nc); err != nil {
		return companion.Command{}, false, err
	}
	if companion.CommandEventDue(old, nc) {
		if err := db.appendEvent(tx, companion.CommandChanged(nc)); err != nil {
			return companion.Command{}, false, err
		}
	}
	if companion.IsFinal(nc.State) {
		if err := tx.Bucket(bucketOpen).Delete([]byte(id)); err != nil {
			return companion.Command{}, false, err
		}
		if _, err := addOpen(tx.Bucket(bucketOpenCount), []byte(nc.DeviceID), -1, 0); err != nil {
			return companion.Command{}, false, err
		}
	}
	return nc, false, nil
}

// ListCommands returns the commands q selects, newest first. It filters
// while it walks the device's commands, so a page holds q.Limit commands
// whenever that many are left, and more is true exactly when commands that
// q selects follow the last one returned. A Before that is not a command
// id is ErrInvalidCursor.
func (db *DB) ListCommands(ctx context.Context, q companion.CommandQuery) (page []companion.Command, more bool, err error) {
	if q.Before != "" && !validCommandID(q.Before) {
		return nil, false, companion.ErrInvalidCursor
	}
	out := make([]companion.Command, 0, pageCap(q.Limit))
	if !validID(q.DeviceID) {
		return out, false, nil
	}
	err = db.bolt.View(func(tx *bolt.Tx) error {
		cmds := tx.Bucket(bucketCommands).Cursor()
		p := prefix(q.DeviceID)
		// The device's newest commands may still be in device_cmds_new
		// (foldDeviceCmds): take theirs, in id order, then walk both, the
		// greater id first.
		var staged [][]byte
		err := tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
			if string(dev) == q.DeviceID && (q.Before == "" || string(id) < q.Before) {
				staged = append(staged, id)
			}
			return nil
		})
		if err != nil {
			return err
		}
		c := tx.Bucket(bucketDeviceCmds).Cursor()
		// Position on the first key past the range, then walk back.
		var k []byte
		if q.Before == "" {
			k, _ = c.Seek(prefixEnd(p))
		} else {
			k, _ = c.Seek(key(q.DeviceID, q.Before))
		}
		if k == nil {
			k, _ = c.Last()
		} else {
			k, _ = c.Prev()
		}
		for {
			var id []byte
			indexed := k != nil && bytes.HasPrefix(k, p)
			switch n := len(staged); {
			case n > 0 && (!indexed || bytes.Compare(staged[n-1], k[len(p):]) > 0):
				id, staged = staged[n-1], staged[:n-1]
			case indexed:
				id = k[len(p):]
				k, _ = c.Prev()
			}
			if id == nil {
				break
			}
			var cmd companion.Command
			ok, err := seekJSON(cmds, id, &cmd)
			if err != nil {
				// One damaged record does not fail the list: it is left
				// out, logged and counted.
				db.metUndecodable(tx, id, err)
				continue
			}
			if !ok || (q.UserID != "" && cmd.UserID != q.UserID) || (q.State != "" && cmd.State != q.State) {
				continue
			}
			if q.Limit > 0 && len(out) == q.Limit {
				more = true
				break
			}
			out = append(out, cmd)
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return out, more, nil
}

// indexCommand moves a command from the queued and expiry indexes it was in
// as old (the zero Command for a new one) to those it belongs in as c.
func indexCommand(tx *bolt.Tx, old, c companion.Command) error {
	queued, expiry := tx.Bucket(bucketQueued), tx.Bucket(bucketExpiry)
	if old.State == companion.StateQueued && c.State != companion.StateQueued {
		if err := queued.Delete([]byte(c.ID)); err != nil {
			return err
		}
	}
	if old.State != companion.StateQueued && c.State == companion.StateQueued {
		if err := queued.Put([]byte(c.ID), []byte(c.DeviceID)); err != nil {
			return err
		}
	}
	was, is := expiring(old.State), expiring(c.State)
	if was && (!is || !old.ExpiresAt.Equal(c.ExpiresAt)) {
		if err := expiry.Delete(expiryKey(old)); err != nil {
			return err
		}
	}
	if is && (!was || !old.ExpiresAt.Equal(c.ExpiresAt)) {
		if err := expiry.Put(expiryKey(c), nil); err != nil {
			return err
		}
	}
	return nil
}

// indexBlob moves a command's entry in blob_refs from the blob it
// referenced as old (the zero Command for a new one) to the one it
// references as c: an unfinished command keeps the blob it references
// now needed (PurgeBlobs, BlobNeeded), whatever fn of UpdateCommand did
// to its Blob, and a final one none.
func indexBlob(tx *bolt.Tx, old, c companion.Command) error {
	was := old.Blob != "" && !companion.IsFinal(old.State)
	is := c.Blob != "" && !companion.IsFinal(c.State)
	if was == is && old.Blob == c.Blob {
		return nil
	}
	refs := tx.Bucket(bucketBlobRefs)
	if was {
		if err := refs.Delete(key(old.Blob, c.ID)); err != nil {
			return err
		}
	}
	if is {
		return refs.Put(key(c.Blob, c.ID), []byte(c.DeviceID))
	}
	return nil
}

// expiring reports whether a command in state s may still expire: the
// bridge does not have it yet.
func expiring(s string) bool { return s == companion.StateQueued || s == companion.StateSent }

func expiryKey(c companion.Command) []byte {
	k := binary.BigEndian.AppendUint64(make([]byte, 0, 8+len(c.ID)), uint64(max(c.ExpiresAt.UnixNano(), 0)))
	return append(k, c.ID...)
}

// decodeListed decodes the command at id for a read of many, the outbox's
// and the sweeps': one that does not decode (the file damaged there) is
// left out (metUndecodable), so that one damaged record does not stop the
// dispatch and the expiry of every other command, as the error of the
// whole read did. false: absent or left out.
func (db *DB) decodeListed(tx *bolt.Tx, cmds *bolt.Bucket, id []byte, cmd *companion.Command) bool {
	ok, err := getJSON(cmds, id, cmd)
	if err != nil {
		db.metUndecodable(tx, id, err)
		return false
	}
	return ok
}

// metUndecodable is told of a command record that a read in tx met and
// could not decode. It is logged and counted once a process
// (logUndecodable); while it is among the unfinished commands, a write of
// its own takes it out of them (closeUndecodable). Nothing can send it,
// expire it, end it or even tell its state, and it counted toward its
// device's limit of unfinished commands for good: enough of them, and the
// device took no command again.
func (db *DB) metUndecodable(tx *bolt.Tx, id []byte, err error) {
	db.logUndecodable("command", id, err)
	if tx.Bucket(bucketOpen).Get(id) == nil {
		return // final, or taken out already
	}
	id = bytes.Clone(id)
	db.batchAsync(func(tx *bolt.Tx) error {
		return db.closeUndecodable(tx, id)
	}, func(err error) {
		if err != nil && !errors.Is(err, groupcommit.ErrClosed) {
			db.log.Error("store: taking a command that does not decode out of its device's unfinished commands failed; tried again when it is next read", "key", string(id), "err", err)
		}
	})
}

// closeUndecodable takes the command id, whose record does not decode, out
// of the indexes of unfinished commands in tx: the open index and its
// device's count, the queued and expiry indexes, and the blob references.
// Its record stays as it is (a backup may restore it), and so does its
// entry in its device's history. The expiry and blob reference keys begin
// with what only the record says, so those indexes are walked: once for
// each damaged record, under a second at a million unfinished commands.
func (db *DB) closeUndecodable(tx *bolt.Tx, id []byte) error {
	open := tx.Bucket(bucketOpen)
	dev := bytes.Clone(open.Get(id))
	if dev == nil {
		return nil
	}
	var c companion.Command
	if _, err := getJSON(tx.Bucket(bucketCommands), id, &c); err == nil {
		return nil // it reads after all: nothing to take out
	}
	if err := open.Delete(id); err != nil {
		return err
	}
	if _, err := addOpen(tx.Bucket(bucketOpenCount), dev, -1, 0); err != nil {
		return err
	}
	if err := tx.Bucket(bucketQueued).Delete(id); err != nil {
		return err
	}
	exp := tx.Bucket(bucketExpiry).Cursor()
	for k, _ := exp.First(); k != nil; k, _ = exp.Next() {
		if bytes.Equal(k[8:], id) {
			if err := exp.Delete(); err != nil {
				return err
			}
			break
		}
	}
	suffix := append([]byte{0}, id...)
	refs := tx.Bucket(bucketBlobRefs).Cursor()
	for k, _ := refs.First(); k != nil; k, _ = refs.Next() {
		if bytes.HasSuffix(k, suffix) {
			if err := refs.Delete(); err != nil {
				return err
			}
			break
		}
	}
	db.log.Warn("store: a command whose record is damaged is no longer counted among its device's unfinished commands; it is never sent, expired or ended",
		"key", string(id), "device_id", string(dev))
	return nil
}

// logUndecodable logs a record left out of a read because it does not
// decode, and counts it, once a process per record: the sweeps read it
// again every pass. It reports whether this was the first time.
func (db *DB) logUndecodable(what string, key []byte, err error) bool {
	if _, seen := db.undecodable.LoadOrStore(what+"\x00"+string(key), true); seen {
		return false
	}
	db.undecodableN.Add(1)
	db.log.Error("store: a "+what+" that does not decode is left out of the reads that meet it (the dispatch, the sweeps, the lists): the file is damaged there; restore it from a backup when you can",
		"key", string(key), "err", err)
	return true
}

// Undecodable returns how many records the store has met since it opened
// that do not decode (the file damaged there), each left out of the reads
// that met it and logged once (docs/operations.md): the figure of
// companion_store_undecodable_records.
func (db *DB) Undecodable() int {
	return int(db.undecodableN.Load())
}

// ExpiredCommands returns the commands still queued or sent whose
// ExpiresAt is before now, soonest first. It reads only those.
func (db *DB) ExpiredCommands(ctx context.Context, now time.Time) ([]companion.Command, error) {
	out := []companion.Command{}
	end := binary.BigEndian.AppendUint64(nil, uint64(max(now.UnixNano(), 0)))
	err := db.bolt.View(func(tx *bolt.Tx) error {
		cmds := tx.Bucket(bucketCommands)
		c := tx.Bucket(bucketExpiry).Cursor()
		for k, _ := c.First(); k != nil && bytes.Compare(k[:8], end) < 0; k, _ = c.Next() {
			var cmd companion.Command
			if db.decodeListed(tx, cmds, k[8:], &cmd) && expiring(cmd.State) {
				out = append(out, cmd)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// OpenCommands returns the non-final commands whose state is one of states
// (every non-final command when none is given), oldest first. Asking for
// queued commands alone reads only those, and so does asking for sent ones
// alone (sentCommands).
func (db *DB) OpenCommands(ctx context.Context, states ...string) ([]companion.Command, error) {
	if len(states) == 1 && states[0] == companion.StateSent {
		return db.sentCommands()
	}
	index := bucketOpen
	if len(states) == 1 && states[0] == companion.StateQueued {
		index = bucketQueued
	}
	out := []companion.Command{}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		cmds := tx.Bucket(bucketCommands)
		c := tx.Bucket(index).Cursor()
		for k, _ := c.First(); k != nil; k, _ = c.Next() {
			var cmd companion.Command
			if db.decodeListed(tx, cmds, k, &cmd) && (len(states) == 0 || slices.Contains(states, cmd.State)) {
				out = append(out, cmd)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// QueuedCommandsWith returns every queued command but those of the devices
// in skip, and the other non-final commands of deviceIDs, oldest first,
// from one read transaction. With deviceIDs it walks the open index
// (command id → device id) and the queued index side by side, both in id
// order; without, the queued index (command id → device id) alone. It
// decodes only the commands it returns: the outbox asks for this each time
// a device's bridge comes back, and with 20,000 commands open for bridges
// that are away, reading every open command took 64-206 ms a pass
// (docs/performance.md); and every few seconds, when those bridges' commands
// wait queued (skip).
func (db *DB) QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error) {
	want := make(map[string]bool, len(deviceIDs))
	for _, d := range deviceIDs {
		want[d] = true
	}
	skipped := make(map[string]bool, len(skip))
	for _, d := range skip {
		skipped[d] = !want[d]
	}
	out := []companion.Command{}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		cmds := tx.Bucket(bucketCommands)
		q := tx.Bucket(bucketQueued).Cursor()
		if len(want) == 0 {
			for k, dev := q.First(); k != nil; k, dev = q.Next() {
				if skipped[string(dev)] {
					continue // before cmd, which escapes: no allocation
				}
				var cmd companion.Command
				if db.decodeListed(tx, cmds, k, &cmd) && !companion.IsFinal(cmd.State) {
					out = append(out, cmd)
				}
			}
			return nil
		}
		qk, _ := q.First()
		c := tx.Bucket(bucketOpen).Cursor()
		for k, dev := c.First(); k != nil; k, dev = c.Next() {
			for qk != nil && bytes.Compare(qk, k) < 0 {
				qk, _ = q.Next()
			}
			if !want[string(dev)] && (!bytes.Equal(qk, k) || skipped[string(dev)]) {
				continue
			}
			var cmd companion.Command
			if db.decodeListed(tx, cmds, k, &cmd) && !companion.IsFinal(cmd.State) {
				out = append(out, cmd)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// sentCommands returns the sent commands, oldest first: OpenCommands'
// answer for StateSent alone, which the broker's retrySent asked for every
// minute. Most open commands are queued or delivered (held by a bridge
// whose device is out of reach): the open index would have every one of
// them decoded. The expiry index holds the queued and the sent ones, and
// the queued index the queued ones: only the rest are read and decoded.
func (db *DB) sentCommands() ([]companion.Command, error) {
	return db.sentCommandsOf(nil)
}

// SentCommandsOnline returns the sent commands of the devices whose stored
// status reads online, oldest first. It finds the sent ones as
// sentCommands does, and decodes a command only when its device (from the
// open index) reads online, each device's status read once: the broker
// asks for them every minute (retrySent), and a bridge away leaves all its
// devices' commands sent, offline, and nothing to send. A status that does
// not decode reads offline, and is logged (bug 162).
func (db *DB) SentCommandsOnline(ctx context.Context) ([]companion.Command, error) {
	online := map[string]bool{}
	return db.sentCommandsOf(func(tx *bolt.Tx, dev []byte) bool {
		on, seen := online[string(dev)]
		if !seen {
			var s companion.Status
			ok, err := getJSON(tx.Bucket(bucketStatus), dev, &s)
			if err != nil {
				db.logUndecodable("status", dev, err)
			}
			on = ok && err == nil && s.Online
			online[string(dev)] = on
		}
		return on
	})
}

// sentCommandsOf returns the sent commands, oldest first, of the devices
// keep says yes to (all when keep is nil); a command whose device keep
// refuses is not decoded, nor one whose record does not decode
// (decodeListed).
func (db *DB) sentCommandsOf(keep func(tx *bolt.Tx, deviceID []byte) bool) ([]companion.Command, error) {
	out := []companion.Command{}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		cmds, queued, open := tx.Bucket(bucketCommands), tx.Bucket(bucketQueued), tx.Bucket(bucketOpen)
		c := tx.Bucket(bucketExpiry).Cursor()
		for k, _ := c.First(); k != nil; k, _ = c.Next() {
			id := k[8:]
			if queued.Get(id) != nil {
				continue
			}
			if keep != nil {
				dev := open.Get(id)
				if dev == nil || !keep(tx, dev) {
					continue // final (no longer sent), or its device refused
				}
			}
			var cmd companion.Command
			if db.decodeListed(tx, cmds, id, &cmd) && cmd.State == companion.StateSent {
				out = append(out, cmd)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	// The expiry index is in expiry order; ids are in acceptance order.
	slices.SortFunc(out, func(a, b companion.Command) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// CountOpen returns how many non-final commands the device has.
func (db *DB) CountOpen(ctx context.Context, deviceID string) (int, error) {
	if !validID(deviceID) {
		return 0, nil
	}
	var n uint64
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketOpenCount).Get([]byte(deviceID)); len(v) == 8 {
			n = binary.BigEndian.Uint64(v)
		}
		return nil
	})
	return int(n), err
}

// CountAllOpen returns how many non-final commands all devices have: the
// keys of the open index, counted from its pages without reading a
// command (bbolt's Bucket.Stats).
func (db *DB) CountAllOpen(ctx context.Context) (int, error) {
	var n int
	err := db.bolt.View(func(tx *bolt.Tx) error {
		n = tx.Bucket(bucketOpen).Stats().KeyN
		return nil
	})
	return n, err
}

// addOpen adds delta to the device's count of non-final commands, unless
// delta is positive and the count has reached max already (max > 0): it
// then changes nothing and reports full.
func addOpen(counts *bolt.Bucket, deviceID []byte, delta, max int) (full bool, err error) {
	var n uint64
	if v := counts.Get(deviceID); len(v) == 8 {
		n = binary.BigEndian.Uint64(v)
	}
	if delta > 0 && max > 0 && n >= uint64(max) {
		return true, nil
	}
	switch {
	case delta < 0 && n <= uint64(-delta):
		return false, counts.Delete(deviceID)
	case delta < 0:
		n -= uint64(-delta)
	default:
		n += uint64(delta)
	}
	return false, counts.Put(deviceID, binary.BigEndian.AppendUint64(nil, n))
}

// prefixEnd returns the smallest key greater than every key starting with
// p. Our prefixes end in NUL, so incrementing that byte is enough.
func prefixEnd(p []byte) []byte {
	end := bytes.Clone(p)
	end[len(end)-1]++
	return end
}

// validCommandID reports whether s is a command id as CreateCommand makes
// them: a UUID in its canonical lower-case form.
func validCommandID(s string) bool {
	u, err := uuid.Parse(s)
	return err == nil && u.String() == s
}
