package store

import (
	"context"
	"crypto/subtle"
	"fmt"
	"sync"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// CreateUser stores a new user, indexed by the hash of its token.
// CreatedAt is set to now when zero. It returns ErrExists when the id or
// the token hash is already taken.
func (db *DB) CreateUser(ctx context.Context, u companion.User) error {
	if !validID(u.ID) || len(u.TokenHash) == 0 {
		return fmt.Errorf("%w: user needs an id and a token hash", companion.ErrInvalid)
	}
	if u.CreatedAt.IsZero() {
		u.CreatedAt = db.now()
	}
	return db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		users, tokens := tx.Bucket(bucketUsers), tx.Bucket(bucketUserTokens)
		if users.Get([]byte(u.ID)) != nil || tokens.Get(u.TokenHash) != nil {
			return abort(companion.ErrExists)
		}
		if err := putJSON(users, []byte(u.ID), u); err != nil {
			return err
		}
		return tokens.Put(u.TokenHash, []byte(u.ID))
	}))
}

// SetUserToken replaces the user's token hash, and its index entry, in
// one transaction: the old token finds nothing from its return on.
func (db *DB) SetUserToken(ctx context.Context, userID string, tokenHash []byte) error {
	if len(tokenHash) == 0 {
		return fmt.Errorf("%w: a user needs a token hash", companion.ErrInvalid)
	}
	if !validID(userID) {
		return companion.ErrNotFound
	}
	defer db.tokens.changed() // the old token finds nothing from here on
	return db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		users, tokens := tx.Bucket(bucketUsers), tx.Bucket(bucketUserTokens)
		var u companion.User
		switch ok, err := getJSON(users, []byte(userID), &u); {
		case err != nil:
			return err
		case !ok:
			return abort(companion.ErrNotFound)
		case tokens.Get(tokenHash) != nil:
			return abort(companion.ErrExists)
		}
		if err := tokens.Delete(u.TokenHash); err != nil {
			return err
		}
		u.TokenHash = tokenHash
		if err := putJSON(users, []byte(u.ID), u); err != nil {
			return err
		}
		return tokens.Put(tokenHash, []byte(u.ID))
	}))
}

// UserByTokenHash returns the user whose token has the SHA-256 hash, or
// ErrNotFound. The hash found through the index is compared again in
// constant time. Every request of a user's asks it, so its answers are
// kept in memory (tokenCache) until a token changes.
func (db *DB) UserByTokenHash(ctx context.Context, hash []byte) (companion.User, error) {
	if u, ok := db.tokens.get(hash); ok {
		return u, nil
	}
	gen := db.tokens.generation()
	var u companion.User
	err := db.bolt.View(func(tx *bolt.Tx) error {
		id := tx.Bucket(bucketUserTokens).Get(hash)
		if id == nil {
			return companion.ErrNotFound
		}
		ok, err := getJSON(tx.Bucket(bucketUsers), id, &u)
		if err != nil {
			return err
		}
		if !ok {
			return companion.ErrNotFound
		}
		return nil
	})
	if err != nil {
		return companion.User{}, err
	}
	if subtle.ConstantTimeCompare(u.TokenHash, hash) != 1 {
		return companion.User{}, companion.ErrNotFound
	}
	db.tokens.put(gen, u)
	return u, nil
}

// tokenCache keeps UserByTokenHash's answers: a user record read per
// request was a read transaction, two bucket lookups and a JSON decoding
// on every call of the API (docs/performance.md). Only tokens found are
// kept, so it holds at most one entry per user; a change of any token
// empties it (changed), and an answer read before the change is not kept
// after it: its generation is older.
type tokenCache struct {
	mu    sync.RWMutex
	gen   uint64
	users map[string]companion.User // by token hash
}

// maxCachedTokens bounds the cache: past it, it starts again empty.
const maxCachedTokens = 1 << 16

func (c *tokenCache) get(hash []byte) (companion.User, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	u, ok := c.users[string(hash)]
	return u, ok
}

func (c *tokenCache) generation() uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.gen
}

// put keeps u, read at generation gen, unless a token changed since.
func (c *tokenCache) put(gen uint64, u companion.User) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen != c.gen {
		return
	}
	if c.users == nil || len(c.users) >= maxCachedTokens {
		c.users = map[string]companion.User{}
	}
	c.users[string(u.TokenHash)] = u
}

// changed empties the cache: call it once a change of a token has
// committed (or failed).
func (c *tokenCache) changed() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	c.users = nil
}

// User returns the user with the id, or ErrNotFound.
func (db *DB) User(ctx context.Context, id string) (companion.User, error) {
	var u companion.User
	if err := db.get(bucketUsers, []byte(id), &u); err != nil {
		return companion.User{}, err
	}
	return u, nil
}

// ProvisionDevice adds a device to the registry, assigned to d.BridgeID
// when it is set: that must be one of the operator's bridges (ErrNotFound
// otherwise; a user's own bridge serves only devices bound to that user).
// CreatedAt is set to now when zero. It returns ErrExists when the id is
// taken, whatever bridge d names.
func (db *DB) ProvisionDevice(ctx context.Context, d companion.RegistryDevice) error {
	if !validID(d.ID) || (d.BridgeID != "" && !validID(d.BridgeID)) {
		return fmt.Errorf("%w: device needs an id", companion.ErrInvalid)
	}
	if d.CreatedAt.IsZero() {
		d.CreatedAt = db.now()
	}
	return db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		devices := tx.Bucket(bucketDevices)
		if devices.Get([]byte(d.ID)) != nil {
			return abort(companion.ErrExists)
		}
		if d.BridgeID != "" {
			var b companion.Bridge
			ok, err := getJSON(tx.Bucket(bucketBridges), []byte(d.BridgeID), &b)
			if err != nil {
				return err
			}
			if !ok || b.OwnerID != "" {
				return abort(companion.ErrNotFound)
			}
			if err := assign(tx, d.ID, d.BridgeID); err != nil {
				return err
			}
		}
		return putJSON(devices, []byte(d.ID), d)
	}))
}

