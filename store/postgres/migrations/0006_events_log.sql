-- The event log's place among the database's transactions (events.go):
-- an event's xid is its transaction's id plus xid_offset, and table_oid is
-- the oid this table had when the row was written. A pg_dump restored
-- makes the table anew, with another oid: Open then takes the database
-- for a restore, moves the log past every id the lost database could have
-- given (xid_offset) and marks the events before as purged (bug 428).
-- One row.
CREATE TABLE events_log (
	one        boolean PRIMARY KEY DEFAULT true CHECK (one),
	xid_offset bigint NOT NULL CHECK (xid_offset >= 0),
	table_oid  oid NOT NULL
);
INSERT INTO events_log (xid_offset, table_oid) VALUES (0, 'events_log'::regclass::oid);
