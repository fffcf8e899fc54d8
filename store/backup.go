package store

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/devicecompanion/companion"
)

// keyBackup, in the meta bucket, marks a copy Backup made: the store
// opened on it is a restore (openedBackup). Backup sets it in the live
// file just before the read transaction it copies, and deletes it after.
var keyBackup = []byte("backup")

// Backup writes a copy of the bbolt file to w as it stands at one
// instant: the file as of one read transaction, which the writes that
// commit meanwhile do not change (bbolt's Tx.WriteTo). A copy of the live
// file by cp can catch a commit half written, and the server then refuses
// it as damaged, or worse reads it. size, when not nil, is called with the
// copy's length before anything is written to w; with w nil, Backup only
// calls size with the file's length as it stands. The copy has no blobs:
// they are files of their own under BlobDir, each written once and never
// changed, to be copied after it.
//
// The copy is marked as one (keyBackup): a store opened on it knows it is
// a restore, and does not give the ids of events it never saw to new ones
// (openedBackup). A disk that takes no write leaves the copy unmarked.
//
// The read transaction lasts only as long as the copy takes to write to a
// temporary file beside the store (removed as it is made, so that a crash
// leaves nothing), and w is then sent that file (bug 427): bbolt does not
// reuse the pages freed after the oldest open read transaction began, so
// one held for a whole download let a slow or stalled client grow the
// live file without bound while commands were written. The directory
// needs room for one more copy of the store meanwhile.
func (db *DB) Backup(ctx context.Context, w io.Writer, size func(int64)) (int64, error) {
	if w == nil {
		// The length alone (HEAD): no copy, and no mark.
		err := db.bolt.View(func(tx *bolt.Tx) error {
			if size != nil {
				size(tx.Size())
			}
			return nil
		})
		return 0, err
	}
	tmp, n, err := db.backupToTemp(ctx)
	if err != nil {
		return 0, err
	}
	defer tmp.Close()
	if size != nil {
		size(n)
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return 0, fmt.Errorf("store: backup: %w", err)
	}
	sent, err := io.Copy(ctxWriter{ctx, w}, io.LimitReader(tmp, n))
	if err != nil {
		return sent, fmt.Errorf("store: backup: %w", err)
	}
	return sent, nil
}

// backupToTemp writes the marked copy Backup sends to a temporary file
// beside the store, already removed from its directory, and returns it
// with its length.
func (db *DB) backupToTemp(ctx context.Context) (*os.File, int64, error) {
	// One at a time: the mark one deletes must not come between the mark
	// of another and its read transaction.
	db.backupMu.Lock()
	defer db.backupMu.Unlock()
	tmp, err := os.CreateTemp(filepath.Dir(db.path), ".backup-*")
	if err != nil {
		return nil, 0, fmt.Errorf("store: backup: %w", err)
	}
	_ = os.Remove(tmp.Name())
	mark := func(put bool) error {
		return db.update(func(tx *bolt.Tx) error {
			if put {
				return tx.Bucket(bucketMeta).Put(keyBackup, []byte{1})
			}
			return tx.Bucket(bucketMeta).Delete(keyBackup)
		})
	}
	if err := mark(true); err != nil {
		db.log.Warn("store: backup: the copy is not marked as one (a store opened on it resets no event stream)", "err", err)
	} else {
		// After the copy's read transaction, not before: a commit
		// waits for the read transactions when it maps the file again.
		defer func() {
			if err := mark(false); err != nil {
				db.log.Warn("store: backup: the live file keeps the copy's mark: the next start resets the event streams", "err", err)
			}
		}()
	}
	var n int64
	err = db.bolt.View(func(tx *bolt.Tx) error {
		if free, ok := freeSpace(tmp); ok && free < tx.Size()+backupHeadroom {
			return fmt.Errorf("%w: the server's data directory has %d bytes free; a backup needs room for a copy of the store (%d bytes) beside it, and %d bytes besides for the store, while it is sent: free space there, or stop the server and use companion backup --offline",
				companion.ErrNoRoom, free, tx.Size(), backupHeadroom)
		}
		var err error
		n, err = tx.WriteTo(ctxWriter{ctx, tmp})
		if errors.Is(err, syscall.ENOSPC) {
			err = fmt.Errorf("%w: the server's data directory ran out of space for the backup's copy of the store (%d bytes): free space there, or stop the server and use companion backup --offline", companion.ErrNoRoom, tx.Size())
		}
		return err
	})
	if err != nil {
		_ = tmp.Close()
		return nil, 0, fmt.Errorf("store: backup: %w", err)
	}
	return tmp, n, nil
}

