package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"time"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// Status returns the device's last reported status. A device that never
// reported gets the zero Status with DeviceID set, and no error.
func (db *DB) Status(ctx context.Context, deviceID string) (companion.Status, error) {
	s := companion.Status{DeviceID: deviceID}
	if !validID(deviceID) {
		return s, nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if !getOrNone(db, tx.Bucket(bucketStatus), "status", []byte(deviceID), &s) {
			s = companion.Status{DeviceID: deviceID}
		}
		return nil
	})
	if err != nil {
		return companion.Status{}, err
	}
	return s, nil
}

// getOrNone reads the record at k of b into v and reports whether there
// is one; a record that does not decode (the file damaged there) is logged
// (logUndecodable; what names which) and read as none, and a write puts
// its own in its place. A device's status and settings are what its
// bridge last reported, which its next report gives again: read as an
// error, one damaged record made every read of the device a 500, and
// refused its reports, its settings changes, its unbinding and its moves,
// for good (docs/reliability.md, bugs 595 and 596). A release that does not
// decode cannot be served, and its next publish, of the same version,
// replaces it: read as an error, it made every install and OTA that looked
// it up a 500, and refused the publish that would mend it (bug 566); the
// rule that a release once published is not changed holds for every
// release that decodes.
func getOrNone[T any](db *DB, b *bolt.Bucket, what string, k []byte, v *T) bool {
	ok, err := getJSON(b, k, v)
	if err != nil {
		db.logUndecodable(what, k, err)
		var none T
		*v = none
		return false
	}
	return ok
}

// PutStatus stores s when it is newer than the stored status (higher Seq,
// or equal Seq and later LastSeen; see newer) and reports whether it did.
// UpdatedAt is set to now. The index from bridge to devices follows the
// device when its bridge changes.
func (db *DB) PutStatus(ctx context.Context, s companion.Status) (bool, error) {
	return awaitBool(func(done func(bool, error)) { db.PutStatusAsync(s, done) })
}

// awaitBool runs an asynchronous write and waits for its outcome.
func awaitBool(start func(done func(bool, error))) (bool, error) {
	type result struct {
		ok  bool
		err error
	}
	ch := make(chan result, 1)
	start(func(ok bool, err error) { ch <- result{ok, err} })
	r := <-ch
	return r.ok, r.err
}

// PutStatusAsync is PutStatus without the wait: done (if not nil) gets its
// results once the status is on disk, in the order of the store's writes
// (see UpdateCommandAsync).
func (db *DB) PutStatusAsync(s companion.Status, done func(applied bool, err error)) {
	if done == nil {
		done = func(bool, error) {}
	}
	if !validID(s.DeviceID) || (s.BridgeID != "" && !validID(s.BridgeID)) {
		done(false, fmt.Errorf("%w: status needs a device id", companion.ErrInvalid))
		return
	}
	var applied bool
	db.batchAsync(func(tx *bolt.Tx) error {
		var err error
		applied, err = db.putStatus(tx, s)
		return err
	}, func(err error) { done(applied && err == nil, err) })
}

// putStatus is PutStatus inside a write transaction; s is checked already.
func (db *DB) putStatus(tx *bolt.Tx, s companion.Status) (bool, error) {
	statuses := tx.Bucket(bucketStatus)
	var old companion.Status
	// A stored status that does not decode is replaced, as if there were
	// none (getOrNone; docs/reliability.md, bug 595).
	found := getOrNone(db, statuses, "status", []byte(s.DeviceID), &old)
	if found && !companion.Newer(s.Seq, s.LastSeen, old.Seq, old.LastSeen, db.now()) {
		return false, nil
	}
	// A status from a bridge other than the one that serves the device
	// now, or of a device no bridge serves: the broker checked the
	// device's bridge before the write, and a move (to another bridge or
	// to none) committed in between. Stored over the move's (offline),
	// it read online on the bridge it left for good (docs/reliability.md,
	// bugs 266 and 271).
	if s.BridgeID != "" && string(tx.Bucket(bucketAssignments).Get([]byte(s.DeviceID))) != s.BridgeID {
		return false, nil
	}
	ns := s
	ns.UpdatedAt = db.now()
	if err := putJSON(statuses, []byte(ns.DeviceID), ns); err != nil {
		return false, err
	}
	if err := db.appendDeviceEvent(tx, old, found, ns); err != nil {
		return false, err
	}
	if !found || old.BridgeID != ns.BridgeID {
		idx := tx.Bucket(bucketBridgeDevices)
		if found && old.BridgeID != "" {
			if err := idx.Delete(key(old.BridgeID, ns.DeviceID)); err != nil {
				return false, err
			}
		}
		if ns.BridgeID != "" {
			if err := idx.Put(key(ns.BridgeID, ns.DeviceID), nil); err != nil {
				return false, err
			}
		}
	}
	return true, nil
}

