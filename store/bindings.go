package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// Bind ties a provisioned device to b.UserID. The model is copied from the
// registry and BoundAt is set to now when zero. It returns (b, true, nil)
// when it created the binding, (existing, false, nil) when the device is
// already bound to the same user, ErrBoundToOther when it is bound to
// another user, and ErrNotFound when the device was never provisioned.
// Checking the claim code is the caller's job. An answer ctx carries
// (companion.WithAnswer) is stored with the binding it creates, and only
// then.
func (db *DB) Bind(ctx context.Context, b companion.Binding) (companion.Binding, bool, error) {
	if !validID(b.DeviceID) || !validID(b.UserID) {
		return companion.Binding{}, false, fmt.Errorf("%w: binding needs a device id and a user id", companion.ErrInvalid)
	}
	if b.BoundAt.IsZero() {
		b.BoundAt = db.now()
	}
	var (
		out     companion.Binding
		created bool
	)
	answer, keyed, err := answerOf(ctx)
	if err != nil {
		return companion.Binding{}, false, err
	}
	bind := func(tx *bolt.Tx) error {
		out, created = companion.Binding{}, false
		var dev companion.RegistryDevice
		ok, err := getJSON(tx.Bucket(bucketDevices), []byte(b.DeviceID), &dev)
		if err != nil {
			return err
		}
		if !ok {
			return abort(companion.ErrNotFound)
		}
		bindings := tx.Bucket(bucketBindings)
		existing, ok, err := db.getBinding(tx, b.DeviceID)
		if err != nil {
			return err
		}
		if ok {
			if existing.UserID != b.UserID {
				return abort(companion.ErrBoundToOther)
			}
			out = existing
			return nil
		}
		nb := b
		nb.Model = dev.Model
		raw, err := fastjson.Marshal(nb)
		if err != nil {
			return fmt.Errorf("store: encode binding: %w", err)
		}
		if err := bindings.Put([]byte(nb.DeviceID), raw); err != nil {
			return err
		}
		if err := tx.Bucket(bucketUserBindings).Put(key(nb.UserID, nb.DeviceID), raw); err != nil {
			return err
		}
		out, created = nb, true
		return nil
	}
	if keyed {
		// The request's answer (a 201) is its only when it binds: one
		// for a device bound already is answered, and recorded, after.
		bind = db.answerIn(answer, bind, &created)
	}
	if err := db.batch(bind); err != nil {
		return companion.Binding{}, false, err
	}
	return out, created, nil
}

// Unbind removes the binding of the device to userID. It returns
// ErrNotFound unless the device is bound to that user. In the same
// transaction it ends the user's unfinished commands of the device
// (companion.EndUnbound) and drops its desired settings: those were the
// user's wishes, not the next owner's. Status, reported settings and the
// history of commands stay, and so does its assignment to one of the
// operator's bridges; one of the user's own bridges stops serving it (it
// reads offline then). The result says which bridge, and which commands.
func (db *DB) Unbind(ctx context.Context, deviceID, userID string) (companion.Unbound, error) {
	if !validID(deviceID) || !validID(userID) {
		return companion.Unbound{}, companion.ErrNotFound
	}
	var out companion.Unbound
	err := db.batch(db.answered(ctx, func(tx *bolt.Tx) error {
		out = companion.Unbound{}
		existing, ok, err := db.getBinding(tx, deviceID)
		if err != nil {
			return err
		}
		if !ok || existing.UserID != userID {
			return abort(companion.ErrNotFound)
		}
		if err := tx.Bucket(bucketBindings).Delete([]byte(deviceID)); err != nil {
			return err
		}
		if err := tx.Bucket(bucketUserBindings).Delete(key(userID, deviceID)); err != nil {
			return err
		}
		if out.Ended, err = db.endUnbound(tx, deviceID, userID); err != nil {
			return err
		}
		if err := db.dropDesired(tx, deviceID); err != nil {
			return err
		}
		if bridge := tx.Bucket(bucketAssignments).Get([]byte(deviceID)); bridge != nil &&
			tx.Bucket(bucketOwnerBridges).Get(key(userID, string(bridge))) != nil {
			if out.Bridge, err = unassign(tx, deviceID); err != nil {
				return err
			}
			return db.markUnserved(tx, deviceID, db.now())
		}
		return nil
	}))
	if err != nil {
		return companion.Unbound{}, err
	}
	return out, nil
}