// backupHeadroom is the room a backup leaves on the store's disk beside
// its copy (bug 430): the copy lives while the client takes it, and the
// store's commits need room meanwhile.
const backupHeadroom = 64 << 20

// freeSpace returns the bytes free to an unprivileged user on f's file
// system, and false when it cannot tell.
func freeSpace(f *os.File) (int64, bool) {
	var st syscall.Statfs_t
	if err := syscall.Fstatfs(int(f.Fd()), &st); err != nil {
		return 0, false
	}
	return int64(st.Bavail) * int64(st.Bsize), true
}

// openedBackup, in Open's migration, takes a file Backup copied as a
// restore (bug 397): what happened after the backup is gone, the events
// too, and clients of the event streams hold ids of events the copy never
// had. The log's sequence jumps past every id the store the copy was
// taken from could have given (the clock in microseconds: the log makes
// far fewer events a second), so that no new event takes one of those
// ids, and the purge mark is put at the jump: a stream resumed from any
// id before it starts with an event "reset", as after events purged,
// and its client reads the state again.
func (db *DB) openedBackup(tx *bolt.Tx) error {
	meta := tx.Bucket(bucketMeta)
	if meta.Get(keyBackup) == nil {
		return nil
	}
	events := tx.Bucket(bucketEvents)
	jump := max(events.Sequence(), uint64(max(db.now().UnixMicro(), 0))) + 1
	if err := events.SetSequence(jump); err != nil {
		return err
	}
	if err := meta.Put(keyEventsPurged, binary.BigEndian.AppendUint64(nil, jump)); err != nil {
		return err
	}
	db.log.Info("store: opened a backup: event streams resumed from an id before it start with an event reset", "path", db.path, "events_from", eventID(jump+1))
	return meta.Delete(keyBackup)
}

// ctxWriter is w that fails once ctx is done.
type ctxWriter struct {
	ctx context.Context
	w   io.Writer
}

func (c ctxWriter) Write(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.w.Write(p)
}

// BackupStopped writes to tmp a copy of the bbolt file at path, of a
// store no process has open (its server stopped), marked as a backup as
// Backup marks its copies (bug 429): a cp of the file has no mark, and a
// store restored from it gave the ids of events clients had seen to new
// ones (bug 397). It returns the copy's length. A file that a running
// server holds is refused at once, and so is a damaged one or none.
func BackupStopped(ctx context.Context, path string, tmp *os.File) (int64, error) {
	if _, err := os.Stat(path); err != nil {
		return 0, fmt.Errorf("store: no store to back up: %w", err)
	}
	if err := checkFile(path); err != nil {
		return 0, fmt.Errorf("store: %s: %w", path, err)
	}
	src, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: 100 * time.Millisecond})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return 0, fmt.Errorf("store: %s is in use: a companion server is running on it; back it up with companion backup without --offline, through the running server", path)
	}
	if err != nil {
		return 0, fmt.Errorf("store: open %s: %w", path, err)
	}
	err = src.View(func(tx *bolt.Tx) error {
		_, err := tx.WriteTo(ctxWriter{ctx, tmp})
		return err
	})
	if cerr := src.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, fmt.Errorf("store: backup: %w", err)
	}
	// The mark goes into the copy only: the file itself stays as it was.
	dst, err := bolt.Open(tmp.Name(), 0o600, &bolt.Options{Timeout: time.Second, NoFreelistSync: true, FreelistType: bolt.FreelistMapType})
	if err != nil {
		return 0, fmt.Errorf("store: backup: mark the copy: %w", err)
	}
	err = dst.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucketIfNotExists(bucketMeta)
		if err != nil {
			return err
		}
		return meta.Put(keyBackup, []byte{1})
	})
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, fmt.Errorf("store: backup: mark the copy: %w", err)
	}
	fi, err := tmp.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}
