package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPostgresReplicaRaces checks writes that two replicas (two Store
// values on one database) make of one thing at the same moment, where
// there is no row yet to lock: a device's very first status reports, and
// a user and a bridge of one id. And that a purge goes in bounded
// transactions, without taking records that a new request renewed.
func TestPostgresReplicaRaces(t *testing.T) {
	env := &testEnv{srv: pgtest.Start(t)}

	// A device's first two reports, each stored on another replica, the
	// second one's transaction holding an earlier xid (a lane's batch
	// whose write of another device came first) and reaching the device
	// while the first one's insert is not committed yet. Its event must
	// still read after the first's, as its status applies over it, and it
	// must compare with the first's status: a report that changes nothing
	// has no event.
	t.Run("FirstReportsInOrder", func(t *testing.T) {
		got := firstReports(t, env, false)
		assert.Equal(t, []bool{true, false}, got, "d's events: online, in log order; want the first report's, then the second's")
	})
	t.Run("FirstReportsNoChange", func(t *testing.T) {
		got := firstReports(t, env, true)
		assert.Equal(t, []bool{true}, got, "d's events: online, in log order; want one, the second report changing nothing")
	})

	// A user and a bridge of one id created at once on two replicas: as
	// with the bbolt engine's single writer, a bridge is never created
	// with the id of a user that exists already. CreateBridge checked
	// users, and then inserted, and CreateUser checked nothing: a user
	// committed between the two, and seen by anyone, did not stop the
	// bridge.
	t.Run("UserAndBridgeOfOneID", func(t *testing.T) {
		ctx := t.Context()
		dsn := env.newDB(t)
		a, b := env.open(t, dsn), env.open(t, dsn)
		// The bridge's insert waits for a bridge with its secret being
		// made elsewhere (not committed), after its check of the users.
		release, pid := holdLock(t, dsn, `INSERT INTO bridges (id, secret_hash, owner_id, created_at) VALUES ('other', '\x01', '', now())`)
		bridge := make(chan error, 1)
		go func() {
			bridge <- a.CreateBridge(ctx, companion.Bridge{ID: "x1", SecretHash: []byte{1}})
		}()
		waitBlockedBy(t, dsn, pid)
		user := make(chan error, 1)
		go func() {
			user <- b.CreateUser(ctx, companion.User{ID: "x1", Name: "ann", TokenHash: []byte{2}})
		}()
		// Either the user is made first and the bridge refused, or the
		// user waits for the bridge's outcome.
		userFirst := false
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		testenv.Eventually(t, waitFor, "CreateUser to return or to wait for CreateBridge", func() bool {
			select {
			case err := <-user:
				require.NoError(t, err, "CreateUser(x1)")
				userFirst = true
				return true
			default:
			}
			var waiting bool
			require.NoError(t, conn.QueryRow(ctx, blockedByStoreSQL).Scan(&waiting))
			return waiting
		})
		release() // rolled back: the secret is free
		err = <-bridge
		if userFirst {
			assert.ErrorIs(t, err, companion.ErrExists, "CreateBridge(x1) that returned after CreateUser(x1) had")
			_, berr := a.Bridge(ctx, "x1")
			assert.ErrorIs(t, berr, companion.ErrNotFound, "Bridge(x1) after the user x1 was made first")
			return
		}
		require.NoError(t, err, "CreateBridge(x1)")
		select {
		case err := <-user:
			// bbolt's order: a bridge does not stop a user.
			require.NoError(t, err, "CreateUser(x1) after CreateBridge(x1)")
		case <-time.After(waitFor):
			t.Fatal("CreateUser did not return")
		}
	})

	// PurgeIdempotency deletes in bounded transactions (bug 40 on bbolt):
	// every old record, no young one.
	t.Run("PurgeIdempotencyInBatches", func(t *testing.T) {
		ctx := t.Context()
		s := env.open(t, env.newDB(t))
		cut := time.Now()
		old := 0
		for i := range 250 {
			at := cut.Add(-time.Hour)
			if i%5 == 0 {
				at = cut.Add(time.Hour)
			} else {
				old++
			}
			require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: fmt.Sprint("u", i%7), Key: fmt.Sprint("k", i), Status: 200, CreatedAt: at}))
		}
		const batch = 30
		between := 0
		postgres.SetPurgeBatch(s, batch, func() { between++ })
		n, err := s.PurgeIdempotency(ctx, cut)
		require.NoError(t, err)
		assert.Equal(t, old, n, "PurgeIdempotency deleted")
		if want := (old + batch - 1) / batch; between+1 < want {
			t.Errorf("the purge of %d records ran in %d transactions; want at least %d, a batch of %d each", old, between+1, want, batch)
		}
		for i := range 250 {
			_, err := s.Idempotency(ctx, fmt.Sprint("u", i%7), fmt.Sprint("k", i))
			if i%5 == 0 {
				assert.NoError(t, err, "young record k%d", i)
			} else {
				assert.ErrorIs(t, err, companion.ErrNotFound, "old record k%d", i)
			}
		}
	})

	// A request that reuses an expired key puts its record over the old
	// one while the purge waits for the row: the purge must see the new
	// record's time, and leave it.
	t.Run("PurgeIdempotencySparesARenewedKey", func(t *testing.T) {
		ctx := t.Context()
		dsn := env.newDB(t)
		s := env.open(t, dsn)
		cut := time.Now()
		require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k1", Status: 200, CreatedAt: cut.Add(-25 * time.Hour)}))
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		var pid int
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		// What the upsert of a new request with the key does.
		_, err = tx.Exec(ctx, `UPDATE idempotency SET created_at = $1, status = 201 WHERE user_id = 'u1' AND key = 'k1'`, cut)
		require.NoError(t, err)
		purged := make(chan error, 1)
		go func() {
			_, err := s.PurgeIdempotency(ctx, cut.Add(-24*time.Hour))
			purged <- err
		}()
		waitBlockedBy(t, dsn, pid)
		require.NoError(t, tx.Commit(ctx))
		select {
		case err := <-purged:
			require.NoError(t, err)
		case <-time.After(waitFor):
			t.Fatal("PurgeIdempotency did not return")
		}
		rec, err := s.Idempotency(ctx, "u1", "k1")
		require.NoError(t, err, "the renewed record after the purge")
		assert.Equal(t, 201, rec.Status)
	})
}

