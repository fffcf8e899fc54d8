package postgres

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

// Bridges serve the devices assigned to them, each device at most one
// bridge (CONTRACT §9): the assignments table.

// assign makes bridgeID serve deviceID in tx, moving it from the bridge
// that served it before, if any.
func assign(ctx context.Context, tx pgx.Tx, deviceID, bridgeID string) error {
	_, err := tx.Exec(ctx, `INSERT INTO assignments (device_id, bridge_id) VALUES ($1, $2)
		ON CONFLICT (device_id) DO UPDATE SET bridge_id = EXCLUDED.bridge_id`, deviceID, bridgeID)
	return err
}

// unassign takes deviceID from the bridge serving it, and returns that
// bridge ("" when none did).
func unassign(ctx context.Context, tx pgx.Tx, deviceID string) (string, error) {
	var old string
	err := tx.QueryRow(ctx, `DELETE FROM assignments WHERE device_id = $1 RETURNING bridge_id`, deviceID).Scan(&old)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return old, err
}

// markUnserved marks offline a device no bridge serves any more (CONTRACT
// §9), or that moved to another bridge, which has not reported it yet, and
// its status names no bridge from then on, online or not (the
// bbolt engine's markUnserved). Seq and LastSeen stay, so the next report
// applies as usual. The caller holds the status's lock (lockReports).
func (s *Store) markUnserved(ctx context.Context, tx pgx.Tx, deviceID string, now time.Time) error {
	var r statusRow
	err := tx.QueryRow(ctx, `UPDATE statuses SET online = false, bridge_id = '', updated_at = $2 WHERE device_id = $1 AND online
		RETURNING `+statusColumnsOf("statuses"), deviceID, now).Scan(r.dest()...)
	if errors.Is(err, pgx.ErrNoRows) {
		// No status, or offline already: no event, but no bridge either.
		_, err := tx.Exec(ctx, `UPDATE statuses SET bridge_id = '', updated_at = $2 WHERE device_id = $1 AND bridge_id <> ''`, deviceID, now)
		return err
	}
	if err != nil {
		return err
	}
	st, err := r.status(deviceID)
	if err != nil {
		return err
	}
	return s.insertDeviceEvent(ctx, tx, st)
}

// lockReports locks, in tx, the device's status and, with settings, its
// settings: each row, or while the device has none, the advisory lock
// that its first write takes (lockStatusSQL, lockSettings). A move takes
// them whether it changes the rows or not: a report of the bridge the
// device leaves, whose write checked the device's bridge before the move
// committed (fromItsBridgeSQL, putReportedSettings), then commits before
// the move, which undoes it, or waits for the move and is refused. Taken
// only when the move changed them, a move of a device offline already
// (seq 0, no bridge: moved before and not reported since), or of one with
// no status or settings yet, took no lock, and the late report landed
// after it: the device read online on the bridge it left, or that
// bridge's settings, its clock ahead, held the new bridge's off
// (docs/reliability.md, bug 288). The status before the settings, as
// every write takes them.
func lockReports(ctx context.Context, tx pgx.Tx, deviceID string, settings bool) error {
	key := statusLockKey(deviceID)
	var b pgx.Batch
	b.Queue(lockStatusSQL, deviceID, lockClassStatus, key)
	b.Queue(`SELECT 1 FROM statuses WHERE device_id = $1 FOR UPDATE`, deviceID)
	if settings {
		b.Queue(`SELECT pg_advisory_xact_lock($2, $3) WHERE NOT EXISTS (SELECT 1 FROM settings WHERE device_id = $1)`,
			deviceID, lockClassSettings, key)
		b.Queue(`SELECT 1 FROM settings WHERE device_id = $1 FOR UPDATE`, deviceID)
	}
	return sendBatch(ctx, tx, &b)
}

// bindingOwner returns the user the device is bound to ("" none).
func bindingOwner(ctx context.Context, tx pgx.Tx, deviceID string) (string, error) {
	var user string
	err := tx.QueryRow(ctx, `SELECT user_id FROM bindings WHERE device_id = $1`, deviceID).Scan(&user)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return user, err
}

