package store

import (
	"bytes"
	"context"
	"fmt"
	"strings"

	bolt "go.etcd.io/bbolt"
)

// Bind ties a provisioned device to b.UserID. The model is copied from the
// registry and BoundAt is set to now when zero. It returns (b, true, nil)
// when it created the binding, (existing, false, nil) when the device is
// already bound to the same user, ErrBoundToOther when it is bound to
// another user, and ErrNotFound when the device was never provisioned.
// Checking the claim code is the caller's job.
func (db *DB) Bind(ctx context.Context, b Binding) (Binding, bool, error) {
	if !validID(b.DeviceID) || !validID(b.UserID) {
		return Binding{}, false, fmt.Errorf("%w: binding needs a device id and a user id", ErrInvalid)
	}
	if b.BoundAt.IsZero() {
		b.BoundAt = db.now()
	}
	var (
		out     Binding
		created bool
	)
	err := db.batch(func(tx *bolt.Tx) error {
		out, created = Binding{}, false
		var dev RegistryDevice
		ok, err := getJSON(tx.Bucket(bucketDevices), []byte(b.DeviceID), &dev)
		if err != nil {
			return err
		}
		if !ok {
			return abort(ErrNotFound)
		}
		bindings := tx.Bucket(bucketBindings)
		var existing Binding
		ok, err = getJSON(bindings, []byte(b.DeviceID), &existing)
		if err != nil {
			return err
		}
		if ok {
			if existing.UserID != b.UserID {
				return abort(ErrBoundToOther)
			}
			out = existing
			return nil
		}
		nb := b
		nb.Model = dev.Model
		if err := putJSON(bindings, []byte(nb.DeviceID), nb); err != nil {
			return err
		}
		if err := tx.Bucket(bucketUserBindings).Put(key(nb.UserID, nb.DeviceID), nil); err != nil {
			return err
		}
		out, created = nb, true
		return nil
	})
	if err != nil {
		return Binding{}, false, err
	}
	return out, created, nil
}

// Unbind removes the binding of the device to userID. It returns
// ErrNotFound unless the device is bound to that user. Status, settings
// and commands of the device stay.
func (db *DB) Unbind(ctx context.Context, deviceID, userID string) error {
	if !validID(deviceID) || !validID(userID) {
		return ErrNotFound
	}
	return db.batch(func(tx *bolt.Tx) error {
		bindings := tx.Bucket(bucketBindings)
		var existing Binding
		ok, err := getJSON(bindings, []byte(deviceID), &existing)
		if err != nil {
			return err
		}
		if !ok || existing.UserID != userID {
			return abort(ErrNotFound)
		}
		if err := bindings.Delete([]byte(deviceID)); err != nil {
			return err
		}
		return tx.Bucket(bucketUserBindings).Delete(key(userID, deviceID))
	})
}

// Binding returns the binding of the device, or ErrNotFound when it is not
// bound.
func (db *DB) Binding(ctx context.Context, deviceID string) (Binding, error) {
	var b Binding
	if err := db.get(bucketBindings, []byte(deviceID), &b); err != nil {
		return Binding{}, err
	}
	return b, nil
}

// ListBindings returns the bindings of the user in device-id order,
// starting after the device id `after` ("" starts at the beginning), at
// most limit of them (limit <= 0: all). An `after` containing a NUL byte
// is ErrInvalidCursor.
func (db *DB) ListBindings(ctx context.Context, userID, after string, limit int) ([]Binding, error) {
	if strings.ContainsRune(after, 0) {
		return nil, ErrInvalidCursor
	}
	if !validID(userID) {
		return []Binding{}, nil
	}
	out := []Binding{}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		bindings := tx.Bucket(bucketBindings)
		p := prefix(userID)
		c := tx.Bucket(bucketUserBindings).Cursor()
		start := append(bytes.Clone(p), after...)
		k, _ := c.Seek(start)
		if after != "" && bytes.Equal(k, start) {
			k, _ = c.Next()
		}
		for ; k != nil && bytes.HasPrefix(k, p); k, _ = c.Next() {
			if limit > 0 && len(out) >= limit {
				break
			}
			var b Binding
			ok, err := getJSON(bindings, k[len(p):], &b)
			if err != nil {
				return err
			}
			if ok && b.UserID == userID {
				out = append(out, b)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
