package postgres

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// CreateUser stores a new user, found again by the hash of its token.
// CreatedAt is set to now when zero. It returns ErrExists when the id or
// the token hash is already taken.
func (s *Store) CreateUser(ctx context.Context, u companion.User) error {
	if !validID(u.ID) || len(u.TokenHash) == 0 {
		return fmt.Errorf("%w: user needs an id and a token hash", companion.ErrInvalid)
	}
	if u.CreatedAt.IsZero() {
		u.CreatedAt = s.clock()
	}
	// Under the id's lock, which CreateBridge holds from its check of the
	// users to its commit: a user made while a bridge of its id is being
	// made commits after it, as in the bbolt engine's order (a bridge does
	// not stop a user; a user stops a bridge made after it).
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		var b pgx.Batch
		b.Queue(`SELECT pg_advisory_xact_lock($1, $2)`, lockClassAccount, idLockKey(u.ID))
		b.Queue(`INSERT INTO users (id, name, token_hash, created_at) VALUES ($1, $2, $3, $4)`,
			u.ID, u.Name, u.TokenHash, u.CreatedAt)
		return sendBatch(ctx, tx, &b)
	}))
	if isUniqueViolation(err) {
		return companion.ErrExists
	}
	return err
}

// SetUserToken replaces the user's token hash: the old token finds nothing
// from the commit on. It takes the id's lock, as CreateUser does, so that
// it comes before or after, not inside, the Mosquitto driver's read of the
// user and write of its account (LockAccount).
func (s *Store) SetUserToken(ctx context.Context, userID string, tokenHash []byte) error {
	if len(tokenHash) == 0 {
		return fmt.Errorf("%w: a user needs a token hash", companion.ErrInvalid)
	}
	if !validID(userID) {
		return companion.ErrNotFound
	}
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		tag, err := execUnderAccountLock(ctx, tx, userID, `UPDATE users SET token_hash = $2 WHERE id = $1`, userID, tokenHash)
		if err == nil && tag.RowsAffected() == 0 {
			return companion.ErrNotFound
		}
		return err
	}))
	if isUniqueViolation(err) {
		return companion.ErrExists
	}
	return err
}

// User returns the user with the id, or ErrNotFound.
func (s *Store) User(ctx context.Context, id string) (companion.User, error) {
	if !validID(id) {
		return companion.User{}, companion.ErrNotFound
	}
	return s.user(ctx, `SELECT id, name, token_hash, created_at FROM users WHERE id = $1`, id)
}

// UserByTokenHash returns the user whose token has the SHA-256 hash, or
// ErrNotFound. The hash found through the index is compared again in
// constant time.
func (s *Store) UserByTokenHash(ctx context.Context, hash []byte) (companion.User, error) {
	if len(hash) == 0 {
		return companion.User{}, companion.ErrNotFound
	}
	u, err := s.user(ctx, `SELECT id, name, token_hash, created_at FROM users WHERE token_hash = $1`, hash)
	if err != nil {
		return companion.User{}, err
	}
	if subtle.ConstantTimeCompare(u.TokenHash, hash) != 1 {
		return companion.User{}, companion.ErrNotFound
	}
	return u, nil
}

func (s *Store) user(ctx context.Context, query string, arg any) (companion.User, error) {
	var u companion.User
	err := s.pool.QueryRow(ctx, query, arg).Scan(&u.ID, &u.Name, &u.TokenHash, &u.CreatedAt)
	if err != nil {
		return companion.User{}, notFound(err)
	}
	u.CreatedAt = u.CreatedAt.UTC()
	return u, nil
}

// notFound turns pgx.ErrNoRows into ErrNotFound.
func notFound(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return companion.ErrNotFound
	}
	return err
}

