// Package companion holds the domain of the device companion service: its
// users, devices, bridges, commands and their states, device status and
// settings, and the catalogs, with the errors every store engine returns.
// It imports nothing of this project; every other package may import it.
// The stores (store for bbolt) implement what their users need of them,
// declared where it is used (api.Store, broker.Store).
package companion

import (
	"errors"
	"fmt"
)

// Errors of the service's stores, whatever the engine. Callers test them
// with errors.Is.
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
	// ErrUnreadable is a record the store holds and cannot read: its
	// bytes do not decode (the bbolt file damaged there). A command so is
	// no longer sent, expired or counted among its device's unfinished
	// commands; its bytes are kept as they are.
	ErrUnreadable = errors.New("store: record does not decode")
	// ErrNoRoom is a backup refused for want of room on the store's disk
	// for the copy it makes there while it is sent.
	ErrNoRoom = errors.New("store: no room for a backup's copy")
)

// ErrNotOwned is returned when a user names a bridge or device that is not
// theirs. The API answers it as not found.
var ErrNotOwned = fmt.Errorf("%w: not the caller's", ErrNotFound)

// ErrInvalid is returned when an argument cannot be stored as given: an
// empty id, an id containing a NUL byte, or a version that is not a
// semantic version. Callers validate input before it reaches the store, so
// this error points at a bug in the caller.
var ErrInvalid = errors.New("store: invalid argument")
