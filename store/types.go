package store

import (
	"encoding/json"
	"errors"
	"time"
)

// Errors of the store. Callers test them with errors.Is.
var (
	ErrNotFound      = errors.New("store: not found")
	ErrExists        = errors.New("store: already exists")
	ErrBoundToOther  = errors.New("store: device bound to another user")
	ErrQueueFull     = errors.New("store: too many unfinished commands for the device")
	ErrFinal         = errors.New("store: command is in a final state")
	ErrIdemConflict  = errors.New("store: idempotency key reused with another request")
	ErrTooLarge      = errors.New("store: content over its size limit")
	ErrBadDigest     = errors.New("store: content does not match its digest")
	ErrSchemaTooNew  = errors.New("store: data file written by a newer version")
	ErrInvalidCursor = errors.New("store: invalid cursor")
)

// User is an account of the service. Its API token is kept only as a
// SHA-256 hash: tokens are 256-bit random strings, so a fast hash is enough.
type User struct {
	ID        string    `json:"id"` // a UUID
	Name      string    `json:"name"`
	TokenHash []byte    `json:"token_hash"`
	CreatedAt time.Time `json:"created_at"`
}

// RegistryDevice is a device as provisioned by the operator, before and
// after anyone binds it.
type RegistryDevice struct {
	ID        string    `json:"id"`
	Model     string    `json:"model"`
	ClaimHash []byte    `json:"claim_hash"` // SHA-256 of the claim code
	CreatedAt time.Time `json:"created_at"`
	// BridgeID is the bridge the device is assigned to ("" none). It is
	// kept apart (the assignments bucket): ProvisionDevice assigns it, and
	// RegistryDevice reads it back.
	BridgeID string `json:"-"`
}

// Bridge is an edge agent allowed onto the broker. It serves the devices
// assigned to it (CONTRACT §9).
type Bridge struct {
	ID         string    `json:"id"`
	SecretHash []byte    `json:"secret_hash"`
	CreatedAt  time.Time `json:"created_at"`
	// OwnerID is the user whose own bridge it is (a phone, a home hub): it
	// serves only devices bound to that user. "" is one of the operator's.
	OwnerID string `json:"owner_id,omitempty"`
}

// Binding ties a device to the user who registered it.
type Binding struct {
	DeviceID string    `json:"device_id"`
	UserID   string    `json:"user_id"`
	Name     string    `json:"name"`
	Model    string    `json:"model"`
	BoundAt  time.Time `json:"bound_at"`
}

// App is an installed app as a device last reported it.
type App struct {
	AppID   string `json:"app_id"`
	Version string `json:"version"`
}

// Status is a device's last reported status. The zero value is the status
// of a device that never reported: offline, battery unknown.
type Status struct {
	DeviceID        string    `json:"device_id"`
	Online          bool      `json:"online"`
	Battery         *int      `json:"battery"`
	FirmwareVersion string    `json:"firmware_version"`
	Model           string    `json:"model"`
	Apps            []App     `json:"apps"`
	BridgeID        string    `json:"bridge_id"`
	LastSeen        time.Time `json:"last_seen"`  // the At of the last report
	UpdatedAt       time.Time `json:"updated_at"` // when the store last changed it
	Seq             uint64    `json:"seq"`
}

// Settings holds a device's settings as reported, as desired by its user,
// and the schema the device declared. Values are JSON values.
type Settings struct {
	DeviceID  string                     `json:"device_id"`
	Reported  map[string]json.RawMessage `json:"reported"`
	Desired   map[string]json.RawMessage `json:"desired"`
	Schema    json.RawMessage            `json:"schema"` // a topics.Schema as JSON
	At        time.Time                  `json:"at"`     // the At of the last report
	Seq       uint64                     `json:"seq"`
	UpdatedAt time.Time                  `json:"updated_at"`
}

// CommandError is why a command failed.
type CommandError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Command is one operation on one device and its life so far.
type Command struct {
	ID       string          `json:"id"` // UUIDv7, assigned by CreateCommand
	DeviceID string          `json:"device_id"`
	UserID   string          `json:"user_id"`
	Op       string          `json:"op"`
	State    string          `json:"state"`
	Progress *int            `json:"progress,omitempty"`
	Error    *CommandError   `json:"error,omitempty"`
	Result   json.RawMessage `json:"result,omitempty"`
	Payload  json.RawMessage `json:"payload,omitempty"` // what the bridge receives
	// Blob is the SHA-256 of the blob the payload references ("" none):
	// the bridge serving the device may download it while the command is
	// not final (CONTRACT §9).
	Blob      string    `json:"blob,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
	ExpiresAt time.Time `json:"expires_at"`
}

// Idempotency remembers the first answer to a request carrying an
// Idempotency-Key, scoped to the user who sent it.
type Idempotency struct {
	UserID      string    `json:"user_id"`
	Key         string    `json:"key"`
	RequestHash []byte    `json:"request_hash"` // SHA-256 of method, path and body
	Status      int       `json:"status"`
	CommandID   string    `json:"command_id,omitempty"` // set when the answer was a command
	Body        []byte    `json:"body,omitempty"`       // set when it was not
	Location    string    `json:"location,omitempty"`
	CreatedAt   time.Time `json:"created_at"`
}

// Firmware is one published firmware image for a model.
type Firmware struct {
	Model     string    `json:"model"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// AppRelease is one published version of an app package.
type AppRelease struct {
	AppID     string    `json:"app_id"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// Blob is content stored once by its SHA-256 (lower-case hex).
type Blob struct {
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}
