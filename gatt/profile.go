package gatt

import (
	"fmt"

	"github.com/devicecompanion/companion/topics"
)

// Return codes (rc) of SMP responses, as MCUmgr numbers them (MGMT_ERR_*).
// Every response body may carry "rc" (absent means RCOK) and "rsn", a
// human-readable reason; in SMP version 2 a group's own failure comes as
// "err": {"group", "rc"} instead, with the group's codes (below).
const (
	RCOK           = 0  // done
	RCUnknown      = 1  // unknown failure
	RCNoMemory     = 2  // out of memory or storage
	RCInvalid      = 3  // a field is missing or wrong
	RCTimeout      = 4  // the device timed out doing it
	RCNotFound     = 5  // no such thing (an app that is not installed; in version 1, a settings key)
	RCBadState     = 6  // not now (another upload holds the slot)
	RCMsgSize      = 7  // the message is larger than the buffer
	RCNotSupported = 8  // unknown group or command
	RCCorrupt      = 9  // corrupt: a message cut short, or a transfer whose SHA-256 did not match
	RCBusy         = 10 // busy: try again shortly
	RCAccessDenied = 11 // not allowed
	RCTooOld       = 12 // the request's SMP version is older than the device takes
	RCTooNew       = 13 // the request's SMP version is newer than the device takes
)

// Errors of the image group (img_mgmt's IMG_MGMT_ERR_*), as SMP version 2
// reports them in err.rc. The names are Zephyr's.
const (
	ImgErrUnknown                 = 1
	ImgErrNoImage                 = 3
	ImgErrNoTLVs                  = 4
	ImgErrHashNotFound            = 8
	ImgErrNoFreeSlot              = 9
	ImgErrFlashWriteFailed        = 12
	ImgErrInvalidOffset           = 20
	ImgErrInvalidLength           = 21
	ImgErrInvalidImageHeader      = 22
	ImgErrInvalidImageHeaderMagic = 23
	ImgErrInvalidHash             = 24
	ImgErrInvalidFlashAddress     = 25
	ImgErrCurrentVersionIsNewer   = 27
	ImgErrImageAlreadyPending     = 28
	ImgErrImageTooLarge           = 30
	ImgErrDataOverrun             = 31
	ImgErrConfirmationDenied      = 32
	ImgErrTestToActiveDenied      = 33
)

// Errors of the settings group (settings_mgmt's SETTINGS_MGMT_ERR_*).
const (
	SettingsErrUnknown            = 1
	SettingsErrKeyTooLong         = 2
	SettingsErrKeyNotFound        = 3
	SettingsErrReadNotSupported   = 4
	SettingsErrRootKeyNotFound    = 5
	SettingsErrWriteNotSupported  = 6
	SettingsErrDeleteNotSupported = 7
)

// Failure codes of commands, as the agent reports them in a reply's
// error.code (CONTRACT §2, agent/errors.go).
const (
	CodeInvalidPayload   = "invalid_payload"
	CodeDeviceError      = "device_error"
	CodeChecksumMismatch = "checksum_mismatch"
	CodeNotInstalled     = "not_installed"
	CodeDeviceBusy       = "device_busy"
	// CodeFirmwareReverted: the device came back from the reboot on its old
	// image (MCUboot refused the new one, or reverted it when it was not
	// confirmed).
	CodeFirmwareReverted = "firmware_reverted"
	// CodeMTUTooSmall: a request did not fit one ATT write at the link's
	// MTU, on a device that does not reassemble SMP requests, over this
	// connection and a new one. The link is too small for it, not the
	// payload wrong: a larger MTU, or reassembly, takes it.
	CodeMTUTooSmall = "mtu_too_small"
)

// Error is a response with a non-zero rc, or (SMP version 2) a group's
// error.
type Error struct {
	Group   uint16
	ID      uint8
	RC      int // MCUmgr's rc; 0 when the group's error says it
	GroupRC int // the group's own error (err.rc of SMP version 2); 0 when none
	Reason  string
	// Code, when set, is the failure code the agent reports, whatever the
	// rc (the bridge's own verdicts: a reverted image).
	Code string
	// Bridge marks the bridge's own verdict, not an answer of the device:
	// a request it did not send because it is longer than the device
	// takes (RC is then RCMsgSize), a value or an image it refused before
	// sending anything, an OTA whose image state never came right. RC is
	// the rc the bridge treats it as, for the failure code.
	Bridge bool
}

func (e *Error) Error() string {
	var s string
	if e.Bridge {
		return fmt.Sprintf("gatt: the bridge's own check (no answer of the device) on group %d command %d: %s", e.Group, e.ID, e.Reason)
	}
	if e.RC == 0 && e.GroupRC == 0 {
		return "gatt: " + e.Reason
	}
	if e.GroupRC != 0 {
		s = fmt.Sprintf("device answered error %d (%s) of group %d to command %d", e.GroupRC, groupErrName(e.Group, e.GroupRC), e.Group, e.ID)
	} else {
		s = fmt.Sprintf("device answered rc %d (%s) to group %d command %d", e.RC, rcName(e.RC), e.Group, e.ID)
	}
	if e.Reason != "" {
		s += ": " + e.Reason
	}
	return s
}

