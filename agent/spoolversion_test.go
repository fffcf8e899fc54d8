package agent

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// TestSpoolOfANewerBridgeRefused opens a spool a newer bridge wrote (its
// version past this build's): the bridge must refuse it, say so and what
// to do, and leave the file as it was, rather than start on a layout it
// may not read, as a bridge from before 8a6c356 started on a newer spool
// and ran none of the commands it held (docs/operations.md, Upgrading).
// A spool of this build's version, or of none (one from before the
// version), opens, and then has this build's version.
func TestSpoolOfANewerBridgeRefused(t *testing.T) {
	path := spoolOnDisk(t)
	dir := filepath.Dir(path)
	s, err := openSpool(dir)
	if err != nil {
		t.Fatalf("openSpool: %v", err)
	}
	s.close()
	if v := spoolFileVersion(t, path); v != spoolVersion {
		t.Errorf("a spool opened by this build has version %q; want %q", v, spoolVersion)
	}

	setSpoolVersion(t, path, "99")
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err = openSpool(dir)
	if err == nil {
		s.close()
		t.Fatalf("openSpool of a spool of version 99 = nil error; want a refusal")
	}
	if n := strings.Count(err.Error(), path); n != 1 {
		t.Errorf("openSpool of a spool of version 99 = %q; want it to name the file once, not %d times", err, n)
	}
	for _, want := range []string{"newer bridge", "version 99", "this build knows " + spoolVersion} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("openSpool of a spool of version 99 = %q; want it to say %q", err, want)
		}
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Errorf("the refused spool was changed")
	}
}

// spoolFileVersion reads the version stored in the spool file at path.
func spoolFileVersion(t *testing.T, path string) string {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var v string
	_ = db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket([]byte("meta")); b != nil {
			v = string(b.Get([]byte("version")))
		}
		return nil
	})
	return v
}

// setSpoolVersion stores version in the spool file at path, as a bridge
// of that version would.
func setSpoolVersion(t *testing.T, path, version string) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists([]byte("meta"))
		if err != nil {
			return err
		}
		return b.Put([]byte("version"), []byte(version))
	}); err != nil {
		t.Fatal(err)
	}
}
