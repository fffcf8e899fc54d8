package main

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestADamagedCommandDoesNotBlockItsDevice runs the real server on a
// store where two of a device's three unfinished commands (its limit)
// were damaged while it was down: the user's list of commands leaves them
// out, a GET of one answers 500 command_unreadable, the device takes new
// commands once the reads have met them, and it can be unbound. Without
// the fix the list and the unbind were 500 internal, and every new command
// 429 queue_full, for good.
func TestADamagedCommandDoesNotBlockItsDevice(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	cfg.Limits.MaxOpenCommands = 3
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	// No bridge: the commands wait, queued.
	var ids []string
	for range 3 {
		ids = append(ids, f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hello"})["id"].(string))
	}
	r = f.user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "one too many"})
	require.Equal(t, 429, r.Status, "%s", r.Body)
	require.NoError(t, m.Close())

	db, err := bolt.Open(filepath.Join(data, "companion.db"), 0o600, nil)
	require.NoError(t, err)
	require.NoError(t, db.Update(func(tx *bolt.Tx) error {
		for _, id := range ids[:2] {
			if err := tx.Bucket([]byte("commands")).Put([]byte(id), []byte(`{"id": "`+id[:8])); err != nil {
				return err
			}
		}
		return nil
	}))
	require.NoError(t, db.Close())

	m = startServer(t, cfg)
	user := newClient(t, m, f.user.token)
	r = user.do("GET", "/api/v1/devices/dev-1/commands", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	listed := r.JSON(t)["commands"].([]any)
	if assert.Len(t, listed, 1) {
		assert.Equal(t, ids[2], listed[0].(map[string]any)["id"])
	}
	for _, method := range []string{"GET", "DELETE"} {
		r = user.do(method, "/api/v1/devices/dev-1/commands/"+ids[0], nil)
		assert.Equal(t, 500, r.Status, "%s", r.Body)
		p := r.JSON(t)
		assert.Equal(t, "command_unreadable", p["code"], "%s", r.Body)
		assert.Contains(t, p["detail"], "damaged", "%s", r.Body)
	}
	r = user.do("GET", "/api/v1/devices/dev-1/commands/"+ids[2], nil)
	assert.Equal(t, 200, r.Status, "%s", r.Body)

	testenv.Eventually(t, 10*time.Second, "a new command for the device", func() bool {
		r = user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "after"})
		return r.Status == 202
	})
	metricsExpect(t, metricsScrape(t, m), 2, "companion_store_undecodable_records")
	r = user.do("DELETE", "/api/v1/devices/dev-1", nil)
	assert.Equal(t, 204, r.Status, "%s", r.Body)
}
