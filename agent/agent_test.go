package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/metrics"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

var _ agent.Device = (*sim.Device)(nil)

// commandFigures returns what the bridge's metrics say of op: the commands
// counted failed, and the runs observed in the duration histogram.
func commandFigures(t testing.TB, b *metrics.Bridge, op string) (failed float64, ran uint64) {
	t.Helper()
	fams, err := b.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["op"] != op {
				continue
			}
			switch f.GetName() {
			case "companion_bridge_commands_total":
				if labels["result"] == companion.StateFailed {
					failed = m.GetCounter().GetValue()
				}
			case "companion_bridge_command_duration_seconds":
				ran = m.GetHistogram().GetSampleCount()
			}
		}
	}
	return failed, ran
}

// states returns the states of replies, in order.
func states(rs []topics.Reply) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.State
	}
	return out
}

// checkLifecycle checks that a command's replies went delivered, then
// in_progress (when wantProgress), then succeeded, never backwards.
// checkLifecycle checks the replies of one command: never backwards,
// "delivered" (which a command that ends quickly does without) at most once
// and first, progress when wanted, succeeded last.
func checkLifecycle(t *testing.T, rs []topics.Reply, wantProgress bool) {
	t.Helper()
	if len(rs) == 0 {
		t.Fatalf("no replies")
	}
	for i, r := range rs {
		if r.State == companion.StateDelivered && i > 0 {
			t.Fatalf("replies %v; want delivered first if at all", states(rs))
		}
	}
	sawProgress := false
	rank := 0
	for _, r := range rs {
		if companion.Rank(r.State) < rank {
			t.Fatalf("replies %v go backwards", states(rs))
		}
		rank = companion.Rank(r.State)
		if r.State == companion.StateInProgress {
			sawProgress = true
			if r.Progress == nil || *r.Progress < 0 || *r.Progress > 100 {
				t.Errorf("in_progress reply with progress %v", r.Progress)
			}
		}
	}
	if last := rs[len(rs)-1].State; last != companion.StateSucceeded {
		t.Fatalf("replies %v; want succeeded last", states(rs))
	}
	if wantProgress && !sawProgress {
		t.Errorf("replies %v; want in_progress among them", states(rs))
	}
}

// A command that ends within deliveredDelay gets its final reply only; one
// that waits behind a slow command on its device reads "delivered" first.
func TestDeliveredOnlyWhenACommandTakesLong(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	slow := sim.New(sim.Options{ID: "dev-slow", ExecDelay: 3 * agent.DeliveredDelay})
	quick := newSim("dev-quick")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{slow, quick}})

	q := command(t, "dev-quick", topics.OpPushText, topics.PushText{Text: "quick"})
	w.send(q)
	if r := w.waitFinal("dev-quick", q.ID); r.State != companion.StateSucceeded {
		t.Fatalf("quick command ended %s", r.State)
	}

	first := command(t, "dev-slow", topics.OpPushText, topics.PushText{Text: "first"})
	second := command(t, "dev-slow", topics.OpPushText, topics.PushText{Text: "second"})
	w.send(first)
	w.send(second)
	for _, c := range []topics.Command{first, second} {
		if r := w.waitFinal("dev-slow", c.ID); r.State != companion.StateSucceeded {
			t.Fatalf("%s ended %s", c.Payload, r.State)
		}
		if got := states(w.replies("dev-slow", c.ID)); len(got) != 2 || got[0] != companion.StateDelivered {
			t.Errorf("replies of %s: %v; want delivered, succeeded", c.Payload, got)
		}
	}
	if got := states(w.replies("dev-quick", q.ID)); len(got) != 1 {
		t.Errorf("replies of the quick command: %v; want succeeded alone", got)
	}
}

func TestEveryOpSucceeds(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{dev}})

	// The first status and settings are published on connect.
	w.waitStatus("dev-1", "first", func(s topics.Status) bool {
		return s.Online && s.FirmwareVersion == "1.0.0" && s.Model == "sim-1" && s.BridgeID == "b1" && s.Battery != nil
	})

	image := bytes.Repeat([]byte("\x89PNG-image-"), 1000)
	appV1 := bytes.Repeat([]byte("app-1.0.0"), 500)
	appV2 := bytes.Repeat([]byte("app-1.1.0"), 500)
	firmware := firmwareImage(t, "2.0.0", bytes.Repeat([]byte("firmware-2.0.0"), 10000))

	steps := []struct {
		name         string
		cmd          topics.Command
		wantProgress bool
		check        func(t *testing.T, r topics.Reply)
	}{
		{"push.text", command(t, "dev-1", topics.OpPushText, topics.PushText{Title: "Hi", Text: "Hello, device"}), false, func(t *testing.T, r topics.Reply) {
			texts := dev.Texts()
			if len(texts) != 1 || texts[0].Text != "Hello, device" || texts[0].Title != "Hi" {
				t.Errorf("Texts() = %+v; want the pushed text", texts)
			}
		}},
		{"push.image", command(t, "dev-1", topics.OpPushImage, topics.PushImage{ContentType: "image/png", Width: 1, Height: 1, Blob: bs.add(image)}), true, func(t *testing.T, r topics.Reply) {
			imgs := dev.Images()
			if len(imgs) != 1 || !bytes.Equal(imgs[0].Data, image) || imgs[0].ContentType != "image/png" {
				t.Errorf("Images() has %d images; want the pushed one", len(imgs))
			}
		}},
		{"app.install", command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: bs.add(appV1)}), true, func(t *testing.T, r topics.Reply) {
			if got := dev.Apps()["weather"]; got != "1.0.0" {
				t.Errorf("weather app version %q; want 1.0.0", got)
			}
			if r.Status == nil || len(r.Status.Apps) != 1 || r.Status.Apps[0] != (companion.App{AppID: "weather", Version: "1.0.0"}) || r.Status.Seq == 0 {
				t.Errorf("final reply's status %+v; want the app installed, with a seq", r.Status)
			}
		}},
		{"app.update", command(t, "dev-1", topics.OpAppUpdate, topics.AppInstall{AppID: "weather", Version: "1.1.0", Blob: bs.add(appV2)}), true, func(t *testing.T, r topics.Reply) {
			if got := dev.Apps()["weather"]; got != "1.1.0" {
				t.Errorf("weather app version %q; want 1.1.0", got)
			}
			w.waitStatus("dev-1", "app 1.1.0", func(s topics.Status) bool {
				return len(s.Apps) == 1 && s.Apps[0] == companion.App{AppID: "weather", Version: "1.1.0"}
			})
		}},
		{"app.uninstall", command(t, "dev-1", topics.OpAppUninstall, topics.AppUninstall{AppID: "weather"}), false, func(t *testing.T, r topics.Reply) {
			if _, ok := dev.Apps()["weather"]; ok {
				t.Errorf("weather app still installed")
			}
			if r.Status == nil || len(r.Status.Apps) != 0 {
				t.Errorf("final reply's status %+v; want no apps", r.Status)
			}
		}},
		{"settings.update", command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80, "language": "de"}}), false, func(t *testing.T, r topics.Reply) {
			if r.Settings == nil || r.Settings.Reported["language"] != "de" || r.Settings.Schema["brightness"].Type != topics.SettingInt {
				t.Errorf("final reply's settings %+v; want the new values and the schema", r.Settings)
			}
			topic, _ := tree.Settings("dev-1")
			w.waitFor("settings with brightness 80", func(m message) bool {
				s, err := topics.ParseSettings(m.payload)
				return m.topic == topic && err == nil && s.Reported["brightness"] == float64(80) && s.Reported["language"] == "de" && s.Schema["brightness"].Type == topics.SettingInt
			})
		}},
		{"ota.update", command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "2.0.0", Blob: bs.add(firmware)}), true, func(t *testing.T, r topics.Reply) {
			if got := dev.Firmware(); got != "2.0.0" {
				t.Errorf("Firmware() = %q; want 2.0.0", got)
			}
			var res struct {
				FirmwareVersion string `json:"firmware_version"`
			}
			if err := json.Unmarshal(r.Result, &res); err != nil || res.FirmwareVersion != "2.0.0" {
				t.Errorf("result %s; want firmware_version 2.0.0", r.Result)
			}
			if r.Status == nil || r.Status.FirmwareVersion != "2.0.0" {
				t.Errorf("final reply's status %+v; want firmware 2.0.0", r.Status)
			}
			w.waitStatus("dev-1", "firmware 2.0.0", func(s topics.Status) bool { return s.FirmwareVersion == "2.0.0" })
		}},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			w.send(st.cmd)
			r := w.waitFinal("dev-1", st.cmd.ID)
			if r.State != companion.StateSucceeded {
				t.Fatalf("%s ended %s (%+v); want succeeded", st.name, r.State, r.Error)
			}
			checkLifecycle(t, w.replies("dev-1", st.cmd.ID), st.wantProgress)
			if n := dev.Executions(st.cmd.ID); n != 1 {
				t.Errorf("Executions(%s) = %d; want 1", st.name, n)
			}
			st.check(t, r)
		})
	}

	// Every request for a blob carried the bridge secret.
	for _, r := range bs.seen() {
		if r.Header.Get("Authorization") != "Bearer "+testSecret {
			t.Errorf("blob request without the bridge secret: %v", r.Header)
		}
	}
}

