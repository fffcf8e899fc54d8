package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
)

// defaultPurgeBatch bounds the deletions of one write transaction, so a
// purge never holds the writer for long.
const defaultPurgeBatch = 1000

// PurgeCommands deletes final commands that last changed before olderThan,
// with their entries in the per-device history (folded or not), and
// returns how many went. Unfinished commands are never deleted. The space
// they held is reused by later writes, so under steady load the file stops
// growing.
//
// Commands are keyed by UUIDv7, in creation order: the scan starts at the
// oldest and stops at the first command created after olderThan. One
// created after now is stepped over instead: it was made while the clock
// ran ahead, and the ids above it (commandID keeps them rising) are of
// commands made once the clock was set right, older than it. Stopping
// there kept every later command until the clock caught up. A transaction
// reads a bounded number of commands (resumable.walk), so a long run of
// those stepped over never holds the writer for long.
func (db *DB) PurgeCommands(ctx context.Context, olderThan time.Time) (int, error) {
	now := db.now()
	var at resumable
	return db.purgeInBatches(ctx, func(tx *bolt.Tx, batch int) (int, bool, error) {
		cmds := tx.Bucket(bucketCommands)
		hist, staged := tx.Bucket(bucketDeviceCmds), tx.Bucket(bucketDeviceCmdsNew)
		var doomed []companion.Command
		more, err := at.walk(cmds.Cursor(), batch, func() bool { return len(doomed) == batch }, func(k, v []byte) (bool, error) {
			var cmd companion.Command
			if err := fastjson.Unmarshal(v, &cmd); err != nil {
				// Kept as it is, and stepped over: one damaged record
				// stopped every purge at it, and the file grew for good.
				db.logUndecodable("command", k, err)
				return false, nil
			}
			if !cmd.CreatedAt.Before(olderThan) {
				return !cmd.CreatedAt.After(now), nil // made ahead: step over
			}
			if companion.IsFinal(cmd.State) && cmd.UpdatedAt.Before(olderThan) {
				doomed = append(doomed, cmd)
			}
			return false, nil
		})
		if err != nil {
			return 0, false, err
		}
		for _, cmd := range doomed {
			if err := cmds.Delete([]byte(cmd.ID)); err != nil {
				return 0, false, err
			}
			if err := hist.Delete(key(cmd.DeviceID, cmd.ID)); err != nil {
				return 0, false, err
			}
			if err := staged.Delete([]byte(cmd.ID)); err != nil {
				return 0, false, err
			}
		}
		return len(doomed), more, nil
	})
}

// resumable is where a purge's next write transaction goes on reading a
// bucket: the key the last one stopped at (nil: the first).
type resumable struct{ from []byte }

// walk calls fn with the records of c from where the last walk stopped,
// in key order, until fn says stop, the bucket ends, full reports true, or
// it has read 16 batches' worth of records, so that one transaction stays
// short however few of the records it reads go. It reports true, more to
// read, when it stopped for full or for that bound. Deleting while a
// cursor walks a bucket skips keys: the callers delete after the walk.
func (r *resumable) walk(c *bolt.Cursor, batch int, full func() bool, fn func(k, v []byte) (stop bool, err error)) (more bool, err error) {
	k, v := c.First()
	if r.from != nil {
		k, v = c.Seek(r.from)
	}
	for read := 0; k != nil; k, v = c.Next() {
		if full() || read == 16*batch {
			r.from = bytes.Clone(k)
			return true, nil
		}
		read++
		if stop, err := fn(k, v); stop || err != nil {
			return false, err
		}
	}
	return false, nil
}

// purgeInBatches runs purge in one write transaction after another, until
// one reports that no more remain, an error, or ctx's end, and returns
// how many the committed transactions deleted. Each purge deletes at most
// batch (db.purgeBatch, or defaultPurgeBatch) and returns how many it
// deleted and whether more remain.
func (db *DB) purgeInBatches(ctx context.Context, purge func(tx *bolt.Tx, batch int) (n int, more bool, err error)) (int, error) {
	batch := db.purgeBatch
	if batch <= 0 {
		batch = defaultPurgeBatch
	}
	total := 0
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		n, more := 0, false
		err := db.update(func(tx *bolt.Tx) error {
			var err error
			n, more, err = purge(tx, batch)
			return err
		})
		if err != nil {
			return total, err
		}
		total += n
		if !more {
			return total, nil
		}
		if db.afterPurgeBatch != nil {
			db.afterPurgeBatch()
		}
	}
}

