package postgres_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func init() {
	ownTests = append(ownTests, []struct {
		name string
		run  func(t *testing.T, e *testEnv)
	}{
		{"Migrate", testMigrate},
		{"TwoStoresOneDevice", testTwoStoresOneDevice},
		{"ClockSkewKeepsIDOrder", testClockSkew},
		{"IdempotencyAcrossStores", testIdempotencyAcrossStores},
		{"ClaimAcrossStores", testClaimAcrossStores},
		{"IdempotencyClaimClockSkew", testIdempotencyClaimClockSkew},
		{"PurgeClockSkew", testPurgeClockSkew},
		{"BlobStoredBehindKeepsItsGrace", testBlobStoredBehindKeepsItsGrace},
		{"CommandWrittenBehindKeepsItsRetention", testCommandWrittenBehindKeepsItsRetention},
		{"CommandExpiresByTheDatabasesClock", testCommandExpiresByTheDatabasesClock},
		{"ListenCommands", testListenCommands},
		{"ListenHearsOwnChanges", testListenHearsOwnChanges},
		{"ListenReconnects", testListenReconnects},
		{"ListenFirstTimeRereads", testListenFirstTimeRereads},
		{"BarrierOrder", testBarrierOrder},
		{"CloseWaitsForWrites", testCloseWaits},
		{"BlobChunks", testBlobChunks},
		{"BatchIsolatesFailures", testBatchIsolatesFailures},
		{"OneDispatcher", testOneDispatcher},
		{"CutOffDispatcherStops", testCutOffDispatcherStops},
		{"DispatcherSessionKeepalive", testDispatcherSessionKeepalive},
		{"AccountLockHoldsCreations", testAccountLockHoldsCreations},
	}...)
}

func cmd(dev string) companion.Command {
	return companion.Command{DeviceID: dev, UserID: "u1", Op: "push.text", Payload: []byte(`{"text":"hi"}`), ExpiresAt: time.Now().Add(time.Hour)}
}

// Replicas that start together apply each migration once; a database of
// a newer build is refused.
func testMigrate(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ctx := t.Context()
	// Without Migrate, Open refuses a database whose schema is behind:
	// companion migrate applies it.
	_, err := postgres.Open(ctx, dsn, postgres.Options{})
	require.ErrorIs(t, err, postgres.ErrSchemaOld, "Open of an empty database")
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = postgres.Migrate(ctx, dsn) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "Migrate #%d", i)
	}
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	var n, v int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*), max(version) FROM schema_migrations`).Scan(&n, &v))
	assert.Equal(t, postgres.SchemaVersion(), n, "rows of schema_migrations")
	assert.Equal(t, postgres.SchemaVersion(), v, "schema version")
	e.open(t, dsn) // Open of a migrated database changes nothing

	_, err = conn.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES (999, '0999_future')`)
	require.NoError(t, err)
	assert.ErrorIs(t, postgres.Migrate(ctx, dsn), companion.ErrSchemaTooNew)
	_, err = postgres.Open(ctx, dsn, postgres.Options{})
	assert.ErrorIs(t, err, companion.ErrSchemaTooNew, "Open")
}

// Two replicas creating commands for one device at once: the queue limit
// holds across them, and ids are unique and rise in each caller's order.
func testTwoStoresOneDevice(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	stores := []*postgres.Store{e.open(t, dsn), e.open(t, dsn)}
	ctx := t.Context()
	const workers, each, maxOpen = 8, 10, 50
	perWorker := make([][]string, workers)
	var full atomic.Int32
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			s := stores[w%2]
			for range each {
				c, _, err := s.CreateCommand(ctx, cmd("d1"), maxOpen, nil)
				if errors.Is(err, companion.ErrQueueFull) {
					full.Add(1)
					continue
				}
				if err != nil {
					t.Errorf("CreateCommand = %v", err)
					return
				}
				perWorker[w] = append(perWorker[w], c.ID)
			}
		})
	}
	wg.Wait()
	assert.Equal(t, int32(workers*each-maxOpen), full.Load(), "refused with ErrQueueFull")
	seen := map[string]bool{}
	for w, ids := range perWorker {
		assert.True(t, slices.IsSorted(ids), "worker %d's ids do not rise: %v", w, ids)
		for _, id := range ids {
			assert.False(t, seen[id], "id %s given twice", id)
			seen[id] = true
		}
	}
	assert.Len(t, seen, maxOpen)
	for _, s := range stores {
		n, err := s.CountOpen(ctx, "d1")
		require.NoError(t, err)
		assert.Equal(t, maxOpen, n, "CountOpen")
	}
}