// AssignDevice makes bridgeID serve deviceID, or no bridge when bridgeID is
// "" (the device then reads offline), and returns the bridge that served
// it before ("" none). With ownerID set, it is a user's request: the
// device must be bound to that user and the bridge must be one of that
// user's own (ErrNotOwned otherwise; an unassignment needs only the
// device). ErrNotFound means no such device or bridge.
func (s *Store) AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (previous string, err error) {
	if !validID(deviceID) || (bridgeID != "" && !validID(bridgeID)) {
		return "", companion.ErrNotFound
	}
	err = s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		previous = ""
		// The device's row is the lock of its assignment.
		var one int
		if err := tx.QueryRow(ctx, `SELECT 1 FROM devices WHERE id = $1 FOR UPDATE`, deviceID).Scan(&one); err != nil {
			return notFound(err)
		}
		bound, err := bindingOwner(ctx, tx, deviceID)
		if err != nil {
			return err
		}
		if ownerID != "" && bound != ownerID {
			return companion.ErrNotOwned
		}
		if bridgeID == "" {
			if previous, err = unassign(ctx, tx, deviceID); err != nil || previous == "" {
				return err
			}
			if err := lockReports(ctx, tx, deviceID, false); err != nil {
				return err
			}
			return s.markUnserved(ctx, tx, deviceID, s.clock())
		}
		var owner string
		if err := tx.QueryRow(ctx, `SELECT owner_id FROM bridges WHERE id = $1 FOR SHARE`, bridgeID).Scan(&owner); err != nil {
			return notFound(err)
		}
		switch {
		case ownerID != "" && owner != ownerID:
			return companion.ErrNotOwned
		case owner != "" && ownerID == "" && bound != owner:
			// The operator too keeps a user's bridge to that user's devices.
			return companion.ErrNotOwned
		}
		err = tx.QueryRow(ctx, `SELECT bridge_id FROM assignments WHERE device_id = $1`, deviceID).Scan(&previous)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if previous != bridgeID {
			if err := lockReports(ctx, tx, deviceID, true); err != nil {
				return err
			}
			// A seq is its bridge's own clock: the new bridge's reports
			// must not wait until its clock passes the old one's (the
			// bbolt engine's forgetSeq); from no bridge too, the seq is
			// the last bridge's (bug 241).
			if _, err := tx.Exec(ctx, `UPDATE statuses SET seq = 0 WHERE device_id = $1 AND seq <> 0`, deviceID); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE settings SET seq = 0 WHERE device_id = $1 AND seq <> 0`, deviceID); err != nil {
				return err
			}
		}
		if previous != "" && previous != bridgeID {
			// Its old bridge's word is no longer the device's: it reads
			// offline until the new bridge reports it.
			if err := s.markUnserved(ctx, tx, deviceID, s.clock()); err != nil {
				return err
			}
		}
		return assign(ctx, tx, deviceID, bridgeID)
	}))
	if err != nil {
		return "", err
	}
	return previous, nil
}

// DeviceBridge returns the bridge serving the device, "" when none does.
func (s *Store) DeviceBridge(ctx context.Context, deviceID string) (string, error) {
	if !validID(deviceID) {
		return "", nil
	}
	var bridge string
	err := s.pool.QueryRow(ctx, `SELECT bridge_id FROM assignments WHERE device_id = $1`, deviceID).Scan(&bridge)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return bridge, err
}

// DeviceBridges returns the bridge serving each of the devices that one
// serves, in one query; a device no bridge serves (or unknown) is absent.
func (s *Store) DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error) {
	ids := make([]string, 0, len(deviceIDs))
	for _, id := range deviceIDs {
		if validID(id) {
			ids = append(ids, id)
		}
	}
	bridges := make(map[string]string, len(ids))
	if len(ids) == 0 {
		return bridges, nil
	}
	rows, err := s.pool.Query(ctx, `SELECT device_id, bridge_id FROM assignments WHERE device_id = ANY($1)`, ids)
	if err != nil {
		return nil, err
	}
	var dev, bridge string
	_, err = pgx.ForEachRow(rows, []any{&dev, &bridge}, func() error {
		bridges[dev] = bridge
		return nil
	})
	if err != nil {
		return nil, err
	}
	return bridges, nil
}

// BridgeServes reports whether bridgeID serves deviceID.
func (s *Store) BridgeServes(ctx context.Context, bridgeID, deviceID string) (bool, error) {
	if !validID(bridgeID) || !validID(deviceID) {
		return false, nil
	}
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM assignments WHERE device_id = $1 AND bridge_id = $2)`, deviceID, bridgeID).Scan(&ok)
	return ok, err
}

// ServedDevices returns, in order, the ids of the devices bridgeID serves.
func (s *Store) ServedDevices(ctx context.Context, bridgeID string) ([]string, error) {
	if !validID(bridgeID) {
		return []string{}, nil
	}
	return s.strings(ctx, `SELECT device_id FROM assignments WHERE bridge_id = $1 ORDER BY device_id`, bridgeID)
}

