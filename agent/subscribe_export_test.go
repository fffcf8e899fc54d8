package agent

import (
	"testing"
	"time"
)

// SetSubscribeTiming shortens how long a SUBACK is awaited and the pauses
// between the rounds that ask again for what the broker refused. Call it
// before Run.
func (a *Agent) SetSubscribeTiming(timeout, retryMin, retryMax time.Duration) {
	a.subTiming = subscribeTiming{timeout: timeout, retryMin: retryMin, retryMax: retryMax}
}

// SetStartHold shortens how long the workers wait at start for a
// connection to the broker before they run what the spool holds. Call it
// before Run.
func (a *Agent) SetStartHold(d time.Duration) {
	a.startHold = d
}

// SetHookLost has f called as the bridge's connection-lost handler starts,
// until the test ends. Call it before the connection is lost.
func SetHookLost(t testing.TB, f func()) {
	testHookLost.Store(&f)
	t.Cleanup(func() { testHookLost.Store(nil) })
}

// SetUnheardSpan shortens how long after the first repeat of a finished
// command its third must come for the bridge to say its replies do not
// reach the server. Call it before Run.
func (a *Agent) SetUnheardSpan(d time.Duration) {
	a.unheardSpan = d
}
