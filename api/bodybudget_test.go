package api

import (
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBodiesPerUserAreBounded: the request bodies one user's requests are
// sending at once are bounded in bytes (MaxBodyBytesPerUser, counted by
// their Content-Length): past the bound a request is a 429 rate_limited
// before its body is read, and what fits still goes, another user's too.
// Unbounded, a token that sent a few MiB of an image push and then a byte
// a minute (the body's average stays above BodyMinRate for hours) held
// them in the server's memory, at the request rate: fifty such requests
// a second took gigabytes in a minute, each for six hours.
func TestBodiesPerUserAreBounded(t *testing.T) {
	const budget = 1 << 20
	e := newEnv(t, func(o *Options) { o.Limits.MaxBodyBytesPerUser = budget })
	alice, bob := e.bound("dev-a"), e.bound("dev-b")
	// An image push padded to 600 KiB with the whitespace JSON allows.
	image := `{"image": "` + base64.StdEncoding.EncodeToString(pngOf(t, 4, 4)) + `"}`
	padded := image + strings.Repeat(" ", 600<<10-len(image))
	path := "/api/v1/devices/dev-a/push/image"

	// The first 1000 bytes of one, and no more for now.
	conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, rawRequest("POST", path, alice, "application/json", int64(len(padded)))+padded[:1000])
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.api.bodies.held() > 0 }, 10*time.Second, 5*time.Millisecond,
		"the server never began to read the first body")

	r := e.send(req{method: "POST", path: path, token: alice, body: padded})
	require.Equal(t, http.StatusTooManyRequests, r.status, "a second 600 KiB body of one user, past 1 MiB: %s", r.body)
	assert.Equal(t, CodeRateLimited, r.problem(t).Code)
	assert.NotEmpty(t, r.header.Get("Retry-After"))
	assert.Equal(t, 202, e.do("POST", "/api/v1/devices/dev-a/push/text", alice, map[string]any{"text": "small"}).status,
		"a small body still fits")
	assert.Equal(t, 202, e.send(req{method: "POST", path: "/api/v1/devices/dev-b/push/image", token: bob, body: padded}).status,
		"another user's body")

	_, err = io.WriteString(conn, padded[1000:])
	require.NoError(t, err)
	require.Eventually(t, func() bool { return e.api.bodies.held() == 0 }, 10*time.Second, 5*time.Millisecond,
		"the first body, read, still counts")
	assert.Equal(t, 202, e.send(req{method: "POST", path: path, token: alice, body: padded}).status, "once the first is in")
}
