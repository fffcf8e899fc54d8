// Package topics is the MQTT contract between the companion server and its
// bridges: every topic name, the parser that reads them back, the identifier
// rules that keep hostile ids out of topic names, and the message types that
// travel on them (CONTRACT §3).
//
// It is the wire format only: the command states and the domain types it
// carries come from package companion (the module's root). It does no I/O.
package topics

import (
	"errors"
	"fmt"
	"strings"

	"github.com/devicecompanion/companion"
)

// DefaultPrefix is the topic prefix used unless one is configured.
const DefaultPrefix = "companion/v1"

// Operations a command can carry. The op is also the last level of the
// command topic.
const (
	OpPushText       = "push.text"
	OpPushImage      = "push.image"
	OpAppInstall     = "app.install"
	OpAppUninstall   = "app.uninstall"
	OpAppUpdate      = "app.update"
	OpSettingsUpdate = companion.OpSettingsUpdate // the stores read its payload (Command.SettingsAsked)
	OpOTAUpdate      = "ota.update"

	// OpCancel asks a bridge to drop a command it has not started yet. It is
	// not a command of its own: it is never stored and never answered.
	OpCancel = "command.cancel"
)

// Ops lists the operations of CONTRACT §3 in a stable order.
var Ops = []string{OpPushText, OpPushImage, OpAppInstall, OpAppUninstall, OpAppUpdate, OpSettingsUpdate, OpOTAUpdate}

// ValidOp reports whether op is one of Ops or OpCancel.
func ValidOp(op string) bool {
	if op == OpCancel {
		return true
	}
	for _, o := range Ops {
		if o == op {
			return true
		}
	}
	return false
}

// Limits on identifiers (CONTRACT §2).
const (
	MaxDeviceIDLen = 64
	MaxAppIDLen    = 128
	MaxBridgeIDLen = 64
)

// ValidDeviceID reports whether s is 1–64 characters of A–Z a–z 0–9 . _ : -.
// Such an id can never contain a topic separator or wildcard.
func ValidDeviceID(s string) bool {
	return validID(s, MaxDeviceIDLen, true, true)
}

// ValidBridgeID applies the device id rules to bridge ids.
func ValidBridgeID(s string) bool {
	return validID(s, MaxBridgeIDLen, true, true)
}

// ValidAppID reports whether s is 1–128 characters of a–z 0–9 . _ -.
func ValidAppID(s string) bool {
	return validID(s, MaxAppIDLen, false, false)
}

func validID(s string, max int, upper, colon bool) bool {
	if len(s) == 0 || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		case upper && c >= 'A' && c <= 'Z':
		case colon && c == ':':
		default:
			return false
		}
	}
	return true
}

// Errors returned by the builders and the parser.
var (
	ErrBadPrefix = errors.New("topics: invalid prefix")
	ErrBadID     = errors.New("topics: invalid identifier")
	ErrBadOp     = errors.New("topics: unknown op")
	ErrNotOurs   = errors.New("topics: not a companion topic")
)

// Kind says which of the contract's topics a parsed topic is.
type Kind int

// The kinds of topic.
const (
	KindCommand Kind = iota + 1
	KindReplies
	KindStatus
	KindSettings
	KindBridgeState
)

