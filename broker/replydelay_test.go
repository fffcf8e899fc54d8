package broker

import (
	"testing"
	"time"
)

// TestReplyRetryDelay checks the pause before each attempt at a reply the
// store failed to take: within ±50% of 100 ms doubling up to 10 s, so
// that maxReplyAttempts spans about ten minutes on average.
func TestReplyRetryDelay(t *testing.T) {
	var total time.Duration
	seen := map[time.Duration]bool{}
	for attempt := 1; attempt < maxReplyAttempts; attempt++ {
		interval := min(100*time.Millisecond<<min(attempt-1, 7), 10*time.Second)
		total += interval
		got := replyRetryDelay(attempt)
		if got < interval/2 || got > interval*3/2 {
			t.Errorf("replyRetryDelay(%d) = %v; want within ±50%% of %v", attempt, got, interval)
		}
		if attempt >= 8 {
			seen[got] = true
		}
	}
	if total < 9*time.Minute || total > 11*time.Minute {
		t.Errorf("%d attempts span %v on average; want about ten minutes", maxReplyAttempts, total)
	}
	if len(seen) < 2 {
		t.Errorf("pauses at the cap took %d distinct values; want jitter", len(seen))
	}
}
