package api

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestUserBridgesAreBounded: a user has at most MaxBridgesPerUser bridges
// of their own; past them a creation is a 422 naming bridge_id, and the
// broker's accounts hear nothing of it. Unbounded, one user's token made
// bridges at the request rate, each a record and, on Mosquitto, a client
// and a role of the dynamic-security plugin, which writes its whole
// configuration again on every change. The operator's bridges, and
// another user's, are not counted.
func TestUserBridgesAreBounded(t *testing.T) {
	acc := &recordingAccounts{}
	e := &bridgesEnv{env: newEnv(t, func(o *Options) {
		o.BrokerAccounts = acc
		o.Limits.MaxBridgesPerUser = 3
	}), acc: acc}
	e.alice, e.bob = e.bound("dev-a"), e.bound("dev-b")
	acc.took()
	path := "/api/v1/bridges"
	for i := range 3 {
		r := e.do("POST", path, e.alice, map[string]any{"bridge_id": fmt.Sprintf("alice-%d", i)})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	acc.took()
	r := e.do("POST", path, e.alice, map[string]any{"bridge_id": "alice-3"})
	require.Equal(t, 422, r.status, "a fourth bridge of one user: %s", r.body)
	p := r.problem(t)
	assert.Equal(t, CodeValidationFailed, p.Code)
	require.Len(t, p.Errors, 1)
	assert.Equal(t, "bridge_id", p.Errors[0].Field)
	assert.Contains(t, p.Errors[0].Message, "3 bridges")
	assert.Empty(t, acc.took(), "a refused bridge was told to the broker")

	r = e.do("POST", path, e.bob, map[string]any{"bridge_id": "bob-0"})
	assert.Equal(t, 201, r.status, "another user: %s", r.body)
	for i := range 4 {
		r := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": fmt.Sprintf("op-%d", i)})
		assert.Equal(t, 201, r.status, "the operator's: %s", r.body)
	}
	require.Equal(t, 204, e.do("DELETE", path+"/alice-0", e.alice, nil).status)
	r = e.do("POST", path, e.alice, map[string]any{"bridge_id": "alice-3"})
	assert.Equal(t, 201, r.status, "one deleted makes room: %s", r.body)
}
