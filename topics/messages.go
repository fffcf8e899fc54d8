package topics

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
)

// Bridge states, the payload of a bridge's state topic.
const (
	BridgeOnline  = "online"
	BridgeOffline = "offline"
)

// MaxPayload is the largest message either side accepts on any topic.
// Binary content never travels over MQTT: it is referenced by a Blob.
const MaxPayload = 256 << 10

// Command is what the server publishes on a device's command topic.
type Command struct {
	ID        string          `json:"id"`
	Op        string          `json:"op"`
	DeviceID  string          `json:"device_id"`
	CreatedAt time.Time       `json:"created_at"`
	ExpiresAt time.Time       `json:"expires_at"`
	Payload   json.RawMessage `json:"payload,omitempty"`
	// After is the id of the device's command published before this one
	// and not known to have ended when this one went out, if any. A bridge
	// that has never heard of it waits for it (up to a bound) before it
	// runs this one: a broker may deliver a command late, after the ones
	// behind it (a NATS node's redelivery after its ack wait), and the
	// device must still run them in the order they were accepted
	// (CONTRACT §2).
	After string `json:"after,omitempty"`
}

// Error is a command's failure, as a bridge reports it.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// BadCode is the code as the bridge wrote it when it was not of the
	// contract's form (ValidErrorCode; Code is then empty), cut to
	// MaxErrorCode bytes, for the server to quote and log (bug 569).
	BadCode string `json:"-"`
}

// MaxErrorCode is the longest error code, in bytes.
const MaxErrorCode = 64

// MaxErrorMessage is the most of a bridge's error message that is kept,
// in bytes; the rest is cut, on a character's boundary, with an ellipsis
// (docs/reliability.md, bug 572). An error of another JSON type than the
// contract's is kept as text of at most as much.
const MaxErrorMessage = 1024

// UnmarshalJSON decodes an error as a bridge wrote it. One of another
// form than {"code": string, "message": string} is taken as far as it
// says something, rather than failing the reply it is in: that reply, a
// command's end, was dropped as malformed, and the command never ended
// (docs/reliability.md, bug 571). A code that is not a string is set aside
// as one not of the contract's form (BadCode, its JSON text); a message
// that is not a string is its JSON text; an error that is a string is its
// message, and one of another type its JSON text.
func (e *Error) UnmarshalJSON(b []byte) error {
	var w struct {
		Code    json.RawMessage `json:"code"`
		Message json.RawMessage `json:"message"`
	}
	if err := json.Unmarshal(b, &w); err != nil {
		*e = Error{Message: errorText(b)}
		return nil
	}
	*e = Error{Message: errorText(w.Message)}
	if err := json.Unmarshal(w.Code, &e.Code); err != nil {
		e.BadCode = clip(string(w.Code), MaxErrorCode)
	}
	return nil
}

// errorText is raw, a member of a bridge's error, as text: the string it
// is, or its JSON text, cut; "" for none or null.
func errorText(raw json.RawMessage) string {
	var s string
	if len(raw) == 0 || json.Unmarshal(raw, &s) == nil {
		return s
	}
	return clip(string(raw), MaxErrorMessage)
}

