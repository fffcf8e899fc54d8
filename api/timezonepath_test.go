package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A timezone setting is an IANA name (CONTRACT §4), not a path to one:
// "./UTC", "Europe//London" and "Europe/./London" open the host's zone
// files, as time.LoadLocation reads them, and were taken and sent to the
// device, whose time zone database knows no such name (bug 561).
func TestTimezoneWrittenAsAPathIsRefused(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	path := "/api/v1/devices/dev-1/settings"
	for _, zone := range []string{"./UTC", "Europe//London", "Europe/./London", "Europe/London/.", "America/Argentina//Buenos_Aires", "./Europe/Berlin"} {
		r := e.do("PUT", path, tok, map[string]any{"timezone": zone})
		require.Equal(t, 422, r.status, "timezone %q = %d %s", zone, r.status, r.body)
		assert.Equal(t, []FieldError{{Field: "timezone", Message: "must be an IANA time zone name such as Europe/Berlin"}}, r.problem(t).Errors, "%q", zone)
	}
	assert.Zero(t, e.cmds.count(), "no command for a refused timezone")
	for _, zone := range []string{"UTC", "Europe/London", "America/Argentina/Buenos_Aires", "Etc/GMT+5"} {
		r := e.do("PUT", path, tok, map[string]any{"timezone": zone})
		require.Equal(t, 202, r.status, "timezone %q = %d %s", zone, r.status, r.body)
	}
}
