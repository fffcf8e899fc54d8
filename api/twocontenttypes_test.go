package api

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

// A request with two Content-Type headers that name different types (a
// client's interceptor that adds its own beside the one the call set, a
// proxy that adds one) was judged by the first alone: a JSON body whose
// second label said text/plain was taken, and an app package sent as a
// form (multipart/form-data, curl -F) behind an application/octet-stream
// label was published as the form's envelope, for devices to install.
// RFC 9110 §8.3 allows the header once; which one a proxy, a WAF or a log
// reads is theirs to choose. Such a request is a 415 now, nothing done, on
// every operation with a body; the same type twice is one type
// (docs/reliability.md, bug 510).
func TestTwoDifferentContentTypesAreRefused(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	push := "/api/v1/devices/dev-1/push/text"
	for _, tc := range []struct {
		name  string
		types []string
	}{
		{"JSON, then text", []string{"application/json", "text/plain"}},
		{"text, then JSON", []string{"text/plain", "application/json"}},
		{"JSON, then a form", []string{"application/json", "application/x-www-form-urlencoded"}},
		{"JSON, then JSON in Latin-1", []string{"application/json", "application/json; charset=iso-8859-1"}},
		{"both in one line", []string{"application/json, text/plain"}},
	} {
		n := e.cmds.count()
		r := e.send(req{method: "POST", path: push, token: tok, body: `{"text":"hi"}`, headers: map[string][]string{"Content-Type": tc.types}})
		require.Equal(t, 415, r.status, "%s: %s", tc.name, r.body)
		assert.Equal(t, CodeUnsupportedMedia, r.problem(t).Code, tc.name)
		assert.Equal(t, n, e.cmds.count(), "%s made a command", tc.name)
	}
	r := e.send(req{method: "POST", path: "/api/v1/devices/dev-1/ota/update", token: tok, body: `{}`,
		headers: map[string][]string{"Content-Type": {"application/json", "text/plain"}}})
	assert.Equal(t, 415, r.status, "an optional body: %s", r.body)
	r = e.send(req{method: "POST", path: push, token: tok, body: `{"text":"hi"}`,
		headers: map[string][]string{"Content-Type": {"application/json", "application/json; charset=utf-8"}}})
	assert.Equal(t, 202, r.status, "the same type twice is one type: %s", r.body)

	pkg := []byte("--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clock.zip\"\r\n\r\n" +
		string(bytes.Repeat([]byte("app package "), 100)) + "\r\n--x--\r\n")
	for _, types := range [][]string{
		{"application/octet-stream", "multipart/form-data; boundary=x"},
		{"multipart/form-data; boundary=x", "application/octet-stream"},
		{"application/octet-stream, multipart/form-data; boundary=x"},
	} {
		r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/clock/1.0.0", token: testAdminToken, body: pkg,
			headers: map[string][]string{"Content-Type": types}})
		require.Equal(t, 415, r.status, "an upload labelled %q: %s", types, r.body)
		assert.Equal(t, CodeUnsupportedMedia, r.problem(t).Code)
		_, err := e.db.AppRelease(context.Background(), "clock", "1.0.0")
		require.ErrorIs(t, err, companion.ErrNotFound, "the form's envelope, labelled %q, was published as the package", types)
	}
	r = e.send(req{method: "PUT", path: "/api/v1/admin/apps/clock/1.0.0", token: testAdminToken, body: []byte("app package"),
		headers: map[string][]string{"Content-Type": {"application/octet-stream", "application/octet-stream"}}})
	assert.Equal(t, 201, r.status, "an upload labelled the same type twice: %s", r.body)
}
