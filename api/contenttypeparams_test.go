package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A JSON body labelled application/json with a parameter of its own
// beside charset (an OData client's odata.metadata, a version, a
// profile) is JSON, and taken (bug 557): it was a 415 "this operation
// takes application/json in UTF-8", to a client that had sent just that,
// where CONTRACT §2 has a 415 for a body that is not application/json.
// A charset is still judged, wherever it stands among them.
func TestJSONTypeParametersBesideCharsetAreTaken(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for _, tc := range []struct {
		path, ctype string
		status      int
	}{
		{"/api/v1/devices/dev-1/push/text", "application/json; foo=bar", 202},
		{"/api/v1/devices/dev-1/push/text", "application/json;odata.metadata=minimal;odata.streaming=true", 202},
		{"/api/v1/devices/dev-1/push/text", "application/json; charset=utf-8; v=2", 202},
		{"/api/v1/devices/dev-1/push/text", "application/json; v=2; charset=UTF-8", 202},
		{"/api/v1/devices/dev-1/push/text", `application/json; profile="https://example.com/text"`, 202},
		{"/api/v1/devices/dev-1/ota/update", "application/json; foo=bar", 404}, // no firmware: past the body checks
		{"/api/v1/devices/dev-1/push/text", "application/json; v=2; charset=latin1", 415},
		{"/api/v1/devices/dev-1/push/text", "application/json; foo=bar; foo=baz", 415}, // a parameter twice: unreadable
	} {
		n := e.cmds.count()
		r := e.send(req{method: "POST", path: tc.path, token: tok, body: `{"text":"hi"}`, header: map[string]string{"Content-Type": tc.ctype}})
		require.Equal(t, tc.status, r.status, "Content-Type %q on %s = %d %s; want %d", tc.ctype, tc.path, r.status, r.body, tc.status)
		if tc.status != 202 {
			assert.Equal(t, n, e.cmds.count(), "Content-Type %q made a command", tc.ctype)
		}
		if tc.status == 415 {
			assert.Equal(t, CodeUnsupportedMedia, r.problem(t).Code)
		}
	}
}
