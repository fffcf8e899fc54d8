package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// tenancy is a store with the devices and bridges of the assignment tests:
// the operator's bridges op1 and op2, u1's own bridge u1-hub and u2's
// u2-hub; d1 and d4 bound to u1, d2 to u2, d3 to nobody, none assigned.
func tenancy(t *testing.T) *DB {
	t.Helper()
	ctx := context.Background()
	db := openTestDB(t)
	provision(t, db, "sim-1", "d1", "d2", "d3", "d4")
	for _, b := range []companion.Bridge{
		{ID: "op1", SecretHash: hashOf("op1")},
		{ID: "op2", SecretHash: hashOf("op2")},
		{ID: "u1-hub", SecretHash: hashOf("u1-hub"), OwnerID: "u1"},
		{ID: "u2-hub", SecretHash: hashOf("u2-hub"), OwnerID: "u2"},
	} {
		mustNil(t, "CreateBridge("+b.ID+")", db.CreateBridge(ctx, b))
	}
	for dev, user := range map[string]string{"d1": "u1", "d4": "u1", "d2": "u2"} {
		if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: user}); err != nil {
			t.Fatalf("Bind(%s, %s) = %v", dev, user, err)
		}
	}
	return db
}

// wantBridge fails the test unless the device is served by bridge ("" none),
// as every lookup of the store tells it.
func wantBridge(t *testing.T, db *DB, dev, bridge string) {
	t.Helper()
	ctx := context.Background()
	got, err := db.DeviceBridge(ctx, dev)
	if err != nil || got != bridge {
		t.Errorf("DeviceBridge(%q) = %q, %v; want %q", dev, got, err, bridge)
	}
	if d, err := db.RegistryDevice(ctx, dev); err != nil || d.BridgeID != bridge {
		t.Errorf("RegistryDevice(%q).BridgeID = %q, %v; want %q", dev, d.BridgeID, err, bridge)
	}
	for _, b := range []string{"op1", "op2", "u1-hub", "u2-hub"} {
		serves, err := db.BridgeServes(ctx, b, dev)
		if err != nil || serves != (b == bridge) {
			t.Errorf("BridgeServes(%q, %q) = %v, %v; want %v", b, dev, serves, err, b == bridge)
		}
		served, err := db.ServedDevices(ctx, b)
		if err != nil || contains(served, dev) != (b == bridge) {
			t.Errorf("ServedDevices(%q) = %v, %v; want %q in it: %v", b, served, err, dev, b == bridge)
		}
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// AssignDevice's rules, step by step on one store: the operator assigns
// any device to any of the operator's bridges, and a user's device to that
// user's bridges only; a user assigns only their own devices, to their
// own bridges only (or to none). A refused assignment changes nothing, and
// not-owned reads as not found.
func TestAssignDevice(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	if !errors.Is(companion.ErrNotOwned, companion.ErrNotFound) {
		t.Fatal("ErrNotOwned is not an ErrNotFound: the API would tell them apart")
	}
	steps := []struct {
		name               string
		dev, bridge, owner string
		wantPrev           string
		wantErr            error
		wantBridge         string // the device's bridge after the step
	}{
		{name: "unknown device", dev: "ghost", bridge: "op1", wantErr: companion.ErrNotFound},
		{name: "unknown bridge", dev: "d1", bridge: "nope", wantErr: companion.ErrNotFound},
		{name: "invalid device id", dev: "d1\x00", bridge: "op1", wantErr: companion.ErrNotFound},
		{name: "invalid bridge id", dev: "d1", bridge: "op\x001", wantErr: companion.ErrNotFound},
		{name: "operator assigns", dev: "d1", bridge: "op1", wantBridge: "op1"},
		{name: "operator moves", dev: "d1", bridge: "op2", wantPrev: "op1", wantBridge: "op2"},
		{name: "same bridge again", dev: "d1", bridge: "op2", wantPrev: "op2", wantBridge: "op2"},
		{name: "user to own bridge", dev: "d1", bridge: "u1-hub", owner: "u1", wantPrev: "op2", wantBridge: "u1-hub"},
		{name: "user to another user's bridge", dev: "d1", bridge: "u2-hub", owner: "u1", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user to an operator's bridge", dev: "d1", bridge: "op1", owner: "u1", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user to unknown bridge", dev: "d1", bridge: "nope", owner: "u1", wantErr: companion.ErrNotFound, wantBridge: "u1-hub"},
		{name: "another user's device", dev: "d1", bridge: "u2-hub", owner: "u2", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "another user's device to none", dev: "d1", owner: "u2", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user, unbound device", dev: "d3", bridge: "u1-hub", owner: "u1", wantErr: companion.ErrNotOwned},
		{name: "operator, u2's device to u1's bridge", dev: "d2", bridge: "u1-hub", wantErr: companion.ErrNotOwned},
		{name: "operator, unbound device to u1's bridge", dev: "d3", bridge: "u1-hub", wantErr: companion.ErrNotOwned},
		{name: "operator, u2's device to u2's bridge", dev: "d2", bridge: "u2-hub", wantBridge: "u2-hub"},
		{name: "operator, unbound device to op1", dev: "d3", bridge: "op1", wantBridge: "op1"},
		{name: "user unassigns own device", dev: "d1", owner: "u1", wantPrev: "u1-hub"},
		{name: "unassign again", dev: "d1", owner: "u1"},
		{name: "operator unassigns", dev: "d3", wantPrev: "op1"},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			prev, err := db.AssignDevice(ctx, s.dev, s.bridge, s.owner)
			if !errors.Is(err, s.wantErr) || (s.wantErr == companion.ErrNotFound && errors.Is(err, companion.ErrNotOwned)) {
				t.Fatalf("AssignDevice(%q, %q, %q) = %q, %v; want error %v", s.dev, s.bridge, s.owner, prev, err, s.wantErr)
			}
			if err == nil && prev != s.wantPrev {
				t.Errorf("AssignDevice(%q, %q, %q) = %q; want previous %q", s.dev, s.bridge, s.owner, prev, s.wantPrev)
			}
			if s.dev != "ghost" && !strings.ContainsRune(s.dev, 0) {
				wantBridge(t, db, s.dev, s.wantBridge)
			}
		})
	}
}

// ProvisionDevice assigns to one of the operator's bridges only.
func TestProvisionDeviceOnABridge(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	mustNil(t, "ProvisionDevice(d5, op1)", db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d5", Model: "sim-1", BridgeID: "op1"}))
	wantBridge(t, db, "d5", "op1")
	for _, bridge := range []string{"nope", "u1-hub"} {
		err := db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d6", Model: "sim-1", BridgeID: bridge})
		wantErr(t, "ProvisionDevice(d6, "+bridge+")", err, companion.ErrNotFound)
		_, err = db.RegistryDevice(ctx, "d6")
		wantErr(t, "RegistryDevice(d6) after a refused provision", err, companion.ErrNotFound)
	}
}

// DeleteBridge removes the bridge, its secret and its assignments, and
// answers the devices it served; a user deletes only their own bridges.
func TestDeleteBridge(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	for _, a := range [][3]string{{"d1", "u1-hub", "u1"}, {"d4", "u1-hub", "u1"}, {"d2", "op1", ""}} {
		if _, err := db.AssignDevice(ctx, a[0], a[1], a[2]); err != nil {
			t.Fatalf("AssignDevice(%v) = %v", a, err)
		}
	}

	for _, c := range []struct{ bridge, owner string }{{"u1-hub", "u2"}, {"op1", "u1"}} {
		_, err := db.DeleteBridge(ctx, c.bridge, c.owner)
		wantErr(t, fmt.Sprintf("DeleteBridge(%q, %q)", c.bridge, c.owner), err, companion.ErrNotOwned)
	}
	_, err := db.DeleteBridge(ctx, "nope", "u1")
	wantErr(t, "DeleteBridge(nope)", err, companion.ErrNotFound)
	if errors.Is(err, companion.ErrNotOwned) {
		t.Errorf("DeleteBridge(nope) = %v; want a plain not found", err)
	}
	wantBridge(t, db, "d1", "u1-hub")

	served, err := db.DeleteBridge(ctx, "u1-hub", "u1")
	if err != nil || !reflect.DeepEqual(served, []string{"d1", "d4"}) {
		t.Fatalf("DeleteBridge(u1-hub, u1) = %v, %v; want [d1 d4]", served, err)
	}
	wantBridge(t, db, "d1", "")
	wantBridge(t, db, "d4", "")
	wantBridge(t, db, "d2", "op1")
	_, err = db.Bridge(ctx, "u1-hub")
	wantErr(t, "Bridge(u1-hub) after delete", err, companion.ErrNotFound)
	_, err = db.BridgeBySecretHash(ctx, hashOf("u1-hub"))
	wantErr(t, "BridgeBySecretHash(u1-hub's secret) after delete", err, companion.ErrNotFound)
	if bs, more, err := db.ListBridges(ctx, "u1", "", 0); err != nil || len(bs) != 0 || more {
		t.Errorf("ListBridges(u1) after delete = %v, %v, %v; want none", bs, more, err)
	}
	_, err = db.DeleteBridge(ctx, "u1-hub", "u1")
	wantErr(t, "DeleteBridge(u1-hub) again", err, companion.ErrNotFound)

	// The operator deletes any bridge, a user's too; the id is free again.
	served, err = db.DeleteBridge(ctx, "op1", "")
	if err != nil || !reflect.DeepEqual(served, []string{"d2"}) {
		t.Errorf("DeleteBridge(op1) = %v, %v; want [d2]", served, err)
	}
	if served, err := db.DeleteBridge(ctx, "u2-hub", ""); err != nil || len(served) != 0 {
		t.Errorf("DeleteBridge(u2-hub, operator) = %v, %v; want nothing served", served, err)
	}
	mustNil(t, "CreateBridge(u1-hub) again", db.CreateBridge(ctx, companion.Bridge{ID: "u1-hub", SecretHash: hashOf("new"), OwnerID: "u1"}))
	wantBridge(t, db, "d1", "")
}

// Bridges and users share the broker's usernames: a bridge cannot take a
// user's id.
func TestCreateBridgeNotAUsersID(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	mustNil(t, "CreateUser", db.CreateUser(ctx, companion.User{ID: "9c1f0d1e-user", Name: "alice", TokenHash: hashOf("tok")}))
	err := db.CreateBridge(ctx, companion.Bridge{ID: "9c1f0d1e-user", SecretHash: hashOf("s"), OwnerID: "u2"})
	wantErr(t, "CreateBridge(a user's id)", err, companion.ErrExists)
	if _, err := db.Bridge(ctx, "9c1f0d1e-user"); !errors.Is(err, companion.ErrNotFound) {
		t.Errorf("Bridge(a user's id) = %v; want not found", err)
	}
}

// ListBridges pages over one owner's bridges (or the operator's) in id
// order, in full pages, and says more follow exactly when they do, also
// when other owners' bridges sort among or after them.
func TestListBridges(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	owners := map[string]string{ // bridge id → owner ("" the operator)
		"a-op": "", "b-u1": "u1", "c-op": "", "d-u2": "u2", "e-u1": "u1",
		"f-op": "", "g-u1": "u1", "h-u2": "u2", "i-u1": "u1", "j-op": "", "k-u1": "u1", "z-u2": "u2",
	}
	want := map[string][]string{}
	for id, owner := range owners {
		mustNil(t, "CreateBridge("+id+")", db.CreateBridge(ctx, companion.Bridge{ID: id, SecretHash: hashOf(id), OwnerID: owner}))
	}
	for _, id := range []string{"a-op", "b-u1", "c-op", "d-u2", "e-u1", "f-op", "g-u1", "h-u2", "i-u1", "j-op", "k-u1", "z-u2"} {
		want[owners[id]] = append(want[owners[id]], id)
	}

	for owner, all := range want {
		for limit := 1; limit <= len(all)+1; limit++ {
			t.Run(fmt.Sprintf("owner %q limit %d", owner, limit), func(t *testing.T) {
				var got []string
				after := ""
				for page := 0; ; page++ {
					bs, more, err := db.ListBridges(ctx, owner, after, limit)
					if err != nil {
						t.Fatalf("ListBridges(%q, %q, %d) = %v", owner, after, limit, err)
					}
					rest := len(all) - len(got)
					if wantLen := min(limit, rest); len(bs) != wantLen {
						t.Fatalf("ListBridges(%q, %q, %d) gave %d bridges; want %d (a full page)", owner, after, limit, len(bs), wantLen)
					}
					if wantMore := rest > limit; more != wantMore {
						t.Fatalf("ListBridges(%q, %q, %d) more = %v; want %v (%d left)", owner, after, limit, more, wantMore, rest-len(bs))
					}
					for _, b := range bs {
						if b.OwnerID != owner {
							t.Fatalf("ListBridges(%q) gave %q of %q", owner, b.ID, b.OwnerID)
						}
						got = append(got, b.ID)
					}
					if !more {
						break
					}
					after = bs[len(bs)-1].ID
				}
				if !reflect.DeepEqual(got, all) {
					t.Errorf("ListBridges(%q) pages = %v; want %v", owner, got, all)
				}
			})
		}
		if bs, more, err := db.ListBridges(ctx, owner, "", 0); err != nil || more || len(bs) != len(all) {
			t.Errorf("ListBridges(%q, no limit) = %d bridges, more %v, %v; want %d, false", owner, len(bs), more, err, len(all))
		}
	}
	if bs, more, err := db.ListBridges(ctx, "u9", "", 10); err != nil || more || len(bs) != 0 {
		t.Errorf("ListBridges(u9) = %v, %v, %v; want none", bs, more, err)
	}
}

// BlobNeeded: a bridge may download a blob exactly while an unfinished
// command of a device it serves now references it.
func TestBlobNeeded(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	for _, a := range [][2]string{{"d1", "op1"}, {"d2", "op2"}} {
		if _, err := db.AssignDevice(ctx, a[0], a[1], ""); err != nil {
			t.Fatalf("AssignDevice(%v) = %v", a, err)
		}
	}
	shaA, shaB := strings.Repeat("a", 64), strings.Repeat("b", 64)
	withBlob := func(dev, sha string) companion.Command {
		c := newCmd(dev)
		c.Op, c.Payload, c.Blob = "push.image", raw(`{"blob":{"sha256":"`+sha+`"}}`), sha
		return create(t, db, c)
	}
	needed := func(sha, bridge string, want bool) {
		t.Helper()
		if got, err := db.BlobNeeded(ctx, sha, bridge); err != nil || got != want {
			t.Errorf("BlobNeeded(%.4s…, %q) = %v, %v; want %v", sha, bridge, got, err, want)
		}
	}

	a1, a2 := withBlob("d1", shaA), withBlob("d1", shaA)
	b3 := withBlob("d3", shaB) // d3: no bridge serves it
	create(t, db, newCmd("d2"))
	needed(shaA, "op1", true)
	needed(shaA, "op2", false) // another bridge's device
	needed(shaB, "op1", false)
	needed(shaB, "op2", false)
	needed(strings.Repeat("c", 64), "op1", false)
	needed(shaA, "nope", false)
	needed("", "op1", false)
	needed(shaA, "", false)

	if _, err := db.AssignDevice(ctx, "d3", "op2", ""); err != nil {
		t.Fatal(err)
	}
	needed(shaB, "op2", true)

	// While one command still needs it, the blob stays needed.
	setState(t, db, a1.ID, companion.StateSucceeded)
	needed(shaA, "op1", true)
	// Moving the device moves the right.
	if _, err := db.AssignDevice(ctx, "d1", "op2", ""); err != nil {
		t.Fatal(err)
	}
	needed(shaA, "op1", false)
	needed(shaA, "op2", true)
	for _, c := range []struct{ id, state string }{{a2.ID, companion.StateDelivered}, {a2.ID, companion.StateFailed}, {b3.ID, companion.StateExpired}} {
		setState(t, db, c.id, c.state)
	}
	needed(shaA, "op2", false)
	needed(shaB, "op2", false)
}

// Unbind takes a device off its user's own bridge (which serves only that
// user's devices), but not off one of the operator's.
func TestUnbindUnassignsFromTheUsersBridge(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	for _, a := range [][3]string{{"d1", "u1-hub", "u1"}, {"d4", "op1", ""}} {
		if _, err := db.AssignDevice(ctx, a[0], a[1], a[2]); err != nil {
			t.Fatalf("AssignDevice(%v) = %v", a, err)
		}
	}
	if got, err := db.Unbind(ctx, "d1", "u1"); err != nil || got != "u1-hub" {
		t.Errorf("Unbind(d1) = %q, %v; want u1-hub", got, err)
	}
	wantBridge(t, db, "d1", "")
	if got, err := db.Unbind(ctx, "d4", "u1"); err != nil || got != "" {
		t.Errorf("Unbind(d4) = %q, %v; want nothing unassigned", got, err)
	}
	wantBridge(t, db, "d4", "op1")

	// Bound to u2 now, d1 cannot go back on u1's bridge.
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u2"}); err != nil {
		t.Fatal(err)
	}
	_, err := db.AssignDevice(ctx, "d1", "u1-hub", "u1")
	wantErr(t, "AssignDevice(d1 of u2, u1-hub, u1)", err, companion.ErrNotOwned)
	_, err = db.AssignDevice(ctx, "d1", "u1-hub", "")
	wantErr(t, "AssignDevice(d1 of u2, u1-hub, operator)", err, companion.ErrNotOwned)
}

// A schema 3 file, migrated to 4: each device is assigned to the bridge
// its last status named, if that bridge still exists, and each unfinished
// command's blob is read from its payload (finished ones need none).
func TestMigrateAssignsDevicesAndBlobs(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "db")
	db := openTestDBWith(t, path, Options{})
	provision(t, db, "sim-1", "d1", "d2", "d3", "d4")
	mustNil(t, "CreateBridge(b1)", db.CreateBridge(ctx, companion.Bridge{ID: "b1", SecretHash: hashOf("b1")}))
	mustNil(t, "CreateBridge(b2)", db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: hashOf("b2")}))
	for dev, bridge := range map[string]string{"d1": "b1", "d2": "gone", "d4": "b2", "ghost": "b1"} {
		if _, err := db.PutStatus(ctx, companion.Status{DeviceID: dev, Online: true, BridgeID: bridge, Seq: 1}); err != nil {
			t.Fatalf("PutStatus(%s) = %v", dev, err)
		}
	}
	// A device whose last status named another bridge than its first.
	if _, err := db.PutStatus(ctx, companion.Status{DeviceID: "d4", Online: true, BridgeID: "b1", Seq: 2}); err != nil {
		t.Fatal(err)
	}
	shaOpen, shaDone := strings.Repeat("1", 64), strings.Repeat("2", 64)
	blobCmd := func(dev, sha string) companion.Command {
		c := newCmd(dev)
		c.Op, c.Payload = "push.image", raw(`{"content_type":"image/png","blob":{"sha256":"`+sha+`","size":3,"url":"/api/v1/blobs/`+sha+`"}}`)
		return create(t, db, c) // no Blob: schema 3 had none
	}
	open, done := blobCmd("d1", shaOpen), blobCmd("d1", shaDone)
	setState(t, db, done.ID, companion.StateSucceeded)
	text := create(t, db, newCmd("d2"))
	mustNil(t, "Close", db.Close())

	// Make it a schema 3 file: none of schema 4's buckets.
	raw3, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = raw3.Update(func(tx *bolt.Tx) error {
		for _, name := range [][]byte{bucketAssignments, bucketBridgeServes, bucketBlobRefs, bucketOwnerBridges} {
			if err := tx.DeleteBucket(name); err != nil {
				return err
			}
		}
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte("3"))
	})
	mustNil(t, "making a schema 3 file", err)
	mustNil(t, "Close", raw3.Close())

	db = openTestDBWith(t, path, Options{})
	wantBridgeOf := map[string]string{"d1": "b1", "d2": "", "d3": "", "d4": "b1", "ghost": ""}
	for dev, want := range wantBridgeOf {
		if got, err := db.DeviceBridge(ctx, dev); err != nil || got != want {
			t.Errorf("DeviceBridge(%q) after migration = %q, %v; want %q", dev, got, err, want)
		}
	}
	if got, err := db.ServedDevices(ctx, "b1"); err != nil || !reflect.DeepEqual(got, []string{"d1", "d4"}) {
		t.Errorf("ServedDevices(b1) after migration = %v, %v; want [d1 d4]", got, err)
	}
	if got, err := db.ServedDevices(ctx, "b2"); err != nil || len(got) != 0 {
		t.Errorf("ServedDevices(b2) after migration = %v, %v; want none", got, err)
	}
	for _, c := range []struct {
		sha  string
		want bool
	}{{shaOpen, true}, {shaDone, false}} {
		if got, err := db.BlobNeeded(ctx, c.sha, "b1"); err != nil || got != c.want {
			t.Errorf("BlobNeeded(%.4s…, b1) after migration = %v, %v; want %v", c.sha, got, err, c.want)
		}
	}
	for id, want := range map[string]string{open.ID: shaOpen, done.ID: "", text.ID: ""} {
		c, err := db.Command(ctx, id)
		if err != nil || c.Blob != want {
			t.Errorf("Command(%s).Blob after migration = %q, %v; want %q", id, c.Blob, err, want)
		}
		var p json.RawMessage
		if err := json.Unmarshal(c.Payload, &p); err != nil {
			t.Errorf("Command(%s).Payload after migration = %s: %v", id, c.Payload, err)
		}
	}
	// The command's end releases the blob, as for one made under schema 4.
	setState(t, db, open.ID, companion.StateSucceeded)
	if got, _ := db.BlobNeeded(ctx, shaOpen, "b1"); got {
		t.Error("BlobNeeded after the migrated command finished = true")
	}
}

