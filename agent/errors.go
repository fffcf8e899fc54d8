package agent

import "github.com/devicecompanion/companion/topics"

// Error codes of failed commands, as they appear in a reply's error.code.
const (
	codeTimeout          = "timeout"
	codeDownloadFailed   = "download_failed"
	codeChecksumMismatch = "checksum_mismatch"
	codeInvalidPayload   = "invalid_payload"
	codeDeviceError      = "device_error"
	codeVersionMismatch  = "version_mismatch"
)

// commandError is a command's failure with the code its reply carries.
type commandError struct {
	Code      string
	Message   string
	transient bool // worth retrying (downloads only)
}

func (e *commandError) Error() string { return e.Code + ": " + e.Message }

func cmdErr(code, msg string) *commandError { return &commandError{Code: code, Message: msg} }

func (e *commandError) reply() *topics.Error { return &topics.Error{Code: e.Code, Message: e.Message} }

// codedError is a device's error that names its own failure code (a GATT
// device's rc mapped to checksum_mismatch, invalid_payload, …); any other
// device error is reported as device_error.
type codedError interface {
	error
	ErrorCode() string
}
