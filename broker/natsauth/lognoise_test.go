package natsauth_test

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/testenv"
)

// On the NATS cluster as on the embedded broker (bug 380), a client that
// logged in with a wrong password in a loop had the responder log a line
// for each refusal, at the rate of its loop. The first refusal of a source
// and reason is logged, the next ones once a minute with their count
// (bug 382).
func TestRefusedLoginsAreLoggedOnceAMinutePerSource(t *testing.T) {
	var logs testenv.Buffer
	d := startDoor(t, func(o *natsauth.Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	d.st.set(func(f *fakeStore) { f.users["alice"] = "token-a" })
	const n = 20
	for i := 0; i < n; i++ {
		_, err := dialOnce(t, d.cl.MQTTURLs[0], "alice-phone", "alice", "wrong")
		require.Error(t, err, "a wrong password")
	}
	got := 0
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, `msg="mqtt connect refused"`) && strings.Contains(l, "username=alice") {
			got++
		}
	}
	assert.Equal(t, 1, got, "lines for %d refused logins; log:\n%s", n, logs.String())
}
