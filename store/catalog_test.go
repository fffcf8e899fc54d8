package store

import (
	"testing"
)

func TestValidVersion(t *testing.T) {
	for v, want := range map[string]bool{
		"1.2.3": true, "0.0.1": true, "1.0.0-rc.1": true, "1.0.0+build.5": true, "10.20.30-alpha+001": true,
		"": false, "v1.2.3": false, "1": false, "1.2": false, "01.2.3": false, "1.2.3.4": false, "x": false,
	} {
		if got := ValidVersion(v); got != want {
			t.Errorf("ValidVersion(%q) = %v; want %v", v, got, want)
		}
	}
}

func TestCompareVersions(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"1.10.0", "1.9.0", 1},
		{"1.0.0-rc.1", "1.0.0", -1},
		{"1.0.0-alpha", "1.0.0-beta", -1},
		{"1.0.0-rc.2", "1.0.0-rc.10", -1},
		{"2.0.0", "2.0.0", 0},
		{"2.0.0+a", "2.0.0+b", 0},
	}
	for _, tt := range tests {
		if got := CompareVersions(tt.a, tt.b); got != tt.want {
			t.Errorf("CompareVersions(%q, %q) = %d; want %d", tt.a, tt.b, got, tt.want)
		}
	}
}
