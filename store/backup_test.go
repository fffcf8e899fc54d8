package store

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion"
)

// TestRestoredBackupResetsStreamsPastIt restores a backup older than
// events clients have seen: a client that resumes with the id of an event
// made after the backup (which the restored store has forgotten) must be
// told it missed events, however many events the restored store has made
// since. Before, the restored store gave the forgotten ids to new events,
// and a client that resumed once it had passed them skipped those new
// events silently, as if it had them.
func TestRestoredBackupResetsStreamsPastIt(t *testing.T) {
	dir := t.TempDir()
	db := openTestDBWith(t, filepath.Join(dir, "live", "companion.db"), Options{})
	ctx := t.Context()
	appendEvents := func(db *DB, n int) string {
		t.Helper()
		require.NoError(t, db.update(func(tx *bolt.Tx) error {
			for range n {
				if err := db.appendEvent(tx, companion.Event{Kind: companion.EventDevice, UserID: "u1", DeviceID: "d1", At: db.now()}); err != nil {
					return err
				}
			}
			return nil
		}))
		head, err := db.EventsHead(ctx)
		require.NoError(t, err)
		return head
	}
	before := appendEvents(db, 3)
	var bak bytes.Buffer
	_, err := db.Backup(ctx, &bak, nil)
	require.NoError(t, err)
	seen := appendEvents(db, 5) // a client saw these, then the store was lost

	restored := filepath.Join(dir, "restored", "companion.db")
	require.NoError(t, os.MkdirAll(filepath.Dir(restored), 0o700))
	require.NoError(t, os.WriteFile(restored, bak.Bytes(), 0o600))
	db2 := openTestDBWith(t, restored, Options{})
	appendEvents(db2, 20) // the restored server runs on past the client's id

	past, err := db2.EventsPastEnd(ctx, seen)
	require.NoError(t, err)
	purged, err := db2.EventsPurgedAfter(ctx, seen)
	require.NoError(t, err)
	assert.True(t, past || purged, "a client at %s, an event the restored store forgot, is not told it missed events", seen)

	// One that resumes from before the backup is told too (what it saw
	// after the backup was undone), and gets the events the copy holds.
	purged, err = db2.EventsPurgedAfter(ctx, before)
	require.NoError(t, err)
	assert.True(t, purged, "a client at %s, before the backup, is not told", before)
	evs, _, err := db2.Events(ctx, "u1", "", 100)
	require.NoError(t, err)
	assert.Len(t, evs, 23)

	// The live store, which went on, resets nobody.
	appendEvents(db, 1)
	purged, err = db.EventsPurgedAfter(ctx, seen)
	require.NoError(t, err)
	assert.False(t, purged, "the live store after a backup")
	db = reopen(t, db, Options{})
	purged, err = db.EventsPurgedAfter(ctx, seen)
	require.NoError(t, err)
	assert.False(t, purged, "the live store reopened after a backup")
	// Neither does the restored store once it reopens.
	last := appendEvents(db2, 1)
	db2 = reopen(t, db2, Options{})
	purged, err = db2.EventsPurgedAfter(ctx, last)
	require.NoError(t, err)
	assert.False(t, purged)
}

// blockingWriter takes the first write, says so on wrote, and then waits
// for release before it takes any: a client that stalls mid-download.
type blockingWriter struct {
	wrote   chan struct{}
	release chan struct{}
	once    bool
	buf     bytes.Buffer
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	if !w.once {
		w.once = true
		close(w.wrote)
		<-w.release
	}
	return w.buf.Write(p)
}

// TestBackupHoldsNoReadTxWhileTheClientReads takes a backup for a client
// that stalls after the first bytes: the store must hold no read
// transaction meanwhile. bbolt does not reuse the pages freed after the
// oldest open read transaction began, so a backup that held one for its
// whole download let a slow or stalled client grow the live file without
// bound while commands were written.
func TestBackupHoldsNoReadTxWhileTheClientReads(t *testing.T) {
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "companion.db"), Options{})
	w := &blockingWriter{wrote: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error, 1)
	var size int64
	go func() {
		_, err := db.Backup(t.Context(), w, func(n int64) { size = n })
		done <- err
	}()
	select {
	case <-w.wrote:
	case err := <-done:
		t.Fatalf("Backup ended before it wrote: %v", err)
	}
	openTx := db.bolt.Stats().OpenTxN
	close(w.release)
	require.NoError(t, <-done)
	assert.Zero(t, openTx, "read transactions open while the client takes the backup")
	assert.Equal(t, size, int64(w.buf.Len()))
	// The copy is the store, marked as a backup.
	restored := filepath.Join(t.TempDir(), "companion.db")
	require.NoError(t, os.WriteFile(restored, w.buf.Bytes(), 0o600))
	bdb, err := bolt.Open(restored, 0o600, &bolt.Options{ReadOnly: true})
	require.NoError(t, err)
	defer bdb.Close()
	require.NoError(t, bdb.View(func(tx *bolt.Tx) error {
		assert.NotNil(t, tx.Bucket(bucketMeta).Get(keyBackup), "the copy is not marked as a backup")
		return nil
	}))
}