func (k Kind) String() string {
	switch k {
	case KindCommand:
		return "command"
	case KindReplies:
		return "replies"
	case KindStatus:
		return "status"
	case KindSettings:
		return "settings"
	case KindBridgeState:
		return "bridge-state"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Topic is a parsed topic name.
type Topic struct {
	Kind     Kind
	DeviceID string // set for every kind but KindBridgeState
	BridgeID string // set for KindBridgeState
	Op       string // set for KindCommand
}

// Tree builds and parses the topics under one prefix. The zero value is not
// usable; call New.
type Tree struct {
	prefix string
}

// New returns the tree under prefix ("" means DefaultPrefix). A prefix is one
// or more non-empty levels without wildcards, leading or trailing slashes,
// and must not start with '$' (those topics belong to the broker).
func New(prefix string) (Tree, error) {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if len(prefix) > 512 || strings.HasPrefix(prefix, "$") || strings.ContainsAny(prefix, "+#\x00") {
		return Tree{}, fmt.Errorf("%w: %q", ErrBadPrefix, prefix)
	}
	for _, level := range strings.Split(prefix, "/") {
		if level == "" {
			return Tree{}, fmt.Errorf("%w: %q has an empty level", ErrBadPrefix, prefix)
		}
	}
	return Tree{prefix: prefix}, nil
}

// MustNew is New for prefixes known to be good, such as DefaultPrefix.
func MustNew(prefix string) Tree {
	t, err := New(prefix)
	if err != nil {
		panic(err)
	}
	return t
}

// Prefix returns the tree's prefix.
func (t Tree) Prefix() string { return t.prefix }

func (t Tree) device(deviceID, leaf string) (string, error) {
	if !ValidDeviceID(deviceID) {
		return "", fmt.Errorf("%w: device %q", ErrBadID, deviceID)
	}
	return t.prefix + "/devices/" + deviceID + "/" + leaf, nil
}

// Command is the topic on which the server sends op to a device's bridge.
func (t Tree) Command(deviceID, op string) (string, error) {
	if !ValidOp(op) {
		return "", fmt.Errorf("%w: %q", ErrBadOp, op)
	}
	return t.device(deviceID, "commands/"+op)
}

// Replies is the topic on which a bridge reports a device's command progress.
func (t Tree) Replies(deviceID string) (string, error) { return t.device(deviceID, "replies") }

// Status is the retained topic of a device's status.
func (t Tree) Status(deviceID string) (string, error) { return t.device(deviceID, "status") }

// Settings is the retained topic of a device's reported settings.
func (t Tree) Settings(deviceID string) (string, error) { return t.device(deviceID, "settings") }

// BridgeState is the retained topic holding "online" or "offline" for a
// bridge; "offline" is the bridge's Will.
func (t Tree) BridgeState(bridgeID string) (string, error) {
	if !ValidBridgeID(bridgeID) {
		return "", fmt.Errorf("%w: bridge %q", ErrBadID, bridgeID)
	}
	return t.prefix + "/bridges/" + bridgeID + "/state", nil
}

// DeviceFilter matches every topic of one device.
func (t Tree) DeviceFilter(deviceID string) (string, error) { return t.device(deviceID, "#") }

// CommandsFilter matches every command topic of one device.
func (t Tree) CommandsFilter(deviceID string) (string, error) {
	return t.device(deviceID, "commands/+")
}

// CommandsGrant is what the bridge serving a device may subscribe to
// (CONTRACT §3: its commands/#): every command topic of the device, and
// every filter within them (commands/+, commands/#, one op's).
func (t Tree) CommandsGrant(deviceID string) (string, error) {
	return t.device(deviceID, "commands/#")
}

// AllReplies matches the replies topics of every device.
func (t Tree) AllReplies() string { return t.prefix + "/devices/+/replies" }

// AllStatus matches the status topics of every device.
func (t Tree) AllStatus() string { return t.prefix + "/devices/+/status" }

// AllSettings matches the settings topics of every device.
func (t Tree) AllSettings() string { return t.prefix + "/devices/+/settings" }

// AllBridgeStates matches the state topics of every bridge.
func (t Tree) AllBridgeStates() string { return t.prefix + "/bridges/+/state" }

// DevicesMoved is where server replicas sharing a store tell the one that
// dispatches of a device moved to another bridge through them (its
// payload: the device's id, plain text). Only servers read or write it:
// outside the devices' and bridges' topics, under the prefix.
func (t Tree) DevicesMoved() string { return t.prefix + "/servers/moved" }

// BridgesKicked is where server replicas sharing a store tell each other
// of a bridge about to be disconnected for a change of its rights (its
// payload: the bridge's id, plain text), so that each holds the Will the
// broker may publish for it (broker.Broker.BridgesDisconnecting). Only
// servers read or write it.
func (t Tree) BridgesKicked() string { return t.prefix + "/servers/kicked" }

// ServerProbe is the topic of a server's self-check: the server
// publishes there and checks that it receives what it published, which
// it does only if the MQTT broker lets it publish and read under the
// prefix (an ACL refusal of a QoS 1 publish is silent in MQTT 3.1.1).
// id (the server's client id, as one topic level) tells the servers
// sharing a broker apart. Only servers read or write it.
func (t Tree) ServerProbe(id string) string { return t.prefix + "/servers/probe/" + id }

// Parse reads a topic name back. It accepts only the exact shapes the
// builders produce, with valid ids and ops; anything else is ErrNotOurs.
func (t Tree) Parse(topic string) (Topic, error) {
	rest, ok := strings.CutPrefix(topic, t.prefix+"/")
	if !ok {
		return Topic{}, fmt.Errorf("%w: %q", ErrNotOurs, topic)
	}
	parts := strings.Split(rest, "/")
	bad := func() (Topic, error) { return Topic{}, fmt.Errorf("%w: %q", ErrNotOurs, topic) }
	switch {
	case len(parts) == 3 && parts[0] == "bridges" && parts[2] == "state":
		if !ValidBridgeID(parts[1]) {
			return bad()
		}
		return Topic{Kind: KindBridgeState, BridgeID: parts[1]}, nil
	case len(parts) >= 3 && parts[0] == "devices":
		id := parts[1]
		if !ValidDeviceID(id) {
			return bad()
		}
		switch {
		case len(parts) == 3 && parts[2] == "replies":
			return Topic{Kind: KindReplies, DeviceID: id}, nil
		case len(parts) == 3 && parts[2] == "status":
			return Topic{Kind: KindStatus, DeviceID: id}, nil
		case len(parts) == 3 && parts[2] == "settings":
			return Topic{Kind: KindSettings, DeviceID: id}, nil
		case len(parts) == 4 && parts[2] == "commands" && ValidOp(parts[3]):
			return Topic{Kind: KindCommand, DeviceID: id, Op: parts[3]}, nil
		}
	}
	return bad()
}
