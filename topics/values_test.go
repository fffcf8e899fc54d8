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

// A number a settings command asks for is judged by its digits, not by the
// float64 nearest them: one with a fraction stays in its digits, which no
// int setting takes, and a whole one past 2^53 written with a fraction of
// zeros or an exponent is the int64 it is (bug 575).
func TestAskedSettingsJudgedByTheirDigits(t *testing.T) {
	hundred := 100
	schema := Schema{"level": {Type: SettingInt, Max: &hundred}, "counter": {Type: SettingInt}}
	for _, tt := range []struct {
		json  string
		want  any
		taken bool // by an int setting of max 100 ("counter" when the value is past it)
	}{
		{"100", float64(100), true},
		{"100.000", float64(100), true},
		{"1e2", float64(100), true},
		{"-0.0", math.Copysign(0, -1), true},
		{"100.00000000000000000000001", json.Number("100.00000000000000000000001"), false},
		{"99.99999999999999999999", json.Number("99.99999999999999999999"), false},
		{"1e-400", json.Number("1e-400"), false},
		{"1.5", json.Number("1.5"), false},
		{"9007199254740993.0", int64(1<<53 + 1), true},
		{"9.007199254740993e15", int64(1<<53 + 1), true},
		{"9007199254740993.5", json.Number("9007199254740993.5"), false},
		{"1e19", float64(1e19), false},
	} {
		var u SettingsUpdate
		if err := json.Unmarshal([]byte(`{"settings": {"v": `+tt.json+`}}`), &u); err != nil {
			t.Errorf("SettingsUpdate of %s: %v", tt.json, err)
			continue
		}
		got := u.Settings["v"]
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("SettingsUpdate of %s = %#v; want %#v", tt.json, got, tt.want)
		}
		name := "level"
		if i, ok := got.(int64); ok && i > 100 {
			name = "counter"
		}
		if errs := schema.Validate(map[string]any{name: got}); (len(errs) == 0) != tt.taken {
			t.Errorf("Validate(%s: %s) = %v; want taken %v", name, tt.json, errs, tt.taken)
		}
	}
}

// A whole number no int64 holds is out of an int setting's range, and its
// message says the range, an unbounded side ending where 64 bits do; it
// read "must be an integer", which 1e19 is.
func TestAWholeNumberPast64BitsIsOutOfRange(t *testing.T) {
	hundred := 100
	schema := Schema{"level": {Type: SettingInt, Max: &hundred}, "counter": {Type: SettingInt}}
	for _, tt := range []struct {
		name, json, want string
	}{
		{"level", "1e19", "must be between -9223372036854775808 and 100"},
		{"level", "-1e19", "must be between -9223372036854775808 and 100"},
		{"counter", "9223372036854775808", "must be between -9223372036854775808 and 9223372036854775807"},
		{"counter", "-9.3e18", "must be between -9223372036854775808 and 9223372036854775807"},
		{"counter", "1e19", "must be between -9223372036854775808 and 9223372036854775807"},
		{"counter", "1.5e19", "must be between -9223372036854775808 and 9223372036854775807"},
		{"counter", "1.00000000000000000001e19", "must be an integer"},
	} {
		var u SettingsUpdate
		if err := json.Unmarshal([]byte(`{"settings": {"`+tt.name+`": `+tt.json+`}}`), &u); err != nil {
			t.Errorf("SettingsUpdate of %s: %v", tt.json, err)
			continue
		}
		errs := schema.Validate(u.Settings)
		if len(errs) != 1 || errs[0].Message != tt.want {
			t.Errorf("Validate(%s: %s) = %v; want %q", tt.name, tt.json, errs, tt.want)
		}
	}
}
