package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

func shaHex(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// tempFiles lists the temp files in the blob directory.
func tempFiles(tb testing.TB, db *DB) []string {
	tb.Helper()
	names, err := filepath.Glob(filepath.Join(db.BlobDir(), tempPattern))
	if err != nil {
		tb.Fatal(err)
	}
	return names
}

func TestPutBlob(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	content := bytes.Repeat([]byte("firmware "), 100000)
	sha := shaHex(content)

	b, err := db.PutBlob(ctx, bytes.NewReader(content), int64(len(content)))
	if err != nil {
		t.Fatal(err)
	}
	if b.SHA256 != sha || b.Size != int64(len(content)) || !b.CreatedAt.Equal(clock.Now()) {
		t.Errorf("PutBlob = %+v; want sha %s, size %d", b, sha, len(content))
	}
	path := filepath.Join(db.BlobDir(), sha[:2], sha)
	if fi, err := os.Stat(path); err != nil || fi.Mode() != 0o600 {
		t.Errorf("Stat(%s) = %v, %v; want a 0600 file", path, fi, err)
	}

	f, got, err := db.OpenBlob(ctx, sha)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(f)
	_ = f.Close()
	if !bytes.Equal(data, content) || got != b {
		t.Errorf("OpenBlob(%s) gave %d bytes, %+v", sha, len(data), got)
	}

	// The same content again: fine, same record, first CreatedAt kept.
	clock.Advance(time.Hour)
	again, err := db.PutBlob(ctx, bytes.NewReader(content), 0)
	if err != nil || again != b {
		t.Errorf("PutBlob(same content) = %+v, %v; want %+v", again, err, b)
	}
	if temps := tempFiles(t, db); len(temps) != 0 {
		t.Errorf("temp files left: %v", temps)
	}

	empty, err := db.PutBlob(ctx, strings.NewReader(""), 10)
	if err != nil || empty.SHA256 != shaHex(nil) || empty.Size != 0 {
		t.Errorf("PutBlob(empty) = %+v, %v", empty, err)
	}
}

func TestPutBlobLimits(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		content string
		max     int64
		want    error
	}{
		{"at the limit", ctx, "12345", 5, nil},
		{"one over", ctx, "123456", 5, companion.ErrTooLarge},
		{"far over", ctx, strings.Repeat("x", 1<<20), 1000, companion.ErrTooLarge},
		{"no limit", ctx, strings.Repeat("y", 1<<20), 0, nil},
		{"canceled", canceled, "abc", 0, context.Canceled},
		{"reader fails", ctx, "", 0, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r io.Reader = strings.NewReader(tt.content)
			if tt.want == io.ErrUnexpectedEOF {
				r = io.MultiReader(strings.NewReader("part"), failingReader{})
			}
			b, err := db.PutBlob(tt.ctx, r, tt.max)
			wantErr(t, "PutBlob", err, tt.want)
			if temps := tempFiles(t, db); len(temps) != 0 {
				t.Errorf("temp files left: %v", temps)
			}
			sha := shaHex([]byte(tt.content))
			_, err = db.Blob(ctx, sha)
			if tt.want == nil {
				if err != nil || b.SHA256 != sha {
					t.Errorf("Blob(%s) = %v; PutBlob gave %+v", sha, err, b)
				}
				return
			}
			wantErr(t, "Blob(refused content)", err, companion.ErrNotFound)
			if _, err := os.Stat(filepath.Join(db.BlobDir(), sha[:2], sha)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("refused content has a file: %v", err)
			}
		})
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

func TestPutBlobConcurrentSameContent(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	content := bytes.Repeat([]byte("image"), 50000)
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := db.PutBlob(ctx, bytes.NewReader(content), 0); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	f, b, err := db.OpenBlob(ctx, shaHex(content))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	data, _ := io.ReadAll(f)
	if !bytes.Equal(data, content) || b.Size != int64(len(content)) {
		t.Errorf("blob after concurrent puts: %d bytes, %+v", len(data), b)
	}
	if temps := tempFiles(t, db); len(temps) != 0 {
		t.Errorf("temp files left: %v", temps)
	}
}

func TestBlobLookups(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	b, err := db.PutBlob(ctx, strings.NewReader("x"), 0)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		sha  string
		want error
	}{
		{"stored", b.SHA256, nil},
		{"absent", shaHex([]byte("y")), companion.ErrNotFound},
		{"upper case", strings.ToUpper(b.SHA256), companion.ErrNotFound},
		{"short", b.SHA256[:63], companion.ErrNotFound},
		{"path", "../" + b.SHA256[3:], companion.ErrNotFound},
		{"empty", "", companion.ErrNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := db.Blob(ctx, tt.sha)
			wantErr(t, "Blob", err, tt.want)
			f, _, err := db.OpenBlob(ctx, tt.sha)
			wantErr(t, "OpenBlob", err, tt.want)
			if f != nil {
				_ = f.Close()
			}
		})
	}

	// A recorded blob whose file is gone (PurgeBlobs removed it after
	// the lookup, or the directory lost it) is not found, not a failure.
	if err := os.Remove(filepath.Join(db.BlobDir(), b.SHA256[:2], b.SHA256)); err != nil {
		t.Fatal(err)
	}
	_, _, err = db.OpenBlob(ctx, b.SHA256)
	wantErr(t, "OpenBlob(missing file)", err, companion.ErrNotFound)
	// Storing the content again brings the file back.
	if _, err := db.PutBlob(ctx, strings.NewReader("x"), 0); err != nil {
		t.Fatal(err)
	}
	f, _, err := db.OpenBlob(ctx, b.SHA256)
	if err != nil {
		t.Fatalf("OpenBlob after PutBlob again = %v", err)
	}
	_ = f.Close()
}

