package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"slices"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

// statusColumnsOf lists the columns statusRow scans, of the table alias t.
func statusColumnsOf(t string) string {
	return t + ".device_id, " + t + ".online, " + t + ".battery, " + t + ".firmware_version, " + t + ".model, " +
		t + ".apps, " + t + ".bridge_id, " + t + ".last_seen, " + t + ".updated_at, " + t + ".seq::text"
}

// statusRow is a row of statuses as scanned, every column nullable (a
// device without one, through a LEFT JOIN).
type statusRow struct {
	deviceID, firmware, model, bridge, seq *string
	online                                 *bool
	battery                                *int32
	apps                                   []byte
	lastSeen, updatedAt                    *time.Time
}

func (r *statusRow) dest() []any {
	return []any{&r.deviceID, &r.online, &r.battery, &r.firmware, &r.model, &r.apps, &r.bridge, &r.lastSeen, &r.updatedAt, &r.seq}
}

// status returns the status the row holds: the zero Status with DeviceID
// set when there was none.
func (r *statusRow) status(deviceID string) (companion.Status, error) {
	s := companion.Status{DeviceID: deviceID}
	if r.deviceID == nil {
		return s, nil
	}
	s.Online, s.FirmwareVersion, s.Model, s.BridgeID = *r.online, *r.firmware, *r.model, *r.bridge
	if r.battery != nil {
		b := int(*r.battery)
		s.Battery = &b
	}
	if len(r.apps) > 0 {
		if err := json.Unmarshal(r.apps, &s.Apps); err != nil {
			return companion.Status{}, fmt.Errorf("postgres: status %s: apps: %w", deviceID, err)
		}
	}
	s.LastSeen, s.UpdatedAt = r.lastSeen.UTC(), r.updatedAt.UTC()
	seq, err := parseSeq(*r.seq)
	if err != nil {
		return companion.Status{}, err
	}
	s.Seq = seq
	return s, nil
}

// lockStatusSQL takes the transaction's advisory lock of the device $1
// (lockClassStatus, $3 its statusLockKey) when the device has no status
// yet, and nothing when it has one: see putStatus.
const lockStatusSQL = `SELECT pg_advisory_xact_lock($2, $3) WHERE NOT EXISTS (SELECT 1 FROM statuses WHERE device_id = $1)`

// statusLockKey is the second key of a device's advisory lock: its
// deviceHash above the low half of the FNV-1a hash that deviceHash folds
// (so as unique as that hash). A lane's batch takes its writes' locks in
// the order of their devices' hashes, and two devices whose keys are one
// share a deviceHash: the lock adds no order between devices that their
// rows' locks do not have already (a deadlock among those is PostgreSQL's
// to break, and the writes run again: runBatch).
func statusLockKey(deviceID string) int32 {
	h := fnv.New32a()
	h.Write([]byte(deviceID))
	return int32(uint32(deviceHash(deviceID))<<16 | h.Sum32()&0xffff)
}

// newer is companion.Newer, the rule of reports, in SQL over the excluded
// (new) row and the stored one of the table t, with limit the parameter of
// companion.SeqLimit (as text): a higher seq wins, and an equal seq with a
// later time; a stored seq past the limit loses to any within it.
func newerSQL(t, at, limit string) string {
	return `((` + t + `.seq > ` + limit + `::text::numeric AND EXCLUDED.seq <= ` + limit + `::text::numeric)
		OR EXCLUDED.seq > ` + t + `.seq OR (EXCLUDED.seq = ` + t + `.seq AND EXCLUDED.` + at + ` > ` + t + `.` + at + `))`
}

// Status returns the device's last reported status. A device that never
// reported gets the zero Status with DeviceID set, and no error.
func (s *Store) Status(ctx context.Context, deviceID string) (companion.Status, error) {
	if !validID(deviceID) {
		return companion.Status{DeviceID: deviceID}, nil
	}
	var r statusRow
	err := s.pool.QueryRow(ctx, `SELECT `+statusColumnsOf("statuses")+` FROM statuses WHERE device_id = $1`, deviceID).Scan(r.dest()...)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return companion.Status{}, err
	}
	return r.status(deviceID)
}

