package api

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/devicecompanion/companion/topics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A number is judged by its digits, not by the float64 nearest them: a
// ttl_seconds a hair past 60–604800, or a setting a hair past its max or
// off a whole number, was read as the bound or the int it rounds to, and
// taken (docs/reliability.md, bug 511).
func TestNumbersJudgedByTheirDigits(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	text := "/api/v1/devices/dev-1/push/text"
	image := "/api/v1/devices/dev-1/push/image"
	settings := "/api/v1/devices/dev-1/settings"
	small := b64(pngOf(t, 2, 2))
	for _, tc := range []struct {
		path, body string
		message    string // of the one field named
	}{
		{text, `{"text":"x","ttl_seconds":59.99999999999999999}`, "must be a whole number of seconds"},
		{text, `{"text":"x","ttl_seconds":604800.00000000000001}`, "must be a whole number of seconds"},
		{text, `{"text":"x","ttl_seconds":60.0000000000000000001}`, "must be a whole number of seconds"},
		{text, `{"text":"x","ttl_seconds":6048010000000000000000e-16}`, "must be between 60 and 604800"},
		{text, `{"text":"x","ttl_seconds":1e30}`, "must be between 60 and 604800"},
		{text, `{"text":"x","ttl_seconds":1e-400}`, "must be a whole number of seconds"},
		{image, `{"image":"` + small + `","ttl_seconds":86400.000000000000001}`, "must be a whole number of seconds"},
		{settings, `{"brightness":100.00000000000000000000001}`, "must be an integer"},
		{settings, `{"volume":1.000000000000000000001}`, "must be an integer"},
		{settings, `{"volume":-0.00000000000000000001}`, "must be an integer"},
		{settings, `{"volume":1e-400}`, "must be an integer"},
		{settings, `{"display_timeout_s":600.0000000000000001}`, "must be an integer"},
		// A whole number past 64 bits is an integer out of range, not
		// "not an integer".
		{settings, `{"volume":1e19}`, "must be between 0 and 100"},
		{settings, `{"volume":-9223372036854775809}`, "must be between 0 and 100"},
		{settings, `{"brightness":18446744073709551616.000}`, "must be between 0 and 100"},
	} {
		r := e.do("POST", tc.path, tok, tc.body)
		if tc.path == settings {
			r = e.do("PUT", tc.path, tok, tc.body)
		}
		require.Equal(t, 422, r.status, "%s %s = %d %s", tc.path, tc.body, r.status, r.body)
		p := r.problem(t)
		require.Len(t, p.Errors, 1, "%s: %s", tc.body, r.body)
		assert.Equal(t, tc.message, p.Errors[0].Message, "%s: %s", tc.body, r.body)
	}
	assert.Zero(t, e.cmds.count(), "no command for a refused body")

	// Whole numbers however written are taken, as the ints they are.
	for _, tc := range []struct {
		path, body string
		ttl        int64 // seconds, of a push
	}{
		{text, `{"text":"x","ttl_seconds":60}`, 60},
		{text, `{"text":"x","ttl_seconds":6e1}`, 60},
		{text, `{"text":"x","ttl_seconds":604800.000}`, 604800},
		{text, `{"text":"x","ttl_seconds":6048000e-1}`, 604800},
		{settings, `{"brightness":100.000,"volume":1e1,"display_timeout_s":0.05e3}`, 0},
	} {
		method := "POST"
		if tc.path == settings {
			method = "PUT"
		}
		r := e.do(method, tc.path, tok, tc.body)
		require.Equal(t, 202, r.status, "%s %s = %d %s", tc.path, tc.body, r.status, r.body)
		c := e.cmds.last(t)
		if tc.ttl != 0 {
			assert.Equal(t, tc.ttl, int64(c.ExpiresAt.Sub(c.CreatedAt).Round(time.Second).Seconds()), tc.body)
		}
	}
}

// The values of a settings change are sent as the ints they are, in the
// digits a device reports them in, and one past 2^53 written with a
// fraction of zeros is the int it is, not the float64 nearest it.
func TestSettingsWholeNumbersSentExactly(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	r := e.do("PUT", "/api/v1/devices/dev-1/settings", tok, `{"brightness":100.000,"volume":1e1}`)
	require.Equal(t, 202, r.status, "%s", r.body)
	var p topics.SettingsUpdate
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &p))
	assert.Equal(t, map[string]any{"brightness": 100.0, "volume": 10.0}, p.Settings)

	r = e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
	require.Equal(t, 200, r.status)
	assert.Equal(t, map[string]any{"brightness": 100.0, "volume": 10.0}, r.json(t)["desired"])
}
