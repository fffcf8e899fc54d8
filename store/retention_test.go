package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

func TestPurgeCommandsInBatches(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	db.purgeBatch = 10
	const total = 27
	for i := 0; i < total; i++ {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text"}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateFailed; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(time.Hour)
	n, err := db.PurgeCommands(ctx, clk.Now())
	if err != nil || n != total {
		t.Fatalf("PurgeCommands = %d, %v; want %d", n, err, total)
	}
}

// A clock that ran ahead by more than the retention, and was set right,
// leaves commands created "in the future" in the middle of the commands'
// id order. The purge walks that order and stopped at the first of them,
// so nothing created after the clock was set right went before the clock
// caught up with them: a store that grew without bound for as long as the
// clock had run ahead (a year, for a board that booted without its RTC).
// Those commands are stepped over, a bounded number a transaction, and the
// ones of the right time behind them go.
func TestPurgeCommandsPastAClockThatRanAhead(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	db.purgeBatch = 2 // 32 commands read a transaction at most
	finished := func(n int) []string {
		var ids []string
		for range n {
			c := create(t, db, companion.Command{DeviceID: "d", UserID: "u", Op: "push.text"}) // a user's: it makes events
			if _, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil }); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, c.ID)
		}
		return ids
	}
	before := finished(5)
	clk.Advance(400 * 24 * time.Hour) // the clock runs a year ahead...
	ahead := finished(70)
	clk.Advance(-400*24*time.Hour + time.Hour) // ...and is set right
	after := finished(5)
	clk.Advance(48 * time.Hour)

	n, err := db.PurgeCommands(ctx, clk.Now().Add(-24*time.Hour))
	if err != nil || n != len(before)+len(after) {
		t.Fatalf("PurgeCommands = %d, %v; want %d: the commands of the right time, before and after those of the clock that ran ahead", n, err, len(before)+len(after))
	}
	for _, id := range append(before, after...) {
		if _, err := db.Command(ctx, id); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("Command(%s) = %v; want purged", id, err)
		}
	}
	for _, id := range ahead {
		if _, err := db.Command(ctx, id); err != nil {
			t.Errorf("Command(%s) created ahead = %v; want kept until the clock passes it", id, err)
		}
	}
	// Each command made two events (queued, succeeded); the event log
	// is walked the same way.
	if n, err := db.PurgeEvents(ctx, clk.Now().Add(-24*time.Hour)); err != nil || n != 2*(len(before)+len(after)) {
		t.Fatalf("PurgeEvents = %d, %v; want %d", n, err, 2*(len(before)+len(after)))
	}
	clk.Advance(401 * 24 * time.Hour)
	if n, err := db.PurgeCommands(ctx, clk.Now().Add(-24*time.Hour)); err != nil || n != len(ahead) {
		t.Fatalf("PurgeCommands once the clock passed them = %d, %v; want %d", n, err, len(ahead))
	}
	if n, err := db.PurgeEvents(ctx, clk.Now().Add(-24*time.Hour)); err != nil || n != 2*len(ahead) {
		t.Fatalf("PurgeEvents once the clock passed them = %d, %v; want %d", n, err, 2*len(ahead))
	}
}

// PurgeBlobs deletes unneeded blobs a batch at a time, records and files,
// however many batches it takes, and keeps the needed ones among them.
func TestPurgeBlobsInBatches(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	db.purgeBatch = 3
	put := func(content string) string { return putBlob(t, db, content) }
	var doomed, kept []string
	for i := range 50 {
		sha := put(fmt.Sprint("unneeded ", i))
		if i%5 != 0 {
			doomed = append(doomed, sha)
			continue
		}
		kept = append(kept, sha)
		create(t, db, companion.Command{DeviceID: fmt.Sprint("d", i), Op: "push.image", Blob: sha})
	}
	fw := put("firmware")
	kept = append(kept, fw)
	if err := db.PutFirmware(ctx, companion.Firmware{Model: "m", Version: "1.0.0", SHA256: fw}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(2 * time.Hour)
	kept = append(kept, put("recent"))

	n, err := db.PurgeBlobs(ctx, clk.Now().Add(-time.Hour))
	if err != nil || n != len(doomed) {
		t.Fatalf("PurgeBlobs = %d, %v; want %d", n, err, len(doomed))
	}
	for _, sha := range doomed {
		if _, err := db.Blob(ctx, sha); !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("Blob(purged %s) = %v; want ErrNotFound", sha, err)
		}
		if _, err := os.Stat(db.blobPath(sha)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the file of purged blob %s: %v; want it gone", sha, err)
		}
	}
	for _, sha := range kept {
		f, _, err := db.OpenBlob(ctx, sha)
		if err != nil {
			t.Errorf("OpenBlob(kept %s) = %v", sha, err)
			continue
		}
		_ = f.Close()
	}
}