func TestDuplicateCommandRunsOnce(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}})

	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "once"})
	w.send(c)
	w.send(c) // a redelivery before it ran
	w.waitReply("dev-1", c.ID, companion.StateSucceeded)

	w.send(c) // a redelivery after it finished: its final reply comes again
	replyTopic, _ := tree.Replies("dev-1")
	w.waitFor("the final reply again", func(m message) bool {
		return m.topic == replyTopic && strings.Contains(string(m.payload), c.ID) && len(finals(w.replies("dev-1", c.ID))) >= 2
	})

	// A command sent after the duplicates finishes, so they have all been
	// handled by now.
	after := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "after"})
	w.send(after)
	w.waitReply("dev-1", after.ID, companion.StateSucceeded)

	if n := dev.Executions(c.ID); n != 1 {
		t.Errorf("Executions = %d; want 1", n)
	}
	if n := len(dev.Texts()); n != 2 {
		t.Errorf("device has %d texts; want 2", n)
	}
	for _, r := range finals(w.replies("dev-1", c.ID)) {
		if r.State != companion.StateSucceeded {
			t.Errorf("final reply %s; want succeeded", r.State)
		}
	}
}

// A repeat of a command the bridge holds, queued or running, is answered
// "delivered". The server sends a command again when it has not heard that
// the bridge has it: here the bridge took the commands in and crashed
// before their "delivered" went out, and the server sends them again when
// the bridge says online (a broker or a server that lost the reply does
// the same). Dropped unanswered, the second read sent until it ended: sent
// again every minute, cancelable while it ran, expired by the server past
// its TTL while the bridge held it.
func TestRepeatOfAHeldCommandIsAnsweredDelivered(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := sim.New(sim.Options{ID: "dev-1", ExecDelay: 4 * agent.DeliveredDelay})
	dir := t.TempDir()
	first := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "first"})
	second := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "second"})
	if err := agent.SpoolCommands(dir, []topics.Command{first, second}); err != nil {
		t.Fatal(err)
	}

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})
	w.send(first) // the server's resend after "online"
	w.send(second)
	if r := w.waitFinal("dev-1", second.ID); r.State != companion.StateSucceeded {
		t.Fatalf("second ended %s", r.State)
	}
	if got := states(w.replies("dev-1", second.ID)); len(got) != 2 || got[0] != companion.StateDelivered {
		t.Errorf("replies of the second: %v; want delivered, succeeded", got)
	}
	for _, c := range []topics.Command{first, second} {
		if n := dev.Executions(c.ID); n != 1 {
			t.Errorf("Executions(%s) = %d; want 1", c.Payload, n)
		}
	}
}

func finals(rs []topics.Reply) []topics.Reply {
	var out []topics.Reply
	for _, r := range rs {
		if companion.IsFinal(r.State) {
			out = append(out, r)
		}
	}
	return out
}

func TestExpiredCommandNeverRuns(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}})

	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "too late"})
	c.ExpiresAt = time.Now().Add(-time.Second)
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateExpired {
		t.Fatalf("final state %s; want expired", r.State)
	}
	if n := dev.Executions(c.ID); n != 0 {
		t.Errorf("Executions = %d; want 0", n)
	}
}

// A command already past its TTL when the bridge takes it is answered
// "expired" alone, whether or not its device is busy: "expired" means never
// delivered (CONTRACT §2), so no "delivered" may come before it. Behind a
// busy device, its "delivered" used to go out deliveredDelay after it came
// in, and "expired" once the worker reached it.
func TestPastItsTTLOnArrivalIsOnlyExpired(t *testing.T) {
	for _, busy := range []bool{false, true} {
		t.Run(fmt.Sprintf("busy=%v", busy), func(t *testing.T) {
			b := startBroker(t)
			w := newWatcher(t, b)
			// Each command takes well past deliveredDelay: the other one's
			// final reply comes after any "delivered" of the late one would
			// have (one client, one topic: in order).
			dev := sim.New(sim.Options{ID: "dev-1", ExecDelay: 4 * agent.DeliveredDelay})
			startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}})

			var other topics.Command
			if busy {
				other = command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "in time"})
				w.send(other)
				w.waitReply("dev-1", other.ID, companion.StateDelivered) // it runs
			}
			late := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "too late"})
			late.ExpiresAt = time.Now().Add(-time.Second)
			w.send(late)
			if !busy {
				other = command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "in time"})
				w.send(other)
			}
			if r := w.waitFinal("dev-1", other.ID); r.State != companion.StateSucceeded {
				t.Fatalf("the command in time ended %s", r.State)
			}
			w.waitFinal("dev-1", late.ID)
			if got := states(w.replies("dev-1", late.ID)); !slices.Equal(got, []string{companion.StateExpired}) {
				t.Errorf("replies of the command past its TTL: %v; want [expired]", got)
			}
			if n := dev.Executions(late.ID); n != 0 {
				t.Errorf("Executions = %d; want 0", n)
			}
		})
	}
}

