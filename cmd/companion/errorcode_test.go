package main

import (
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A command's error.code is a word of the contract's form, snake_case
// (docs/asyncapi.yaml: ^[a-z0-9_]+$), which a client tells a failure by.
// A bridge, buggy or hostile, that ends a command with a code of another
// form (spaces, capitals, a control character, 10 KB of it) had it stored
// as given and served to the user as the command's error.code. Such a code
// is set aside: the command reads the code its state has when the bridge
// gives none, and the bridge's code is quoted, bounded, in the message
// alone, and logged (docs/reliability.md, bug 569).
func TestABridgesMalformedErrorCodeNeverReachesTheUser(t *testing.T) {
	t.Parallel() // it mostly waits
	logs := &logCapture{}
	m := startServerWithLog(t, Config{}, logs)
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	fake := connectFakeBridge(t, m.MQTTURL(), f)
	replies, err := topics.MustNew(topics.DefaultPrefix).Replies("dev-1")
	require.NoError(t, err)

	long := strings.Repeat("a", 10<<10)
	for _, tc := range []struct {
		state, said, message string
		code                 string // the command's error.code
		quoted               string // what of the bridge's code its message quotes; "" none
	}{
		{companion.StateFailed, "Bad Code!", "the disk is on fire", "device_error", `"Bad Code!"`},
		{companion.StateFailed, "Bad Code!", "", "device_error", `"Bad Code!"`},
		{companion.StateFailed, "device error", "", "device_error", `"device error"`},
		{companion.StateFailed, "TIMEOUT", "", "device_error", `"TIMEOUT"`},
		{companion.StateFailed, "time\nout\u0007", "", "device_error", `"time\nout\a"`},
		{companion.StateFailed, "tímeout", "", "device_error", `"tímeout"`},
		{companion.StateFailed, long, "", "device_error", `"` + strings.Repeat("a", 64) + `…"`},
		{companion.StateFailed, "timeout-2", "", "device_error", `"timeout-2"`},
		{companion.StateExpired, "Expired!", "", "expired", `"Expired!"`},
		{companion.StateCanceled, "user canceled", "gone", "canceled", `"user canceled"`},
		// Codes of the contract's form are kept as the bridge gave them.
		{companion.StateFailed, "device_busy", "busy", "device_busy", ""},
		{companion.StateFailed, "e2big_0", "", "e2big_0", ""},
		{companion.StateFailed, strings.Repeat("z", 64), "", strings.Repeat("z", 64), ""},
	} {
		id := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended with a code", "ttl_seconds": 60})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, topics.Reply{CommandID: id, State: companion.StateDelivered, At: time.Now()}, false)
		fake.publish(replies, topics.Reply{CommandID: id, State: tc.state, At: time.Now(),
			Error: &topics.Error{Code: tc.said, Message: tc.message}}, false)

		f.user.waitFinal("dev-1", id)
		r := f.user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil)
		require.Equal(t, 200, r.Status, "%s", r.Body)
		cmd := r.JSON(t)
		require.Equal(t, tc.state, cmd["state"], "%v", cmd)
		e, ok := cmd["error"].(map[string]any)
		require.True(t, ok, "a command its bridge ended %s has no error: %v", tc.state, cmd)
		shown := tc.said
		if len(shown) > 80 {
			shown = shown[:80] + "…"
		}
		assert.Equal(t, tc.code, e["code"], "a command its bridge ended %s with the error code %q", tc.state, shown)
		msg, _ := e["message"].(string)
		if tc.quoted == "" {
			assert.Equal(t, tc.message, msg)
			continue
		}
		assert.Contains(t, msg, tc.quoted, "the bridge's code %q in the message", shown)
		assert.LessOrEqual(t, len(msg), 256, "the message of a command whose bridge gave the code %q", shown)
		if tc.message != "" {
			assert.Contains(t, msg, tc.message, "the bridge's message is kept")
		}
		assert.True(t, logs.has(slog.LevelWarn, "a bridge's error code is not of the contract's form (^[a-z0-9_]+$, at most 64 bytes); the command reads the code its state has without one", "device_id", "dev-1"),
			"the bridge's code %q is logged", shown)
	}
}

// A bridge that ends a command with an error of another JSON type than the
// contract's, a code that is a number, an error that is a string, had its
// reply dropped as malformed: the command never ended, and its user waited
// on it to its TTL. The reply is taken, the error as far as it says
// something (docs/reliability.md, bug 571).
func TestACommandEndedWithAnErrorOfAnotherJSONTypeEnds(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	fake := connectFakeBridge(t, m.MQTTURL(), f)
	replies, err := topics.MustNew(topics.DefaultPrefix).Replies("dev-1")
	require.NoError(t, err)

	for _, tc := range []struct {
		error         string
		code, message string // of the command; message contained
	}{
		{`{"code":5,"message":"rc 5"}`, "device_error", `rc 5 (the bridge gave the error code "5", which is not a code)`},
		{`{"code":"device_busy","message":{"rc":3}}`, "device_busy", `{"rc":3}`},
		{`"the disk is on fire"`, "device_error", "the disk is on fire"},
		{`[1,2]`, "device_error", "[1,2]"},
	} {
		id := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "ended with an error", "ttl_seconds": 60})["id"].(string)
		waitState(t, f.user, "dev-1", id, "sent")
		fake.publish(replies, json.RawMessage(`{"command_id":"`+id+`","state":"failed","error":`+tc.error+`,"at":"`+
			time.Now().UTC().Format(time.RFC3339Nano)+`"}`), false)

		f.user.waitFinal("dev-1", id)
		cmd := f.user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil).JSON(t)
		require.Equal(t, companion.StateFailed, cmd["state"], "the error %s: %v", tc.error, cmd)
		e, _ := cmd["error"].(map[string]any)
		assert.Equal(t, tc.code, e["code"], "the error %s", tc.error)
		assert.Contains(t, e["message"], tc.message, "the error %s", tc.error)
	}
}
