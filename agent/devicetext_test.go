package agent_test

import (
	"context"
	"fmt"
	"maps"
	"math"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// A device's apps list is the device's text: a C string with its
// terminator, or an app put there by other means than the bridge, with an
// id the contract does not allow. The server refuses a status holding an
// app id it cannot take, and with it a final reply that carries one: the
// command that changed the apps would never end, and the device's status
// never change again. The bridge reports the apps it can name and leaves
// out the others.
func TestAppsTheServerCannotTakeAreLeftOut(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	if err := dev.InstallApp(t.Context(), "before-the-bridge", "weather", "1.2.0", []byte("pkg")); err != nil {
		t.Fatal(err)
	}
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev},
		wrap: func(d *sim.Device) agent.Device { return oddApps{d} }})

	c := command(t, "dev-1", topics.OpAppUninstall, topics.AppUninstall{AppID: "weather"})
	w.send(c)
	final := w.waitFinal("dev-1", c.ID)
	if final.State != companion.StateSucceeded || final.Status == nil {
		t.Fatalf("final reply %+v; want succeeded with the status", final)
	}
	want := []companion.App{{AppID: "clock", Version: "1.0.0"}}
	if !equalApps(final.Status.Apps, want) {
		t.Errorf("apps in the final reply %v; want %v", final.Status.Apps, want)
	}
	st := w.waitStatus("dev-1", "without weather", func(s topics.Status) bool { return s.Online && equalApps(s.Apps, want) })
	if st.Battery == nil {
		t.Errorf("status %+v", st)
	}
}

func equalApps(a, b []companion.App) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// oddApps is a device whose apps list also holds an app named as a C
// string, terminator included, and one whose id has capitals and spaces.
type oddApps struct{ *sim.Device }

func (d oddApps) Info(ctx context.Context) (companion.DeviceInfo, error) {
	info, err := d.Device.Info(ctx)
	info.Apps = append(info.Apps, companion.App{AppID: "clock\x00", Version: "1.0.0\x00"},
		companion.App{AppID: "Factory Demo", Version: "0.1.0"})
	return info, err
}

// A device's settings schema is the firmware's: a default it declares as a
// CBOR float NaN or infinity decodes, and JSON cannot carry it. The
// settings the bridge cannot encode are left out, with their values, as
// the server leaves out those it cannot describe: before, the final reply
// of every command that read the settings back could not be encoded, nor
// spooled, and the command never ended (bug 141).
func TestSettingsTheBridgeCannotEncodeAreLeftOut(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")},
		wrap: func(d *sim.Device) agent.Device { return oddSchema{d} }})

	c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80}})
	w.send(c)
	final := w.waitFinal("dev-1", c.ID)
	if final.State != companion.StateSucceeded || final.Settings == nil {
		t.Fatalf("final reply %+v; want succeeded with the settings", final)
	}
	if _, ok := final.Settings.Schema["glow"]; ok || final.Settings.Reported["glow"] != nil {
		t.Errorf("the setting with a NaN default is in the final reply: %+v", *final.Settings)
	}
	if final.Settings.Reported["brightness"] != 80.0 || final.Settings.Schema["volume"].Type != topics.SettingInt {
		t.Errorf("settings in the final reply %+v; want the others", *final.Settings)
	}
}

// oddSchema is a device whose schema also declares settings with a default
// JSON cannot hold.
type oddSchema struct{ *sim.Device }

func (d oddSchema) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	values, schema, err := d.Device.Settings(ctx)
	if err != nil {
		return nil, nil, err
	}
	schema = maps.Clone(schema)
	schema["glow"] = topics.SettingSpec{Type: topics.SettingInt, Default: math.NaN()}
	schema["heat"] = topics.SettingSpec{Type: topics.SettingString, Default: map[string]any{"x": math.Inf(1)}}
	values["glow"], values["heat"] = int64(3), "warm"
	return values, schema, nil
}

// A device may answer each setting's read with up to 16 KiB (the bridge's
// largest SMP response): forty such settings are more than a message
// carries (topics.MaxPayload), and the server, as the MQTT broker, refuses
// a longer one. The settings are then not sent, and said so; the final
// reply goes without them, and the next command is not held up. Ten fit a
// message, but not twice over: the final reply of a settings change,
// which carries them and its result (the reported values again), goes
// without its result (bug 142).
func TestSettingsLongerThanAMessageAreNotSent(t *testing.T) {
	for _, tt := range []struct {
		n            int
		withSettings bool
	}{{40, false}, {10, true}} {
		t.Run(fmt.Sprint(tt.n), func(t *testing.T) {
			b := startBroker(t)
			w := newWatcher(t, b)
			startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")},
				wrap: func(d *sim.Device) agent.Device { return bigSettings{d, tt.n} }})

			c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80}})
			w.send(c)
			final := w.waitFinal("dev-1", c.ID)
			if final.State != companion.StateSucceeded || (final.Settings != nil) != tt.withSettings || final.Result != nil {
				t.Fatalf("final reply %.300v; want succeeded, without its result, with the settings %v", final, tt.withSettings)
			}
			if tt.withSettings && final.Settings.Reported["brightness"] != 80.0 {
				t.Errorf("settings in the final reply: brightness %v", final.Settings.Reported["brightness"])
			}
			next := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "after"})
			w.send(next)
			if r := w.waitFinal("dev-1", next.ID); r.State != companion.StateSucceeded {
				t.Errorf("the next command: %+v", r)
			}
		})
	}
}

// bigSettings is a device with n more settings of 16 KiB each.
type bigSettings struct {
	*sim.Device
	n int
}

func (d bigSettings) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	values, schema, err := d.Device.Settings(ctx)
	if err != nil {
		return nil, nil, err
	}
	schema = maps.Clone(schema)
	for i := range d.n {
		name := fmt.Sprintf("big%02d", i)
		schema[name] = topics.SettingSpec{Type: topics.SettingString, Default: ""}
		values[name] = strings.Repeat("x", 16<<10-100)
	}
	return values, schema, nil
}

// A device whose battery level could not be read (companion.BatteryUnknown)
// is reported online with its battery unknown (null), never as -1, which
// the server refuses with the whole status (bug 147).
func TestAnUnknownBatteryIsReportedNull(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")},
		wrap: func(d *sim.Device) agent.Device { return unknownBattery{d} }})
	st := w.waitStatus("dev-1", "online, battery unknown", func(s topics.Status) bool { return s.Online })
	if st.Battery != nil || st.FirmwareVersion == "" {
		t.Errorf("status %+v; want the battery null and the firmware version", st)
	}
}

// unknownBattery is a device whose battery level could not be read.
type unknownBattery struct{ *sim.Device }

func (d unknownBattery) Info(ctx context.Context) (companion.DeviceInfo, error) {
	info, err := d.Device.Info(ctx)
	info.Battery = companion.BatteryUnknown
	return info, err
}