// RegistryDevice returns the provisioned device with the id, with the
// bridge it is assigned to, or ErrNotFound.
func (db *DB) RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error) {
	var d companion.RegistryDevice
	if len(id) == 0 {
		return companion.RegistryDevice{}, companion.ErrNotFound
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		ok, err := getJSON(tx.Bucket(bucketDevices), []byte(id), &d)
		if err != nil {
			return err
		}
		if !ok {
			return companion.ErrNotFound
		}
		d.BridgeID = string(tx.Bucket(bucketAssignments).Get([]byte(id)))
		return nil
	})
	if err != nil {
		return companion.RegistryDevice{}, err
	}
	return d, nil
}

// CreateBridge stores a new bridge, indexed by the hash of its secret (and
// by its owner, for a user's own). CreatedAt is set to now when zero. It
// returns ErrExists when the id or the secret hash is already taken, the
// id also by a user: bridges and users log in to the broker alike, the id
// their username, and a user may name their own bridges.
func (db *DB) CreateBridge(ctx context.Context, b companion.Bridge) error {
	if !validID(b.ID) || len(b.SecretHash) == 0 || (b.OwnerID != "" && !validID(b.OwnerID)) {
		return fmt.Errorf("%w: bridge needs an id and a secret hash", companion.ErrInvalid)
	}
	if b.CreatedAt.IsZero() {
		b.CreatedAt = db.now()
	}
	return db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		bridges, secrets := tx.Bucket(bucketBridges), tx.Bucket(bucketBridgeSecrets)
		if bridges.Get([]byte(b.ID)) != nil || secrets.Get(b.SecretHash) != nil || tx.Bucket(bucketUsers).Get([]byte(b.ID)) != nil {
			return abort(companion.ErrExists)
		}
		if err := putJSON(bridges, []byte(b.ID), b); err != nil {
			return err
		}
		if b.OwnerID != "" {
			if err := tx.Bucket(bucketOwnerBridges).Put(key(b.OwnerID, b.ID), nil); err != nil {
				return err
			}
		}
		return secrets.Put(b.SecretHash, []byte(b.ID))
	}))
}

// Bridge returns the bridge with the id, or ErrNotFound.
func (db *DB) Bridge(ctx context.Context, id string) (companion.Bridge, error) {
	var b companion.Bridge
	if err := db.get(bucketBridges, []byte(id), &b); err != nil {
		return companion.Bridge{}, err
	}
	return b, nil
}

// SetBridgeSecret replaces the bridge's secret hash, and its index entry,
// in one transaction: the old secret finds nothing from its commit on.
func (db *DB) SetBridgeSecret(ctx context.Context, bridgeID, ownerID string, secretHash []byte) error {
	if len(secretHash) == 0 {
		return fmt.Errorf("%w: a bridge needs a secret hash", companion.ErrInvalid)
	}
	if !validID(bridgeID) {
		return companion.ErrNotFound
	}
	return db.update(db.answered(ctx, func(tx *bolt.Tx) error {
		bridges, secrets := tx.Bucket(bucketBridges), tx.Bucket(bucketBridgeSecrets)
		var b companion.Bridge
		switch ok, err := getJSON(bridges, []byte(bridgeID), &b); {
		case err != nil:
			return err
		case !ok:
			return abort(companion.ErrNotFound)
		case ownerID != "" && b.OwnerID != ownerID:
			return abort(companion.ErrNotOwned)
		case secrets.Get(secretHash) != nil:
			return abort(companion.ErrExists)
		}
		if err := secrets.Delete(b.SecretHash); err != nil {
			return err
		}
		b.SecretHash = secretHash
		if err := putJSON(bridges, []byte(b.ID), b); err != nil {
			return err
		}
		return secrets.Put(secretHash, []byte(b.ID))
	}))
}

// BridgeBySecretHash returns the bridge whose secret has the SHA-256 hash,
// or ErrNotFound. The hash is compared again in constant time.
func (db *DB) BridgeBySecretHash(ctx context.Context, hash []byte) (companion.Bridge, error) {
	var b companion.Bridge
	err := db.bolt.View(func(tx *bolt.Tx) error {
		id := tx.Bucket(bucketBridgeSecrets).Get(hash)
		if id == nil {
			return companion.ErrNotFound
		}
		ok, err := getJSON(tx.Bucket(bucketBridges), id, &b)
		if err != nil {
			return err
		}
		if !ok {
			return companion.ErrNotFound
		}
		return nil
	})
	if err != nil {
		return companion.Bridge{}, err
	}
	if subtle.ConstantTimeCompare(b.SecretHash, hash) != 1 {
		return companion.Bridge{}, companion.ErrNotFound
	}
	return b, nil
}

// get decodes the value at k of the bucket into v, or returns ErrNotFound.
func (db *DB) get(bucket, k []byte, v any) error {
	if len(k) == 0 {
		return companion.ErrNotFound
	}
	return db.bolt.View(func(tx *bolt.Tx) error {
		ok, err := getJSON(tx.Bucket(bucket), k, v)
		if err != nil {
			return err
		}
		if !ok {
			return companion.ErrNotFound
		}
		return nil
	})
}
