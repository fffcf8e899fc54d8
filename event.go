package companion

import (
	"slices"
	"time"
)

// Event kinds: what a user's event stream (GET /api/v1/events) carries.
const (
	// EventCommand: one of the user's commands changed state, progress or
	// error.
	EventCommand = "command"
	// EventDevice: a device bound to the user changed status (online,
	// battery, firmware version, apps).
	EventDevice = "device"
)

// EventRetention is how long the stores keep events: the server purges
// older ones (PurgeEvents) in its hourly retention pass, so a stream
// resumes without a gap (Last-Event-ID) for at least an hour.
const EventRetention = 2 * time.Hour

// Event is one entry of the store's event log: a change announced to one
// user. The store writes it in the transaction of the change it
// describes, so nothing is announced that was not committed and nothing
// committed goes unannounced.
type Event struct {
	// ID is the event's place in the log, assigned by the store: an
	// opaque string, and the cursor that Events takes to resume after it.
	// The ids of one store compare as strings in the order of the log.
	ID       string    `json:"-"`
	Kind     string    `json:"kind"`
	UserID   string    `json:"user_id,omitempty"`
	DeviceID string    `json:"device_id"`
	At       time.Time `json:"at"` // when the store made the change

	Command *CommandEvent `json:"command,omitempty"` // with Kind EventCommand
	Device  *DeviceEvent  `json:"device,omitempty"`  // with Kind EventDevice
}

// CommandEvent is a command as an event shows it.
type CommandEvent struct {
	ID       string        `json:"id"`
	Op       string        `json:"op"`
	State    string        `json:"state"`
	Progress *int          `json:"progress,omitempty"`
	Error    *CommandError `json:"error,omitempty"`
}

// DeviceEvent is a device's status as an event shows it.
type DeviceEvent struct {
	Online          bool   `json:"online"`
	Battery         *int   `json:"battery"`
	FirmwareVersion string `json:"firmware_version"`
	Apps            []App  `json:"apps"`
}

// CommandChanged returns the event of command c as now stored, for its
// user.
func CommandChanged(c Command) Event {
	ce := &CommandEvent{ID: c.ID, Op: c.Op, State: c.State}
	if c.Progress != nil {
		p := *c.Progress
		ce.Progress = &p
	}
	if c.Error != nil {
		e := *c.Error
		ce.Error = &e
	}
	return Event{Kind: EventCommand, UserID: c.UserID, DeviceID: c.DeviceID, At: c.UpdatedAt, Command: ce}
}

// CommandEventDue reports whether a command that was old and is now c
// changed as its user sees it: state, progress or error.
func CommandEventDue(old, c Command) bool {
	return old.State != c.State || !sameIntPtr(old.Progress, c.Progress) || !sameError(old.Error, c.Error)
}

// DeviceChanged returns the event of status s, as now stored, for user
// userID ("" when the engine fills it in).
func DeviceChanged(userID string, s Status) Event {
	de := &DeviceEvent{Online: s.Online, FirmwareVersion: s.FirmwareVersion, Apps: slices.Clone(s.Apps)}
	if s.Battery != nil {
		b := *s.Battery
		de.Battery = &b
	}
	if de.Apps == nil {
		de.Apps = []App{}
	}
	return Event{Kind: EventDevice, UserID: userID, DeviceID: s.DeviceID, At: s.UpdatedAt, Device: de}
}

// DeviceEventDue reports whether a status that was old (found false: there
// was none) and is now s changed as a user sees it: online, battery,
// firmware version or apps. A report that repeats the last one is no
// event.
func DeviceEventDue(old Status, found bool, s Status) bool {
	return !found || old.Online != s.Online || !sameIntPtr(old.Battery, s.Battery) ||
		old.FirmwareVersion != s.FirmwareVersion || !slices.Equal(old.Apps, s.Apps)
}

func sameIntPtr(a, b *int) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}

func sameError(a, b *CommandError) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}
