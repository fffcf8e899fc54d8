package topics

import (
	"encoding/json"
	"reflect"
	"strconv"
	"testing"
)

var testSchema = Schema{
	"brightness":     {Type: SettingInt, Min: intp(0), Max: intp(100), Default: 50},
	"do_not_disturb": {Type: SettingBool, Default: false},
	"timezone":       {Type: SettingTimezone, Default: "UTC"},
	"language":       {Type: SettingEnum, Values: []string{"en", "de"}, Default: "en"},
	"nickname":       {Type: SettingString, MaxLen: 4, Default: ""},
}

func TestSchemaValidate(t *testing.T) {
	tests := []struct {
		in   string
		want []string // fields named in errors
	}{
		{`{"brightness":0}`, nil},
		{`{"brightness":100,"do_not_disturb":true,"timezone":"Europe/Berlin","language":"de","nickname":"abcd"}`, nil},
		{`{"brightness":101}`, []string{"brightness"}},
		{`{"brightness":-1}`, []string{"brightness"}},
		{`{"brightness":1.5}`, []string{"brightness"}},
		{`{"brightness":"5"}`, []string{"brightness"}},
		{`{"do_not_disturb":1}`, []string{"do_not_disturb"}},
		{`{"timezone":"Mars/Olympus"}`, []string{"timezone"}},
		{`{"timezone":"Local"}`, []string{"timezone"}},
		{`{"timezone":"localtime"}`, []string{"timezone"}},
		{`{"timezone":"posixrules"}`, []string{"timezone"}},
		{`{"timezone":"Factory"}`, []string{"timezone"}},
		{`{"timezone":"right/UTC"}`, []string{"timezone"}},
		{`{"timezone":"posix/Europe/Berlin"}`, []string{"timezone"}},
		{`{"timezone":"US/Pacific"}`, nil},
		{`{"timezone":"./UTC"}`, []string{"timezone"}}, // bug 561: a path, not a name
		{`{"timezone":"Europe//Berlin"}`, []string{"timezone"}},
		{`{"timezone":"Europe/./Berlin"}`, []string{"timezone"}},
		{`{"language":"xx"}`, []string{"language"}},
		{`{"nickname":"abcde"}`, []string{"nickname"}},
		{`{"volume":5,"brightness":500}`, []string{"brightness", "volume"}},
	}
	for _, tt := range tests {
		var in map[string]any
		if err := json.Unmarshal([]byte(tt.in), &in); err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, e := range testSchema.Validate(in) {
			got = append(got, e.Field)
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("Validate(%s) named %v; want %v", tt.in, got, tt.want)
		}
	}
}

func TestVersions(t *testing.T) {
	for _, v := range []string{"1.0.0", "0.0.1", "10.20.30", "1.0.0-rc.1", "1.0.0+build.5"} {
		if !ValidVersion(v) {
			t.Errorf("ValidVersion(%q) = false; want true", v)
		}
	}
	for _, v := range []string{"", "v1.0.0", "1.0", "1", "1.0.0.0", "01.0.0", "a.b.c", "1.0.0-"} {
		if ValidVersion(v) {
			t.Errorf("ValidVersion(%q) = true; want false", v)
		}
	}
	tests := []struct {
		a, b string
		want int
	}{
		{"1.0.0", "1.0.0", 0},
		{"1.9.0", "1.10.0", -1},
		{"2.0.0", "1.99.99", 1},
		{"1.0.0-rc.1", "1.0.0", -1},
		{"1.0.0-alpha", "1.0.0-beta", -1},
		{"1.0.0-rc.2", "1.0.0-rc.10", -1},
		{"1.0.0+a", "1.0.0+b", 0},
	}
	for _, tt := range tests {
		if got := CompareVersions(tt.a, tt.b); got != tt.want {
			t.Errorf("CompareVersions(%q, %q) = %d; want %d", tt.a, tt.b, got, tt.want)
		}
	}
}

// A schema's time zone defaults are looked up in the zone database at
// most maxZoneLookups names a schema (bug 150): past them, one not yet
// looked up is taken out unchecked, and a name declared again is not
// looked up again.
func TestValidDefaultsBoundsTheZoneLookups(t *testing.T) {
	s := Schema{}
	for i := 1; i <= 12; i++ {
		for _, sign := range []string{"+", "-"} {
			zone := "Etc/GMT" + sign + strconv.Itoa(i)
			s[zone] = SettingSpec{Type: SettingTimezone, Default: zone}
			s["again "+zone] = SettingSpec{Type: SettingTimezone, Default: zone}
		}
	}
	out, bad := s.ValidDefaults()
	kept := map[string]bool{}
	for _, spec := range out {
		if spec.Default != nil {
			kept[spec.Default.(string)] = true
		}
	}
	if len(out) != len(s) || len(kept) != maxZoneLookups || len(bad) != 2*(24-maxZoneLookups) {
		t.Errorf("ValidDefaults kept the defaults of %d zones and took out %d of %d; want %d zones kept, twice each, and every setting",
			len(kept), len(bad), len(s), maxZoneLookups)
	}
}
