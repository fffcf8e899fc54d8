package postgres

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"

	"github.com/devicecompanion/companion/internal/retry"
)

// ListenCommands calls fn with the id of every command whose state a
// transaction changed, on any replica of the database, once that
// transaction committed; fn("") means notifications may have been missed,
// so that the caller re-reads what it waits for. It comes once each LISTEN
// is in place: after a reconnection, and after the first one too, since
// what the caller registered before it was announced to nobody
// (docs/reliability.md, bug 252). fn runs on ListenCommands' goroutine,
// one call at a time: it must be quick.
//
// It LISTENs on a connection of its own, outside the pool, and
// reconnects (backing off up to 5 seconds, ±50%) when it is lost. It returns
// when ctx is done (ctx.Err()) or the store is closed (nil).
func (s *Store) ListenCommands(ctx context.Context, fn func(id string)) error {
	return s.listenLoop(ctx, notifyChannel, fn)
}

// listenLoop LISTENs on channel and calls fn with the payload of each
// notification, and fn("") once each LISTEN is in place, until ctx is done
// or the store is closed (see ListenCommands).
func (s *Store) listenLoop(ctx context.Context, channel string, fn func(payload string)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	// Jittered, so that replicas that lost PostgreSQL together (a restart)
	// do not reconnect in lockstep.
	bo := listenBackoff()
	for {
		err := s.listen(ctx, channel, fn)
		select {
		case <-s.done:
			return nil
		default:
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errListening) {
			bo.Reset() // it worked for a while
		}
		wait := bo.NextBackOff()
		s.logRetry("postgres: listening for notifications", err, "channel", channel, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
}

// listenBackoff returns the pauses between attempts to LISTEN: 50 ms
// doubling up to 5 s, each ±50%.
func listenBackoff() *backoff.ExponentialBackOff {
	return retry.Backoff(50*time.Millisecond, 5*time.Second)
}

// errListening marks an error that came once LISTEN was in place: the
// next attempt starts again with a short wait.
var errListening = errors.New("lost while listening")

// listen connects, LISTENs, calls fn(""), then fn of each notification
// until the connection fails or ctx is done. fn("") comes after the first
// LISTEN too: until it is in place, notifications reach nobody, and the
// caller may have registered what it waits for before, a Wait whose
// command another replica ends meanwhile (bug 252).
func (s *Store) listen(ctx context.Context, channel string, fn func(payload string)) error {
	conn, err := pgx.ConnectConfig(ctx, s.cfg.ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if hook := testHookListen.Load(); hook != nil {
		(*hook)(ctx)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return err
	}
	fn("")
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return errors.Join(errListening, err)
		}
		if n.Channel == channel {
			fn(n.Payload)
		}
	}
}

// testHookListen, when set (by tests only), is called by listen on its new
// connection before it LISTENs. Atomic: a listener of an earlier test may
// still be winding down when a test sets it.
var testHookListen atomic.Pointer[func(ctx context.Context)]
