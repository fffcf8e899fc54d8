package broker

import "errors"

// Errors of the broker, for callers to test with errors.Is. Store errors
// (companion.ErrNotFound, companion.ErrQueueFull, companion.ErrIdemConflict, companion.ErrFinal)
// pass through unchanged.
var (
	// ErrNotCancelable means the bridge already has the command: it can no
	// longer be canceled.
	ErrNotCancelable = errors.New("broker: command already delivered")
	// ErrClosed means the broker is shutting down.
	ErrClosed = errors.New("broker: closed")
)
