package postgres

import (
	"testing"
	"time"
)

// TestListenBackoff checks the pauses between attempts to LISTEN: within
// ±50% of 50 ms doubling up to 5 s, and 50 ms again after a Reset (the
// connection had worked for a while).
func TestListenBackoff(t *testing.T) {
	b := listenBackoff()
	for round := range 2 {
		interval := 50 * time.Millisecond
		for i := range 12 {
			got := b.NextBackOff()
			if got < interval/2 || got > interval*3/2 {
				t.Errorf("round %d, pause %d = %v; want within ±50%% of %v", round, i, got, interval)
			}
			interval = min(2*interval, 5*time.Second)
		}
		b.Reset()
	}
}
