package store

import (
	"fmt"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// ProvisionDevices is ProvisionDevice for many devices in one write
// transaction. It exists for the scale benchmark (scale_test.go), which
// provisions a million devices: ProvisionDevice commits (and fsyncs) each
// one alone, which would take longer than everything the benchmark measures.
// The whole call fails, writing nothing, if one device is invalid or exists.
func (db *DB) ProvisionDevices(ds []companion.RegistryDevice) error {
	now := db.now()
	return db.update(func(tx *bolt.Tx) error {
		devices := tx.Bucket(bucketDevices)
		for _, d := range ds {
			if !validID(d.ID) {
				return fmt.Errorf("%w: device needs an id", companion.ErrInvalid)
			}
			if d.CreatedAt.IsZero() {
				d.CreatedAt = now
			}
			if devices.Get([]byte(d.ID)) != nil {
				return fmt.Errorf("device %s: %w", d.ID, companion.ErrExists)
			}
			if err := putJSON(devices, []byte(d.ID), d); err != nil {
				return err
			}
		}
		return nil
	})
}

// DataSize returns the bytes of the bbolt file up to its highest page in
// use: the file's size without the room bbolt grows it by in advance
// (16 MiB at a time). Pages freed below that mark are reused by later
// writes, so they are counted.
func (db *DB) DataSize() (int64, error) {
	var n int64
	err := db.bolt.View(func(tx *bolt.Tx) error {
		n = tx.Size()
		return nil
	})
	return n, err
}
