//go:build linux

package main

import (
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestAReadTheDiskFailsIsA500: a request whose read of the bbolt file
// meets a fault of its mapping (SIGBUS: a page the disk cannot read, or,
// here, the file cut short under the server) is answered 500 and logged,
// and the server goes on, rather than the process ending with "fatal
// error: fault" (bug 344). In a child process, which the fault may end.
func TestAReadTheDiskFailsIsA500(t *testing.T) {
	if !testenv.InChild(t) {
		return
	}
	var log testenv.Buffer
	m := startServerLogging(t, Config{SweepInterval: time.Hour}, slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})))
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	// The two meta pages stay; every page of the tree is past the end.
	require.NoError(t, os.Truncate(m.bolt.Path(), 2*int64(os.Getpagesize())))
	r = f.user.do("GET", "/api/v1/devices/dev-1", nil)
	require.Equal(t, 500, r.Status, "%s", r.Body)
	require.True(t, strings.Contains(log.String(), `msg="handler panicked"`), "the log:\n%s", log.String())
	require.Equal(t, 200, f.user.do("GET", "/healthz", nil).Status)
}