// defaultBlobPurgeBatch bounds the blobs one write transaction of
// PurgeBlobs deletes.
const defaultBlobPurgeBatch = 1000

// PurgeBlobs deletes the blobs that nothing needs any more and that were
// last stored (PutBlob, the first time or again) before olderThan, and
// returns how many went. A blob is needed while an unfinished command
// references it (blob_refs: a bridge downloads only those, CONTRACT §9; a
// final command keeps the digest, not the blob) or a firmware or an app
// release does. Content is stored before the command or release that will
// reference it is written: callers pass a time well before now, so that
// such content, just stored, is kept.
//
// The blobs bucket is scanned in key order, a window at a time in read
// transactions; each batch of the blobs found (db.purgeBatch, or
// defaultBlobPurgeBatch) is checked again and its records deleted in one
// write transaction. The files go after the records: PurgeBlobs ends by
// removing every blob file that has no record (removeOrphanBlobs). So a
// crash leaves at worst files without records, never a record without
// its file, and those files go with the next purge, as do the ones a
// crash of PutBlob leaves between its rename and its record.
func (db *DB) PurgeBlobs(ctx context.Context, olderThan time.Time) (int, error) {
	batch := db.purgeBatch
	if batch <= 0 {
		batch = defaultBlobPurgeBatch
	}
	total := 0
	var from []byte
	for {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		doomed, next, err := db.unneededBlobs(from, olderThan, batch)
		if err != nil {
			return total, err
		}
		n, err := db.deleteBlobRecords(doomed, olderThan)
		total += n
		if err != nil {
			return total, err
		}
		if next == nil {
			break
		}
		from = next
	}
	return total, db.removeOrphanBlobs(ctx)
}

// unneededBlobs returns up to batch digests of blobs, from the key from
// on (nil: the first), that nothing needs and that were last stored
// before olderThan, and the key to go on from (nil: the scan is done). It
// reads at most 16 batches' worth of records, so that its read
// transaction stays short.
func (db *DB) unneededBlobs(from []byte, olderThan time.Time, batch int) (doomed []string, next []byte, err error) {
	err = db.bolt.View(func(tx *bolt.Tx) error {
		released := db.releasedBlobs(tx)
		c := tx.Bucket(bucketBlobs).Cursor()
		k, v := c.First()
		if from != nil {
			k, v = c.Seek(from)
		}
		for read := 0; k != nil; k, v = c.Next() {
			if len(doomed) == batch || read == 16*batch {
				next = bytes.Clone(k)
				return nil
			}
			read++
			var rec blobRecord
			if !db.decodeBlob(k, v, &rec) || !blobNeeded(tx, released, string(k), rec, olderThan) {
				doomed = append(doomed, string(k))
			}
		}
		return nil
	})
	return doomed, next, err
}

