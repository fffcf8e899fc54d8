package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestProgressRenderBar(t *testing.T) {
	const mib = 1 << 20
	tests := []struct {
		sent, total int64
		elapsed     time.Duration
		width       int
		want        string
	}{
		{0, 2 * mib, 0, 60, "  0% [>                                 ] 0 B / 2.0 MiB  --"},
		{mib, 2 * mib, 2 * time.Second, 60, " 50% [==========>          ] 1.0 MiB / 2.0 MiB  512.0 KiB/s"},
		{2 * mib, 2 * mib, time.Second, 60, "100% [=======================] 2.0 MiB / 2.0 MiB  2.0 MiB/s"},
		{mib, 2 * mib, 2 * time.Second, 30, " 50% 1.0 MiB / 2.0 MiB  512.0"}, // too narrow for a bar
		{0, 0, time.Second, 40, "100% [===============] 0 B / 0 B  0 B/s"},
		{3 << 30, 4 << 30, 3 * time.Second, 70, " 75% [========================>        ] 3.0 GiB / 4.0 GiB  1.0 GiB/s"},
	}
	for _, tt := range tests {
		got := renderBar(tt.sent, tt.total, tt.elapsed, tt.width)
		if got != tt.want {
			t.Errorf("renderBar(%d, %d, %v, %d) =\n%q; want\n%q", tt.sent, tt.total, tt.elapsed, tt.width, got, tt.want)
		}
		if len(got) > tt.width-1 {
			t.Errorf("renderBar(%d, %d, %v, %d) is %d columns wide; want at most %d", tt.sent, tt.total, tt.elapsed, tt.width, len(got), tt.width-1)
		}
	}
	for width := 1; width < 120; width++ {
		if got := renderBar(12345, 67890, time.Second, width); len(got) > max(width-1, 0) {
			t.Errorf("renderBar at width %d = %q: %d columns", width, got, len(got))
		}
	}
}

// fakeClock is a clock that moves only when told.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// Not on a terminal: a plain line each time a quarter is passed, in
// order, with the percentage actually sent, the last at 100%.
func TestProgressPlainLines(t *testing.T) {
	var out bytes.Buffer
	p := newProgress(&out, 1000)
	require.False(t, p.bar, "a buffer is no terminal")
	for range 10 {
		p.add(100)
	}
	p.finish()
	p.add(100) // the transport reading after the end is not told
	assert.Equal(t, "uploaded 30% (300 B of 1000 B)\nuploaded 50% (500 B of 1000 B)\n"+
		"uploaded 80% (800 B of 1000 B)\nuploaded 100% (1000 B of 1000 B)\n", out.String())

	// 40 KiB read as the HTTP transport reads a body, 32 KiB at a time:
	// the first read is 80%, not "75%".
	out.Reset()
	p = newProgress(&out, 40<<10)
	p.add(32 << 10)
	p.add(8 << 10)
	p.finish()
	assert.Equal(t, "uploaded 80% (32.0 KiB of 40.0 KiB)\nuploaded 100% (40.0 KiB of 40.0 KiB)\n", out.String())

	out.Reset()
	p = newProgress(&out, 0)
	p.finish()
	assert.Equal(t, "uploaded 100% (0 B of 0 B)\n", out.String())
}

// On a terminal: the bar redrawn in place at most every barInterval, its
// last state at the end and the line ended.
func TestProgressBarRedraws(t *testing.T) {
	var out bytes.Buffer
	clock := &fakeClock{t: time.Unix(1000, 0)}
	p := newProgress(&out, 1000)
	p.bar, p.width, p.now, p.start = true, 50, clock.now, clock.t
	for range 10 {
		clock.t = clock.t.Add(60 * time.Millisecond)
		p.add(100)
	}
	p.finish()
	draws := strings.Split(out.String(), "\r")[1:]
	require.Len(t, draws, 6, "%q", out.String()) // at 60, 180, 300, 420, 540 ms, and the end
	for _, d := range draws[:5] {
		assert.Len(t, d, 49, "each draw covers the line: %q", d)
	}
	want := fmt.Sprintf("%-49s\n", renderBar(1000, 1000, 600*time.Millisecond, 50))
	assert.Equal(t, want, draws[5])
	assert.True(t, strings.HasPrefix(draws[0], " 10% ["), "%q", draws[0])
}

// companion firmware publish and app publish, not on a terminal: plain
// progress lines on stderr, in order, ending at 100%; the answer on stdout.
func TestPublishProgress(t *testing.T) {
	m := startServer(t, Config{})
	api := "http://" + m.HTTPAddr()
	dir := t.TempDir()
	app := filepath.Join(dir, "app.bin")
	require.NoError(t, os.WriteFile(app, bytes.Repeat([]byte("app!"), 1<<18), 0o600)) // 1 MiB
	fw := filepath.Join(dir, "fw.bin")
	require.NoError(t, os.WriteFile(fw, firmwareImage(t, "1.2.0", 1<<20), 0o600))

	for _, args := range [][]string{
		{"app", "publish", "--app-id", "weather", "--version", "1.0.0", app},
		{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0", fw},
	} {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), append(args, "--api-url", api, "--admin-token", m.AdminToken()), &stdout, &stderr)
		require.NoError(t, err, "%v: %s", args, stderr.String())
		var answer map[string]any
		require.NoError(t, json.Unmarshal(stdout.Bytes(), &answer), "stdout holds the answer only: %s", stdout.String())
		assert.EqualValues(t, 1<<20, answer["size"])

		lines := strings.Split(strings.TrimSuffix(stderr.String(), "\n"), "\n")
		require.NotEmpty(t, lines)
		last := -1
		for _, l := range lines {
			var pct int
			_, err := fmt.Sscanf(l, "uploaded %d%%", &pct)
			require.NoError(t, err, "line %q", l)
			assert.Greater(t, pct, last, "%v: %q", args, lines)
			last = pct
		}
		assert.Equal(t, "uploaded 100% (1.0 MiB of 1.0 MiB)", lines[len(lines)-1])
		t.Logf("%s: %q", args[0], lines)
	}
}
