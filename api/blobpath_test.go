package api

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A blob's path that is no SHA-256 of the form blobs are named by (the
// hash in capitals, as PowerShell's Get-FileHash and many tools print
// it; too short) is a 404 that says what a blob's name is, as a path
// segment that is no id of its kind is on the other routes (bug 560): it
// said "no such content" of content the server had, under its name in
// lower case. Content that is not there, or not the bridge's, is "no
// such content" as before.
func TestABlobPathThatIsNoSHA256SaysSo(t *testing.T) {
	e := newEnv(t)
	_, sha := putFirmware(t, e, 1000)
	secret := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "b-1"}).json(t)["secret"].(string)
	i := strings.IndexAny(sha, "abcdef") // one digit in a capital
	oneCapital := sha[:i] + strings.ToUpper(sha[i:i+1]) + sha[i+1:]
	for _, token := range []string{testAdminToken, secret} {
		for _, bad := range []string{strings.ToUpper(sha), oneCapital, "abc", sha + "0", strings.Repeat("g", 64)} {
			r := e.do("GET", "/api/v1/blobs/"+bad, token, nil)
			require.Equal(t, 404, r.status, "%s: %s", bad, r.body)
			p := r.problem(t)
			assert.Equal(t, CodeBlobNotFound, p.Code)
			assert.Equal(t, "the path names no content: a blob is named by its SHA-256, 64 hex digits in lower case", p.Detail, "GET /api/v1/blobs/%s", bad)
		}
	}
	r := e.do("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), testAdminToken, nil)
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, "no such content", r.problem(t).Detail)
	r = e.do("GET", "/api/v1/blobs/"+sha, secret, nil)
	require.Equal(t, 404, r.status, "a blob no command of the bridge's needs: %s", r.body)
	assert.Equal(t, "no such content", r.problem(t).Detail)
	r = e.do("GET", "/api/v1/blobs/"+sha, testAdminToken, nil)
	assert.Equal(t, 200, r.status)
}