// endUnbound ends the user's unfinished commands of the device in tx
// (companion.EndUnbound) and returns them, oldest first. It reads the
// device's commands newest first (unfinished ones are mostly recent), and
// stops once it has seen as many unfinished ones as the device counts.
// Only the unfinished ones are decoded: the open index tells them from the
// finished history the walk passes on its way to an old unfinished one
// (decoded, 50,000 of them held the writer for a quarter of a second).
func (db *DB) endUnbound(tx *bolt.Tx, deviceID, userID string) ([]companion.Command, error) {
	var open uint64
	if v := tx.Bucket(bucketOpenCount).Get([]byte(deviceID)); len(v) == 8 {
		open = binary.BigEndian.Uint64(v)
	}
	if open == 0 {
		return nil, nil
	}
	cmds, openIdx := tx.Bucket(bucketCommands).Cursor(), tx.Bucket(bucketOpen).Cursor()
	var ids []string
	seen := uint64(0)
	visit := func(id []byte) (more bool, err error) {
		if k, _ := openIdx.Seek(id); !bytes.Equal(k, id) {
			return true, nil // final
		}
		var c companion.Command
		ok, err := seekJSON(cmds, id, &c)
		if err != nil {
			// Damaged: it cannot be ended, and is taken out of the
			// unfinished commands instead, not left to the device's
			// next owner.
			db.logUndecodable("command", id, err)
			if err := db.closeUndecodable(tx, id); err != nil {
				return false, err
			}
			seen++
			return seen < open, nil
		}
		if !ok || companion.IsFinal(c.State) {
			return true, nil
		}
		if c.UserID == userID {
			ids = append(ids, c.ID)
		}
		seen++
		return seen < open, nil
	}
	more := true
	// The newest commands' entries may still wait in device_cmds_new;
	// device_cmds holds the older ones, walked from its newest back.
	err := tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
		if !more || string(dev) != deviceID {
			return nil
		}
		var err error
		more, err = visit(id)
		return err
	})
	if err != nil {
		return nil, err
	}
	p := prefix(deviceID)
	c := tx.Bucket(bucketDeviceCmds).Cursor()
	k, _ := c.Seek(prefixEnd(p))
	if k == nil {
		k, _ = c.Last()
	} else {
		k, _ = c.Prev()
	}
	for ; more && k != nil && bytes.HasPrefix(k, p); k, _ = c.Prev() {
		if more, err = visit(k[len(p):]); err != nil {
			return nil, err
		}
	}
	slices.Sort(ids) // UUIDv7: oldest first
	ended := make([]companion.Command, 0, len(ids))
	for _, id := range ids {
		c, final, err := db.updateCommand(tx, id, func(c *companion.Command) error {
			companion.EndUnbound(c)
			return nil
		})
		if err != nil {
			return nil, err
		}
		if !final {
			ended = append(ended, c)
		}
	}
	return ended, nil
}

// dropDesired forgets the desired settings of the device in tx.
func (db *DB) dropDesired(tx *bolt.Tx, deviceID string) error {
	b := tx.Bucket(bucketSettings)
	var s companion.Settings
	ok := getOrNone(db, b, "settings record", []byte(deviceID), &s)
	if !ok || len(s.Desired) == 0 {
		return nil
	}
	s.Desired = map[string]json.RawMessage{}
	s.UpdatedAt = db.now()
	return putJSON(b, []byte(deviceID), s)
}

// Binding returns the binding of the device, or ErrNotFound when it is not
// bound. A binding that does not decode is read as getBinding reads it,
// and then written back whole (or deleted) in a write of its own.
func (db *DB) Binding(ctx context.Context, deviceID string) (companion.Binding, error) {
	if !validID(deviceID) {
		return companion.Binding{}, companion.ErrNotFound
	}
	var (
		b           companion.Binding
		ok, damaged bool
	)
	err := db.bolt.View(func(tx *bolt.Tx) error {
		b, ok, damaged = db.readBinding(tx, deviceID)
		return nil
	})
	if err != nil {
		return companion.Binding{}, err
	}
	if damaged {
		err := db.batch(func(tx *bolt.Tx) error {
			_, _, err := db.getBinding(tx, deviceID)
			return err
		})
		if err != nil {
			// What was read stands; the next write that reads the
			// binding heals it.
			db.log.Warn("store: could not write back a binding that does not decode", "device_id", deviceID, "err", err)
		}
	}
	if !ok {
		return companion.Binding{}, companion.ErrNotFound
	}
	return b, nil
}

