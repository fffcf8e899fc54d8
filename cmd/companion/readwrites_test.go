package main

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A read right after a command ends reflects what the command changed
// (CONTRACT §8), on both brokers. The bridge here is a fake that answers
// each command with its final reply alone: the device's state travels in
// that reply, and no status or settings message follows it, so only the
// reply can make the reads right.
func TestReadsAfterAFinalReply(t *testing.T) {
	for _, tc := range []struct {
		name  string
		start func(t *testing.T) (*Main, string)
	}{
		{"embedded", func(t *testing.T) (*Main, string) {
			m := startServer(t, Config{})
			return m, m.MQTTURL()
		}},
		{"mosquitto", func(t *testing.T) (*Main, string) {
			m, mq := startWithMosquitto(t, t.TempDir())
			return m, mq.URL
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, url := tc.start(t)
			f := setupFleet(t, m, "dev-1")
			registerDevices(t, f, "dev-1")
			fb := connectFakeBridge(t, url, f)
			fb.answerWithState(t, f.bridgeID, "dev-1")
			u, dp := f.user, "/api/v1/devices/dev-1"
			testenv.Eventually(t, 20*time.Second, "the first reports", func() bool {
				set := u.do("GET", dp+"/settings", nil).JSON(t)
				return u.do("GET", dp+"/status", nil).JSON(t)["online"] == true && len(set["schema"].(map[string]any)) > 0
			})

			cmd := u.accept("POST", dp+"/apps/install", map[string]any{"app_id": "weather", "version": "1.0.0"}, "Prefer", "wait=20")
			require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
			assert.JSONEq(t, `{"apps":[{"app_id":"weather","version":"1.0.0"}]}`, string(u.do("GET", dp+"/apps", nil).Body))

			cmd = u.accept("PUT", dp+"/settings", map[string]any{"brightness": 80}, "Prefer", "wait=20")
			require.Equal(t, "succeeded", cmd["state"], "%v", cmd)
			set := u.do("GET", dp+"/settings", nil).JSON(t)
			assert.EqualValues(t, 80, set["reported"].(map[string]any)["brightness"], "%v", set)
			assert.Empty(t, set["pending"])

			cmd = u.accept("POST", dp+"/ota/update", map[string]any{})
			assert.Equal(t, "succeeded", u.waitFinal("dev-1", cmd["id"].(string))["state"])
			st := u.do("GET", dp+"/status", nil).JSON(t)
			assert.Equal(t, "1.1.0", st["firmware_version"])
			assert.JSONEq(t, `{"apps":[{"app_id":"weather","version":"1.0.0"}]}`, string(u.do("GET", dp+"/apps", nil).Body))
		})
	}
}

// A device that cannot be read once its update is in (out of reach after
// its reboot): the OTA still ends succeeded, and the status read right
// after it, and later, says the new version (CONTRACT §8), through the
// real bridge and server. The final reply carries the last status the
// bridge knew with the version it installed (docs/reliability.md, bug 87).
func TestOTAStatusWhenTheDeviceCannotBeReadAfterIt(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	registerDevices(t, f, "dev-1")
	dev := &unreadableAfterOTA{Device: sim.New(sim.Options{ID: "dev-1"})}
	runBridge(t, m, m.MQTTURL(), f, []agent.Device{dev}, map[string]*sim.Device{"dev-1": dev.Device}, nil)
	u, dp := f.user, "/api/v1/devices/dev-1"
	testenv.Eventually(t, 20*time.Second, "the first status", func() bool {
		st := u.do("GET", dp+"/status", nil).JSON(t)
		return st["online"] == true && st["firmware_version"] != "1.1.0"
	})

	cmd := u.accept("POST", dp+"/ota/update", map[string]any{})
	require.Equal(t, "succeeded", u.waitFinal("dev-1", cmd["id"].(string))["state"])
	require.True(t, dev.wasUpdated(), "the OTA reached the device")
	assert.Equal(t, "1.1.0", u.do("GET", dp+"/status", nil).JSON(t)["firmware_version"], "read right after the command")
	check := u.do("GET", dp+"/ota/check", nil).JSON(t)
	assert.Equal(t, "1.1.0", check["current_version"], "%v", check)
}

// unreadableAfterOTA is a simulated device that answers no status read once
// an update has gone in.
type unreadableAfterOTA struct {
	*sim.Device
	mu      sync.Mutex
	updated bool
}

func (d *unreadableAfterOTA) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	err := d.Device.UpdateFirmware(ctx, cmdID, version, image, progress)
	if err == nil {
		d.mu.Lock()
		d.updated = true
		d.mu.Unlock()
	}
	return err
}

func (d *unreadableAfterOTA) Info(ctx context.Context) (companion.DeviceInfo, error) {
	if d.wasUpdated() {
		return companion.DeviceInfo{}, errors.New("the device does not answer")
	}
	return d.Device.Info(ctx)
}

func (d *unreadableAfterOTA) wasUpdated() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.updated
}

// answerWithState has the fake bridge report deviceID's first status and
// settings, then answer each command for it with a final reply carrying
// the state the command changed, as a bridge does, and nothing else.
func (fb *fakeBridge) answerWithState(tb testing.TB, bridgeID, deviceID string) {
	tb.Helper()
	tree := topics.MustNew(topics.DefaultPrefix)
	replies, _ := tree.Replies(deviceID)
	statusTopic, _ := tree.Status(deviceID)
	settingsTopic, _ := tree.Settings(deviceID)
	commands, _ := tree.CommandsFilter(deviceID)

	battery := 90
	status := topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: sim.DefaultModel,
		Apps: []companion.App{}, BridgeID: bridgeID, At: time.Now(), Seq: uint64(time.Now().UnixNano())}
	settings := topics.Settings{Reported: map[string]any{"brightness": 50}, Schema: sim.DefaultSchema(), At: time.Now(), Seq: uint64(time.Now().UnixNano())}
	fb.publish(statusTopic, status, true)
	fb.publish(settingsTopic, settings, true)

	// The handler runs on paho's goroutine: it never calls into testing.
	send := func(v any) {
		b, _ := json.Marshal(v)
		fb.c.Publish(replies, 1, false, b)
	}
	tok := fb.c.Subscribe(commands, 1, func(_ mqtt.Client, m mqtt.Message) {
		c, err := topics.ParseCommand(m.Payload())
		if err != nil {
			return
		}
		reply := topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: time.Now()}
		seq := uint64(time.Now().UnixNano())
		switch c.Op {
		case topics.OpAppInstall:
			var p topics.AppInstall
			json.Unmarshal(c.Payload, &p)
			status.Apps = []companion.App{{AppID: p.AppID, Version: p.Version}}
			status.Seq = seq
			st := status
			reply.Status = &st
		case topics.OpSettingsUpdate:
			var p topics.SettingsUpdate
			json.Unmarshal(c.Payload, &p)
			for k, v := range p.Settings {
				settings.Reported[k] = v
			}
			settings.Seq = seq
			set := settings
			reply.Settings = &set
		case topics.OpOTAUpdate:
			var p topics.OTAUpdate
			json.Unmarshal(c.Payload, &p)
			status.FirmwareVersion, status.Seq = p.Version, seq
			st := status
			reply.Status = &st
		}
		send(reply)
	})
	require.NoError(tb, mqtt.WaitTokenTimeout(tok, 10*time.Second))
}
