package agent

import (
	"io"
	"log/slog"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
)

// spoolObserver records what the agent says of its spool.
type spoolObserver struct {
	mu   sync.Mutex
	said []bool
}

func (o *spoolObserver) CommandDone(string, string, bool, time.Duration) {}
func (o *spoolObserver) MQTTConnected(bool)                              {}
func (o *spoolObserver) ReplyUnheard()                                   {}
func (o *spoolObserver) DevicesRefused(int)                              {}
func (o *spoolObserver) SpoolWritable(ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.said = append(o.said, ok)
}

// The observer hears that the spool cannot be written at its first failed
// write, and that it can at the first that succeeds after, once each
// however many fail or succeed: companion_bridge_spool_unwritable, which
// CompanionBridgeSpoolUnwritable alerts on. Before, the bridge's metrics
// said nothing of it, and a bridge that took no command in for want of
// disk raised no alert while other bridges' commands ended
// (docs/reliability.md, bug 422).
func TestSpoolWritableIsObserved(t *testing.T) {
	obs := &spoolObserver{}
	a := &Agent{opts: Options{Observer: obs}, log: slog.New(slog.NewTextHandler(io.Discard, nil)), spoolPath: "spool.db"}
	a.spoolWritten() // no failure yet: nothing to say
	for range 3 {
		a.spoolFailed("taking commands in", syscall.EIO)
	}
	a.spoolWritten()
	a.spoolWritten()
	a.spoolFailed("recording a reply", syscall.EIO)
	if want := []bool{false, true, false}; !slices.Equal(obs.said, want) {
		t.Errorf("SpoolWritable calls = %v; want %v", obs.said, want)
	}
}
