package dynsec_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/internal/mqtttest"
)

// A bridge's or a user's client the server made, given another role by
// hand (one to read $SYS, say), was taken for a client the server had not
// made: a new secret or token (the remedy for one that leaked) left the
// old one working on Mosquitto, with the API's answer saying it opened
// nothing, and deleting the bridge left its client, which logged in with
// the old secret and held the other role's rights (bug 499).
func TestAClientGivenAnotherRoleStillFollowsItsSecret(t *testing.T) {
	ctx := context.Background()
	mq := mqtttest.StartMosquitto(t, server)
	st := newBindings()
	d, granted := newDriver(t, mq, server, st)
	require.True(t, granted)
	st.createBridge("b1", "secret-1")
	st.assign("dev-1", "b1")
	st.createBridge("b2", "secret-b2")
	st.setUser("u1", "token-1")
	require.NoError(t, d.BridgeCreated(ctx, "b1", "secret-1"))
	require.NoError(t, d.BridgeCreated(ctx, "b2", "secret-b2"))
	require.NoError(t, d.UserCreated(ctx, "u1", "token-1"))
	for _, r := range mq.Dynsec(t,
		map[string]any{"command": "createRole", "rolename": "sys-watch", "acls": []map[string]any{
			{"acltype": "subscribePattern", "topic": "$SYS/#", "allow": true},
			{"acltype": "publishClientReceive", "topic": "$SYS/#", "allow": true},
		}},
		map[string]any{"command": "addClientRole", "username": "b1", "rolename": "sys-watch"},
		map[string]any{"command": "addClientRole", "username": "b2", "rolename": "sys-watch"},
		map[string]any{"command": "addClientRole", "username": "u1", "rolename": "sys-watch"},
	) {
		require.Empty(t, r.Error, r.Command)
	}

	st.createBridge("b1", "secret-2")
	assert.NoError(t, d.BridgeSecretChanged(ctx, "b1", "secret-2"), "a new secret for b1")
	assert.Error(t, canConnect(mq, dynsec.BridgeClientID("b1"), "b1", "secret-1"), "b1's old secret, replaced, still opens Mosquitto")
	assert.NoError(t, canConnect(mq, dynsec.BridgeClientID("b1"), "b1", "secret-2"), "b1's new secret")

	st.setUser("u1", "token-2")
	assert.NoError(t, d.UserTokenChanged(ctx, "u1", "token-2"), "a new token for u1")
	assert.Error(t, canConnect(mq, "app-u1", "u1", "token-1"), "u1's old token, replaced, still opens Mosquitto")
	assert.NoError(t, canConnect(mq, "app-u1", "u1", "token-2"), "u1's new token")

	st.deleteBridge("b2")
	require.NoError(t, d.BridgeDeleted(ctx, "b2"))
	assert.Error(t, canConnect(mq, dynsec.BridgeClientID("b2"), "b2", "secret-b2"), "the deleted bridge's secret still opens Mosquitto")
	r := mq.Dynsec(t, map[string]any{"command": "getRole", "rolename": "sys-watch"})
	assert.Empty(t, r[0].Error, "the operator's role was deleted with the bridge")
}
