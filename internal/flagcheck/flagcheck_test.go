package flagcheck

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
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

// A listen the system refuses names the flag and what to do: for a port
// below 1024, the capability and the unit's settings; otherwise, a policy
// (bug 475). Other errors pass as they are.
func TestListenFailedNamesWhatToDo(t *testing.T) {
	for _, tc := range []struct {
		addr string
		err  error
		want []string
	}{
		{"127.0.0.1:443", syscall.EACCES, []string{"--http 127.0.0.1:443", "CAP_NET_BIND_SERVICE", "PrivateUsers=no", "1024 or above"}},
		{"127.0.0.1:8080", syscall.EACCES, []string{"--http 127.0.0.1:8080", "refuses this process the address", "another one"}},
		{"127.0.0.1:8080", syscall.EADDRINUSE, []string{"--http 127.0.0.1:8080", "another process listens there", "sport = :8080"}},
	} {
		err := ListenFailed("http", tc.addr, &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", tc.err)})
		require.ErrorIs(t, err, ErrCannotListen, "%s %v", tc.addr, tc.err)
		require.ErrorIs(t, err, tc.err)
		for _, w := range tc.want {
			require.Contains(t, err.Error(), w)
		}
	}
	other := errors.New("listen tcp: lookup nowhere: no such host")
	require.Equal(t, other, ListenFailed("http", "nowhere:80", other))
}
