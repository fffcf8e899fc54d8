package store

import (
	"context"
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
// oldest and stops at the first command created after olderThan.
func (db *DB) PurgeCommands(ctx context.Context, olderThan time.Time) (int, error) {
	return db.purgeInBatches(ctx, func(tx *bolt.Tx, batch int) (int, bool, error) {
		cmds := tx.Bucket(bucketCommands)
		hist, staged := tx.Bucket(bucketDeviceCmds), tx.Bucket(bucketDeviceCmdsNew)
		var doomed []companion.Command
		more := false
		c := cmds.Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			var cmd companion.Command
			if err := fastjson.Unmarshal(v, &cmd); err != nil {
				return 0, false, err
			}
			if !cmd.CreatedAt.Before(olderThan) {
				break
			}
			if len(doomed) == batch {
				more = true
				break
			}
			if companion.IsFinal(cmd.State) && cmd.UpdatedAt.Before(olderThan) {
				doomed = append(doomed, cmd)
			}
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
	}
}
