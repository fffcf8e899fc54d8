package companion

import (
	"encoding/json"
	"time"
)

// Command states (CONTRACT §2). The last four are final.
const (
	StateQueued     = "queued"
	StateSent       = "sent"
	StateDelivered  = "delivered"
	StateInProgress = "in_progress"
	StateSucceeded  = "succeeded"
	StateFailed     = "failed"
	StateExpired    = "expired"
	StateCanceled   = "canceled"
)

// States lists every command state in lifecycle order.
var States = []string{StateQueued, StateSent, StateDelivered, StateInProgress, StateSucceeded, StateFailed, StateExpired, StateCanceled}

// ValidState reports whether s is one of States.
func ValidState(s string) bool {
	for _, st := range States {
		if st == s {
			return true
		}
	}
	return false
}

// IsFinal reports whether a command in state s can never change again.
func IsFinal(s string) bool {
	switch s {
	case StateSucceeded, StateFailed, StateExpired, StateCanceled:
		return true
	}
	return false
}

// Rank orders the non-final states so that a late or replayed reply can never
// move a command backwards; final states rank highest.
func Rank(s string) int {
	switch s {
	case StateQueued:
		return 0
	case StateSent:
		return 1
	case StateDelivered:
		return 2
	case StateInProgress:
		return 3
	}
	if IsFinal(s) {
		return 4
	}
	return -1
}

// CodeDeviceUnbound is the error code of a command that ended because its
// user unbound the device (EndUnbound).
const CodeDeviceUnbound = "device_unbound"

// CodeDeviceNotServed is the error code of a command its bridge held when
// the bridge stopped serving the device: the bridge ends so those its spool
// holds for a device it was restarted without, and the server those the
// bridge had when the device was taken off it.
const CodeDeviceNotServed = "device_not_served"

// EndUnbound ends a command of a device its user unbound. One the bridge
// does not have yet is canceled: it never runs (the broker withdraws it
// from the bridge). One the bridge has may have run, or be running, and
// fails, since nobody can tell what it did. c must not be final.
func EndUnbound(c *Command) {
	switch c.State {
	case StateQueued, StateSent:
		c.State = StateCanceled
		c.Error = &CommandError{Code: CodeDeviceUnbound, Message: "the device was unbound before its bridge took the command"}
	default:
		c.State = StateFailed
		c.Error = &CommandError{Code: CodeDeviceUnbound, Message: "the device was unbound while its bridge had the command; whether it took effect is not known"}
	}
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
	// Desired is what a settings.update records as the device's desired
	// settings: CreateCommand merges each key into them (each value must
	// be JSON) in the transaction that stores the command, and only when
	// it stores one, so that desired settings follow the order of the
	// commands and a replay records nothing. It is never stored or
	// returned with the command.
	Desired map[string]json.RawMessage `json:"-"`
}

// OpSettingsUpdate is the op of a command that changes settings
// (topics.OpSettingsUpdate): its payload is {"settings": {name: value}}.
const OpSettingsUpdate = "settings.update"

// SettingsAsked returns the names of the settings c asks the device for:
// those of its payload when it is a settings.update, else none (nor for a
// payload that does not decode).
func (c Command) SettingsAsked() []string {
	asked := c.settingsAsked()
	if len(asked) == 0 {
		return nil
	}
	names := make([]string, 0, len(asked))
	for k := range asked {
		names = append(names, k)
	}
	return names
}

// settingsAsked returns the settings c asks the device for, each name with
// its value as the payload holds it: those of a settings.update, else none
// (nor for a payload that does not decode).
func (c Command) settingsAsked() map[string]json.RawMessage {
	if c.Op != OpSettingsUpdate {
		return nil
	}
	var p struct {
		Settings map[string]json.RawMessage `json:"settings"`
	}
	if json.Unmarshal(c.Payload, &p) != nil {
		return nil
	}
	return p.Settings
}

// WithdrawsDesired reports whether c, as stored now, ended a change of
// settings without succeeding (failed, expired or canceled): what it
// asked for is then no longer desired, since nothing will apply it
// (Settings.Withdraw; docs/reliability.md, bug 236).
func (c Command) WithdrawsDesired() bool {
	return c.Op == OpSettingsUpdate && IsFinal(c.State) && c.State != StateSucceeded
}

// SupersededChange returns c, a command that has just ended with a
// report of the device's settings older than the one stored, as one whose
// desired values are to be withdrawn: when it succeeded, the device ran
// it and has reported since (a later change the store does not know of,
// as after a restore from a backup), so its values are no longer pending,
// but those a later change asked for (docs/reliability.md, bug 399). A
// command that did not succeed is withdrawn as it is.
func SupersededChange(c Command) Command {
	if c.Op == OpSettingsUpdate && c.State == StateSucceeded {
		c.State = StateFailed
	}
	return c
}

// TakeDesired returns c.Desired checked and compacted by
// NewDesiredSettings (nil when there is none) and clears it: what a
// store's CreateCommand records with the command it stores.
func (c *Command) TakeDesired() (map[string]json.RawMessage, error) {
	d := c.Desired
	c.Desired = nil
	if len(d) == 0 {
		return nil, nil
	}
	return NewDesiredSettings(d)
}

// CommandQuery selects the commands of one device that ListCommands
// returns. The zero value of each field but DeviceID selects everything.
type CommandQuery struct {
	DeviceID string
	// UserID keeps only the commands this user sent ("" keeps every
	// user's): a device keeps its history across owners, and each owner
	// sees their own.
	UserID string
	State  string // only commands in this state ("" for every state)
	// Before starts the list below this command id, the last of the
	// previous page ("" starts at the newest).
	Before string
	Limit  int // at most this many (<= 0: all)
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
