package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

// Bind ties a provisioned device to b.UserID. The model is copied from the
// registry and BoundAt is set to now when zero. It returns (b, true, nil)
// when it created the binding, (existing, false, nil) when the device is
// already bound to the same user, ErrBoundToOther when it is bound to
// another user, and ErrNotFound when the device was never provisioned.
// An answer ctx carries (companion.WithAnswer) is stored with the binding
// it creates, and only then.
func (s *Store) Bind(ctx context.Context, b companion.Binding) (companion.Binding, bool, error) {
	if !validID(b.DeviceID) || !validID(b.UserID) {
		return companion.Binding{}, false, fmt.Errorf("%w: binding needs a device id and a user id", companion.ErrInvalid)
	}
	if b.BoundAt.IsZero() {
		b.BoundAt = s.clock()
	}
	b.BoundAt = pgTime(b.BoundAt)
	var (
		out     companion.Binding
		created bool
	)
	answer, keyed, err := answerOf(ctx)
	if err != nil {
		return companion.Binding{}, false, err
	}
	bind := func(tx pgx.Tx) error {
		out, created = companion.Binding{}, false
		// A device's row is the lock of its binding and assignment.
		var model string
		if err := tx.QueryRow(ctx, `SELECT model FROM devices WHERE id = $1 FOR UPDATE`, b.DeviceID).Scan(&model); err != nil {
			return notFound(err)
		}
		existing, err := scanBinding(tx.QueryRow(ctx, `SELECT `+bindingColumns+` FROM bindings WHERE device_id = $1`, b.DeviceID))
		switch {
		case err == nil && existing.UserID != b.UserID:
			return companion.ErrBoundToOther
		case err == nil:
			out = existing
			return nil
		case !errors.Is(err, companion.ErrNotFound):
			return err
		}
		nb := b
		nb.Model = model
		_, err = tx.Exec(ctx, `INSERT INTO bindings (device_id, user_id, name, model, bound_at) VALUES ($1, $2, $3, $4, $5)`,
			nb.DeviceID, nb.UserID, nb.Name, nb.Model, nb.BoundAt)
		if err != nil {
			return err
		}
		out, created = nb, true
		return nil
	}
	if keyed {
		// The request's answer (a 201) is its only when it binds: one
		// for a device bound already is answered, and recorded, after.
		bind = s.answerIn(ctx, answer, bind, &created)
	}
	if err := s.tx(ctx, bind); err != nil {
		return companion.Binding{}, false, err
	}
	return out, created, nil
}

const bindingColumns = `device_id, user_id, name, model, bound_at`

func scanBinding(row pgx.Row) (companion.Binding, error) {
	var b companion.Binding
	if err := row.Scan(&b.DeviceID, &b.UserID, &b.Name, &b.Model, &b.BoundAt); err != nil {
		return companion.Binding{}, notFound(err)
	}
	b.BoundAt = b.BoundAt.UTC()
	return b, nil
}

