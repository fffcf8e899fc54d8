package postgres_test

import (
	"context"
	"encoding/json"
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
	ownTests = append(ownTests, struct {
		name string
		run  func(t *testing.T, e *testEnv)
	}{"MoveWaitsForALateWriteOfTheBridgeItLeft", testMoveWaitsForALateWrite})
}

// holdClass is the advisory lock class of heldWrites.
const holdClass = 424242

// heldWrites has every write (events, a trigger's: "INSERT OR UPDATE") of
// a row of table that when selects (a trigger's WHEN) wait inside its statement, its snapshot taken, until
// the returned func is called: a report of the bridge a device is leaving
// that checked the device's bridge before the move committed and commits
// after it. waiting reports whether a write waits there now.
func heldWrites(t *testing.T, dsn, events, table, when string) (release func(), waiting func() bool) {
	t.Helper()
	ctx := t.Context()
	admin, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(func() { admin.Close(context.Background()) })
	_, err = admin.Exec(ctx, `CREATE OR REPLACE FUNCTION held_write() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock(424242, 1); RETURN NEW; END $$`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `CREATE TRIGGER held_write BEFORE `+events+` ON `+table+` FOR EACH ROW WHEN (`+when+`) EXECUTE FUNCTION held_write()`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `SELECT pg_advisory_lock(424242, 1)`)
	require.NoError(t, err)
	released := false
	release = func() {
		if !released {
			released = true
			_, err := admin.Exec(context.Background(), `SELECT pg_advisory_unlock(424242, 1)`)
			require.NoError(t, err)
		}
	}
	t.Cleanup(release)
	waiting = func() bool {
		var n int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = $1`, holdClass).Scan(&n))
		return n > 0
	}
	return release, waiting
}

// blocked reports whether a transaction other than those of heldWrites
// waits for a lock.
func blocked(t *testing.T, dsn string) func() bool {
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return func() bool {
		var n int
		require.NoError(t, conn.QueryRow(t.Context(), `SELECT count(*) FROM pg_locks
			WHERE NOT granted AND NOT (locktype = 'advisory' AND classid = $1)`, holdClass).Scan(&n))
		return n > 0
	}
}

// A move of a device waits for a write of the bridge it leaves that began
// before it, whatever the device's status and settings were: a late
// report of the old bridge, which checked the device's bridge before the
// move committed, is stored before the move, which then undoes it, or not
// at all. The move locked the status and settings rows only when it
// changed them: a device offline already, with seq 0 (moved before, not
// reported since by its new bridge), or with no status or settings yet,
// took no lock, and the late report landed after the move: the device read
// online on the bridge it left, or that bridge's settings, its clock ahead,
// held the new bridge's off (docs/reliability.md, bugs 266, 271, 272, 288).
func testMoveWaitsForALateWrite(t *testing.T, e *testEnv) {
	for _, tc := range []struct {
		name string
		// before readies d1 on s: served by op1, the state the move
		// finds.
		before func(t *testing.T, s *postgres.Store)
	}{
		{"NoStatusYet", func(t *testing.T, s *postgres.Store) {}},
		{"MovedBeforeNotReportedSince", func(t *testing.T, s *postgres.Store) {
			ctx := t.Context()
			_, err := s.AssignDevice(ctx, "d1", "op0", "")
			require.NoError(t, err)
			_, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op0", LastSeen: time.Now(), Seq: 7})
			require.NoError(t, err)
			_, err = s.PutReportedSettings(ctx, "d1", "op0", map[string]json.RawMessage{"volume": json.RawMessage("1")}, nil, time.Now(), 7)
			require.NoError(t, err)
		}},
	} {
		for _, to := range []string{"op2", ""} {
			name := tc.name + "/To" + to
			if to == "" {
				name = tc.name + "/ToNone"
			}
			t.Run(name, func(t *testing.T) {
				t.Run("Status", func(t *testing.T) { testMoveAfterLateStatus(t, e, tc.before, to) })
				t.Run("Settings", func(t *testing.T) { testMoveAfterLateSettings(t, e, tc.before, to) })
			})
		}
	}
}

// moveReady opens a store with d1 and the bridges op0, op1 and op2,
// readies d1 with before, and moves it to op1.
func moveReady(t *testing.T, e *testEnv, before func(*testing.T, *postgres.Store)) (string, *postgres.Store) {
	t.Helper()
	ctx := t.Context()
	dsn := e.newDB(t)
	s := e.open(t, dsn)
	require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "m"}))
	for _, b := range []string{"op0", "op1", "op2"} {
		require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: b, SecretHash: []byte(b)}))
	}
	before(t, s)
	_, err := s.AssignDevice(ctx, "d1", "op1", "")
	require.NoError(t, err)
	return dsn, s
}

// lateWrite runs write, which waits in heldWrites, then the move of d1 to
// to; once the move is done or waits for write, it lets write go on, and
// waits for both.
func lateWrite(t *testing.T, dsn string, s *postgres.Store, release func(), waiting func() bool, to string, write func() error) {
	t.Helper()
	wrote := make(chan error, 1)
	go func() { wrote <- write() }()
	testenv.Eventually(t, waitFor, "the report of op1 to wait in its write", waiting)
	moved := make(chan error, 1)
	go func() {
		_, err := s.AssignDevice(context.Background(), "d1", to, "")
		moved <- err
	}()
	others := blocked(t, dsn)
	var movedErr error
	done := false
	testenv.Eventually(t, waitFor, "the move to end or wait for the report", func() bool {
		select {
		case movedErr = <-moved:
			done = true
			return true
		default:
			return others()
		}
	})
	release()
	require.NoError(t, <-wrote, "the late report")
	if !done {
		movedErr = <-moved
	}
	require.NoError(t, movedErr, "AssignDevice(d1, %q)", to)
}

func testMoveAfterLateStatus(t *testing.T, e *testEnv, before func(*testing.T, *postgres.Store), to string) {
	dsn, s := moveReady(t, e, before)
	ctx := t.Context()
	release, waiting := heldWrites(t, dsn, "INSERT OR UPDATE", "statuses", "NEW.bridge_id = 'op1'")
	lateWrite(t, dsn, s, release, waiting, to, func() error {
		_, err := s.PutStatus(context.Background(), companion.Status{DeviceID: "d1", Online: true, BridgeID: "op1", LastSeen: time.Now(), Seq: 20})
		return err
	})
	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	if st.Online || st.BridgeID != "" {
		t.Errorf("Status(d1) after a late report of op1 and the move: online %v on %q; want false on \"\"", st.Online, st.BridgeID)
	}
	if to != "" {
		applied, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: to, LastSeen: time.Now(), Seq: 5})
		require.NoError(t, err)
		assert.True(t, applied, "the first report of its new bridge, its seq behind the old one's")
	}
}

func testMoveAfterLateSettings(t *testing.T, e *testEnv, before func(*testing.T, *postgres.Store), to string) {
	dsn, s := moveReady(t, e, before)
	ctx := t.Context()
	ahead := uint64(time.Now().Add(12 * time.Hour).UnixNano())
	release, waiting := heldWrites(t, dsn, "UPDATE", "settings", "NEW.seq <> 0")
	lateWrite(t, dsn, s, release, waiting, to, func() error {
		_, err := s.PutReportedSettings(context.Background(), "d1", "op1", map[string]json.RawMessage{"volume": json.RawMessage("20")}, nil, time.Now(), ahead)
		return err
	})
	set, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	if set.Seq != 0 && to != "" {
		t.Errorf("Settings(d1).Seq after a late report of op1 and the move = %d; want 0, the new bridge's clock its own", set.Seq)
	}
	if to == "" {
		to = "op2"
		_, err := s.AssignDevice(ctx, "d1", to, "")
		require.NoError(t, err)
	}
	applied, err := s.PutReportedSettings(ctx, "d1", to, map[string]json.RawMessage{"volume": json.RawMessage("30")}, nil, time.Now(), uint64(time.Now().UnixNano()))
	require.NoError(t, err)
	assert.True(t, applied, "settings of its new bridge, its clock behind the old one's")
}
