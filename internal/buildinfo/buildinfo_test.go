package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestString(t *testing.T) {
	if got := Version("v1.2.3"); got != "v1.2.3" {
		t.Errorf("Version(%q) = %q; want %q", "v1.2.3", got, "v1.2.3")
	}
	for _, tc := range []struct {
		name     string
		settings []debug.BuildSetting
		want     string
	}{
		{"none", nil, "devel"},
		{"clean", []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "false"}}, "0123456789ab"},
		{"dirty", []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"}}, "0123456789ab-dirty"},
		{"short", []debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}}, "abc"},
	} {
		if got := fromSettings(tc.settings); got != tc.want {
			t.Errorf("fromSettings(%s) = %q; want %q", tc.name, got, tc.want)
		}
	}
}
