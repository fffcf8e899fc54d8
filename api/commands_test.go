package api

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

// unbindingStore unbinds each device right after the API has read its
// binding: an unbind that commits while the request's body is read.
type unbindingStore struct{ *store.DB }

func (s unbindingStore) Binding(ctx context.Context, id string) (companion.Binding, error) {
	b, err := s.DB.Binding(ctx, id)
	if err == nil {
		_, _ = s.DB.Unbind(ctx, id, b.UserID)
	}
	return b, err
}

// A command whose device is unbound after the API checked it is refused
// as the device of another (404), not stored for the device's next owner
// (CONTRACT §9).
func TestCommandAcrossAnUnbindIsRefused(t *testing.T) {
	base := newEnv(t)
	tok := base.bound("dev-1")
	e := newEnvWith(t, base.db, unbindingStore{base.db})
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "too late"})
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
	n, err := base.db.CountOpen(context.Background(), "dev-1")
	require.NoError(t, err)
	assert.Zero(t, n, "a command was stored for the unbound device")
}