// A replica whose clock is behind still gives a device's next command an
// id above the last one another replica gave. (A clock off the database's
// by more than a minute gives way to the database's, bug 313: 30 s ahead
// is kept.)
func testClockSkew(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ahead := e.openWith(t, dsn, postgres.Options{Now: func() time.Time { return time.Now().Add(30 * time.Second) }})
	behind := e.open(t, dsn)
	ctx := t.Context()
	var ids []string
	for i := range 6 {
		s := ahead
		if i%2 == 1 {
			s = behind
		}
		c, _, err := s.CreateCommand(ctx, cmd("d1"), 0, nil)
		require.NoError(t, err)
		ids = append(ids, c.ID)
	}
	assert.True(t, slices.IsSorted(ids), "ids in commit order %v; want rising", ids)
	list, _, err := behind.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1"})
	require.NoError(t, err)
	got := make([]string, len(list))
	for i, c := range list {
		got[len(list)-1-i] = c.ID
	}
	assert.Equal(t, ids, got, "ListCommands, oldest first")
	// Another device is not held back by d1's ids.
	c, _, err := behind.CreateCommand(ctx, cmd("d2"), 0, nil)
	require.NoError(t, err)
	assert.Less(t, c.ID, ids[0], "d2's id made by the replica behind")
}

// Two replicas given one idempotency key at once create one command.
func testIdempotencyAcrossStores(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	stores := []*postgres.Store{e.open(t, dsn), e.open(t, dsn)}
	ctx := t.Context()
	hash := sha256.Sum256([]byte("body"))
	const tries = 10
	ids := make([]string, tries)
	replays := make([]bool, tries)
	var wg sync.WaitGroup
	for i := range tries {
		wg.Go(func() {
			c, replay, err := stores[i%2].CreateCommand(ctx, cmd("d1"), 0, &companion.Idempotency{UserID: "u1", Key: "k", RequestHash: hash[:], Status: 202})
			if err != nil {
				t.Errorf("CreateCommand = %v", err)
				return
			}
			ids[i], replays[i] = c.ID, replay
		})
	}
	wg.Wait()
	for i := range ids {
		assert.Equal(t, ids[0], ids[i], "command of try %d", i)
	}
	fresh := 0
	for _, r := range replays {
		if !r {
			fresh++
		}
	}
	assert.Equal(t, 1, fresh, "tries that created the command")
	n, err := stores[0].CountOpen(ctx, "d1")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

// Of two replicas that both try to move a queued command on, one does:
// the other's fn sees it moved (the outbox's claim).
func testClaimAcrossStores(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	stores := []*postgres.Store{e.open(t, dsn), e.open(t, dsn)}
	ctx := t.Context()
	errStale := errors.New("stale")
	for range 10 {
		c, _, err := stores[0].CreateCommand(ctx, cmd("d1"), 0, nil)
		require.NoError(t, err)
		var won atomic.Int32
		var wg sync.WaitGroup
		for _, s := range stores {
			wg.Go(func() {
				_, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
					if c.State != companion.StateQueued {
						return errStale
					}
					c.State = companion.StateSent
					return nil
				})
				switch {
				case err == nil:
					won.Add(1)
				case !errors.Is(err, errStale):
					t.Errorf("UpdateCommand = %v", err)
				}
			})
		}
		wg.Wait()
		assert.Equal(t, int32(1), won.Load(), "replicas that marked %s sent", c.ID)
	}
}

// A claim of an Idempotency-Key holds its key for a minute by the
// database's clock, whatever the clocks of the replicas that claim and
// read it say: a replica 90 s ahead took another replica's claim of a
// moment ago for one left by a request that died, and let a repeat claim
// the key and do the work a second time (docs/reliability.md, bug 309).
// Nor does a claim made by the replica ahead hold the key longer.
func testIdempotencyClaimClockSkew(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ahead := e.openWith(t, dsn, postgres.Options{Now: func() time.Time { return time.Now().Add(90 * time.Second) }})
	behind := e.open(t, dsn)
	ctx := t.Context()
	for _, tc := range []struct {
		name        string
		claim, read *postgres.Store
	}{
		{"claimed behind, read ahead", behind, ahead},
		{"claimed ahead, read behind", ahead, behind},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "k-" + tc.name
			claim := companion.Idempotency{UserID: "u1", Key: key, RequestHash: []byte("the request")}
			require.NoError(t, tc.claim.PutIdempotency(ctx, claim))
			got, err := tc.read.Idempotency(ctx, "u1", key)
			require.NoError(t, err, "Idempotency of a claim made a moment ago, read by the other replica")
			assert.Equal(t, 0, got.Status)
			assert.ErrorIs(t, tc.read.PutIdempotency(ctx, claim), companion.ErrExists, "a repeat's claim on the other replica")
			assert.WithinDuration(t, time.Now(), got.CreatedAt, 30*time.Second, "the claim's time, by the database's clock")

			answer := claim
			answer.Status = 201
			require.NoError(t, tc.claim.PutIdempotency(ctx, answer), "the answer over its claim")
			got, err = tc.read.Idempotency(ctx, "u1", key)
			require.NoError(t, err)
			assert.Equal(t, 201, got.Status)
			assert.WithinDuration(t, time.Now(), got.CreatedAt, 30*time.Second, "the answer's time, by the database's clock")
		})
	}
}

