package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"

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

	damage(t, data, func(tx *bolt.Tx) error {
		for _, id := range ids[:2] {
			if err := tx.Bucket([]byte("commands")).Put([]byte(id), []byte(`{"id": "`+id[:8])); err != nil {
				return err
			}
		}
		return nil
	})

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

// TestADamagedRecordDoesNotFailItsList runs the real server on a store
// where one record of each list was damaged while it was down: a device's
// status, the list's copy of another device's binding, one of the user's
// bridges and one release of an app. Each list answers 200 with every
// item it can read, in full pages (CONTRACT §8: a list never hides what
// exists): the device whose status is damaged with its status unknown,
// the other from its binding; the damaged bridge and release left out.
// The device's next report takes the damaged status's place. Without the
// fix each list was a 500 internal for good, hiding everything.
func TestADamagedRecordDoesNotFailItsList(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1", "dev-2", "dev-3")
	registerDevices(t, f, "dev-1", "dev-2", "dev-3")
	for _, b := range []string{"own-1", "own-2", "own-3"} {
		r := f.user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": b})
		require.Equal(t, 201, r.Status, "%s", r.Body)
	}
	r := f.admin.do("PUT", "/api/v1/admin/apps/clock/1.0.0", []byte("clock"))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	require.NoError(t, m.Close())

	damage(t, data, overwrite([]record{
		{"status", "dev-2", `{"device_id": "dev-2", "onl`},
		{"user_bindings", f.userID + "\x00dev-3", `{"device_id": "de`},
		{"bridges", "own-2", `{"id": "own`},
		{"apps", "weather\x001.0.0", `{"app_id": "wea`},
	}))

	m = startServer(t, cfg)
	user := newClient(t, m, f.user.token)
	listed := func(path, member, id string) []string {
		t.Helper()
		var ids []string
		cursor := ""
		for pages := 0; ; pages++ {
			require.Less(t, pages, 10, "the pages of %s do not end", path)
			r := user.do("GET", path+"?limit=1&cursor="+cursor, nil)
			require.Equal(t, 200, r.Status, "GET %s: %s", path, r.Body)
			page := r.JSON(t)
			items := page[member].([]any)
			for _, it := range items {
				ids = append(ids, it.(map[string]any)[id].(string))
			}
			next, ok := page["next_cursor"].(string)
			if !ok {
				return ids
			}
			require.Len(t, items, 1, "GET %s: a page before the last is full", path)
			cursor = next
		}
	}
	assert.Equal(t, []string{"dev-1", "dev-2", "dev-3"}, listed("/api/v1/devices", "devices", "device_id"))
	assert.Equal(t, []string{"own-1", "own-3"}, listed("/api/v1/bridges", "bridges", "bridge_id"))
	assert.Equal(t, []string{"clock", "weather"}, listed("/api/v1/apps", "apps", "app_id"))
	r = user.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	for _, d := range r.JSON(t)["devices"].([]any) {
		if dev := d.(map[string]any); dev["device_id"] == "dev-2" {
			assert.Equal(t, false, dev["status"].(map[string]any)["online"], "a status that does not decode is not known: %v", dev)
		}
	}
	r = user.do("GET", "/api/v1/apps", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	for _, a := range r.JSON(t)["apps"].([]any) {
		if app := a.(map[string]any); app["app_id"] == "weather" {
			assert.Equal(t, []any{"1.2.0"}, app["versions"], "%v", app)
		}
	}
	metricsExpect(t, metricsScrape(t, m), 4, "companion_store_undecodable_records")

	// The device's next report takes the damaged status's place.
	fb := connectFakeBridge(t, m.MQTTURL(), f)
	statusTopic, _ := topics.MustNew(topics.DefaultPrefix).Status("dev-2")
	battery := 70
	fb.publish(statusTopic, topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: "sim-1",
		Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: uint64(time.Now().UnixNano())}, true)
	testenv.Eventually(t, 10*time.Second, "dev-2's next report stored", func() bool {
		r := user.do("GET", "/api/v1/devices/dev-2/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == true
	})
}

// TestADamagedStatusOrSettingsIsReadAsNone runs the real server on a store
// where a device's status and settings records were damaged while it was
// down, and another device's settings. Each is read as none, as before any
// report: the device's status and settings read 200, its settings change
// is accepted and desired, it moves to no bridge and back, its next
// reports are stored, and the other device is unbound. Without the fix
// each of those was a 500 internal for good.
func TestADamagedStatusOrSettingsIsReadAsNone(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1", "dev-2")
	registerDevices(t, f, "dev-1", "dev-2")
	require.NoError(t, m.Close())

	damage(t, data, overwrite([]record{
		{"status", "dev-1", `{"device_id": "dev-1", "onl`},
		{"settings", "dev-1", `{"device_id": "dev-1", "rep`},
		{"settings", "dev-2", `{"device_id": "dev-2", "des`},
	}))

	m = startServer(t, cfg)
	user, admin := newClient(t, m, f.user.token), newClient(t, m, m.AdminToken())
	const dp = "/api/v1/devices/dev-1"
	r := user.do("GET", dp+"/status", nil)
	require.Equal(t, 200, r.Status, "GET %s/status: %s", dp, r.Body)
	assert.Equal(t, false, r.JSON(t)["online"], "a status that does not decode is not known: %s", r.Body)
	r = user.do("GET", dp+"/settings", nil)
	require.Equal(t, 200, r.Status, "GET %s/settings: %s", dp, r.Body)
	r = user.do("PUT", dp+"/settings", map[string]any{"brightness": 70})
	require.Equal(t, 202, r.Status, "PUT %s/settings: %s", dp, r.Body)
	set := user.do("GET", dp+"/settings", nil).JSON(t)
	assert.Equal(t, []any{"brightness"}, set["pending"], "%v", set)
	for _, to := range []any{nil, f.bridgeID} {
		r = admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": to})
		require.Equal(t, 200, r.Status, "moving dev-1 to %v: %s", to, r.Body)
	}

	// Its next reports are stored.
	fb := connectFakeBridge(t, m.MQTTURL(), f)
	tree := topics.MustNew(topics.DefaultPrefix)
	statusTopic, _ := tree.Status("dev-1")
	settingsTopic, _ := tree.Settings("dev-1")
	battery := 70
	fb.publish(statusTopic, topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: "sim-1",
		Apps: []companion.App{}, BridgeID: f.bridgeID, At: time.Now(), Seq: uint64(time.Now().UnixNano())}, true)
	fb.publish(settingsTopic, topics.Settings{Reported: map[string]any{"brightness": 70}, Schema: sim.DefaultSchema(),
		At: time.Now(), Seq: uint64(time.Now().UnixNano())}, true)
	testenv.Eventually(t, 10*time.Second, "dev-1's next reports stored", func() bool {
		set := user.do("GET", dp+"/settings", nil).JSON(t)
		return user.do("GET", dp+"/status", nil).JSON(t)["online"] == true &&
			fmt.Sprint(set["reported"].(map[string]any)["brightness"]) == "70" && len(set["pending"].([]any)) == 0
	})

	r = user.do("DELETE", "/api/v1/devices/dev-2", nil)
	assert.Equal(t, 204, r.Status, "unbinding dev-2: %s", r.Body)
}