// A command past its TTL as the bridge takes it never runs, also when the
// bridge stops before its worker reached it: queued first of its line, it
// was on disk as running, and after a restart it ran whatever its TTL.
func TestPastItsTTLOnArrivalNeverRunsAfterARestart(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()
	late := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "too late"})
	late.ExpiresAt = time.Now().Add(-time.Second)
	if err := agent.SpoolCommands(dir, []topics.Command{late}); err != nil {
		t.Fatal(err)
	}

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})
	if r := w.waitFinal("dev-1", late.ID); r.State != companion.StateExpired {
		t.Errorf("final state %s; want expired", r.State)
	}
	if n := dev.Executions(late.ID); n != 0 {
		t.Errorf("Executions = %d; want 0", n)
	}
}

func TestFailures(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{dev}, timeout: 500 * time.Millisecond})

	good := bs.add([]byte("good image"))
	wrongSHA := bs.add([]byte("served bytes"))
	wrongSHA.SHA256 = strings.Repeat("ab", 32)
	wrongSHA.URL = "/api/v1/blobs/" + wrongSHA.SHA256
	bs.mu.Lock()
	bs.blobs[wrongSHA.SHA256] = []byte("served bytes")
	bs.mu.Unlock()
	missing := topics.Blob{SHA256: strings.Repeat("cd", 32), Size: 3, URL: "/api/v1/blobs/" + strings.Repeat("cd", 32)}

	tests := []struct {
		name     string
		setup    func()
		cmd      topics.Command
		wantCode string
	}{
		{"settings out of range", nil, command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 500}}), "invalid_payload"},
		{"unknown setting", nil, command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"colour": "red"}}), "invalid_payload"},
		{"bad payload", nil, command(t, "dev-1", topics.OpPushText, "not an object"), "invalid_payload"},
		// What the server refuses, the bridge refuses too, for a command
		// from elsewhere on the topic.
		{"text with a NUL", nil, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "cut\x00here"}), "invalid_payload"},
		{"text with an ESC", nil, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "\x1b[2Jcleared"}), "invalid_payload"},
		{"text with a C1 code", nil, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "a\u0085b"}), "invalid_payload"},
		{"title on two lines", nil, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "x", Title: "two\nlines"}), "invalid_payload"},
		{"device fails", func() { dev.FailNext(errors.New("screen broken")) }, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "x"}), "device_error"},
		{"device hangs", dev.HangNext, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "y"}), "timeout"},
		{"checksum mismatch", nil, command(t, "dev-1", topics.OpPushImage, topics.PushImage{ContentType: "image/png", Blob: wrongSHA}), "checksum_mismatch"},
		{"blob missing", nil, command(t, "dev-1", topics.OpPushImage, topics.PushImage{ContentType: "image/png", Blob: missing}), "download_failed"},
		{"uninstall absent app", nil, command(t, "dev-1", topics.OpAppUninstall, topics.AppUninstall{AppID: "nope"}), "device_error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.setup != nil {
				tt.setup()
			}
			w.send(tt.cmd)
			// The next command is not held up by a failing one.
			next := command(t, "dev-1", topics.OpPushImage, topics.PushImage{ContentType: "image/png", Blob: good})
			w.send(next)

			r := w.waitFinal("dev-1", tt.cmd.ID)
			if r.State != companion.StateFailed || r.Error == nil || r.Error.Code != tt.wantCode {
				t.Errorf("%s: final %s %+v; want failed %s", tt.name, r.State, r.Error, tt.wantCode)
			}
			if rn := w.waitFinal("dev-1", next.ID); rn.State != companion.StateSucceeded {
				t.Errorf("next command ended %s %+v; want succeeded", rn.State, rn.Error)
			}
		})
	}
	settings, _, _ := dev.Settings(t.Context())
	if settings["brightness"] != 50 {
		t.Errorf("brightness = %v after bad updates; want 50", settings["brightness"])
	}
	for _, text := range dev.Texts() {
		if _, at := topics.ControlChar(text.Text, topics.TextControls); at >= 0 || strings.ContainsFunc(text.Title, unicode.IsControl) {
			t.Errorf("the device was written the text %q titled %q", text.Text, text.Title)
		}
	}
}

// An OTA whose UpdateFirmware returned nil has happened: the device runs
// the image and has confirmed it. A status read that fails right after it
// leaves the command succeeded, with the version UpdateFirmware confirmed,
// and its final reply carries the last known status with that version (the
// server stores it with the command's end, CONTRACT §8); the status follows
// in a report, and a device out of reach from then on is reported offline
// with the new version, not the old one. A read that reports another
// version fails the command with version_mismatch. (The read failing
// failed the update.)
func TestOTAStatusReadAfterTheUpdate(t *testing.T) {
	tests := []struct {
		name      string
		dev       func(*sim.Device) *afterUpdate
		wantState string
		wantCode  string
	}{
		{"the read fails", func(d *sim.Device) *afterUpdate {
			return &afterUpdate{Device: d, readErr: errors.New("link dropped after the reboot")}
		}, companion.StateSucceeded, ""},
		{"the device is out of reach from then on", func(d *sim.Device) *afterUpdate {
			return &afterUpdate{Device: d, readErr: errors.New("out of reach after the reboot"), sticky: true}
		}, companion.StateSucceeded, ""},
		{"the read reports another version", func(d *sim.Device) *afterUpdate {
			return &afterUpdate{Device: d, version: "1.0.0"}
		}, companion.StateFailed, "version_mismatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startBroker(t)
			bs := startBlobServer(t)
			w := newWatcher(t, b)
			sd := newSim("dev-1")
			dev := tt.dev(sd)
			startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{sd}, interval: 200 * time.Millisecond, wrap: func(*sim.Device) agent.Device { return dev }})
			// The reporter's first read is done before the update: the
			// next read after it is the worker's.
			w.waitStatus("dev-1", "first", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "1.0.0" })

			firmware := firmwareImage(t, "2.0.0", bytes.Repeat([]byte("firmware-2.0.0"), 1000))
			c := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "2.0.0", Blob: bs.add(firmware)})
			w.send(c)
			r := w.waitFinal("dev-1", c.ID)
			if !dev.readAfterUpdate() {
				t.Fatal("no status read after the update")
			}
			if got := sd.Firmware(); got != "2.0.0" {
				t.Fatalf("Firmware() = %q; want 2.0.0 (the update happened)", got)
			}
			if tt.wantCode != "" {
				if r.State != tt.wantState || r.Error == nil || r.Error.Code != tt.wantCode {
					t.Fatalf("final %s %+v; want %s %s", r.State, r.Error, tt.wantState, tt.wantCode)
				}
				if r.Status == nil || r.Status.FirmwareVersion != dev.version {
					t.Errorf("final reply's status %+v; want the version the device reported, %s", r.Status, dev.version)
				}
				return
			}
			if r.State != tt.wantState {
				t.Fatalf("final %s %+v; want %s", r.State, r.Error, tt.wantState)
			}
			var res struct {
				FirmwareVersion string `json:"firmware_version"`
			}
			if err := json.Unmarshal(r.Result, &res); err != nil || res.FirmwareVersion != "2.0.0" {
				t.Errorf("result %s; want firmware_version 2.0.0", r.Result)
			}
			if r.Status == nil || !r.Status.Online || r.Status.FirmwareVersion != "2.0.0" || r.Status.Battery == nil || r.Status.Model != "sim-1" {
				t.Errorf("final reply's status %+v; want the last known one, online, with firmware 2.0.0", r.Status)
			}
			if !dev.sticky {
				w.waitStatus("dev-1", "firmware 2.0.0 in a report", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "2.0.0" })
				return
			}
			statusTopic, _ := tree.Status("dev-1")
			offline := func(m message) bool {
				if m.topic != statusTopic {
					return false
				}
				s, err := topics.ParseStatus(m.payload)
				return err == nil && !s.Online && s.FirmwareVersion == "2.0.0"
			}
			w.waitFor("two reports offline with firmware 2.0.0", func(message) bool { return w.count(offline) >= 2 })
		})
	}
}