// MarkBridgeOffline marks offline every device online whose current status
// names the bridge, as when the bridge's MQTT Will fires, and returns their
// ids in order. UpdatedAt is set to now; Seq and LastSeen are kept, so the
// bridge's next report applies as usual. A device offline already is left
// as it is, and not returned: the broker republishes the status of each
// returned, and a bridge whose link flaps has a Will each time
// (docs/reliability.md, bug 456).
func (db *DB) MarkBridgeOffline(ctx context.Context, bridgeID string) ([]string, error) {
	type result struct {
		ids []string
		err error
	}
	ch := make(chan result, 1)
	db.MarkBridgeOfflineAsync(bridgeID, func(ids []string, err error) { ch <- result{ids, err} })
	r := <-ch
	return r.ids, r.err
}

// MarkBridgeOfflineAsync is MarkBridgeOffline without the wait: done gets
// its results once the change is on disk, in the order of the store's
// writes (see UpdateCommandAsync).
func (db *DB) MarkBridgeOfflineAsync(bridgeID string, done func(ids []string, err error)) {
	if !validID(bridgeID) {
		done([]string{}, nil)
		return
	}
	var ids []string
	db.batchAsync(func(tx *bolt.Tx) error {
		ids = []string{}
		var devices [][]byte
		scanPrefix(tx.Bucket(bucketBridgeDevices), prefix(bridgeID), func(rest []byte) bool {
			devices = append(devices, bytes.Clone(rest))
			return true
		})
		statuses := tx.Bucket(bucketStatus)
		now := db.now()
		for _, dev := range devices {
			var s companion.Status
			ok := getOrNone(db, statuses, "status", dev, &s)
			if !ok || s.BridgeID != bridgeID || !s.Online {
				continue
			}
			old := s
			s.Online = false
			s.UpdatedAt = now
			if err := putJSON(statuses, dev, s); err != nil {
				return err
			}
			if err := db.appendDeviceEvent(tx, old, true, s); err != nil {
				return err
			}
			ids = append(ids, s.DeviceID)
		}
		return nil
	}, func(err error) {
		if err != nil {
			done(nil, err)
			return
		}
		done(ids, nil)
	})
}

// BridgeDevices returns, in order, the ids of the devices whose current
// status names the bridge.
func (db *DB) BridgeDevices(ctx context.Context, bridgeID string) ([]string, error) {
	ids := []string{}
	if !validID(bridgeID) {
		return ids, nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		statuses := tx.Bucket(bucketStatus)
		scanPrefix(tx.Bucket(bucketBridgeDevices), prefix(bridgeID), func(dev []byte) bool {
			var s companion.Status
			if getOrNone(db, statuses, "status", dev, &s) && s.BridgeID == bridgeID {
				ids = append(ids, s.DeviceID)
			}
			return true
		})
		return nil
	})
	if err != nil {
		return nil, err
	}
	return ids, nil
}

// Settings returns the device's settings. A device with none gets the zero
// value with DeviceID set and empty (non-nil) maps.
func (db *DB) Settings(ctx context.Context, deviceID string) (companion.Settings, error) {
	s := companion.Settings{DeviceID: deviceID}
	if validID(deviceID) {
		err := db.bolt.View(func(tx *bolt.Tx) error {
			if !getOrNone(db, tx.Bucket(bucketSettings), "settings record", []byte(deviceID), &s) {
				s = companion.Settings{DeviceID: deviceID}
			}
			return nil
		})
		if err != nil {
			return companion.Settings{}, err
		}
	}
	fillMaps(&s)
	return s, nil
}

