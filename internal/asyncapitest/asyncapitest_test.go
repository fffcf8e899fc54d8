package asyncapitest

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"go.yaml.in/yaml/v3"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/topics"
)

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func command(t *testing.T, op string, payload any) []byte {
	t.Helper()
	now := time.Date(2026, 1, 2, 3, 4, 5, 600, time.UTC)
	return mustJSON(t, topics.Command{
		ID: "0b5e6f5c-8d3a-4a53-9a61-3c9f1f0d2e11", Op: op, DeviceID: "dev-1",
		CreatedAt: now, ExpiresAt: now.Add(time.Hour), Payload: mustJSON(t, payload),
	})
}

// The document accepts the messages package topics writes, on the topics
// its Tree builds, and refuses what the contract does not allow.
func TestValidate(t *testing.T) {
	d := Load(t)
	tree := topics.MustNew(topics.DefaultPrefix)
	must := func(s string, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	blob := topics.Blob{SHA256: strings.Repeat("ab", 32), Size: 10, URL: "/api/v1/blobs/" + strings.Repeat("ab", 32)}
	battery, progress := 80, 40
	at := time.Now().UTC()
	status := topics.Status{Online: true, Battery: &battery, FirmwareVersion: "1.0.0", Model: "sim-1",
		Apps: []companion.App{{AppID: "weather", Version: "1.0.0"}}, BridgeID: "bridge-1", At: at, Seq: 7}
	max := 100
	settings := topics.Settings{
		Reported: map[string]any{"brightness": 50, "language": "en"},
		Schema: topics.Schema{
			"brightness": {Type: topics.SettingInt, Min: new(int), Max: &max, Default: 50},
			"language":   {Type: topics.SettingEnum, Values: []string{"en", "de"}, Default: "en"},
		},
		At: at, Seq: 8,
	}
	cmdID := "0b5e6f5c-8d3a-4a53-9a61-3c9f1f0d2e11"
	for _, tc := range []struct {
		name, topic string
		payload     []byte
		retained    bool
		channel     string // "" when it must fail
	}{
		{"push.text", must(tree.Command("dev-1", topics.OpPushText)), command(t, topics.OpPushText, topics.PushText{Text: "hi", Title: "t"}), false, "pushText"},
		{"push.text without title", must(tree.Command("dev-1", topics.OpPushText)), command(t, topics.OpPushText, topics.PushText{Text: "hi"}), false, "pushText"},
		{"push.image", must(tree.Command("dev-1", topics.OpPushImage)), command(t, topics.OpPushImage, topics.PushImage{ContentType: "image/png", Width: 2, Height: 2, Blob: blob}), false, "pushImage"},
		{"app.install", must(tree.Command("dev-1", topics.OpAppInstall)), command(t, topics.OpAppInstall, topics.AppInstall{AppID: "weather", Version: "1.0.0", Blob: blob}), false, "appInstall"},
		{"app.update", must(tree.Command("dev-1", topics.OpAppUpdate)), command(t, topics.OpAppUpdate, topics.AppInstall{AppID: "weather", Version: "1.2.0", Blob: blob}), false, "appUpdate"},
		{"app.uninstall", must(tree.Command("dev-1", topics.OpAppUninstall)), command(t, topics.OpAppUninstall, topics.AppUninstall{AppID: "weather"}), false, "appUninstall"},
		{"settings.update", must(tree.Command("dev-1", topics.OpSettingsUpdate)), command(t, topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: map[string]any{"brightness": 80}}), false, "settingsUpdate"},
		{"ota.update", must(tree.Command("dev-1", topics.OpOTAUpdate)), command(t, topics.OpOTAUpdate, topics.OTAUpdate{Version: "1.1.0", Blob: blob}), false, "otaUpdate"},
		{"command.cancel", must(tree.Command("dev-1", topics.OpCancel)), command(t, topics.OpCancel, topics.Cancel{CommandID: cmdID}), false, "commandCancel"},
		{"reply delivered", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateDelivered, At: at}), false, "replies"},
		{"reply progress", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateInProgress, Progress: &progress, At: at}), false, "replies"},
		{"reply failed", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateFailed, Error: &topics.Error{Code: "device_error", Message: "no"}, At: at}), false, "replies"},
		{"reply with state", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateSucceeded, Result: json.RawMessage(`{"firmware_version":"1.1.0"}`), Status: &status, Settings: &settings, At: at}), false, "replies"},
		{"status", must(tree.Status("dev-1")), mustJSON(t, status), true, "status"},
		{"settings", must(tree.Settings("dev-1")), mustJSON(t, settings), true, "settings"},
		{"settings cleared", must(tree.Settings("dev-1")), []byte{}, true, "settings"},
		{"status cleared", must(tree.Status("dev-1")), []byte{}, true, "status"},
		{"bridge online", must(tree.BridgeState("bridge-1")), []byte("online"), true, "bridgeState"},
		{"bridge offline", must(tree.BridgeState("bridge-1")), []byte("offline"), false, "bridgeState"},

		{"unknown topic", "companion/v1/devices/dev-1/secrets", []byte(`{}`), false, ""},
		{"unknown op", "companion/v1/devices/dev-1/commands/reboot", command(t, "reboot", map[string]any{}), false, ""},
		{"op of another topic", must(tree.Command("dev-1", topics.OpPushText)), command(t, topics.OpPushImage, topics.PushText{Text: "hi"}), false, ""},
		{"retained command", must(tree.Command("dev-1", topics.OpPushText)), command(t, topics.OpPushText, topics.PushText{Text: "hi"}), true, ""},
		{"undeclared field", must(tree.Command("dev-1", topics.OpPushText)), command(t, topics.OpPushText, map[string]any{"text": "hi", "font": "big"}), false, ""},
		{"missing field", must(tree.Command("dev-1", topics.OpAppUninstall)), command(t, topics.OpAppUninstall, map[string]any{}), false, ""},
		{"reply sent", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateSent, At: at}), false, ""},
		{"reply bad time", must(tree.Replies("dev-1")), []byte(`{"command_id":"` + cmdID + `","state":"delivered","at":"yesterday"}`), false, ""},
		{"status without seq", must(tree.Status("dev-1")), []byte(`{"online":true,"battery":1,"firmware_version":"1","apps":[],"bridge_id":"b","at":"2026-01-02T03:04:05Z"}`), false, ""},
		{"bridge state JSON", must(tree.BridgeState("bridge-1")), []byte(`"online"`), false, ""},
		{"not JSON", must(tree.Status("dev-1")), []byte("online"), false, ""},
		{"status as a string", must(tree.Status("dev-1")), []byte(`""`), false, ""},
		{"replies cleared", must(tree.Replies("dev-1")), []byte{}, false, "replies"},
		{"reply retained", must(tree.Replies("dev-1")), mustJSON(t, topics.Reply{CommandID: cmdID, State: companion.StateSucceeded, At: at}), true, ""},
		{"empty command", must(tree.Command("dev-1", topics.OpPushText)), []byte{}, false, ""},
	} {
		got, err := d.Validate(tc.topic, tc.payload, tc.retained)
		switch {
		case tc.channel == "" && err == nil:
			t.Errorf("%s: Validate(%q, %s) = %q, nil; want an error", tc.name, tc.topic, tc.payload, got)
		case tc.channel != "" && err != nil:
			t.Errorf("%s: Validate(%q, %s): %v", tc.name, tc.topic, tc.payload, err)
		case tc.channel != "" && got != tc.channel:
			t.Errorf("%s: Validate(%q) = %q; want %q", tc.name, tc.topic, got, tc.channel)
		}
	}
	if _, err := d.Validate("companion/v1/devices/dev-1/nothing", nil, false); !errors.Is(err, ErrNoChannel) {
		t.Errorf("Validate(unknown topic) = %v; want ErrNoChannel", err)
	}
}

