package api

import (
	"encoding/base64"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An image refused for its base64 says what is wrong with it (bug 376):
// "must be standard base64" alone was the answer to base64 in lines
// (Android's Base64.DEFAULT, Java's MIME encoder, `base64` without -w0),
// to a data: URL (JavaScript's FileReader.readAsDataURL) and to the
// URL-safe alphabet (Base64.URL_SAFE, Java's getUrlEncoder), each of which
// its user knows as base64.
func TestAnImagesBase64SaysWhatIsWrong(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	png := pngOf(t, 64, 64)
	img := b64(png)
	urlSafe := base64.URLEncoding.EncodeToString(png)
	require.True(t, strings.ContainsAny(urlSafe, "-_"), "the test image's base64 has no URL-safe character")
	for _, tc := range []struct{ name, image, says string }{
		{"in lines", img[:76] + "\n" + img[76:], "line break"},
		{"in CRLF lines", img[:76] + "\r\n" + img[76:], "line break"},
		{"a data: URL", "data:image/png;base64," + img, "data:"},
		{"URL-safe", urlSafe, "URL-safe"},
	} {
		r := e.do("POST", "/api/v1/devices/dev-1/push/image", tok, map[string]any{"image": tc.image})
		require.Equal(t, 422, r.status, "%s: %s", tc.name, r.body)
		p := r.problem(t)
		require.Len(t, p.Errors, 1, tc.name)
		assert.Equal(t, "image", p.Errors[0].Field, tc.name)
		assert.Contains(t, p.Errors[0].Message, tc.says, tc.name)
	}
	assert.Zero(t, e.cmds.count())
}
