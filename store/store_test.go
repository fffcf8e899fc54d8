package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
}

// Now returns the clock's time.
func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock forward by d.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// quietLogger drops every log line.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// openTestDB opens a store in a fresh temp dir, closed at cleanup.
func openTestDB(tb testing.TB) *DB {
	tb.Helper()
	return openTestDBWith(tb, filepath.Join(tb.TempDir(), "data", "companion.db"), Options{})
}

// openTestDBWith opens a store at path with opts, closed at cleanup.
func openTestDBWith(tb testing.TB, path string, opts Options) *DB {
	tb.Helper()
	if opts.Logger == nil {
		opts.Logger = quietLogger()
	}
	db, err := Open(path, opts)
	if err != nil {
		tb.Fatalf("Open(%q) = %v", path, err)
	}
	tb.Cleanup(func() { _ = db.Close() })
	return db
}

// reopen closes db and opens its file again with opts.
func reopen(tb testing.TB, db *DB, opts Options) *DB {
	tb.Helper()
	if err := db.Close(); err != nil {
		tb.Fatalf("Close() = %v", err)
	}
	return openTestDBWith(tb, db.Path(), opts)
}

// wantErr fails the test unless errors.Is(err, want); want nil means no
// error.
func wantErr(tb testing.TB, what string, err, want error) {
	tb.Helper()
	if want == nil && err != nil {
		tb.Fatalf("%s = %v; want no error", what, err)
	}
	if !errors.Is(err, want) {
		tb.Fatalf("%s = %v; want %v", what, err, want)
	}
}

func TestOpenCreatesFilesAndSchema(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	path := filepath.Join(dir, "companion.db")
	db := openTestDBWith(t, path, Options{})
	if db.Path() != path {
		t.Errorf("Path() = %q; want %q", db.Path(), path)
	}
	if db.BlobDir() != filepath.Join(dir, "blobs") {
		t.Errorf("BlobDir() = %q; want %q", db.BlobDir(), filepath.Join(dir, "blobs"))
	}
	for _, c := range []struct {
		path string
		mode os.FileMode
	}{
		{dir, 0o700 | os.ModeDir},
		{path, 0o600},
		{filepath.Join(dir, "blobs"), 0o700 | os.ModeDir},
	} {
		fi, err := os.Stat(c.path)
		if err != nil {
			t.Fatalf("Stat(%q) = %v", c.path, err)
		}
		if fi.Mode() != c.mode {
			t.Errorf("mode of %q = %v; want %v", c.path, fi.Mode(), c.mode)
		}
	}
	if err := db.bolt.View(func(tx *bolt.Tx) error {
		for _, name := range append(slices.Clip(allBuckets), bucketQueued, bucketExpiry, bucketOpenCount) {
			if tx.Bucket(name) == nil && !bytes.Equal(name, bucketDeviceOpen) {
				t.Errorf("bucket %q missing", name)
			}
		}
		if tx.Bucket(bucketDeviceOpen) != nil {
			t.Errorf("bucket %q is still there after schema 3", bucketDeviceOpen)
		}
		v, err := schemaVersion(tx)
		if err != nil || v != SchemaVersion {
			t.Errorf("schemaVersion() = %d, %v; want %d", v, err, SchemaVersion)
		}
		if got := string(tx.Bucket(bucketMeta).Get(keySchemaVersion)); got != strconv.Itoa(SchemaVersion) {
			t.Errorf("meta/schema_version = %q; want %d", got, SchemaVersion)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func TestOpenSchemaTooNew(t *testing.T) {
	db := openTestDB(t)
	path := db.Path()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte(strconv.Itoa(SchemaVersion+1)))
	}); err != nil {
		t.Fatal(err)
	}
	if err := raw.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = Open(path, Options{Logger: quietLogger()})
	wantErr(t, "Open(newer file)", err, companion.ErrSchemaTooNew)

	// The refusal released the lock: an older-schema rewrite opens again.
	raw, err = bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatalf("bolt.Open after refusal = %v", err)
	}
	_ = raw.Close()
}

func TestOpenMigratesFromVersionZero(t *testing.T) {
	// A bbolt file with no buckets at all, as an older build might leave.
	path := filepath.Join(t.TempDir(), "old.db")
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucket(bucketUsers)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	_ = raw.Close()

	db := openTestDBWith(t, path, Options{})
	if err := db.CreateUser(context.Background(), companion.User{ID: "u1", TokenHash: []byte("h")}); err != nil {
		t.Fatalf("CreateUser after migration = %v", err)
	}
}

