package gatt

import (
	"fmt"

	"github.com/devicecompanion/companion/topics"
)

// Return codes (rc) of SMP responses, as MCUmgr numbers them (MGMT_ERR_*).
// Every response body may carry "rc" (absent means RCOK) and "rsn", a
// human-readable reason.
const (
	RCOK           = 0  // done
	RCUnknown      = 1  // unknown failure
	RCNoMemory     = 2  // out of memory or storage
	RCInvalid      = 3  // a field is missing or wrong
	RCTimeout      = 4  // the device timed out doing it
	RCNotFound     = 5  // no such thing (an app that is not installed)
	RCBadState     = 6  // not now (another upload holds the slot)
	RCMsgSize      = 7  // the message is larger than the buffer
	RCNotSupported = 8  // unknown group or command
	RCCorrupt      = 9  // the whole transfer's SHA-256 did not match
	RCBusy         = 10 // busy: try again shortly
	RCAccessDenied = 11 // not allowed
)

// Failure codes of commands, as the agent reports them in a reply's
// error.code (CONTRACT §2, agent/errors.go).
const (
	CodeInvalidPayload   = "invalid_payload"
	CodeDeviceError      = "device_error"
	CodeChecksumMismatch = "checksum_mismatch"
	CodeNotInstalled     = "not_installed"
	CodeDeviceBusy       = "device_busy"
)

// Error is a response with a non-zero rc.
type Error struct {
	Group  uint16
	ID     uint8
	RC     int
	Reason string
}

func (e *Error) Error() string {
	s := fmt.Sprintf("device answered rc %d (%s) to group %d command %d", e.RC, rcName(e.RC), e.Group, e.ID)
	if e.Reason != "" {
		s += ": " + e.Reason
	}
	return s
}

// ErrorCode is the failure code the agent reports for this error: what a
// firmware engineer's rc becomes in the command's reply.
func (e *Error) ErrorCode() string {
	switch e.RC {
	case RCInvalid, RCMsgSize:
		return CodeInvalidPayload
	case RCCorrupt:
		return CodeChecksumMismatch
	case RCNotFound:
		return CodeNotInstalled
	case RCBusy:
		return CodeDeviceBusy
	}
	return CodeDeviceError
}

// Temporary reports whether the request is worth repeating after a pause.
func (e *Error) Temporary() bool { return e.RC == RCBusy || e.RC == RCTimeout }

func rcName(rc int) string {
	names := []string{"ok", "unknown", "no memory", "invalid", "timeout", "not found", "bad state",
		"message size", "not supported", "corrupt", "busy", "access denied"}
	if rc >= 0 && rc < len(names) {
		return names[rc]
	}
	return "unknown rc"
}

// Status is the part every response body shares.
type Status struct {
	RC     int    `cbor:"rc,omitempty"`
	Reason string `cbor:"rsn,omitempty"`
}

// EchoRequest is OS echo (group 0, command 0, write).
type EchoRequest struct {
	D string `cbor:"d"`
}

// EchoResponse answers EchoRequest.
type EchoResponse struct {
	Status
	R string `cbor:"r"`
}

// ParamsResponse answers MCUmgr parameters (group 0, command 6, read):
// the size of the device's SMP receive buffer (the largest whole message,
// header included, it takes) and how many of them it has.
type ParamsResponse struct {
	Status
	BufSize  int `cbor:"buf_size"`
	BufCount int `cbor:"buf_count"`
}

// UploadRequest is one chunk of a chunked upload (image group command 1 for
// firmware, group 65 command 1 for pictures, group 66 command 1 for app
// packages). The first request of an upload, off 0, also carries len, sha
// and the group's fields; it may have no data, and then it only asks for
// the offset the device holds for this sha.
type UploadRequest struct {
	CmdID string `cbor:"cid"`
	Off   uint64 `cbor:"off"`
	Data  []byte `cbor:"data"`
	Len   uint64 `cbor:"len,omitempty"`
	SHA   []byte `cbor:"sha,omitempty"`

	Upgrade     bool   `cbor:"upgrade,omitempty"`      // firmware: boot it when complete
	Version     string `cbor:"version,omitempty"`      // firmware and apps
	ContentType string `cbor:"content_type,omitempty"` // pictures
	AppID       string `cbor:"app_id,omitempty"`       // apps
}

// UploadResponse answers an UploadRequest with the offset the device
// holds: the next byte it wants.
type UploadResponse struct {
	Status
	Off uint64 `cbor:"off"`
}

// TextRequest pushes a text (group 64, command 0, write).
type TextRequest struct {
	CmdID string `cbor:"cid"`
	Title string `cbor:"title,omitempty"`
	Text  string `cbor:"text"`
}

// AppEntry is one installed app.
type AppEntry struct {
	AppID   string `cbor:"app_id"`
	Version string `cbor:"version"`
}

// AppsResponse answers the apps list (group 66, command 0, read).
type AppsResponse struct {
	Status
	Apps []AppEntry `cbor:"apps"`
}

// UninstallRequest removes an app (group 66, command 2, write).
type UninstallRequest struct {
	CmdID string `cbor:"cid"`
	AppID string `cbor:"app_id"`
}

// SettingsResponse answers a settings read (group 3, command 0, read).
type SettingsResponse struct {
	Status
	Values map[string]any `cbor:"values"`
	Schema topics.Schema  `cbor:"schema"`
}

// SettingsRequest changes some settings (group 3, command 0, write); all
// or none apply.
type SettingsRequest struct {
	CmdID  string         `cbor:"cid"`
	Values map[string]any `cbor:"values"`
}