// A device no bridge serves any more reads offline (CONTRACT §9), whichever
// way it lost its bridge: unassigned, its bridge deleted, or unbound from
// its user's own bridge. Its Seq stays, so the next report applies. A
// device moved to another bridge keeps its status until that one reports.
func TestADeviceWithoutABridgeReadsOffline(t *testing.T) {
	ctx := context.Background()
	db := tenancy(t)
	for _, a := range [][3]string{{"d1", "op1", ""}, {"d2", "op2", ""}, {"d3", "op2", ""}, {"d4", "u1-hub", "u1"}} {
		if _, err := db.AssignDevice(ctx, a[0], a[1], a[2]); err != nil {
			t.Fatalf("AssignDevice(%v) = %v", a, err)
		}
		if _, err := db.PutStatus(ctx, companion.Status{DeviceID: a[0], Online: true, BridgeID: a[1], Seq: 7}); err != nil {
			t.Fatal(err)
		}
	}
	online := func(dev string, want bool) {
		t.Helper()
		s, err := db.Status(ctx, dev)
		if err != nil || s.Online != want || s.Seq != 7 {
			t.Errorf("Status(%q) = online %v, seq %d, %v; want online %v, seq 7", dev, s.Online, s.Seq, err, want)
		}
	}

	if _, err := db.AssignDevice(ctx, "d1", "op2", ""); err != nil {
		t.Fatal(err)
	}
	online("d1", true)
	if _, err := db.AssignDevice(ctx, "d1", "", ""); err != nil {
		t.Fatal(err)
	}
	online("d1", false)
	if _, err := db.DeleteBridge(ctx, "op2", ""); err != nil {
		t.Fatal(err)
	}
	online("d2", false)
	online("d3", false)
	if _, err := db.Unbind(ctx, "d4", "u1"); err != nil {
		t.Fatal(err)
	}
	online("d4", false)
	if ok, err := db.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op1", Seq: 8}); err != nil || !ok {
		t.Errorf("PutStatus(d1, seq 8) after the unassignment = %v, %v; want applied", ok, err)
	}
}