// deleteBlobRecords deletes the records of those of the blobs that still
// are unneeded and stored before olderThan (see PurgeBlobs), and returns
// how many went.
func (db *DB) deleteBlobRecords(shas []string, olderThan time.Time) (int, error) {
	if len(shas) == 0 {
		return 0, nil
	}
	n := 0
	err := db.update(func(tx *bolt.Tx) error {
		n = 0
		released := db.releasedBlobs(tx)
		b := tx.Bucket(bucketBlobs)
		for _, sha := range shas {
			v := b.Get([]byte(sha))
			if v == nil {
				continue
			}
			// A record that does not decode, with no file to rebuild it
			// from, is one of nothing: it goes (decodeBlob).
			var rec blobRecord
			if db.decodeBlob([]byte(sha), v, &rec) && blobNeeded(tx, released, sha, rec, olderThan) {
				continue
			}
			if err := b.Delete([]byte(sha)); err != nil {
				return err
			}
			n++
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}

// blobNeeded reports whether PurgeBlobs keeps the blob of rec: stored
// since olderThan, referenced by an unfinished command, or released (its
// digest in released).
func blobNeeded(tx *bolt.Tx, released map[string]bool, sha string, rec blobRecord, olderThan time.Time) bool {
	if !rec.storedAt().Before(olderThan) || released[sha] {
		return true
	}
	k, _ := tx.Bucket(bucketBlobRefs).Cursor().Seek(prefix(sha))
	return k != nil && bytes.HasPrefix(k, prefix(sha))
}

// releasedBlobs returns the digests of every firmware and app release.
// The catalog is small: a few releases of a few models and apps.
//
// A release that does not decode (the file damaged there) is left out and
// logged once (logUndecodable), and the purge goes on: as an error it
// stopped every purge of blobs for good, and the content nothing needed
// stayed on the disk (docs/reliability.md, bug 566). Its blob, no
// longer known as released, goes with the purge once nothing else needs
// it: a release that does not decode is served by no read (getOrNone,
// scanReleases), so nothing downloads that blob through it; a command that
// still references it keeps it (blob_refs); its next publish uploads the
// content again; and a restore brings the blobs back with its backup
// (docs/operations.md). Keeping every blob a damaged release might hold
// would mean keeping them all: which it held is what was lost.
func (db *DB) releasedBlobs(tx *bolt.Tx) map[string]bool {
	released := make(map[string]bool)
	for _, r := range []struct {
		bucket []byte
		what   string
	}{{bucketFirmware, undecodableFirmware}, {bucketApps, undecodableApp}} {
		c := tx.Bucket(r.bucket).Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			var rel struct {
				SHA256 string `json:"sha256"`
			}
			if err := fastjson.Unmarshal(v, &rel); err != nil {
				db.logUndecodable(r.what, k, err)
				continue
			}
			released[rel.SHA256] = true
		}
	}
	return released
}

// removeOrphanBlobs removes the blob files that have no record (see
// PurgeBlobs): only files named as blobs, in the directories blobs go in.
// It checks and removes a directory's files under the blob directory's
// lock (blobLock), which PutBlob holds from the moment it finds or places
// a file until its record is written: a file whose record is on its way
// stays, and one removed here is placed again by a PutBlob that follows.
func (db *DB) removeOrphanBlobs(ctx context.Context) error {
	dirs, err := os.ReadDir(db.blobDir)
	if err != nil {
		return fmt.Errorf("store: read blob dir: %w", err)
	}
	removed := 0
	for _, d := range dirs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if !d.IsDir() || len(d.Name()) != 2 {
			continue
		}
		entries, err := os.ReadDir(filepath.Join(db.blobDir, d.Name()))
		if err != nil {
			return fmt.Errorf("store: read blob dir: %w", err)
		}
		var names []string
		for _, e := range entries {
			if name := e.Name(); validSHA256(name) && strings.HasPrefix(name, d.Name()) {
				names = append(names, name)
			}
		}
		n, err := db.removeOrphansAmong(names)
		removed += n
		if err != nil {
			return err
		}
	}
	if removed > 0 {
		db.log.Info("store: removed blob files without a record", "count", removed)
	}
	return nil
}

// removeOrphansAmong removes the files of those of the blobs that have no
// record, and returns how many it removed.
func (db *DB) removeOrphansAmong(shas []string) (int, error) {
	if len(shas) == 0 {
		return 0, nil
	}
	lock := db.blobLock()
	lock.Lock()
	defer lock.Unlock()
	var orphans []string
	err := db.bolt.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBlobs)
		for _, sha := range shas {
			if b.Get([]byte(sha)) == nil {
				orphans = append(orphans, sha)
			}
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	removed := 0
	for _, sha := range orphans {
		if err := os.Remove(db.blobPath(sha)); err != nil && !errors.Is(err, os.ErrNotExist) {
			db.log.Warn("store: remove blob file without a record", "sha256", sha, "err", err)
			continue
		}
		removed++
	}
	return removed, nil
}
