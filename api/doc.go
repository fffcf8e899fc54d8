// Package api is the companion server's HTTP API (CONTRACT §2): the gin
// handlers of the twelve device operations, the command resource behind
// every 202, the admin API, blob downloads for bridges, authentication and
// the RFC 9457 problem+json errors every failure is answered with.
//
// It validates every request completely before anything reaches the store
// or the command broker, and it owns no state of its own beyond the rate
// limiter's buckets: what it needs of the store and of the broker it
// declares as the small interfaces Store and Commander. It does not talk
// MQTT and does not track commands; the broker does.
package api