// ProvisionDevice adds a device to the registry, assigned to d.BridgeID
// when it is set: that must be one of the operator's bridges (ErrNotFound
// otherwise). CreatedAt is set to now when zero. It returns ErrExists
// when the id is taken, whatever bridge d names.
func (s *Store) ProvisionDevice(ctx context.Context, d companion.RegistryDevice) error {
	if !validID(d.ID) || (d.BridgeID != "" && !validID(d.BridgeID)) {
		return fmt.Errorf("%w: device needs an id", companion.ErrInvalid)
	}
	if d.CreatedAt.IsZero() {
		d.CreatedAt = s.clock()
	}
	return s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		// A device that exists is ErrExists whatever bridge is named, as
		// in the bbolt engine: the insert comes first, and a refused
		// bridge rolls it back.
		tag, err := tx.Exec(ctx, `INSERT INTO devices (id, model, claim_hash, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT (id) DO NOTHING`,
			d.ID, d.Model, d.ClaimHash, d.CreatedAt)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return companion.ErrExists
		}
		if d.BridgeID == "" {
			return nil
		}
		var owner string
		err = tx.QueryRow(ctx, `SELECT owner_id FROM bridges WHERE id = $1 FOR SHARE`, d.BridgeID).Scan(&owner)
		if err != nil {
			return notFound(err)
		}
		if owner != "" {
			return companion.ErrNotFound
		}
		return assign(ctx, tx, d.ID, d.BridgeID)
	}))
}

// RegistryDevice returns the provisioned device with the id, with the
// bridge it is assigned to, or ErrNotFound.
func (s *Store) RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error) {
	if !validID(id) {
		return companion.RegistryDevice{}, companion.ErrNotFound
	}
	var d companion.RegistryDevice
	err := s.pool.QueryRow(ctx, `
		SELECT d.id, d.model, d.claim_hash, d.created_at, coalesce(a.bridge_id, '')
		FROM devices d LEFT JOIN assignments a ON a.device_id = d.id
		WHERE d.id = $1`, id).Scan(&d.ID, &d.Model, &d.ClaimHash, &d.CreatedAt, &d.BridgeID)
	if err != nil {
		return companion.RegistryDevice{}, notFound(err)
	}
	d.CreatedAt = d.CreatedAt.UTC()
	return d, nil
}

// LockAccount holds the lock of the id that CreateUser and CreateBridge
// take (users and bridges share the broker's usernames) until unlock is
// called: meanwhile no user or bridge of that id is created, on this
// store or any other on the database. The Mosquitto driver holds it from
// its read of a bridge to its write of the bridge's account
// (broker/dynsec, AccountLocker; docs/reliability.md, bug 257). It is a
// transaction's lock, on a connection of the pool kept until unlock:
// PostgreSQL frees it when the session ends, also when this process dies.
// Taking it waits at most LockTimeout, as the store's other locks do.
func (s *Store) LockAccount(ctx context.Context, id string) (unlock func(), err error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	end := func() {
		// A rollback that fails leaves the connection out of the pool,
		// closed, and the lock with it.
		ctx, cancel := context.WithTimeout(context.Background(), LockTimeout)
		defer cancel()
		_ = tx.Rollback(ctx)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, $2)`, lockClassAccount, idLockKey(id)); err != nil {
		end()
		return nil, err
	}
	return end, nil
}

// CreateBridge stores a new bridge, found again by the hash of its secret
// (and by its owner, for a user's own). CreatedAt is set to now when zero.
// It returns ErrExists when the id or the secret hash is already taken,
// the id also by a user: bridges and users log in to the broker alike.
func (s *Store) CreateBridge(ctx context.Context, b companion.Bridge) error {
	if !validID(b.ID) || len(b.SecretHash) == 0 || (b.OwnerID != "" && !validID(b.OwnerID)) {
		return fmt.Errorf("%w: bridge needs an id and a secret hash", companion.ErrInvalid)
	}
	if b.CreatedAt.IsZero() {
		b.CreatedAt = s.clock()
	}
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		// The id's lock first, which CreateUser takes too: the check of
		// the users and the insert are one step for it. Without it a user
		// committed between the two (another replica's, or this one's)
		// did not stop the bridge, although it was there to be seen
		// before the bridge was.
		tag, err := execUnderAccountLock(ctx, tx, b.ID, `INSERT INTO bridges (id, secret_hash, owner_id, created_at) SELECT $1, $2, $3, $4
			WHERE NOT EXISTS (SELECT 1 FROM users WHERE id = $1)`,
			b.ID, b.SecretHash, b.OwnerID, b.CreatedAt)
		if err == nil && tag.RowsAffected() == 0 {
			return companion.ErrExists // a user's id
		}
		return err
	}))
	if isUniqueViolation(err) {
		return companion.ErrExists
	}
	return err
}

// SetBridgeSecret replaces the bridge's secret hash: the old secret finds
// nothing from the commit on. It takes the id's lock, as CreateBridge
// does, so that it comes before or after, not inside, the Mosquitto
// driver's read of the bridge and write of its account (LockAccount).
func (s *Store) SetBridgeSecret(ctx context.Context, bridgeID, ownerID string, secretHash []byte) error {
	if len(secretHash) == 0 {
		return fmt.Errorf("%w: a bridge needs a secret hash", companion.ErrInvalid)
	}
	if !validID(bridgeID) {
		return companion.ErrNotFound
	}
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, $2)`, lockClassAccount, idLockKey(bridgeID)); err != nil {
			return err
		}
		var owner string
		if err := tx.QueryRow(ctx, `SELECT owner_id FROM bridges WHERE id = $1 FOR UPDATE`, bridgeID).Scan(&owner); err != nil {
			return notFound(err)
		}
		if ownerID != "" && owner != ownerID {
			return companion.ErrNotOwned
		}
		_, err := tx.Exec(ctx, `UPDATE bridges SET secret_hash = $2 WHERE id = $1`, bridgeID, secretHash)
		return err
	}))
	if isUniqueViolation(err) {
		return companion.ErrExists
	}
	return err
}

