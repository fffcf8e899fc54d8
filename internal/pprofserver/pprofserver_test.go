package pprofserver

import (
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/testenv"
)

func start(t *testing.T) *Server {
	t.Helper()
	s, err := Start("127.0.0.1:0", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// shortWrites sets writeTimeout to d for the test.
func shortWrites(t *testing.T, d time.Duration) {
	old := writeTimeout
	writeTimeout = d
	t.Cleanup(func() { writeTimeout = old })
}

// A client that asks for a profile and stops reading it does not hold the
// handler for ever: its answer is cut off once its write deadline passes
// (docs/reliability.md, bug 362).
func TestStalledClientIsCutOff(t *testing.T) {
	shortWrites(t, 200*time.Millisecond)
	s := start(t)
	// Parked goroutines make the dump of every stack a few megabytes,
	// more than the sockets' buffers take.
	park := make(chan struct{})
	defer close(park)
	for range 10000 {
		go func() { <-park }()
	}
	if !testenv.StalledClientIsCut(t, s.Addr(), "GET /debug/pprof/goroutine?debug=2 HTTP/1.1\r\nHost: x\r\n\r\n", 2*time.Second) {
		t.Fatal("the answer to a client that stopped reading was not cut: its handler waited for it to read")
	}
}

// A CPU profile may run for longer than writeTimeout: its seconds are
// added to its deadline, and pprof does not refuse it as longer than the
// server's WriteTimeout.
func TestProfileLongerThanTheWriteTimeout(t *testing.T) {
	shortWrites(t, 100*time.Millisecond)
	s := start(t)
	resp, err := http.Get("http://" + s.Addr() + "/debug/pprof/profile?seconds=1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || len(body) == 0 {
		t.Fatalf("profile?seconds=1 = %d, %d bytes: %s; want 200 and a profile", resp.StatusCode, len(body), body)
	}
}