// ErrorCode is the failure code the agent reports for this error: what a
// firmware engineer's rc becomes in the command's reply.
func (e *Error) ErrorCode() string {
	if e.Code != "" {
		return e.Code
	}
	if e.GroupRC != 0 {
		switch {
		case e.Group == GroupImage && (e.GroupRC >= ImgErrInvalidOffset && e.GroupRC <= ImgErrInvalidFlashAddress ||
			e.GroupRC == ImgErrImageTooLarge || e.GroupRC == ImgErrDataOverrun):
			// Error 25, invalid flash address, is img_mgmt_upload_inspect's
			// refusal of an image built for a fixed address (imgtool
			// --rom-fixed, MCUboot direct-XIP) other than the free slot's:
			// the image is wrong for the device, as it is for its size
			// (error 30). SMP version 1 says it as rc 3 (EINVAL), which
			// was invalid_payload while version 2's was device_error
			// (docs/reliability.md, bug 506).
			return CodeInvalidPayload
		case e.Group == GroupSettings && (e.GroupRC == SettingsErrKeyTooLong || e.GroupRC == SettingsErrKeyNotFound ||
			e.GroupRC == SettingsErrRootKeyNotFound):
			return CodeInvalidPayload
		}
		return CodeDeviceError
	}
	switch e.RC {
	case RCInvalid, RCMsgSize:
		return CodeInvalidPayload
	case RCUnknown:
		// settings_mgmt's version 1 answer of a value its handler
		// refused (h_set's -EINVAL, version 2's error 5): its
		// translation has no other code for it, and a value write or
		// read (in RAM: settings_runtime_set and _get) fails for nothing
		// but its handler's refusal (bug 412).
		if e.Group == GroupSettings && e.ID == CmdSettingsValue {
			return CodeInvalidPayload
		}
	case RCCorrupt:
		return CodeChecksumMismatch
	case RCNotFound:
		// ENOENT: an app the device does not have, in the project's apps
		// group. A device answering in SMP version 1 gives it for a
		// settings key its handler does not know too, and for a slot
		// without an image, as settings_mgmt and img_mgmt translate their
		// errors (docs/reliability.md, bug 260).
		switch e.Group {
		case GroupApps:
			return CodeNotInstalled
		case GroupSettings:
			return CodeInvalidPayload
		}
		return CodeDeviceError
	case RCBusy:
		return CodeDeviceBusy
	}
	return CodeDeviceError
}

// Temporary reports whether the request is worth repeating after a pause:
// the device is busy, timed out inside, or had no buffer for the answer
// (rc 2, MGMT_ERR_ENOMEM, which smp.c answers in the request's own buffer,
// the request not run).
func (e *Error) Temporary() bool {
	return e.RC == RCBusy || e.RC == RCTimeout || e.RC == RCNoMemory
}

func rcName(rc int) string {
	names := []string{"ok", "unknown", "no memory", "invalid", "timeout", "not found", "bad state",
		"message size", "not supported", "corrupt", "busy", "access denied", "protocol version too old",
		"protocol version too new"}
	if rc >= 0 && rc < len(names) {
		return names[rc]
	}
	return "unknown rc"
}

func groupErrName(group uint16, rc int) string {
	var names []string
	switch group {
	case GroupImage:
		names = []string{"ok", "unknown", "flash config query fail", "no image", "no TLVs", "invalid TLV",
			"multiple hashes", "TLV invalid size", "hash not found", "no free slot", "flash open failed",
			"flash read failed", "flash write failed", "flash erase failed", "invalid slot", "no free memory",
			"flash context already set", "flash context not set", "flash area device null", "invalid page offset",
			"invalid offset", "invalid length", "invalid image header", "invalid image header magic",
			"invalid hash", "invalid flash address", "version get failed", "current version is newer",
			"image already pending", "invalid image vector table", "image too large", "data overrun",
			"confirmation denied", "setting test to active denied", "active slot not known"}
	case GroupSettings:
		names = []string{"ok", "unknown", "key too long", "key not found", "read not supported",
			"root key not found", "write not supported", "delete not supported"}
	}
	if rc >= 0 && rc < len(names) {
		return names[rc]
	}
	return "error of the group"
}

// GroupError is a group's own error in an SMP version 2 response.
type GroupError struct {
	Group uint16 `cbor:"group"`
	RC    int    `cbor:"rc"`
}