// afterUpdate is a simulated device whose first status read after a
// firmware update that returned nil goes wrong: it fails with readErr, or
// reports version as the firmware it runs.
type afterUpdate struct {
	*sim.Device
	readErr error
	version string
	sticky  bool // every read after the update fails with readErr

	mu      sync.Mutex
	updated bool // an update returned nil, and no read followed yet
	read    bool // a read followed an update
}

func (d *afterUpdate) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	err := d.Device.UpdateFirmware(ctx, cmdID, version, image, progress)
	if err == nil {
		d.mu.Lock()
		d.updated = true
		d.mu.Unlock()
	}
	return err
}

func (d *afterUpdate) Info(ctx context.Context) (companion.DeviceInfo, error) {
	d.mu.Lock()
	first := d.updated
	d.updated = false
	d.read = d.read || first
	failing := d.sticky && d.read
	d.mu.Unlock()
	if failing {
		return companion.DeviceInfo{}, d.readErr
	}
	info, err := d.Device.Info(ctx)
	if !first || err != nil {
		return info, err
	}
	if d.readErr != nil {
		return companion.DeviceInfo{}, d.readErr
	}
	info.FirmwareVersion = d.version
	return info, nil
}

// readAfterUpdate reports whether a status read followed an update.
func (d *afterUpdate) readAfterUpdate() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.read
}

func TestOrderPerDevice(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	devA, devB := newSim("dev-a"), newSim("dev-b")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{devA, devB}})

	const n = 50
	var lastA, lastB topics.Command
	for i := range n {
		lastA = command(t, "dev-a", topics.OpPushText, topics.PushText{Text: fmt.Sprint(i)})
		lastB = command(t, "dev-b", topics.OpPushText, topics.PushText{Text: fmt.Sprint(i)})
		w.send(lastA)
		w.send(lastB)
	}
	w.waitReply("dev-a", lastA.ID, companion.StateSucceeded)
	w.waitReply("dev-b", lastB.ID, companion.StateSucceeded)
	for _, dev := range []*sim.Device{devA, devB} {
		texts := dev.Texts()
		if len(texts) != n {
			t.Fatalf("%s has %d texts; want %d", dev.ID(), len(texts), n)
		}
		for i, tx := range texts {
			if tx.Text != fmt.Sprint(i) {
				t.Fatalf("%s text %d is %q; want %q (out of order)", dev.ID(), i, tx.Text, fmt.Sprint(i))
			}
		}
	}
}

// afterTest runs a bridge with one device, dev-a, waiting afterWait for a
// command's predecessor (0: the default), and returns its watcher, the
// device, and a maker of text commands that run after another (after "":
// none).
func afterTest(t *testing.T, afterWait time.Duration) (*watcher, *sim.Device, func(text, after string) topics.Command) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-a")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, afterWait: afterWait})
	return w, dev, func(text, after string) topics.Command {
		c := command(t, "dev-a", topics.OpPushText, topics.PushText{Text: text})
		c.After = after
		return c
	}
}

// textsOf returns the texts a device ran, in order.
func textsOf(dev *sim.Device) []string {
	var got []string
	for _, tx := range dev.Texts() {
		got = append(got, tx.Text)
	}
	return got
}

// A command that comes late, after the ones accepted behind it (a NATS
// node's redelivery after its ack wait), still runs first: each of those
// names the one it runs after, and waits for it.
func TestLateCommandRunsBeforeTheOnesAfterIt(t *testing.T) {
	w, dev, text := afterTest(t, 0)
	first := text("first", "")
	second := text("second", first.ID)
	third := text("third", second.ID)
	w.send(second)
	w.send(third)
	// Both are in the spool ("delivered"), and wait.
	w.waitReply("dev-a", second.ID, companion.StateDelivered)
	w.waitReply("dev-a", third.ID, companion.StateDelivered)
	if got := textsOf(dev); len(got) != 0 {
		t.Fatalf("the device ran %v before the command they run after came", got)
	}
	w.send(first)
	w.waitReply("dev-a", third.ID, companion.StateSucceeded)
	if got, want := textsOf(dev), []string{"first", "second", "third"}; !slices.Equal(got, want) {
		t.Fatalf("the device ran %v; want %v", got, want)
	}
	// One whose predecessor has finished runs at once (the wait is
	// DefaultAfterWait, longer than waitReply waits).
	fourth := text("fourth", third.ID)
	w.send(fourth)
	w.waitReply("dev-a", fourth.ID, companion.StateSucceeded)
}

// A command whose predecessor the server withdrew (a cancel, sent when it
// expired or was canceled on its way) waits for it no longer.
func TestWithdrawnPredecessorIsNotWaitedFor(t *testing.T) {
	w, dev, text := afterTest(t, 0)
	gone := text("gone", "")
	next := text("next", gone.ID)
	w.send(next)
	w.waitReply("dev-a", next.ID, companion.StateDelivered)
	w.send(command(t, "dev-a", topics.OpCancel, topics.Cancel{CommandID: gone.ID}))
	w.waitReply("dev-a", next.ID, companion.StateSucceeded)
	// And the withdrawn one, should it still come, never runs.
	w.send(gone)
	w.waitReply("dev-a", gone.ID, companion.StateCanceled)
	if got := textsOf(dev); !slices.Equal(got, []string{"next"}) {
		t.Fatalf("the device ran %v; want next alone", got)
	}
}

// A command whose predecessor never comes runs after AfterWait.
func TestCommandRunsWithoutAPredecessorThatNeverComes(t *testing.T) {
	w, dev, text := afterTest(t, 300*time.Millisecond)
	orphan := text("orphan", text("missing", "").ID)
	w.send(orphan)
	w.waitReply("dev-a", orphan.ID, companion.StateDelivered)
	w.waitReply("dev-a", orphan.ID, companion.StateSucceeded)
	if got := textsOf(dev); !slices.Equal(got, []string{"orphan"}) {
		t.Fatalf("the device ran %v; want the orphan", got)
	}
}

