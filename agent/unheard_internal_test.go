package agent

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/topics"
)

type countUnheard struct {
	nopObserver
	n int
}

func (o *countUnheard) ReplyUnheard() { o.n++ }

// A finished command repeated quickly (a reconnect's resend racing the
// outbox, a broker's duplicates) says nothing; one repeated over a minute
// and more, three times, does, once; and one command is counted once
// however often it comes again (bug 484).
func TestRepeatsOfAFinishedCommandOverAMinuteAreUnheard(t *testing.T) {
	var log bytes.Buffer
	obs := &countUnheard{}
	a := &Agent{
		born: time.Now(), unheardSpan: unheardSpan, tree: topics.MustNew(topics.DefaultPrefix),
		stateTopic: "companion/v1/bridges/b1/state", log: slog.New(slog.NewTextHandler(&log, nil)),
		opts: Options{Observer: obs, Username: "b1"},
	}
	for range 5 {
		a.noteRepeated("dev-1", "c1")
	}
	if obs.n != 0 || log.Len() != 0 {
		t.Fatalf("five quick repeats: %d counted, log %q; want none", obs.n, log.String())
	}
	a.born = a.born.Add(-unheardSpan) // a minute on
	a.noteRepeated("dev-1", "c1")
	a.noteRepeated("dev-1", "c1")
	if obs.n != 1 {
		t.Errorf("counted %d; want 1", obs.n)
	}
	if n := strings.Count(log.String(), "its replies do not reach the server"); n != 1 {
		t.Errorf("lines: %d; want 1\n%s", n, log.String())
	}
	for range 2 {
		a.noteRepeated("dev-1", "c2")
	}
	a.born = a.born.Add(-unheardSpan)
	a.noteRepeated("dev-1", "c2")
	if obs.n != 2 {
		t.Errorf("counted %d after a second command; want 2", obs.n)
	}
	if n := strings.Count(log.String(), "its replies do not reach the server"); n != 1 {
		t.Errorf("lines within the hour: %d; want 1", n)
	}
}