// Unbind removes the binding of the device to userID. It returns
// ErrNotFound unless the device is bound to that user. In the same
// transaction it ends the user's unfinished commands of the device
// (companion.EndUnbound) and drops its desired settings: those were the
// user's wishes, not the next owner's. Status, reported settings and the
// history of commands stay, and so does its assignment to one of the
// operator's bridges; one of the user's own bridges stops serving it (it
// reads offline then). The result says which bridge, and which commands.
func (s *Store) Unbind(ctx context.Context, deviceID, userID string) (companion.Unbound, error) {
	if !validID(deviceID) || !validID(userID) {
		return companion.Unbound{}, companion.ErrNotFound
	}
	var out companion.Unbound
	err := s.tx(ctx, s.answered(ctx, func(tx pgx.Tx) error {
		out = companion.Unbound{}
		var one int
		if err := tx.QueryRow(ctx, `SELECT 1 FROM devices WHERE id = $1 FOR UPDATE`, deviceID).Scan(&one); err != nil {
			return notFound(err)
		}
		tag, err := tx.Exec(ctx, `DELETE FROM bindings WHERE device_id = $1 AND user_id = $2`, deviceID, userID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return companion.ErrNotFound
		}
		if out.Ended, err = s.endUnbound(ctx, tx, deviceID, userID); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE settings SET desired = '{}', updated_at = $2 WHERE device_id = $1 AND desired::text <> '{}'`,
			deviceID, s.clock()); err != nil {
			return err
		}
		err = tx.QueryRow(ctx, `DELETE FROM assignments a USING bridges b
			WHERE a.device_id = $1 AND b.id = a.bridge_id AND b.owner_id = $2
			RETURNING a.bridge_id`, deviceID, userID).Scan(&out.Bridge)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		return s.markUnserved(ctx, tx, deviceID, s.clock())
	}))
	if err != nil {
		return companion.Unbound{}, err
	}
	return out, nil
}

// endUnbound ends the user's unfinished commands of the device in tx
// (companion.EndUnbound) and returns them, oldest first. It locks them all
// first, in id order, before it writes the device's count of open
// commands, as UpdateCommand takes its command and then that count.
func (s *Store) endUnbound(ctx context.Context, tx pgx.Tx, deviceID, userID string) ([]companion.Command, error) {
	rows, err := tx.Query(ctx, `SELECT id::text FROM commands
		WHERE device_id = $1 AND user_id = $2 AND state IN ($3, $4, $5, $6)
		ORDER BY id FOR UPDATE`,
		deviceID, userID, companion.StateQueued, companion.StateSent, companion.StateDelivered, companion.StateInProgress)
	if err != nil {
		return nil, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	var ended []companion.Command
	for _, id := range ids {
		c, final, err := s.updateCommand(ctx, tx, id, func(c *companion.Command) error {
			companion.EndUnbound(c)
			return nil
		})
		if err != nil {
			return nil, err
		}
		if !final {
			ended = append(ended, c)
		}
	}
	return ended, nil
}

// Binding returns the binding of the device, or ErrNotFound when it is not
// bound.
func (s *Store) Binding(ctx context.Context, deviceID string) (companion.Binding, error) {
	if !validID(deviceID) {
		return companion.Binding{}, companion.ErrNotFound
	}
	return scanBinding(s.pool.QueryRow(ctx, `SELECT `+bindingColumns+` FROM bindings WHERE device_id = $1`, deviceID))
}

// ListBindings returns the bindings of the user in device-id order,
// starting after the device id `after` ("" starts at the beginning), at
// most limit of them (limit <= 0: all). An `after` containing a NUL byte
// is ErrInvalidCursor.
func (s *Store) ListBindings(ctx context.Context, userID, after string, limit int) ([]companion.Binding, error) {
	if strings.ContainsRune(after, 0) {
		return nil, companion.ErrInvalidCursor
	}
	out := make([]companion.Binding, 0, pageCap(limit))
	if !validID(userID) {
		return out, nil
	}
	rows, err := s.pool.Query(ctx, `SELECT `+bindingColumns+` FROM bindings
		WHERE user_id = $1 AND device_id > $2 ORDER BY device_id LIMIT $3`, userID, after, listLimit(limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		b, err := scanBinding(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}

// listLimit is the LIMIT of a query for at most limit items (limit <= 0:
// all).
func listLimit(limit int) any {
	if limit <= 0 {
		return nil
	}
	return limit
}

// ListDevices is ListBindings with each device's status, read by the same
// query.
func (s *Store) ListDevices(ctx context.Context, userID, after string, limit int) ([]companion.BoundDevice, error) {
	if strings.ContainsRune(after, 0) {
		return nil, companion.ErrInvalidCursor
	}
	out := make([]companion.BoundDevice, 0, pageCap(limit))
	if !validID(userID) {
		return out, nil
	}
	rows, err := s.pool.Query(ctx, `SELECT b.device_id, b.user_id, b.name, b.model, b.bound_at,
		`+statusColumnsOf("st")+`
		FROM bindings b LEFT JOIN statuses st ON st.device_id = b.device_id
		WHERE b.user_id = $1 AND b.device_id > $2 ORDER BY b.device_id LIMIT $3`, userID, after, listLimit(limit))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var bd companion.BoundDevice
		b := &bd.Binding
		var sr statusRow
		if err := rows.Scan(append([]any{&b.DeviceID, &b.UserID, &b.Name, &b.Model, &b.BoundAt}, sr.dest()...)...); err != nil {
			return nil, err
		}
		b.BoundAt = b.BoundAt.UTC()
		st, err := sr.status(b.DeviceID)
		if err != nil {
			return nil, err
		}
		bd.Status = st
		out = append(out, bd)
	}
	return out, rows.Err()
}
