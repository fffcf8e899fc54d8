package api

import (
	"context"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

// apiTimeRE is the one form of every time the API writes: RFC 3339 in
// UTC with exactly three fraction digits, what JavaScript's toISOString
// writes and one Swift ISO8601DateFormatter ([.withInternetDateTime,
// .withFractionalSeconds]) reads, whatever the time's nanoseconds.
var apiTimeRE = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$`)

// TestTimesHaveThreeFractionDigits reads times whose nanoseconds are 0
// (a whole second), 120 ms and 123456789 ns from the status, the device
// list and a command, each as an app decodes them (bug 423).
func TestTimesHaveThreeFractionDigits(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.serve("dev-1")
	second := time.Now().UTC().Truncate(time.Second).Add(-time.Minute)
	for i, at := range []time.Time{second, second.Add(120 * time.Millisecond), second.Add(123456789)} {
		battery := 80
		_, err := e.db.PutStatus(context.Background(), companion.Status{DeviceID: "dev-1", Online: true, Battery: &battery,
			FirmwareVersion: "1.0.0", BridgeID: "bridge-1", LastSeen: at, Seq: uint64(i + 1)})
		require.NoError(t, err)
		r := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
		require.Equal(t, http.StatusOK, r.status, "%s", r.body)
		got := r.json(t)["last_seen"]
		assert.Regexp(t, apiTimeRE, got, "last_seen of %s", at.Format(time.RFC3339Nano))
		assert.Equal(t, at.Truncate(time.Millisecond).Format("2006-01-02T15:04:05.000Z"), got)
	}

	r := e.do("GET", "/api/v1/devices", tok, nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	devices := r.json(t)["devices"].([]any)
	require.Len(t, devices, 1)
	d := devices[0].(map[string]any)
	assert.Regexp(t, apiTimeRE, d["bound_at"])
	assert.Regexp(t, apiTimeRE, d["status"].(map[string]any)["last_seen"])
	assert.Regexp(t, apiTimeRE, d["status"].(map[string]any)["updated_at"])

	r = e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
	require.Equal(t, http.StatusAccepted, r.status, "%s", r.body)
	cmd := r.json(t)
	for _, k := range []string{"created_at", "updated_at", "expires_at"} {
		assert.Regexp(t, apiTimeRE, cmd[k], k)
	}
}

// TestAPITimeMarshal: apiTime's own cases, each in the one form: a whole
// second, a fraction Go would trim, 999999999 ns truncated (not rounded
// into the next second), a time in another zone written in UTC, the zero
// time as null, and a year RFC 3339 cannot write refused (bug 423).
func TestAPITimeMarshal(t *testing.T) {
	base := time.Date(2026, 12, 1, 1, 14, 13, 0, time.UTC)
	for _, c := range []struct {
		in   time.Time
		want string
	}{
		{base, `"2026-12-01T01:14:13.000Z"`},
		{base.Add(120 * time.Millisecond), `"2026-12-01T01:14:13.120Z"`},
		{base.Add(999999999), `"2026-12-01T01:14:13.999Z"`},
		{base.In(time.FixedZone("CET", 3600)), `"2026-12-01T01:14:13.000Z"`},
		{time.Time{}, `null`},
	} {
		b, err := apiTime(c.in).MarshalJSON()
		require.NoError(t, err, "%v", c.in)
		assert.Equal(t, c.want, string(b), "%v", c.in)
	}
	_, err := apiTime(time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)).MarshalJSON()
	assert.Error(t, err, "year 10000")
}