func TestCancelQueuedCommand(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, timeout: time.Second})

	dev.HangNext()
	first := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "hangs"})
	second := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "canceled"})
	third := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "runs"})
	w.send(first)
	w.send(second)
	w.waitReply("dev-1", second.ID, companion.StateDelivered)
	w.send(command(t, "dev-1", topics.OpCancel, topics.Cancel{CommandID: second.ID}))
	w.send(third)

	if r := w.waitFinal("dev-1", third.ID); r.State != companion.StateSucceeded {
		t.Fatalf("third ended %s", r.State)
	}
	if n := dev.Executions(second.ID); n != 0 {
		t.Errorf("canceled command ran %d times", n)
	}
	for _, r := range w.replies("dev-1", second.ID) {
		if r.State == companion.StateSucceeded || r.State == companion.StateInProgress {
			t.Errorf("canceled command has a %s reply", r.State)
		}
	}
}

// A command canceled soon after it came in, before its "delivered" was
// due, never reads "delivered" after "canceled".
func TestNoDeliveredAfterCanceled(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, timeout: time.Second})

	dev.HangNext()
	first := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "hangs"})
	second := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "canceled"})
	w.send(first)
	w.send(second)
	w.send(command(t, "dev-1", topics.OpCancel, topics.Cancel{CommandID: second.ID}))
	w.waitReply("dev-1", second.ID, companion.StateCanceled)
	// The first ends with the command timeout, well after the second's
	// "delivered" would have been due.
	w.waitFinal("dev-1", first.ID)
	if got := states(w.replies("dev-1", second.ID)); got[len(got)-1] != companion.StateCanceled {
		t.Errorf("replies of the canceled command: %v; want canceled last", got)
	}
}

func TestBadMessagesAreDropped(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}})

	topic, _ := tree.Command("dev-1", topics.OpPushText)
	for _, payload := range []string{"", "{", `{"id":"not-a-uuid","op":"push.text","device_id":"dev-1"}`} {
		w.client.Publish(topic, 1, false, payload).Wait()
	}
	mismatch := command(t, "dev-2", topics.OpPushText, topics.PushText{Text: "for another device"})
	raw, _ := json.Marshal(mismatch)
	w.client.Publish(topic, 1, false, raw).Wait()

	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "fine"})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("ended %s", r.State)
	}
	if n := len(dev.Texts()); n != 1 {
		t.Errorf("device has %d texts; want 1", n)
	}
}

func TestBlobDownloadResumes(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{dev}})

	firmware := firmwareImage(t, "1.1.0", bytes.Repeat([]byte("0123456789abcdef"), 64<<10)) // 1 MiB and a little
	ref := bs.add(firmware)
	bs.cutNext(ref.SHA256, 300<<10)
	c := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "1.1.0", Blob: ref})
	w.send(c)
	if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
		t.Fatalf("ended %s %+v", r.State, r.Error)
	}
	var ranges []string
	for _, r := range bs.seen() {
		if rg := r.Header.Get("Range"); rg != "" {
			ranges = append(ranges, rg)
		}
	}
	if len(ranges) != 1 || ranges[0] != fmt.Sprintf("bytes=%d-", 300<<10) {
		t.Errorf("Range requests %q; want one from byte %d", ranges, 300<<10)
	}
	if dev.Firmware() != "1.1.0" {
		t.Errorf("Firmware() = %q", dev.Firmware())
	}

	// A second command with the same blob uses the cache.
	before := len(bs.seen())
	c2 := command(t, "dev-1", topics.OpOTAUpdate, topics.OTAUpdate{Version: "1.1.0", Blob: ref})
	w.send(c2)
	if r := w.waitFinal("dev-1", c2.ID); r.State != companion.StateSucceeded {
		t.Fatalf("ended %s %+v", r.State, r.Error)
	}
	if after := len(bs.seen()); after != before {
		t.Errorf("%d more blob requests; want the cached blob reused", after-before)
	}
}

func TestRestartKeepsCommands(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})

	done := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "before"})
	w.send(done)
	w.waitReply("dev-1", done.ID, companion.StateSucceeded)
	br.stop(t)
	w.waitBridgeState("b1", topics.BridgeOffline, 1)

	// While the bridge is down, the broker keeps its session's messages.
	var queued []topics.Command
	for i := range 3 {
		c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: fmt.Sprint("while down ", i)})
		queued = append(queued, c)
		w.send(c)
	}
	w.send(done) // a repeat of a finished one

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})
	for _, c := range queued {
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Errorf("%s ended %s", c.ID, r.State)
		}
	}
	w.waitFor("the repeat's final reply", func(message) bool { return len(finals(w.replies("dev-1", done.ID))) >= 2 })
	if n := dev.Executions(done.ID); n != 1 {
		t.Errorf("finished command ran %d times; want 1", n)
	}
	texts := dev.Texts()
	if len(texts) != 4 || texts[1].Text != "while down 0" || texts[3].Text != "while down 2" {
		t.Errorf("texts %+v; want before and the three sent while down, in order", texts)
	}
}

// Commands the spool holds for a device the bridge no longer serves (it
// restarted with a shorter device list) end failed with device_not_served,
// their final replies published as any other: nothing ran or answered
// them, and the server read them delivered until the device moved to
// another bridge.
func TestCommandsOfADeviceNoLongerServedFail(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	devA, devB := newSim("dev-a"), newSim("dev-b")
	dir := t.TempDir()
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{devA, devB}, dataDir: dir})

	// The first hangs on the device until the bridge stops; the second
	// waits behind it.
	devB.HangNext()
	running := command(t, "dev-b", topics.OpPushText, topics.PushText{Text: "hangs"})
	queued := command(t, "dev-b", topics.OpPushText, topics.PushText{Text: "queued"})
	w.send(running)
	w.send(queued)
	w.waitReply("dev-b", queued.ID, companion.StateDelivered)
	br.stop(t)

	// Back with dev-a only, while the broker turns it away: the commands
	// end on disk, and their final replies wait in the outbox through
	// another restart.
	b.hook.refuse.Store(true)
	figures := metrics.NewBridge(metrics.BridgeOptions{Devices: 1})
	a, err := agent.New(agent.Options{MQTTURL: b.url, BridgeID: "b1", DataDir: dir, Devices: []agent.Device{devA}, Logger: testLogger(t), Observer: figures})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(context.Background()) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(waitLong)
	for _, c := range []topics.Command{running, queued} {
		for {
			st, err := a.SpoolState(c.ID)
			if err != nil {
				t.Fatal(err)
			}
			if st == "done" {
				break
			}
			select {
			case <-tick.C:
			case <-deadline:
				t.Fatalf("%s is %q in the spool; want done", c.Payload, st)
			}
		}
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
	b.hook.refuse.Store(false)
	// Counted as failed, as the server reads them, but not observed as
	// runs of 0 s: they never ran (docs/reliability.md, bug 361).
	failed, ran := commandFigures(t, figures, topics.OpPushText)
	if failed != 2 || ran != 0 {
		t.Errorf("push.text: %v failed, %d observed runs; want 2 failed, 0 runs", failed, ran)
	}

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{devA}, dataDir: dir})
	for _, c := range []topics.Command{running, queued} {
		r := w.waitFinal("dev-b", c.ID)
		if r.State != companion.StateFailed || r.Error == nil || r.Error.Code != "device_not_served" ||
			!strings.Contains(r.Error.Message, "no longer serves") {
			t.Errorf("%s ended %s %+v; want failed device_not_served", c.Payload, r.State, r.Error)
		}
	}
	if n := devB.Executions(queued.ID); n != 0 {
		t.Errorf("Executions(queued) = %d; want 0", n)
	}

	served := command(t, "dev-a", topics.OpPushText, topics.PushText{Text: "still served"})
	w.send(served)
	if r := w.waitFinal("dev-a", served.ID); r.State != companion.StateSucceeded {
		t.Errorf("the command of the served device ended %s %+v; want succeeded", r.State, r.Error)
	}
}

