package store

import (
	"context"
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion"
)

// TestDeviceIndexFolds: a device's commands are listed whole, newest
// first, page by page, whether their entries are still in device_cmds_new
// or folded into device_cmds, before and after the store is opened again;
// a purge takes them from both.
func TestDeviceIndexFolds(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	path := filepath.Join(t.TempDir(), "db")
	db := openTestDBWith(t, path, Options{Now: clk.Now})
	db.foldAt = 7
	devices := []string{"d1", "d2", "d3"}
	want := map[string][]string{} // newest first
	for i := range 40 {
		dev := devices[i%3]
		if i%5 == 0 {
			dev = "d1" // d1 gets more
		}
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: dev, Op: "push.text"}, 0, nil)
		require.NoError(t, err)
		want[dev] = append([]string{c.ID}, want[dev]...)
		if i%6 == 0 {
			_, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateFailed; return nil })
			require.NoError(t, err)
		}
		if i == 20 {
			checkDeviceLists(t, db, want)
		}
	}
	staged, folded := countDeviceIndex(t, db)
	require.Less(t, staged, 7, "device_cmds_new was not folded")
	require.Equal(t, 40, staged+folded)
	staged0 := staged
	require.NotZero(t, staged, "the test should leave some entries unfolded")
	checkDeviceLists(t, db, want)

	// Only the failed ones, across both buckets.
	failed, _, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1", State: companion.StateFailed})
	require.NoError(t, err)
	require.NotEmpty(t, failed)
	for _, c := range failed {
		require.Equal(t, companion.StateFailed, c.State)
	}

	require.NoError(t, db.Close())
	db = openTestDBWith(t, path, Options{Now: clk.Now})
	db.foldAt = 7
	checkDeviceLists(t, db, want)
	// The count of staged entries survives the reopening: the fold comes
	// after as many more as before.
	for range 7 - staged {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d2", Op: "push.text"}, 0, nil)
		require.NoError(t, err)
		want["d2"] = append([]string{c.ID}, want["d2"]...)
	}
	staged, _ = countDeviceIndex(t, db)
	require.Zero(t, staged, "no fold after the count of staged entries reached foldAt")
	checkDeviceLists(t, db, want)

	// Purged, a command leaves both buckets.
	for _, ids := range want {
		for _, id := range ids {
			_, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = companion.StateFailed; return nil })
			if err != nil {
				require.ErrorIs(t, err, companion.ErrFinal)
			}
		}
	}
	clk.Advance(time.Hour)
	n, err := db.PurgeCommands(ctx, clk.Now())
	require.NoError(t, err)
	require.Equal(t, 40+7-staged0, n)
	staged, folded = countDeviceIndex(t, db)
	require.Zero(t, staged+folded)
	checkDeviceLists(t, db, map[string][]string{"d1": nil, "d2": nil, "d3": nil})
}

// checkDeviceLists lists each device's commands whole and three at a
// time, and compares them with want (ids, newest first).
func checkDeviceLists(t *testing.T, db *DB, want map[string][]string) {
	t.Helper()
	ctx := context.Background()
	for dev, ids := range want {
		all, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: dev})
		require.NoError(t, err)
		require.False(t, more)
		require.Equal(t, ids, commandIDs(all), "%s, whole", dev)
		var paged []string
		before := ""
		for {
			page, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: dev, Limit: 3, Before: before})
			require.NoError(t, err)
			paged = append(paged, commandIDs(page)...)
			if !more {
				break
			}
			before = page[len(page)-1].ID
		}
		require.Equal(t, ids, paged, "%s, three at a time", dev)
	}
}

func commandIDs(cs []companion.Command) []string {
	var ids []string
	for _, c := range cs {
		ids = append(ids, c.ID)
	}
	return ids
}

// countDeviceIndex counts the entries of device_cmds_new and device_cmds.
func countDeviceIndex(t *testing.T, db *DB) (staged, folded int) {
	t.Helper()
	require.NoError(t, db.bolt.View(func(tx *bolt.Tx) error {
		staged = tx.Bucket(bucketDeviceCmdsNew).Stats().KeyN
		folded = tx.Bucket(bucketDeviceCmds).Stats().KeyN
		return nil
	}))
	return staged, folded
}

// TestMigrateAddsTheNewCommandsIndex: a schema 6 file, whose device_cmds
// holds every entry and which has no device_cmds_new, lists its commands
// as before once opened, and takes new ones.
func TestMigrateAddsTheNewCommandsIndex(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "db")
	db := openTestDBWith(t, path, Options{})
	var ids []string
	for range 3 {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text"}, 0, nil)
		require.NoError(t, err)
		ids = append([]string{c.ID}, ids...)
	}
	require.NoError(t, db.Close())

	// Make it a version 6 file.
	raw, err := bolt.Open(path, 0o600, nil)
	require.NoError(t, err)
	require.NoError(t, raw.Update(func(tx *bolt.Tx) error {
		if err := foldDeviceCmds(tx); err != nil {
			return err
		}
		if err := tx.DeleteBucket(bucketDeviceCmdsNew); err != nil {
			return err
		}
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte("6"))
	}))
	require.NoError(t, raw.Close())

	db = openTestDBWith(t, path, Options{})
	c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text"}, 0, nil)
	require.NoError(t, err)
	checkDeviceLists(t, db, map[string][]string{"d1": append([]string{c.ID}, ids...)})
}