// getBinding reads the binding of the device in tx, false when it is not
// bound; every read of a binding but a list's goes through it. A binding
// that does not decode (the file damaged there) is read as readBinding
// reads it, from its copy in user_bindings or as not bound, and in a write
// transaction the file is made to say what was read: the copy is written
// back in its place, or, with no copy that decodes, the binding is deleted
// with its copies that do not decode (the device can be registered again).
// Read as an error, one damaged binding made every read of its device a
// 500 for good: the device, its status and settings, its commands, its
// unbinding and its moves (docs/reliability.md, bug 563).
func (db *DB) getBinding(tx *bolt.Tx, deviceID string) (companion.Binding, bool, error) {
	b, ok, damaged := db.readBinding(tx, deviceID)
	if !damaged || !tx.Writable() {
		return b, ok, nil
	}
	k := []byte(deviceID)
	if ok {
		if err := putJSON(tx.Bucket(bucketBindings), k, b); err != nil {
			return companion.Binding{}, false, err
		}
		db.log.Warn("store: a binding that did not decode was written back from its copy in user_bindings",
			"device_id", deviceID, "user_id", b.UserID)
		return b, true, nil
	}
	if err := tx.Bucket(bucketBindings).Delete(k); err != nil {
		return companion.Binding{}, false, err
	}
	copies := tx.Bucket(bucketUserBindings)
	for _, ck := range db.bindingCopies(tx, deviceID, nil) {
		if err := copies.Delete(ck); err != nil {
			return companion.Binding{}, false, err
		}
	}
	db.log.Warn("store: a binding that did not decode, with no copy that does, was deleted: the device is not bound, and can be registered again",
		"device_id", deviceID)
	return companion.Binding{}, false, nil
}

// readBinding reads the binding of the device in tx, as getBinding
// without its write: damaged says the binding does not decode (logged
// once, logUndecodable), and b and ok are then its copy in user_bindings,
// if one decodes, or not bound.
func (db *DB) readBinding(tx *bolt.Tx, deviceID string) (b companion.Binding, ok, damaged bool) {
	k := []byte(deviceID)
	raw := tx.Bucket(bucketBindings).Get(k)
	if raw == nil {
		return companion.Binding{}, false, false
	}
	err := fastjson.Unmarshal(raw, &b)
	if err == nil {
		return b, true, false
	}
	db.logUndecodable("binding", k, err)
	var good []companion.Binding
	db.bindingCopies(tx, deviceID, &good)
	if len(good) == 0 {
		return companion.Binding{}, false, true
	}
	return good[0], true, true
}

// bindingCopies walks user_bindings for the copies of the device's
// binding, which are keyed by user first: the whole bucket, read only for
// a binding that does not decode. It appends to good (when not nil) the
// copies that decode, name the device and the user of their key, and
// returns the keys of those that do not decode, each logged
// (logUndecodable).
func (db *DB) bindingCopies(tx *bolt.Tx, deviceID string, good *[]companion.Binding) (bad [][]byte) {
	suffix := []byte("\x00" + deviceID)
	c := tx.Bucket(bucketUserBindings).Cursor()
	for k, v := c.First(); k != nil; k, v = c.Next() {
		if !bytes.HasSuffix(k, suffix) {
			continue
		}
		var b companion.Binding
		if err := fastjson.Unmarshal(v, &b); err != nil {
			db.logUndecodable("binding", k, err)
			bad = append(bad, bytes.Clone(k))
			continue
		}
		if good != nil && b.DeviceID == deviceID && b.UserID == string(k[:len(k)-len(suffix)]) {
			*good = append(*good, b)
		}
	}
	return bad
}

