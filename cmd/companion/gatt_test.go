package main

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"image"
	"image/png"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// startGATTBridge is startBridge with the bridge reaching its simulated
// devices the way companion-bridge --sim-devices does: through gatt.Device
// over the simulated Bluetooth link with opts.
func startGATTBridge(tb testing.TB, m *Main, mqttURL string, f *fleet, opts sim.LinkOptions, devices ...string) (*bridge, *sim.Network) {
	tb.Helper()
	network := sim.NewNetwork(opts)
	tb.Cleanup(func() { network.Close() })
	sims := map[string]*sim.Device{}
	for _, id := range devices {
		s := sim.New(sim.Options{ID: id})
		sims[id] = s
		network.Add(id, sim.NewPeripheral(s, sim.PeripheralOptions{}))
	}
	return startBridgeOver(tb, m, mqttURL, f, network, sims), network
}

// startBridgeOver runs a real bridge whose devices are gatt.Devices reached
// through connector; sims are the simulated devices behind it, by id.
func startBridgeOver(tb testing.TB, m *Main, mqttURL string, f *fleet, connector gatt.Connector, sims map[string]*sim.Device) *bridge {
	tb.Helper()
	var devs []agent.Device
	for id := range sims {
		g, err := gatt.NewDevice(gatt.DeviceOptions{ID: id, Connector: connector, Logger: testLogger(tb).With("component", "gatt")})
		require.NoError(tb, err)
		tb.Cleanup(func() { g.Close() }) // runs after the bridge stops
		devs = append(devs, g)
	}
	return runBridge(tb, m, mqttURL, f, devs, sims, nil)
}

// noisePNG is a PNG of random pixels: it does not compress, so its size is
// about w×h×4 bytes.
func noisePNG(tb testing.TB, w, h int) []byte {
	tb.Helper()
	img := image.NewNRGBA(image.Rect(0, 0, w, h))
	rand.Read(img.Pix)
	var buf bytes.Buffer
	require.NoError(tb, png.Encode(&buf, img))
	return buf.Bytes()
}

// Every operation of the spec over the simulated Bluetooth link at the
// smallest MTU, with the link dropping every 3 s, including a 300 KiB
// image and a 256 KiB MCUboot image that must resume across drops, boot
// and be confirmed; then an image the device reverts.
func TestEveryOperationOverGATT(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1", "dev-2")
	b, network := startGATTBridge(t, m, m.MQTTURL(), f, sim.LinkOptions{MTU: 23, DropEvery: 3 * time.Second}, "dev-1", "dev-2")
	exerciseEveryOperation(t, f, b, "dev-1")

	u, dp, s := f.user, "/api/v1/devices/dev-1", b.sims["dev-1"]
	img := noisePNG(t, 300, 256) // 300 KiB and a little
	require.Greater(t, len(img), 300<<10)
	cmd := u.accept("POST", dp+"/push/image", map[string]any{"image": base64.StdEncoding.EncodeToString(img), "content_type": "image/png"})
	assert.Equal(t, "succeeded", u.waitFinal("dev-1", cmd["id"].(string))["state"])
	imgs := s.Images()
	require.NotEmpty(t, imgs)
	assert.True(t, bytes.Equal(img, imgs[len(imgs)-1].Data), "the device holds the image as sent")

	fw := firmwareImage(t, "1.3.0", 256<<10)
	r := f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.3.0", fw)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	boots := s.Boots()
	cmd = u.accept("POST", dp+"/ota/update", map[string]any{"version": "1.3.0"})
	final := u.waitFinal("dev-1", cmd["id"].(string))
	assert.Equal(t, "succeeded", final["state"], "%v", final)
	assert.Equal(t, "1.3.0", s.Firmware())
	assert.True(t, s.FirmwareConfirmed(), "the bridge confirmed the image the device booted")
	assert.Equal(t, boots+1, s.Boots(), "one reboot into the new image")
	assert.Equal(t, "1.3.0", u.do("GET", dp+"/status", nil).JSON(t)["firmware_version"])

	// An image the device reverts fails the command with its own code.
	s.CrashNextBoot()
	r = f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.4.0", firmwareImage(t, "1.4.0", 64<<10))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd = u.accept("POST", dp+"/ota/update", map[string]any{"version": "1.4.0"})
	final = u.waitFinal("dev-1", cmd["id"].(string))
	assert.Equal(t, "failed", final["state"], "%v", final)
	assert.Equal(t, "firmware_reverted", final["error"].(map[string]any)["code"], "%v", final)
	assert.Equal(t, "1.3.0", s.Firmware())

	assert.Positive(t, network.Drops(), "the link never dropped: the test did not test resumption")
	t.Logf("link drops: %d, connects: %d", network.Drops(), network.Connects())
}