// TestADamagedBindingIsReadFromItsCopy runs the real server on a store
// where, while it was down, a device's binding was damaged, its copy in
// user_bindings whole, and another device's binding and copy both. The
// first reads from its copy: the device, its status and settings read
// 200, a command is accepted, it moves to no bridge, back, and to its
// user's own bridge, and the binding is written back whole (after a
// restart nothing is met that does not decode, and it is unbound). The
// second reads as not bound: a 404 to its user, who can register it
// again. Without the fix every read of either device was a
// 500 internal for good.
func TestADamagedBindingIsReadFromItsCopy(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1", "dev-2")
	registerDevices(t, f, "dev-1", "dev-2")
	require.NoError(t, m.Close())

	damage(t, data, overwrite([]record{
		{"bindings", "dev-1", `{"device_id": "dev-1", "us`},
		{"bindings", "dev-2", `{"device_id": "dev-2", "us`},
		{"user_bindings", f.userID + "\x00dev-2", `{"device_id": "de`},
	}))

	m = startServer(t, cfg)
	user, admin := newClient(t, m, f.user.token), newClient(t, m, m.AdminToken())
	const dp = "/api/v1/devices/dev-1"
	for _, path := range []string{dp, dp + "/status", dp + "/settings"} {
		r := user.do("GET", path, nil)
		require.Equal(t, 200, r.Status, "GET %s: %s", path, r.Body)
	}
	var r response
	for _, to := range []any{nil, f.bridgeID} {
		r = admin.do("PUT", "/api/v1/admin/devices/dev-1/bridge", map[string]any{"bridge_id": to})
		require.Equal(t, 200, r.Status, "moving dev-1 to %v: %s", to, r.Body)
	}
	r = user.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "own-1"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = user.do("PUT", dp+"/bridge", map[string]any{"bridge_id": "own-1"})
	require.Equal(t, 200, r.Status, "moving dev-1 to its user's bridge: %s", r.Body)
	r = user.do("POST", dp+"/push/text", map[string]any{"text": "hello"})
	require.Equal(t, 202, r.Status, "POST %s/push/text: %s", dp, r.Body)

	// The device whose binding and copy are both damaged is not bound.
	const dp2 = "/api/v1/devices/dev-2"
	r = user.do("GET", dp2, nil)
	assert.Equal(t, 404, r.Status, "GET %s: %s", dp2, r.Body)
	r = user.do("DELETE", dp2, nil)
	assert.Equal(t, 404, r.Status, "DELETE %s: %s", dp2, r.Body)
	r = user.do("GET", "/api/v1/devices", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	var listed []string
	for _, d := range r.JSON(t)["devices"].([]any) {
		listed = append(listed, d.(map[string]any)["device_id"].(string))
	}
	assert.Equal(t, []string{"dev-1"}, listed)
	r = user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "registering dev-2 again: %s", r.Body)
	r = user.do("GET", dp2, nil)
	assert.Equal(t, 200, r.Status, "GET %s after registering it again: %s", dp2, r.Body)
	metricsExpect(t, metricsScrape(t, m), 3, "companion_store_undecodable_records")

	// Healed: after a restart, the device and the list meet nothing that
	// does not decode.
	require.NoError(t, m.Close())
	m = startServer(t, cfg)
	user = newClient(t, m, f.user.token)
	for _, path := range []string{dp, "/api/v1/devices", dp2} {
		r = user.do("GET", path, nil)
		require.Equal(t, 200, r.Status, "GET %s after a restart: %s", path, r.Body)
	}
	metricsExpect(t, metricsScrape(t, m), 0, "companion_store_undecodable_records")
	r = user.do("DELETE", dp, nil)
	assert.Equal(t, 204, r.Status, "unbinding dev-1: %s", r.Body)
}

