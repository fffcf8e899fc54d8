//go:build linux

package main

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestShutdownOnADiskThatDoesNotAnswer: with every fdatasync of the
// process held (a network volume gone) and a command waiting for its
// commit, the server's shutdown gives up after shutdownWithin, says what
// it waits for, and ends with exit status 1, rather than waiting for the
// disk for good (bug 343). The faults are a seccomp filter's
// (testenv.FailSyscalls), in a child process, which it outlives.
func TestShutdownOnADiskThatDoesNotAnswer(t *testing.T) {
	if !testenv.InChild(t) {
		return
	}
	faults := testenv.FailSyscalls(t, unix.SYS_FDATASYNC)
	shutdownWithin = 500 * time.Millisecond // this child's alone
	var log testenv.Buffer
	m := startServerLogging(t, Config{}, slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})))
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	release := faults.Hold(unix.SYS_FDATASYNC)
	defer release()
	req, err := http.NewRequest("POST", m.APIURL()+"/api/v1/devices/dev-1/push/text", bytes.NewReader([]byte(`{"text":"held"}`)))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+f.user.token)
	go func() {
		if resp, err := httpClientFor(m).Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	testenv.Eventually(t, 10*time.Second, "the command to wait for its commit", func() bool {
		return m.bolt.WriteWaiting() > 0
	})

	done := make(chan error, 1)
	go func() { done <- m.shutdown() }()
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		release()
		t.Fatal("the shutdown has not returned in 1m with the disk not answering")
	}
	var ee exitError
	require.True(t, errors.As(err, &ee), "shutdown() = %v; want an exitError", err)
	require.Equal(t, 1, ee.code)
	require.Contains(t, err.Error(), "a write of the data directory")
	require.True(t, strings.Contains(log.String(), `level=ERROR msg="shutdown has not finished; exiting without it"`), "the log:\n%s", log.String())
	release() // the commit ends, and the rest of the shutdown, for the test's cleanup
}
