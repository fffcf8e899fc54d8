package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A name is something to show: one of white space alone, or of
// characters that draw nothing (a zero-width space, a BOM), is a 422 as
// an empty one is (bug 558). A device registered as "   " was listed
// with no name in its user's app, and a user made as " " likewise. A
// name with a visible character is kept as given, its spaces too.
func TestBlankNamesAreRefused(t *testing.T) {
	e := newEnv(t)
	tok := e.user("u1")
	for i, name := range []string{" ", "   ", "\u00a0", "\u3000", " \u2003 ", "\u200b", "\ufeff", "\u2060 \u200b", "\u200e"} {
		id := "dev-" + string(rune('a'+i))
		e.provision(id, "code-"+id, "sim-1")
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": "code-" + id, "name": name})
		require.Equal(t, 422, r.status, "register with the name %q = %d %s", name, r.status, r.body)
		assert.Equal(t, []FieldError{{Field: "name", Message: "must not be blank"}}, r.problem(t).Errors, "%q", name)
		r = e.do("GET", "/api/v1/devices", tok, nil)
		require.Equal(t, 200, r.status)
		assert.Empty(t, r.json(t)["devices"], "the name %q bound the device", name)

		r = e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": name})
		require.Equal(t, 422, r.status, "a user named %q = %d %s", name, r.status, r.body)
		assert.Equal(t, []FieldError{{Field: "name", Message: "must not be blank"}}, r.problem(t).Errors, "%q", name)
	}

	for i, name := range []string{" Kitchen ", "\u200bx", "👍", "a\u200db"} {
		id := "dev-k" + string(rune('a'+i))
		e.provision(id, "code-"+id, "sim-1")
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": "code-" + id, "name": name})
		require.Equal(t, 201, r.status, "register with the name %q = %d %s", name, r.status, r.body)
		assert.Equal(t, name, r.json(t)["name"], "the name is kept as given")
		r = e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": name})
		require.Equal(t, 201, r.status, "a user named %q = %d %s", name, r.status, r.body)
		assert.Equal(t, name, r.json(t)["name"])
	}
}

// A name's control character is named with its byte, as free text's is
// (bug 559): docs/api.md says a field with one is "naming the field, the
// character and its byte", and a name said only "must not contain control
// characters", which a user who pasted a tab could not find.
func TestANamesControlCharacterIsNamed(t *testing.T) {
	e := newEnv(t)
	tok := e.user("u1")
	e.provision("dev-1", "code-1", "sim-1")
	r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "dev-1", "claim_code": "code-1", "name": "Kit\tchen"})
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, []FieldError{{Field: "name", Message: "must not contain control characters: it has U+0009 at byte 3"}}, r.problem(t).Errors)
	r = e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "Ann\u0085"})
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, []FieldError{{Field: "name", Message: "must not contain control characters: it has U+0085 at byte 3"}}, r.problem(t).Errors)
}
