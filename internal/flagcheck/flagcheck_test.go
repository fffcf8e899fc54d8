package flagcheck

import (
	"strings"
	"testing"
)

func TestListenAddr(t *testing.T) {
	for _, ok := range []string{"", "127.0.0.1:0", ":8080", "[::1]:http", "localhost:9464"} {
		if err := ListenAddr("http", ok); err != nil {
			t.Errorf("ListenAddr(%q) = %v; want nil", ok, err)
		}
	}
	for _, bad := range []string{"8080", "127.0.0.1", "127.0.0.1:notaport", "127.0.0.1:99999"} {
		err := ListenAddr("metrics", bad)
		if err == nil || !strings.HasPrefix(err.Error(), "--metrics ") {
			t.Errorf("ListenAddr(%q) = %v; want an error naming --metrics", bad, err)
		}
	}
}

func TestDistinct(t *testing.T) {
	for _, tc := range []struct {
		a, b  string
		clash bool
	}{
		{"127.0.0.1:9464", "127.0.0.1:9464", true},
		{"127.0.0.1:9464", ":9464", true},
		{"0.0.0.0:9464", "[::1]:9464", true},
		{"[::]:9464", "10.0.0.1:9464", true},
		{"localhost:9464", "127.0.0.1:9464", true},
		{"LOCALHOST:http", "localhost:80", true},
		{"127.0.0.1:0", "127.0.0.1:0", false},
		{"127.0.0.1:9464", "127.0.0.1:9465", false},
		{"127.0.0.1:9464", "127.0.0.2:9464", false},
		{"127.0.0.1:9464", "[::1]:9464", false},
		{"", ":9464", false},
	} {
		err := Distinct(Listen{"http", tc.a}, Listen{"metrics", tc.b})
		if got := err != nil; got != tc.clash {
			t.Errorf("Distinct(%q, %q) = %v; want a clash: %v", tc.a, tc.b, err, tc.clash)
		}
		if err != nil && !strings.Contains(err.Error(), "--http ") || err != nil && !strings.Contains(err.Error(), "--metrics ") {
			t.Errorf("Distinct(%q, %q) = %v; want an error naming both flags", tc.a, tc.b, err)
		}
	}
}
