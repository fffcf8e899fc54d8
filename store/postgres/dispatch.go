package postgres

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// dispatchLock is the session-level advisory lock (two-key form, apart
// from the migrations' and the idempotency keys') that the dispatcher
// holds: one replica at a time publishes the queued commands, resends and
// sweeps expiry (CONTRACT §11).
const dispatchLock = `SELECT pg_try_advisory_lock(1668246896, 2)`

// Dispatching reports whether this Store holds the dispatcher's lock (see
// Campaign). It is the broker's Dispatcher.
func (s *Store) Dispatching() bool { return s.dispatching.Load() }

// Campaign competes for the dispatcher's lock until ctx is done or the
// store is closed: on a connection of its own it takes the advisory lock
// when no other replica holds it and keeps it while the connection lives
// (PostgreSQL frees it when the session ends, also when the replica dies:
// then another replica takes it within about a second; when the holder's
// link goes silent, within about 12 s: see sessionKeepalive). onChange is
// called with true when this store starts dispatching and with false when
// it stops.
func (s *Store) Campaign(ctx context.Context, onChange func(dispatching bool)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	set := func(v bool) {
		if s.dispatching.Swap(v) != v && onChange != nil {
			onChange(v)
		}
	}
	defer set(false)
	for {
		err := s.holdDispatch(ctx, set)
		set(false)
		if ctx.Err() != nil {
			select {
			case <-s.done:
				return nil
			default:
				return ctx.Err()
			}
		}
		s.logRetry("postgres: dispatcher campaign", err)
		t := time.NewTimer(time.Second)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
}

// campaignInterval is how often a replica without the lock tries again,
// and how often the holder checks that its session is alive.
const campaignInterval = 500 * time.Millisecond

// checkTimeout bounds each step of the campaign connection: the connect,
// each try for the lock, each ping of the holder, the close. A ping
// answers in milliseconds; without a bound of its own, on a black-holed
// link (packets dropped, no reset) it would wait for the kernel's TCP
// timeout, minutes, while this replica still says it dispatches and
// PostgreSQL may already have ended the session and let another replica
// take the lock. Four intervals (2 s) is long enough that a busy server's
// slow answer does not cost the lock, and short enough that the holder
// stops at most campaignInterval+checkTimeout (2.5 s) after its last
// answered ping.
const checkTimeout = 4 * campaignInterval

// sessionKeepalive is what the campaign session asks of PostgreSQL's side
// of its TCP connection (run-time parameters of the startup message, so
// they hold from the session's first byte). The holder stops dispatching
// at most 2.5 s after its link goes silent (checkTimeout), but PostgreSQL
// keeps the session, and with it the lock, until its own TCP gives the
// client up: with the kernel's defaults (tcp_keepalives_idle 0, that is
// two hours of idleness before a first probe) no other replica could take
// over for hours after a black-holed link or a host gone without a FIN or
// RST. With these the server ends a silent session about 10–11 s after it
// last heard from it:
//   - idle 5 s: the campaign speaks every 0.5 s, so a live session is never
//     idle that long and no probe is ever sent on a healthy link;
//   - interval 2 s, count 3: three unanswered probes, 5+3·2 = 11 s after
//     the last packet, end an idle session;
//   - user timeout 10 s: the same bound when the server has an answer in
//     flight (a pong sent into the silence is retransmitted, and while
//     data is unacknowledged keepalives are not sent); on Linux it also
//     caps the probing: the first probe due 10 s or more after the last
//     answer ends the session instead.
//
// Another replica, trying every 0.5 s, then takes the lock about 12 s
// after the link went silent. The bound must stay well above the holder's
// 2.5 s, so that the server never frees the lock while the old holder may
// still dispatch; 10 s leaves room for a slow or lossy link. They are set
// over whatever the DSN says, as they belong to the campaign's timing,
// not to the pool's.
var sessionKeepalive = map[string]string{
	"tcp_keepalives_idle":     "5",     // seconds
	"tcp_keepalives_interval": "2",     // seconds
	"tcp_keepalives_count":    "3",     // probes
	"tcp_user_timeout":        "10000", // milliseconds (PostgreSQL 12+)
}

// campaignConfig is the connection config of the campaign session: the
// store's, with sessionKeepalive.
func (s *Store) campaignConfig() *pgx.ConnConfig {
	cfg := s.cfg.ConnConfig.Copy()
	for k, v := range sessionKeepalive {
		cfg.RuntimeParams[k] = v
	}
	return cfg
}

// testHookHeld, when set (by tests only), is called on the campaign's
// connection just after it took the lock. Atomic: a campaign of an earlier
// test may still be winding down when a test sets it.
var testHookHeld atomic.Pointer[func(ctx context.Context, conn *pgx.Conn)]

// bounded runs one step of the campaign connection with checkTimeout of its
// own.
func bounded(ctx context.Context, step func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	return step(ctx)
}

// holdDispatch connects, then tries the lock every campaignInterval; once
// it has it, it pings the session at the same pace until a ping fails or
// goes unanswered for checkTimeout.
func (s *Store) holdDispatch(ctx context.Context, set func(bool)) error {
	var conn *pgx.Conn
	err := bounded(ctx, func(ctx context.Context) (err error) {
		conn, err = pgx.ConnectConfig(ctx, s.campaignConfig())
		return err
	})
	if err != nil {
		return err
	}
	defer bounded(context.WithoutCancel(ctx), conn.Close)
	tick := time.NewTicker(campaignInterval)
	defer tick.Stop()
	held := false
	for {
		if held {
			if err := bounded(ctx, conn.Ping); err != nil {
				return errors.Join(errors.New("the dispatcher's session was lost"), err)
			}
		} else {
			err := bounded(ctx, func(ctx context.Context) error {
				return conn.QueryRow(ctx, dispatchLock).Scan(&held)
			})
			if err != nil {
				return err
			}
			if held {
				if hook := testHookHeld.Load(); hook != nil {
					(*hook)(ctx, conn)
				}
				set(true)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}