// fillMaps makes the maps of s non-nil.
func fillMaps(s *companion.Settings) {
	if s.Reported == nil {
		s.Reported = map[string]json.RawMessage{}
	}
	if s.Desired == nil {
		s.Desired = map[string]json.RawMessage{}
	}
}

// PutReportedSettings stores the settings a device reported when the
// report is newer than the stored one (same rule as PutStatus), and
// reports whether it did. reported replaces the stored set; schema
// replaces the stored schema unless it is empty. Each desired key whose
// value the device now reports is dropped: it is no longer pending.
// bridgeID, when set, is the bridge the caller found serving the device:
// the settings are not stored unless it serves the device still (see
// putReportedSettings).
func (db *DB) PutReportedSettings(ctx context.Context, deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64) (bool, error) {
	return awaitBool(func(done func(bool, error)) {
		db.PutReportedSettingsAsync(deviceID, bridgeID, reported, schema, at, seq, done)
	})
}

// PutReportedSettingsAsync is PutReportedSettings without the wait: done
// (if not nil) gets its results once the settings are on disk, in the
// order of the store's writes (see UpdateCommandAsync).
func (db *DB) PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(applied bool, err error)) {
	if done == nil {
		done = func(bool, error) {}
	}
	if !validID(deviceID) || (bridgeID != "" && !validID(bridgeID)) {
		done(false, fmt.Errorf("%w: settings need a device id", companion.ErrInvalid))
		return
	}
	r, err := companion.NewReportedSettings(reported, schema, at, seq)
	if err != nil {
		done(false, err)
		return
	}
	var applied bool
	db.batchAsync(func(tx *bolt.Tx) error {
		var err error
		applied, err = db.putReportedSettings(tx, deviceID, bridgeID, r)
		return err
	}, func(err error) { done(applied && err == nil, err) })
}

// putReportedSettings is PutReportedSettings inside a write transaction;
// r is checked and compacted already. Settings reported through bridgeID
// ("" when the caller names none) are not stored unless that bridge serves
// the device now: the broker checked the device's bridge before the
// write, and a move that committed in between set the settings' seq to 0
// (forgetSeq). Stored over that, the bridge it left, its clock for a seq
// (up to a day ahead), held the new bridge's reports off: GET …/settings
// read the old bridge's values, and a change that succeeded did not show
// (docs/reliability.md, bug 272).
func (db *DB) putReportedSettings(tx *bolt.Tx, deviceID, bridgeID string, r companion.ReportedSettings) (bool, error) {
	if bridgeID != "" && string(tx.Bucket(bucketAssignments).Get([]byte(deviceID))) != bridgeID {
		return false, nil
	}
	b := tx.Bucket(bucketSettings)
	s := companion.Settings{DeviceID: deviceID}
	found := getOrNone(db, b, "settings record", []byte(deviceID), &s)
	s.DeviceID = deviceID
	if found && !companion.Newer(r.Seq, r.At, s.Seq, s.At, db.now()) {
		return false, nil
	}
	fillMaps(&s)
	r.ApplyTo(&s)
	s.UpdatedAt = db.now()
	if err := putJSON(b, []byte(deviceID), s); err != nil {
		return false, err
	}
	return true, nil
}

