package api

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/topics"
)

// A string setting's value with a NUL is no value a device can hold: its
// settings handler is C, and keeps the value as a C string, which ends at
// the NUL; the bridge reads a value without the NULs that end it (bug
// 576). Taken, "kitchen\u0000" was sent and desired, the device reported
// "kitchen", and the change stayed pending for good. It is a 422 naming
// the setting, for a device whose schema the server knows and for one
// whose schema it does not know yet alike, and no command is made (bug
// 578).
func TestASettingWithANULIsRefused(t *testing.T) {
	e := newEnv(t)
	known := e.bound("dev-1")
	e.serve("dev-1")
	schema := json.RawMessage(`{"nickname": {"type": "string", "max_len": 16, "default": ""},
		"language": {"type": "enum", "values": ["en","de"], "default": "en"}}`)
	_, err := e.db.PutReportedSettings(context.Background(), "dev-1", "", map[string]json.RawMessage{
		"nickname": json.RawMessage(`""`), "language": json.RawMessage(`"en"`)}, schema, time.Now(), uint64(time.Now().UnixNano()))
	require.NoError(t, err)
	unknown := e.user("owner of dev-2")
	e.provision("dev-2", "code-dev-2", "acme-1") // a model whose schema the server does not know
	r := e.do("POST", "/api/v1/devices/register", unknown, map[string]any{"device_id": "dev-2", "claim_code": "code-dev-2"})
	require.Equal(t, 201, r.status, "%s", r.body)

	for _, tc := range []struct{ dev, tok, body string }{
		{"dev-1", known, `{"nickname":"kitchen\u0000"}`},
		{"dev-1", known, `{"nickname":"a\u0000b"}`},
		{"dev-2", unknown, `{"nickname":"kitchen\u0000"}`},
		{"dev-2", unknown, `{"nickname":"\u0000"}`},
	} {
		r := e.do("PUT", "/api/v1/devices/"+tc.dev+"/settings", tc.tok, tc.body)
		require.Equal(t, 422, r.status, "PUT …/settings %s of %s = %d %s", tc.body, tc.dev, r.status, r.body)
		p := r.problem(t)
		require.Len(t, p.Errors, 1, "%s: %s", tc.body, r.body)
		assert.Equal(t, "nickname", p.Errors[0].Field, "%s", tc.body)
		assert.Equal(t, topics.NoNUL, p.Errors[0].Message, "%s", tc.body)
	}
	assert.Zero(t, e.cmds.count(), "no command for a refused body")

	// Its bridge refuses one likewise (the device's schema, checked there).
	errs := topics.Schema{"nickname": {Type: topics.SettingString}}.Validate(map[string]any{"nickname": "kitchen\x00"})
	assert.Len(t, errs, 1, "the bridge's check of a string setting with a NUL")

	for _, tc := range []struct{ dev, tok string }{{"dev-1", known}, {"dev-2", unknown}} {
		r := e.do("PUT", "/api/v1/devices/"+tc.dev+"/settings", tc.tok, `{"nickname":"kitchen\ttable"}`)
		assert.Equal(t, 202, r.status, "a tab is a string's own: %s", r.body)
	}
}
