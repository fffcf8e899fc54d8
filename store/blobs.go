package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// tempPattern names blob files still being written.
const tempPattern = ".tmp-*"

// PutBlob stores the content of r as a blob and returns its record. The
// content is streamed into a temp file in the blob directory while it is
// hashed, fsync'd and renamed to BlobDir/ab/<sha256> (ab being the first
// two hex digits), so a blob file is either whole or absent. Content over
// max bytes (max <= 0: no limit) is ErrTooLarge and leaves nothing behind.
// Storing content that is already stored is fine, concurrently too; the
// record keeps its first CreatedAt.
func (db *DB) PutBlob(ctx context.Context, r io.Reader, max int64) (companion.Blob, error) {
	tmp, err := os.CreateTemp(db.blobDir, tempPattern)
	if err != nil {
		return companion.Blob{}, fmt.Errorf("store: blob temp file: %w", err)
	}
	tmpName := tmp.Name()
	placed := false
	defer func() {
		if !placed {
			_ = tmp.Close()
			_ = os.Remove(tmpName)
		}
	}()

	h := sha256.New()
	var src io.Reader = ctxReader{ctx, r}
	if max > 0 {
		src = io.LimitReader(src, max+1)
	}
	n, err := io.Copy(io.MultiWriter(tmp, h), src)
	if err != nil {
		return companion.Blob{}, fmt.Errorf("store: write blob: %w", err)
	}
	if max > 0 && n > max {
		return companion.Blob{}, companion.ErrTooLarge
	}
	if err := tmp.Sync(); err != nil {
		return companion.Blob{}, fmt.Errorf("store: sync blob: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return companion.Blob{}, fmt.Errorf("store: close blob: %w", err)
	}

	sha := hex.EncodeToString(h.Sum(nil))
	dir := filepath.Dir(db.blobPath(sha))
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return companion.Blob{}, fmt.Errorf("store: blob dir: %w", err)
		}
		if err := syncDir(db.blobDir); err != nil {
			return companion.Blob{}, err
		}
	}
	if _, err := os.Stat(db.blobPath(sha)); err == nil {
		// Same name, same content: keep the file already in place.
		if err := os.Remove(tmpName); err != nil {
			return companion.Blob{}, fmt.Errorf("store: remove blob temp: %w", err)
		}
	} else if err := os.Rename(tmpName, db.blobPath(sha)); err != nil {
		return companion.Blob{}, fmt.Errorf("store: place blob: %w", err)
	}
	placed = true
	if err := syncDir(dir); err != nil {
		return companion.Blob{}, err
	}

	var out companion.Blob
	err = db.batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBlobs)
		ok, err := getJSON(b, []byte(sha), &out)
		if err != nil || ok {
			return err
		}
		out = companion.Blob{SHA256: sha, Size: n, CreatedAt: db.now()}
		return putJSON(b, []byte(sha), out)
	})
	if err != nil {
		return companion.Blob{}, err
	}
	return out, nil
}

// Blob returns the record of the blob with the SHA-256 (64 lower-case hex
// digits), or ErrNotFound; a malformed digest is ErrNotFound too.
func (db *DB) Blob(ctx context.Context, sha string) (companion.Blob, error) {
	if !validSHA256(sha) {
		return companion.Blob{}, companion.ErrNotFound
	}
	var b companion.Blob
	if err := db.get(bucketBlobs, []byte(sha), &b); err != nil {
		return companion.Blob{}, err
	}
	return b, nil
}

// OpenBlob opens the file of the blob for reading; the caller closes it.
// It returns ErrNotFound as Blob does. A recorded blob whose file is gone
// is an error of its own, not ErrNotFound: the data directory is damaged.
func (db *DB) OpenBlob(ctx context.Context, sha string) (io.ReadSeekCloser, companion.Blob, error) {
	b, err := db.Blob(ctx, sha)
	if err != nil {
		return nil, companion.Blob{}, err
	}
	f, err := os.Open(db.blobPath(sha))
	if err != nil {
		db.log.Error("store: blob recorded but unreadable", "sha256", sha, "err", err)
		return nil, companion.Blob{}, fmt.Errorf("store: open blob %s: %w", sha, err)
	}
	return f, b, nil
}

// blobPath is where the blob with the digest lives.
func (db *DB) blobPath(sha string) string {
	return filepath.Join(db.blobDir, sha[:2], sha)
}

// removeStaleTemps deletes temp files a crash left in the blob directory.
func (db *DB) removeStaleTemps() {
	names, err := filepath.Glob(filepath.Join(db.blobDir, tempPattern))
	if err != nil {
		return
	}
	for _, name := range names {
		if err := os.Remove(name); err != nil {
			db.log.Warn("store: remove stale blob temp", "file", name, "err", err)
		}
	}
	if len(names) > 0 {
		db.log.Info("store: removed stale blob temp files", "count", len(names))
	}
}

// validSHA256 reports whether s is 64 lower-case hex digits.
func validSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// syncDir fsyncs a directory so that a rename or create in it is durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("store: open dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("store: sync dir: %w", err)
	}
	return nil
}

// ctxReader stops a copy once its context is done.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