// TestADamagedReleaseIsLeftOut runs the real server on a store where,
// while it was down, one firmware release of the devices' model and one
// release of an app were damaged, the others whole, and every blob was
// stored two hours before. The damaged releases are left out: the OTA
// check names the whole firmware as the latest, an OTA and an install
// without a version take the whole releases, one of the damaged version
// is a 404, and the catalog lists the whole ones. The first retention pass
// purges the two blobs nothing needs any more (the damaged releases') and
// keeps the others. The damaged versions are published again, and then
// served. Without the fix the OTA check, the OTA, the install and the
// publish were each a 500 internal for good, and the purge of blobs failed
// every pass (bug 566).
func TestADamagedReleaseIsLeftOut(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1") // firmware sim-1 1.1.0, app weather 1.0.0 and 1.2.0
	registerDevices(t, f, "dev-1")
	fw := firmwareImage(t, "1.2.0", 64<<10)
	r := f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.2.0", fw)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	require.NoError(t, m.Close())

	damage(t, data, func(tx *bolt.Tx) error {
		if err := tx.Bucket([]byte("firmware")).Put([]byte("sim-1\x001.2.0"), []byte(`{"model": "si`)); err != nil {
			return err
		}
		if err := tx.Bucket([]byte("apps")).Put([]byte("weather\x001.2.0"), []byte(`{"app_id": "wea`)); err != nil {
			return err
		}
		// Stored two hours before: the retention pass at the start weighs
		// every blob (it spares those stored within the hour).
		blobs := tx.Bucket([]byte("blobs"))
		aged := map[string][]byte{}
		err := blobs.ForEach(func(k, v []byte) error {
			var rec map[string]any
			if err := json.Unmarshal(v, &rec); err != nil {
				return err
			}
			then := time.Now().Add(-2 * time.Hour).UTC().Format(time.RFC3339Nano)
			rec["created_at"], rec["stored_at"] = then, then
			b, err := json.Marshal(rec)
			aged[string(k)] = b
			return err
		})
		if err != nil {
			return err
		}
		require.Len(t, aged, 4, "a blob a release")
		for k, v := range aged {
			if err := blobs.Put([]byte(k), v); err != nil {
				return err
			}
		}
		return nil
	})

	capture := &logCapture{next: testLogger(t).Handler(), store: &capturedLogs{}}
	m = startServerLogging(t, cfg, slog.New(capture))
	user, admin := newClient(t, m, f.user.token), newClient(t, m, m.AdminToken())
	const dp = "/api/v1/devices/dev-1"
	r = user.do("GET", dp+"/ota/check", nil)
	require.Equal(t, 200, r.Status, "GET %s/ota/check: %s", dp, r.Body)
	assert.Equal(t, "1.1.0", r.JSON(t)["latest_version"], "%s", r.Body)
	for _, body := range []map[string]any{{}, {"version": "1.1.0"}} {
		r = user.do("POST", dp+"/ota/update", body)
		assert.Equal(t, 202, r.Status, "POST %s/ota/update %v: %s", dp, body, r.Body)
	}
	r = user.do("POST", dp+"/ota/update", map[string]any{"version": "1.2.0"})
	assert.Equal(t, 404, r.Status, "POST %s/ota/update of the damaged 1.2.0: %s", dp, r.Body)
	for _, body := range []map[string]any{{"app_id": "weather"}, {"app_id": "weather", "version": "1.0.0"}} {
		r = user.do("POST", dp+"/apps/install", body)
		assert.Equal(t, 202, r.Status, "POST %s/apps/install %v: %s", dp, body, r.Body)
	}
	r = user.do("POST", dp+"/apps/install", map[string]any{"app_id": "weather", "version": "1.2.0"})
	assert.Equal(t, 404, r.Status, "POST %s/apps/install of the damaged 1.2.0: %s", dp, r.Body)
	catalog := func() map[string]any {
		t.Helper()
		r := user.do("GET", "/api/v1/apps", nil)
		require.Equal(t, 200, r.Status, "GET /api/v1/apps: %s", r.Body)
		for _, a := range r.JSON(t)["apps"].([]any) {
			if app := a.(map[string]any); app["app_id"] == "weather" {
				return app
			}
		}
		t.Fatalf("GET /api/v1/apps lists no weather: %s", r.Body)
		return nil
	}
	assert.Equal(t, []any{"1.0.0"}, catalog()["versions"])

	// The retention pass at the start went on past the damaged releases,
	// and purged their blobs alone: nothing else needs them.
	testenv.Eventually(t, 10*time.Second, "the retention pass purging the damaged releases' two blobs", func() bool {
		return capture.has(slog.LevelInfo, "purged blobs nothing needs", "count", "2")
	})
	assert.False(t, capture.has(slog.LevelError, "purging unneeded blobs", "", ""), "the retention pass failed")
	metricsExpect(t, metricsScrape(t, m), 2, "companion_store_undecodable_records")

	// Published again, the damaged versions are served.
	r = admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.2.0", fw)
	assert.Equal(t, 201, r.Status, "publishing the damaged firmware again: %s", r.Body)
	r = admin.do("PUT", "/api/v1/admin/apps/weather/1.2.0", bytes.Repeat([]byte("1.2.0"), 1000))
	assert.Equal(t, 201, r.Status, "publishing the damaged app release again: %s", r.Body)
	r = user.do("GET", dp+"/ota/check", nil)
	require.Equal(t, 200, r.Status, "GET %s/ota/check: %s", dp, r.Body)
	assert.Equal(t, "1.2.0", r.JSON(t)["latest_version"], "%s", r.Body)
	r = user.do("POST", dp+"/apps/install", map[string]any{"app_id": "weather", "version": "1.2.0"})
	assert.Equal(t, 202, r.Status, "POST %s/apps/install of 1.2.0 published again: %s", dp, r.Body)
	assert.Equal(t, []any{"1.0.0", "1.2.0"}, catalog()["versions"])
}

