package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
)

// progress tells how an upload goes: on a terminal as a bar redrawn in
// place with \r (bytes sent of the total, percentage, rate), elsewhere
// (a log, a pipe) as a plain line each time the upload passes a quarter,
// with the percentage sent ("uploaded 30% …").
// The HTTP transport reads the body on a goroutine of its own, so add may
// run beside finish.
type progress struct {
	w     io.Writer
	total int64
	bar   bool
	width int              // of the terminal, for the bar
	now   func() time.Time // the clock, for the rate

	mu       sync.Mutex
	start    time.Time
	sent     int64
	drawn    time.Time // when the bar was last drawn
	quarters int64     // plain: how many quarters were told
	done     bool
}

// barInterval is how often the bar is redrawn at most.
const barInterval = 100 * time.Millisecond

// newProgress reports an upload of total bytes on w: a bar when w is a
// terminal.
func newProgress(w io.Writer, total int64) *progress {
	p := &progress{w: w, total: total, width: 80, now: time.Now}
	if f, ok := w.(*os.File); ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd())) {
		p.bar = true
		if n, err := strconv.Atoi(os.Getenv("COLUMNS")); err == nil && n > 0 {
			p.width = n
		}
	}
	p.start = p.now()
	return p
}

// add counts n more bytes sent.
func (p *progress) add(n int) {
	if n <= 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.sent += int64(n)
	if p.bar {
		if now := p.now(); now.Sub(p.drawn) >= barInterval {
			p.drawn = now
			p.draw(now)
		}
		return
	}
	if p.total > 0 {
		// A line each time the upload passes a quarter, with the share
		// actually sent: one read may pass a quarter by far (the
		// transport reads 32 KiB at a time, 80% of a 40 KiB upload).
		sent := min(p.sent, p.total)
		if q := sent * 4 / p.total; q > p.quarters {
			p.quarters = q
			fmt.Fprintf(p.w, "uploaded %d%% (%s of %s)\n", sent*100/p.total, humanBytes(sent), humanBytes(p.total))
		}
	}
}

// finish ends the report: the bar's last state and its line's end, or
// for an empty upload the plain line the bytes never gave.
func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	switch {
	case p.bar:
		p.draw(p.now())
		fmt.Fprintln(p.w)
	case p.total == 0:
		fmt.Fprintf(p.w, "uploaded 100%% (%s of %s)\n", humanBytes(0), humanBytes(0))
	}
}

// draw redraws the bar over the line; p.mu held.
func (p *progress) draw(now time.Time) {
	line := renderBar(p.sent, p.total, now.Sub(p.start), p.width)
	// Spaces cover what a longer line before left; the last column stays
	// free so that the terminal does not wrap.
	fmt.Fprintf(p.w, "\r%-*s", max(p.width-1, 0), line)
}

// renderBar is the bar's line for sent of total bytes after elapsed, at
// most width-1 columns wide:
//
//	45% [=========>           ] 1.2 MiB / 2.6 MiB  3.4 MiB/s
//
// The bar itself is left out when the rest leaves it less than 10 columns.
func renderBar(sent, total int64, elapsed time.Duration, width int) string {
	frac := 1.0
	if total > 0 {
		frac = float64(min(sent, total)) / float64(total)
	}
	rate := "--"
	if elapsed > 0 {
		rate = humanBytes(int64(float64(sent)/elapsed.Seconds())) + "/s"
	}
	head := fmt.Sprintf("%3d%%", int(frac*100))
	tail := fmt.Sprintf("%s / %s  %s", humanBytes(sent), humanBytes(total), rate)
	n := width - 1 - len(head) - len(tail) - 4 // the spaces and brackets
	if n < 10 {
		line := head + " " + tail
		if len(line) > width-1 {
			line = line[:max(width-1, 0)]
		}
		return line
	}
	fill := int(frac * float64(n))
	bar := strings.Repeat("=", fill)
	if fill < n {
		bar += ">" + strings.Repeat(" ", n-fill-1)
	}
	return head + " [" + bar + "] " + tail
}

// humanBytes is n in B, KiB, MiB or GiB, with one decimal past bytes.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	f, suffix := float64(n)/unit, "KiB"
	for _, s := range []string{"MiB", "GiB", "TiB"} {
		if f < unit {
			break
		}
		f, suffix = f/unit, s
	}
	return fmt.Sprintf("%.1f %s", f, suffix)
}

// countingReader tells p of every byte read through it: the body of an
// upload, as the HTTP transport reads it.
type countingReader struct {
	r io.Reader
	p *progress
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.p.add(n)
	return n, err
}
