package agent

import (
	"time"

	"github.com/cenkalti/backoff/v5"
)

// newBackoff returns pauses that start at initial and double up to limit,
// each randomised by ±50% so that bridges that failed together (refused by
// a broker node's election, say) do not try again in lockstep. It is
// gatt's newBackoff: github.com/cenkalti/backoff's pauses, the loops our
// own, deciding themselves when to stop and what to log.
func newBackoff(initial, limit time.Duration) *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{
		InitialInterval:     initial,
		RandomizationFactor: 0.5,
		Multiplier:          2,
		MaxInterval:         limit,
	}
}
