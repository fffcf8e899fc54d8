-- The last event PurgeEvents deleted, in log order (xid, id): a cursor
-- before it has lost an event to retention (EventsPurgedAfter; see
-- events.go). One row; (0, 0) before the first purge that deleted one.
CREATE TABLE events_purged (
	one boolean PRIMARY KEY DEFAULT true CHECK (one),
	xid xid8 NOT NULL,
	id  bigint NOT NULL
);
INSERT INTO events_purged (xid, id) VALUES ('0', 0);
