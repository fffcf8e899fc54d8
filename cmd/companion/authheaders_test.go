package main

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A request with two Authorization headers of different tokens names two
// principals: it is a 401, on the user, admin and blob routes, and does
// nothing; the same token twice is taken (docs/reliability.md, bug 501).
// Before, the server acted as the first token, as Header.Get reads it.
func TestTwoDifferentBearerTokensAreRefused(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "mallory"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	mallory := r.JSON(t)["token"].(string)

	send := func(method, path, body string, tokens ...string) (int, http.Header, string) {
		t.Helper()
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		req, err := http.NewRequest(method, m.APIURL()+path, rd)
		require.NoError(t, err)
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		for _, tok := range tokens {
			req.Header.Add("Authorization", "Bearer "+tok)
		}
		resp, err := f.user.hc.Do(req) // checked against api/openapi.json
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, string(b)
	}

	for _, tc := range []struct {
		name, method, path, body string
		tokens                   []string
	}{
		{"another user's token first", "GET", "/api/v1/devices", "", []string{mallory, f.user.token}},
		{"the user's token first", "POST", "/api/v1/devices/dev-1/push/text", `{"text":"whose?"}`, []string{f.user.token, mallory}},
		{"the admin token and a user's", "POST", "/api/v1/admin/users", `{"name":"eve"}`, []string{m.AdminToken(), f.user.token}},
		{"a bridge's secret and the admin token", "GET", "/api/v1/blobs/" + strings.Repeat("0", 64), "", []string{f.bridgeSecret, m.AdminToken()}},
	} {
		status, h, body := send(tc.method, tc.path, tc.body, tc.tokens...)
		assert.Equal(t, 401, status, "%s %s with two different bearer tokens (%s): %s", tc.method, tc.path, tc.name, body)
		assert.Contains(t, body, `"code":"unauthorized"`, tc.name)
		assert.Equal(t, `Bearer realm="companion", error="invalid_token"`, h.Get("WWW-Authenticate"), tc.name)
	}

	// Nothing was done as either of them.
	r = f.user.do("GET", "/api/v1/devices/dev-1/commands", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	assert.JSONEq(t, `{"commands":[],"next_cursor":null}`, string(r.Body), "a push sent with two tokens was stored")

	// The same token twice (a proxy that repeats the header) is one token.
	status, _, body := send("GET", "/api/v1/devices", "", f.user.token, f.user.token)
	assert.Equal(t, 200, status, "%s", body)
	assert.Contains(t, body, `"device_id":"dev-1"`)
	status, _, body = send("GET", "/api/v1/devices", "", f.user.token, "  "+f.user.token)
	assert.Equal(t, 200, status, "the same token, spaced otherwise: %s", body)
}
