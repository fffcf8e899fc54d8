package groupcommit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	bolt "go.etcd.io/bbolt"
)

// bbolt's layout of a meta page (go.etcd.io/bbolt/internal/common): a page
// header of 16 bytes (its id first, in the host's byte order), then the
// meta, whose transaction id is at byte 48 of it.
const (
	pageIDOffset   = 0
	metaTxIDOffset = 16 + 48
)

// forget undoes, where bbolt left it done, the commit of the write
// transaction id that failed (bug 337).
//
// bbolt commits by writing the transaction's pages, syncing them, writing
// its meta page in one of the file's two meta slots (id%2) and syncing it.
// When that last sync fails (EIO: the disk failing), bbolt rolls the
// transaction back in memory, but it reads its metas from the mapped
// file, where the page it wrote shows: the transaction reads as
// committed, the next one is begun on top of it, and its commit makes the
// writes durable, though every caller was answered that they failed. So
// forget copies the other slot's meta, the last commit that succeeded,
// over the one written (a write of the page cache; its sync, if it fails,
// is the disk's to fail), and has bbolt rebuild its list of free pages
// from the pages that commit uses, which it does when a transaction rolls
// back for a panic (Update), as after a failed commit; a Rollback does
// not.
//
// All of it happens in a write transaction, which holds the other writers
// off; it does nothing unless that transaction reads the failed one as the
// last committed: a commit that failed before its meta page was written
// left nothing to undo.
func forget(db *bolt.DB, id int) (err error) {
	defer func() {
		if v := recover(); v != nil && v != errForgotten {
			panic(v)
		}
	}()
	return db.Update(func(tx *bolt.Tx) error {
		if tx.ID() != id+1 {
			return errNothingToForget // rolls back
		}
		if err := restoreMeta(db, id); err != nil {
			return err
		}
		panic(errForgotten)
	})
}

var (
	errNothingToForget = errors.New("groupcommit: the failed commit left nothing to undo")
	errForgotten       = errors.New("groupcommit: a failed commit undone")
)

// restoreMeta copies the meta page of transaction id-1 over the one of
// transaction id.
func restoreMeta(db *bolt.DB, id int) error {
	size := int64(db.Info().PageSize)
	f, err := os.OpenFile(db.Path(), os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	page := make([]byte, size)
	kept := int64((id - 1) % 2) // the slot of the last commit that succeeded
	if _, err := f.ReadAt(page, kept*size); err != nil {
		return err
	}
	if got := binary.NativeEndian.Uint64(page[metaTxIDOffset:]); got != uint64(id-1) {
		return fmt.Errorf("the meta page in slot %d is of transaction %d, not %d", kept, got, id-1)
	}
	written := int64(id % 2)
	binary.NativeEndian.PutUint64(page[pageIDOffset:], uint64(written))
	if _, err := f.WriteAt(page, written*size); err != nil {
		return err
	}
	_ = f.Sync()
	return nil
}

// Update is bbolt's Update for a write of its own, outside the committer's
// groups: when the commit fails, it returns a *CommitError, and undoes the
// commit where bbolt left it done (forget). An error of fn is returned as
// it is, with its writes rolled back.
func Update(db *bolt.DB, fn func(tx *bolt.Tx) error) error {
	id := 0 // the transaction's, once begun
	var fnErr error
	err := db.Update(func(tx *bolt.Tx) error {
		id = tx.ID()
		fnErr = fn(tx)
		return fnErr
	})
	if err == nil || id == 0 || fnErr != nil {
		return err
	}
	return failed(db, id, err)
}

// failed is the *CommitError of the write transaction id, whose commit
// failed with err, once forget has undone what bbolt left of it.
func failed(db *bolt.DB, id int, err error) *CommitError {
	if ferr := forget(db, id); ferr != nil && !errors.Is(ferr, errNothingToForget) {
		err = fmt.Errorf("%w (and bbolt keeps the transaction, which could not be undone: %v)", err, ferr)
	}
	return &CommitError{Err: err}
}