// firstReports stores a device's first two reports through two stores,
// as described in FirstReportsInOrder (same says whether the second
// reports what the first does, with a higher seq), and returns Online of
// the device's events in log order, checking that the last one is the
// device's status.
func firstReports(t *testing.T, env *testEnv, same bool) []bool {
	ctx := t.Context()
	dsn := env.newDB(t)
	a, b := env.open(t, dsn), env.open(t, dsn)
	// Six devices of one lane (the stores have as many lanes), in the
	// order of their hashes: a lane's batch writes in that order.
	var devs []string
	for i := 0; len(devs) < 6; i++ {
		d := fmt.Sprintf("dev-%d", i)
		if postgres.LaneOf(a, d) != 0 || slices.ContainsFunc(devs, func(o string) bool { return postgres.DeviceHash(o) == postgres.DeviceHash(d) }) {
			continue
		}
		devs = append(devs, d)
	}
	slices.SortFunc(devs, func(x, y string) int { return int(postgres.DeviceHash(x)) - int(postgres.DeviceHash(y)) })
	x, y, d, z, wA, wB := devs[0], devs[1], devs[2], devs[3], devs[4], devs[5]
	for _, dev := range devs {
		require.NoError(t, a.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "m"}))
		_, _, err := a.Bind(ctx, companion.Binding{DeviceID: dev, UserID: "u1"})
		require.NoError(t, err)
	}
	serve(t, a, devs...)
	report := func(dev string, online bool, seq uint64) companion.Status {
		return companion.Status{DeviceID: dev, Online: online, BridgeID: "br1", Model: "m", LastSeen: time.Now(), Seq: seq}
	}
	for _, dev := range []string{y, z, wA, wB} {
		_, err := a.PutStatus(ctx, report(dev, true, 1))
		require.NoError(t, err)
	}
	lockRow := func(dev string) (func(), int) {
		return holdLock(t, dsn, fmt.Sprintf(`SELECT 1 FROM statuses WHERE device_id = '%s' FOR UPDATE`, dev))
	}
	relA, pidA := lockRow(wA)
	relB, pidB := lockRow(wB)
	relY, pidY := lockRow(y)
	relZ, pidZ := lockRow(z)
	var results []chan error
	put := func(s *postgres.Store, st companion.Status) {
		ch := make(chan error, 1)
		s.PutStatusAsync(st, func(applied bool, err error) {
			if err == nil && !applied {
				err = fmt.Errorf("status of %s seq %d not applied", st.DeviceID, st.Seq)
			}
			ch <- err
		})
		results = append(results, ch)
	}

	// Each store's lane waits on its first report (wA, wB), with the
	// reports after it queued: they go as one batch.
	put(a, report(wA, true, 2))
	waitBlockedBy(t, dsn, pidA)
	put(a, report(d, true, 1)) // the first report of d
	put(a, report(z, true, 2))
	put(b, report(wB, true, 2))
	waitBlockedBy(t, dsn, pidB)
	put(b, report(x, true, 1)) // b's batch takes its xid here
	put(b, report(y, true, 2))
	put(b, report(d, same, 2)) // the second report of d
	// b's batch writes x, then waits for y; then a's writes d (a later
	// xid), and waits for z; then b's reaches d.
	relB()
	waitBlockedBy(t, dsn, pidY)
	relA()
	waitBlockedBy(t, dsn, pidZ)
	relY()
	waitBlockedByStore(t, dsn)
	relZ()
	for _, ch := range results {
		select {
		case err := <-ch:
			require.NoError(t, err, "PutStatusAsync")
		case <-time.After(waitFor):
			t.Fatal("PutStatusAsync did not finish")
		}
	}

	st, err := a.Status(ctx, d)
	require.NoError(t, err)
	require.Equal(t, uint64(2), st.Seq, "d's status: the second report's")
	online := deviceOnline(t, a, "u1", d)
	require.NotEmpty(t, online, "d's events")
	assert.Equal(t, st.Online, online[len(online)-1], "online in d's last event %v; want its status's", online)
	return online
}

