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
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
)

// startGATTBridge is startBridge with the bridge reaching its simulated
// devices (made with devices, each with its ID) the way companion-bridge
// --sim-devices does: through gatt.Device over the simulated Bluetooth
// link with opts.
func startGATTBridge(tb testing.TB, m *Main, mqttURL string, f *fleet, opts sim.LinkOptions, devices ...sim.Options) (*bridge, *sim.Network) {
	tb.Helper()
	network := sim.NewNetwork(opts)
	tb.Cleanup(func() { network.Close() })
	sims := map[string]*sim.Device{}
	for _, o := range devices {
		s := sim.New(o)
		sims[o.ID] = s
		network.Add(o.ID, sim.NewPeripheral(s, sim.PeripheralOptions{}))
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
// and be confirmed; an image padded to its slot with a confirmed trailer,
// and a SHA-512 image to a device whose MCUboot checks SHA-512, installed
// the same way; then an image the device reverts.
func TestEveryOperationOverGATT(t *testing.T) {
	t.Parallel()
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1", "dev-2")
	b, network := startGATTBridge(t, m, m.MQTTURL(), f, sim.LinkOptions{MTU: 23, DropEvery: 3 * time.Second},
		sim.Options{ID: "dev-1"}, sim.Options{ID: "dev-2", ImageHash: mcuboot.TLVSHA512})
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

	// zephyr.signed.confirmed.bin (imgtool sign --pad --confirm) is
	// published as it is; the device takes the image without its padding
	// and goes through test, reset and confirm.
	payload := bytes.Repeat([]byte("firmware 1.3.1 "), 2000)
	padded := mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 1}, HeaderSize: 0x200,
		SlotSize: 128 << 10, Confirm: true})
	r = f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.3.1", padded)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	boots = s.Boots()
	cmd = u.accept("POST", dp+"/ota/update", map[string]any{"version": "1.3.1"})
	final = u.waitFinal("dev-1", cmd["id"].(string))
	assert.Equal(t, "succeeded", final["state"], "%v", final)
	assert.Equal(t, "1.3.1", s.Firmware())
	assert.True(t, s.FirmwareConfirmed())
	assert.Equal(t, boots+1, s.Boots())

	// A SHA-512 image (imgtool sign --sha 512) to dev-2, whose MCUboot
	// checks SHA-512 (CONFIG_MCUBOOT_BOOTLOADER_USES_SHA512): its image
	// state reports 64-byte hashes.
	s2, dp2 := b.sims["dev-2"], "/api/v1/devices/dev-2"
	r = u.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-2", "claim_code": f.claims["dev-2"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	sha512Image := mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 2}, HeaderSize: 0x200,
		Hash: mcuboot.TLVSHA512})
	r = f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.3.2", sha512Image)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	testenv.Eventually(t, 20*time.Second, "dev-2 online", func() bool {
		r := u.do("GET", dp2+"/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == true
	})
	cmd = u.accept("POST", dp2+"/ota/update", map[string]any{"version": "1.3.2"})
	final = u.waitFinal("dev-2", cmd["id"].(string))
	assert.Equal(t, "succeeded", final["state"], "%v", final)
	assert.Equal(t, "1.3.2", s2.Firmware())
	assert.True(t, s2.FirmwareConfirmed())
	assert.Equal(t, 1, s2.Boots())
	assert.Equal(t, "1.3.2", u.do("GET", dp2+"/status", nil).JSON(t)["firmware_version"])

	// An image the device reverts fails the command with its own code.
	s.CrashNextBoot()
	r = f.admin.do("PUT", "/api/v1/admin/firmware/sim-1/1.4.0", firmwareImage(t, "1.4.0", 64<<10))
	require.Equal(t, 201, r.Status, "%s", r.Body)
	cmd = u.accept("POST", dp+"/ota/update", map[string]any{"version": "1.4.0"})
	final = u.waitFinal("dev-1", cmd["id"].(string))
	assert.Equal(t, "failed", final["state"], "%v", final)
	assert.Equal(t, "firmware_reverted", final["error"].(map[string]any)["code"], "%v", final)
	assert.Equal(t, "1.3.1", s.Firmware())

	assert.Positive(t, network.Drops(), "the link never dropped: the test did not test resumption")
	t.Logf("link drops: %d, connects: %d", network.Drops(), network.Connects())
}
