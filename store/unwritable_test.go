package store

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"

	bolt "go.etcd.io/bbolt"
)

// TestWritesWhileTheDiskIsFull fills the store's file up to a file size
// limit with concurrent commands: each is stored, or fails ErrUnwritable
// and is not; a blob that does not fit fails ErrUnwritable and leaves no
// file. Once the limit is lifted, commands and blobs are stored again,
// without a reopen, and after one every command stored is there once and
// none that failed.
func TestWritesWhileTheDiskIsFull(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openTestDB(t)
	ctx := context.Background()
	payload := []byte(`"` + strings.Repeat("x", 4000) + `"`)
	create := func() (string, error) {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued", Payload: payload}, 0, nil)
		return c.ID, err
	}
	var stored []string
	for range 20 {
		id, err := create()
		if err != nil {
			t.Fatal(err)
		}
		stored = append(stored, id)
	}
	var used int64
	_ = db.bolt.View(func(tx *bolt.Tx) error { used = tx.Size(); return nil })

	// Past the pages in use, not the file's end: bbolt and the store's
	// zeros have grown the file ahead, and pages written there fail.
	lift := testenv.LimitFileSize(t, used+256<<10)
	failed := 0
	for round := 0; failed < 50 && round < 200; round++ {
		var (
			wg sync.WaitGroup
			mu sync.Mutex
		)
		for range 8 {
			wg.Go(func() {
				id, err := create()
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					stored = append(stored, id)
				case errors.Is(err, ErrUnwritable):
					failed++
				default:
					t.Errorf("CreateCommand(disk full) = %v; want ErrUnwritable", err)
				}
			})
		}
		wg.Wait()
	}
	if failed == 0 {
		t.Fatalf("no command failed past the limit (%d stored)", len(stored))
	}
	blob := bytes.Repeat([]byte("b"), 1<<20)
	if _, err := db.PutBlob(ctx, bytes.NewReader(blob), 0); !errors.Is(err, ErrUnwritable) {
		// The blob's own file is past the limit from its first megabyte:
		// 256 KiB plus the pages in use.
		t.Errorf("PutBlob(disk full) = %v; want ErrUnwritable", err)
	}
	if files := blobFiles(t, db.BlobDir()); len(files) > 0 {
		t.Errorf("a blob that did not fit left %q", files)
	}

	lift()
	awaitWrites(t, db)
	for range 20 {
		id, err := create()
		if err != nil {
			t.Fatalf("CreateCommand(space back) = %v", err)
		}
		stored = append(stored, id)
	}
	if _, err := db.PutBlob(ctx, bytes.NewReader(blob), 0); err != nil {
		t.Fatalf("PutBlob(space back) = %v", err)
	}

	db = reopen(t, db, Options{})
	for _, id := range stored {
		if _, err := db.Command(ctx, id); err != nil {
			t.Errorf("Command(%s) = %v after the reopen; it was stored", id, err)
		}
	}
	if n, err := db.CountAllOpen(ctx); err != nil || n != len(stored) {
		t.Errorf("CountAllOpen() = %d, %v; want the %d stored (%d failed)", n, err, len(stored), failed)
	}
	if err := db.bolt.View(func(tx *bolt.Tx) error { return errors.Join(collect(tx.Check())...) }); err != nil {
		t.Errorf("the file after the full disk: %v", err)
	}
}

func collect(ch <-chan error) []error {
	var errs []error
	for err := range ch {
		errs = append(errs, err)
	}
	return errs
}

// blobFiles lists the files under dir.
func blobFiles(tb testing.TB, dir string) []string {
	tb.Helper()
	var files []string
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return files
}

// A store opened for the first time on a full disk fails and leaves no
// file behind, so that it opens, new, once space is back.
func TestOpenOnAFullDiskLeavesNoFile(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	path := filepath.Join(t.TempDir(), "companion.db")
	lift := testenv.LimitFileSize(t, 0)
	if db, err := Open(path, Options{Logger: quietLogger()}); err == nil {
		db.Close()
		t.Fatal("Open(disk full) = nil error")
	}
	lift()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Open(disk full) left %s: %v", path, err)
	}
	openTestDBWith(t, path, Options{})
}

