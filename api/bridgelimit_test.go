package api

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

// TestUserBridgesAreBounded: a user has at most MaxBridgesPerUser bridges
// of their own; past them a creation is a 422 naming bridge_id, and the
// broker's accounts hear nothing of it. Unbounded, one user's token made
// bridges at the request rate, each a record and, on Mosquitto, a client
// and a role of the dynamic-security plugin, which writes its whole
// configuration again on every change. The operator's bridges, and
// another user's, are not counted.
func TestUserBridgesAreBounded(t *testing.T) {
	acc := &recordingAccounts{}
	e := &bridgesEnv{env: newEnv(t, func(o *Options) {
		o.BrokerAccounts = acc
		o.Limits.MaxBridgesPerUser = 3
	}), acc: acc}
	e.alice, e.bob = e.bound("dev-a"), e.bound("dev-b")
	acc.took()
	path := "/api/v1/bridges"
	for i := range 3 {
		r := e.do("POST", path, e.alice, map[string]any{"bridge_id": fmt.Sprintf("alice-%d", i)})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	acc.took()
	r := e.do("POST", path, e.alice, map[string]any{"bridge_id": "alice-3"})
	require.Equal(t, 422, r.status, "a fourth bridge of one user: %s", r.body)
	p := r.problem(t)
	assert.Equal(t, CodeValidationFailed, p.Code)
	require.Len(t, p.Errors, 1)
	assert.Equal(t, "bridge_id", p.Errors[0].Field)
	assert.Contains(t, p.Errors[0].Message, "3 bridges")
	assert.Empty(t, acc.took(), "a refused bridge was told to the broker")

	r = e.do("POST", path, e.bob, map[string]any{"bridge_id": "bob-0"})
	assert.Equal(t, 201, r.status, "another user: %s", r.body)
	for i := range 4 {
		r := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": fmt.Sprintf("op-%d", i)})
		assert.Equal(t, 201, r.status, "the operator's: %s", r.body)
	}
	require.Equal(t, 204, e.do("DELETE", path+"/alice-0", e.alice, nil).status)
	r = e.do("POST", path, e.alice, map[string]any{"bridge_id": "alice-3"})
	assert.Equal(t, 201, r.status, "one deleted makes room: %s", r.body)
}

// devicesReadStore counts the devices its ListBridges reads.
type devicesReadStore struct {
	*store.DB
	devices atomic.Int64
}

func (s *devicesReadStore) ListBridges(ctx context.Context, ownerID, after string, limit int) ([]companion.ServingBridge, bool, error) {
	bs, more, err := s.DB.ListBridges(ctx, ownerID, after, limit)
	for _, b := range bs {
		s.devices.Add(int64(len(b.Devices)))
	}
	return bs, more, err
}

// TestCreatingABridgeReadsNoDevices: the bound on a user's bridges is
// counted from the bridges alone. It was counted with a page of
// ListBridges, which reads every device each bridge serves: a bridge's
// creation cost as much as all the user's devices (bug 367).
func TestCreatingABridgeReadsNoDevices(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	st := &devicesReadStore{DB: db}
	e := newEnvWith(t, db, st, func(o *Options) { o.Limits.MaxBridgesPerUser = 3 })
	alice := e.bound("dev-0")
	path := "/api/v1/bridges"
	r := e.do("POST", path, alice, map[string]any{"bridge_id": "home"})
	require.Equal(t, 201, r.status, "%s", r.body)
	const devices = 20
	for i := range devices {
		id := fmt.Sprintf("dev-%d", i)
		if i > 0 {
			e.provision(id, "code-"+id, "sim-1")
			r := e.do("POST", "/api/v1/devices/register", alice, map[string]any{"device_id": id, "claim_code": "code-" + id})
			require.Equal(t, 201, r.status, "%s", r.body)
		}
		r := e.do("PUT", "/api/v1/devices/"+id+"/bridge", alice, map[string]any{"bridge_id": "home"})
		require.Equal(t, 200, r.status, "%s", r.body)
	}

	st.devices.Store(0)
	r = e.do("POST", path, alice, map[string]any{"bridge_id": "car"})
	require.Equal(t, 201, r.status, "%s", r.body)
	assert.Zero(t, st.devices.Load(), "devices read to create a bridge beside one serving %d", devices)
	r = e.do("POST", path, alice, map[string]any{"bridge_id": "boat"})
	require.Equal(t, 201, r.status, "%s", r.body)
	r = e.do("POST", path, alice, map[string]any{"bridge_id": "plane"})
	require.Equal(t, 422, r.status, "a fourth bridge: %s", r.body)
	assert.Contains(t, string(r.body), "3 bridges")
	assert.Zero(t, st.devices.Load(), "devices read to refuse a bridge")
}
