package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

// The event log (migration 0002). The writes that change a command or a
// status insert their events in their own transaction, and notify the
// channel companion_events (see ListenEvents) on commit.
//
// An id from a sequence is not in commit order: of two transactions,
// the one that took id 10 may commit after the one that took id 11, and
// a reader that saw 11 and resumed after it would miss 10. So each event
// also keeps the id of the transaction that wrote it (pg_current_xact_id,
// a 64-bit xid8 that never wraps), the log is ordered by (xid, id), and a
// reader reads only the events whose xid is below the xmin of its own
// snapshot (pg_snapshot_xmin): every transaction below it has ended,
// committed (and visible) or rolled back, so no event can ever appear
// before the last one read. An event shows once every transaction that
// began before it has ended: a long write transaction elsewhere on the
// server delays the events committed meanwhile, it does not lose them.
//
// The xid an event is stored with is its place in the log, and xids are
// handed out when a transaction first writes, not when it commits nor
// when it takes the lock of the command or device the event is about. A
// transaction that took its xid early (an unbind, with the device's lock;
// a lane's batch, with the write of another device) and then waited for a
// command that another, with a later xid, changed and committed meanwhile
// would put its own event of the command before that one: a reader would
// see the command failed, then delivered. So an event is stored with
// eventXidSQL: its transaction's xid, or the highest xid among the user's
// events already committed when that is higher. Every write that appends
// an event about a command or a device holds that row's lock from an
// earlier statement, so under READ COMMITTED the statement that appends
// it sees every earlier event of the row as committed, and goes after
// them; the id of the sequence, taken later, orders it after an event of
// the same xid. The stored xid is never below the transaction's own, so a
// reader still sees it only once its transaction has ended.
//
// In a database restored from a dump, an event's place is its
// transaction's id plus an offset (logXid, openEventsLog): the xids
// above are places in the log, xmin too.
//
// A cursor is the event's (xid, id) as two 16-digit hex numbers joined by
// "-", so that cursors compare as strings in log order.

// eventsChannel is the channel of pg_notify that says events were
// committed (no payload: readers read the log).
const eventsChannel = "companion_events"

// maxEventsPage bounds a page of Events.
const maxEventsPage = 1000

// eventCursor is a place in the log: after the event (xid, id).
type eventCursor struct{ xid, id uint64 }

func (c eventCursor) String() string { return fmt.Sprintf("%016x-%016x", c.xid, c.id) }

func (c eventCursor) less(o eventCursor) bool {
	return c.xid < o.xid || (c.xid == o.xid && c.id < o.id)
}

// parseEventCursor reads a cursor: "" is before every event.
func parseEventCursor(s string) (eventCursor, error) {
	if s == "" {
		return eventCursor{}, nil
	}
	x, i, ok := strings.Cut(s, "-")
	if !ok || len(x) != 16 || len(i) != 16 {
		return eventCursor{}, companion.ErrInvalidCursor
	}
	xid, err1 := strconv.ParseUint(x, 16, 64)
	id, err2 := strconv.ParseUint(i, 16, 64)
	if err1 != nil || err2 != nil || id > 1<<63-1 || xid > 1<<63-1 {
		return eventCursor{}, companion.ErrInvalidCursor
	}
	return eventCursor{xid, id}, nil
}

// eventXidSQL is the xid an event of the user named by the SQL
// expression user is stored with (see above): the transaction's own, or
// the highest of the user's events committed, through the index
// events_by_user.
func (s *Store) eventXidSQL(user string) string {
	return `greatest(` + s.logXid(`pg_current_xact_id()`) + `, (SELECT l.xid FROM events l WHERE l.user_id = ` + user + ` ORDER BY l.xid DESC LIMIT 1))`
}

// logXid is the SQL of the xid8 expression xid as a place in the event
// log: xid itself, or moved on by the offset of a restored database
// (openEventsLog); as it was for a database never restored, so that the
// command path does no more work there.
func (s *Store) logXid(xid string) string {
	if s.xidOffset == 0 {
		return xid
	}
	return `((` + xid + `)::text::numeric + ` + strconv.FormatUint(s.xidOffset, 10) + `)::text::xid8`
}