func TestCrashedCommandRunsAgainAfterRestart(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()

	// A bridge took these in, then died before running them.
	c1 := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "interrupted"})
	c2 := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "queued"})
	if err := agent.SpoolCommands(dir, []topics.Command{c1, c2}); err != nil {
		t.Fatal(err)
	}
	// The device had done the first before the crash.
	if err := dev.PushText(t.Context(), c1.ID, "", "interrupted"); err != nil {
		t.Fatal(err)
	}

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})
	for _, c := range []topics.Command{c1, c2} {
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Errorf("%s ended %s", c.ID, r.State)
		}
		if n := dev.Executions(c.ID); n != 1 {
			t.Errorf("Executions(%s) = %d; want 1", c.ID, n)
		}
	}
}

// A command the device ran before a bridge crash, whose final reply never
// reached the spool, ends with the device's answer when the bridge comes
// back after its TTL: expired means never delivered (CONTRACT §2).
func TestRanBeforeCrashIsNotExpired(t *testing.T) {
	tests := []struct {
		name  string
		spool func(dir string, cmds []topics.Command) error
		ran   int // how many of the commands the device ran before the crash
	}{
		{"first of its queue", func(dir string, cmds []topics.Command) error {
			return agent.SpoolCommands(dir, cmds[:1])
		}, 1},
		// The worker goes on to the next command while the final reply of
		// the one before is on its way to the file.
		{"second, the first's final reply not on disk", func(dir string, cmds []topics.Command) error {
			return agent.SpoolStarted(dir, cmds, 2)
		}, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startBroker(t)
			w := newWatcher(t, b)
			dev := newSim("dev-1")
			dir := t.TempDir()
			cmds := []topics.Command{
				command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "one"}),
				command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "two"}),
			}
			if err := tt.spool(dir, cmds); err != nil {
				t.Fatal(err)
			}
			ran := cmds[:tt.ran]
			for _, c := range ran { // before the crash
				if err := dev.PushText(t.Context(), c.ID, "", "ran"); err != nil {
					t.Fatal(err)
				}
			}

			// Back two hours later, past every TTL.
			later := func() time.Time { return time.Now().Add(2 * time.Hour) }
			startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir, now: later})
			for _, c := range ran {
				if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
					t.Errorf("%s ended %s; want succeeded (the device ran it)", c.ID, r.State)
				}
				if n := dev.Executions(c.ID); n != 1 {
					t.Errorf("Executions(%s) = %d; want 1", c.ID, n)
				}
			}
		})
	}
}

// A command that never started before a bridge crash still expires when
// the bridge comes back after its TTL, behind one that may have run.
func TestNeverStartedExpiresAfterRestart(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	dir := t.TempDir()
	ran := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "ran"})
	never := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "never"})
	if err := agent.SpoolCommands(dir, []topics.Command{ran, never}); err != nil {
		t.Fatal(err)
	}
	if err := dev.PushText(t.Context(), ran.ID, "", "ran"); err != nil {
		t.Fatal(err)
	}

	later := func() time.Time { return time.Now().Add(2 * time.Hour) }
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir, now: later})
	if r := w.waitFinal("dev-1", ran.ID); r.State != companion.StateSucceeded {
		t.Errorf("the command that ran ended %s; want succeeded", r.State)
	}
	if r := w.waitFinal("dev-1", never.ID); r.State != companion.StateExpired {
		t.Errorf("the command that never started ended %s; want expired", r.State)
	}
	if n := dev.Executions(never.ID); n != 0 {
		t.Errorf("Executions(never) = %d; want 0", n)
	}
}

// Every command is on disk as possibly started before it reaches the
// device, also when the worker takes it while the final reply of the one
// before is still on its way to the file.
func TestCommandIsSpooledAsStartedBeforeItRuns(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dir := t.TempDir()
	var cmds []topics.Command
	for i := range 8 {
		cmds = append(cmds, command(t, "dev-1", topics.OpPushText, topics.PushText{Text: fmt.Sprint("text ", i)}))
	}
	if err := agent.SpoolCommands(dir, cmds); err != nil {
		t.Fatal(err)
	}
	dev := &spoolWatch{Device: newSim("dev-1"), ready: make(chan struct{}), states: map[string]string{}}
	dev.br = startBridge(t, b, nil, w, bridgeConfig{
		devices: []*sim.Device{dev.Device},
		dataDir: dir,
		wrap:    func(*sim.Device) agent.Device { return dev },
	})
	close(dev.ready)
	for i := range 4 { // and a few that arrive while it works
		c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: fmt.Sprint("late ", i)})
		cmds = append(cmds, c)
		w.send(c)
	}
	for _, c := range cmds {
		w.waitFinal("dev-1", c.ID)
		dev.mu.Lock()
		st := dev.states[c.ID]
		dev.mu.Unlock()
		if st != "running" {
			t.Errorf("%s reached the device %q in the spool; want running", c.ID, st)
		}
	}
}

// spoolWatch is a simulated device that notes, as each text reaches it,
// the state of its command in the bridge's spool.
type spoolWatch struct {
	*sim.Device
	ready chan struct{} // closed once br is set
	br    *bridge

	mu     sync.Mutex
	states map[string]string // command id → spool state as it reached the device
}

func (d *spoolWatch) PushText(ctx context.Context, cmdID, title, text string) error {
	select {
	case <-d.ready:
	case <-ctx.Done():
		return ctx.Err()
	}
	st, err := d.br.SpoolState(cmdID)
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.states[cmdID] = st
	d.mu.Unlock()
	return d.Device.PushText(ctx, cmdID, title, text)
}

