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
