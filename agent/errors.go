package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/devicecompanion/companion/topics"
)

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

// failure is the reply's error for a command that failed with err.
// timedOut says the command ran out of its whole time, limit. A request
// to the device that timed out on its own (a GATT request the device never
// answered) is a timeout too, but of that request, and says so: its
// message does not claim the command's limit passed.
func failure(err error, timedOut bool, limit time.Duration) *commandError {
	var ce *commandError
	if errors.As(err, &ce) {
		return ce
	}
	var coded codedError
	switch {
	case timedOut:
		return cmdErr(codeTimeout, fmt.Sprintf("the command did not finish within %s", limit))
	case errors.As(err, &coded):
		return cmdErr(coded.ErrorCode(), err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return cmdErr(codeTimeout, "the device did not answer in time: "+err.Error())
	}
	return cmdErr(codeDeviceError, err.Error())
}