const bridgeColumns = `id, secret_hash, owner_id, created_at`

// execUnderAccountLock takes the lock of the account id (CreateUser's,
// CreateBridge's, LockAccount's) and runs sql in tx, in one round trip,
// and returns sql's command tag.
func execUnderAccountLock(ctx context.Context, tx pgx.Tx, id, sql string, args ...any) (pgconn.CommandTag, error) {
	var b pgx.Batch
	b.Queue(`SELECT pg_advisory_xact_lock($1, $2)`, lockClassAccount, idLockKey(id))
	b.Queue(sql, args...)
	br := tx.SendBatch(ctx, &b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if err != nil {
		_ = br.Close()
		return pgconn.CommandTag{}, err
	}
	return tag, br.Close()
}

func scanBridge(row pgx.Row) (companion.Bridge, error) {
	var b companion.Bridge
	if err := row.Scan(&b.ID, &b.SecretHash, &b.OwnerID, &b.CreatedAt); err != nil {
		return companion.Bridge{}, notFound(err)
	}
	b.CreatedAt = b.CreatedAt.UTC()
	return b, nil
}

// Bridge returns the bridge with the id, or ErrNotFound.
func (s *Store) Bridge(ctx context.Context, id string) (companion.Bridge, error) {
	if !validID(id) {
		return companion.Bridge{}, companion.ErrNotFound
	}
	return scanBridge(s.pool.QueryRow(ctx, `SELECT `+bridgeColumns+` FROM bridges WHERE id = $1`, id))
}

// BridgeBySecretHash returns the bridge whose secret has the SHA-256 hash,
// or ErrNotFound. The hash is compared again in constant time.
func (s *Store) BridgeBySecretHash(ctx context.Context, hash []byte) (companion.Bridge, error) {
	if len(hash) == 0 {
		return companion.Bridge{}, companion.ErrNotFound
	}
	b, err := scanBridge(s.pool.QueryRow(ctx, `SELECT `+bridgeColumns+` FROM bridges WHERE secret_hash = $1`, hash))
	if err != nil {
		return companion.Bridge{}, err
	}
	if subtle.ConstantTimeCompare(b.SecretHash, hash) != 1 {
		return companion.Bridge{}, companion.ErrNotFound
	}
	return b, nil
}
