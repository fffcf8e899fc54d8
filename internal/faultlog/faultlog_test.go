package faultlog

import (
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/testenv"
)

type kind int

const full kind = 1

func newTestLog(every time.Duration) (*Log[kind], *testenv.Buffer) {
	var buf testenv.Buffer
	l := New(Options[kind]{
		Logger: slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Faults: map[kind]Fault{full: {Name: "full", Words: "disk: full; free space"}},
		Attrs:  []any{"path", "/data"},
		Still:  "disk: still full",
		Gone:   "disk: takes writes again",
		Every:  every,
	})
	return l, &buf
}

var errFull = errors.New("no space left on device")

// A fault is said once as it starts, however many writes meet it, and
// once as it is gone; one that comes back and goes again within Every, as
// on a disk so nearly full that a small probe fits and a command does not,
// is not said again each time.
func TestAFaultIsSaidOnce(t *testing.T) {
	l, buf := newTestLog(time.Hour)
	for range 100 {
		l.Failed(full, errFull)
	}
	if !l.Stands(full) {
		t.Fatal("Stands(full) = false after failures")
	}
	l.Gone(full)
	if l.Stands(full) {
		t.Fatal("Stands(full) = true once gone")
	}
	for range 50 {
		l.Failed(full, errFull)
		if !l.Stands(full) {
			t.Fatal("Stands(full) = false after it came back")
		}
		l.Gone(full)
	}
	out := buf.String()
	t.Logf("the log:\n%s", out)
	if n := strings.Count(out, `level=ERROR msg="disk: full; free space" path=/data err="no space left on device"`); n != 1 {
		t.Errorf("the fault's start said %d times; want 1", n)
	}
	if n := strings.Count(out, `level=INFO msg="disk: takes writes again" path=/data fault=full`); n != 1 {
		t.Errorf("its end said %d times; want 1", n)
	}
	if n := strings.Count(out, "\n"); n != 2 {
		t.Errorf("%d lines; want 2", n)
	}
}

// A fault that stands is said again once Every has passed, with the
// failures since; so is one that came back quietly within Every of its
// end and still stands Every after it, whose end is then said too.
func TestAStandingFaultIsSaidAgain(t *testing.T) {
	const every = 50 * time.Millisecond
	l, buf := newTestLog(every)
	l.Failed(full, errFull)
	l.Failed(full, errFull)
	l.Failed(full, errFull)
	testenv.Eventually(t, time.Minute, "the fault said again", func() bool {
		l.standing()
		return strings.Contains(buf.String(), `level=ERROR msg="disk: still full" path=/data fault=full`)
	})
	if !strings.Contains(buf.String(), "failures=2 ") {
		t.Errorf("the line again does not count the 2 failures after the first:\n%s", buf.String())
	}
	l.Gone(full)
	l.Failed(full, errFull) // back at once: not said
	if n := strings.Count(buf.String(), `msg="disk: full; free space"`); n != 1 {
		t.Fatalf("a fault back within Every said again:\n%s", buf.String())
	}
	testenv.Eventually(t, time.Minute, "the fault back said standing", func() bool {
		l.standing()
		return strings.Count(buf.String(), `msg="disk: still full"`) == 2
	})
	l.Gone(full)
	if n := strings.Count(buf.String(), `msg="disk: takes writes again"`); n != 2 {
		t.Errorf("the end of a fault said standing said %d times; want 2:\n%s", n, buf.String())
	}
}

// Watch probes a standing fault until the probe finds it gone, and then
// sleeps until another starts; it returns once done is closed.
func TestWatchEndsAFaultItFindsGone(t *testing.T) {
	l, buf := newTestLog(time.Hour)
	l.opts.ProbeEvery = time.Millisecond
	probes := make(chan kind, 100)
	fixed := make(chan struct{})
	done, returned := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(returned)
		l.Watch(done, func(f kind) error {
			probes <- f
			select {
			case <-fixed:
				return nil
			default:
				return errFull
			}
		})
	}()
	l.Failed(full, errFull)
	if f := <-probes; f != full {
		t.Fatalf("probe(%v); want %v", f, full)
	}
	close(fixed)
	testenv.Eventually(t, time.Minute, "the fault found gone", func() bool { return !l.Stands(full) })
	close(done)
	<-returned
	if !strings.Contains(buf.String(), `msg="disk: takes writes again"`) {
		t.Errorf("the end not said:\n%s", buf.String())
	}
}