// Status is the part every response body shares.
type Status struct {
	RC     int         `cbor:"rc,omitempty"`
	Reason string      `cbor:"rsn,omitempty"`
	Err    *GroupError `cbor:"err,omitempty"`
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
// the size of the device's SMP buffers (CONFIG_MCUMGR_TRANSPORT_NETBUF_SIZE:
// the largest whole message, header included, it takes) and how many it
// has (CONFIG_MCUMGR_TRANSPORT_NETBUF_COUNT, shared by requests and
// responses).
type ParamsResponse struct {
	Status
	BufSize  int `cbor:"buf_size"`
	BufCount int `cbor:"buf_count"`
}

// ResetRequest is OS reset (group 0, command 5, write). Zephyr answers,
// then reboots CONFIG_MCUMGR_GRP_OS_RESET_MS later.
type ResetRequest struct {
	Force bool `cbor:"force,omitempty"`
}

// ImageUploadRequest is one chunk of img_mgmt's upload (group 1, command
// 1). The request at off 0 opens the upload: it carries len, sha (the
// SHA-256 of all the bytes uploaded, whatever hash the image carries:
// img_mgmt takes at most 32 bytes, to resume and to answer match) and the
// first bytes, at least the image header, which the device checks. Later ones carry off and data only.
// Upgrade asks the device to refuse an image not newer than the one it
// runs; the bridge leaves it out (an explicit older version is a rollback
// the API allows).
type ImageUploadRequest struct {
	Off     uint64 `cbor:"off"`
	Data    []byte `cbor:"data"`
	Len     uint64 `cbor:"len,omitempty"`
	SHA     []byte `cbor:"sha,omitempty"`
	Upgrade bool   `cbor:"upgrade,omitempty"`
}

// UploadResponse answers an upload request with the offset the device
// holds: the next byte it wants. img_mgmt's answer to the request that
// completes an upload adds match: whether the SHA-256 of what it wrote is
// the sha it was given (CONFIG_IMG_ENABLE_IMAGE_CHECK).
type UploadResponse struct {
	Status
	Off   uint64 `cbor:"off"`
	Match *bool  `cbor:"match,omitempty"`
}

// ImageSlot is one slot of the image state (group 1, command 0).
type ImageSlot struct {
	Image     int    `cbor:"image,omitempty"`
	Slot      int    `cbor:"slot"`
	Version   string `cbor:"version"` // "1.2.3", or "1.2.3.4" with a build number
	Hash      []byte `cbor:"hash"`    // the image's hash TLV: SHA-256, or SHA-512 in a build that checks it
	Bootable  bool   `cbor:"bootable,omitempty"`
	Pending   bool   `cbor:"pending,omitempty"`
	Confirmed bool   `cbor:"confirmed,omitempty"`
	Active    bool   `cbor:"active,omitempty"`
	Permanent bool   `cbor:"permanent,omitempty"`
}

// ImageStateResponse answers an image state read or write.
type ImageStateResponse struct {
	Status
	Images      []ImageSlot `cbor:"images"`
	SplitStatus int         `cbor:"splitStatus,omitempty"`
}

// ImageStateRequest is an image state write: test the image with hash on
// the next boot (confirm false), or make it permanent (confirm true; no
// hash: the running image).
type ImageStateRequest struct {
	Hash    []byte `cbor:"hash,omitempty"`
	Confirm bool   `cbor:"confirm"`
}

// SettingReadRequest reads one setting (group 3, command 0, read).
type SettingReadRequest struct {
	Name string `cbor:"name"`
}

// SettingReadResponse answers SettingReadRequest with the value's bytes as
// the device's settings handler gives them.
type SettingReadResponse struct {
	Status
	Val []byte `cbor:"val"`
}

// SettingWriteRequest writes one setting (group 3, command 0, write).
type SettingWriteRequest struct {
	Name string `cbor:"name"`
	Val  []byte `cbor:"val"`
}

// SchemaResponse answers the settings schema read (group 67, command 0):
// the settings the device has, by name (read and written through group 3
// as SettingsPrefix+name).
type SchemaResponse struct {
	Status
	Schema topics.Schema `cbor:"schema"`
}

// SettingsPrefix is the subtree of the device's settings the bridge reads
// and writes: setting "brightness" is the Zephyr settings key
// "companion/brightness".
const SettingsPrefix = "companion/"

// UploadRequest is one chunk of a project group's upload (group 65 command
// 1 for pictures, group 66 command 1 for app packages). The first request
// of an upload, off 0, also carries len, sha and the group's fields; it
// has no data, and only asks for the offset the device holds.
type UploadRequest struct {
	CmdID string `cbor:"cid"`
	Off   uint64 `cbor:"off"`
	Data  []byte `cbor:"data"`
	Len   uint64 `cbor:"len,omitempty"`
	SHA   []byte `cbor:"sha,omitempty"`

	Version     string `cbor:"version,omitempty"`      // apps
	ContentType string `cbor:"content_type,omitempty"` // pictures
	AppID       string `cbor:"app_id,omitempty"`       // apps
}

// TextBody is what a text's chunked upload (group 64, command 1) carries
// as its data: a CBOR map of the text and its title, as command 0's
// request has them.
type TextBody struct {
	Title string `cbor:"title,omitempty"`
	Text  string `cbor:"text"`
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