// A blob file without a record (a crash between a purge's commit and its
// file removals, or within PutBlob) goes with the next purge; other files
// in the blob directory stay.
func TestPurgeBlobsRemovesFilesWithoutRecord(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	kept, err := db.PutBlob(ctx, strings.NewReader("kept"), 0)
	if err != nil {
		t.Fatal(err)
	}
	orphan := shaHex([]byte("orphan"))
	others := []string{
		filepath.Join(db.BlobDir(), "notes.txt"),
		filepath.Join(db.BlobDir(), orphan[:2], "notes.txt"),
		filepath.Join(db.BlobDir(), "zz", orphan), // not where the blob goes
	}
	for _, name := range append(others, db.blobPath(orphan)) {
		if err := os.MkdirAll(filepath.Dir(name), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(name, []byte("orphan"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := db.PurgeBlobs(ctx, db.now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("PurgeBlobs = %d, %v; want 0 (no record to delete)", n, err)
	}
	if _, err := os.Stat(db.blobPath(orphan)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a blob file without a record: %v; want it gone", err)
	}
	for _, name := range append(others, db.blobPath(kept.SHA256)) {
		if _, err := os.Stat(name); err != nil {
			t.Errorf("%s: %v; want it kept", name, err)
		}
	}
}

// A PutBlob of content stored long ago, racing a purge that would delete
// it, leaves a blob that can be read: either the purge went first and
// PutBlob stored it anew, or PutBlob refreshed it and the purge kept it.
// Never a record without its file.
func TestPutBlobRacesPurgeBlobs(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	content := bytes.Repeat([]byte("photo"), 1000)
	for i := range 300 {
		if _, err := db.PutBlob(ctx, bytes.NewReader(content), 0); err != nil {
			t.Fatal(err)
		}
		clk.Advance(2 * time.Hour)
		cutoff := clk.Now().Add(-time.Hour)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if _, err := db.PurgeBlobs(ctx, cutoff); err != nil {
				t.Error(err)
			}
		}()
		go func() {
			defer wg.Done()
			if _, err := db.PutBlob(ctx, bytes.NewReader(content), 0); err != nil {
				t.Error(err)
			}
		}()
		wg.Wait()
		f, _, err := db.OpenBlob(ctx, shaHex(content))
		if err != nil {
			t.Fatalf("round %d: OpenBlob after PutBlob raced PurgeBlobs = %v", i, err)
		}
		_ = f.Close()
	}
}

// The write transaction of a purge checks each blob its read found again:
// one that was stored again, or became referenced, in between is kept.
func TestPurgeBlobsChecksAgainBeforeDeleting(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	put := func(content string) string { return putBlob(t, db, content) }
	again, forCmd, forApp, unneeded := put("again"), put("command"), put("app"), put("unneeded")
	clk.Advance(2 * time.Hour)
	cutoff := clk.Now().Add(-time.Hour)
	doomed, next, err := db.unneededBlobs(nil, cutoff, 10)
	if err != nil || len(doomed) != 4 || next != nil {
		t.Fatalf("unneededBlobs = %d blobs, %q, %v; want all 4 and the end", len(doomed), next, err)
	}
	put("again")
	create(t, db, companion.Command{DeviceID: "d", Op: "push.image", Blob: forCmd})
	if err := db.PutAppRelease(ctx, companion.AppRelease{AppID: "a", Version: "1.0.0", SHA256: forApp}); err != nil {
		t.Fatal(err)
	}
	if n, err := db.deleteBlobRecords(doomed, cutoff); err != nil || n != 1 {
		t.Fatalf("deleteBlobRecords = %d, %v; want 1", n, err)
	}
	for sha, want := range map[string]error{again: nil, forCmd: nil, forApp: nil, unneeded: companion.ErrNotFound} {
		_, err := db.Blob(ctx, sha)
		wantErr(t, "Blob("+sha+")", err, want)
	}
}

// putBlob stores content as a blob and returns its SHA-256.
func putBlob(t *testing.T, db *DB, content string) string {
	t.Helper()
	b, err := db.PutBlob(context.Background(), strings.NewReader(content), 0)
	if err != nil {
		t.Fatal(err)
	}
	return b.SHA256
}
