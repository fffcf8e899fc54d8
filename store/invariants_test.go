package store

import (
	"bytes"
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

// TestOtherIndexesFollowTheRecords runs random sequences of what the
// service does to bindings, bridges, assignments, statuses, commands and
// the event log (bind and unbind, bridges made and deleted, devices
// assigned and moved, reports, Wills, the purges) and checks after each
// step that the indexes beside the commands' (user_bindings,
// bridge_serves, bridge_devices, user_events, owner_bridges) say what the
// records say, as TestIndexesFollowTheCommands does for the commands'.
func TestOtherIndexesFollowTheRecords(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { checkOtherIndexesUnderRandomWork(t, rand.New(rand.NewPCG(seed, 7))) })
	}
}

func checkOtherIndexesUnderRandomWork(t *testing.T, rnd *rand.Rand) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now, Logger: quietLogger()})
	db.foldAt = 5
	db.purgeBatch = 3
	devices := []string{"d1", "d2", "d3", "d4"}
	users := []string{"u1", "u2", "u3"}
	for _, u := range users {
		if err := db.CreateUser(ctx, companion.User{ID: u, TokenHash: []byte(u)}); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range devices {
		if err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: d, Model: "m"}); err != nil {
			t.Fatal(err)
		}
	}
	bridges := []string{"b1", "b2", "b3"}
	secret := 0
	mkBridge := func(id, owner string) {
		secret++
		_ = db.CreateBridge(ctx, companion.Bridge{ID: id, SecretHash: []byte(fmt.Sprint(secret)), OwnerID: owner})
	}
	var ids []string
	seq := uint64(0)
	for step := range 300 {
		dev := devices[rnd.IntN(len(devices))]
		user := users[rnd.IntN(len(users))]
		br := bridges[rnd.IntN(len(bridges))]
		what := ""
		switch op := rnd.IntN(15); op {
		case 0, 1:
			_, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: user})
			what = fmt.Sprint("bind ", dev, user, err)
		case 2:
			_, err := db.Unbind(ctx, dev, user)
			what = fmt.Sprint("unbind ", dev, user, err)
		case 3, 4:
			c := companion.Command{DeviceID: dev, UserID: user, Op: "x", ExpiresAt: clk.Now().Add(time.Minute * time.Duration(rnd.IntN(100)))}
			var idem *companion.Idempotency
			if rnd.IntN(2) == 0 {
				idem = &companion.Idempotency{UserID: user, Key: fmt.Sprint(rnd.IntN(5)), RequestHash: []byte{byte(rnd.IntN(2))}, Status: 202}
			}
			got, _, err := db.CreateCommand(ctx, c, 3, idem)
			if err == nil {
				ids = append(ids, got.ID)
			}
			what = fmt.Sprint("create ", err)
		case 5, 6:
			if len(ids) > 0 {
				id := ids[rnd.IntN(len(ids))]
				st := companion.States[1+rnd.IntN(len(companion.States)-1)]
				_, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = st; return nil })
				what = fmt.Sprint("update ", err)
			}
		case 7:
			seq++
			_, err := db.PutStatus(ctx, companion.Status{DeviceID: dev, Online: rnd.IntN(2) == 0, BridgeID: br, Seq: seq})
			what = fmt.Sprint("status ", err)
		case 8:
			_, err := db.MarkBridgeOffline(ctx, br)
			what = fmt.Sprint("offline ", err)
		case 9:
			owner := ""
			if rnd.IntN(2) == 0 {
				owner = user
			}
			mkBridge(br, owner)
			what = "mkbridge"
		case 10:
			_, err := db.DeleteBridge(ctx, br, "")
			what = fmt.Sprint("delbridge ", err)
		case 11:
			b := br
			if rnd.IntN(4) == 0 {
				b = ""
			}
			owner := ""
			if rnd.IntN(2) == 0 {
				owner = user
			}
			_, err := db.AssignDevice(ctx, dev, b, owner)
			what = fmt.Sprint("assign ", dev, b, owner, err)
		case 12:
			clk.Advance(time.Duration(rnd.IntN(90)) * time.Minute)
			_, err := db.PurgeEvents(ctx, clk.Now().Add(-2*time.Hour))
			what = fmt.Sprint("purge events ", err)
		case 13:
			clk.Advance(time.Duration(rnd.IntN(90)) * time.Minute)
			_, err := db.PurgeCommands(ctx, clk.Now().Add(-1*time.Hour))
			what = fmt.Sprint("purge commands ", err)
		case 14:
			clk.Advance(time.Duration(rnd.IntN(30)) * time.Hour)
			_, err := db.PurgeIdempotency(ctx, clk.Now().Add(-24*time.Hour))
			what = fmt.Sprint("purge idem ", err)
		}
		if err := indexesAgree(db); err != nil {
			t.Fatalf("step %d (%s): %v", step, what, err)
		}
		if err := otherIndexesAgree(db); err != nil {
			t.Fatalf("step %d (%s): %v", step, what, err)
		}
	}
}