// TestADamagedBlobRecordIsRebuiltOrLeftOut runs the real server on a store
// where, while it was down, the records of four blobs were damaged: the
// firmware's and an app release's, whose files are there; one nothing
// needs, its file two hours old; and one whose file is gone. The first two
// are served whole, rebuilt from their files, and the app's content
// uploads again; the retention pass at the start purges the other two;
// the one without a file reads as absent. Without the fix each download
// was a 500, the upload of the same content too, and every purge of blobs
// failed, for good.
func TestADamagedBlobRecordIsRebuiltOrLeftOut(t *testing.T) {
	data := t.TempDir()
	cfg := Config{Data: data, Metrics: "127.0.0.1:0"}
	m := startServer(t, cfg)
	f := setupFleet(t, m, "dev-1") // firmware sim-1 1.1.0, app weather 1.0.0 and 1.2.0
	registerDevices(t, f, "dev-1")
	require.NoError(t, m.Close())

	digest := func(b []byte) string {
		sum := sha256.Sum256(b)
		return hex.EncodeToString(sum[:])
	}
	app := bytes.Repeat([]byte("1.2.0"), 1000)
	unneeded, lost := []byte("content nothing needs"), []byte("content whose file is gone")
	fwSHA, appSHA, unneededSHA, lostSHA := digest(f.firmware), digest(app), digest(unneeded), digest(lost)
	unneededFile := filepath.Join(data, "blobs", unneededSHA[:2], unneededSHA)
	require.NoError(t, os.MkdirAll(filepath.Dir(unneededFile), 0o700))
	require.NoError(t, os.WriteFile(unneededFile, unneeded, 0o600))
	then := time.Now().Add(-2 * time.Hour)
	require.NoError(t, os.Chtimes(unneededFile, then, then))
	damage(t, data, func(tx *bolt.Tx) error {
		blobs := tx.Bucket([]byte("blobs"))
		require.NotNil(t, blobs.Get([]byte(fwSHA)), "the firmware's blob record")
		require.NotNil(t, blobs.Get([]byte(appSHA)), "the app's blob record")
		for _, sha := range []string{fwSHA, appSHA, unneededSHA, lostSHA} {
			if err := blobs.Put([]byte(sha), []byte(`{"sha256": "ab`)); err != nil {
				return err
			}
		}
		return nil
	})

	capture := &logCapture{next: testLogger(t).Handler(), store: &capturedLogs{}}
	m = startServerLogging(t, cfg, slog.New(capture))
	admin := newClient(t, m, m.AdminToken())
	r := admin.do("GET", "/api/v1/blobs/"+fwSHA, nil)
	require.Equal(t, 200, r.Status, "GET the firmware's blob: %s", r.Body)
	assert.True(t, bytes.Equal(f.firmware, r.Body), "the firmware's blob served: %d bytes; want the %d published", len(r.Body), len(f.firmware))
	r = admin.do("GET", "/api/v1/blobs/"+lostSHA, nil)
	assert.Equal(t, 404, r.Status, "GET the blob whose file is gone: %s", r.Body)

	// The retention pass at the start went on past the damaged records,
	// and purged the two nothing needs, by their files' time.
	testenv.Eventually(t, 10*time.Second, "the retention pass purging the two damaged blobs nothing needs", func() bool {
		return capture.has(slog.LevelInfo, "purged blobs nothing needs", "count", "2")
	})
	assert.False(t, capture.has(slog.LevelError, "purging unneeded blobs", "", ""), "the retention pass failed")
	_, err := os.Stat(unneededFile)
	assert.ErrorIs(t, err, os.ErrNotExist, "the file of the blob nothing needs, after the purge")
	r = admin.do("GET", "/api/v1/blobs/"+unneededSHA, nil)
	assert.Equal(t, 404, r.Status, "GET the purged blob: %s", r.Body)

	// The same content uploads again, as another version.
	r = admin.do("PUT", "/api/v1/admin/apps/weather/1.3.0", app)
	assert.Equal(t, 201, r.Status, "publishing the content of the damaged blob record again: %s", r.Body)
	r = admin.do("GET", "/api/v1/blobs/"+appSHA, nil)
	require.Equal(t, 200, r.Status, "GET the app's blob: %s", r.Body)
	assert.True(t, bytes.Equal(app, r.Body), "the app's blob served: %d bytes; want the %d published", len(r.Body), len(app))
	r = newClient(t, m, f.user.token).do("POST", "/api/v1/devices/dev-1/ota/update", map[string]any{"version": "1.1.0"})
	assert.Equal(t, 202, r.Status, "POST ota/update 1.1.0: %s", r.Body)
	metricsExpect(t, metricsScrape(t, m), 4, "companion_store_undecodable_records")
}

// record is a value written over a record of the bbolt file: a JSON
// fragment, as a value overwritten inside a page that is otherwise whole
// reads, which the start does not see.
type record struct{ bucket, key, value string }

// damage opens the bbolt file under data, the server down, and has fn
// write into it a test's damaged records.
func damage(t *testing.T, data string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	db, err := bolt.Open(filepath.Join(data, "companion.db"), 0o600, nil)
	require.NoError(t, err)
	require.NoError(t, db.Update(fn))
	require.NoError(t, db.Close())
}

// overwrite is a damage that puts each of records.
func overwrite(records []record) func(tx *bolt.Tx) error {
	return func(tx *bolt.Tx) error {
		for _, d := range records {
			if err := tx.Bucket([]byte(d.bucket)).Put([]byte(d.key), []byte(d.value)); err != nil {
				return err
			}
		}
		return nil
	}
}
