-- The last event PurgeEvents deleted, in log order (xid, id): a cursor
-- before it has lost an event to retention (EventsPurgedAfter; see
-- events.go). One row; (0, 0) before the first purge that deleted one.
CREATE TABLE events_purged (
	one boolean PRIMARY KEY DEFAULT true CHECK (one),
	xid xid8 NOT NULL,
	id  bigint NOT NULL
);
INSERT INTO events_purged (xid, id) VALUES ('0', 0);
-- A database whose events the build before this migration purged kept no
-- mark of them: ids run from 1, so an oldest id above 1, or no event left
-- once one was made, says events went, and the mark starts just below the
-- oldest event kept, or at this transaction when none is. A client that
-- resumes across the upgrade from before them then gets its reset
-- (docs/reliability.md, bug 305); an insert rolled back before the oldest
-- makes such a gap too, which costs a reset at most.
UPDATE events_purged SET xid = o.xid, id = o.id - 1
	FROM (SELECT xid, id FROM events ORDER BY xid, id LIMIT 1) o
	WHERE (SELECT min(id) FROM events) > 1;
UPDATE events_purged SET xid = pg_current_xact_id(), id = 0
	WHERE NOT EXISTS (SELECT 1 FROM events) AND (SELECT is_called FROM events_id_seq);
