package companion

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"
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

// ServingBridge is a bridge with the devices it serves (in id order), as a
// list of bridges reads them together.
type ServingBridge struct {
	Bridge
	Devices []string
}

// Binding ties a device to the user who registered it.
type Binding struct {
	DeviceID string    `json:"device_id"`
	UserID   string    `json:"user_id"`
	Name     string    `json:"name"`
	Model    string    `json:"model"`
	BoundAt  time.Time `json:"bound_at"`
}

// Unbound is what an unbinding changed besides the binding. What the user
// asked of the device and it has not done yet is theirs, not the next
// owner's: their unfinished commands end (EndUnbound) and their desired
// settings are dropped, in the unbinding's transaction, so that nothing of
// theirs reaches the device, or its next owner's bridge, afterwards.
type Unbound struct {
	// Bridge is the user's own bridge that stopped serving the device ("":
	// none did; a device stays on the operator's bridge).
	Bridge string
	// Ended are the user's commands of the device that were not final, as
	// EndUnbound left them, oldest first.
	Ended []Command
}

// App is an installed app as a device last reported it.
type App struct {
	AppID   string `json:"app_id"`
	Version string `json:"version"`
}

// DeviceInfo is what a device reports about itself when asked: the
// bridge reads it on connect, every minute and after an app or OTA
// command, and turns it into a Status.
type DeviceInfo struct {
	Model           string
	FirmwareVersion string
	Battery         int // percent; -1 when the device's level is not one (BatteryUnknown)
	Apps            []App
}

// BatteryUnknown is DeviceInfo.Battery of a device whose battery level
// could not be read as one byte 0–100: its status reports the battery as
// unknown (null), and the rest of what was read.
const BatteryUnknown = -1

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

// BoundDevice is a device bound to a user, with its last reported status.
type BoundDevice struct {
	Binding Binding
	Status  Status // as Status returns it: the zero Status with DeviceID set before any report
}

// DeviceReport is the state of a device that came with a reply to one of
// its commands: what the command changed.
type DeviceReport struct {
	Status   *Status           // stored as PutStatus stores it
	Settings *ReportedSettings // stored as PutReportedSettings stores it
	// BridgeID, when set, is the bridge the caller found serving the
	// device: the settings are stored as PutReportedSettings stores those
	// of that bridge, only if it serves the device still.
	BridgeID string
}

// ReportedSettings are settings as a device reported them: each value and
// the schema as JSON.
type ReportedSettings struct {
	Reported map[string]json.RawMessage
	Schema   json.RawMessage // kept as stored when empty
	At       time.Time
	Seq      uint64
}

// NewReportedSettings checks and compacts settings as a device reported
// them: each value and the schema must be JSON (ErrInvalid otherwise).
func NewReportedSettings(reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64) (ReportedSettings, error) {
	r := ReportedSettings{Reported: make(map[string]json.RawMessage, len(reported)), At: at, Seq: seq}
	for k, v := range reported {
		c, err := CompactJSON(v)
		if err != nil {
			return ReportedSettings{}, fmt.Errorf("%w: reported setting %q: %v", ErrInvalid, k, err)
		}
		r.Reported[k] = c
	}
	if len(schema) > 0 {
		c, err := CompactJSON(schema)
		if err != nil {
			return ReportedSettings{}, fmt.Errorf("%w: settings schema: %v", ErrInvalid, err)
		}
		r.Schema = c
	}
	return r, nil
}

// MaxSeqAhead is how far past the server's clock a report's seq may be,
// read as a time: a bridge's seq is its clock in nanoseconds. The stores
// keep a device's highest seq and take no report below it, so a report
// whose seq is far ahead held back every later one until the bridge's
// clock reached it: years for a clock once set years ahead, never for
// 2^64−1. The broker refuses such a report, and the stores take a stored
// seq past it for one from another era (see Newer). A day lets through a
// clock off by a time zone (up to 14 hours ahead), and bounds how long the
// reports of a bridge whose fast clock is set right count for nothing.
const MaxSeqAhead = 24 * time.Hour

// SeqLimit is the highest seq a report may carry at now (MaxSeqAhead past
// it, as Unix nanoseconds).
func SeqLimit(now time.Time) uint64 { return uint64(now.Add(MaxSeqAhead).UnixNano()) }

// Newer reports whether a report with seq and at replaces one with
// storedSeq and storedAt, at the server's time now: a higher seq wins, and
// an equal seq with a later time. Bridges use a nanosecond clock as seq, so
// it rises across their restarts; a report that arrives late never
// overwrites a fresher one. A stored seq past SeqLimit(now) was taken
// before the broker refused such reports, or before the server's clock
// stepped back by more than a day: any report within the limit replaces
// it, or the device's state would stay frozen at it (the limit grows with
// the clock, so a seq taken within it never passes it later).
func Newer(seq uint64, at time.Time, storedSeq uint64, storedAt time.Time, now time.Time) bool {
	if limit := SeqLimit(now); storedSeq > limit && seq <= limit {
		return true
	}
	return seq > storedSeq || (seq == storedSeq && at.After(storedAt))
}

