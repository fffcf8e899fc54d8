package main

import (
	"encoding/base64"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/gatt/bluez"
	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// The whole path with the real BlueZ code of companion-bridge --gatt bluez:
// HTTP → MQTT → bridge → gatt.Device → bluez.Connector
// → D-Bus → a fake org.bluez on a private bus → the simulator's peripheral.
func TestEveryOperationOverBlueZ(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("BlueZ is Linux only")
	}
	fake := fakebluez.New(t)
	sims := map[string]*sim.Device{}
	devices := map[string]*fakebluez.Device{}
	for i, id := range []string{"dev-1", "dev-2"} {
		s := sim.New(sim.Options{ID: id})
		sims[id] = s
		devices[id] = fake.AddDevice(fakebluez.DeviceOptions{
			Address:    []string{"C0:FF:EE:00:00:01", "C0:FF:EE:00:00:02"}[i],
			Name:       id,
			MTU:        185,
			Peripheral: sim.NewPeripheral(s, sim.PeripheralOptions{}),
		})
	}
	conn, err := bluez.New(bluez.Options{Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })

	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1", "dev-2")
	b := startBridgeOver(t, m, m.MQTTURL(), f, conn, sims)
	exerciseEveryOperation(t, f, b, "dev-1")

	// The connection drops while a 300 KiB transfer runs (or just after,
	// when the fake link outruns the test): the command still succeeds
	// exactly once, and the next command reconnects through BlueZ.
	u, dp := f.user, "/api/v1/devices/dev-1"
	img := noisePNG(t, 300, 256)
	cmd := u.accept("POST", dp+"/push/image", map[string]any{"image": base64.StdEncoding.EncodeToString(img)})
	id := cmd["id"].(string)
	testenv.Eventually(t, 20*time.Second, "the transfer under way", func() bool {
		c := u.do("GET", dp+"/commands/"+id, nil).JSON(t)
		return c["state"] == "in_progress" || c["state"] == "succeeded"
	})
	devices["dev-1"].Drop()
	assert.Equal(t, "succeeded", u.waitFinal("dev-1", id)["state"])
	imgs := sims["dev-1"].Images()
	require.NotEmpty(t, imgs)
	assert.Equal(t, img, imgs[len(imgs)-1].Data)
	assert.Equal(t, 1, sims["dev-1"].Executions(id))
	after := u.accept("POST", dp+"/push/text", map[string]any{"text": "after the drop"}, "Prefer", "wait=30")
	assert.Equal(t, "succeeded", u.waitFinal("dev-1", after["id"].(string))["state"])
	connects := 0
	for _, c := range fake.Calls() {
		if c == "Device1.Connect "+string(devices["dev-1"].Path()) {
			connects++
		}
	}
	assert.GreaterOrEqual(t, connects, 2, "the bridge reconnected to dev-1 after the drop")
}

// The real companion-bridge --gatt bluez, its device connected through
// the fake BlueZ, stopped (SIGTERM) once bluetoothd stopped answering:
// the bridge stops within its shutdown bound all the same, exit status 0,
// and says what it gave up on. Before, the disconnect at its Close waited
// for bluetoothd for good, until a SIGKILL (docs/reliability.md, bug 194).
func TestProcessBridgeStopsWhileBluetoothdHangs(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("BlueZ is Linux only")
	}
	fake := fakebluez.New(t) // the bridge's DBUS_SYSTEM_BUS_ADDRESS
	fake.AddDevice(fakebluez.DeviceOptions{Address: "C0:FF:EE:00:00:01", Name: "dev-1",
		Peripheral: sim.NewPeripheral(sim.New(sim.Options{ID: "dev-1"}), sim.PeripheralOptions{})})
	c := newProcCluster(t, 1)
	c.startServer()
	c.setupFleet()
	bridge := startProc(t, "companion-bridge", c.bridge,
		"--mqtt-url", c.brokerURL(), "--api-url", c.base(),
		"--bridge-id", "bridge-1", "--bridge-secret", c.bridgeSecret,
		"--data", c.bridgeData, "--gatt", "bluez", "--devices", "dev-1", "--log-level", "debug")
	testenv.Eventually(t, 30*time.Second, "dev-1 online through BlueZ", func() bool {
		require.True(t, bridge.running(), "companion-bridge exited: %v", bridge.waitErr)
		r := c.user.do("GET", "/api/v1/devices/dev-1/status", nil)
		return r.Status == 200 && r.JSON(t)["online"] == true
	})

	fake.Stall()
	require.NoError(t, bridge.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-bridge.exited:
	case <-time.After(60 * time.Second):
		t.Fatal("companion-bridge did not stop within 60 s of SIGTERM with bluetoothd hung")
	}
	assert.NoError(t, bridge.waitErr, "exit status")
	log, err := os.ReadFile(bridge.logPath)
	require.NoError(t, err)
	for _, want := range []string{"bluetoothd did not answer; gave up on the call", "call=Device1.Disconnect",
		"address=C0:FF:EE:00:00:01", "systemctl status bluetooth", "msg=stopped"} {
		assert.Contains(t, string(log), want)
	}
}
