package api

import (
	"bytes"
	"compress/gzip"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

func gzipped(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	_, err := w.Write(b)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	return buf.Bytes()
}

// A request body with a content coding (Content-Encoding: gzip, as
// HTTPie's --compress and some apps' interceptors send it) is a 415 with
// Accept-Encoding: identity (RFC 9110 §15.5.16), on every operation with
// a body (bug 371): the coding was ignored, so a compressed JSON body was
// a 400 "not valid JSON", one labelled gzip but sent plain was taken, and
// an app package or firmware image uploaded compressed was published as
// the compressed bytes, for devices to install.
func TestContentCodingsAreRefused(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	push := "/api/v1/devices/dev-1/push/text"
	for _, tc := range []struct {
		name   string
		body   []byte
		coding string
	}{
		{"gzip", gzipped(t, []byte(`{"text":"hi"}`)), "gzip"},
		{"labelled gzip, sent plain", []byte(`{"text":"hi"}`), "gzip"},
		{"deflate in a list", []byte(`{"text":"hi"}`), "identity, deflate"},
		{"br", []byte(`{"text":"hi"}`), "br"},
	} {
		n := e.cmds.count()
		r := e.send(req{method: "POST", path: push, token: tok, body: tc.body, header: map[string]string{"Content-Encoding": tc.coding}})
		require.Equal(t, 415, r.status, "%s: %s", tc.name, r.body)
		assert.Equal(t, CodeUnsupportedMedia, r.problem(t).Code, tc.name)
		assert.Equal(t, "identity", r.header.Get("Accept-Encoding"), tc.name)
		assert.Equal(t, n, e.cmds.count(), "%s made a command", tc.name)
	}
	r := e.send(req{method: "POST", path: push, token: tok, body: `{"text":"hi"}`, header: map[string]string{"Content-Encoding": "Identity"}})
	assert.Equal(t, 202, r.status, "identity is no coding: %s", r.body)
	r = e.send(req{method: "POST", path: "/api/v1/devices/dev-1/ota/update", token: tok, body: gzipped(t, []byte(`{}`)),
		header: map[string]string{"Content-Encoding": "gzip"}})
	assert.Equal(t, 415, r.status, "an optional body: %s", r.body)

	pkg := bytes.Repeat([]byte("app package "), 100)
	r = e.send(req{method: "PUT", path: "/api/v1/admin/apps/clock/1.0.0", token: testAdminToken, body: gzipped(t, pkg),
		header: map[string]string{"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"}})
	require.Equal(t, 415, r.status, "an upload: %s", r.body)
	assert.Equal(t, "identity", r.header.Get("Accept-Encoding"))
	_, err := e.db.AppRelease(context.Background(), "clock", "1.0.0")
	assert.ErrorIs(t, err, companion.ErrNotFound, "the compressed bytes were published as the package")
}
