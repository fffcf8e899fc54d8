package gatt

import (
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/retry"
)

// TestNewBackoff checks the pauses between connection attempts and between
// busy answers: each within ±50% of an interval that doubles from the
// first and stops at the cap, and the first again after a Reset.
func TestNewBackoff(t *testing.T) {
	for _, tc := range []struct {
		name         string
		initial, max time.Duration
		steps        int
	}{
		{"reconnect", DefaultMinBackoff, DefaultMaxBackoff, 12},
		{"busy", 2 * DefaultMinBackoff, DefaultMinBackoff << busyRetries, busyRetries},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := retry.Backoff(tc.initial, tc.max)
			for round := range 2 {
				interval := tc.initial
				for i := range tc.steps {
					got := b.NextBackOff()
					if got < interval/2 || got > interval*3/2 {
						t.Errorf("round %d, pause %d = %v; want within ±50%% of %v", round, i, got, interval)
					}
					interval = min(2*interval, tc.max)
				}
				b.Reset()
			}
		})
	}
}

// TestNewBackoffJitters checks that two bridges do not wait alike.
func TestNewBackoffJitters(t *testing.T) {
	seen := map[time.Duration]bool{}
	for range 20 {
		seen[retry.Backoff(DefaultMinBackoff, DefaultMaxBackoff).NextBackOff()] = true
	}
	if len(seen) < 2 {
		t.Errorf("20 first pauses took %d distinct values; want jitter", len(seen))
	}
}
