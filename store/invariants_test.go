package store

import (
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// TestIndexesFollowTheCommands runs random sequences of what the service
// does to commands (accept, move through states, cancel, expire, unbind
// and bind again, purge, fold) and checks after each step that every
// index of the bbolt file says exactly what the commands say.
func TestIndexesFollowTheCommands(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			checkIndexesUnderRandomWork(t, rand.New(rand.NewPCG(seed, 42)))
		})
	}
}

func checkIndexesUnderRandomWork(t *testing.T, rnd *rand.Rand) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now, Logger: quietLogger()})
	db.foldAt = 5
	devices := []string{"d1", "d2", "d3"}
	owner := map[string]string{}
	for i, dev := range devices {
		if err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "sim-1"}); err != nil {
			t.Fatal(err)
		}
		owner[dev] = fmt.Sprint("u", i%2)
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: owner[dev]}); err != nil {
			t.Fatal(err)
		}
	}
	var ids []string
	for step := range 300 {
		dev := devices[rnd.IntN(len(devices))]
		var what string
		switch op := rnd.IntN(20); {
		case op < 8 || len(ids) == 0:
			c := companion.Command{DeviceID: dev, UserID: owner[dev], Op: "push.text", ExpiresAt: clk.Now().Add(time.Duration(1+rnd.IntN(60)) * time.Minute)}
			if rnd.IntN(3) == 0 {
				c.Op, c.Blob = "push.image", strings.Repeat(string(rune('a'+rnd.IntN(3))), 64)
			}
			got, _, err := db.CreateCommand(ctx, c, 0, nil)
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, got.ID)
			what = "create " + got.ID
		case op < 16:
			id := ids[rnd.IntN(len(ids))]
			state := companion.States[1+rnd.IntN(len(companion.States)-1)]
			_, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error {
				c.State = state
				if rnd.IntN(4) == 0 {
					c.ExpiresAt = c.ExpiresAt.Add(time.Minute)
				}
				if rnd.IntN(6) == 0 { // fn may change the blob too
					c.Blob = strings.Repeat(string(rune('a'+rnd.IntN(3))), 64*rnd.IntN(2))
				}
				return nil
			})
			if err != nil && err != companion.ErrFinal {
				if _, ferr := db.Command(ctx, id); ferr == nil {
					t.Fatalf("update %s: %v", id, err)
				}
			}
			what = "update " + id + " to " + state
		case op < 18:
			if _, err := db.Unbind(ctx, dev, owner[dev]); err != nil {
				t.Fatal(err)
			}
			left, _, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: dev, UserID: owner[dev]})
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range left {
				if !companion.IsFinal(c.State) {
					t.Fatalf("step %d: %s of %s is %s after %s unbound it", step, c.ID, dev, c.State, owner[dev])
				}
			}
			owner[dev] = fmt.Sprint("u", 2+step)
			if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: owner[dev]}); err != nil {
				t.Fatal(err)
			}
			what = "unbind " + dev
		default:
			clk.Advance(time.Duration(rnd.IntN(30)) * time.Minute)
			if _, err := db.PurgeCommands(ctx, clk.Now().Add(-10*time.Minute)); err != nil {
				t.Fatal(err)
			}
			what = "purge"
		}
		if err := indexesAgree(db); err != nil {
			t.Fatalf("step %d (%s): %v", step, what, err)
		}
	}
}

// indexesAgree reads every command and every index of db and says where
// they differ.
func indexesAgree(db *DB) error {
	return db.bolt.View(func(tx *bolt.Tx) error {
		want := map[string]map[string]bool{} // bucket → keys the commands call for
		for _, b := range []string{"open", "queued", "expiry", "blob_refs", "device_cmds"} {
			want[b] = map[string]bool{}
		}
		open := map[string]uint64{}
		err := tx.Bucket(bucketCommands).ForEach(func(k, v []byte) error {
			var c companion.Command
			if err := fastjson.Unmarshal(v, &c); err != nil {
				return err
			}
			want["device_cmds"][string(key(c.DeviceID, c.ID))] = true
			if companion.IsFinal(c.State) {
				return nil
			}
			open[c.DeviceID]++
			want["open"][c.ID] = true
			if c.State == companion.StateQueued {
				want["queued"][c.ID] = true
			}
			if expiring(c.State) {
				want["expiry"][string(expiryKey(c))] = true
			}
			if c.Blob != "" {
				want["blob_refs"][string(key(c.Blob, c.ID))] = true
			}
			return nil
		})
		if err != nil {
			return err
		}
		for name, keys := range want {
			got := map[string]bool{}
			b := tx.Bucket([]byte(name))
			if err := b.ForEach(func(k, _ []byte) error { got[string(k)] = true; return nil }); err != nil {
				return err
			}
			if name == "device_cmds" { // and those still staged
				err := tx.Bucket(bucketDeviceCmdsNew).ForEach(func(id, dev []byte) error {
					got[string(key(string(dev), string(id)))] = true
					return nil
				})
				if err != nil {
					return err
				}
			}
			for k := range keys {
				if !got[k] {
					return fmt.Errorf("%s lacks %q", name, k)
				}
			}
			for k := range got {
				if !keys[k] {
					return fmt.Errorf("%s has %q, which no command calls for", name, k)
				}
			}
		}
		counted := map[string]uint64{}
		err = tx.Bucket(bucketOpenCount).ForEach(func(dev, v []byte) error {
			counted[string(dev)] = binary.BigEndian.Uint64(v)
			if counted[string(dev)] == 0 {
				return fmt.Errorf("open_count keeps a 0 for %s", dev)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, dev := range slices.Concat(slices.Collect(maps.Keys(open)), slices.Collect(maps.Keys(counted))) {
			if counted[dev] != open[dev] {
				return fmt.Errorf("open_count of %s is %d; %d of its commands are open", dev, counted[dev], open[dev])
			}
		}
		return nil
	})
}
