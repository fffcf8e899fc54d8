package topics

import (
	"errors"
	"strings"
	"testing"
)

func TestValidIDs(t *testing.T) {
	tests := []struct {
		fn   func(string) bool
		name string
		in   string
		want bool
	}{
		{ValidDeviceID, "device", "sim-001", true},
		{ValidDeviceID, "device", "A.b_c:d-9", true},
		{ValidDeviceID, "device", strings.Repeat("a", 64), true},
		{ValidDeviceID, "device", strings.Repeat("a", 65), false},
		{ValidDeviceID, "device", "", false},
		{ValidDeviceID, "device", "a/b", false},
		{ValidDeviceID, "device", "+", false},
		{ValidDeviceID, "device", "#", false},
		{ValidDeviceID, "device", "a b", false},
		{ValidDeviceID, "device", "é", false},
		{ValidDeviceID, "device", "a\x00", false},
		{ValidAppID, "app", "weather", true},
		{ValidAppID, "app", "com.example.app_1-2", true},
		{ValidAppID, "app", strings.Repeat("a", 128), true},
		{ValidAppID, "app", strings.Repeat("a", 129), false},
		{ValidAppID, "app", "Weather", false},
		{ValidAppID, "app", "a:b", false},
		{ValidAppID, "app", "", false},
		{ValidBridgeID, "bridge", "bridge-1", true},
		{ValidBridgeID, "bridge", "b/1", false},
	}
	for _, tt := range tests {
		if got := tt.fn(tt.in); got != tt.want {
			t.Errorf("Valid%sID(%q) = %v; want %v", tt.name, tt.in, got, tt.want)
		}
	}
}

func TestNewPrefix(t *testing.T) {
	for _, p := range []string{"companion/v1", "a", "x/y/z"} {
		if _, err := New(p); err != nil {
			t.Errorf("New(%q) = %v; want nil", p, err)
		}
	}
	for _, p := range []string{"/a", "a/", "a//b", "a/+/b", "a/#", "$SYS/x", "a\x00"} {
		if _, err := New(p); !errors.Is(err, ErrBadPrefix) {
			t.Errorf("New(%q) = %v; want ErrBadPrefix", p, err)
		}
	}
	tr, err := New("")
	if err != nil || tr.Prefix() != DefaultPrefix {
		t.Errorf("New(\"\") = %q, %v; want the default prefix", tr.Prefix(), err)
	}
}

func TestBuildAndParse(t *testing.T) {
	tr := MustNew("acme/v1")
	must := func(s string, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	tests := []struct {
		topic string
		want  Topic
	}{
		{must(tr.Command("dev-1", OpPushText)), Topic{Kind: KindCommand, DeviceID: "dev-1", Op: OpPushText}},
		{must(tr.Command("dev-1", OpCancel)), Topic{Kind: KindCommand, DeviceID: "dev-1", Op: OpCancel}},
		{must(tr.Replies("dev-1")), Topic{Kind: KindReplies, DeviceID: "dev-1"}},
		{must(tr.Status("d:2")), Topic{Kind: KindStatus, DeviceID: "d:2"}},
		{must(tr.Settings("d.3")), Topic{Kind: KindSettings, DeviceID: "d.3"}},
		{must(tr.BridgeState("b1")), Topic{Kind: KindBridgeState, BridgeID: "b1"}},
	}
	for _, tt := range tests {
		got, err := tr.Parse(tt.topic)
		if err != nil || got != tt.want {
			t.Errorf("Parse(%q) = %+v, %v; want %+v", tt.topic, got, err, tt.want)
		}
	}
	if got := must(tr.Command("dev-1", OpOTAUpdate)); got != "acme/v1/devices/dev-1/commands/ota.update" {
		t.Errorf("Command = %q", got)
	}
	if got := must(tr.DeviceFilter("dev-1")); got != "acme/v1/devices/dev-1/#" {
		t.Errorf("DeviceFilter = %q", got)
	}
	if got := tr.AllReplies(); got != "acme/v1/devices/+/replies" {
		t.Errorf("AllReplies = %q", got)
	}
}

func TestBuildersRefuseBadIDs(t *testing.T) {
	tr := MustNew(DefaultPrefix)
	for _, id := range []string{"", "+", "#", "a/b", strings.Repeat("x", 65)} {
		if _, err := tr.Status(id); !errors.Is(err, ErrBadID) {
			t.Errorf("Status(%q) error = %v; want ErrBadID", id, err)
		}
		if _, err := tr.Command(id, OpPushText); !errors.Is(err, ErrBadID) {
			t.Errorf("Command(%q) error = %v; want ErrBadID", id, err)
		}
		if _, err := tr.BridgeState(id); !errors.Is(err, ErrBadID) {
			t.Errorf("BridgeState(%q) error = %v; want ErrBadID", id, err)
		}
	}
	if _, err := tr.Command("dev", "rm.rf"); !errors.Is(err, ErrBadOp) {
		t.Errorf("Command with unknown op error = %v; want ErrBadOp", err)
	}
}

func TestParseRejects(t *testing.T) {
	tr := MustNew(DefaultPrefix)
	for _, topic := range []string{
		"",
		"companion/v1",
		"companion/v2/devices/d/status",
		"other/companion/v1/devices/d/status",
		"companion/v1/devices/d",
		"companion/v1/devices//status",
		"companion/v1/devices/+/status",
		"companion/v1/devices/d/status/extra",
		"companion/v1/devices/d/commands",
		"companion/v1/devices/d/commands/unknown.op",
		"companion/v1/devices/d/commands/push.text/x",
		"companion/v1/bridges/b/state/x",
		"companion/v1/bridges/+/state",
		"companion/v1/devices/d/whatever",
	} {
		if got, err := tr.Parse(topic); !errors.Is(err, ErrNotOurs) {
			t.Errorf("Parse(%q) = %+v, %v; want ErrNotOurs", topic, got, err)
		}
	}
}

func FuzzParse(f *testing.F) {
	tr := MustNew(DefaultPrefix)
	f.Add("companion/v1/devices/d/status")
	f.Add("companion/v1/devices/d/commands/push.text")
	f.Add("companion/v1/bridges/b/state")
	f.Fuzz(func(t *testing.T, topic string) {
		got, err := tr.Parse(topic)
		if err != nil {
			return
		}
		// Whatever parses must rebuild to the same topic.
		var again string
		switch got.Kind {
		case KindCommand:
			again, err = tr.Command(got.DeviceID, got.Op)
		case KindReplies:
			again, err = tr.Replies(got.DeviceID)
		case KindStatus:
			again, err = tr.Status(got.DeviceID)
		case KindSettings:
			again, err = tr.Settings(got.DeviceID)
		case KindBridgeState:
			again, err = tr.BridgeState(got.BridgeID)
		}
		if err != nil || again != topic {
			t.Fatalf("Parse(%q) = %+v, rebuilt %q, %v", topic, got, again, err)
		}
	})
}