// ApplyTo merges the report into s, whose maps are not nil: Reported is
// replaced, Schema unless the report's is empty, At and Seq become the
// report's, and each desired key whose value the device now reports is
// dropped, as it is no longer pending. UpdatedAt is the caller's.
func (r ReportedSettings) ApplyTo(s *Settings) {
	s.Reported = maps.Clone(r.Reported)
	if r.Schema != nil {
		s.Schema = r.Schema
	}
	for k, want := range s.Desired {
		if got, ok := r.Reported[k]; ok && SameJSON(got, want) {
			delete(s.Desired, k)
		}
	}
	s.At, s.Seq = r.At, r.Seq
}

// Withdraw takes out of s.Desired the settings that ended asked for, a
// settings command that ended without succeeding (Command.WithdrawsDesired):
// nothing will apply them. others are the device's other commands: those
// with an id above ended's, and those below it that are not final or
// succeeded (a store may leave out those below the oldest that is not
// final: they decide nothing). Desired values follow the commands in id
// order (Command.Desired), and a change that ended without succeeding
// counts for nothing. So a setting that a later change asked for stays:
// it is that change's. One that an earlier change asked for is that
// change's again, of the latest such change: its value when the change is
// not final, which the device is still to be sent or to apply; none when
// it succeeded, since the device ran it, and the earlier ones before it,
// and its final reply brought the value it set (bug 251: the earlier
// change still open was left out of desired and pending until it ended).
// A value the device reports already goes too, as a report takes out
// those it brings (ReportedSettings.ApplyTo). Only settings still desired
// are touched: one the device reported meanwhile, or that an unbinding
// dropped, stays out. It reports whether it changed s.Desired (bug 236: a
// canceled, failed or expired change was listed as desired and pending
// for good).
func (s *Settings) Withdraw(ended Command, others []Command) bool {
	asked := ended.SettingsAsked()
	if len(s.Desired) == 0 || len(asked) == 0 {
		return false
	}
	kept := map[string]bool{}
	back := map[string]json.RawMessage{} // a setting → its value of the latest earlier change (nil: none, it succeeded)
	backID := map[string]string{}        // a setting → that change's id
	for _, c := range others {
		if c.WithdrawsDesired() {
			continue
		}
		switch {
		case c.ID > ended.ID:
			for _, k := range c.SettingsAsked() {
				kept[k] = true
			}
		case c.ID < ended.ID && (!IsFinal(c.State) || c.State == StateSucceeded):
			for k, v := range c.settingsAsked() {
				if c.ID < backID[k] {
					continue
				}
				backID[k], back[k] = c.ID, nil
				if c.State == StateSucceeded {
					continue
				}
				// As CreateCommand recorded it (NewDesiredSettings).
				if v, err := CompactJSON(v); err == nil {
					back[k] = v
				}
			}
		}
	}
	changed := false
	for _, k := range asked {
		had, ok := s.Desired[k]
		switch {
		case !ok || kept[k]:
		case back[k] != nil && !SameJSON(back[k], s.Reported[k]):
			if !bytes.Equal(had, back[k]) {
				s.Desired[k] = back[k]
				changed = true
			}
		default:
			delete(s.Desired, k)
			changed = true
		}
	}
	return changed
}

// NewDesiredSettings checks and compacts settings a user asked for: each
// value must be JSON (ErrInvalid otherwise, naming the first bad key in
// key order).
func NewDesiredSettings(partial map[string]json.RawMessage) (map[string]json.RawMessage, error) {
	want := make(map[string]json.RawMessage, len(partial))
	for _, k := range slices.Sorted(maps.Keys(partial)) {
		c, err := CompactJSON(partial[k])
		if err != nil {
			return nil, fmt.Errorf("%w: desired setting %q: %v", ErrInvalid, k, err)
		}
		want[k] = c
	}
	return want, nil
}

// CompactJSON returns v without insignificant white space, in a new
// slice: how the stores keep JSON values, whatever the engine.
func CompactJSON(v json.RawMessage) (json.RawMessage, error) {
	var buf bytes.Buffer
	if err := json.Compact(&buf, v); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// SameJSON reports whether two JSON values have the same compacted text
// (false when either is not JSON).
func SameJSON(a, b json.RawMessage) bool {
	ca, err := CompactJSON(a)
	if err != nil {
		return false
	}
	cb, err := CompactJSON(b)
	if err != nil {
		return false
	}
	return bytes.Equal(ca, cb)
}
