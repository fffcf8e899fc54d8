package idleread

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// Every read that returns bytes puts the timer off; reading to the end
// before it fires leaves it unfired.
func TestReaderPutsTheTimerOff(t *testing.T) {
	fired := make(chan struct{})
	timer := time.AfterFunc(time.Hour, func() { close(fired) })
	defer timer.Stop()
	r := &Reader{R: iotest.OneByteReader(strings.NewReader("quiet")), Timer: timer, Idle: time.Hour}
	b, err := io.ReadAll(r)
	if err != nil || string(b) != "quiet" {
		t.Fatalf("ReadAll = %q, %v", b, err)
	}
	if !timer.Stop() {
		t.Error("the timer fired or was stopped; want it still armed")
	}
	select {
	case <-fired:
		t.Error("the timer fired")
	default:
	}
}
