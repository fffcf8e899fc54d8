package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A member named in another case than the operation's member it resembles
// is never read as that member (docs/api.md), its value's JSON type
// included (bug 562): {"text":"a","Title":1} was a 400 "field "title" has
// the wrong JSON type", naming a member the body does not have, and
// {"text":"a","title":"t","TITLE":2} said so of a title that is a string.
func TestAMisnamedMemberOfAnotherTypeIsNotReadAsTheOneItResembles(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	const text = "/api/v1/devices/dev-1/push/text"
	cased := func(field, meant string) FieldError {
		return FieldError{Field: field, Message: `must be written "` + meant + `": member names are case-sensitive`}
	}
	for _, tc := range []struct {
		method, path, token, body string
		errors                    []FieldError
	}{
		{"POST", text, tok, `{"text":"a","Title":1}`, []FieldError{cased("Title", "title")}},
		{"POST", text, tok, `{"text":"a","title":"t","TITLE":2}`, []FieldError{cased("TITLE", "title")}},
		{"POST", text, tok, `{"TEXT":1}`, []FieldError{cased("TEXT", "text")}},
		{"POST", text, tok, `{"text":"a","TTL_SECONDS":"x"}`, []FieldError{cased("TTL_SECONDS", "ttl_seconds")}},
		{"POST", text, tok, `{"text":"a","Ttl_Seconds":1e400}`, []FieldError{cased("Ttl_Seconds", "ttl_seconds")}},
		{"PUT", "/api/v1/devices/dev-1/bridge", tok, `{"Bridge_ID":5}`, []FieldError{cased("Bridge_ID", "bridge_id")}},
		{"POST", "/api/v1/admin/users", testAdminToken, `{"NAME":5}`, []FieldError{cased("NAME", "name")}},
	} {
		r := e.do(tc.method, tc.path, tc.token, tc.body)
		require.Equal(t, 422, r.status, "%s %s %s = %d %s", tc.method, tc.path, tc.body, r.status, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code, "%s", tc.body)
		assert.Equal(t, tc.errors, p.Errors, "%s: %s", tc.body, r.body)
	}
	assert.Zero(t, e.cmds.count(), "no command for a refused body")

	// A wrong type of a member written as it should be is the 400 it was.
	r := e.do("POST", text, tok, `{"text":"a","title":1,"TITLE":"x"}`)
	require.Equal(t, 400, r.status, "%s", r.body)
	assert.Equal(t, []FieldError{{Field: "title", Message: "must be a string"}}, r.problem(t).Errors)
}
