package api

import (
	"encoding/json"
	"errors"
	"sort"
	"time"

	"github.com/devicecompanion/companion"
)

// The shapes of CONTRACT §2's answers. Times never set are null.

type statusJSON struct {
	DeviceID        string  `json:"device_id"`
	Online          bool    `json:"online"`
	Battery         *int    `json:"battery"`
	FirmwareVersion *string `json:"firmware_version"`
	Model           *string `json:"model"`
	BridgeID        *string `json:"bridge_id"`
	LastSeen        apiTime `json:"last_seen"`
	UpdatedAt       apiTime `json:"updated_at"`
}

type deviceJSON struct {
	DeviceID string     `json:"device_id"`
	Name     string     `json:"name"`
	Model    string     `json:"model"`
	BoundAt  apiTime    `json:"bound_at"`
	Status   statusJSON `json:"status"`
}

type commandJSON struct {
	ID        string                  `json:"id"`
	DeviceID  string                  `json:"device_id"`
	Op        string                  `json:"op"`
	State     string                  `json:"state"`
	Progress  *int                    `json:"progress,omitempty"`
	Error     *companion.CommandError `json:"error,omitempty"`
	Result    json.RawMessage         `json:"result,omitempty"`
	CreatedAt apiTime                 `json:"created_at"`
	UpdatedAt apiTime                 `json:"updated_at"`
	ExpiresAt apiTime                 `json:"expires_at"`
}

type appJSON struct {
	AppID   string `json:"app_id"`
	Version string `json:"version"`
}

// apiTime is a time as every answer and event of the API writes it: RFC
// 3339 in UTC with exactly three fraction digits, truncated to the
// millisecond ("2026-11-23T15:04:05.000Z"), which is what JavaScript's
// toISOString writes. time.Time writes as few fraction digits as its
// nanoseconds need and none for a whole second, and no one decoder of
// Swift's reads both forms: JSONDecoder's .iso8601 refuses any fraction,
// an ISO8601DateFormatter with .withFractionalSeconds refuses none
// (docs/reliability.md, bug 423). Order between times of one millisecond
// is the order of ids (command ids are UUIDv7, events' ids count up);
// nothing takes a time back as input.
type apiTime time.Time

// apiTimeLayout is apiTime's form; the time is in UTC when formatted.
const apiTimeLayout = "2006-01-02T15:04:05.000Z"

// MarshalJSON writes the time in apiTimeLayout, and the zero time as null.
func (t apiTime) MarshalJSON() ([]byte, error) {
	u := time.Time(t)
	if u.IsZero() {
		return []byte("null"), nil
	}
	u = u.UTC()
	if y := u.Year(); y < 0 || y > 9999 {
		return nil, errors.New("api: a time's year is outside 0–9999, which RFC 3339 cannot write")
	}
	b := make([]byte, 0, len(apiTimeLayout)+2)
	b = append(b, '"')
	b = u.AppendFormat(b, apiTimeLayout) // .000 truncates, never rounds up
	return append(b, '"'), nil
}

// timeOrNull is t as the API writes it, null when t is zero. A value,
// not a pointer: a command's answer is marshalled per command.
func timeOrNull(t time.Time) apiTime { return apiTime(t) }

func stringOrNull(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func toStatus(deviceID, model string, st companion.Status) statusJSON {
	if st.Model != "" {
		model = st.Model
	}
	return statusJSON{
		DeviceID:        deviceID,
		Online:          st.Online,
		Battery:         st.Battery,
		FirmwareVersion: stringOrNull(st.FirmwareVersion),
		Model:           stringOrNull(model),
		BridgeID:        stringOrNull(st.BridgeID),
		LastSeen:        timeOrNull(st.LastSeen),
		UpdatedAt:       timeOrNull(st.UpdatedAt),
	}
}

func toDevice(b companion.Binding, st companion.Status) deviceJSON {
	return deviceJSON{
		DeviceID: b.DeviceID,
		Name:     b.Name,
		Model:    b.Model,
		BoundAt:  timeOrNull(b.BoundAt),
		Status:   toStatus(b.DeviceID, b.Model, st),
	}
}

func toCommand(c companion.Command) commandJSON {
	var result json.RawMessage
	if len(c.Result) > 0 && json.Valid(c.Result) {
		// A result stored before bug 370's fix may not be valid Unicode.
		result = companion.UnicodeJSON(c.Result)
	}
	return commandJSON{
		ID:        c.ID,
		DeviceID:  c.DeviceID,
		Op:        c.Op,
		State:     c.State,
		Progress:  c.Progress,
		Error:     c.Error,
		Result:    result,
		CreatedAt: timeOrNull(c.CreatedAt),
		UpdatedAt: timeOrNull(c.UpdatedAt),
		ExpiresAt: timeOrNull(c.ExpiresAt),
	}
}

func toApps(apps []companion.App) []appJSON {
	out := make([]appJSON, 0, len(apps))
	for _, a := range apps {
		out = append(out, appJSON(a))
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