// openEventsLog reads the event log's offset (events_log, migration 0006)
// and takes a database whose events_log has another oid than its row says
// for a restore of a dump (bug 428): what happened after the dump is
// gone, the events too, and clients of the event streams hold places in
// the log the restored one never had. Those places are the transaction
// ids of the lost server: a dump restored into a new server, whose
// transaction ids are behind, hid every event made after it until the new
// server caught up with the old, and a client that resumed once it had
// passed its place then skipped the events before silently; in a new
// database of the same server, the client was not told that what it saw
// after the dump was undone. So the log moves past every place the lost
// database could have given: the clock in microseconds, as a place, is
// past them (a server hands out far fewer transaction ids a second), and
// the purge mark is put there, so that a stream resumed from before it
// starts with an event "reset", and its client reads the state again.
// Under the migrations' lock: replicas opening at once do it once.
func (s *Store) openEventsLog(ctx context.Context) error {
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, migrationLock); err != nil {
			return err
		}
		var (
			off             int64
			stored, current uint32
			ahead           bool
		)
		// ahead: the log holds a place past every transaction of this
		// server, which only a restore into a server behind the lost one
		// makes; so a dump of a build before events_log, which the
		// migration then made anew with its own oid, is taken for one too.
		err := tx.QueryRow(ctx, `SELECT l.xid_offset, l.table_oid, 'events_log'::regclass::oid,
				coalesce((SELECT xid FROM events ORDER BY xid DESC LIMIT 1)::text::numeric
					>= pg_snapshot_xmax(pg_current_snapshot())::text::numeric + l.xid_offset, false)
			FROM events_log l FOR UPDATE`).Scan(&off, &stored, &current, &ahead)
		if err != nil {
			return err
		}
		if stored != current || ahead {
			var mark string
			err := tx.QueryRow(ctx, `WITH now AS (
					SELECT pg_snapshot_xmin(pg_current_snapshot())::text::numeric AS xmin,
						floor(extract(epoch FROM clock_timestamp()) * 1000000) AS us),
				top AS (
					SELECT greatest(now.us,
						(SELECT xid FROM events ORDER BY xid DESC LIMIT 1)::text::numeric,
						(SELECT xid FROM events_purged)::text::numeric) AS top FROM now)
				UPDATE events_log SET xid_offset = greatest(xid_offset, top.top + 1 - now.xmin), table_oid = $1
				FROM now, top
				RETURNING xid_offset, (now.xmin + greatest(xid_offset, top.top + 1 - now.xmin))::text`, current).Scan(&off, &mark)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `UPDATE events_purged SET xid = $1::text::xid8, id = 0`, mark); err != nil {
				return err
			}
			x, _ := strconv.ParseUint(mark, 10, 64)
			s.log.Info("postgres: opened a restored database: event streams resumed from an id before it start with an event reset",
				"events_from", eventCursor{xid: x}.String())
		}
		s.xidOffset = uint64(off)
		return nil
	})
}

// queueCommandEvent queues on b the event of command c as now stored.
func (s *Store) queueCommandEvent(b *pgx.Batch, c companion.Command) error {
	if c.UserID == "" {
		return nil
	}
	data, err := json.Marshal(companion.CommandChanged(c))
	if err != nil {
		return err
	}
	b.Queue(`INSERT INTO events (xid, user_id, device_id, at, data) SELECT `+s.eventXidSQL("$1::text")+`, $1, $2, $3, $4`,
		c.UserID, c.DeviceID, c.UpdatedAt, data)
	b.Queue(`SELECT pg_notify($1, '')`, eventsChannel)
	return nil
}

// insertDeviceEvent appends the event of status st, as now stored, for the
// user the device is bound to (none when it is bound to no one).
func (s *Store) insertDeviceEvent(ctx context.Context, tx pgx.Tx, st companion.Status) error {
	data, err := json.Marshal(companion.DeviceChanged("", st))
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `WITH ev AS (
			INSERT INTO events (xid, user_id, device_id, at, data)
			SELECT `+s.eventXidSQL("b.user_id")+`, b.user_id, b.device_id, $2, $3 FROM bindings b WHERE b.device_id = $1
			RETURNING 1)
		SELECT pg_notify('`+eventsChannel+`', '') FROM ev`, st.DeviceID, st.UpdatedAt, data)
	return err
}

