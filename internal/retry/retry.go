// Package retry holds the one backoff schedule the service's retry loops
// share: the GATT reconnect, the bridge's blob downloads and subscriptions,
// the server's reply intake and its PostgreSQL LISTEN.
//
// It is github.com/cenkalti/backoff, not a schedule of our own: the
// OpenTelemetry Go SDK and much else depend on it, it is small, and it has
// no dependencies. Callers use its ExponentialBackOff's pauses, not its
// Retry: their loops decide themselves when to stop and what to log.
package retry

import (
	"time"

	"github.com/cenkalti/backoff/v5"
)

// Backoff returns pauses that start at initial and double up to limit,
// each randomised by ±50% so that clients that failed together (bridges
// after a BlueZ or broker restart, replicas after PostgreSQL's) do not try
// again in lockstep. Reset starts it over.
func Backoff(initial, limit time.Duration) *backoff.ExponentialBackOff {
	return &backoff.ExponentialBackOff{
		InitialInterval:     initial,
		RandomizationFactor: 0.5,
		Multiplier:          2,
		MaxInterval:         limit,
	}
}
