package main

import (
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A command its bridge ends expired or canceled reads as one the server
// ends so: with the error that says why, as api/openapi.json has it ("why
// a command failed, expired or was canceled"). The bridge's reply of such
// a state has no error (agent/spool.go answers a command already past its
// TTL as it arrives, or held behind a long one, with the state alone), and
// the command read `"state": "expired"` with no `error`, where one the
// server expired had `{"code": "expired", …}` (docs/reliability.md,
// bug 512).
func TestBridgeEndedCommandCarriesItsError(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	fake := connectFakeBridge(t, m.MQTTURL(), f)
	replies, err := topics.MustNew(topics.DefaultPrefix).Replies("dev-1")
	require.NoError(t, err)

	for _, tc := range []struct{ state, code string }{
		{companion.StateExpired, "expired"},
		{companion.StateCanceled, "canceled"},
	} {
		id := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended by the bridge", "ttl_seconds": 60})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, topics.Reply{CommandID: id, State: companion.StateDelivered, At: time.Now()}, false)
		fake.publish(replies, topics.Reply{CommandID: id, State: tc.state, At: time.Now()}, false)

		cmd := f.user.waitFinal("dev-1", id)
		require.Equal(t, tc.state, cmd["state"], "%v", cmd)
		e, ok := cmd["error"].(map[string]any)
		require.True(t, ok, "a command its bridge ended %s has no error: %v", tc.state, cmd)
		assert.Equal(t, tc.code, e["code"], "%v", cmd)
		assert.NotEmpty(t, e["message"], "%v", cmd)

		// A bridge's own error is kept as it said it.
		id = f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended with a word"})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, topics.Reply{CommandID: id, State: tc.state, At: time.Now(),
			Error: &topics.Error{Code: tc.code, Message: "the bridge's own words"}}, false)
		cmd = f.user.waitFinal("dev-1", id)
		require.Equal(t, tc.state, cmd["state"], "%v", cmd)
		assert.Equal(t, map[string]any{"code": tc.code, "message": "the bridge's own words"}, cmd["error"])
	}
}
