package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/sim"
)

// TestBackupWhileCommandsFlow takes a backup of a running server's store
// with companion backup while a user's commands are accepted and run,
// restores it into a new data directory (the copy as companion.db, and
// the blobs directory copied after it, as docs/operations.md says),
// starts a server there and the bridge on its spool as it was: every
// command accepted before the backup began is there, each command ends,
// and the device ran each text once (those the bridge ran after the
// backup, which the restored store had not seen end, are answered from
// the bridge's spool, not run again).
func TestBackupWhileCommandsFlow(t *testing.T) {
	dir := t.TempDir()
	m := startServer(t, Config{Data: dir})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	spool := t.TempDir()
	b := startBridge(t, m, m.MQTTURL(), f, spool, "dev-1")
	img := f.user.accept("POST", "/api/v1/devices/dev-1/push/image", map[string]any{"image": pngImage(t, 8, 8)})
	f.user.waitFinal("dev-1", img["id"].(string))

	// A user keeps sending texts while the backup runs.
	var mu sync.Mutex
	var accepted []string
	stop := make(chan struct{})
	sent := make(chan struct{}, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			id := f.user.pushText("dev-1", fmt.Sprintf("msg %d", i))
			mu.Lock()
			accepted = append(accepted, id)
			mu.Unlock()
			select {
			case sent <- struct{}{}:
			default:
			}
		}
	}()
	for range 3 {
		<-sent
	}
	mu.Lock()
	before := append([]string(nil), accepted...)
	mu.Unlock()

	file := filepath.Join(t.TempDir(), "companion.db.bak")
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{"backup", file, "--api-url", m.APIURL(), "--admin-token", m.AdminToken()}, &out, &errOut)
	require.NoError(t, err, "companion backup: %s", errOut.String())
	var got map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &got), "%s", out.String())
	assert.Equal(t, file, got["file"])
	// The route the CLI calls, as api/openapi.json documents it.
	r = f.admin.do("GET", "/api/v1/admin/backup", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Equal(t, r.Header.Get("Content-Length"), fmt.Sprint(len(r.Body)))
	for range 3 {
		<-sent // more texts after the backup
	}
	close(stop)
	wg.Wait()
	b.stop()
	require.NoError(t, m.Close())

	// Restore: the copy becomes companion.db of a new data directory, and
	// the blobs follow.
	restored := t.TempDir()
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(restored, "companion.db"), raw, 0o600))
	cp := exec.Command("cp", "-a", filepath.Join(dir, "blobs"), restored)
	out2, err := cp.CombinedOutput()
	require.NoError(t, err, "%s", out2)

	m2 := startServer(t, Config{Data: restored})
	user := newClient(t, m2, f.user.token)
	for _, id := range before {
		r := user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil)
		require.Equal(t, 200, r.Status, "command %s, accepted before the backup: %s", id, r.Body)
	}
	f.user = user
	var devs []agent.Device
	for _, s := range b.sims {
		devs = append(devs, s)
	}
	runBridge(t, m2, m2.MQTTURL(), f, devs, b.sims, func(o *agent.Options) { o.DataDir = spool })
	var inStore []string
	for _, id := range accepted {
		if user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil).Status == 200 {
			inStore = append(inStore, id)
		}
	}
	for _, id := range inStore {
		assert.Equal(t, "succeeded", user.waitFinal("dev-1", id)["state"], "command %s", id)
	}
	img2 := user.waitFinal("dev-1", img["id"].(string))
	assert.Equal(t, "succeeded", img2["state"])
	seen := map[string]int{}
	for _, tx := range b.sims["dev-1"].Texts() {
		seen[tx.Text]++
	}
	for text, n := range seen {
		assert.Equal(t, 1, n, "text %q ran %d times", text, n)
	}
	assert.Len(t, seen, len(accepted), "every text accepted ran once")
}

// TestRestoreWithTheBridgeConnected restores a backup taken while a
// command was delivered to the bridge, which ran it to its end after the
// backup, and starts the server on it while the bridge stays connected
// to the (external) broker throughout, as a bridge at a remote site does:
// the restored store's command must end as the bridge says, not wait
// delivered for a reply the bridge gave the lost store.
func TestRestoreWithTheBridgeConnected(t *testing.T) {
	_, mqttURL := mochitest.Start(t)
	dir := t.TempDir()
	m := startServer(t, Config{Data: dir, MQTTURL: mqttURL})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	dev := sim.New(sim.Options{ID: "dev-1", ExecDelay: 2 * time.Second})
	runBridge(t, m, mqttURL, f, []agent.Device{dev}, map[string]*sim.Device{"dev-1": dev}, nil)
	id := f.user.pushText("dev-1", "slow")
	require.Eventually(t, func() bool {
		state := f.user.do("GET", "/api/v1/devices/dev-1/commands/"+id, nil).JSON(t)["state"]
		return state == "delivered" || state == "in_progress"
	}, 30*time.Second, 10*time.Millisecond, "the command never reached the bridge")
	file := filepath.Join(t.TempDir(), "companion.db.bak")
	var out, errOut bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"backup", file, "--api-url", m.APIURL(), "--admin-token", m.AdminToken()}, &out, &errOut), "%s", errOut.String())
	assert.Equal(t, "succeeded", f.user.waitFinal("dev-1", id)["state"])
	require.NoError(t, m.Close())

	restored := t.TempDir()
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(restored, "companion.db"), raw, 0o600))
	m2 := startServer(t, Config{Data: restored, MQTTURL: mqttURL})
	user := newClient(t, m2, f.user.token)
	got := user.waitFinal("dev-1", id)
	assert.Equal(t, "succeeded", got["state"])
	assert.Len(t, dev.Texts(), 1, "the device ran the text once")
}