// TestUnbindFindsFoldedCommands: an unbind ends the user's unfinished
// commands of the device whether their index entries are folded into
// device_cmds or still staged in device_cmds_new, and leaves the other
// devices' and the finished ones alone.
func TestUnbindFindsFoldedCommands(t *testing.T) {
	ctx := context.Background()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{})
	db.foldAt = 5
	for _, dev := range []string{"d1", "d2"} {
		require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "sim-1"}))
		_, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: "u1"})
		require.NoError(t, err)
	}
	var want []string // d1's unfinished, oldest first
	for i := range 23 {
		dev := []string{"d1", "d2"}[i%2]
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: dev, UserID: "u1", Op: "push.text"}, 0, nil)
		require.NoError(t, err)
		switch {
		case i%3 == 0:
			_, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
			require.NoError(t, err)
		case dev == "d1":
			want = append(want, c.ID)
		}
	}
	staged, folded := countDeviceIndex(t, db)
	require.NotZero(t, staged, "the test should leave some entries unfolded")
	require.NotZero(t, folded, "the test should fold some entries")

	got, err := db.Unbind(ctx, "d1", "u1")
	require.NoError(t, err)
	var ended []string
	for _, c := range got.Ended {
		ended = append(ended, c.ID)
	}
	require.Equal(t, want, ended)
	n, err := db.CountOpen(ctx, "d1")
	require.NoError(t, err)
	require.Zero(t, n, "d1's open commands after the unbind")
	n, err = db.CountOpen(ctx, "d2")
	require.NoError(t, err)
	require.NotZero(t, n, "d2 keeps its open commands")
}

// TestUnbindReadsOnlyTheOpenCommands checks that an unbind decodes only the
// device's unfinished commands, not the finished history it walks past to
// reach an old unfinished one: that walk runs in a write transaction,
// which every 202 waits behind. The finished commands' records are made
// unreadable, so a read of one fails the unbind.
func TestUnbindReadsOnlyTheOpenCommands(t *testing.T) {
	ctx := context.Background()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Logger: quietLogger()})
	db.foldAt = 4
	require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "sim-1"}))
	_, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	mk := func(state string) companion.Command {
		t.Helper()
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text"}, 0, nil)
		require.NoError(t, err)
		if state != companion.StateQueued {
			c, err = db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = state; return nil })
			require.NoError(t, err)
		}
		return c
	}
	// One old command the bridge holds, then a history of finished ones
	// (folded into device_cmds and still staged), then a new queued one.
	old := mk(companion.StateDelivered)
	var finished []string
	for range 9 {
		finished = append(finished, mk(companion.StateSucceeded).ID)
	}
	last := mk(companion.StateQueued)
	staged, folded := countDeviceIndex(t, db)
	require.NotZero(t, staged, "the test should leave some entries unfolded")
	require.NotZero(t, folded, "the test should fold some entries")
	err = db.bolt.Update(func(tx *bolt.Tx) error {
		for _, id := range finished {
			if err := tx.Bucket(bucketCommands).Put([]byte(id), []byte("not a command")); err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)

	got, err := db.Unbind(ctx, "d1", "u1")
	require.NoError(t, err, "Unbind read a finished command")
	var ended []string
	for _, c := range got.Ended {
		ended = append(ended, c.ID)
	}
	require.Equal(t, []string{old.ID, last.ID}, ended)
	n, err := db.CountOpen(ctx, "d1")
	require.NoError(t, err)
	require.Zero(t, n, "d1's open commands after the unbind")
}

// TestDesiredBackFromFoldedCommands: a settings change that ends without
// succeeding gives its setting back to the latest earlier change still
// open, unless one between them succeeded, whether those changes' index
// entries are folded into device_cmds or still staged in device_cmds_new
// (docs/reliability.md, bug 251).
func TestDesiredBackFromFoldedCommands(t *testing.T) {
	ctx := context.Background()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{})
	db.foldAt = 4
	require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "sim-1"}))
	_, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	volume := func(v string) companion.Command {
		t.Helper()
		c, _, err := db.CreateCommand(ctx, companion.Command{
			DeviceID: "d1", UserID: "u1", Op: companion.OpSettingsUpdate,
			Payload: json.RawMessage(`{"settings":{"volume":` + v + `}}`),
			Desired: map[string]json.RawMessage{"volume": json.RawMessage(v)},
		}, 0, nil)
		require.NoError(t, err)
		return c
	}
	end := func(id, state string) {
		t.Helper()
		_, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = state; return nil })
		require.NoError(t, err)
	}
	history := func() {
		t.Helper()
		for range 5 {
			c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text"}, 0, nil)
			require.NoError(t, err)
			end(c.ID, companion.StateSucceeded)
		}
	}
	wantVolume := func(want, what string) {
		t.Helper()
		s, err := db.Settings(ctx, "d1")
		require.NoError(t, err)
		require.Equal(t, want, string(s.Desired["volume"]), "desired volume after %s", what)
	}

	a := volume("3")
	end(a.ID, companion.StateDelivered)
	history()
	b := volume("5")
	history()
	c := volume("7")
	staged, folded := countDeviceIndex(t, db)
	require.NotZero(t, staged, "the test should leave some entries unfolded")
	require.NotZero(t, folded, "the test should fold some entries")

	end(c.ID, companion.StateCanceled)
	wantVolume("5", "C canceled: B's")
	end(b.ID, companion.StateFailed)
	wantVolume("3", "B failed: A's")
	end(a.ID, companion.StateFailed)
	wantVolume("", "A failed: none")

	// One that succeeded after the earlier one still open, folded too.
	d := volume("9")
	end(d.ID, companion.StateDelivered)
	history()
	e := volume("11")
	end(e.ID, companion.StateSucceeded)
	history()
	f := volume("13")
	end(f.ID, companion.StateFailed)
	wantVolume("", "F failed, E before it succeeded: none, not D's")
}
