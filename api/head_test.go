package api

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestHeadIsGetWithoutItsBody sends every GET route of the server, over
// the real HTTP server, as GET and as HEAD, with the caller's token and
// without: each HEAD has its GET's status and headers and no body, and is
// an answer api/openapi.json documents. The event stream's HEAD ends at
// once. Every other method of such a path is a 405 whose Allow names
// HEAD. Without the fix each HEAD but those of /healthz, /readyz and a
// blob was a 405.
func TestHeadIsGetWithoutItsBody(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	cmd := e.push(t, tok, "dev-1")
	content := []byte(strings.Repeat("package ", 512)) // past net/http's buffer: chunked for GET
	r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/clock/1.0.0", token: testAdminToken, body: content,
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	sum := sha256.Sum256(content)
	sample := strings.NewReplacer(":id", "dev-1", ":command_id", cmd, ":sha256", hex.EncodeToString(sum[:]))

	gets := 0
	for _, route := range e.api.engine.Routes() {
		if route.Method != "GET" {
			continue
		}
		gets++
		path := sample.Replace(route.Path)
		token := tok
		switch {
		case strings.HasPrefix(path, "/api/v1/blobs/"):
			token = testAdminToken
		case !strings.HasPrefix(path, "/api/v1/") || path == "/api/v1/openapi.json":
			token = ""
		}
		tokens := []string{token}
		if token != "" {
			tokens = append(tokens, "") // the 401, as GET's
		}
		for _, token := range tokens {
			get := getHeaders(t, e.srv.URL+path, token)
			head := e.send(req{method: "HEAD", path: path, token: token})
			assert.Equal(t, get.status, head.status, "HEAD %s (token %t): the status of GET", path, token != "")
			assert.Empty(t, head.body, "HEAD %s", path)
			for _, h := range []http.Header{get.header, head.header} {
				h.Del("Date")
				h.Del(RequestIDHeader) // each request's own
			}
			if get.header.Get("Content-Length") == "" {
				// A GET whose body outgrew net/http's buffer is chunked,
				// and its length not known before it is written; nor then
				// is a HEAD's. Either may give it.
				head.header.Del("Content-Length")
			}
			assert.Equal(t, get.header, head.header, "HEAD %s (token %t): the headers of GET", path, token != "")
		}
		r := e.do("PATCH", path, tok, nil)
		require.Equal(t, http.StatusMethodNotAllowed, r.status, "PATCH %s", path)
		assert.True(t, slices.Contains(strings.Split(r.header.Get("Allow"), ", "), "HEAD"), "PATCH %s: Allow %q names HEAD", path, r.header.Get("Allow"))
	}
	assert.GreaterOrEqual(t, gets, 15, "GET routes")
}

// getHeaders sends a GET and returns its status and headers, with its
// body read only when it is not an event stream (which does not end).
func getHeaders(t testing.TB, url, token string) resp {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	require.NoError(t, err)
	if token != "" {
		hr.Header.Set("Authorization", "Bearer "+token)
	}
	res, err := http.DefaultClient.Do(hr)
	require.NoError(t, err)
	defer res.Body.Close()
	out := resp{status: res.StatusCode, header: res.Header}
	if res.Header.Get("Content-Type") != "text/event-stream" {
		out.body, err = io.ReadAll(res.Body)
		require.NoError(t, err)
	}
	return out
}
