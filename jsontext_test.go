package companion

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// UnicodeJSON changes a JSON text only where encoding/json would decode a
// U+FFFD, and the value it decodes to is the same (bug 370).
func TestUnicodeJSON(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"a":"b"}`, `{"a":"b"}`},
		{`"caf` + "\xe9" + `"`, `"caf` + "\uFFFD" + `"`},
		{`"` + "\xff\xfe" + `"`, `"` + "\uFFFD\uFFFD" + `"`},
		{`"\ud800"`, `"\ufffd"`},
		{`"\uDC00x"`, `"\ufffdx"`},
		{`"\ud800\u0041"`, `"\ufffd\u0041"`},
		{`"\ud800\ud800\udc00"`, `"\ufffd\ud800\udc00"`},
		{`"\ud83d\ude00"`, `"\ud83d\ude00"`},
		{`"\\ud800"`, `"\\ud800"`},
		{`"\\\ud800"`, `"\\\ufffd"`},
		{`{"\ud800":1e400,"n":12345678901234567890}`, `{"\ufffd":1e400,"n":12345678901234567890}`},
		{`"é😀"`, `"é😀"`},
	} {
		got := string(UnicodeJSON(json.RawMessage(tc.in)))
		assert.Equal(t, tc.want, got, "%q", tc.in)
		assert.True(t, utf8.ValidString(got), "%q", tc.in)
		var a, b any
		if json.Unmarshal([]byte(tc.in), &a) == nil {
			require.NoError(t, json.Unmarshal([]byte(got), &b), "%q", tc.in)
			assert.Equal(t, a, b, "%q decodes to another value", tc.in)
		}
	}
}
