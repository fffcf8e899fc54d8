package postgres_test

import (
	"context"
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

// TestPostgresEventOrder checks that the events of one command or device
// read in the order its writes applied, and that none is lost, when
// transactions of the store (of one replica or of two) wait for each
// other's locks. Each test holds a lock in a transaction of its own, as a
// write of the store under way elsewhere would, to order the writes.
func TestPostgresEventOrder(t *testing.T) {
	env := &testEnv{srv: pgtest.Start(t)}

	// An unbind takes its transaction id with the device's lock, then
	// waits for the binding, which a command being created holds (its
	// share lock). Meanwhile the bridge's reply marks one of the user's
	// commands delivered, in a transaction with a later id, and commits;
	// the unbind then ends the command. Its events read queued, delivered,
	// failed, as api.md promises ("in the order of its states"): not the
	// failure before the delivery.
	t.Run("CommandAcrossAnUnbind", func(t *testing.T) {
		ctx := t.Context()
		dsn, s := env.boundStore(t)
		c, _, err := s.CreateCommand(ctx, cmd("d1"), 0, nil)
		require.NoError(t, err)

		hold := lockInTx(t, dsn, `SELECT 1 FROM bindings WHERE device_id = 'd1' FOR SHARE`)
		unbound := make(chan error, 1)
		go func() {
			_, err := s.Unbind(ctx, "d1", "u1")
			unbound <- err
		}()
		waitLockWaiters(t, dsn, 1)
		_, err = s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
			c.State = companion.StateDelivered
			return nil
		})
		require.NoError(t, err)
		hold()
		select {
		case err := <-unbound:
			require.NoError(t, err, "Unbind")
		case <-time.After(waitFor):
			t.Fatal("Unbind did not return")
		}

		got, err := s.Command(ctx, c.ID)
		require.NoError(t, err)
		require.Equal(t, companion.StateFailed, got.State, "the command after the unbind")
		assert.Equal(t, []string{companion.StateQueued, companion.StateDelivered, companion.StateFailed},
			commandStates(t, s, "u1", c.ID), "the command's events, in log order")
	})

	// Two replicas store reports of one device: the first waits for the
	// device's status (held here, as a write under way would hold it), the
	// second queues behind it. Each applies (its seq is higher), and each
	// changes what the user sees, so each is an event: the second's is not
	// lost for having compared with the status as it was before the first
	// committed.
	t.Run("StatusAfterAWait", func(t *testing.T) {
		ctx := t.Context()
		dsn, a := env.boundStore(t)
		b := env.open(t, dsn)
		put := func(s *postgres.Store, online bool, seq uint64) chan error {
			ch := make(chan error, 1)
			go func() {
				ok, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: online, BridgeID: "br1", Model: "m",
					LastSeen: time.Now(), Seq: seq})
				if err == nil && !ok {
					t.Errorf("PutStatus(seq %d) not applied", seq)
				}
				ch <- err
			}()
			return ch
		}
		require.NoError(t, <-put(a, false, 1))

		hold := lockInTx(t, dsn, `SELECT 1 FROM statuses WHERE device_id = 'd1' FOR UPDATE`)
		first := put(a, true, 2)
		waitLockWaiters(t, dsn, 1)
		second := put(b, false, 3)
		waitLockWaiters(t, dsn, 2)
		hold()
		for _, ch := range []chan error{first, second} {
			select {
			case err := <-ch:
				require.NoError(t, err, "PutStatus")
			case <-time.After(waitFor):
				t.Fatal("PutStatus did not return")
			}
		}

		st, err := a.Status(ctx, "d1")
		require.NoError(t, err)
		require.False(t, st.Online, "the status after both")
		assert.Equal(t, []bool{false, true, false}, deviceOnline(t, a, "u1", "d1"), "the device's events: online, in log order")
	})

	// A bridge's Will locks the devices its status names; while it waits
	// for one of them, another replica stores the bridge's report that a
	// second device, offline, is online again. The Will then takes both
	// offline: the second one's going offline is an event too, or the
	// user's last word on it is "online".
	t.Run("BridgeOfflineAfterAWait", func(t *testing.T) {
		ctx := t.Context()
		dsn, a := env.boundStore(t)
		b := env.open(t, dsn)
		require.NoError(t, a.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d2", Model: "m"}))
		_, _, err := a.Bind(ctx, companion.Binding{DeviceID: "d2", UserID: "u1"})
		require.NoError(t, err)
		serve(t, a, "d2")
		for _, st := range []companion.Status{
			{DeviceID: "d1", Online: true, BridgeID: "br1", Model: "m", LastSeen: time.Now(), Seq: 1},
			{DeviceID: "d2", Online: false, BridgeID: "br1", Model: "m", LastSeen: time.Now(), Seq: 1},
		} {
			_, err := a.PutStatus(ctx, st)
			require.NoError(t, err)
		}

		hold := lockInTx(t, dsn, `SELECT 1 FROM statuses WHERE device_id = 'd1' FOR UPDATE`)
		marked := make(chan error, 1)
		go func() {
			_, err := a.MarkBridgeOffline(ctx, "br1")
			marked <- err
		}()
		waitLockWaiters(t, dsn, 1)
		ok, err := b.PutStatus(ctx, companion.Status{DeviceID: "d2", Online: true, BridgeID: "br1", Model: "m", LastSeen: time.Now(), Seq: 2})
		require.NoError(t, err)
		require.True(t, ok, "d2's report applied")
		hold()
		select {
		case err := <-marked:
			require.NoError(t, err, "MarkBridgeOffline")
		case <-time.After(waitFor):
			t.Fatal("MarkBridgeOffline did not return")
		}

		for _, dev := range []string{"d1", "d2"} {
			st, err := a.Status(ctx, dev)
			require.NoError(t, err)
			online := deviceOnline(t, a, "u1", dev)
			require.NotEmpty(t, online, "events of %s", dev)
			assert.Equal(t, st.Online, online[len(online)-1], "%s: online in its last event %v; want its status's", dev, online)
		}
	})
}

