package store

import (
	"context"
	"fmt"
	"io"

	bolt "go.etcd.io/bbolt"
)

// Backup writes a copy of the bbolt file to w as it stands at one
// instant: the file as of one read transaction, which the writes that
// commit meanwhile do not change (bbolt's Tx.WriteTo). A copy of the live
// file by cp can catch a commit half written, and the server then refuses
// it as damaged, or worse reads it. size, when not nil, is called with the
// copy's length before anything is written to w. The copy has no blobs:
// they are files of their own under BlobDir, each written once and never
// changed, to be copied after it.
//
// The read transaction lasts as long as w takes the copy: the pages the
// writes free meanwhile are not reused until it ends, so the file may
// grow while a slow client takes its backup.
func (db *DB) Backup(ctx context.Context, w io.Writer, size func(int64)) (int64, error) {
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
