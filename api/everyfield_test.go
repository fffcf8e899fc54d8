package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A 422 names every bad field (CONTRACT §2), those the body shows as it is
// decoded (a member named twice, one named in another case, a number out
// of range) beside the operation's own (bug 374): the first kind was
// answered alone, and the client that fixed it was told only then of its
// next bad field. A check of the operation on a member already named is
// not named again ("TEXT" is not also "text is required").
func TestEveryBadFieldIsNamedBesideTheBodysOwn(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	for _, tc := range []struct {
		method, path, token, body string
		fields                    []string
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"TEXT":"a","ttl_seconds":5}`, []string{"TEXT", "ttl_seconds"}},
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","text":"b","ttl_seconds":5}`, []string{"text", "ttl_seconds"}},
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","ttl_seconds":1e400,"title":"a\u0000"}`, []string{"ttl_seconds", "title"}},
		{"PUT", "/api/v1/devices/dev-1/settings", tok, `{"brightness":1e400,"volume":500}`, []string{"brightness", "volume"}},
		{"POST", "/api/v1/devices/dev-1/apps/install", tok, `{"App_Id":"clock","version":"x"}`, []string{"App_Id", "version"}},
		{"POST", "/api/v1/admin/devices", testAdminToken, `{"DEVICE_ID":"dev-9","claim_code":"","model":"sim-1"}`, []string{"DEVICE_ID", "claim_code"}},
	} {
		n := e.cmds.count()
		r := e.do(tc.method, tc.path, tc.token, tc.body)
		require.Equal(t, 422, r.status, "%s %s %s: %s", tc.method, tc.path, tc.body, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code)
		assert.ElementsMatch(t, tc.fields, p.fields(), "%s %s: %s", tc.path, tc.body, r.body)
		assert.Equal(t, n, e.cmds.count(), "%s %s made a command", tc.path, tc.body)
	}
}