// ValidErrorCode reports whether s is an error code of the contract's
// form (docs/asyncapi.yaml): 1 to MaxErrorCode bytes of a–z 0–9 _, a
// word a client tells a failure by, such as device_unreachable.
func ValidErrorCode(s string) bool {
	if len(s) == 0 || len(s) > MaxErrorCode {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// Reply is what a bridge publishes on a device's replies topic as a command
// moves through its states.
type Reply struct {
	CommandID string          `json:"command_id"`
	State     string          `json:"state"`
	Progress  *int            `json:"progress,omitempty"`
	Error     *Error          `json:"error,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	At        time.Time       `json:"at"`
	// BadAt is the `at` as the bridge wrote it when it was no time the
	// server reads (At is then zero), for the server to log (bug 425).
	BadAt string `json:"-"`

	// The device's state after the command, in a final reply of a command
	// that changed it (CONTRACT §8): the status after an app or OTA
	// command, the settings after a settings command. They are the
	// messages of the status and settings topics, with their seq: the
	// server stores them with the command's final state, in one
	// transaction, and a newer report still wins.
	Status   *Status   `json:"status,omitempty"`
	Settings *Settings `json:"settings,omitempty"`
}

// Status is the retained status a bridge publishes for a device.
type Status struct {
	Online          bool            `json:"online"`
	Battery         *int            `json:"battery"`
	FirmwareVersion string          `json:"firmware_version"`
	Model           string          `json:"model,omitempty"`
	Apps            []companion.App `json:"apps"`
	BridgeID        string          `json:"bridge_id"`
	At              time.Time       `json:"at"`
	Seq             uint64          `json:"seq"`
	BadAt           string          `json:"-"` // as Reply's
}

// Setting types of a settings schema.
const (
	SettingInt      = "int"
	SettingBool     = "bool"
	SettingString   = "string"
	SettingEnum     = "enum"
	SettingTimezone = "timezone" // an IANA time zone name
)

// SettingSpec describes one setting of a device's schema.
type SettingSpec struct {
	Type    string   `json:"type"`
	Min     *int     `json:"min,omitempty"`
	Max     *int     `json:"max,omitempty"`
	Values  []string `json:"values,omitempty"`  // for SettingEnum
	MaxLen  int      `json:"max_len,omitempty"` // for SettingString
	Default any      `json:"default"`
}

// Schema maps each setting's name to its description.
type Schema map[string]SettingSpec

// Settings is the retained settings message a bridge publishes for a device.
type Settings struct {
	Reported map[string]any `json:"reported"`
	Schema   Schema         `json:"schema"`
	At       time.Time      `json:"at"`
	Seq      uint64         `json:"seq"`
	BadAt    string         `json:"-"` // as Reply's
	// Flaws are what ParseSettings and ParseReply left out of the
	// report, or found in it, against the rules of a setting, for the
	// reader to log (docs/reliability.md, bug 567).
	Flaws SettingsFlaws `json:"-"`
}

// Blob references binary content the bridge fetches over HTTP, by SHA-256.
type Blob struct {
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
	URL    string `json:"url"`
}

// Payloads of each op.
type (
	// PushText is the payload of OpPushText.
	PushText struct {
		Text  string `json:"text"`
		Title string `json:"title,omitempty"`
	}
	// PushImage is the payload of OpPushImage.
	PushImage struct {
		ContentType string `json:"content_type"`
		Width       int    `json:"width"`
		Height      int    `json:"height"`
		Blob        Blob   `json:"blob"`
	}
	// AppInstall is the payload of OpAppInstall and OpAppUpdate.
	AppInstall struct {
		AppID   string `json:"app_id"`
		Version string `json:"version"`
		Blob    Blob   `json:"blob"`
	}
	// AppUninstall is the payload of OpAppUninstall.
	AppUninstall struct {
		AppID string `json:"app_id"`
	}
	// SettingsUpdate is the payload of OpSettingsUpdate.
	SettingsUpdate struct {
		Settings map[string]any `json:"settings"`
	}
	// OTAUpdate is the payload of OpOTAUpdate.
	OTAUpdate struct {
		Version string `json:"version"`
		Blob    Blob   `json:"blob"`
	}
	// Cancel is the payload of OpCancel.
	Cancel struct {
		CommandID string `json:"command_id"`
	}
)

// ErrBadMessage wraps every decoding failure of the Parse functions.
var ErrBadMessage = errors.New("topics: malformed message")

func decode(b []byte, v any) error {
	if len(b) > MaxPayload {
		return fmt.Errorf("%w: %d bytes is over the %d limit", ErrBadMessage, len(b), MaxPayload)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%w: %v", ErrBadMessage, err)
	}
	return nil
}

// ValidCommandID reports whether s is a UUID in canonical form.
func ValidCommandID(s string) bool {
	if len(s) != 36 {
		return false
	}
	_, err := uuid.Parse(s)
	return err == nil
}

// ParseCommand decodes and checks a command message.
func ParseCommand(b []byte) (Command, error) {
	var c Command
	if err := decode(b, &c); err != nil {
		return Command{}, err
	}
	switch {
	case !ValidCommandID(c.ID):
		return Command{}, fmt.Errorf("%w: command id %q", ErrBadMessage, c.ID)
	case !ValidOp(c.Op):
		return Command{}, fmt.Errorf("%w: op %q", ErrBadMessage, c.Op)
	case !ValidDeviceID(c.DeviceID):
		return Command{}, fmt.Errorf("%w: device id %q", ErrBadMessage, c.DeviceID)
	case c.After != "" && !ValidCommandID(c.After):
		return Command{}, fmt.Errorf("%w: after %q", ErrBadMessage, c.After)
	}
	return c, nil
}

// ParseReply decodes and checks a reply message.
func ParseReply(b []byte) (Reply, error) {
	var w wireReply
	if err := decode(b, &w); err != nil {
		return Reply{}, err
	}
	r := w.reply()
	switch {
	case !ValidCommandID(r.CommandID):
		return Reply{}, fmt.Errorf("%w: command id %q", ErrBadMessage, r.CommandID)
	case !companion.ValidState(r.State) || r.State == companion.StateQueued || r.State == companion.StateSent:
		return Reply{}, fmt.Errorf("%w: state %q is not one a bridge reports", ErrBadMessage, r.State)
	case r.Progress != nil && (*r.Progress < 0 || *r.Progress > 100):
		return Reply{}, fmt.Errorf("%w: progress %d", ErrBadMessage, *r.Progress)
	case (r.Status != nil || r.Settings != nil) && !companion.IsFinal(r.State):
		return Reply{}, fmt.Errorf("%w: device state in a %s reply", ErrBadMessage, r.State)
	}
	// A UUID's hex digits are case-insensitive (RFC 9562 §4), and command
	// ids are stored in lower case: a bridge that carried the id as a UUID
	// may write it in capitals (Swift's uuidString does), and its replies
	// were dropped as naming no command (docs/reliability.md, bug 377).
	r.CommandID = strings.ToLower(r.CommandID)
	switch {
	case r.Error != nil && (r.State == companion.StateDelivered || r.State == companion.StateInProgress || r.State == companion.StateSucceeded):
		// An error says why a command failed, expired or was canceled: on
		// another state it is dropped. Kept, it stayed on the command
		// through every later state, a succeeded one included
		// (docs/reliability.md, bug 146).
		r.Error = nil
	case r.Error != nil:
		// A message is what a device or its bridge said; stored with the
		// command and served with it on every read, 200 KiB of it was too
		// (bug 572).
		r.Error.Code, r.Error.Message = deviceText(r.Error.Code), clip(deviceText(r.Error.Message), MaxErrorMessage)
		if r.Error.Code != "" && !ValidErrorCode(r.Error.Code) {
			// Served as it came, such a code reached users as the
			// command's error.code, which a client tells a failure by:
			// "Bad Code!", a line break, 10 KB of it. It is taken as no
			// code, and kept in BadCode for the server to quote and log
			// (docs/reliability.md, bug 569).
			r.Error.BadCode, r.Error.Code = clip(r.Error.Code, MaxErrorCode), ""
		}
	}
	if len(r.Result) > 0 {
		// Kept as written, but valid Unicode, as every string decoded
		// here is: it reaches clients as it is (bug 370).
		r.Result = companion.UnicodeJSON(r.Result)
	}
	if r.Status != nil {
		if err := checkStatus(*r.Status); err != nil {
			return Reply{}, err
		}
		cleanStatus(r.Status)
	}
	if r.Settings != nil {
		if err := checkSettings(r.Settings); err != nil {
			return Reply{}, err
		}
	}
	return r, nil
}

// ParseStatus decodes and checks a status message.
func ParseStatus(b []byte) (Status, error) {
	var s Status
	if err := decode(b, &s); err != nil {
		return Status{}, err
	}
	if err := checkStatus(s); err != nil {
		return Status{}, err
	}
	cleanStatus(&s)
	return s, nil
}

// cleanStatus makes the text a device reported storable (deviceText), and
// its names and versions showable (deviceLabel).
func cleanStatus(s *Status) {
	s.FirmwareVersion, s.Model = deviceLabel(s.FirmwareVersion), deviceLabel(s.Model)
	for i := range s.Apps {
		s.Apps[i].Version = deviceLabel(s.Apps[i].Version)
	}
}

// deviceLabel is a one-line text a device reported, a model or a version
// (a GATT string of the Device Information Service), as deviceText makes
// it, with each control character (an ESC, a line break, a C1 code) made
// U+FFFD: an app shows it in one line, and the server takes no such
// character in a name or a text from a user either (docs/reliability.md,
// bug 568). Served as it came, an ESC sequence in a model reached a
// terminal watching the API, and a line break split the line a list
// shows it on.
func deviceLabel(s string) string {
	s = deviceText(s)
	if _, at := ControlChar(s, ""); at < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return utf8.RuneError
		}
		return r
	}, s)
}

// deviceText is text a device reported (a GATT string, an error message),
// made storable in every store: firmware that hands over a C string with
// its terminator is common, and PostgreSQL's text cannot hold a NUL, which
// bbolt would keep. Trailing NULs go; one inside becomes U+FFFD, as
// encoding/json already makes of invalid UTF-8.
func deviceText(s string) string {
	s = strings.TrimRight(s, "\x00")
	if strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// clip is s cut to at most n bytes, on a character's boundary, with an
// ellipsis where it was cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}

func checkStatus(s Status) error {
	if s.Battery != nil && (*s.Battery < 0 || *s.Battery > 100) {
		return fmt.Errorf("%w: battery %d", ErrBadMessage, *s.Battery)
	}
	if s.BridgeID != "" && !ValidBridgeID(s.BridgeID) {
		return fmt.Errorf("%w: bridge id %q", ErrBadMessage, s.BridgeID)
	}
	for _, a := range s.Apps {
		if !ValidAppID(a.AppID) {
			return fmt.Errorf("%w: app id %q", ErrBadMessage, a.AppID)
		}
	}
	return nil
}

// ParseSettings decodes a settings message, and holds it to the rules of
// a setting (Settings.clean): what breaks them is left out, or found, and
// named in its Flaws.
func ParseSettings(b []byte) (Settings, error) {
	var s Settings
	if err := decode(b, &s); err != nil {
		return Settings{}, err
	}
	if err := checkSettings(&s); err != nil {
		return Settings{}, err
	}
	return s, nil
}

func checkSettings(s *Settings) error {
	if s.Reported == nil {
		return fmt.Errorf("%w: no reported settings", ErrBadMessage)
	}
	s.clean()
	return nil
}
