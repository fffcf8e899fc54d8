package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

func TestQueuedAndExpiryIndexes(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now, Logger: quietLogger()})
	mk := func(ttl time.Duration) companion.Command {
		t.Helper()
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text", ExpiresAt: clk.Now().Add(ttl)}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	set := func(id, state string) {
		t.Helper()
		if _, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = state; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	a, b, c := mk(time.Minute), mk(2*time.Minute), mk(time.Hour)

	q, _ := db.OpenCommands(ctx, companion.StateQueued)
	if got := ids(q); len(got) != 3 || got[0] != a.ID || got[2] != c.ID {
		t.Fatalf("queued = %v; want a, b, c in order", got)
	}
	set(a.ID, companion.StateSent)
	set(b.ID, companion.StateDelivered)
	q, _ = db.OpenCommands(ctx, companion.StateQueued)
	if got := ids(q); len(got) != 1 || got[0] != c.ID {
		t.Fatalf("queued after a sent, b delivered = %v; want c", got)
	}

	exp, _ := db.ExpiredCommands(ctx, clk.Now().Add(90*time.Second))
	if got := ids(exp); len(got) != 1 || got[0] != a.ID {
		t.Fatalf("expired at +90s = %v; want a (b is delivered: the bridge has it)", got)
	}
	exp, _ = db.ExpiredCommands(ctx, clk.Now().Add(2*time.Hour))
	if got := ids(exp); len(got) != 2 || got[0] != a.ID || got[1] != c.ID {
		t.Fatalf("expired at +2h = %v; want a, c soonest first", got)
	}
	set(a.ID, companion.StateExpired)
	set(c.ID, companion.StateCanceled)
	exp, _ = db.ExpiredCommands(ctx, clk.Now().Add(2*time.Hour))
	if len(exp) != 0 {
		t.Fatalf("expired after a and c went final = %v; want none", ids(exp))
	}
	// Nothing left behind in the index buckets.
	db.bolt.View(func(tx *bolt.Tx) error {
		if n := tx.Bucket(bucketQueued).Stats().KeyN; n != 0 {
			t.Errorf("queued index holds %d keys; want 0", n)
		}
		if n := tx.Bucket(bucketExpiry).Stats().KeyN; n != 0 {
			t.Errorf("expiry index holds %d keys; want 0", n)
		}
		return nil
	})
}

// A file of schema version 1 gets its indexes built from its commands.
func TestMigrateBuildsIndexes(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	path := filepath.Join(t.TempDir(), "db")
	db, err := Open(path, Options{Now: clk.Now, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	q, _, _ := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text", ExpiresAt: clk.Now().Add(time.Minute)}, 0, nil)
	s, _, _ := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text", ExpiresAt: clk.Now().Add(time.Minute)}, 0, nil)
	db.UpdateCommand(ctx, s.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil })
	db.Close()

	// Make it a version 1 file: no index buckets.
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	raw.Update(func(tx *bolt.Tx) error {
		tx.DeleteBucket(bucketQueued)
		tx.DeleteBucket(bucketExpiry)
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte("1"))
	})
	raw.Close()

	db = openTestDBWith(t, path, Options{Now: clk.Now})
	queued, err := db.OpenCommands(ctx, companion.StateQueued)
	if err != nil || len(queued) != 1 || queued[0].ID != q.ID {
		t.Fatalf("queued after migration = %v, %v; want %s", ids(queued), err, q.ID)
	}
	exp, _ := db.ExpiredCommands(ctx, clk.Now().Add(time.Hour))
	if len(exp) != 2 {
		t.Fatalf("expired after migration = %v; want both", ids(exp))
	}
}