// otherIndexesAgree reads the bindings, assignments, statuses, events and
// bridges of db and says where an index beside them differs.
func otherIndexesAgree(db *DB) error {
	return db.bolt.View(func(tx *bolt.Tx) error {
		// bindings <-> user_bindings
		n := 0
		err := tx.Bucket(bucketBindings).ForEach(func(k, v []byte) error {
			var b companion.Binding
			if err := fastjson.Unmarshal(v, &b); err != nil {
				return err
			}
			n++
			if got := tx.Bucket(bucketUserBindings).Get(key(b.UserID, string(k))); !bytes.Equal(got, v) {
				return fmt.Errorf("user_bindings of %s: %q want %q", k, got, v)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if m := tx.Bucket(bucketUserBindings).Stats().KeyN; m != n {
			return fmt.Errorf("user_bindings %d, bindings %d", m, n)
		}
		// assignments <-> bridge_serves, to existing bridges; user bridges serve their owner's devices
		n = 0
		err = tx.Bucket(bucketAssignments).ForEach(func(dev, br []byte) error {
			n++
			if tx.Bucket(bucketBridgeServes).Get(key(string(br), string(dev))) == nil {
				return fmt.Errorf("bridge_serves lacks %s/%s", br, dev)
			}
			var b companion.Bridge
			ok, err := getJSON(tx.Bucket(bucketBridges), br, &b)
			if err != nil || !ok {
				return fmt.Errorf("assignment %s to missing bridge %s", dev, br)
			}
			if b.OwnerID != "" {
				var bd companion.Binding
				ok, _ := getJSON(tx.Bucket(bucketBindings), dev, &bd)
				if !ok || bd.UserID != b.OwnerID {
					return fmt.Errorf("device %s on %s's bridge %s, bound to %q", dev, b.OwnerID, br, bd.UserID)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if m := tx.Bucket(bucketBridgeServes).Stats().KeyN; m != n {
			return fmt.Errorf("bridge_serves %d, assignments %d", m, n)
		}
		// status <-> bridge_devices
		n = 0
		err = tx.Bucket(bucketStatus).ForEach(func(dev, v []byte) error {
			var s companion.Status
			if err := fastjson.Unmarshal(v, &s); err != nil {
				return err
			}
			if s.BridgeID != "" {
				n++
				if tx.Bucket(bucketBridgeDevices).Get(key(s.BridgeID, string(dev))) == nil {
					return fmt.Errorf("bridge_devices lacks %s/%s", s.BridgeID, dev)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if m := tx.Bucket(bucketBridgeDevices).Stats().KeyN; m != n {
			return fmt.Errorf("bridge_devices %d, statuses with a bridge %d", m, n)
		}
		// events <-> user_events
		n = 0
		err = tx.Bucket(bucketEvents).ForEach(func(k, v []byte) error {
			var ev companion.Event
			if err := fastjson.Unmarshal(v, &ev); err != nil {
				return err
			}
			n++
			if tx.Bucket(bucketUserEvents).Get(append(prefix(ev.UserID), k...)) == nil {
				return fmt.Errorf("user_events lacks %s/%x", ev.UserID, k)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if m := tx.Bucket(bucketUserEvents).Stats().KeyN; m != n {
			return fmt.Errorf("user_events %d, events %d", m, n)
		}
		// owner_bridges
		n = 0
		err = tx.Bucket(bucketBridges).ForEach(func(k, v []byte) error {
			var b companion.Bridge
			if err := fastjson.Unmarshal(v, &b); err != nil {
				return err
			}
			if b.OwnerID != "" {
				n++
				if tx.Bucket(bucketOwnerBridges).Get(key(b.OwnerID, string(k))) == nil {
					return fmt.Errorf("owner_bridges lacks %s", k)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if m := tx.Bucket(bucketOwnerBridges).Stats().KeyN; m != n {
			return fmt.Errorf("owner_bridges %d, owned bridges %d", m, n)
		}
		return nil
	})
}
