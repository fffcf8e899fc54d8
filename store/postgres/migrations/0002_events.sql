-- The event log of GET /api/v1/events (see events.go). A bigserial is
-- not commit-ordered across concurrent transactions, so each event also
-- keeps the id of the transaction that wrote it (pg_current_xact_id());
-- readers order by (xid, id) and read only events whose xid is below the
-- xmin of their snapshot: every transaction there has ended, so no event
-- can appear later before the cursor.
CREATE TABLE events (
	xid       xid8 NOT NULL,
	id        bigserial NOT NULL,
	user_id   text COLLATE "C" NOT NULL,
	device_id text COLLATE "C" NOT NULL,
	at        timestamptz NOT NULL,
	data      json NOT NULL,
	PRIMARY KEY (xid, id)
);
-- A user's resume.
CREATE INDEX events_by_user ON events (user_id, xid, id);
-- Retention.
CREATE INDEX events_by_age ON events (at);
