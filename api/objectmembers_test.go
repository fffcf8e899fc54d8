package api

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// objectMembersCases are JSON objects whose split must agree with
// encoding/json's: nesting, names and values with escapes, quotes and
// brackets inside strings, white space everywhere JSON allows it, invalid
// UTF-8 in a name, repeats.
var objectMembersCases = []string{
	`{}`,
	` { } `,
	`{"text":"hi"}`,
	"{ \"text\" :\t\"hi\" ,\r\n \"ttl_seconds\" : 6e1 }",
	`{"a":{"b":[1,{"c":"}"}],"d":"]"},"e":[],"f":null,"g":true,"h":-0.5e-3}`,
	`{"t\u0065xt":"a","text":"b"}`,
	`{"a\"b":"c\\","\\":"\""}`,
	"{\"te\xffxt\":1}",
	`{"é":"ü","日本":[ "x" , 1 ]}`,
	`{"a":1,"a":2,"b":{"a":3},"a":{"x":[]}}`,
	`{"x":"{\"y\":1}","z":[[[]]]}`,
}

// objectMembers gives what json.Unmarshal into a map of raw messages
// gives, and counts every name at the top level, repeats too.
func TestObjectMembersAgreeWithEncodingJSON(t *testing.T) {
	for _, raw := range objectMembersCases {
		checkObjectMembers(t, []byte(raw))
	}
	members, count := objectMembers([]byte(`{"a":1,"a":2,"b":{"a":3},"a":{"x":[]}}`))
	assert.Equal(t, 4, count)
	assert.Equal(t, `{"x":[]}`, string(members["a"]))
}

func FuzzObjectMembers(f *testing.F) {
	for _, raw := range objectMembersCases {
		f.Add([]byte(raw))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || !bytes.HasPrefix(bytes.TrimLeft(raw, " \t\r\n"), []byte("{")) {
			return
		}
		checkObjectMembers(t, raw)
	})
}

func checkObjectMembers(t *testing.T, raw []byte) {
	t.Helper()
	var want map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(raw, &want), "%q", raw)
	got, count := objectMembers(raw)
	if want == nil {
		want = map[string]json.RawMessage{}
	}
	require.Equal(t, len(want), len(got), "%q: members %q", raw, got)
	for name, v := range want {
		require.Contains(t, got, name, "%q", raw)
		assert.Equal(t, string(v), string(got[name]), "%q: member %q", raw, name)
	}
	// The names at the top level, counted by encoding/json's tokens.
	dec := json.NewDecoder(bytes.NewReader(raw))
	names, depth, name := 0, 0, false
	for tok, err := dec.Token(); err == nil; tok, err = dec.Token() {
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
			name = depth == 1
			continue
		case json.Delim('}'), json.Delim(']'):
			depth--
			name = depth == 1
			continue
		}
		if depth == 1 {
			if name {
				names++
			}
			name = !name
		}
	}
	assert.Equal(t, names, count, "%q: names counted", raw)
}
