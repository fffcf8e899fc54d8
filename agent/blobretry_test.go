package agent

import (
	"testing"

	"github.com/devicecompanion/companion/internal/retry"
)

// The pauses between download attempts double from blobRetryMin up to
// blobRetryMax, each within ±50% of its step.
func TestBlobRetryPauses(t *testing.T) {
	bo := retry.Backoff(blobRetryMin, blobRetryMax)
	step := blobRetryMin
	for i := range 8 {
		got := bo.NextBackOff()
		if lo, hi := step/2, step*3/2+1; got < lo || got > hi {
			t.Errorf("pause %d = %v; want %v..%v", i+1, got, lo, hi)
		}
		step = min(2*step, blobRetryMax)
	}
}
