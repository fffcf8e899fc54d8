package postgres

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// ListenCommands calls fn with the id of every command whose state a
// transaction changed, on any replica of the database, once that
// transaction committed; fn("") means notifications may have been missed
// (the connection was lost and is back), so that the caller re-reads what
// it waits for. fn runs on ListenCommands' goroutine, one call at a time:
// it must be quick.
//
// It LISTENs on a connection of its own, outside the pool, and
// reconnects (backing off up to 5 seconds) when it is lost. It returns
// when ctx is done (ctx.Err()) or the store is closed (nil).
func (s *Store) ListenCommands(ctx context.Context, fn func(id string)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	const minBackoff, maxBackoff = 50 * time.Millisecond, 5 * time.Second
	backoff := minBackoff
	for first := true; ; first = false {
		err := s.listen(ctx, fn, !first)
		select {
		case <-s.done:
			return nil
		default:
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errListening) {
			backoff = minBackoff // it worked for a while
		}
		s.log.Warn("postgres: listening for command changes", "err", err, "retry_in", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// errListening marks an error that came once LISTEN was in place: the
// next attempt starts again with a short wait.
var errListening = errors.New("lost while listening")

// listen connects, LISTENs, calls fn("") when it reconnected, then fn of
// each notification until the connection fails or ctx is done.
func (s *Store) listen(ctx context.Context, fn func(id string), reconnected bool) error {
	conn, err := pgx.ConnectConfig(ctx, s.cfg.ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+notifyChannel); err != nil {
		return err
	}
	if reconnected {
		fn("")
	}
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return errors.Join(errListening, err)
		}
		if n.Channel == notifyChannel {
			fn(n.Payload)
		}
	}
}