// PutStatus stores s when it is newer than the stored status (higher Seq,
// or equal Seq and later LastSeen) and reports whether it did. UpdatedAt
// is set to now.
func (s *Store) PutStatus(ctx context.Context, st companion.Status) (bool, error) {
	return awaitBool(ctx, func(done func(bool, error)) { s.putStatusAsync(ctx, st, done) })
}

// awaitBool runs a lane write and waits for its outcome, or for ctx.
func awaitBool(ctx context.Context, start func(done func(bool, error))) (bool, error) {
	type result struct {
		ok  bool
		err error
	}
	ch := make(chan result, 1)
	start(func(ok bool, err error) { ch <- result{ok, err} })
	r, err := wait(ctx, ch)
	if err != nil {
		return false, err
	}
	return r.ok, r.err
}

// PutStatusAsync is PutStatus without the wait: done (if not nil) gets its
// results once the status is committed, after the device's writes made
// before.
func (s *Store) PutStatusAsync(st companion.Status, done func(applied bool, err error)) {
	s.putStatusAsync(context.Background(), st, done)
}

// putStatusAsync runs PutStatus on the device's lane in ctx (Background
// for an asynchronous call), and not at all once ctx is done.
func (s *Store) putStatusAsync(ctx context.Context, st companion.Status, done func(bool, error)) {
	if done == nil {
		done = func(bool, error) {}
	}
	if !validID(st.DeviceID) || (st.BridgeID != "" && !validID(st.BridgeID)) {
		done(false, fmt.Errorf("%w: status needs a device id", companion.ErrInvalid))
		return
	}
	var applied bool
	ok := s.submit(job{
		ctx: ctx,
		key: deviceHash(st.DeviceID),
		body: func(ctx context.Context, tx pgx.Tx) error {
			var err error
			applied, err = s.putStatus(ctx, tx, st)
			return err
		},
		finish: func(err error) { done(applied && err == nil, err) },
	})
	if !ok {
		done(false, ErrClosed)
	}
}

// fromItsBridgeSQL holds for a status ($1 the device, $7 the bridge that
// reported it) of no bridge, or of the bridge that serves the device.
// The broker checks the device's bridge before the write; a move that
// commits in between sets the device offline with seq 0, which the bridge
// it left, its clock for a seq, would overwrite: the device read online on
// that bridge for good (docs/reliability.md, bug 266). A move to no bridge
// (an unassignment, the bridge deleted) sets it offline too, and the
// bridge it left, with a higher seq, did the same (bug 271). The move
// updates the status row, whose lock the statement before the upsert waits
// for: the upsert's snapshot has the move's assignment. The move locks the
// row, or while there is none the advisory lock of lockStatusSQL, whether
// it changes the status or not (lockReports): a move of a device offline
// already waits for a report that checked the bridge before it, and then
// sets the device offline over it (bug 288).
const fromItsBridgeSQL = `($7 = '' OR EXISTS (SELECT 1 FROM assignments a WHERE a.device_id = $1 AND a.bridge_id = $7))`

