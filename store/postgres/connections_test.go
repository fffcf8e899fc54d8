package postgres_test

import (
	"errors"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

// A database host that stops answering (not refusing: its connections
// complete and then nothing comes) costs a write, and the store's open,
// the connect timeout, and then a 503's error, not a wait for as long as
// the kernel keeps trying, or for ever: the store's writes run on no
// request's context. A DSN without connect_timeout gets ConnectTimeout.
func TestAHostThatStopsAnsweringTimesOut(t *testing.T) {
	t.Parallel() // it mostly waits, on a PostgreSQL of its own
	s, h, dsn := relayedStore(t)

	h.Silence()
	// Bounds to tell a timeout from a hang, far past ConnectTimeout. The
	// first writes meet the connections cut (at once); the next needs a
	// new one.
	hung := 12 * postgres.ConnectTimeout
	errc := make(chan error, 1)
	go func() {
		var err error
		for range 8 {
			start := time.Now()
			if _, _, err = s.CreateCommand(t.Context(), cmd("d1"), 0, nil); err == nil || time.Since(start) > postgres.ConnectTimeout/2 {
				break
			}
		}
		errc <- err
	}()
	select {
	case err := <-errc:
		require.Error(t, err, "a write with the database's host silent")
		require.True(t, postgres.IsUnavailable(err), "IsUnavailable(%v) = false; want true", err)
	case <-time.After(hung):
		t.Fatalf("a write waited past %v on a database host that does not answer", hung)
	}

	go func() {
		s2, err := postgres.Open(t.Context(), dsn, postgres.Options{MaxConns: 4})
		if err == nil {
			s2.Close()
			err = errors.New("opened")
		}
		errc <- err
	}()
	select {
	case err := <-errc:
		require.NotEqual(t, "opened", err.Error())
	case <-time.After(hung):
		t.Fatalf("Open waited %v on a database host that does not answer", hung)
	}
}

// While the database does not take new connections, the store's requests
// that need one are answered unavailable at once, and the pool tries a
// connection one at a time, 100 ms apart at least, not one for each
// request: with PostgreSQL's max_connections taken, each attempt forks a
// backend on the database's server that is refused (bug 579). Once the
// database takes connections again, so does the store, within 100 ms.
func TestConnectionsAreNotTriedForEveryRequestWhileTheyFail(t *testing.T) {
	t.Parallel() // it mostly waits, on a PostgreSQL of its own
	s, h, _ := relayedStore(t)

	h.Refuse()
	before := h.Accepted()
	// 16 clients for two seconds, each request after the last: the pool's
	// attempts, 100 ms apart at least, and the health probe's, once a
	// second.
	var requests atomic.Int64
	var wg sync.WaitGroup
	end := time.Now().Add(2 * time.Second)
	for range 16 {
		wg.Go(func() {
			for time.Now().Before(end) {
				_, err := s.CountOpen(t.Context(), "d1")
				requests.Add(1)
				if err == nil || !postgres.IsUnavailable(err) {
					t.Errorf("a request with the database's connections refused: %v; want an error IsUnavailable", err)
					return
				}
			}
		})
	}
	wg.Wait()
	tried := h.Accepted() - before
	t.Logf("%d requests, %d connections tried", requests.Load(), tried)
	require.LessOrEqual(t, tried, int64(60), "connections tried for %d requests while the database refused them", requests.Load())

	h.Restore()
	back := time.Now()
	testenv.Eventually(t, 10*time.Second, "a request taken once the database takes connections", func() bool {
		_, err := s.CountOpen(t.Context(), "d1")
		return err == nil
	})
	t.Logf("taken again %v after the database", time.Since(back))
	for range 20 {
		n, err := s.CountOpen(t.Context(), "d1")
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
}

// relayedStore opens a store of 4 connections on a PostgreSQL of the
// test's own through a relay, with a command of d1's in it; it returns the
// store, the relay and the DSN through it. The store ends with the test.
func relayedStore(t *testing.T) (*postgres.Store, *testenv.Relay, string) {
	t.Helper()
	srv := pgtest.Start(t)
	u, err := url.Parse(srv.NewDatabase(t))
	require.NoError(t, err)
	h := testenv.NewRelay(t, u.Host)
	u.Host = h.Addr()
	s, err := postgres.Open(t.Context(), u.String(), postgres.Options{MaxConns: 4, Migrate: true})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	_, _, err = s.CreateCommand(t.Context(), cmd("d1"), 0, nil)
	require.NoError(t, err)
	return s, h, u.String()
}

// The pool takes pool_max_conns from the DSN, as pgxpool documents it,
// when the store's options do not set MaxConns; 16 when neither does.
func TestPoolMaxConnsOfTheDSN(t *testing.T) {
	t.Parallel() // it mostly waits, on a PostgreSQL of its own
	srv := pgtest.Start(t)
	dsn := srv.NewDatabase(t)
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	q := u.Query()
	q.Set("pool_max_conns", "3")
	u.RawQuery = q.Encode()
	for _, tc := range []struct {
		dsn  string
		opt  int32
		want int32
	}{
		{dsn, 0, 16},
		{u.String(), 0, 3},
		{u.String(), 5, 5},
	} {
		s, err := postgres.Open(t.Context(), tc.dsn, postgres.Options{MaxConns: tc.opt, Migrate: true})
		require.NoError(t, err)
		require.Equal(t, tc.want, postgres.PoolMaxConns(s), "%s with MaxConns %d", tc.dsn, tc.opt)
		s.Close()
	}
}
