package fastjson_test

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// The values the store and the bridge's spool keep, with the strings and
// raw values where encoders differ: HTML characters, U+2028, invalid UTF-8,
// raw JSON with spaces, nil against empty, times with zones and nanoseconds.
func values() []any {
	at := time.Date(2026, 11, 23, 18, 4, 5, 123456789, time.FixedZone("x", 3600))
	n, battery := 42, 87
	tricky := "<b>&amp;</b> \u2028\u2029 \xff\xfe \"quoted\"\n\ttab é 😀"
	return []any{
		companion.Command{ID: "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", DeviceID: "dev-1", UserID: "u", Op: topics.OpPushText,
			State: companion.StateInProgress, Progress: &n, Error: &companion.CommandError{Code: "x", Message: tricky},
			Result: json.RawMessage(` { "a" : [1, 2.50, "<>"] } `), Payload: json.RawMessage(`{"text":"` + "<&>" + `"}`),
			Blob: "ab", CreatedAt: at, UpdatedAt: at.UTC(), ExpiresAt: time.Time{}},
		companion.Command{},
		companion.Status{DeviceID: "d", Battery: &battery, Apps: []companion.App{{AppID: "a", Version: "1.0.0"}}, LastSeen: at},
		companion.Status{Apps: []companion.App{}},
		companion.User{ID: "u", Name: tricky, TokenHash: []byte{0, 1, 2, 255}, CreatedAt: at},
		companion.Binding{DeviceID: "d", UserID: "u", Name: tricky, BoundAt: at},
		companion.Idempotency{UserID: "u", Key: "k", RequestHash: []byte("h"), Status: 202, Body: []byte(`{"x":1}`), CreatedAt: at},
		companion.Settings{DeviceID: "d", Reported: map[string]json.RawMessage{"z": json.RawMessage(`1`), "a": json.RawMessage(`"<"`)},
			Schema: json.RawMessage(`{"type": "object"}`), At: at},
		companion.Event{Kind: companion.EventCommand, DeviceID: "d", At: at,
			Command: &companion.CommandEvent{ID: "c", Op: "o", State: "queued", Progress: &n}},
		topics.Command{ID: "c", Op: topics.OpPushText, DeviceID: "d", CreatedAt: at, Payload: json.RawMessage(`{"text":"hi"}`)},
		topics.Reply{CommandID: "c", State: "failed", Error: &topics.Error{Code: "x", Message: tricky}, Result: json.RawMessage(`[ ]`), At: at},
		map[string]any{"b": 1.5e300, "a": []any{nil, true, 0.1, int64(1) << 60, tricky}},
	}
}

func TestMarshalIsEncodingJSON(t *testing.T) {
	for _, v := range values() {
		want, err := json.Marshal(v)
		require.NoError(t, err)
		got, err := fastjson.Marshal(v)
		require.NoError(t, err)
		assert.Equal(t, string(want), string(got), "%T", v)
	}
}

func TestUnmarshalIsEncodingJSON(t *testing.T) {
	for _, v := range values() {
		raw, err := json.Marshal(v)
		require.NoError(t, err)
		want := reflect.New(reflect.TypeOf(v))
		got := reflect.New(reflect.TypeOf(v))
		require.NoError(t, json.Unmarshal(raw, want.Interface()))
		require.NoError(t, fastjson.Unmarshal(raw, got.Interface()), "%T", v)
		assert.Equal(t, want.Interface(), got.Interface(), "%T", v)
	}
}
