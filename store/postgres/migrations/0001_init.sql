-- The store's first schema: every bucket of the bbolt engine as a table.
-- Ids that lists are ordered by are text COLLATE "C", so that their order
-- is byte order whatever the database's locale (the bbolt engine's order).

CREATE TABLE users (
	id         text COLLATE "C" PRIMARY KEY,
	name       text NOT NULL,
	token_hash bytea NOT NULL UNIQUE,
	created_at timestamptz NOT NULL
);

CREATE TABLE devices (
	id         text COLLATE "C" PRIMARY KEY,
	model      text NOT NULL,
	claim_hash bytea,
	created_at timestamptz NOT NULL
);

-- owner_id '' is one of the operator's bridges.
CREATE TABLE bridges (
	id          text COLLATE "C" PRIMARY KEY,
	secret_hash bytea NOT NULL UNIQUE,
	owner_id    text COLLATE "C" NOT NULL,
	created_at  timestamptz NOT NULL
);
CREATE INDEX bridges_by_owner ON bridges (owner_id, id);

-- Which bridge serves which device (CONTRACT §9): at most one per device.
CREATE TABLE assignments (
	device_id text COLLATE "C" PRIMARY KEY REFERENCES devices (id),
	bridge_id text COLLATE "C" NOT NULL REFERENCES bridges (id)
);
CREATE INDEX assignments_by_bridge ON assignments (bridge_id, device_id);

CREATE TABLE bindings (
	device_id text COLLATE "C" PRIMARY KEY REFERENCES devices (id),
	user_id   text COLLATE "C" NOT NULL,
	name      text NOT NULL,
	model     text NOT NULL,
	bound_at  timestamptz NOT NULL
);
CREATE INDEX bindings_by_user ON bindings (user_id, device_id);

-- seq is a uint64 (bridges use a nanosecond clock): numeric(20), compared
-- in SQL. bridge_id '' names no bridge.
CREATE TABLE statuses (
	device_id        text COLLATE "C" PRIMARY KEY,
	online           boolean NOT NULL,
	battery          integer,
	firmware_version text NOT NULL,
	model            text NOT NULL,
	apps             json,
	bridge_id        text COLLATE "C" NOT NULL,
	last_seen        timestamptz NOT NULL,
	updated_at       timestamptz NOT NULL,
	seq              numeric(20) NOT NULL
);
CREATE INDEX statuses_by_bridge ON statuses (bridge_id, device_id) WHERE bridge_id <> '';

CREATE TABLE settings (
	device_id  text COLLATE "C" PRIMARY KEY,
	reported   json NOT NULL,
	desired    json NOT NULL,
	schema     json,
	at         timestamptz NOT NULL,
	seq        numeric(20) NOT NULL,
	updated_at timestamptz NOT NULL
);

-- One row per device that ever had a command: the row CreateCommand locks
-- (FOR UPDATE) so that the commands of a device are accepted one at a
-- time, the highest id given to the device so far, and how many of its
-- commands are not final.
CREATE TABLE device_queues (
	device_id  text COLLATE "C" PRIMARY KEY,
	last_id    uuid,
	open_count integer NOT NULL CHECK (open_count >= 0)
);

CREATE TABLE commands (
	id            uuid PRIMARY KEY,
	device_id     text COLLATE "C" NOT NULL,
	user_id       text COLLATE "C" NOT NULL,
	op            text NOT NULL,
	state         text NOT NULL,
	progress      integer,
	error_code    text,
	error_message text,
	result        json,
	payload       json,
	blob          text COLLATE "C" NOT NULL,
	created_at    timestamptz NOT NULL,
	updated_at    timestamptz NOT NULL,
	expires_at    timestamptz NOT NULL
);
-- A device's history, newest first (scanned backwards), by owner and by state.
CREATE INDEX commands_by_device ON commands (device_id, id);
CREATE INDEX commands_by_device_user ON commands (device_id, user_id, id);
CREATE INDEX commands_by_device_state ON commands (device_id, state, id);
-- The open commands (the outbox reads the queued ones), oldest first.
CREATE INDEX commands_open ON commands (id) WHERE state IN ('queued', 'sent', 'delivered', 'in_progress');
CREATE INDEX commands_queued ON commands (id) WHERE state = 'queued';
-- The expiry sweep: commands the bridge does not have yet.
CREATE INDEX commands_expiry ON commands (expires_at, id) WHERE state IN ('queued', 'sent');
-- Which unfinished commands need which blob (BlobNeeded).
CREATE INDEX commands_blob ON commands (blob, device_id) WHERE blob <> '' AND state IN ('queued', 'sent', 'delivered', 'in_progress');
-- Retention of final commands.
CREATE INDEX commands_final ON commands (updated_at) WHERE state IN ('succeeded', 'failed', 'expired', 'canceled');

CREATE TABLE idempotency (
	user_id      text COLLATE "C" NOT NULL,
	key          text COLLATE "C" NOT NULL,
	request_hash bytea,
	status       integer NOT NULL,
	command_id   text NOT NULL,
	body         bytea,
	location     text NOT NULL,
	created_at   timestamptz NOT NULL,
	PRIMARY KEY (user_id, key)
);
CREATE INDEX idempotency_by_age ON idempotency (created_at);

CREATE TABLE firmware (
	model      text COLLATE "C" NOT NULL,
	version    text COLLATE "C" NOT NULL,
	sha256     text NOT NULL,
	size       bigint NOT NULL,
	created_at timestamptz NOT NULL,
	PRIMARY KEY (model, version)
);

CREATE TABLE app_releases (
	app_id     text COLLATE "C" NOT NULL,
	version    text COLLATE "C" NOT NULL,
	sha256     text NOT NULL,
	size       bigint NOT NULL,
	created_at timestamptz NOT NULL,
	PRIMARY KEY (app_id, version)
);

-- A blob's content is chunks of chunk_size bytes (the last one shorter),
-- written under a content id of their own before the digest is known.
CREATE TABLE blobs (
	sha256     text COLLATE "C" PRIMARY KEY,
	content_id uuid NOT NULL UNIQUE,
	size       bigint NOT NULL,
	chunk_size integer NOT NULL,
	created_at timestamptz NOT NULL
);

CREATE TABLE blob_chunks (
	content_id uuid NOT NULL,
	n          integer NOT NULL,
	data       bytea NOT NULL,
	PRIMARY KEY (content_id, n)
);
-- Blob content is mostly compressed already (images, packages): store it
-- out of line without trying to compress it again.
ALTER TABLE blob_chunks ALTER COLUMN data SET STORAGE EXTERNAL;
