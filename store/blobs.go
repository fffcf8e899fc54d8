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
	"sync"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

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
// record keeps its first CreatedAt, and its storedAt becomes now, so that
// PurgeBlobs spares content stored again for a command about to reference
// it, however old the blob.
func (db *DB) PutBlob(ctx context.Context, r io.Reader, max int64) (companion.Blob, error) {
	tmp, err := os.CreateTemp(db.blobDir, tempPattern)
	if err != nil {
		return companion.Blob{}, db.diskError(fmt.Errorf("store: blob temp file: %w", err))
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
		return companion.Blob{}, db.diskError(fmt.Errorf("store: write blob: %w", err))
	}
	if max > 0 && n > max {
		return companion.Blob{}, companion.ErrTooLarge
	}
	if err := tmp.Sync(); err != nil {
		return companion.Blob{}, db.unwritable(fmt.Errorf("store: sync blob: %w", err))
	}
	if err := tmp.Close(); err != nil {
		return companion.Blob{}, db.diskError(fmt.Errorf("store: close blob: %w", err))
	}

	sha := hex.EncodeToString(h.Sum(nil))
	// The file is placed and recorded under the blob directory's lock, so
	// that PurgeBlobs does not take it for one without a record between
	// the two.
	lock := db.blobLock()
	lock.RLock()
	defer lock.RUnlock()
	dir := filepath.Dir(db.blobPath(sha))
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return companion.Blob{}, db.diskError(fmt.Errorf("store: blob dir: %w", err))
		}
		if err := syncDir(db.blobDir); err != nil {
			return companion.Blob{}, db.diskError(err)
		}
	}
	if _, err := os.Stat(db.blobPath(sha)); err == nil {
		// Same name, same content: keep the file already in place.
		if err := os.Remove(tmpName); err != nil {
			return companion.Blob{}, fmt.Errorf("store: remove blob temp: %w", err)
		}
	} else if err := os.Rename(tmpName, db.blobPath(sha)); err != nil {
		return companion.Blob{}, db.diskError(fmt.Errorf("store: place blob: %w", err))
	}
	placed = true
	if err := syncDir(dir); err != nil {
		return companion.Blob{}, db.diskError(err)
	}

	var rec blobRecord
	err = db.batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBlobs)
		now := db.now()
		rec = blobRecord{}
		// A record that does not decode (the file damaged there) is
		// replaced as if there were none (bug 573).
		ok := getOrNone(db, b, undecodableBlob, []byte(sha), &rec)
		switch {
		case !ok:
			rec = blobRecord{SHA256: sha, Size: n, CreatedAt: now, StoredAt: now}
		case now.After(rec.storedAt()):
			rec.StoredAt = now
		default:
			return nil // stored as late already
		}
		return putJSON(b, []byte(sha), rec)
	})
	if err != nil {
		return companion.Blob{}, err
	}
	return rec.blob(), nil
}

// blobRecord is a blob's value in the blobs bucket: companion.Blob and
// when its content was last stored (PutBlob, first or again), which
// PurgeBlobs reads. Records written before StoredAt existed lack it: their
// CreatedAt stands for it.
type blobRecord struct {
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
	StoredAt  time.Time `json:"stored_at"`
}

// storedAt is when the content was last stored.
func (r blobRecord) storedAt() time.Time {
	if r.StoredAt.IsZero() {
		return r.CreatedAt
	}
	return r.StoredAt
}

func (r blobRecord) blob() companion.Blob {
	return companion.Blob{SHA256: r.SHA256, Size: r.Size, CreatedAt: r.CreatedAt}
}

// blobLock is the lock of the DB's blob directory (DB.blobMu): PutBlob
// holds it shared while it places a file and records it, PurgeBlobs
// exclusively while it removes the files without a record, so that a file
// PutBlob has just found in place is not removed before its record is
// written. (Only one DB uses a blob directory at a time: Open takes the
// bbolt file's lock.)
func (db *DB) blobLock() *sync.RWMutex { return &db.blobMu }

// Blob returns the record of the blob with the SHA-256 (64 lower-case hex
// digits), or ErrNotFound; a malformed digest is ErrNotFound too.
func (db *DB) Blob(ctx context.Context, sha string) (companion.Blob, error) {
	if !validSHA256(sha) {
		return companion.Blob{}, companion.ErrNotFound
	}
	var rec blobRecord
	err := db.bolt.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketBlobs).Get([]byte(sha))
		if v == nil || !db.decodeBlob([]byte(sha), v, &rec) {
			return companion.ErrNotFound
		}
		return nil
	})
	if err != nil {
		return companion.Blob{}, err
	}
	return rec.blob(), nil
}

// undecodableBlob names a blob's record in the log of logUndecodable.
const undecodableBlob = "blob record"

// decodeBlob decodes v, the record of the blob sha, into rec and reports
// whether there is one. A record that does not decode (the file damaged
// there) is logged once (logUndecodable) and rebuilt from the blob's file,
// which is named by its digest: its size is the file's, and when it was
// stored, the file's modification time (when its content was first
// written). With no file it is read as none, and the purge deletes it.
// Read as an error, one damaged record made the blob's download a 500,
// refused the same content stored again, and failed every purge of blobs,
// for good (docs/reliability.md, bug 573). The record is not written
// back here; PutBlob of the content replaces it, as if there were none.
func (db *DB) decodeBlob(sha, v []byte, rec *blobRecord) bool {
	err := fastjson.Unmarshal(v, rec)
	if err == nil {
		return true
	}
	*rec = blobRecord{}
	first := db.logUndecodable(undecodableBlob, sha, err)
	if !validSHA256(string(sha)) {
		return false
	}
	fi, serr := os.Stat(db.blobPath(string(sha)))
	if serr != nil || !fi.Mode().IsRegular() {
		return false
	}
	*rec = blobRecord{SHA256: string(sha), Size: fi.Size(), CreatedAt: fi.ModTime().UTC()}
	if first {
		db.log.Warn("store: a blob record that does not decode is read as rebuilt from the blob's file (its size, and the file's time for when it was stored)",
			"key", string(sha), "size", rec.Size, "created_at", rec.CreatedAt)
	}
	return true
}

// OpenBlob opens the file of the blob for reading; the caller closes it.
// It returns ErrNotFound as Blob does, and when the file is gone: PurgeBlobs
// deleted the blob between the lookup and the open, or (logged, the record
// being still there) the data directory lost it. A file that is there but
// unreadable is an error of its own.
func (db *DB) OpenBlob(ctx context.Context, sha string) (io.ReadSeekCloser, companion.Blob, error) {
	b, err := db.Blob(ctx, sha)
	if err != nil {
		return nil, companion.Blob{}, err
	}
	f, err := os.Open(db.blobPath(sha))
	if errors.Is(err, os.ErrNotExist) {
		if _, err := db.Blob(ctx, sha); err == nil {
			db.log.Error("store: blob recorded but its file is gone", "sha256", sha)
		}
		return nil, companion.Blob{}, companion.ErrNotFound
	}
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

// diskError marks err as ErrUnwritable when it is the disk's refusal
// (diskRefused): a blob's content or its directory that did not fit, or
// that a failing or read-only disk did not take, rather than a client's
// body that broke off.
func (db *DB) diskError(err error) error {
	if diskRefused(err) {
		return db.unwritable(err)
	}
	return err
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