func TestWillAndCleanClose(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}})

	// Keep the bridge out until the broker has noticed: a reconnect that
	// takes the session over first would (rightly) never fire the Will.
	b.hook.refuse.Store(true)
	b.dropClient(t, "companion-bridge-b1")
	w.waitBridgeState("b1", topics.BridgeOffline, 1)
	b.hook.refuse.Store(false)
	// It reconnects by itself and says so.
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 2)

	br.stop(t)
	w.waitBridgeState("b1", topics.BridgeOffline, 2)

	// The last word is retained for whoever subscribes next.
	late := newWatcher(t, b)
	topic, _ := tree.BridgeState("b1")
	m := late.waitFor("retained state", func(m message) bool { return m.topic == topic })
	if string(m.payload) != topics.BridgeOffline || !m.retained {
		t.Errorf("retained state %q (retained %v); want offline", m.payload, m.retained)
	}
}

func TestStatusSeqIncreases(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{newSim("dev-1")}, interval: 50 * time.Millisecond})

	topic, _ := tree.Status("dev-1")
	w.waitFor("four statuses", func(message) bool {
		return w.count(func(m message) bool { return m.topic == topic }) >= 4
	})
	var last uint64
	seen := map[string]bool{}
	w.mu.Lock()
	for _, m := range w.msgs {
		if m.topic != topic {
			continue
		}
		if seen[string(m.payload)] {
			// A QoS 1 repeat: paho sends a status published as it
			// connects a second time (see helpers_test.go,
			// publishCounter), which the server's seq check ignores.
			continue
		}
		seen[string(m.payload)] = true
		s, err := topics.ParseStatus(m.payload)
		if err != nil {
			t.Errorf("bad status %s: %v", m.payload, err)
			continue
		}
		if s.Seq <= last {
			t.Errorf("status seq %d after %d; want strictly increasing", s.Seq, last)
		}
		last = s.Seq
	}
	w.mu.Unlock()

	// Stopped first: mochi races a retained message being replaced against
	// a subscription reading it (mochi-mqtt/server#200).
	br.stop(t)
	late := newWatcher(t, b)
	m := late.waitFor("retained status", func(m message) bool { return m.topic == topic })
	if !m.retained {
		t.Errorf("status is not retained")
	}
}

// TestBrokerDown: spooled commands run while the broker is unreachable, and
// Run still returns promptly when canceled.
func TestBrokerDown(t *testing.T) {
	dir := t.TempDir()
	dev := newSim("dev-1")
	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "offline work"})
	if err := agent.SpoolCommands(dir, []topics.Command{c}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "tcp://" + l.Addr().String()
	l.Close() // nothing listens there any more
	a, err := agent.New(agent.Options{MQTTURL: url, BridgeID: "b1", DataDir: dir, Devices: []agent.Device{dev}, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()

	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(waitLong)
	for dev.Executions(c.ID) == 0 {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatal("the spooled command did not run while the broker was down")
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v", err)
		}
	case <-time.After(waitLong):
		t.Fatal("Run did not return after cancel")
	}
	if err := a.Close(); err != nil {
		t.Errorf("Close = %v", err)
	}
}

// A device the bridge cannot read after a restart is reported offline
// with what was last known of it, as within one run of the bridge. The
// server stores a status whole: a blank one put the device's firmware
// version, model, battery and apps out of its records until the device was
// back in reach (GET …/apps listed none, the OTA check offered every
// firmware as an update).
func TestOutOfReachAfterRestartKeepsWhatWasKnown(t *testing.T) {
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	if err := dev.InstallApp(t.Context(), "before-the-bridge", "weather", "1.2.0", []byte("pkg")); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	br := startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir})
	known := w.waitStatus("dev-1", "read from the device", func(s topics.Status) bool { return s.Online && len(s.Apps) == 1 })
	br.stop(t)

	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}, dataDir: dir,
		wrap: func(d *sim.Device) agent.Device { return outOfReach{d} }})
	st := w.waitStatus("dev-1", "offline", func(s topics.Status) bool { return !s.Online })
	if st.FirmwareVersion != known.FirmwareVersion || st.Model != known.Model || st.Battery == nil ||
		*st.Battery != *known.Battery || !slices.Equal(st.Apps, known.Apps) {
		t.Errorf("offline status %+v; want what was known: %+v", st, known)
	}
	if st.Seq <= known.Seq {
		t.Errorf("offline status seq %d; want above the known one's %d", st.Seq, known.Seq)
	}
}

// outOfReach is a device the bridge cannot reach: every read fails.
type outOfReach struct{ *sim.Device }

func (outOfReach) Info(context.Context) (companion.DeviceInfo, error) {
	return companion.DeviceInfo{}, errors.New("out of reach")
}

func (outOfReach) Settings(context.Context) (map[string]any, topics.Schema, error) {
	return nil, nil, errors.New("out of reach")
}

// An app installed, updated or removed on a device whose status read right
// after fails: the command succeeds, and its final reply carries the last
// known status with the change (the server stores it with the command's
// end, CONTRACT §8: GET …/apps lists the new state once the command is
// final), also for a device out of reach from then on. (The reply carried
// no status: the apps read stale until the device could be read again.)
func TestAppStatusReadAfterTheChangeFails(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	sd := newSim("dev-1")
	dev := &unreadableAfterApps{Device: sd}
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{sd}, interval: 200 * time.Millisecond, wrap: func(*sim.Device) agent.Device { return dev }})
	w.waitStatus("dev-1", "first", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "1.0.0" })

	apps := func(r topics.Reply) []companion.App {
		if r.Status == nil {
			return nil
		}
		return r.Status.Apps
	}
	pkg := bs.add([]byte("weather package"))
	for _, tc := range []struct {
		c    topics.Command
		want []companion.App
	}{
		{command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: pkg}),
			[]companion.App{{AppID: "weather", Version: "1.0.0"}}},
		{command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "clock", Version: "2.0.0", Blob: pkg}),
			[]companion.App{{AppID: "clock", Version: "2.0.0"}, {AppID: "weather", Version: "1.0.0"}}},
		{command(t, "dev-1", topics.OpAppUpdate, topics.AppInstall{AppID: "weather", Version: "1.1.0", Blob: pkg}),
			[]companion.App{{AppID: "clock", Version: "2.0.0"}, {AppID: "weather", Version: "1.1.0"}}},
		{command(t, "dev-1", topics.OpAppUninstall, topics.AppUninstall{AppID: "clock"}),
			[]companion.App{{AppID: "weather", Version: "1.1.0"}}},
	} {
		w.send(tc.c)
		r := w.waitFinal("dev-1", tc.c.ID)
		if r.State != companion.StateSucceeded {
			t.Fatalf("%s: final %s %+v; want succeeded", tc.c.Op, r.State, r.Error)
		}
		if !dev.unreadable() {
			t.Fatalf("%s: the device was not made unreadable", tc.c.Op)
		}
		if got := apps(r); !reflect.DeepEqual(got, tc.want) || !r.Status.Online {
			t.Errorf("%s: final reply's status %+v; want the last known one, online, with apps %v", tc.c.Op, r.Status, tc.want)
		}
	}
}