// holdLock runs query (one that takes a lock) in a transaction of its own
// on the database of dsn, and returns the func that ends it (rolled back)
// and the pid of its session; the test's end ends it too.
func holdLock(t *testing.T, dsn, query string) (release func(), pid int) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	require.NoError(t, tx.QueryRow(t.Context(), `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = tx.Exec(t.Context(), query)
	require.NoError(t, err)
	return func() {
		t.Helper()
		if err := tx.Rollback(context.Background()); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("rollback: %v", err)
		}
	}, pid
}

// blockedByStoreSQL says whether a session of the store (application_name
// companion) waits for a lock that another session of the store holds.
const blockedByStoreSQL = `SELECT EXISTS (SELECT 1 FROM pg_stat_activity a
	WHERE a.datname = current_database() AND a.application_name = 'companion' AND EXISTS (
		SELECT 1 FROM pg_stat_activity o WHERE o.application_name = 'companion' AND o.pid = ANY(pg_blocking_pids(a.pid))))`

// waitBlockedByStore waits until a session of the store waits for a lock
// that another session of the store holds.
func waitBlockedByStore(t *testing.T, dsn string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	testenv.Eventually(t, waitFor, "a session of the store blocked by another", func() bool {
		var waiting bool
		require.NoError(t, conn.QueryRow(t.Context(), blockedByStoreSQL).Scan(&waiting))
		return waiting
	})
}

// waitBlockedBy waits until a session of the store on the database of dsn
// waits for a lock that the session pid holds.
func waitBlockedBy(t *testing.T, dsn string, pid int) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	testenv.Eventually(t, waitFor, fmt.Sprintf("a session of the store blocked by %d", pid), func() bool {
		var waiting bool
		err := conn.QueryRow(t.Context(), `SELECT EXISTS (SELECT 1 FROM pg_stat_activity a
			WHERE a.datname = current_database() AND a.application_name = 'companion' AND $1 = ANY(pg_blocking_pids(a.pid)))`, pid).Scan(&waiting)
		require.NoError(t, err)
		return waiting
	})
}