// Every op of the contract, and the cancel, has a channel.
func TestEveryOpHasAChannel(t *testing.T) {
	d := Load(t)
	tree := topics.MustNew(topics.DefaultPrefix)
	for _, op := range append(append([]string{}, topics.Ops...), topics.OpCancel) {
		topic, err := tree.Command("dev-1", op)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Validate(topic, []byte(`{}`), false); errors.Is(err, ErrNoChannel) {
			t.Errorf("op %s: %v", op, err)
		}
	}
}

// A broken document is refused, not taken as one that accepts anything.
func TestParseRefusesBrokenDocuments(t *testing.T) {
	for _, tc := range []struct{ name, doc string }{
		{"not 3", "asyncapi: 2.6.0\nchannels: {}\n"},
		{"no payload", "asyncapi: 3.0.0\nchannels:\n  a:\n    address: x/y\n    messages:\n      m:\n        name: m\n"},
		{"dangling ref", "asyncapi: 3.0.0\nchannels:\n  a:\n    address: x/y\n    messages:\n      m:\n        $ref: '#/components/messages/nope'\n"},
		{"bad schema", "asyncapi: 3.0.0\ndefaultContentType: application/json\nchannels:\n  a:\n    address: x/y\n    messages:\n      m:\n        payload:\n          type: 12\n"},
		{"no binding", "asyncapi: 3.0.0\ndefaultContentType: application/json\nchannels:\n  a:\n    address: x/y\n    messages:\n      m:\n        payload: {type: object}\noperations:\n  o:\n    action: send\n    channel: {$ref: '#/channels/a'}\n"},
	} {
		if _, err := Parse([]byte(tc.doc)); err == nil {
			t.Errorf("%s: Parse succeeded", tc.name)
		}
	}
}

// docs/asyncapi.yaml is a valid AsyncAPI 3.0.0 document, by the JSON
// Schema the AsyncAPI project publishes for it (testdata/README.md).
func TestDocumentIsAsyncAPI3(t *testing.T) {
	docYAML := testenv.ReadRepoFile(t, Path)
	var raw any
	if err := yaml.Unmarshal(docYAML, &raw); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(raw)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(js))
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join("testdata", "asyncapi-3.0.0.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	spec, err := jsonschema.UnmarshalJSON(f)
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("urn:asyncapi:3.0.0", spec); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("urn:asyncapi:3.0.0")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(doc); err != nil {
		t.Errorf("%s is not a valid AsyncAPI 3.0.0 document: %#v", Path, err)
	}
}