// A replica hears of the state changes another replica stores.
func testListenCommands(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	a, b := e.open(t, dsn), e.open(t, dsn)
	heard := make(chan string, 100)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	listened := make(chan error, 1)
	go func() { listened <- a.ListenCommands(ctx, func(id string) { heard <- id }) }()

	// LISTEN takes a moment: change commands until one is heard. Those
	// changed meanwhile may be heard later; they are skipped below, as is
	// the fn("") that follows the LISTEN (testListenFirstTimeRereads).
	warm := map[string]bool{"": true}
	deadline := time.After(waitFor)
	for heardOne := false; !heardOne; {
		c, _, err := b.CreateCommand(t.Context(), cmd("d1"), 0, nil)
		require.NoError(t, err)
		warm[c.ID] = true
		_, err = b.UpdateCommand(t.Context(), c.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil })
		require.NoError(t, err)
		select {
		case id := <-heard:
			assert.True(t, warm[id], "heard %q; want one of the commands changed", id)
			heardOne = true
		case <-time.After(100 * time.Millisecond):
		case <-deadline:
			t.Fatal("no notification heard")
		}
	}
	next := func(within time.Duration) (string, bool) {
		t.Helper()
		timeout := time.After(within)
		for {
			select {
			case id := <-heard:
				if !warm[id] {
					return id, true
				}
			case <-timeout:
				return "", false
			}
		}
	}
	// Now the creation (for the dispatcher) and every change of state are
	// heard, in commit order; a change that keeps the state (progress) is
	// not announced, nor a refused one.
	c, _, err := b.CreateCommand(t.Context(), cmd("d1"), 0, nil)
	require.NoError(t, err)
	for _, st := range []string{companion.StateDelivered, companion.StateInProgress, companion.StateInProgress, companion.StateSucceeded} {
		_, err := b.UpdateCommand(t.Context(), c.ID, func(c *companion.Command) error { c.State = st; return nil })
		require.NoError(t, err)
	}
	_, err = b.UpdateCommand(t.Context(), c.ID, func(c *companion.Command) error { return nil })
	require.ErrorIs(t, err, companion.ErrFinal)
	for i := range 4 {
		id, ok := next(waitFor)
		require.True(t, ok, "notification %d not heard", i)
		assert.Equal(t, c.ID, id, "notification %d", i)
	}
	if id, ok := next(200 * time.Millisecond); ok {
		t.Errorf("heard %q; want nothing more", id)
	}

	// Closing the store ends ListenCommands with nil.
	require.NoError(t, a.Close())
	select {
	case err := <-listened:
		assert.NoError(t, err, "ListenCommands after Close")
	case <-time.After(waitFor):
		t.Fatal("ListenCommands did not return after Close")
	}
}

