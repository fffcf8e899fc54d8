package companion

import (
	"context"
	"encoding/json"
	"io"
	"time"
)

// Store is everything the service keeps, whatever the engine: store.DB
// (bbolt, one process) and postgres.Store (PostgreSQL, any number of
// server replicas) implement it, and store/storetest holds the tests both
// pass. Its users declare the part they need (api.Store, broker.Store,
// broker.AccountStore, dynsec.Store); the server wires a whole Store.
//
// Lookups of what does not exist return ErrNotFound. Writes are durable
// when they return nil (or when their done func is called with nil): a
// 202 means committed. The ...Async methods return at once and call done
// from another goroutine when the write is durable; writes to one device
// are applied in the order they were made.
type Store interface {
	CreateUser(ctx context.Context, u User) error
	User(ctx context.Context, id string) (User, error)
	UserByTokenHash(ctx context.Context, hash []byte) (User, error)
	// SetUserToken replaces the hash of a user's API token: the old token
	// opens nothing from then on. It returns ErrNotFound for no such user
	// and ErrExists when another user has the hash.
	SetUserToken(ctx context.Context, userID string, tokenHash []byte) error

	ProvisionDevice(ctx context.Context, d RegistryDevice) error
	RegistryDevice(ctx context.Context, id string) (RegistryDevice, error)

	CreateBridge(ctx context.Context, b Bridge) error
	Bridge(ctx context.Context, id string) (Bridge, error)
	BridgeBySecretHash(ctx context.Context, hash []byte) (Bridge, error)
	// ListBridges returns a page of the bridges of ownerID ("" the
	// operator's) in id order after the bridge id `after`, at most limit
	// (<= 0: all), each with the devices it serves, read at one instant,
	// and whether more follow.
	ListBridges(ctx context.Context, ownerID, after string, limit int) ([]ServingBridge, bool, error)
	// CountBridges returns how many bridges ownerID ("" the operator)
	// has, reading the bridges only, never the devices they serve.
	CountBridges(ctx context.Context, ownerID string) (int, error)
	DeleteBridge(ctx context.Context, bridgeID, ownerID string) ([]string, error)
	// SetBridgeSecret replaces the hash of a bridge's secret: the old
	// secret opens nothing from then on. ownerID "" is the operator, who
	// may change any bridge's; a user only their own (ErrNotOwned). It
	// returns ErrNotFound for no such bridge and ErrExists when another
	// bridge has the hash.
	SetBridgeSecret(ctx context.Context, bridgeID, ownerID string, secretHash []byte) error
	AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (previous string, err error)
	DeviceBridge(ctx context.Context, deviceID string) (string, error)
	// DeviceBridges is DeviceBridge for many devices in one read: those
	// no bridge serves are absent.
	DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error)
	BridgeServes(ctx context.Context, bridgeID, deviceID string) (bool, error)
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	BridgeDevices(ctx context.Context, bridgeID string) ([]string, error)
	BlobNeeded(ctx context.Context, sha, bridgeID string) (bool, error)

	Bind(ctx context.Context, b Binding) (Binding, bool, error)
	Unbind(ctx context.Context, deviceID, userID string) (Unbound, error)
	Binding(ctx context.Context, deviceID string) (Binding, error)
	ListBindings(ctx context.Context, userID, after string, limit int) ([]Binding, error)
	ListDevices(ctx context.Context, userID, after string, limit int) ([]BoundDevice, error)

	Status(ctx context.Context, deviceID string) (Status, error)
	PutStatus(ctx context.Context, s Status) (applied bool, err error)
	PutStatusAsync(s Status, done func(applied bool, err error))
	MarkBridgeOffline(ctx context.Context, bridgeID string) ([]string, error)
	MarkBridgeOfflineAsync(bridgeID string, done func(ids []string, err error))
	Settings(ctx context.Context, deviceID string) (Settings, error)
	PutReportedSettings(ctx context.Context, deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64) (bool, error)
	PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(bool, error))

	CreateCommand(ctx context.Context, c Command, maxOpen int, idem *Idempotency) (cmd Command, replay bool, err error)
	CreateCommandAsync(c Command, maxOpen int, idem *Idempotency, done func(cmd Command, replay bool, err error))
	Command(ctx context.Context, id string) (Command, error)
	UpdateCommand(ctx context.Context, id string, fn func(*Command) error) (Command, error)
	UpdateCommandAsync(id string, fn func(*Command) error, done func(Command, error))
	UpdateCommandWithReportAsync(id string, fn func(*Command) error, report DeviceReport, done func(Command, error))
	ListCommands(ctx context.Context, q CommandQuery) (page []Command, more bool, err error)
	OpenCommands(ctx context.Context, states ...string) ([]Command, error)
	// QueuedCommandsWith returns every queued command but those of the
	// devices in skip, and the other non-final commands of deviceIDs (a
	// device in both: all of its non-final ones), oldest first, as of one
	// moment: what the outbox sends when deviceIDs' bridge is back, and,
	// with none, what it sends when it reads the store; skip are the
	// devices whose bridge is away, whose commands wait queued. The other
	// open commands are not read, nor decoded.
	QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]Command, error)
	// SentCommandsOnline returns the sent commands of the devices whose
	// stored status reads online (a device never reported reads
	// offline), oldest first. The others are not read.
	SentCommandsOnline(ctx context.Context) ([]Command, error)
	ExpiredCommands(ctx context.Context, now time.Time) ([]Command, error)
	CountOpen(ctx context.Context, deviceID string) (int, error)
	// CountAllOpen is how many commands of all devices are not final,
	// without reading them.
	CountAllOpen(ctx context.Context) (int, error)
	PurgeCommands(ctx context.Context, olderThan time.Time) (int, error)

	Idempotency(ctx context.Context, userID, key string) (Idempotency, error)
	PutIdempotency(ctx context.Context, rec Idempotency) error
	PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error)

	PutFirmware(ctx context.Context, f Firmware) error
	Firmware(ctx context.Context, model, version string) (Firmware, error)
	Firmwares(ctx context.Context, model string) ([]Firmware, error)
	PutAppRelease(ctx context.Context, a AppRelease) error
	AppRelease(ctx context.Context, appID, version string) (AppRelease, error)
	AppReleases(ctx context.Context, appID string) ([]AppRelease, error)
	// AppCatalog returns a page of the app catalog in app id order: at
	// most limit apps (limit <= 0: all) whose ids sort after `after`,
	// each with its latest release and every version published, read at
	// one instant (one transaction, one query), and whether more apps
	// follow.
	AppCatalog(ctx context.Context, after string, limit int) (apps []CatalogApp, more bool, err error)

	// PutBlob stores what r holds (at most max bytes: ErrTooLarge) under
	// its SHA-256; storing the same content again is not an error.
	PutBlob(ctx context.Context, r io.Reader, max int64) (Blob, error)
	Blob(ctx context.Context, sha string) (Blob, error)

	// Events returns, oldest first, at most limit (<= 0: 1000) of the
	// events of userID ("" for every user's) after the cursor after (""
	// for the oldest kept; a malformed one is ErrInvalidCursor), with the
	// cursor to pass next. The log has no gap: an event that Events has
	// not returned after a cursor is never committed before it later.
	// The writes that change commands and statuses append the events in
	// their own transactions.
	Events(ctx context.Context, userID, after string, limit int) (events []Event, next string, err error)
	// EventsHead returns the cursor of the present: Events after it
	// returns only events committed from now on (and perhaps a few of the
	// last moments).
	EventsHead(ctx context.Context) (string, error)
	// EventsPastEnd reports whether the cursor after is past every id
	// the store has ever assigned, as one that a client kept across a
	// reset of the store (the bbolt file deleted, the database recreated)
	// may be: Events after it would return nothing until the log passed
	// it. No cursor the store handed out (an event's id, a next cursor,
	// the head) is ever past the end; a malformed one is
	// ErrInvalidCursor.
	EventsPastEnd(ctx context.Context, after string) (bool, error)
	// EventsPurgedAfter reports whether the log has lost to PurgeEvents
	// an event after the cursor after, any user's: Events after it would
	// return what the log holds with a gap, unseen (a cursor older than
	// the log keeps, EventRetention). A malformed cursor is
	// ErrInvalidCursor. docs/reliability.md, bug 274.
	EventsPurgedAfter(ctx context.Context, after string) (bool, error)
	// PurgeEvents deletes the events older than olderThan, and keeps the
	// last id it deleted for EventsPurgedAfter.
	PurgeEvents(ctx context.Context, olderThan time.Time) (int, error)
	// OpenBlob opens a blob for reading; the caller closes it.
	OpenBlob(ctx context.Context, sha string) (io.ReadSeekCloser, Blob, error)
	// PurgeBlobs deletes the blobs that no unfinished command, firmware
	// or app release references and that were last stored (PutBlob, also
	// of content stored already) before olderThan, and returns how many
	// went.
	PurgeBlobs(ctx context.Context, olderThan time.Time) (int, error)

	Close() error
}