// putStatus is PutStatus inside a transaction; st is checked already.
func (s *Store) putStatus(ctx context.Context, tx pgx.Tx, st companion.Status) (bool, error) {
	var apps []byte
	if st.Apps != nil {
		var err error
		if apps, err = json.Marshal(st.Apps); err != nil {
			return false, err
		}
	}
	var battery *int32
	if st.Battery != nil {
		b := int32(*st.Battery)
		battery = &b
	}
	// One statement stores the status and, when it applied and changed
	// what a user sees (companion.DeviceEventDue), the event for the
	// user the device is bound to (events.go). No apps (NULL) and an empty
	// list are the same to a user: an event shows both as [].
	//
	// It compares with the status its snapshot holds, and under READ
	// COMMITTED that snapshot is taken when the statement starts: had the
	// statement itself waited for the row (the report of another replica
	// being stored), it would compare with the status from before that
	// report, while the upsert applies over the report. A change that
	// undid the other report's (online again offline) would then read as
	// no change, and the user's last event would say what is no longer
	// true. So a statement before it, in the same round trip, takes the
	// row's lock and waits for any write under way: the statement that
	// stores starts after it.
	//
	// A device's first status has no row to lock yet: of two first
	// reports at once, on two replicas, the second's upsert would wait for
	// the first's insert inside the statement, compare with no status at
	// all (announcing a change it did not make), and store its event with
	// an xid from before the first's commit (its transaction's own, taken
	// by an earlier write of its lane's batch): the event read before the
	// first's, the user's last word on the device the first report. So
	// while the device has no status, the statement before takes the
	// device's advisory lock (lockStatusSQL), which the first report holds
	// until it commits: the second then finds its row, locks it, and
	// stores as after any other wait. Once the row exists (statuses are
	// never deleted) the row lock alone orders the reports.
	now := s.clock()
	ns := st
	ns.UpdatedAt = now
	event, err := json.Marshal(companion.DeviceChanged("", ns))
	if err != nil {
		return false, err
	}
	var b pgx.Batch
	b.Queue(lockStatusSQL, st.DeviceID, lockClassStatus, statusLockKey(st.DeviceID))
	b.Queue(`SELECT 1 FROM statuses WHERE device_id = $1 FOR UPDATE`, st.DeviceID)
	b.Queue(`WITH old AS (
			SELECT online, battery, firmware_version, apps::text AS apps FROM statuses WHERE device_id = $1),
		up AS (
			INSERT INTO statuses AS t (device_id, online, battery, firmware_version, model, apps, bridge_id, last_seen, updated_at, seq)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::text::numeric)
			ON CONFLICT (device_id) DO UPDATE SET online = EXCLUDED.online, battery = EXCLUDED.battery,
				firmware_version = EXCLUDED.firmware_version, model = EXCLUDED.model, apps = EXCLUDED.apps,
				bridge_id = EXCLUDED.bridge_id, last_seen = EXCLUDED.last_seen, updated_at = EXCLUDED.updated_at, seq = EXCLUDED.seq
			WHERE `+newerSQL("t", "last_seen", "$12")+` AND `+fromItsBridgeSQL+`
			RETURNING device_id),
		ev AS (
			INSERT INTO events (xid, user_id, device_id, at, data)
			SELECT `+s.eventXidSQL("b.user_id")+`, b.user_id, b.device_id, $9, $11 FROM up JOIN bindings b ON b.device_id = up.device_id
			WHERE NOT EXISTS (SELECT 1 FROM old WHERE old.online = $2 AND old.battery IS NOT DISTINCT FROM $3
				AND old.firmware_version = $4 AND coalesce(old.apps, '[]') = coalesce($6::json::text, '[]'))
			RETURNING 1),
		notified AS (SELECT pg_notify('`+eventsChannel+`', '') FROM ev LIMIT 1)
		SELECT (SELECT count(*) FROM up) + 0 * (SELECT count(*) FROM notified)`,
		st.DeviceID, st.Online, battery, st.FirmwareVersion, st.Model, apps, st.BridgeID, st.LastSeen, now, seqText(st.Seq), event,
		seqText(companion.SeqLimit(now)))
	br := tx.SendBatch(ctx, &b)
	var applied int
	for range 2 {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return false, err
		}
	}
	if err := br.QueryRow().Scan(&applied); err != nil {
		_ = br.Close()
		return false, err
	}
	if err := br.Close(); err != nil {
		return false, err
	}
	return applied == 1, nil
}

// MarkBridgeOffline marks offline every device online whose current status
// names the bridge, as when the bridge's MQTT Will fires, and returns their
// ids in order. UpdatedAt is set to now; Seq and LastSeen are kept, so the
// bridge's next report applies as usual. A device offline already is left
// as it is, and not returned (bug 456, as the bbolt engine).
func (s *Store) MarkBridgeOffline(ctx context.Context, bridgeID string) ([]string, error) {
	type result struct {
		ids []string
		err error
	}
	ch := make(chan result, 1)
	s.MarkBridgeOfflineAsync(bridgeID, func(ids []string, err error) { ch <- result{ids, err} })
	r, err := wait(ctx, ch)
	if err != nil {
		return nil, err
	}
	return r.ids, r.err
}

