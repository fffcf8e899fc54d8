package store

import (
	"bytes"
	"context"
	"time"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// Bridges serve the devices assigned to them, each device at most one
// bridge (CONTRACT §9). The assignment decides what the bridge may read and
// write on the broker, which blobs it may download, and whether the
// device's commands go out at all: those of an unassigned device wait
// queued.

// assign makes bridgeID serve deviceID in tx, moving it from the bridge
// that served it before, if any.
func assign(tx *bolt.Tx, deviceID, bridgeID string) error {
	if _, err := unassign(tx, deviceID); err != nil {
		return err
	}
	if err := tx.Bucket(bucketAssignments).Put([]byte(deviceID), []byte(bridgeID)); err != nil {
		return err
	}
	return tx.Bucket(bucketBridgeServes).Put(key(bridgeID, deviceID), nil)
}

// unassign takes deviceID from the bridge serving it, and returns that
// bridge ("" when none did).
func unassign(tx *bolt.Tx, deviceID string) (string, error) {
	assignments := tx.Bucket(bucketAssignments)
	old := string(assignments.Get([]byte(deviceID)))
	if old == "" {
		return "", nil
	}
	if err := assignments.Delete([]byte(deviceID)); err != nil {
		return "", err
	}
	return old, tx.Bucket(bucketBridgeServes).Delete(key(old, deviceID))
}

// markUnserved marks offline a device no bridge serves any more (CONTRACT
// §9), or that moved to another bridge, which has not reported it yet:
// nothing reports it now, and its old bridge's Will need not fire
// (Mosquitto's plugin cuts a bridge off without it). Its status names no
// bridge from then on, online or not: the bridge does not serve it, and
// after an unbind it may be the last owner's own, whose name is not the
// next owner's to read. Seq and LastSeen stay, as MarkBridgeOffline keeps
// them, so the next report applies as usual.
func (db *DB) markUnserved(tx *bolt.Tx, deviceID string, now time.Time) error {
	statuses := tx.Bucket(bucketStatus)
	var s companion.Status
	ok := getOrNone(db, statuses, "status", []byte(deviceID), &s)
	if !ok || (!s.Online && s.BridgeID == "") {
		return nil
	}
	old := s
	if old.BridgeID != "" {
		if err := tx.Bucket(bucketBridgeDevices).Delete(key(old.BridgeID, deviceID)); err != nil {
			return err
		}
	}
	s.Online, s.BridgeID = false, ""
	s.UpdatedAt = now
	if err := putJSON(statuses, []byte(deviceID), s); err != nil {
		return err
	}
	return db.appendDeviceEvent(tx, old, true, s)
}

// AssignDevice makes bridgeID serve deviceID, or no bridge when bridgeID is
// "" (the device then reads offline), and returns the bridge that served
// it before ("" none). With ownerID set, it is a user's request: the
// device must be bound to that user and the bridge must be one of that
// user's own (ErrNotOwned otherwise; an unassignment needs only the
// device). ErrNotFound means no such device or bridge.
func (db *DB) AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (previous string, err error) {
	if !validID(deviceID) || (bridgeID != "" && !validID(bridgeID)) {
		return "", companion.ErrNotFound
	}
	err = db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		previous = ""
		if tx.Bucket(bucketDevices).Get([]byte(deviceID)) == nil {
			return abort(companion.ErrNotFound)
		}
		if ownerID != "" {
			b, ok, err := db.getBinding(tx, deviceID)
			if err != nil {
				return err
			}
			if !ok || b.UserID != ownerID {
				return abort(companion.ErrNotOwned)
			}
		}
		if bridgeID == "" {
			var err error
			if previous, err = unassign(tx, deviceID); err != nil || previous == "" {
				return err
			}
			return db.markUnserved(tx, deviceID, db.now())
		}
		var br companion.Bridge
		ok, err := getJSON(tx.Bucket(bucketBridges), []byte(bridgeID), &br)
		if err != nil {
			return err
		}
		switch {
		case !ok:
			return abort(companion.ErrNotFound)
		case ownerID != "" && br.OwnerID != ownerID:
			return abort(companion.ErrNotOwned)
		case br.OwnerID != "" && ownerID == "":
			// The operator too keeps a user's bridge to that user's devices.
			b, ok, err := db.getBinding(tx, deviceID)
			if err != nil {
				return err
			}
			if !ok || b.UserID != br.OwnerID {
				return abort(companion.ErrNotOwned)
			}
		}
		previous = string(tx.Bucket(bucketAssignments).Get([]byte(deviceID)))
		if previous != bridgeID {
			// From another bridge, or from none: the seq is the clock of
			// the bridge that reported last, which may have been set a
			// day ahead by a user's bridge before the device was unbound
			// and bound to the next user (bug 241).
			if err := db.forgetSeq(tx, deviceID); err != nil {
				return err
			}
		}
		if previous != "" && previous != bridgeID {
			// Its old bridge's word is no longer the device's: it reads
			// offline until the new bridge reports it.
			if err := db.markUnserved(tx, deviceID, db.now()); err != nil {
				return err
			}
		}
		return assign(tx, deviceID, bridgeID)
	}))
	return previous, err
}

