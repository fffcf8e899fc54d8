package main

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/sim"
)

// A device whose settings schema the server does not know yet (a model
// not sim-1's, not yet reported) is sent a setting with a fraction in its
// digits as written, for its bridge to judge against the device's schema
// (bug 511). The bridge read it as the float64 nearest it: a hair past
// brightness's max of 100 as 100, 1e-400 as 0, each written to the device
// over GATT and the command succeeded. It must fail invalid_payload, the
// device unchanged, and a whole number beside it must still be written
// (bug 575).
func TestABridgeJudgesAskedSettingsByTheirDigits(t *testing.T) {
	t.Parallel()
	m := startServer(t, Config{})
	f := setupFleet(t, m)
	const dev, code = "dev-acme", "CLAIM-ACME-XXXXXXXXXXXX"
	r := f.admin.do("POST", "/api/v1/admin/devices", map[string]string{"device_id": dev, "claim_code": code, "model": "acme-1", "bridge_id": f.bridgeID})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": dev, "claim_code": code})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	dp := "/api/v1/devices/" + dev

	// No bridge has reported the device: the server knows no schema of
	// its model, and takes any number for its bridge to check.
	r = f.user.do("GET", dp+"/settings", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	require.Empty(t, r.JSON(t)["schema"], "the device's schema is known before it reported")
	asked := []string{
		`{"brightness":100.00000000000000000000001}`,
		`{"volume":1e-400}`,
		`{"display_timeout_s":30.0000000000000000001}`,
		`{"brightness":99.99999999999999999999}`,
	}
	var ids []string
	for _, body := range asked {
		cmd := f.user.accept("PUT", dp+"/settings", []byte(body), "Content-Type", "application/json")
		ids = append(ids, cmd["id"].(string))
	}
	whole := f.user.accept("PUT", dp+"/settings", []byte(`{"volume":70.000}`), "Content-Type", "application/json")["id"].(string)

	b, _ := startGATTBridge(t, m, m.MQTTURL(), f, sim.LinkOptions{}, sim.Options{ID: dev, Model: "acme-1"})
	for i, id := range ids {
		final := f.user.waitFinal(dev, id)
		if !assert.Equal(t, companion.StateFailed, final["state"], "PUT …/settings %s on a device of a schema not known yet: %v", asked[i], final) {
			continue
		}
		e, _ := final["error"].(map[string]any)
		assert.Equal(t, "invalid_payload", e["code"], "%s: %v", asked[i], final)
		assert.Contains(t, e["message"], "must be an integer", "%s: %v", asked[i], final)
	}
	final := f.user.waitFinal(dev, whole)
	assert.Equal(t, companion.StateSucceeded, final["state"], "%v", final)

	got, _, err := b.sims[dev].Settings(context.Background())
	require.NoError(t, err)
	for k, want := range map[string]string{"brightness": "50", "volume": "70", "display_timeout_s": "30"} {
		assert.Equal(t, want, fmt.Sprint(got[k]), "the device's %s", k)
	}
}
