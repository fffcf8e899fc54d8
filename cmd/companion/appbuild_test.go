package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An app update to another build of the version a device runs (1.0.0+2 on
// a device with 1.0.0+1: one semantic version, two packages) is sent and
// runs; only the very release it runs is a 409 no_update, as for an OTA
// (docs/reliability.md, bug 502; bug 107).
func TestAppUpdateToAnotherBuildOfTheRunningVersion(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	for _, v := range []string{"1.0.0+1", "1.0.0+2"} {
		r := f.admin.do("PUT", "/api/v1/admin/apps/clock/"+v, bytes.Repeat([]byte(v), 100))
		require.Equal(t, 201, r.Status, "%s", r.Body)
	}
	u := f.user
	r := u.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd := u.accept("POST", "/api/v1/devices/dev-1/apps/install", map[string]any{"app_id": "clock", "version": "1.0.0+1"}, "Prefer", "wait=30")
	require.Equal(t, "succeeded", u.waitFinal("dev-1", cmd["id"].(string))["state"])

	r = u.do("PUT", "/api/v1/devices/dev-1/apps/clock/update", map[string]any{"version": "1.0.0+1"})
	assert.Equal(t, 409, r.Status, "an update to the very release the device runs: %s", r.Body)

	r = u.do("PUT", "/api/v1/devices/dev-1/apps/clock/update", map[string]any{"version": "1.0.0+2"}, "Prefer", "wait=30")
	require.Contains(t, []int{200, 202}, r.Status, "an update to another build of the running version was refused: %s", r.Body)
	assert.Equal(t, "succeeded", u.waitFinal("dev-1", r.JSON(t)["id"].(string))["state"])
	r = u.do("GET", "/api/v1/devices/dev-1/apps", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.Contains(t, string(r.Body), `{"app_id":"clock","version":"1.0.0+2"}`)

	// Back to the build it ran: a rollback, asked for by its version.
	r = u.do("PUT", "/api/v1/devices/dev-1/apps/clock/update", map[string]any{"version": "1.0.0+1"}, "Prefer", "wait=30")
	require.Contains(t, []int{200, 202}, r.Status, "%s", r.Body)
	assert.Equal(t, "succeeded", u.waitFinal("dev-1", r.JSON(t)["id"].(string))["state"])

	// Without a version the latest must be a newer semantic version, as
	// for an OTA: another build of the one it runs is not.
	r = u.do("PUT", "/api/v1/devices/dev-1/apps/clock/update", map[string]any{})
	assert.Equal(t, 409, r.Status, "%s", r.Body)
}