// MarkBridgeOfflineAsync is MarkBridgeOffline without the wait: done gets
// its results once the change is committed. It applies after every write
// of the store made before it, and before every one made after it.
func (s *Store) MarkBridgeOfflineAsync(bridgeID string, done func(ids []string, err error)) {
	if done == nil {
		done = func([]string, error) {}
	}
	if !validID(bridgeID) {
		done([]string{}, nil)
		return
	}
	ok := s.barrier(func(ctx context.Context) {
		var ids []string
		err := s.tx(ctx, func(tx pgx.Tx) error {
			// The devices going offline now have events (events.go), in
			// device order as the bbolt engine appends them. Every
			// device the bridge's status names is locked first, and
			// exactly those are changed: a second statement that chose
			// them again would take with them a device whose report
			// (another replica's, committed while this one waited for a
			// lock) named the bridge only after the first statement's
			// snapshot, and mark it offline with no event, its user's
			// last word on it "online". A locked row is read as it is
			// now, report included.
			now := s.clock()
			rows, _ := tx.Query(ctx, `SELECT `+statusColumnsOf("statuses")+` FROM statuses WHERE bridge_id = $1 ORDER BY device_id FOR UPDATE`, bridgeID)
			var going []companion.Status
			ids = nil
			for rows.Next() {
				var r statusRow
				if err := rows.Scan(r.dest()...); err != nil {
					rows.Close()
					return err
				}
				st, err := r.status(*r.deviceID)
				if err != nil {
					rows.Close()
					return err
				}
				if st.Online {
					ids = append(ids, st.DeviceID)
					going = append(going, st)
				}
			}
			if err := rows.Err(); err != nil {
				return err
			}
			if len(ids) == 0 {
				return nil
			}
			if _, err := tx.Exec(ctx, `UPDATE statuses SET online = false, updated_at = $2 WHERE device_id = ANY($1)`, ids, now); err != nil {
				return err
			}
			for _, st := range going {
				st.Online, st.UpdatedAt = false, now
				if err := s.insertDeviceEvent(ctx, tx, st); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			done(nil, err)
			return
		}
		if ids == nil {
			ids = []string{}
		}
		slices.Sort(ids)
		done(ids, nil)
	})
	if !ok {
		done(nil, ErrClosed)
	}
}

// BridgeDevices returns, in order, the ids of the devices whose current
// status names the bridge.
func (s *Store) BridgeDevices(ctx context.Context, bridgeID string) ([]string, error) {
	if !validID(bridgeID) {
		return []string{}, nil
	}
	return s.strings(ctx, `SELECT device_id FROM statuses WHERE bridge_id = $1 ORDER BY device_id`, bridgeID)
}

// settingsRow is a row of settings as scanned.
type settingsRow struct {
	reported, desired, schema []byte
	seq                       string
	s                         companion.Settings
}

const settingsColumns = `reported, desired, schema, at, seq::text, updated_at`

func (r *settingsRow) dest() []any {
	return []any{&r.reported, &r.desired, &r.schema, &r.s.At, &r.seq, &r.s.UpdatedAt}
}

// settings decodes the row into r.s.
func (r *settingsRow) settings() error {
	if err := json.Unmarshal(r.reported, &r.s.Reported); err != nil {
		return fmt.Errorf("postgres: settings of %s: %w", r.s.DeviceID, err)
	}
	if err := json.Unmarshal(r.desired, &r.s.Desired); err != nil {
		return fmt.Errorf("postgres: settings of %s: %w", r.s.DeviceID, err)
	}
	if len(r.schema) > 0 {
		r.s.Schema = json.RawMessage(r.schema)
	}
	seq, err := parseSeq(r.seq)
	if err != nil {
		return err
	}
	r.s.Seq = seq
	r.s.At, r.s.UpdatedAt = r.s.At.UTC(), r.s.UpdatedAt.UTC()
	fillMaps(&r.s)
	return nil
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

// Settings returns the device's settings. A device with none gets the zero
// value with DeviceID set and empty (non-nil) maps.
func (s *Store) Settings(ctx context.Context, deviceID string) (companion.Settings, error) {
	r := settingsRow{s: companion.Settings{DeviceID: deviceID}}
	if validID(deviceID) {
		err := s.pool.QueryRow(ctx, `SELECT `+settingsColumns+` FROM settings WHERE device_id = $1`, deviceID).Scan(r.dest()...)
		switch {
		case err == nil:
			if err := r.settings(); err != nil {
				return companion.Settings{}, err
			}
		case !errors.Is(err, pgx.ErrNoRows):
			return companion.Settings{}, err
		}
	}
	fillMaps(&r.s)
	return r.s, nil
}

// lockSettings reads the device's settings FOR UPDATE, making the row
// when there is none (under the device's advisory lock of lockClassSettings,
// see lockReports): found says whether there was one.
func lockSettings(ctx context.Context, tx pgx.Tx, deviceID string, now time.Time) (r settingsRow, found bool, err error) {
	for {
		r = settingsRow{s: companion.Settings{DeviceID: deviceID}}
		err = tx.QueryRow(ctx, `SELECT `+settingsColumns+` FROM settings WHERE device_id = $1 FOR UPDATE`, deviceID).Scan(r.dest()...)
		if err == nil {
			return r, true, r.settings()
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return r, false, err
		}
		// A device's first settings take its advisory lock, which a move
		// takes too while the device has none (lockReports): the move
		// then waits for a report of the bridge it leaves that checked
		// the device's bridge before it (putReportedSettings).
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, $2)`, lockClassSettings, statusLockKey(deviceID)); err != nil {
			return r, false, err
		}
		tag, err := tx.Exec(ctx, `INSERT INTO settings (device_id, reported, desired, at, seq, updated_at)
			VALUES ($1, '{}', '{}', '0001-01-01 00:00:00+00', 0, $2) ON CONFLICT (device_id) DO NOTHING`, deviceID, now)
		if err != nil {
			return r, false, err
		}
		if tag.RowsAffected() == 1 {
			// Ours, locked by the insert.
			r.s.UpdatedAt = now
			fillMaps(&r.s)
			return r, false, nil
		}
		// Another transaction made it meanwhile: lock that one.
	}
}

// writeSettings stores r.s as the device's settings.
func writeSettings(ctx context.Context, tx pgx.Tx, st companion.Settings) error {
	reported, err := json.Marshal(st.Reported)
	if err != nil {
		return err
	}
	desired, err := json.Marshal(st.Desired)
	if err != nil {
		return err
	}
	var schema []byte
	if len(st.Schema) > 0 {
		schema = st.Schema
	}
	_, err = tx.Exec(ctx, `UPDATE settings SET reported = $2, desired = $3, schema = $4, at = $5, seq = $6::text::numeric, updated_at = $7 WHERE device_id = $1`,
		st.DeviceID, reported, desired, schema, st.At, seqText(st.Seq), st.UpdatedAt)
	return err
}

// PutReportedSettings stores the settings a device reported when the
// report is newer than the stored one (same rule as PutStatus), and
// reports whether it did. reported replaces the stored set; schema
// replaces the stored schema unless it is empty. Each desired key whose
// value the device now reports is dropped: it is no longer pending.
// bridgeID, when set, is the bridge the caller found serving the device:
// the settings are not stored unless it serves the device still (see
// putReportedSettings).
func (s *Store) PutReportedSettings(ctx context.Context, deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64) (bool, error) {
	return awaitBool(ctx, func(done func(bool, error)) {
		s.putReportedSettingsAsync(ctx, deviceID, bridgeID, reported, schema, at, seq, done)
	})
}

// PutReportedSettingsAsync is PutReportedSettings without the wait: done
// (if not nil) gets its results once the settings are committed, after
// the device's writes made before.
func (s *Store) PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(applied bool, err error)) {
	s.putReportedSettingsAsync(context.Background(), deviceID, bridgeID, reported, schema, at, seq, done)
}

func (s *Store) putReportedSettingsAsync(ctx context.Context, deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(applied bool, err error)) {
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
	ok := s.submit(job{
		ctx: ctx,
		key: deviceHash(deviceID),
		body: func(ctx context.Context, tx pgx.Tx) error {
			var err error
			applied, err = s.putReportedSettings(ctx, tx, deviceID, bridgeID, r)
			return err
		},
		finish: func(err error) { done(applied && err == nil, err) },
	})
	if !ok {
		done(false, ErrClosed)
	}
}

// putReportedSettings is PutReportedSettings inside a transaction; r is
// checked and compacted already. Settings reported through bridgeID (""
// when the caller names none) are not stored unless that bridge serves
// the device now: the broker checked the device's bridge before the
// write, and a move that committed in between set the settings' seq to 0.
// Stored over that, the bridge it left, its clock for a seq (up to a day
// ahead), held the new bridge's reports off: GET …/settings read the old
// bridge's values, and a change that succeeded did not show
// (docs/reliability.md, bug 272). The move locks the settings row, or
// while there is none the advisory lock that a first write takes
// (lockReports), and lockSettings waits for either: the statement after
// it reads the move's assignment, or the move waits for this write (bug
// 288).
func (s *Store) putReportedSettings(ctx context.Context, tx pgx.Tx, deviceID, bridgeID string, r companion.ReportedSettings) (bool, error) {
	now := s.clock()
	row, found, err := lockSettings(ctx, tx, deviceID, now)
	if err != nil {
		return false, err
	}
	if bridgeID != "" {
		var serves bool
		err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM assignments WHERE device_id = $1 AND bridge_id = $2)`, deviceID, bridgeID).Scan(&serves)
		if err != nil || !serves {
			return false, err
		}
	}
	st := row.s
	// Stored times have microseconds: r.At is compared and kept as stored.
	r.At = pgTime(r.At)
	if found && !companion.Newer(r.Seq, r.At, st.Seq, st.At, now) {
		return false, nil
	}
	r.ApplyTo(&st)
	st.UpdatedAt = now
	if err := writeSettings(ctx, tx, st); err != nil {
		return false, err
	}
	return true, nil
}

// withdrawDesired takes out, in tx, the desired settings that c asked
// for when it is a settings command that has just ended without
// succeeding (companion.Command.WithdrawsDesired), but those a later
// settings command of its device asked for, and gives back those an
// earlier settings command still open asked for, unless one after it
// succeeded (companion.Settings.Withdraw): nothing will apply c's, and
// they were left desired and pending for good (bug 236), while an earlier
// change still open was left out of them (bug 251). The settings row is taken
// last, as every write that changes it does (after the command's row,
// the device's queue and its status). An unbinding needs none of it: it
// drops every desired setting.
func withdrawDesired(ctx context.Context, tx pgx.Tx, c companion.Command, now time.Time) error {
	if !c.WithdrawsDesired() {
		return nil
	}
	r := settingsRow{s: companion.Settings{DeviceID: c.DeviceID}}
	err := tx.QueryRow(ctx, `SELECT `+settingsColumns+` FROM settings WHERE device_id = $1 FOR UPDATE`, c.DeviceID).Scan(r.dest()...)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case err != nil:
		return err
	}
	if err := r.settings(); err != nil || len(r.s.Desired) == 0 {
		return err
	}
	// Those after c, and those before it not final, or succeeded after
	// the oldest of those (companion.Settings.Withdraw).
	rows, err := tx.Query(ctx, `SELECT `+commandColumns+` FROM commands WHERE device_id = $1 AND op = $3
		AND (id > $2 OR (id < $2 AND (state IN `+openStates+` OR (state = $4 AND id > (
			SELECT id FROM commands WHERE device_id = $1 AND op = $3 AND id < $2 AND state IN `+openStates+`
			ORDER BY id LIMIT 1)))))`,
		c.DeviceID, c.ID, companion.OpSettingsUpdate, companion.StateSucceeded)
	if err != nil {
		return err
	}
	others, err := appendCommands(nil, rows)
	if err != nil {
		return err
	}
	if !r.s.Withdraw(c, others) {
		return nil
	}
	r.s.UpdatedAt = now
	return writeSettings(ctx, tx, r.s)
}

// mergeDesired records, in tx, values a user asked of the device: each
// key of want (checked and compacted by companion.NewDesiredSettings)
// replaces the desired value of that key. CreateCommand calls it for a
// settings command it stores, so that the desired settings follow the
// order of the commands.
func mergeDesired(ctx context.Context, tx pgx.Tx, deviceID string, want map[string]json.RawMessage, now time.Time) error {
	row, _, err := lockSettings(ctx, tx, deviceID, now)
	if err != nil {
		return err
	}
	maps.Copy(row.s.Desired, want)
	row.s.UpdatedAt = now
	return writeSettings(ctx, tx, row.s)
}