// forgetSeq sets the seq of a device's status and of its reported settings
// to 0 as it moves to another bridge, or reaches one after none: a seq is
// the clock of the bridge that reported it, and the new bridge's reports
// must not wait until its clock passes the old one's (up to a day ahead,
// companion.MaxSeqAhead). What else they hold stays until the new bridge
// reports (the status reads offline meanwhile, markUnserved); the broker
// takes no report of the old one once it has moved.
func (db *DB) forgetSeq(tx *bolt.Tx, deviceID string) error {
	if err := zeroSeq(db, tx.Bucket(bucketStatus), "status", deviceID, func(s *companion.Status) *uint64 { return &s.Seq }); err != nil {
		return err
	}
	return zeroSeq(db, tx.Bucket(bucketSettings), "settings record", deviceID, func(s *companion.Settings) *uint64 { return &s.Seq })
}

// zeroSeq sets to 0 the seq (as seqOf finds it) of the record of id in b,
// when there is one and its seq is not 0 already.
func zeroSeq[T any](db *DB, b *bolt.Bucket, what, id string, seqOf func(*T) *uint64) error {
	var v T
	ok := getOrNone(db, b, what, []byte(id), &v)
	if !ok || *seqOf(&v) == 0 {
		return nil
	}
	*seqOf(&v) = 0
	return putJSON(b, []byte(id), v)
}

// DeviceBridge returns the bridge serving the device, "" when none does.
func (db *DB) DeviceBridge(ctx context.Context, deviceID string) (string, error) {
	var bridge string
	if !validID(deviceID) {
		return "", nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		bridge = string(tx.Bucket(bucketAssignments).Get([]byte(deviceID)))
		return nil
	})
	return bridge, err
}

// DeviceBridges returns the bridge serving each of the devices that one
// serves, in one read; a device no bridge serves (or unknown) is absent.
func (db *DB) DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error) {
	bridges := make(map[string]string, len(deviceIDs))
	err := db.bolt.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketAssignments)
		for _, id := range deviceIDs {
			if !validID(id) {
				continue
			}
			if v := b.Get([]byte(id)); len(v) > 0 {
				bridges[id] = string(v)
			}
		}
		return nil
	})
	return bridges, err
}

// BridgeServes reports whether bridgeID serves deviceID.
func (db *DB) BridgeServes(ctx context.Context, bridgeID, deviceID string) (bool, error) {
	if !validID(bridgeID) || !validID(deviceID) {
		return false, nil
	}
	var ok bool
	err := db.bolt.View(func(tx *bolt.Tx) error {
		ok = tx.Bucket(bucketBridgeServes).Get(key(bridgeID, deviceID)) != nil
		return nil
	})
	return ok, err
}

// ServedDevices returns, in order, the ids of the devices bridgeID serves.
func (db *DB) ServedDevices(ctx context.Context, bridgeID string) ([]string, error) {
	ids := []string{}
	if !validID(bridgeID) {
		return ids, nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		scanPrefix(tx.Bucket(bucketBridgeServes), prefix(bridgeID), func(dev []byte) bool {
			ids = append(ids, string(dev))
			return true
		})
		return nil
	})
	return ids, err
}

