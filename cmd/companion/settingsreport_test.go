package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A settings report is held to the rules of a setting (docs/reliability.md,
// bug 567). A bridge, buggy or hostile, reports a device's settings with a
// value of null, an object or an array, settings named "", " ", with a tab
// or a NUL, an enum naming a value twice or naming "", and values outside
// their own schema. GET …/settings must read what a user can use: every
// value of a type a setting holds, no name that is not a name, each enum
// value once; a value outside its schema as the device reported it, for it
// is at it; and the rest of the report kept. A PUT must then take a change
// of a setting whose value was null, refuse one of a name that is not a
// name, and its change must end once the device reports it.
func TestASettingsReportIsHeldToItsRules(t *testing.T) {
	logs := &logCapture{}
	m := startServerWithLog(t, Config{}, logs)
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	fake := connectFakeBridge(t, m.MQTTURL(), f)
	tree, must := topics.MustNew(topics.DefaultPrefix), topicsOf(t)
	settingsTopic, replies := must(tree.Settings("dev-1")), must(tree.Replies("dev-1"))
	const dp = "/api/v1/devices/dev-1/settings"

	// The report, its schema sim-1's and more, written as JSON: a
	// topics.Settings would not carry a null or a name twice.
	report := func(values map[string]string) json.RawMessage {
		reported := map[string]string{
			"brightness": "70", "volume": "150", "do_not_disturb": `"yes"`, "timezone": `"Mars/Olympus"`,
			"language": `"en"`, "display_timeout_s": "30", "mode": `"eco"`, "level": "null",
			"obj": `{"a": 1}`, "arr": "[1, 2]", "": "1", " ": "2", "tab\t": "3", "nul\u0000": "4", "\u200b": "5",
		}
		maps.Copy(reported, values)
		schema, err := json.Marshal(topics.SimSchema())
		require.NoError(t, err)
		var b []byte
		b = fmt.Appendf(b, `{"seq": %d, "at": %q, "reported": {`, time.Now().UnixNano(), time.Now().Format(time.RFC3339Nano))
		for i, k := range slices.Sorted(maps.Keys(reported)) {
			if i > 0 {
				b = append(b, ',')
			}
			key, err := json.Marshal(k)
			require.NoError(t, err)
			b = fmt.Appendf(b, "%s: %s", key, reported[k])
		}
		b = append(b, `}, "schema": `...)
		b = append(b, schema[:len(schema)-1]...)
		b = append(b, `, "mode": {"type": "enum", "values": ["eco", "sport", "eco", "", " ", "sport", "x\u0000"], "default": "eco"},
			"level": {"type": "int", "min": 0, "max": 10, "default": 0},
			"": {"type": "int", "default": 0}, " ": {"type": "int"}, "tab\t": {"type": "int"}, "nul\u0000": {"type": "int"}, "\u200b": {"type": "int"}}}`...)
		require.True(t, json.Valid(b), "%s", b)
		return b
	}
	fake.publish(settingsTopic, report(nil), true)

	var set map[string]any
	testenv.Eventually(t, 10*time.Second, "dev-1's settings stored", func() bool {
		set = f.user.do("GET", dp, nil).JSON(t)
		return fmt.Sprint(set["reported"].(map[string]any)["brightness"]) == "70"
	})
	reported := set["reported"].(map[string]any)
	for _, name := range []string{"level", "obj", "arr", "", " ", "tab\t", "nul\u0000", "\u200b"} {
		v, ok := reported[name]
		assert.False(t, ok, "GET …/settings: reported[%q] = %v; a value of no setting's type, or a name that is no name, left out", name, v)
	}
	assert.Equal(t, map[string]any{
		"brightness": 70.0, "volume": 150.0, "do_not_disturb": "yes", "timezone": "Mars/Olympus",
		"language": "en", "display_timeout_s": 30.0, "mode": "eco",
	}, reported, "GET …/settings: reported, the values outside their schema (volume, do_not_disturb, timezone) as the device reported them")
	schema := set["schema"].(map[string]any)
	assert.ElementsMatch(t, []string{"brightness", "volume", "do_not_disturb", "timezone", "language", "display_timeout_s", "mode", "level"},
		slices.Collect(maps.Keys(schema)), "GET …/settings: the names of the schema")
	if mode, ok := schema["mode"].(map[string]any); assert.True(t, ok, "GET …/settings: the schema of mode: %v", schema["mode"]) {
		assert.Equal(t, []any{"eco", "sport"}, mode["values"], "GET …/settings: the values of the enum mode")
	}
	for _, msg := range []string{
		"a device reported settings under names no setting has (empty, blank, or with a control character); leaving them out",
		"a device reported settings at values no setting holds (null, an object, an array, a number JSON cannot write); leaving the values out",
		"a device declared enum settings naming a value more than once, or one that is empty, blank or with a control character; keeping each value once",
		"a device reported settings at values outside their own schema; serving them as reported",
	} {
		assert.True(t, logs.has(slog.LevelWarn, msg, "device_id", "dev-1"), "logged: %q", msg)
	}

	// A name that is not a name is no setting to change.
	for _, name := range []string{" ", "tab\t", "\u200b"} {
		r := f.user.do("PUT", dp, map[string]any{name: 1})
		assert.Equal(t, 422, r.Status, "PUT …/settings {%q: 1}: %s", name, r.Body)
	}

	// A change of the setting whose value was null, of one outside its
	// schema and of the enum ends once the device reports it, in the
	// command's final reply with the same flaws again.
	cmd := f.user.accept("PUT", dp, map[string]any{"level": 3, "volume": 80, "mode": "sport"})
	id := cmd["id"].(string)
	waitState(t, f.user, "dev-1", id, "sent")
	var after topics.Settings
	require.NoError(t, json.Unmarshal(report(map[string]string{"level": "3", "volume": "80", "mode": `"sport"`}), &after))
	fake.publish(replies, topics.Reply{CommandID: id, State: companion.StateSucceeded, At: time.Now(), Settings: &after}, false)
	f.user.waitFinal("dev-1", id)
	set = f.user.do("GET", dp, nil).JSON(t)
	assert.Equal(t, []any{}, set["pending"], "GET …/settings after the change succeeded: %v", set)
	reported = set["reported"].(map[string]any)
	for name, want := range map[string]any{"level": 3.0, "volume": 80.0, "mode": "sport"} {
		assert.Equal(t, want, reported[name], "GET …/settings after the change succeeded: reported[%q]", name)
	}
	for _, name := range []string{"obj", "arr", "", " ", "tab\t", "nul\u0000"} {
		v, ok := reported[name]
		assert.False(t, ok, "GET …/settings after the change succeeded: reported[%q] = %v", name, v)
	}
}