// withdrawDesired takes out, in tx, the desired settings that c asked
// for when it is a settings command that has just ended without
// succeeding (companion.Command.WithdrawsDesired), but those a later
// command of its device asked for, and gives back those an earlier
// command still open asked for, unless one after it succeeded
// (companion.Settings.Withdraw): nothing will apply c's, and they were
// left desired and pending for good (bug 236), while an earlier change
// still open was left out of them (bug 251). The later commands are
// those above c's id in the device's index, the ones not folded yet
// included (ListCommands); the earlier ones are read newest first, only
// those the open index holds, until the device's count of open commands
// is reached (as endUnbound reads them), and then, when one of them is a
// settings change, the finished ones between the oldest such and c. An
// unbinding needs none of it: it drops every desired setting
// (dropDesired).
func (db *DB) withdrawDesired(tx *bolt.Tx, c companion.Command) error {
	if !c.WithdrawsDesired() {
		return nil
	}
	b := tx.Bucket(bucketSettings)
	var s companion.Settings
	ok := getOrNone(db, b, "settings record", []byte(c.DeviceID), &s)
	if !ok || len(s.Desired) == 0 {
		return nil
	}
	var (
		others  []companion.Command
		left    uint64 // the device's open commands not met yet
		openIdx = tx.Bucket(bucketOpen)
	)
	if v := tx.Bucket(bucketOpenCount).Get([]byte(c.DeviceID)); len(v) == 8 {
		left = binary.BigEndian.Uint64(v)
	}
	cmds := tx.Bucket(bucketCommands)
	// visit reads the command id when it is later than c, or earlier and
	// open.
	visit := func(id []byte) {
		open := openIdx.Get(id) != nil
		if open && left > 0 {
			left--
		}
		if string(id) < c.ID && !open {
			return
		}
		var oc companion.Command
		// A record that does not decode asks for nothing here; the reads
		// that list it count and log it (metUndecodable).
		if found, err := getJSON(cmds, id, &oc); err == nil && found {
			others = append(others, oc)
		}
	}
	err := tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
		if string(dev) == c.DeviceID && string(id) != c.ID {
			visit(id)
		}
		return nil
	})
	if err != nil {
		return err
	}
	p := prefix(c.DeviceID)
	cur := tx.Bucket(bucketDeviceCmds).Cursor()
	for k, _ := cur.Seek(key(c.DeviceID, c.ID)); k != nil && bytes.HasPrefix(k, p); k, _ = cur.Next() {
		if id := k[len(p):]; string(id) > c.ID {
			visit(id)
		}
	}
	k, _ := cur.Seek(key(c.DeviceID, c.ID))
	if k == nil {
		k, _ = cur.Last()
	} else {
		k, _ = cur.Prev()
	}
	for ; left > 0 && k != nil && bytes.HasPrefix(k, p); k, _ = cur.Prev() {
		visit(k[len(p):])
	}
	// The settings changes that succeeded between the oldest earlier one
	// still open and c: the device ran that one before them. Only when
	// there is one, as the walk decodes the finished history.
	since := ""
	for _, oc := range others {
		if oc.ID < c.ID && oc.Op == companion.OpSettingsUpdate && (since == "" || oc.ID < since) {
			since = oc.ID
		}
	}
	if since != "" {
		between := func(id []byte) {
			if string(id) <= since || string(id) >= c.ID || openIdx.Get(id) != nil {
				return
			}
			var oc companion.Command
			if found, err := getJSON(cmds, id, &oc); err == nil && found && oc.Op == companion.OpSettingsUpdate && oc.State == companion.StateSucceeded {
				others = append(others, oc)
			}
		}
		err = tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
			if string(dev) == c.DeviceID {
				between(id)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for k, _ := cur.Seek(key(c.DeviceID, since)); k != nil && bytes.HasPrefix(k, p) && string(k[len(p):]) < c.ID; k, _ = cur.Next() {
			between(k[len(p):])
		}
	}
	if !s.Withdraw(c, others) {
		return nil
	}
	s.UpdatedAt = db.now()
	return putJSON(b, []byte(c.DeviceID), s)
}

// mergeDesired records, in tx, values a user asked of the device: each
// key of want (checked and compacted by companion.NewDesiredSettings)
// replaces the desired value of that key. CreateCommand calls it for a
// settings command it stores, so that the desired settings follow the
// order of the commands.
func (db *DB) mergeDesired(tx *bolt.Tx, deviceID string, want map[string]json.RawMessage) error {
	b := tx.Bucket(bucketSettings)
	s := companion.Settings{DeviceID: deviceID}
	getOrNone(db, b, "settings record", []byte(deviceID), &s)
	s.DeviceID = deviceID
	fillMaps(&s)
	maps.Copy(s.Desired, want)
	s.UpdatedAt = db.now()
	return putJSON(b, []byte(deviceID), s)
}
