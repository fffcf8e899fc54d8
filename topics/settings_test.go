package topics

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A settings report is held to the rules of a setting (docs/reliability.md,
// bug 567): a value no setting holds and a name no setting has are left
// out, an enum's values are each kept once, and a value outside its own
// schema is kept, as the device is at it, and named.
func TestASettingsReportIsHeldToItsRules(t *testing.T) {
	const report = `{"seq": 1, "reported": {
		"brightness": 70, "volume": 150, "do_not_disturb": "yes", "timezone": "Mars/Olympus",
		"nickname": "kitchen table", "mode": "turbo", "level": null, "obj": {"a": 1}, "arr": [1], "huge": 1e999,
		"": 1, " ": 2, "tab\t": 3, "nul\u0000": 4, "\u200b": 5, "\u0085": 6, "undeclared": 7},
	"schema": {
		"brightness": {"type": "int", "min": 0, "max": 100, "default": 50},
		"volume": {"type": "int", "min": 0, "max": 100, "default": 50},
		"do_not_disturb": {"type": "bool", "default": false},
		"timezone": {"type": "timezone", "default": "UTC"},
		"nickname": {"type": "string", "max_len": 8, "default": ""},
		"mode": {"type": "enum", "values": ["eco", "sport", "eco", "", " ", "sport", "x\u0000", "\u00a0"], "default": "eco"},
		"flat": {"type": "enum", "values": ["", "\t"]},
		"level": {"type": "int", "min": 0, "max": 10, "default": 0},
		"": {"type": "int"}, " ": {"type": "int"}, "tab\t": {"type": "int"}, "other\u0000": {"type": "bool"}}}`
	s, err := ParseSettings([]byte(report))
	require.NoError(t, err)
	assert.Equal(t, map[string]any{
		"brightness": 70.0, "volume": 150.0, "do_not_disturb": "yes", "timezone": "Mars/Olympus",
		"nickname": "kitchen table", "mode": "turbo", "undeclared": 7.0,
	}, s.Reported, "ParseSettings: Reported")
	names := make([]string, 0, len(s.Schema))
	for name := range s.Schema {
		names = append(names, name)
	}
	assert.ElementsMatch(t, []string{"brightness", "volume", "do_not_disturb", "timezone", "nickname", "mode", "flat", "level"}, names, "ParseSettings: the schema's names")
	assert.Equal(t, []string{"eco", "sport"}, s.Schema["mode"].Values, "ParseSettings: mode's values")
	assert.Empty(t, s.Schema["flat"].Values, "ParseSettings: flat's values")
	assert.Equal(t, "eco", s.Schema["mode"].Default, "ParseSettings: mode's default")
	assert.Equal(t, SettingsFlaws{
		NotNames:   []string{"", " ", "nul\x00", "other\x00", "tab\t", "\u0085", "\u200b"},
		NoValues:   []string{"arr", "huge", "level", "obj"},
		EnumValues: []string{"flat", "mode"},
		Unfit:      []string{"do_not_disturb", "mode", "nickname", "timezone", "volume"},
	}, s.Flaws, "ParseSettings: Flaws")

	// An enum left with no value is one Usable takes out, as one declared
	// with none.
	usable, bad := s.Schema.Usable()
	assert.Equal(t, []string{"flat"}, bad, "Usable of the schema ParseSettings kept")
	assert.NotContains(t, usable, "flat")

	// The settings of a command's final reply are held to the same rules.
	r, err := ParseReply([]byte(`{"command_id": "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "state": "succeeded", "settings": ` + report + `}`))
	require.NoError(t, err)
	require.NotNil(t, r.Settings)
	assert.Equal(t, s, *r.Settings, "ParseReply: the settings of a final reply, as ParseSettings reads them")

	// A report that keeps the rules is read as written, and names nothing.
	clean := `{"seq": 1, "reported": {"brightness": 100, "language": "en", "counter": 9007199254740993},
		"schema": {"brightness": {"type": "int", "min": 0, "max": 100}, "language": {"type": "enum", "values": ["en", "de"]},
		"counter": {"type": "int"}, "Zeit zone": {"type": "timezone", "default": "Europe/Berlin"}}}`
	s, err = ParseSettings([]byte(clean))
	require.NoError(t, err)
	assert.False(t, s.Flaws.Any(), "ParseSettings of a report that keeps the rules: Flaws = %+v", s.Flaws)
	assert.Equal(t, map[string]any{"brightness": 100.0, "language": "en", "counter": int64(9007199254740993)}, s.Reported)
	assert.Len(t, s.Schema, 4)
	assert.Equal(t, []string{"en", "de"}, s.Schema["language"].Values)
}

func TestValidSettingName(t *testing.T) {
	for _, c := range []struct {
		name string
		want bool
	}{
		{"brightness", true}, {"app/volume", true}, {"display timeout", true}, {" x ", true},
		{"Größe", true}, {"音量", true}, {"a\u200db", true},
		{"", false}, {" ", false}, {"\u00a0", false}, {"\u3000", false}, {"\u200b", false}, {"\ufeff", false},
		{"tab\t", false}, {"line\n", false}, {"y\x00", false}, {"\x1b[2J", false}, {"del\x7f", false}, {"c1\u0085", false},
	} {
		if got := ValidSettingName(c.name); got != c.want {
			t.Errorf("ValidSettingName(%q) = %v; want %v", c.name, got, c.want)
		}
	}
}
