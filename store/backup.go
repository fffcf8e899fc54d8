package store

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"

	bolt "go.etcd.io/bbolt"
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
// copy's length before anything is written to w. The copy has no blobs:
// they are files of their own under BlobDir, each written once and never
// changed, to be copied after it.
//
// The copy is marked as one (keyBackup): a store opened on it knows it is
// a restore, and does not give the ids of events it never saw to new ones
// (openedBackup). A disk that takes no write leaves the copy unmarked.
//
// The read transaction lasts as long as w takes the copy: the pages the
// writes free meanwhile are not reused until it ends, so the file may
// grow while a slow client takes its backup.
func (db *DB) Backup(ctx context.Context, w io.Writer, size func(int64)) (int64, error) {
	// One at a time: the mark one deletes must not come between the mark
	// of another and its read transaction.
	db.backupMu.Lock()
	defer db.backupMu.Unlock()
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
	err := db.bolt.View(func(tx *bolt.Tx) error {
		if size != nil {
			size(tx.Size())
		}
		var err error
		n, err = tx.WriteTo(ctxWriter{ctx, w})
		return err
	})
	if err != nil {
		return n, fmt.Errorf("store: backup: %w", err)
	}
	return n, nil
}

// openedBackup, in Open's migration, takes a file Backup copied as a
// restore (bug 430): what happened after the backup is gone, the events
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