// A record written before blobs had a stored time reads as before, and
// counts as stored when created; storing its content again refreshes it.
func TestBlobRecordWithoutStoredAt(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "c.db"), Options{Now: clock.Now})
	content := []byte("old record")
	sha := shaHex(content)
	created := clock.Now().Add(-365 * 24 * time.Hour)
	old := fmt.Sprintf(`{"sha256":%q,"size":%d,"created_at":%q}`, sha, len(content), created.Format(time.RFC3339Nano))
	if err := os.MkdirAll(filepath.Join(db.BlobDir(), sha[:2]), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(db.BlobDir(), sha[:2], sha), content, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := db.update(func(tx *bolt.Tx) error { return tx.Bucket(bucketBlobs).Put([]byte(sha), []byte(old)) }); err != nil {
		t.Fatal(err)
	}
	want := companion.Blob{SHA256: sha, Size: int64(len(content)), CreatedAt: created}
	if b, err := db.Blob(ctx, sha); err != nil || !b.CreatedAt.Equal(created) || b.Size != want.Size {
		t.Fatalf("Blob(old record) = %+v, %v; want %+v", b, err, want)
	}

	if n, err := db.PurgeBlobs(ctx, created.Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("PurgeBlobs(before it was created) = %d, %v; want 0", n, err)
	}

	// Stored again today: kept by a purge of what is older than an hour.
	if b, err := db.PutBlob(ctx, bytes.NewReader(content), 0); err != nil || !b.CreatedAt.Equal(created) {
		t.Fatalf("PutBlob(old content) = %+v, %v; want CreatedAt %v kept", b, err, created)
	}
	clock.Advance(2 * time.Hour)
	if n, err := db.PurgeBlobs(ctx, clock.Now().Add(-3*time.Hour)); err != nil || n != 0 {
		t.Fatalf("PurgeBlobs(before it was stored again) = %d, %v; want 0", n, err)
	}
	if n, err := db.PurgeBlobs(ctx, clock.Now().Add(-time.Hour)); err != nil || n != 1 {
		t.Fatalf("PurgeBlobs(after it was stored again) = %d, %v; want 1", n, err)
	}
}
