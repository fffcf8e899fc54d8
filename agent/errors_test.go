package agent_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/agent"
)

type rcError struct{}

func (rcError) Error() string     { return "rc 3" }
func (rcError) ErrorCode() string { return "invalid_payload" }

// TestFailure checks the error a failed command's reply carries: the
// command's own time limit is named only when that limit passed, and a
// device request that timed out on its own says so instead (a simulated
// device whose buffer was full failed settings updates after its 30 s
// request timeout with "did not finish within 10m0s").
func TestFailure(t *testing.T) {
	const limit = 10 * time.Minute
	request := fmt.Errorf("smp request: %w", context.DeadlineExceeded)
	tests := []struct {
		name      string
		err       error
		timedOut  bool
		wantCode  string
		wantIn    string
		wantNotIn string
	}{
		{"the command's limit passed", request, true, "timeout", "did not finish within 10m0s", ""},
		{"a device request timed out", request, false, "timeout", "the device did not answer in time: smp request", "10m0s"},
		{"a device's coded error", rcError{}, false, "invalid_payload", "rc 3", ""},
		{"a coded error after the limit", rcError{}, true, "timeout", "did not finish within 10m0s", ""},
		{"any other device error", errors.New("screen broken"), false, "device_error", "screen broken", ""},
	}
	for _, tt := range tests {
		code, msg := agent.Failure(tt.err, tt.timedOut, limit)
		if code != tt.wantCode || !strings.Contains(msg, tt.wantIn) || (tt.wantNotIn != "" && strings.Contains(msg, tt.wantNotIn)) {
			t.Errorf("%s: Failure(%v, %v) = %q, %q; want code %q, a message with %q and without %q",
				tt.name, tt.err, tt.timedOut, code, msg, tt.wantCode, tt.wantIn, tt.wantNotIn)
		}
	}
}
