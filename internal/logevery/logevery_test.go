package logevery

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestOnceAnIntervalWithTheCountLeftOut(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1000, 0)
	l := New(slog.New(slog.NewTextHandler(&buf, nil)), time.Minute, func() time.Time { return now })
	for i := 0; i < 5; i++ {
		l.Warn("dev-1", "bad status", "device_id", "dev-1")
	}
	l.Warn("dev-2", "bad status", "device_id", "dev-2")
	now = now.Add(time.Minute)
	l.Warn("dev-1", "bad status", "device_id", "dev-1")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("got %d lines; want 3:\n%s", len(lines), buf.String())
	}
	if !strings.Contains(lines[2], "device_id=dev-1 not_logged=4 not_logged_in=1m0s") {
		t.Errorf("the line after the interval = %q; want the 4 left out", lines[2])
	}
}

func TestKeysAreBounded(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1000, 0)
	l := New(slog.New(slog.NewTextHandler(&buf, nil)), time.Minute, func() time.Time { return now })
	for i := 0; i < 3*maxKeys; i++ {
		l.Warn(strings.Repeat("k", 1+i%7)+string(rune('a'+i%26))+time.Duration(i).String(), "dropped")
	}
	if n := len(l.keys); n > maxKeys+1 {
		t.Errorf("%d keys kept; want at most %d", n, maxKeys+1)
	}
	if n := strings.Count(buf.String(), "\n"); n > maxKeys+1 {
		t.Errorf("%d lines; want at most %d", n, maxKeys+1)
	}
}

// Logged says whether the line was logged, for a caller that logs the
// ones left out at a lower level (docs/reliability.md, bug 493).
func TestLoggedSaysWhetherItLogged(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(1000, 0)
	l := New(slog.New(slog.NewTextHandler(&buf, nil)), time.Minute, func() time.Time { return now })
	if !l.Logged(slog.LevelInfo, "k", "refused") {
		t.Error("the first line of a key: Logged = false; want true")
	}
	if l.Logged(slog.LevelInfo, "k", "refused") {
		t.Error("a second line of a key within the interval: Logged = true; want false")
	}
	if l.Logged(slog.LevelDebug, "other", "refused") {
		t.Error("a line at a level the logger does not log: Logged = true; want false")
	}
}
