package api

import (
	"encoding/json"
	"sort"
	"time"

	"github.com/devicecompanion/companion"
)

// The shapes of CONTRACT §2's answers. Times never set are null.

type statusJSON struct {
	DeviceID        string     `json:"device_id"`
	Online          bool       `json:"online"`
	Battery         *int       `json:"battery"`
	FirmwareVersion *string    `json:"firmware_version"`
	Model           *string    `json:"model"`
	BridgeID        *string    `json:"bridge_id"`
	LastSeen        *time.Time `json:"last_seen"`
	UpdatedAt       *time.Time `json:"updated_at"`
}

type deviceJSON struct {
	DeviceID string     `json:"device_id"`
	Name     string     `json:"name"`
	Model    string     `json:"model"`
	BoundAt  *time.Time `json:"bound_at"`
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
	CreatedAt *time.Time              `json:"created_at"`
	UpdatedAt *time.Time              `json:"updated_at"`
	ExpiresAt *time.Time              `json:"expires_at"`
}

type appJSON struct {
	AppID   string `json:"app_id"`
	Version string `json:"version"`
}

func timeOrNull(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	u := t.UTC()
	return &u
}

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
