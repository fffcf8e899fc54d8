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
// bug 512). A `failed` said without an error, or with one that has no
// code, is the same: a client that shows `error.message`, or tells a
// failure by `error.code`, had nothing to show (bug 555).
func TestBridgeEndedCommandCarriesItsError(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	fake := connectFakeBridge(t, m.MQTTURL(), f)
	replies, err := topics.MustNew(topics.DefaultPrefix).Replies("dev-1")
	require.NoError(t, err)

	for _, tc := range []struct {
		state, code string
		said        *topics.Error // the bridge's error, with no code
	}{
		{companion.StateExpired, "expired", nil},
		{companion.StateCanceled, "canceled", nil},
		{companion.StateFailed, "device_error", nil},
		{companion.StateFailed, "device_error", &topics.Error{}},
		{companion.StateFailed, "device_error", &topics.Error{Message: "the bridge's own words"}},
	} {
		id := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended by the bridge", "ttl_seconds": 60})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, topics.Reply{CommandID: id, State: companion.StateDelivered, At: time.Now()}, false)
		fake.publish(replies, topics.Reply{CommandID: id, State: tc.state, Error: tc.said, At: time.Now()}, false)

		cmd := f.user.waitFinal("dev-1", id)
		require.Equal(t, tc.state, cmd["state"], "%v", cmd)
		e, ok := cmd["error"].(map[string]any)
		require.True(t, ok, "a command its bridge ended %s has no error: %v", tc.state, cmd)
		assert.Equal(t, tc.code, e["code"], "a command its bridge ended %s with the error %+v: %v", tc.state, tc.said, cmd)
		assert.NotEmpty(t, e["message"], "%v", cmd)
		if tc.said != nil && tc.said.Message != "" {
			assert.Equal(t, tc.said.Message, e["message"], "the bridge's message is kept: %v", cmd)
		}

		// A bridge's own error is kept as it said it.
		if tc.said != nil {
			continue
		}
		code := tc.code
		if tc.state == companion.StateFailed {
			code = "timeout"
		}
		id = f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended with a word"})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, topics.Reply{CommandID: id, State: tc.state, At: time.Now(),
			Error: &topics.Error{Code: code, Message: "the bridge's own words"}}, false)
		cmd = f.user.waitFinal("dev-1", id)
		require.Equal(t, tc.state, cmd["state"], "%v", cmd)
		assert.Equal(t, map[string]any{"code": code, "message": "the bridge's own words"}, cmd["error"])
	}
}
