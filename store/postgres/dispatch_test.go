package postgres_test

import (
	"context"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

// Of the stores campaigning on one database one dispatches at a time;
// when it goes (its session ends), another takes over.
func testOneDispatcher(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	a, b := e.open(t, dsn), e.open(t, dsn)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	changes := make(chan bool, 10)
	wg.Go(func() { a.Campaign(ctx, func(v bool) { changes <- v }) })
	select {
	case v := <-changes:
		require.True(t, v, "a's first change")
	case <-time.After(waitFor):
		t.Fatal("a never became the dispatcher")
	}
	bctx, bcancel := context.WithCancel(ctx)
	bdone := make(chan error, 1)
	go func() { bdone <- b.Campaign(bctx, nil) }()
	time.Sleep(3 * campaignTries) // b tries several times while a holds it
	assert.True(t, a.Dispatching())
	assert.False(t, b.Dispatching(), "two dispatchers at once")

	require.NoError(t, a.Close()) // a's session ends: the lock is free
	testenv.Eventually(t, waitFor, "b to take over", b.Dispatching)
	assert.False(t, a.Dispatching())
	bcancel()
	<-bdone
	assert.False(t, b.Dispatching(), "b stopped campaigning and still dispatches")
}

// campaignTries is about the pace at which a store tries for the lock.
const campaignTries = 500 * time.Millisecond

// A dispatcher whose link to PostgreSQL goes silent (packets dropped, no
// reset) stops dispatching once a check of its session goes unanswered,
// not minutes later at the kernel's TCP timeout: PostgreSQL may by then
// have ended that session and let another replica take the lock.
func testCutOffDispatcherStops(t *testing.T, e *testEnv) {
	u, err := url.Parse(e.newDB(t))
	require.NoError(t, err)
	link := testenv.NewRelay(t, u.Host)
	u.Host = link.Addr()
	dsn := u.String()
	s := e.open(t, dsn)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	changes := make(chan bool, 10)
	wg.Go(func() { s.Campaign(ctx, func(v bool) { changes <- v }) })
	select {
	case v := <-changes:
		require.True(t, v, "first change")
	case <-time.After(waitFor):
		t.Fatal("the store never became the dispatcher")
	}

	link.Blackhole()
	testenv.Eventually(t, waitFor, "the cut-off dispatcher to stop", func() bool { return !s.Dispatching() })
	select {
	case v := <-changes:
		assert.False(t, v, "change after the cut")
	case <-time.After(waitFor):
		t.Fatal("onChange(false) not called")
	}
}

// The session that holds the dispatcher's lock asks PostgreSQL to give it
// up about 10 s after its link goes silent (TCP keepalives and user
// timeout on the server's side), not after the kernel's two hours, so that
// another replica can take over. This checks the settings on that very
// session, as the server applies them to its socket (SHOW reads them back
// from the socket). It cannot check the takeover after a really silent
// link: CutOffDispatcherStops's relay is a userspace one whose kernel
// keeps acknowledging the server's packets and probes after blackhole, so
// the server's TCP never finds the peer gone.
func testDispatcherSessionKeepalive(t *testing.T, e *testEnv) {
	type settings struct {
		idle, interval, count, userTimeout string
		holdsLock                          bool
	}
	got := make(chan settings, 1)
	postgres.SetHookHeld(t, func(ctx context.Context, conn *pgx.Conn) {
		var s settings
		err := conn.QueryRow(ctx, `SELECT current_setting('tcp_keepalives_idle'),
			current_setting('tcp_keepalives_interval'),
			current_setting('tcp_keepalives_count'),
			current_setting('tcp_user_timeout'),
			EXISTS (SELECT FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'
				AND classid = 1668246896 AND objid = 2 AND objsubid = 2 AND granted)`).
			Scan(&s.idle, &s.interval, &s.count, &s.userTimeout, &s.holdsLock)
		if err != nil {
			t.Errorf("reading the campaign session's settings: %v", err)
		}
		select {
		case got <- s:
		default:
		}
	})
	s := e.open(t, e.newDB(t))
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { s.Campaign(ctx, nil) })
	select {
	case v := <-got:
		assert.True(t, v.holdsLock, "the session read holds the dispatcher's lock")
		assert.Equal(t, "5", v.idle, "tcp_keepalives_idle (s)")
		assert.Equal(t, "2", v.interval, "tcp_keepalives_interval (s)")
		assert.Equal(t, "3", v.count, "tcp_keepalives_count")
		assert.Equal(t, "10000", v.userTimeout, "tcp_user_timeout (ms)")
	case <-time.After(waitFor):
		t.Fatal("the store never took the dispatcher's lock")
	}
}