// A schema 2 file counted a device's open commands in device_open; the
// migration to 3 counts them into open_count and drops device_open.
func TestMigrateCountsOpenCommands(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	path := filepath.Join(t.TempDir(), "db")
	db, err := Open(path, Options{Now: clk.Now, Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for range 3 {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text", ExpiresAt: clk.Now().Add(time.Minute)}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, c.ID)
	}
	db.UpdateCommand(ctx, ids[0], func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
	db.Close()

	// Make it a version 2 file: device_open, no open_count.
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	raw.Update(func(tx *bolt.Tx) error {
		tx.DeleteBucket(bucketOpenCount)
		b, _ := tx.CreateBucket(bucketDeviceOpen)
		for _, id := range ids[1:] {
			b.Put(key("d", id), nil)
		}
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte("2"))
	})
	raw.Close()

	db = openTestDBWith(t, path, Options{Now: clk.Now})
	if n, err := db.CountOpen(ctx, "d"); err != nil || n != 2 {
		t.Fatalf("CountOpen after migration = %d, %v; want 2", n, err)
	}
	db.bolt.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketDeviceOpen) != nil {
			t.Errorf("device_open is still there")
		}
		return nil
	})
	// The limit counts what the migration counted.
	if _, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text"}, 2, nil); !errors.Is(err, companion.ErrQueueFull) {
		t.Errorf("CreateCommand past the limit = %v; want ErrQueueFull", err)
	}
	for _, id := range ids[1:] {
		db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = companion.StateFailed; return nil })
	}
	if n, _ := db.CountOpen(ctx, "d"); n != 0 {
		t.Errorf("CountOpen once all are final = %d; want 0", n)
	}
}

// A schema 5 file kept nothing in user_bindings but the keys; the migration
// to 6 copies each binding there, in batches, and drops entries whose
// binding is gone or is another user's. Lists read the copies.
func TestMigrateCopiesBindingsIntoTheUserIndex(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "db")
	db, err := Open(path, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	const n = 2500 // more than one batch of the migration
	var devs []companion.RegistryDevice
	for i := range n {
		devs = append(devs, companion.RegistryDevice{ID: fmt.Sprintf("dev-%05d", i), Model: "m"})
	}
	if err := db.ProvisionDevices(devs); err != nil {
		t.Fatal(err)
	}
	for i, d := range devs {
		user := []string{"u1", "u2"}[i%2]
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: d.ID, UserID: user, Name: "n" + d.ID}); err != nil {
			t.Fatal(err)
		}
	}
	db.Close()

	// Make it a version 5 file: empty values, plus two stale entries.
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = raw.Update(func(tx *bolt.Tx) error {
		idx := tx.Bucket(bucketUserBindings)
		var keys [][]byte
		idx.ForEach(func(k, _ []byte) error { keys = append(keys, bytes.Clone(k)); return nil })
		for _, k := range keys {
			if err := idx.Put(k, nil); err != nil {
				return err
			}
		}
		idx.Put(key("u1", "dev-gone"), nil)  // no binding
		idx.Put(key("u1", "dev-00001"), nil) // bound to u2
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte("5"))
	})
	raw.Close()
	if err != nil {
		t.Fatal(err)
	}

	db = openTestDBWith(t, path, Options{})
	for u, parity := range map[string]int{"u1": 0, "u2": 1} {
		got, err := db.ListDevices(ctx, u, "", 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != n/2 {
			t.Fatalf("%s lists %d devices after migration; want %d", u, len(got), n/2)
		}
		for j, d := range got {
			want := fmt.Sprintf("dev-%05d", 2*j+parity)
			if b := d.Binding; b.DeviceID != want || b.UserID != u || b.Name != "n"+want || b.Model != "m" {
				t.Fatalf("%s's device %d = %+v; want %s bound to %s", u, j, d.Binding, want, u)
			}
		}
	}
	db.bolt.View(func(tx *bolt.Tx) error {
		idx := tx.Bucket(bucketUserBindings)
		if n := idx.Stats().KeyN; n != 2500 {
			t.Errorf("user_bindings holds %d keys; want the 2500 bindings alone", n)
		}
		return idx.ForEach(func(k, v []byte) error {
			if !bytes.Equal(v, tx.Bucket(bucketBindings).Get(k[bytes.IndexByte(k, 0)+1:])) {
				t.Errorf("user_bindings %q = %q; want its binding", k, v)
			}
			return nil
		})
	})
}