// Events returns the user's events after the cursor (every user's with
// userID ""), oldest first; see companion.Store and the comment above.
func (s *Store) Events(ctx context.Context, userID, after string, limit int) ([]companion.Event, string, error) {
	from, err := parseEventCursor(after)
	if err != nil {
		return nil, "", err
	}
	if limit <= 0 || limit > maxEventsPage {
		limit = maxEventsPage
	}
	out := []companion.Event{}
	if userID != "" && !validID(userID) {
		return out, from.String(), nil
	}
	// One statement, so one snapshot: its xmin, and the events below it.
	// The row of the snapshot comes back even when no event does.
	where := `(e.xid, e.id) > ($1::text::xid8, $2) AND e.xid < snap.xmin`
	args := []any{strconv.FormatUint(from.xid, 10), int64(from.id), limit}
	if userID != "" {
		where = `e.user_id = $4 AND ` + where
		args = append(args, userID)
	}
	rows, err := s.pool.Query(ctx, `WITH snap AS (SELECT `+s.logXid(`pg_snapshot_xmin(pg_current_snapshot())`)+` AS xmin)
		SELECT snap.xmin::text, e.xid::text, e.id, e.user_id, e.data::text
		FROM snap LEFT JOIN LATERAL (
			SELECT e.xid, e.id, e.user_id, e.data FROM events e
			WHERE `+where+` ORDER BY e.xid, e.id LIMIT $3) e ON true
		ORDER BY e.xid, e.id`, args...)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	var xmin uint64
	last := from
	for rows.Next() {
		var (
			xminText      string
			xidText, user *string
			id            *int64
			data          *string
		)
		if err := rows.Scan(&xminText, &xidText, &id, &user, &data); err != nil {
			return nil, "", err
		}
		if xmin, err = strconv.ParseUint(xminText, 10, 64); err != nil {
			return nil, "", fmt.Errorf("postgres: snapshot xmin %q: %w", xminText, err)
		}
		if xidText == nil {
			continue // no event
		}
		xid, err := strconv.ParseUint(*xidText, 10, 64)
		if err != nil {
			return nil, "", fmt.Errorf("postgres: event xid %q: %w", *xidText, err)
		}
		var ev companion.Event
		if err := json.Unmarshal([]byte(*data), &ev); err != nil {
			return nil, "", fmt.Errorf("postgres: event %d: %w", *id, err)
		}
		last = eventCursor{xid, uint64(*id)}
		ev.ID, ev.UserID = last.String(), *user
		ev.At = ev.At.UTC()
		out = append(out, ev)
	}
	if err := rows.Err(); err != nil {
		return nil, "", err
	}
	next := last
	if len(out) < limit {
		// Every event of the user below xmin has been read: the next
		// read starts at xmin (whose events, if any, are not visible yet).
		if c := (eventCursor{xid: xmin}); next.less(c) {
			next = c
		}
	}
	return out, next.String(), nil
}

// EventsHead returns the cursor of the present: the xmin of a snapshot
// taken now.
func (s *Store) EventsHead(ctx context.Context) (string, error) {
	var xmin string
	if err := s.pool.QueryRow(ctx, `SELECT (`+s.logXid(`pg_snapshot_xmin(pg_current_snapshot())`)+`)::text`).Scan(&xmin); err != nil {
		return "", err
	}
	v, err := strconv.ParseUint(xmin, 10, 64)
	if err != nil {
		return "", fmt.Errorf("postgres: snapshot xmin %q: %w", xmin, err)
	}
	return eventCursor{xid: v}.String(), nil
}