// strings runs a query of one text column and returns its values, an
// empty (non-nil) slice for none.
func (s *Store) strings(ctx context.Context, query string, args ...any) ([]string, error) {
	rows, _ := s.pool.Query(ctx, query, args...)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	if ids == nil {
		ids = []string{}
	}
	return ids, nil
}

// ListBridges returns the bridges of ownerID ("" the operator's) in id
// order, after the bridge id `after`, at most limit of them (limit <= 0:
// all), each with the devices it serves, read in one query, and whether
// more follow.
func (s *Store) ListBridges(ctx context.Context, ownerID, after string, limit int) ([]companion.ServingBridge, bool, error) {
	out := []companion.ServingBridge{}
	if (ownerID != "" && !validID(ownerID)) || (after != "" && !validID(after)) {
		return out, false, nil
	}
	rows, err := s.pool.Query(ctx, `SELECT `+bridgeColumns+`, ARRAY(SELECT device_id FROM assignments
			WHERE bridge_id = bridges.id ORDER BY device_id)
		FROM bridges WHERE owner_id = $1 AND id > $2 ORDER BY id LIMIT $3`, ownerID, after, pageLimit(limit))
	if err != nil {
		return nil, false, err
	}
	defer rows.Close()
	for rows.Next() {
		var b companion.ServingBridge
		if err := rows.Scan(&b.ID, &b.SecretHash, &b.OwnerID, &b.CreatedAt, &b.Devices); err != nil {
			return nil, false, err
		}
		b.CreatedAt = b.CreatedAt.UTC()
		if b.Devices == nil {
			b.Devices = []string{}
		}
		out = append(out, b)
	}
	if err := rows.Err(); err != nil {
		return nil, false, err
	}
	out, more := trimPage(out, limit)
	return out, more, nil
}

// CountBridges returns how many bridges ownerID ("" the operator) has,
// from the index bridges_by_owner, never reading the devices they serve
// (bug 367).
func (s *Store) CountBridges(ctx context.Context, ownerID string) (int, error) {
	if ownerID != "" && !validID(ownerID) {
		return 0, nil
	}
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM bridges WHERE owner_id = $1`, ownerID).Scan(&n)
	return n, err
}

// pageLimit is the LIMIT of a query for a page of at most limit items
// (limit <= 0: all): one more, to learn whether more follow.
func pageLimit(limit int) any {
	if limit <= 0 {
		return nil // LIMIT NULL: no limit
	}
	return limit + 1
}

// trimPage cuts what a pageLimit query returned to the page, and says
// whether more followed.
func trimPage[T any](items []T, limit int) ([]T, bool) {
	if limit > 0 && len(items) > limit {
		return items[:limit], true
	}
	return items, false
}

// DeleteBridge removes a bridge, its secret and its assignments, and
// returns the devices it served, which read offline. With ownerID set,
// only one of that user's own bridges goes (ErrNotOwned for another's).
func (s *Store) DeleteBridge(ctx context.Context, bridgeID, ownerID string) ([]string, error) {
	if !validID(bridgeID) {
		return nil, companion.ErrNotFound
	}
	var served []string
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		served = nil
		var owner string
		if err := tx.QueryRow(ctx, `SELECT owner_id FROM bridges WHERE id = $1 FOR UPDATE`, bridgeID).Scan(&owner); err != nil {
			return notFound(err)
		}
		if ownerID != "" && owner != ownerID {
			return companion.ErrNotOwned
		}
		rows, _ := tx.Query(ctx, `DELETE FROM assignments WHERE bridge_id = $1 RETURNING device_id`, bridgeID)
		devs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		slices.Sort(devs)
		now := s.clock()
		for _, dev := range devs {
			if err := lockReports(ctx, tx, dev, false); err != nil {
				return err
			}
			if err := s.markUnserved(ctx, tx, dev, now); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `DELETE FROM bridges WHERE id = $1`, bridgeID); err != nil {
			return err
		}
		served = devs
		return nil
	}))
	if err != nil {
		return nil, err
	}
	return served, nil
}

// BlobNeeded reports whether an unfinished command of a device bridgeID
// serves references the blob: only then may the bridge download it.
func (s *Store) BlobNeeded(ctx context.Context, sha, bridgeID string) (bool, error) {
	if !validID(sha) || !validID(bridgeID) {
		return false, nil
	}
	var needed bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (
		SELECT 1 FROM commands c JOIN assignments a ON a.device_id = c.device_id
		WHERE c.blob = $1 AND c.state IN `+openStates+` AND a.bridge_id = $2)`, sha, bridgeID).Scan(&needed)
	return needed, err
}
