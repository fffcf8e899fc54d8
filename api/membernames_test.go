package api

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Member names are case-sensitive: encoding/json matches a field's name
// whatever its case, so without a check {"TEXT": "hi"} would push a text
// the client never named. A member that is a field's name but for its
// case is a 422 naming it; members that name no field are ignored, as
// before.
func TestMemberNamesAreCaseSensitive(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	push := "/api/v1/devices/dev-1/push/text"
	for _, tc := range []struct {
		body  string
		field string
	}{
		{`{"TEXT":"hi"}`, "TEXT"},
		{`{"Text":"hi"}`, "Text"},
		{`{"text":"hi","Title":"x"}`, "Title"},
		{`{"text":"hi","ttl_\u017feconds":60}`, "ttl_\u017feconds"}, // ſ folds to s
	} {
		n := e.cmds.count()
		r := e.do("POST", push, tok, tc.body)
		require.Equal(t, 422, r.status, "POST push/text %s: %s", tc.body, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code, "POST push/text %s", tc.body)
		assert.Equal(t, []string{tc.field}, p.fields(), "POST push/text %s", tc.body)
		assert.Equal(t, n, e.cmds.count(), "POST push/text %s made a command", tc.body)
	}
	r := e.do("POST", push, tok, `{"text":"hi","colour":"red"}`)
	assert.Equal(t, 202, r.status, "an unknown member is ignored: %s", r.body)

	r = e.do("POST", "/api/v1/admin/users", testAdminToken, `{"NAME":"gina"}`)
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, []string{"NAME"}, r.problem(t).fields())
}

// The bridge assignment checks that bridge_id is there (only an explicit
// null unassigns); a second member BRIDGE_ID used to be decoded over it.
func TestAssignMemberCase(t *testing.T) {
	e := newBridgesEnv(t)
	require.Equal(t, 201, e.do("POST", "/api/v1/bridges", e.alice, map[string]any{"bridge_id": "alice-hub"}).status)
	require.Equal(t, 201, e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "b-2"}).status)
	bridgeOf := func(dev string) string {
		t.Helper()
		b, err := e.db.DeviceBridge(context.Background(), dev)
		require.NoError(t, err)
		return b
	}
	for _, tc := range []struct{ path, token string }{
		{"/api/v1/devices/dev-a/bridge", e.alice},
		{"/api/v1/admin/devices/dev-a/bridge", testAdminToken},
	} {
		for _, body := range []string{
			`{"bridge_id":null,"BRIDGE_ID":"alice-hub"}`,
			`{"bridge_id":null,"BRIDGE_ID":"b-2"}`,
			`{"Bridge_Id":"alice-hub"}`,
		} {
			r := e.do("PUT", tc.path, tc.token, body)
			require.Equal(t, 422, r.status, "PUT %s %s: %s", tc.path, body, r.body)
			p := r.problem(t)
			assert.Equal(t, CodeValidationFailed, p.Code)
			assert.Len(t, p.fields(), 1, "PUT %s %s", tc.path, body)
			assert.NotContains(t, p.fields(), "bridge_id", "PUT %s %s: the member named is the one sent", tc.path, body)
			assert.Equal(t, "", bridgeOf("dev-a"), "PUT %s %s assigned", tc.path, body)
		}
	}
}