// EventsPastEnd reports whether the cursor after is past every id the
// database has assigned: its xid is one that no transaction has had yet,
// or its id one that the sequence of the events (events_id_seq, of the
// bigserial) has not handed out.
//
// Not the xmin of a snapshot (the head): a transaction open elsewhere
// holds it back, and the ids committed since are above it. Nor the xmax of
// the snapshot: it is one past the last transaction that ended, and a
// transaction still open may have a later xid. The server's next xid is
// what age(xid) counts from in a transaction that has none of its own,
// as this one. The head of a server where no transaction runs is (next
// xid, 0), so only what follows it in cursor order is past the end. A
// sequence is not transactional: its last value counts the ids of
// transactions committed, open or rolled back alike.
func (s *Store) EventsPastEnd(ctx context.Context, after string) (bool, error) {
	c, err := parseEventCursor(after)
	if err != nil {
		return false, err
	}
	var (
		xmaxText string
		age      int32 // of the snapshot's xmax: how far the next xid is past it
		lastID   int64
	)
	err = s.pool.QueryRow(ctx, `SELECT snap.xmax::text, age(snap.xmax::xid), CASE WHEN seq.is_called THEN seq.last_value ELSE 0 END
		FROM (SELECT pg_snapshot_xmax(pg_current_snapshot()) AS xmax) snap, events_id_seq seq`).Scan(&xmaxText, &age, &lastID)
	if err != nil {
		return false, err
	}
	xmax, err := strconv.ParseUint(xmaxText, 10, 64)
	if err != nil {
		return false, fmt.Errorf("postgres: snapshot xmax %q: %w", xmaxText, err)
	}
	// The age of an xid whose low 32 bits are a special xid (once every
	// 2^32 transactions) is the largest int4: then hardly any xid is past
	// the end, which keeps the behaviour of a cursor that is not.
	next := eventCursor{xid: xmax + uint64(max(age, 0)) + s.xidOffset}
	return next.less(c) || c.id > uint64(lastID), nil
}

// EventsPurgedAfter reports whether PurgeEvents deleted an event after
// the cursor after (docs/reliability.md, bug 274).
func (s *Store) EventsPurgedAfter(ctx context.Context, after string) (bool, error) {
	c, err := parseEventCursor(after)
	if err != nil {
		return false, err
	}
	var xid string
	var id int64
	if err := s.pool.QueryRow(ctx, `SELECT xid::text, id FROM events_purged`).Scan(&xid, &id); err != nil {
		return false, err
	}
	x, err := strconv.ParseUint(xid, 10, 64)
	if err != nil {
		return false, fmt.Errorf("postgres: purged xid %q: %w", xid, err)
	}
	return c.less(eventCursor{xid: x, id: uint64(id)}), nil
}

// PurgeEvents deletes the events older than olderThan (by the database's
// clock, purgeCut), at most
// purgeBatch in each transaction, and keeps the last it deleted in
// events_purged (never lowered: a replica's purge at the same time waits
// for the row, then compares with what the other wrote).
func (s *Store) PurgeEvents(ctx context.Context, olderThan time.Time) (int, error) {
	return s.purgeCounted(ctx, `WITH gone AS (
			DELETE FROM events WHERE (xid, id) IN (
				SELECT xid, id FROM events WHERE at < `+purgeCut+` LIMIT $2)
			RETURNING xid, id),
		last AS (SELECT xid, id FROM gone ORDER BY xid DESC, id DESC LIMIT 1),
		mark AS (UPDATE events_purged p SET xid = last.xid, id = last.id FROM last
			WHERE (last.xid, last.id) > (p.xid, p.id))
		SELECT count(*) FROM gone`, olderThan)
}

// ListenEvents calls fn each time a transaction that appended events
// committed, on any replica of the database, and when notifications may
// have been missed (LISTEN is in place, the first time or after the
// connection was lost): fn then reads the log. fn runs on ListenEvents' goroutine, one call at a time: it must
// be quick. It LISTENs on a connection of its own, as ListenCommands does,
// and returns when ctx is done (ctx.Err()) or the store is closed (nil).
func (s *Store) ListenEvents(ctx context.Context, fn func()) error {
	return s.listenLoop(ctx, eventsChannel, func(string) { fn() })
}