// unreadableAfterApps is a simulated device that answers no status read
// once an app has been installed on it.
type unreadableAfterApps struct {
	*sim.Device
	mu      sync.Mutex
	changed bool
}

func (d *unreadableAfterApps) InstallApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error {
	err := d.Device.InstallApp(ctx, cmdID, appID, version, pkg)
	d.mu.Lock()
	d.changed = d.changed || err == nil
	d.mu.Unlock()
	return err
}

func (d *unreadableAfterApps) unreadable() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.changed
}

func (d *unreadableAfterApps) Info(ctx context.Context) (companion.DeviceInfo, error) {
	if d.unreadable() {
		return companion.DeviceInfo{}, errors.New("out of reach after the change")
	}
	return d.Device.Info(ctx)
}

// TestSettingsReadAfterTheChangeFails: a settings change on a device that
// cannot be read right after is done, and its final reply carries the
// settings read before it with the change applied (CONTRACT §8; bug 226).
func TestSettingsReadAfterTheChangeFails(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	sd := newSim("dev-1")
	dev := &unreadableAfterSettings{Device: sd}
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{sd}, wrap: func(*sim.Device) agent.Device { return dev }})
	w.waitStatus("dev-1", "first", func(s topics.Status) bool { return s.Online })

	c := command(t, "dev-1", topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80, "language": "de"}})
	w.send(c)
	r := w.waitFinal("dev-1", c.ID)
	if r.State != companion.StateSucceeded {
		t.Fatalf("final %s %+v; want succeeded", r.State, r.Error)
	}
	if !dev.unreadable() {
		t.Fatal("the device was not made unreadable")
	}
	if r.Settings == nil {
		t.Fatal("final reply carries no settings; want the settings with the change")
	}
	got := r.Settings.Reported
	if got["brightness"] != float64(80) || got["language"] != "de" || got["volume"] != float64(50) || got["timezone"] != "UTC" {
		t.Errorf("final reply's settings %v; want brightness 80 and language de, the rest as before", got)
	}
	if r.Settings.Schema["brightness"].Type != topics.SettingInt {
		t.Errorf("final reply's schema %+v; want the device's", r.Settings.Schema)
	}
	var res struct {
		Reported map[string]any `json:"reported"`
	}
	if err := json.Unmarshal(r.Result, &res); err != nil || res.Reported["brightness"] != float64(80) {
		t.Errorf("result %s (%v); want the reported settings", r.Result, err)
	}
}

// unreadableAfterSettings is a simulated device that answers no settings
// read once its settings have been changed.
type unreadableAfterSettings struct {
	*sim.Device
	mu      sync.Mutex
	changed bool
}

func (d *unreadableAfterSettings) UpdateSettings(ctx context.Context, cmdID string, values map[string]any) error {
	err := d.Device.UpdateSettings(ctx, cmdID, values)
	d.mu.Lock()
	d.changed = d.changed || err == nil
	d.mu.Unlock()
	return err
}

func (d *unreadableAfterSettings) unreadable() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.changed
}

func (d *unreadableAfterSettings) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	if d.unreadable() {
		return nil, nil, errors.New("out of reach after the change")
	}
	return d.Device.Settings(ctx)
}

// TestAppStatusAfterAnotherChangeNotYetReported: two app installs on a
// device that cannot be read after them, the second run while the reporter
// has not yet taken the status the first one's reply carried (it is busy
// reading the device's settings): the second reply lists both apps, not
// the spool's status with the second one only (bug 229).
func TestAppStatusAfterAnotherChangeNotYetReported(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	sd := newSim("dev-1")
	dev := &settingsReadHeld{unreadableAfterApps: &unreadableAfterApps{Device: sd}, held: make(chan struct{}), release: make(chan struct{})}
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{sd}, interval: 50 * time.Millisecond, wrap: func(*sim.Device) agent.Device { return dev }})
	w.waitStatus("dev-1", "first", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "1.0.0" })

	dev.hold.Store(true)
	select {
	case <-dev.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the reporter read no settings within 10 s")
	}
	pkg := bs.add([]byte("weather package"))
	c1 := command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: pkg})
	c2 := command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "clock", Version: "2.0.0", Blob: pkg})
	w.send(c1)
	w.send(c2)
	w.waitFinal("dev-1", c1.ID)
	r := w.waitFinal("dev-1", c2.ID)
	close(dev.release)
	want := []companion.App{{AppID: "clock", Version: "2.0.0"}, {AppID: "weather", Version: "1.0.0"}}
	if r.State != companion.StateSucceeded || r.Status == nil || !reflect.DeepEqual(r.Status.Apps, want) {
		t.Errorf("second final reply %s with status %+v; want succeeded with apps %v", r.State, r.Status, want)
	}
}

// settingsReadHeld is unreadableAfterApps whose settings reads, once hold
// is set, wait until release is closed, after saying so on held.
type settingsReadHeld struct {
	*unreadableAfterApps
	hold    atomic.Bool
	held    chan struct{}
	release chan struct{}
	once    sync.Once
}

func (d *settingsReadHeld) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	if d.hold.Load() {
		d.once.Do(func() { close(d.held) })
		select {
		case <-d.release:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
	return d.unreadableAfterApps.Settings(ctx)
}

// TestOfflineStatusAfterAChangeNotYetReported: an app installed on a
// device that cannot be read after it, while the reporter is busy; the
// bridge reconnects, which asks the reporter for a status read before it
// has taken the one the install's reply carried. The read fails, and the
// offline status it reports, newer than the reply's, lists the app (bug
// 229).
func TestOfflineStatusAfterAChangeNotYetReported(t *testing.T) {
	b := startBroker(t)
	bs := startBlobServer(t)
	w := newWatcher(t, b)
	sd := newSim("dev-1")
	dev := &settingsReadHeld{unreadableAfterApps: &unreadableAfterApps{Device: sd}, held: make(chan struct{}), release: make(chan struct{})}
	dev.hold.Store(true) // the reporter's first settings read
	startBridge(t, b, bs, w, bridgeConfig{devices: []*sim.Device{sd}, interval: time.Hour, wrap: func(*sim.Device) agent.Device { return dev }})
	w.waitStatus("dev-1", "first", func(s topics.Status) bool { return s.Online && s.FirmwareVersion == "1.0.0" })
	select {
	case <-dev.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the reporter read no settings within 10 s")
	}
	c := command(t, "dev-1", topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: bs.add([]byte("weather package"))})
	w.send(c)
	w.waitFinal("dev-1", c.ID)
	stateTopic, _ := tree.BridgeState("b1")
	online := b.pubs.count(stateTopic, topics.BridgeOnline)
	b.dropClient(t, "companion-bridge-b1")
	b.waitBridgeState(t, "b1", topics.BridgeOnline, online+1)
	close(dev.release)
	st := w.waitStatus("dev-1", "offline", func(s topics.Status) bool { return !s.Online })
	if want := []companion.App{{AppID: "weather", Version: "1.0.0"}}; !reflect.DeepEqual(st.Apps, want) {
		t.Errorf("offline status lists apps %v; want %v", st.Apps, want)
	}
}