// ListBindings returns the bindings of the user in device-id order,
// starting after the device id `after` ("" starts at the beginning), at
// most limit of them (limit <= 0: all). An `after` containing a NUL byte
// is ErrInvalidCursor.
func (db *DB) ListBindings(ctx context.Context, userID, after string, limit int) ([]companion.Binding, error) {
	out := make([]companion.Binding, 0, pageCap(limit))
	err := db.bolt.View(func(tx *bolt.Tx) error {
		return db.scanBindings(tx, userID, after, limit, func(b companion.Binding) error {
			out = append(out, b)
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ListDevices is ListBindings with each device's status, read in the same
// transaction: a page of devices costs one read transaction rather than one
// per device, which is what a user with many devices pays on every page.
func (db *DB) ListDevices(ctx context.Context, userID, after string, limit int) ([]companion.BoundDevice, error) {
	out := make([]companion.BoundDevice, 0, pageCap(limit))
	err := db.bolt.View(func(tx *bolt.Tx) error {
		statuses := tx.Bucket(bucketStatus).Cursor()
		return db.scanBindings(tx, userID, after, limit, func(b companion.Binding) error {
			out = append(out, companion.BoundDevice{Binding: b, Status: companion.Status{DeviceID: b.DeviceID}})
			if _, err := seekJSON(statuses, []byte(b.DeviceID), &out[len(out)-1].Status); err != nil {
				// A status that does not decode (the file damaged there)
				// does not fail the user's whole list: the device is
				// listed, its status not known, as before any report
				// (docs/reliability.md, bug 595).
				db.logUndecodable("status", []byte(b.DeviceID), err)
				out[len(out)-1].Status = companion.Status{DeviceID: b.DeviceID}
			}
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// pageCap is the capacity to give a page of at most limit items: a page
// of devices grown by append would allocate it about twice over.
func pageCap(limit int) int {
	if limit <= 0 {
		return 0
	}
	return min(limit, 1000)
}

// scanBindings calls fn with the bindings of the user as ListBindings
// selects them. An entry of user_bindings that does not decode (the file
// damaged there) is logged (logUndecodable) and read from bindings, of
// which it is a copy; one that does not decode there either is left out,
// as a damaged command is left out of its device's list: one damaged
// record failed the user's whole list (docs/reliability.md, bug 595).
func (db *DB) scanBindings(tx *bolt.Tx, userID, after string, limit int, fn func(b companion.Binding) error) error {
	if strings.ContainsRune(after, 0) {
		return companion.ErrInvalidCursor
	}
	if !validID(userID) {
		return nil
	}
	p := prefix(userID)
	c := tx.Bucket(bucketUserBindings).Cursor()
	start := append(bytes.Clone(p), after...)
	k, v := c.Seek(start)
	if after != "" && bytes.Equal(k, start) {
		k, v = c.Next()
	}
	for n := 0; k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
		if limit > 0 && n >= limit {
			break
		}
		var b companion.Binding
		if err := fastjson.Unmarshal(v, &b); err != nil {
			db.logUndecodable("binding", k, err)
			var ok bool
			if b, ok, _ = db.readBinding(tx, string(k[len(p):])); !ok {
				continue
			}
		}
		if b.UserID != userID {
			continue
		}
		if err := fn(b); err != nil {
			return err
		}
		n++
	}
	return nil
}

// seekJSON is getJSON through a cursor of the bucket, for the many reads of
// one transaction: Bucket.Get makes a new cursor, and allocates its stack,
// on every call.
func seekJSON(c *bolt.Cursor, k []byte, v any) (bool, error) {
	got, raw := c.Seek(k)
	if raw == nil || !bytes.Equal(got, k) {
		return false, nil
	}
	if err := fastjson.Unmarshal(raw, v); err != nil {
		return false, fmt.Errorf("store: decode %q: %w", k, err)
	}
	return true, nil
}

// migrateTo6 copies each binding into its user_bindings entry, which held
// nothing before, so that listing a user's devices reads their bindings in
// key order instead of seeking each in the bindings bucket. An entry whose
// binding is gone or is another user's (none should be) is dropped: the
// list skipped it before. bbolt's cursors do not survive changes to their
// bucket, so it reads a thousand entries, writes them, and seeks again.
func migrateTo6(tx *bolt.Tx) error {
	bindings, idx := tx.Bucket(bucketBindings), tx.Bucket(bucketUserBindings)
	type entry struct{ k, v []byte } // v nil: drop the entry
	var from []byte
	for {
		var batch []entry
		c := idx.Cursor()
		k, _ := c.Seek(from)
		if from != nil && bytes.Equal(k, from) {
			k, _ = c.Next()
		}
		for ; k != nil && len(batch) < 1000; k, _ = c.Next() {
			e := entry{k: bytes.Clone(k)}
			if i := bytes.IndexByte(k, 0); i >= 0 {
				raw := bindings.Get(k[i+1:])
				var b companion.Binding
				if raw != nil && fastjson.Unmarshal(raw, &b) == nil && b.UserID == string(k[:i]) {
					e.v = bytes.Clone(raw)
				}
			}
			batch = append(batch, e)
		}
		if len(batch) == 0 {
			return nil
		}
		for _, e := range batch {
			var err error
			if e.v == nil {
				err = idx.Delete(e.k)
			} else {
				err = idx.Put(e.k, e.v)
			}
			if err != nil {
				return err
			}
		}
		from = batch[len(batch)-1].k
	}
}