func TestOpenLockTimeout(t *testing.T) {
	db := openTestDB(t)
	start := time.Now()
	_, err := Open(db.Path(), Options{Timeout: 100 * time.Millisecond, Logger: quietLogger()})
	wantErr(t, "second Open", err, berrors.ErrTimeout)
	if err != nil && !strings.Contains(err.Error(), "another process holds it") {
		t.Errorf("second Open = %v; want it to say another process holds the file", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("second Open took %v", d)
	}
}

func TestOpenRemovesStaleTemps(t *testing.T) {
	db := openTestDB(t)
	stale := filepath.Join(db.BlobDir(), ".tmp-123")
	if err := os.WriteFile(stale, []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	reopen(t, db, Options{})
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Stat(stale temp) = %v; want not exist", err)
	}
}

func TestOpenEmptyPath(t *testing.T) {
	_, err := Open("", Options{})
	wantErr(t, "Open(\"\")", err, companion.ErrInvalid)
}

func TestClosedDB(t *testing.T) {
	db := openTestDB(t)
	_ = db.Close()
	if _, err := db.User(context.Background(), "u"); err == nil || !strings.Contains(err.Error(), "not open") {
		t.Errorf("User after Close = %v; want database not open", err)
	}
}

// TestReopenKeepsEverything writes one of each kind of record, closes the
// store, opens it again and reads them all back.
func TestReopenKeepsEverything(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	dir := t.TempDir()
	db := openTestDBWith(t, filepath.Join(dir, "companion.db"), Options{Now: clock.Now})

	mustNil(t, "CreateUser", db.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: []byte("tok")}))
	mustNil(t, "CreateBridge", db.CreateBridge(ctx, companion.Bridge{ID: "br1", SecretHash: []byte("sec")}))
	mustNil(t, "ProvisionDevice", db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "sim-1", ClaimHash: []byte("claim")}))
	if _, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1", Name: "desk"}); err != nil {
		t.Fatal(err)
	}
	if _, err := db.AssignDevice(ctx, "d1", "br1", ""); err != nil { // its status names br1 (bug 271)
		t.Fatal(err)
	}
	cmd, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", Payload: []byte(`{"text":"hi"}`)}, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "br1", Seq: 1}); err != nil {
		t.Fatal(err)
	}
	mustNil(t, "PutFirmware", db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: "1.0.0", SHA256: "aa", Size: 1}))
	mustNil(t, "PutAppRelease", db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: "bb", Size: 2}))
	blob, err := db.PutBlob(ctx, strings.NewReader("hello"), 0)
	if err != nil {
		t.Fatal(err)
	}

	db = reopen(t, db, Options{Now: clock.Now})

	if u, err := db.UserByTokenHash(ctx, []byte("tok")); err != nil || u.Name != "Ann" {
		t.Errorf("UserByTokenHash after reopen = %+v, %v", u, err)
	}
	if b, err := db.BridgeBySecretHash(ctx, []byte("sec")); err != nil || b.ID != "br1" {
		t.Errorf("BridgeBySecretHash after reopen = %+v, %v", b, err)
	}
	if d, err := db.RegistryDevice(ctx, "d1"); err != nil || d.Model != "sim-1" {
		t.Errorf("RegistryDevice after reopen = %+v, %v", d, err)
	}
	if bs, err := db.ListBindings(ctx, "u1", "", 10); err != nil || len(bs) != 1 || bs[0].Name != "desk" {
		t.Errorf("ListBindings after reopen = %+v, %v", bs, err)
	}
	if c, err := db.Command(ctx, cmd.ID); err != nil || string(c.Payload) != `{"text":"hi"}` || c.State != companion.StateQueued {
		t.Errorf("Command after reopen = %+v, %v", c, err)
	}
	if n, err := db.CountOpen(ctx, "d1"); err != nil || n != 1 {
		t.Errorf("CountOpen after reopen = %d, %v; want 1", n, err)
	}
	if s, err := db.Status(ctx, "d1"); err != nil || !s.Online || s.Seq != 1 {
		t.Errorf("Status after reopen = %+v, %v", s, err)
	}
	if f, err := db.Firmware(ctx, "sim-1", "1.0.0"); err != nil || f.SHA256 != "aa" {
		t.Errorf("Firmware after reopen = %+v, %v", f, err)
	}
	if a, _, err := db.AppCatalog(ctx, "", 0); err != nil || len(a) != 1 || a[0].Latest.SHA256 != "bb" {
		t.Errorf("AppCatalog after reopen = %+v, %v", a, err)
	}
	f, b, err := db.OpenBlob(ctx, blob.SHA256)
	if err != nil {
		t.Fatalf("OpenBlob after reopen = %v", err)
	}
	defer f.Close()
	got, _ := io.ReadAll(f)
	if string(got) != "hello" || b.Size != 5 {
		t.Errorf("blob after reopen = %q (%+v); want \"hello\"", got, b)
	}
}

// mustNil fails the test when err is not nil.
func mustNil(tb testing.TB, what string, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatalf("%s = %v", what, err)
	}
}

func raw(s string) json.RawMessage { return json.RawMessage(s) }

func provision(tb testing.TB, db *DB, model string, ids ...string) {
	tb.Helper()
	for _, id := range ids {
		mustNil(tb, "ProvisionDevice("+id+")", db.ProvisionDevice(context.Background(), companion.RegistryDevice{ID: id, Model: model, ClaimHash: hashOf(id)}))
	}
}

// A store growing by tens of megabytes commits while a read transaction
// stays open: its file is mapped with room to grow (MmapReserve), so no
// commit waits for readers to let bbolt map it again.
func TestGrowingStoreDoesNotWaitForReaders(t *testing.T) {
	db := openTestDB(t)
	ctx := context.Background()
	release := make(chan struct{})
	reading := make(chan struct{})
	readDone := make(chan error, 1)
	go func() {
		readDone <- db.bolt.View(func(*bolt.Tx) error {
			close(reading)
			<-release
			return nil
		})
	}()
	<-reading
	payload := json.RawMessage(`{"text":"` + strings.Repeat("x", 32<<10) + `"}`)
	wrote := make(chan error, 1)
	go func() {
		for i := range 1000 { // about 33 MB
			_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: fmt.Sprintf("d%d", i%50), Op: "push.text",
				Payload: payload, ExpiresAt: time.Now().Add(time.Hour)}, 0, nil)
			if err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()
	select {
	case err := <-wrote:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		close(release)
		t.Fatal("commits waited for an open read transaction while the file grew")
	}
	close(release)
	require.NoError(t, <-readDone)
	st, err := os.Stat(db.Path())
	require.NoError(t, err)
	assert.Greater(t, st.Size(), int64(32<<20), "the file grew past 32 MB")
}
