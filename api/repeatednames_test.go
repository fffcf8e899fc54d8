package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A member named twice in a body is a 422 naming it (bug 369):
// encoding/json took the last silently, so {"text":"a","text":"b"} pushed
// "b" where a proxy, a log or an audit reading the first saw "a". Names
// are compared as decoded ("t\u0065xt" is "text"). A repeat inside a
// member the operation does not read is let be, as that member is.
func TestRepeatedMemberNamesAreRefused(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for _, tc := range []struct {
		method, path, token, body string
		fields                    []string
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","text":"b"}`, []string{"text"}},
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","t\u0065xt":"a"}`, []string{"text"}},
		{"POST", "/api/v1/devices/dev-1/push/text", tok, `{"title":"x","text":"a","title":"y","ttl_seconds":60,"ttl_seconds":600}`, []string{"title", "ttl_seconds"}},
		{"PUT", "/api/v1/devices/dev-1/settings", tok, `{"brightness":10,"brightness":90}`, []string{"brightness"}},
		{"POST", "/api/v1/devices/dev-1/ota/update", tok, `{"version":"1.0.0","version":"2.0.0"}`, []string{"version"}},
		{"POST", "/api/v1/devices/dev-1/apps/install", tok, `{"app_id":"x","app_id":"y"}`, []string{"app_id"}},
		{"POST", "/api/v1/admin/users", testAdminToken, `{"name":"a","name":"b"}`, []string{"name"}},
		{"PUT", "/api/v1/admin/devices/dev-1/bridge", testAdminToken, `{"bridge_id":"b-1","bridge_id":null}`, []string{"bridge_id"}},
	} {
		n := e.cmds.count()
		r := e.do(tc.method, tc.path, tc.token, tc.body)
		require.Equal(t, 422, r.status, "%s %s %s: %s", tc.method, tc.path, tc.body, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code, "%s %s", tc.path, tc.body)
		assert.Equal(t, tc.fields, p.fields(), "%s %s", tc.path, tc.body)
		assert.Equal(t, n, e.cmds.count(), "%s %s made a command", tc.path, tc.body)
	}
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","extra":{"x":1,"x":2}}`)
	assert.Equal(t, 202, r.status, "a repeat inside a member no operation reads: %s", r.body)
	r = e.do("POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a","list":[{"text":1},{"text":2}]}`)
	assert.Equal(t, 202, r.status, "the same name in two objects of an array: %s", r.body)
	r = e.do("POST", "/api/v1/devices/dev-1/push/text", tok, `{"text":"a\"text\":"}`)
	assert.Equal(t, 202, r.status, "a name inside a string: %s", r.body)
}

// A 422 names each fault of a body once (bug 556): a number out of range
// in a member named twice was named once for each copy, beside "must be
// given once", so that a form showed the same message twice under one
// field. Two faults of one member are each named, once.
func TestABodyFaultIsNamedOnce(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	fe := func(field, message string) FieldError { return FieldError{Field: field, Message: message} }
	for _, tc := range []struct {
		method, path, body string
		errors             []FieldError
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"a","ttl_seconds":1e400,"ttl_seconds":1e400}`,
			[]FieldError{fe("ttl_seconds", "must be given once"), fe("ttl_seconds", "is a number out of range")}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"a","ttl_seconds":1e400,"ttl_seconds":60,"ttl_seconds":-1e999}`,
			[]FieldError{fe("ttl_seconds", "must be given once"), fe("ttl_seconds", "is a number out of range")}},
		{"PUT", "/api/v1/devices/dev-1/settings", `{"brightness":1e400,"brightness":1e400,"volume":1e400}`,
			[]FieldError{fe("brightness", "must be given once"), fe("brightness", "is a number out of range"), fe("volume", "is a number out of range")}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"TEXT":"a","TEXT":"b"}`,
			[]FieldError{fe("TEXT", "must be given once"), fe("TEXT", `must be written "text": member names are case-sensitive`)}},
	} {
		r := e.do(tc.method, tc.path, tok, tc.body)
		require.Equal(t, 422, r.status, "%s %s: %s", tc.method, tc.body, r.body)
		assert.Equal(t, tc.errors, r.problem(t).Errors, "%s %s: %s", tc.method, tc.body, r.body)
	}
	assert.Zero(t, e.cmds.count(), "no command for a refused body")
}
