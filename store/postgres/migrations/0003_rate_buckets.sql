-- The token buckets of the API's rate limits (CONTRACT §6), shared by every
-- replica on the database (RateLimiter, ratelimit.go): one row per key,
-- tokens as of updated_at. A key without a row has a full bucket, so a row
-- may go once its bucket has refilled (full_at); RateLimiter deletes them.
--
-- UNLOGGED: the rows are written on every request and are not promises. No
-- WAL is written for them, so an update costs no flush; after a crash
-- PostgreSQL empties the table (every bucket full again, a moment of
-- generosity), and standbys do not have it (a replica that fails over to
-- one starts the same way). Nothing else of the store refers to it.
CREATE UNLOGGED TABLE rate_buckets (
	key        text COLLATE "C" PRIMARY KEY,
	tokens     double precision NOT NULL,
	updated_at timestamptz NOT NULL,
	full_at    timestamptz NOT NULL,
	-- Whether the last Allow took a token: what its RETURNING reports.
	granted    boolean NOT NULL
);