// ListBridges returns the bridges of ownerID ("" the operator's) in id
// order, after the bridge id `after`, at most limit of them (limit <= 0:
// all), each with the devices it serves, read in one transaction, and
// whether more follow.
func (db *DB) ListBridges(ctx context.Context, ownerID, after string, limit int) ([]companion.ServingBridge, bool, error) {
	out := []companion.ServingBridge{}
	var more bool
	err := db.bolt.View(func(tx *bolt.Tx) error {
		bridges := tx.Bucket(bucketBridges)
		each := func(id []byte) (bool, error) {
			var b companion.Bridge
			ok, err := getJSON(bridges, id, &b)
			if err != nil {
				// One that does not decode (the file damaged there) is
				// left out and logged: it failed the whole list
				// (docs/reliability.md, bug 595).
				db.logUndecodable("bridge", id, err)
				return true, nil
			}
			if !ok || b.OwnerID != ownerID {
				return true, nil
			}
			// Only one of the owner's own after a full page means more.
			if limit > 0 && len(out) == limit {
				more = true
				return false, nil
			}
			served := []string{}
			scanPrefix(tx.Bucket(bucketBridgeServes), prefix(b.ID), func(dev []byte) bool {
				served = append(served, string(dev))
				return true
			})
			out = append(out, companion.ServingBridge{Bridge: b, Devices: served})
			return true, nil
		}
		if ownerID != "" {
			p := prefix(ownerID)
			c := tx.Bucket(bucketOwnerBridges).Cursor()
			for k, _ := c.Seek(append(bytes.Clone(p), after...)); k != nil && bytes.HasPrefix(k, p); k, _ = c.Next() {
				if string(k[len(p):]) == after {
					continue
				}
				if goOn, err := each(k[len(p):]); err != nil || !goOn {
					return err
				}
			}
			return nil
		}
		c := bridges.Cursor()
		for k, _ := c.Seek([]byte(after)); k != nil; k, _ = c.Next() {
			if string(k) == after {
				continue
			}
			if goOn, err := each(k); err != nil || !goOn {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return out, more, nil
}

// CountBridges returns how many bridges ownerID ("" the operator) has,
// from the owner's index (a user's) or the bridges themselves (the
// operator's), never reading the devices they serve (bug 367).
func (db *DB) CountBridges(ctx context.Context, ownerID string) (int, error) {
	n := 0
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if ownerID != "" {
			if !validID(ownerID) {
				return nil
			}
			scanPrefix(tx.Bucket(bucketOwnerBridges), prefix(ownerID), func([]byte) bool {
				n++
				return true
			})
			return nil
		}
		bridges := tx.Bucket(bucketBridges)
		return bridges.ForEach(func(id, _ []byte) error {
			var b companion.Bridge
			if _, err := getJSON(bridges, id, &b); err != nil {
				return err
			}
			if b.OwnerID == "" {
				n++
			}
			return nil
		})
	})
	return n, err
}

// DeleteBridge removes a bridge, its secret and its assignments, and
// returns the devices it served, which read offline. With ownerID set,
// only one of that user's own bridges goes (ErrNotOwned for another's).
func (db *DB) DeleteBridge(ctx context.Context, bridgeID, ownerID string) ([]string, error) {
	if !validID(bridgeID) {
		return nil, companion.ErrNotFound
	}
	var served []string
	err := db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		served = nil
		var b companion.Bridge
		ok, err := getJSON(tx.Bucket(bucketBridges), []byte(bridgeID), &b)
		if err != nil {
			return err
		}
		if !ok {
			return abort(companion.ErrNotFound)
		}
		if ownerID != "" && b.OwnerID != ownerID {
			return abort(companion.ErrNotOwned)
		}
		scanPrefix(tx.Bucket(bucketBridgeServes), prefix(bridgeID), func(dev []byte) bool {
			served = append(served, string(dev))
			return true
		})
		for _, dev := range served {
			if _, err := unassign(tx, dev); err != nil {
				return err
			}
			if err := db.markUnserved(tx, dev, db.now()); err != nil {
				return err
			}
		}
		if err := tx.Bucket(bucketBridgeSecrets).Delete(b.SecretHash); err != nil {
			return err
		}
		if b.OwnerID != "" {
			if err := tx.Bucket(bucketOwnerBridges).Delete(key(b.OwnerID, b.ID)); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketBridges).Delete([]byte(bridgeID))
	}))
	if err != nil {
		return nil, err
	}
	return served, nil
}

// BlobNeeded reports whether an unfinished command of a device bridgeID
// serves references the blob: only then may the bridge download it.
func (db *DB) BlobNeeded(ctx context.Context, sha, bridgeID string) (bool, error) {
	if !validID(sha) || !validID(bridgeID) {
		return false, nil
	}
	var needed bool
	err := db.bolt.View(func(tx *bolt.Tx) error {
		serves := tx.Bucket(bucketBridgeServes)
		c := tx.Bucket(bucketBlobRefs).Cursor()
		p := prefix(sha)
		for k, dev := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, dev = c.Next() {
			if serves.Get(key(bridgeID, string(dev))) != nil {
				needed = true
				return nil
			}
		}
		return nil
	})
	return needed, err
}