// While the disk refuses the store's writes, the store says so once, with
// what to do, however many writes fail, and once that it takes writes
// again, which it finds out itself (a write of its own every second),
// with no other write to show it.
func TestADiskFaultIsLoggedOnce(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	var log testenv.Buffer
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "companion.db"), Options{
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	ctx := context.Background()
	lift := testenv.LimitFileSize(t, 0)
	for range 50 {
		_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued"}, 0, nil)
		if !errors.Is(err, ErrUnwritable) {
			t.Fatalf("CreateCommand(disk full) = %v; want ErrUnwritable", err)
		}
	}
	if _, err := db.PutBlob(ctx, bytes.NewReader(make([]byte, 1<<20)), 0); !errors.Is(err, ErrUnwritable) {
		t.Fatalf("PutBlob(disk full) = %v; want ErrUnwritable", err)
	}
	lift()
	testenv.Eventually(t, time.Minute, "the store to say it takes writes again", func() bool {
		return strings.Contains(log.String(), `level=INFO msg="store: the data directory takes writes again"`)
	})
	if _, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued"}, 0, nil); err != nil {
		t.Fatalf("CreateCommand once the limit is lifted = %v", err)
	}
	out := log.String()
	t.Logf("the store's log:\n%s", out)
	if n := strings.Count(out, `level=ERROR msg="store: the data directory cannot be written`); n != 1 {
		t.Errorf("the fault said %d times; want 1", n)
	}
	if !strings.Contains(out, "free space on its disk") {
		t.Error("the log does not say what to do")
	}
	if n := strings.Count(out, "level=ERROR") + strings.Count(out, "level=WARN"); n != 1 {
		t.Errorf("%d errors and warnings; want 1", n)
	}
}

// TestAFullDiskIsTriedAgainOnlyNowAndThen: while the disk is full (a file
// size limit of 0), commands and CheckWrites fail ErrUnwritable, and the
// store tries a commit once every commitRetry, not once for each of them,
// each failed commit costing a scan of the file; once the limit is
// lifted, CheckWrites says so and a command is stored (bug 342).
func TestAFullDiskIsTriedAgainOnlyNowAndThen(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	defer func(old time.Duration) { commitRetry = old }(commitRetry)
	commitRetry = 500 * time.Millisecond
	db := openTestDB(t)
	ctx := context.Background()
	create := func() error {
		_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued", Payload: []byte(`"x"`)}, 0, nil)
		return err
	}
	if err := create(); err != nil {
		t.Fatal(err)
	}

	lift := testenv.LimitFileSize(t, 0)
	start, before := time.Now(), db.writer.Stats().Failed
	for i := range 300 {
		if err := create(); !errors.Is(err, ErrUnwritable) {
			t.Fatalf("CreateCommand(%d, the disk full) = %v; want ErrUnwritable", i, err)
		}
		if i%10 == 0 {
			if err := db.CheckWrites(ctx); !errors.Is(err, ErrUnwritable) {
				t.Fatalf("CheckWrites(the disk full) = %v; want ErrUnwritable", err)
			}
		}
	}
	tried := db.writer.Stats().Failed - before
	// One at the start, one for each commitRetry since, and the one under
	// way as the loop ended.
	if most := 2 + int64(time.Since(start)/commitRetry); tried > most {
		t.Errorf("%d commits tried for 300 commands and 30 CheckWrites on a full disk; want at most %d", tried, most)
	}

	lift()
	awaitWrites(t, db)
	if err := create(); err != nil {
		t.Fatalf("CreateCommand(the disk no longer full) = %v", err)
	}
}

// awaitWrites waits for CheckWrites to say that db takes writes again:
// within commitRetry of the disk's space back (bug 342).
func awaitWrites(t *testing.T, db *DB) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "CheckWrites to say the disk takes writes again", func() bool {
		return db.CheckWrites(context.Background()) == nil
	})
}