// A store hears its own changes too: PostgreSQL delivers a notification
// to every session that LISTENs, the sender's database included. A
// replica's broker takes them as another replica's (CommandChanged), which
// costs it a queue read per change on the dispatcher and leaves almost
// nothing in live; but they are kept (docs/scale-out.md). For n commands,
// each created and moved through sent to succeeded here, the listener
// hears 3n. And a write its caller was told failed may have committed:
// here its caller stopped waiting for it (its context ended:
// UpdateCommand returned the context's error) while the lane's batch went
// on and committed it; a lost answer to COMMIT does the same. Its own
// notification is then the only word this replica gets of it, as the
// caller told its broker nothing. Dropped, a Prefer: wait here on the
// command would trust live and wait out its time (as in
// docs/reliability.md, bugs 232 and 253).
func testListenHearsOwnChanges(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	a := e.open(t, dsn)
	heard := make(chan string, 1000)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	listened := make(chan error, 1)
	go func() { listened <- a.ListenCommands(ctx, func(id string) { heard <- id }) }()
	defer func() {
		cancel()
		<-listened
	}()
	// The fn("") that says the LISTEN is in place: changes from now on
	// are heard.
	select {
	case id := <-heard:
		require.Empty(t, id, "first call")
	case <-time.After(waitFor):
		t.Fatal("ListenCommands did not say it listens")
	}
	// hear takes want notifications and counts them by id.
	hear := func(want int, ids map[string]bool) map[string]int {
		t.Helper()
		count := map[string]int{}
		timeout := time.After(waitFor)
		for total := 0; total < want; total++ {
			select {
			case id := <-heard:
				require.True(t, ids[id], "heard %q; want one of the commands changed", id)
				count[id]++
			case <-timeout:
				t.Fatalf("heard %d of this store's own %d changes", total, want)
			}
		}
		return count
	}

	const n = 20
	ids := map[string]bool{}
	for range n {
		c, _, err := a.CreateCommand(t.Context(), cmd("d1"), 0, nil)
		require.NoError(t, err)
		ids[c.ID] = true
		for _, st := range []string{companion.StateSent, companion.StateSucceeded} {
			_, err := a.UpdateCommand(t.Context(), c.ID, func(c *companion.Command) error { c.State = st; return nil })
			require.NoError(t, err)
		}
	}
	for id, k := range hear(3*n, ids) {
		assert.Equal(t, 3, k, "notifications of %s (created, sent, succeeded)", id)
	}

	// The abandoned write: x, y and z are one device's, so one lane's.
	// x's write waits for a lock held here while y's and z's queue up
	// behind it; they then share a batch, which waits for z's lock. The
	// caller of y's stops waiting; then the batch commits.
	var x, y, z companion.Command
	for _, c := range []*companion.Command{&x, &y, &z} {
		var err error
		*c, _, err = a.CreateCommand(t.Context(), cmd("d2"), 0, nil)
		require.NoError(t, err)
	}
	ids = map[string]bool{x.ID: true, y.ID: true, z.ID: true}
	hear(3, ids)
	lock := func(id string) pgx.Tx {
		conn, err := pgx.Connect(t.Context(), dsn)
		require.NoError(t, err)
		t.Cleanup(func() { conn.Close(context.Background()) })
		tx, err := conn.Begin(t.Context())
		require.NoError(t, err)
		_, err = tx.Exec(t.Context(), `SELECT 1 FROM commands WHERE id = $1 FOR UPDATE`, id)
		require.NoError(t, err)
		return tx
	}
	sent := func(c *companion.Command) error { c.State = companion.StateSent; return nil }
	holdX, holdZ := lock(x.ID), lock(z.ID)
	xDone, zDone := make(chan error, 1), make(chan error, 1)
	a.UpdateCommandAsync(x.ID, sent, func(_ companion.Command, err error) { xDone <- err })
	waitLockWaiters(t, dsn, 1)
	yCtx, stopWaiting := context.WithCancel(t.Context())
	defer stopWaiting()
	spy := &waitSpy{Context: yCtx, waiting: make(chan struct{})}
	yDone := make(chan error, 1)
	go func() {
		_, err := a.UpdateCommand(spy, y.ID, func(c *companion.Command) error {
			c.State = companion.StateCanceled
			return nil
		})
		yDone <- err
	}()
	<-spy.waiting // queued: UpdateCommand waits for it
	a.UpdateCommandAsync(z.ID, sent, func(_ companion.Command, err error) { zDone <- err })
	require.NoError(t, holdX.Commit(t.Context()))
	require.NoError(t, <-xDone)
	waitLockWaiters(t, dsn, 1) // the batch of y and z, at z
	stopWaiting()
	require.ErrorIs(t, <-yDone, context.Canceled, "UpdateCommand of y, its caller gone")
	require.NoError(t, holdZ.Commit(t.Context()))
	require.NoError(t, <-zDone)
	got, err := a.Command(t.Context(), y.ID)
	require.NoError(t, err)
	require.Equal(t, companion.StateCanceled, got.State, "y, whose caller stopped waiting for its write")
	assert.Equal(t, 1, hear(3, ids)[y.ID],
		"y's change, which its caller was not told of, is not heard: a replica would not hear of it")
}

// waitSpy is a context that says when its Done was first asked for: when
// the store's UpdateCommand, its write queued, waits for it.
type waitSpy struct {
	context.Context
	once    sync.Once
	waiting chan struct{}
}

func (c *waitSpy) Done() <-chan struct{} {
	c.once.Do(func() { close(c.waiting) })
	return c.Context.Done()
}

