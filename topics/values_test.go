package topics

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
)

// An int setting's value past 2^53 comes through a settings message, a
// settings command's payload and the schema's default exactly, as an
// int64; every other number as encoding/json decodes it (bug 151).
func TestSettingsValuesAreExact(t *testing.T) {
	for _, tt := range []struct {
		json string
		want any
	}{
		{"7", float64(7)},
		{"-0", math.Copysign(0, -1)},
		{"7.0", float64(7)},
		{"1.5", 1.5},
		{"9007199254740992", float64(1 << 53)},
		{"-9007199254740992", float64(-1 << 53)},
		{"9007199254740994", int64(1<<53 + 2)},
		{"9007199254740993", int64(1<<53 + 1)},
		{"-9007199254740993", int64(-1<<53 - 1)},
		{"9223372036854775807", int64(math.MaxInt64)},
		{"-9223372036854775808", int64(math.MinInt64)},
		{"9223372036854775808", float64(1 << 63)},
		{"9.007199254740993e15", float64(1 << 53)},
		{`[9007199254740993, {"a": 9007199254740995}]`, []any{int64(1<<53 + 1), map[string]any{"a": int64(1<<53 + 3)}}},
		{`"9007199254740993"`, "9007199254740993"},
	} {
		got, err := DecodeValue([]byte(tt.json))
		if err != nil || !reflect.DeepEqual(got, tt.want) || (tt.json == "-0" && !math.Signbit(got.(float64))) {
			t.Errorf("DecodeValue(%s) = %#v, %v; want %#v", tt.json, got, err, tt.want)
		}
	}

	const big = 1<<53 + 1 // 9007199254740993: a float64 holds 9007199254740992
	s, err := ParseSettings([]byte(`{"reported": {"counter": 9007199254740993, "volume": 7}, "schema": {"counter": {"type": "int", "default": 9007199254740993}}}`))
	if err != nil || s.Reported["counter"] != int64(big) || s.Reported["volume"] != float64(7) || s.Schema["counter"].Default != int64(big) {
		t.Errorf("ParseSettings = %+v, %v; want counter and its default %d exactly", s, err, big)
	}
	if b, _ := json.Marshal(s.Reported); string(b) != `{"counter":9007199254740993,"volume":7}` {
		t.Errorf("encoded again: %s", b)
	}
	var u SettingsUpdate
	if err := json.Unmarshal([]byte(`{"settings": {"counter": 9007199254740993}}`), &u); err != nil || u.Settings["counter"] != int64(big) {
		t.Errorf("SettingsUpdate = %+v, %v; want counter %d exactly", u, err, big)
	}

	// Compared exactly with its bounds: as float64s, 2^53 + 1 reads 2^53.
	limit := 1 << 53
	schema := Schema{"counter": {Type: SettingInt, Max: &limit}}
	if errs := schema.Validate(map[string]any{"counter": int64(big)}); len(errs) != 1 {
		t.Errorf("Validate(%d) with max %d = %v; want it out of range", big, limit, errs)
	}
	if errs := schema.Validate(map[string]any{"counter": float64(1 << 63)}); len(errs) != 1 {
		t.Errorf("Validate(2^63) = %v; want it refused: no int setting holds it", errs)
	}
}