// lockInTx runs query (one that takes a lock) in a transaction of its own
// on the database of dsn and returns the func that ends it, releasing the
// lock; the test's end ends it too.
func lockInTx(t *testing.T, dsn, query string) (release func()) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	tx, err := conn.Begin(t.Context())
	require.NoError(t, err)
	_, err = tx.Exec(t.Context(), query)
	require.NoError(t, err)
	return func() {
		t.Helper()
		require.NoError(t, tx.Rollback(context.Background()))
	}
}

// waitLockWaiters waits until n sessions of the store (application_name
// companion) on the database of dsn wait for a lock.
func waitLockWaiters(t *testing.T, dsn string, n int) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	testenv.Eventually(t, waitFor, "sessions of the store waiting for a lock", func() bool {
		var waiting int
		err := conn.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'companion' AND wait_event_type = 'Lock'`).Scan(&waiting)
		require.NoError(t, err)
		return waiting >= n
	})
}

// commandStates returns the states of the command's events in the user's
// log, in log order.
func commandStates(t *testing.T, s *postgres.Store, user, id string) []string {
	t.Helper()
	var states []string
	for _, ev := range allEvents(t, s, user) {
		if ev.Command != nil && ev.Command.ID == id {
			states = append(states, ev.Command.State)
		}
	}
	return states
}

// deviceOnline returns Online of the device's events in the user's log,
// in log order.
func deviceOnline(t *testing.T, s *postgres.Store, user, dev string) []bool {
	t.Helper()
	var online []bool
	for _, ev := range allEvents(t, s, user) {
		if ev.Device != nil && ev.DeviceID == dev {
			online = append(online, ev.Device.Online)
		}
	}
	return online
}

// allEvents reads the user's whole log.
func allEvents(t *testing.T, s *postgres.Store, user string) []companion.Event {
	t.Helper()
	var all []companion.Event
	after := ""
	for {
		evs, next, err := s.Events(t.Context(), user, after, 0)
		require.NoError(t, err)
		all = append(all, evs...)
		if len(evs) == 0 {
			return all
		}
		after = next
	}
}