// When its connection is cut, ListenCommands reconnects and says so with
// fn(""); ctx's end ends it.
func testListenReconnects(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	s := e.open(t, dsn)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	heard := make(chan string, 100)
	listened := make(chan error, 1)
	go func() { listened <- s.ListenCommands(ctx, func(id string) { heard <- id }) }()
	select {
	case id := <-heard:
		require.Equal(t, "", id, "first call once LISTEN was in place")
	case <-time.After(waitFor):
		t.Fatal(`fn("") not called once LISTEN was in place`)
	}

	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	terminate := func() int {
		var n int
		err := conn.QueryRow(t.Context(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND query = 'LISTEN companion_commands' AND pid <> pg_backend_pid()`).Scan(&n)
		require.NoError(t, err)
		return n
	}
	testenv.Eventually(t, waitFor, "a listening connection to cut", func() bool { return terminate() > 0 })
	select {
	case id := <-heard:
		assert.Equal(t, "", id, "first call after the connection was cut")
	case <-time.After(waitFor):
		t.Fatal(`fn("") not called after reconnecting`)
	}
	c, _, err := s.CreateCommand(t.Context(), cmd("d1"), 0, nil)
	require.NoError(t, err)
	_, err = s.UpdateCommand(t.Context(), c.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil })
	require.NoError(t, err)
	select {
	case id := <-heard:
		assert.Equal(t, c.ID, id, "after reconnecting")
	case <-time.After(waitFor):
		t.Fatal("nothing heard after reconnecting")
	}
	cancel()
	select {
	case err := <-listened:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(waitFor):
		t.Fatal("ListenCommands did not return when its context ended")
	}
}

// A replica may register what it waits for (a Prefer: wait, a command
// accepted there) before its listener's first LISTEN is in place: what
// another replica changed meanwhile is announced to nobody. So the first
// LISTEN, as every reconnection, is followed by fn(""), before any
// notification, and the caller reads again what it waits for
// (docs/reliability.md, bug 252).
func testListenFirstTimeRereads(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	a, b := e.open(t, dsn), e.open(t, dsn)
	connected, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	postgres.SetHookListen(t, func(ctx context.Context) {
		if first.CompareAndSwap(false, true) {
			close(connected)
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
	})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	heard := make(chan string, 100)
	listened := make(chan error, 1)
	go func() { listened <- a.ListenCommands(ctx, func(id string) { heard <- id }) }()
	select {
	case <-connected:
	case <-time.After(waitFor):
		t.Fatal("the listener did not connect")
	}
	// Announced before the LISTEN: nobody hears it.
	missed, _, err := b.CreateCommand(t.Context(), cmd("d1"), 0, nil)
	require.NoError(t, err)
	_, err = b.UpdateCommand(t.Context(), missed.ID, func(c *companion.Command) error { c.State = companion.StateCanceled; return nil })
	require.NoError(t, err)
	close(release)

	// The LISTEN is in place once a change is heard; fn("") came before.
	var got []string
	deadline := time.After(waitFor)
	for len(got) == 0 || got[len(got)-1] == "" {
		_, _, err := b.CreateCommand(t.Context(), cmd("d1"), 0, nil)
		require.NoError(t, err)
		select {
		case id := <-heard:
			got = append(got, id)
		case <-time.After(100 * time.Millisecond):
		case <-deadline:
			t.Fatalf("no notification heard; heard %q", got)
		}
	}
	assert.Equal(t, "", got[0], "first call once LISTEN was in place (heard %q): what was waited for before it is not read again", got)
	assert.NotContains(t, got, missed.ID, "heard a change announced before the LISTEN")
	cancel()
	select {
	case err := <-listened:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(waitFor):
		t.Fatal("ListenCommands did not return when its context ended")
	}
}

// MarkBridgeOffline applies after the writes made before it and before
// those made after it, whichever device they are for.
func testBarrierOrder(t *testing.T, e *testEnv) {
	s := e.open(t, e.newDB(t))
	const devices = 16
	var order []string
	var mu sync.Mutex
	note := func(what string) {
		mu.Lock()
		order = append(order, what)
		mu.Unlock()
	}
	done := make(chan struct{}, 3*devices+1)
	for i := range devices {
		serve(t, s, fmt.Sprintf("d%d", i))
	}
	for i := range devices {
		dev := fmt.Sprintf("d%d", i)
		s.PutStatusAsync(companion.Status{DeviceID: dev, Online: true, BridgeID: "br1", Seq: 1}, func(ok bool, err error) {
			assert.True(t, ok && err == nil, "first status of %s: %v %v", dev, ok, err)
			note("before")
			done <- struct{}{}
		})
	}
	var marked []string
	s.MarkBridgeOfflineAsync("br1", func(ids []string, err error) {
		assert.NoError(t, err)
		marked = ids
		note("barrier")
		done <- struct{}{}
	})
	for i := range devices / 2 {
		dev := fmt.Sprintf("d%d", i)
		s.PutStatusAsync(companion.Status{DeviceID: dev, Online: true, BridgeID: "br1", Seq: 2}, func(ok bool, err error) {
			assert.True(t, ok && err == nil, "second status of %s: %v %v", dev, ok, err)
			note("after")
			done <- struct{}{}
		})
	}
	for range devices + 1 + devices/2 {
		select {
		case <-done:
		case <-time.After(waitFor):
			t.Fatal("done not called")
		}
	}
	want := slices.Concat(slices.Repeat([]string{"before"}, devices), []string{"barrier"}, slices.Repeat([]string{"after"}, devices/2))
	assert.Equal(t, want, order, "order of the done calls")
	assert.Len(t, marked, devices, "MarkBridgeOffline's devices")
	for i := range devices {
		st, err := s.Status(t.Context(), fmt.Sprintf("d%d", i))
		require.NoError(t, err)
		assert.Equal(t, i < devices/2, st.Online, "d%d online", i)
	}
}

// Close waits for the writes under way; later writes fail with ErrClosed.
func testCloseWaits(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	s, err := postgres.Open(t.Context(), dsn, postgres.Options{MaxConns: 4, Migrate: true})
	require.NoError(t, err)
	const n = 40
	var calls atomic.Int32
	for i := range n {
		s.CreateCommandAsync(cmd(fmt.Sprintf("d%d", i%5)), 0, nil, func(c companion.Command, _ bool, err error) {
			assert.NoError(t, err)
			calls.Add(1)
		})
	}
	require.NoError(t, s.Close())
	assert.Equal(t, int32(n), calls.Load(), "done calls when Close returned")
	var got error
	s.PutStatusAsync(companion.Status{DeviceID: "d1", Seq: 1}, func(_ bool, err error) { got = err })
	assert.ErrorIs(t, got, postgres.ErrClosed, "PutStatusAsync after Close")
	_, _, err = s.CreateCommand(t.Context(), cmd("d1"), 0, nil)
	assert.ErrorIs(t, err, postgres.ErrClosed, "CreateCommand after Close")

	s2 := e.open(t, dsn)
	for i := range 5 {
		c, err := s2.CountOpen(t.Context(), fmt.Sprintf("d%d", i))
		require.NoError(t, err)
		assert.Equal(t, n/5, c, "CountOpen(d%d) after Close", i)
	}
}

// A blob over several chunks reads back whole, and seeks across chunks.
func testBlobChunks(t *testing.T, e *testEnv) {
	s := e.open(t, e.newDB(t))
	ctx := t.Context()
	content := make([]byte, 600<<10+123)
	_, _ = rand.Read(content)
	sum := sha256.Sum256(content)
	b, err := s.PutBlob(ctx, bytes.NewReader(content), int64(len(content)))
	require.NoError(t, err)
	assert.Equal(t, hex.EncodeToString(sum[:]), b.SHA256)
	assert.Equal(t, int64(len(content)), b.Size)

	r, got, err := s.OpenBlob(ctx, b.SHA256)
	require.NoError(t, err)
	defer r.Close()
	assert.Equal(t, b.SHA256, got.SHA256)
	all, err := io.ReadAll(r)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(content, all), "read %d bytes; want the %d stored", len(all), len(content))
	for _, off := range []int64{0, 1, 256<<10 - 1, 256 << 10, 512<<10 + 7, int64(len(content)) - 1} {
		pos, err := r.Seek(off, io.SeekStart)
		require.NoError(t, err)
		require.Equal(t, off, pos)
		buf := make([]byte, 300<<10)
		n, err := io.ReadFull(r, buf)
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("read at %d: %v", off, err)
		}
		assert.True(t, bytes.Equal(content[off:off+int64(n)], buf[:n]), "content at %d", off)
		assert.Equal(t, min(int64(len(buf)), int64(len(content))-off), int64(n), "bytes read at %d", off)
	}
	end, err := r.Seek(0, io.SeekEnd)
	require.NoError(t, err)
	assert.Equal(t, int64(len(content)), end)
	n, err := r.Read(make([]byte, 10))
	assert.Equal(t, 0, n)
	assert.ErrorIs(t, err, io.EOF)

	// Over the limit by a byte: nothing is stored, chunks included.
	_, err = s.PutBlob(ctx, bytes.NewReader(content), int64(len(content)-1))
	assert.ErrorIs(t, err, companion.ErrTooLarge)
	again, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
	require.NoError(t, err)
	assert.True(t, again.CreatedAt.Equal(b.CreatedAt), "CreatedAt of content stored again")
}

// Writes that share a transaction (a lane's batch) fail alone: one that
// PostgreSQL refuses leaves the others stored, in order.
func testBatchIsolatesFailures(t *testing.T, e *testEnv) {
	s := e.open(t, e.newDB(t))
	ctx := t.Context()
	c, _, err := s.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)
	const n = 40
	errs := make(chan error, n)
	results := make([]error, n)
	for i := range n {
		s.UpdateCommandAsync(c.ID, func(c *companion.Command) error {
			c.State = companion.StateInProgress
			if i%7 == 3 {
				c.Op = "bad \xff utf-8" // PostgreSQL refuses the text
				return nil
			}
			p := i
			c.Progress = &p
			return nil
		}, func(_ companion.Command, err error) {
			results[i] = err
			errs <- err
		})
	}
	for range n {
		select {
		case <-errs:
		case <-time.After(waitFor):
			t.Fatal("done not called")
		}
	}
	for i, err := range results {
		if i%7 == 3 {
			assert.Error(t, err, "update %d with bad text", i)
		} else {
			assert.NoError(t, err, "update %d", i)
		}
	}
	got, err := s.Command(ctx, c.ID)
	require.NoError(t, err)
	require.NotNil(t, got.Progress)
	assert.Equal(t, n-1, *got.Progress, "progress after the updates, in order")
	assert.Equal(t, "push.text", got.Op)
}

// A bridge is not created, through any store, while another holds the
// lock of its id (LockAccount: the Mosquitto driver's, from its read of
// the bridge to its write of its account; docs/reliability.md, bug 257).
func testAccountLockHoldsCreations(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	s1, s2 := e.open(t, dsn), e.open(t, dsn)
	ctx := t.Context()
	admin, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer admin.Close(context.Background())

	unlock, err := s1.LockAccount(ctx, "b1")
	require.NoError(t, err)
	created := make(chan error, 1)
	go func() {
		created <- s2.CreateBridge(ctx, companion.Bridge{ID: "b1", SecretHash: []byte("hash-1")})
	}()
	require.Eventually(t, func() bool {
		var waiting int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 10*time.Second, 10*time.Millisecond, "the creation does not wait for the lock")
	_, err = s1.Bridge(ctx, "b1")
	require.ErrorIs(t, err, companion.ErrNotFound, "the bridge was created under the lock")
	unlock()
	require.NoError(t, <-created)
	_, err = s1.Bridge(ctx, "b1")
	require.NoError(t, err)

	// Another id is not held.
	unlock, err = s1.LockAccount(ctx, "b2")
	require.NoError(t, err)
	defer unlock()
	require.NoError(t, s2.CreateBridge(ctx, companion.Bridge{ID: "b3", SecretHash: []byte("hash-3")}))
}

// A purge deletes what is older than the age it is given by the database's
// clock, whatever the clock of the replica that purges says: a replica 2 h
// ahead deleted the Idempotency-Key records of 23 h ago, whose repeats then
// ran again, and the events, final commands and blobs of 23 h ago with
// them; one 2 h behind kept records 2 h past their age (docs/reliability.md,
// bug 310).
func testPurgeClockSkew(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ctx := t.Context()
	clockAt := func(d time.Duration) func() time.Time { return func() time.Time { return time.Now().Add(d) } }
	// Records of 23 h ago, stamped by a replica whose clock said so then.
	writer := e.openWith(t, dsn, postgres.Options{Now: clockAt(-23 * time.Hour)})
	require.NoError(t, writer.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k1", Status: 201, CreatedAt: time.Now().Add(-23 * time.Hour)}))
	c, _, err := writer.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)
	_, err = writer.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
	require.NoError(t, err)
	// A blob (bug 312), a command and its events (bug 313) are stamped by
	// the database's clock: those of 23 h ago are written to the database
	// directly.
	_, err = writer.PutBlob(ctx, strings.NewReader("a photo of 23 h ago"), 0)
	require.NoError(t, err)
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	for _, q := range []string{
		`UPDATE blobs SET created_at = now() - interval '23 hours', stored_at = now() - interval '23 hours'`,
		`UPDATE commands SET created_at = now() - interval '23 hours', updated_at = now() - interval '23 hours'`,
		`UPDATE events SET at = now() - interval '23 hours'`,
	} {
		_, err = conn.Exec(ctx, q)
		require.NoError(t, err, q)
	}

	purge := func(s *postgres.Store, olderThan time.Time) map[string]int {
		t.Helper()
		got := map[string]int{}
		for name, f := range map[string]func(context.Context, time.Time) (int, error){
			"idempotency": s.PurgeIdempotency, "commands": s.PurgeCommands, "events": s.PurgeEvents, "blobs": s.PurgeBlobs,
		} {
			n, err := f(ctx, olderThan)
			require.NoError(t, err, "purging %s", name)
			got[name] = n
		}
		return got
	}
	// A purging replica whose clock stepped since its store last saw the
	// database's (ClockOffset, bug 314): its cutoff is by that clock.
	stepped := func(d time.Duration) *postgres.Store {
		var step atomic.Int64
		s := e.openWith(t, dsn, postgres.Options{Now: func() time.Time { return time.Now().Add(time.Duration(step.Load())) }})
		step.Store(int64(d))
		return s
	}
	// A day by the clock 2 h ahead: 22 h by the database's.
	ahead := stepped(2 * time.Hour)
	assert.Equal(t, map[string]int{"idempotency": 0, "commands": 0, "events": 0, "blobs": 0},
		purge(ahead, time.Now().Add(2*time.Hour-24*time.Hour)), "purged a day ago by a replica 2 h ahead")
	_, err = writer.Idempotency(ctx, "u1", "k1")
	assert.NoError(t, err, "the record of 23 h ago")

	// A day, and then 22 h, by the clock 2 h behind: the records of 23 h
	// ago are younger than the one, older than the other.
	behind := stepped(-2 * time.Hour)
	assert.Equal(t, map[string]int{"idempotency": 0, "commands": 0, "events": 0, "blobs": 0},
		purge(behind, time.Now().Add(-2*time.Hour-24*time.Hour)), "purged a day ago by a replica 2 h behind")
	got := purge(behind, time.Now().Add(-2*time.Hour-22*time.Hour))
	assert.Equal(t, 1, got["idempotency"], "idempotency records purged 22 h ago by a replica 2 h behind")
	assert.Equal(t, 1, got["commands"], "commands purged 22 h ago by a replica 2 h behind")
	assert.Positive(t, got["events"], "events purged 22 h ago by a replica 2 h behind")
	assert.Equal(t, 1, got["blobs"], "blobs purged 22 h ago by a replica 2 h behind")
}

// A blob is last stored when the database's clock says, whatever the clock
// of the replica that took the upload: one 2 h behind stamped it 2 h old,
// and a purge in the moment before the command or release it was uploaded
// for referenced it deleted it, the hour's grace (blobGrace) gone
// (docs/reliability.md, bug 312).
func testBlobStoredBehindKeepsItsGrace(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ctx := t.Context()
	behind := e.openWith(t, dsn, postgres.Options{Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
	dispatcher := e.open(t, dsn)
	b, err := behind.PutBlob(ctx, strings.NewReader("a photo for a command about to be sent"), 0)
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now(), b.CreatedAt, 30*time.Second, "the blob's time, by the database's clock")
	n, err := dispatcher.PurgeBlobs(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "blobs purged an hour ago, a moment after the upload")
	_, err = behind.Blob(ctx, b.SHA256)
	assert.NoError(t, err, "the blob, a moment after its upload")
}

// A command is stamped, and its events with it, by the database's clock,
// the clock its purges judge it by (bug 310), whatever the clock of the
// replica that writes it: one 2 h behind stamped a command it had just
// ended 2 h old, and the hourly purge deleted it and its events 2 h
// before their retention (docs/reliability.md, bug 313).
func testCommandWrittenBehindKeepsItsRetention(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ctx := t.Context()
	behind := e.openWith(t, dsn, postgres.Options{Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
	dispatcher := e.open(t, dsn)
	c, _, err := behind.CreateCommand(ctx, cmd("d1"), 0, nil)
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now(), c.CreatedAt, 30*time.Second, "the command's creation, by the database's clock")
	done, err := behind.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
	require.NoError(t, err)
	assert.WithinDuration(t, time.Now(), done.UpdatedAt, 30*time.Second, "the command's change, by the database's clock")
	got, err := dispatcher.Command(ctx, c.ID)
	require.NoError(t, err)
	assert.Equal(t, done, got, "the command as read through another replica, as its writer answered it")

	n, err := dispatcher.PurgeCommands(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "commands purged an hour ago, a moment after one ended")
	n, err = dispatcher.PurgeEvents(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "events purged an hour ago, a moment after a command's")
	_, err = dispatcher.Command(ctx, c.ID)
	assert.NoError(t, err, "the command, a moment after it ended")
}

// A command's TTL runs on the database's clock, whatever the clocks of the
// replica that accepts it and of the one that dispatches it: accepted
// through a replica 2 h behind, a command of an hour's TTL read expired at
// once to a dispatcher in step with the database, and to one 2 h ahead its
// own commands did (docs/reliability.md, bug 314).
func testCommandExpiresByTheDatabasesClock(t *testing.T, e *testEnv) {
	dsn := e.newDB(t)
	ctx := t.Context()
	clockAt := func(d time.Duration) func() time.Time { return func() time.Time { return time.Now().Add(d) } }
	behind := e.openWith(t, dsn, postgres.Options{Now: clockAt(-2 * time.Hour)})
	ahead := e.openWith(t, dsn, postgres.Options{Now: clockAt(2 * time.Hour)})
	inStep := e.open(t, dsn)
	// Each command's ExpiresAt as the API of its replica sets it: its
	// clock and the store's, plus the TTL.
	accept := func(s *postgres.Store, d time.Duration) companion.Command {
		t.Helper()
		in := cmd("d1")
		in.ExpiresAt = time.Now().Add(d + time.Hour)
		c, _, err := s.CreateCommand(ctx, in, 0, nil)
		require.NoError(t, err)
		assert.WithinDuration(t, time.Now().Add(time.Hour), c.ExpiresAt, 30*time.Second, "the command's expiry, an hour by the database's clock")
		got, err := inStep.Command(ctx, c.ID)
		require.NoError(t, err)
		assert.Equal(t, c, got, "the command as read through another replica, as its 202 showed it")
		return c
	}
	accept(behind, -2*time.Hour)
	accept(ahead, 2*time.Hour)
	accept(inStep, 0)
	// A dispatcher judges by its store's clock and ClockOffset, as the
	// broker does.
	for name, d := range map[string]time.Duration{"in step": 0, "2 h ahead": 2 * time.Hour, "2 h behind": -2 * time.Hour} {
		s := map[time.Duration]*postgres.Store{0: inStep, 2 * time.Hour: ahead, -2 * time.Hour: behind}[d]
		now := time.Now().Add(d).Add(s.ClockOffset())
		assert.WithinDuration(t, time.Now(), now, 30*time.Second, "the clock of the dispatcher %s, as its store reads it", name)
		expired, err := s.ExpiredCommands(ctx, now)
		require.NoError(t, err)
		assert.Empty(t, expired, "commands expired by the dispatcher %s, a moment after they were accepted", name)
		expired, err = s.ExpiredCommands(ctx, now.Add(61*time.Minute))
		require.NoError(t, err)
		assert.Len(t, expired, 3, "commands expired by the dispatcher %s, an hour after they were accepted", name)
	}
}
