package store

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"
)

// A file whose events a build from before the purge's mark (8b0d0c9)
// purged has no mark (or, taken back to that build for a while, a stale
// one): EventsPurgedAfter still tells a cursor before the
// events those purges deleted, from the log itself, so that a client
// that resumes across the upgrade gets its reset (docs/reliability.md,
// bug 304).
func TestEventsPurgedAfterOnAFileOlderThanTheMark(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	db := openTestDBWith(t, t.TempDir()+"/companion.db", Options{Now: func() time.Time { return now }})
	ctx := t.Context()
	// Events 1 to 3 three hours old, 4 and 5 new.
	require.NoError(t, db.update(func(tx *bolt.Tx) error {
		for i := range 5 {
			at := now
			if i < 3 {
				at = now.Add(-3 * time.Hour)
			}
			if err := db.appendEvent(tx, companion.Event{Kind: companion.EventDevice, UserID: "u1", DeviceID: "d1", At: at}); err != nil {
				return err
			}
		}
		return nil
	}))
	// oldPurge purges as the builds before the mark did: the same
	// deletions, no mark.
	oldPurge := func(olderThan time.Time) {
		t.Helper()
		_, err := db.PurgeEvents(ctx, olderThan)
		require.NoError(t, err)
		require.NoError(t, db.update(func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Delete(keyEventsPurged) }))
	}
	purgedAfter := func(seq uint64) bool {
		t.Helper()
		purged, err := db.EventsPurgedAfter(ctx, eventID(seq))
		require.NoError(t, err)
		return purged
	}

	for seq := range uint64(6) {
		assert.False(t, purgedAfter(seq), "EventsPurgedAfter(%d) before any purge", seq)
	}
	oldPurge(now.Add(-2 * time.Hour))
	for seq := range uint64(3) {
		assert.True(t, purgedAfter(seq), "EventsPurgedAfter(%d) after an old build purged 1 to 3", seq)
	}
	for seq := uint64(3); seq <= 5; seq++ {
		assert.False(t, purgedAfter(seq), "EventsPurgedAfter(%d) after an old build purged 1 to 3", seq)
	}
	// A stale mark: this build purged event 1, then the old build, taken
	// back to, purged 2 and 3.
	require.NoError(t, db.update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put(keyEventsPurged, binary.BigEndian.AppendUint64(nil, 1))
	}))
	assert.True(t, purgedAfter(2), "EventsPurgedAfter(2) with the mark at 1 and the old build's purge of 2 and 3")
	assert.False(t, purgedAfter(3), "EventsPurgedAfter(3) with the mark at 1 and the old build's purge of 2 and 3")
	oldPurge(now.Add(time.Minute))
	assert.True(t, purgedAfter(4), "EventsPurgedAfter(4) after an old build purged every event")
	assert.False(t, purgedAfter(5), "EventsPurgedAfter(5) after an old build purged every event")
}
