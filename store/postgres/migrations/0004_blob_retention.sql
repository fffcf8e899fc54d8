-- When each blob's content was last stored: PutBlob sets it, also for
-- content stored already, and PurgeBlobs keeps what was stored since its
-- cutoff, so that content stored for a command or release about to be
-- written is not deleted first, however old the blob. Blobs stored before
-- this column count as stored when they were created; the default serves
-- a replica of the previous build, which inserts without it, until it is
-- replaced.
ALTER TABLE blobs ADD COLUMN stored_at timestamptz NOT NULL DEFAULT now();
UPDATE blobs SET stored_at = created_at;
-- Retention: the blobs stored before the cutoff.
CREATE INDEX blobs_by_stored_at ON blobs (stored_at);
