package store

import (
	"context"
	"encoding/json"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// A schema 3 file, migrated to 4: each device is assigned to the bridge
// its last status named, if that bridge still exists, and each unfinished
// command's blob is read from its payload (finished ones need none).
func TestMigrateAssignsDevicesAndBlobs(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "db")
	db := openTestDBWith(t, path, Options{})
	provision(t, db, "sim-1", "d1", "d2", "d3", "d4")
	for _, dev := range []string{"d1", "d2"} { // newCmd's commands are u1's
		_, _, err := db.Bind(ctx, companion.Binding{DeviceID: dev, UserID: "u1"})
		mustNil(t, "Bind("+dev+")", err)
	}
	mustNil(t, "CreateBridge(b1)", db.CreateBridge(ctx, companion.Bridge{ID: "b1", SecretHash: hashOf("b1")}))
	mustNil(t, "CreateBridge(b2)", db.CreateBridge(ctx, companion.Bridge{ID: "b2", SecretHash: hashOf("b2")}))
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
		// The statuses schema 3 had, naming bridges that nothing assigned
		// (written here: the store now takes a bridge's status only for a
		// device it serves, docs/reliability.md, bug 271).
		for _, st := range []struct{ dev, bridge string }{{"d1", "b1"}, {"d2", "gone"}, {"d4", "b1"}, {"ghost", "b1"}} {
			if err := putJSON(tx.Bucket(bucketStatus), []byte(st.dev), companion.Status{DeviceID: st.dev, Online: true, BridgeID: st.bridge, Seq: 1}); err != nil {
				return err
			}
			if err := tx.Bucket(bucketBridgeDevices).Put(key(st.bridge, st.dev), nil); err != nil {
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
