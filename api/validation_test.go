package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"image"
	"image/color"
	"image/gif"
	"image/jpeg"
	"image/png"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/topics"
)

func pngOf(t testing.TB, w, h int) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, png.Encode(&buf, image.NewGray(image.Rect(0, 0, w, h))))
	return buf.Bytes()
}

func jpegOf(t testing.TB, w, h int) []byte {
	t.Helper()
	var buf bytes.Buffer
	require.NoError(t, jpeg.Encode(&buf, image.NewRGBA(image.Rect(0, 0, w, h)), nil))
	return buf.Bytes()
}

func gifOf(t testing.TB, w, h int) []byte {
	t.Helper()
	var buf bytes.Buffer
	img := image.NewPaletted(image.Rect(0, 0, w, h), color.Palette{color.Black, color.White})
	require.NoError(t, gif.Encode(&buf, img, nil))
	return buf.Bytes()
}

// pngHeaderOnly is a PNG signature and an IHDR chunk claiming w×h pixels,
// and nothing else: only a header-only check can get an answer from it.
func pngHeaderOnly(w, h uint32) []byte {
	var ihdr bytes.Buffer
	ihdr.WriteString("IHDR")
	binary.Write(&ihdr, binary.BigEndian, w)
	binary.Write(&ihdr, binary.BigEndian, h)
	ihdr.Write([]byte{8, 0, 0, 0, 0}) // 8-bit grey
	var out bytes.Buffer
	out.WriteString("\x89PNG\r\n\x1a\n")
	binary.Write(&out, binary.BigEndian, uint32(13))
	out.Write(ihdr.Bytes())
	binary.Write(&out, binary.BigEndian, crc32.ChecksumIEEE(ihdr.Bytes()))
	return out.Bytes()
}

// flipByte returns a copy of b with its byte at i inverted.
func flipByte(b []byte, i int) []byte {
	c := bytes.Clone(b)
	c[i] ^= 0xff
	return c
}

// jpegWithRestarts is a JPEG whose scan ends in a restart marker (RSTn,
// which image/jpeg does not write, cameras do) and a stuffed 0xff byte:
// the check must walk past both to the EOI.
func jpegWithRestarts(t testing.TB) []byte {
	t.Helper()
	b := jpegOf(t, 16, 16)
	sos := bytes.Index(b, []byte{0xff, 0xda})
	require.Positive(t, sos)
	n := int(b[sos+2])<<8 | int(b[sos+3])
	scan := sos + 2 + n
	out := append(bytes.Clone(b[:scan]), b[scan:len(b)-2]...)
	out = append(out, 0xff, 0xd0, 0xff, 0x00, 0xff, 0xd9)
	_, format, err := image.DecodeConfig(bytes.NewReader(out))
	require.NoError(t, err)
	require.Equal(t, "jpeg", format)
	return out
}

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// padTo appends zero bytes to a valid image until it is n bytes long,
// after its end, where decoders stop.
func padTo(b []byte, n int) []byte {
	return append(b, make([]byte, n-len(b))...)
}

type bodyCase struct {
	name   string
	body   any
	status int
	fields []string // the fields the problem must name, in order; nil: none checked
}

func runBodyCases(t *testing.T, e *env, method, path, token string, cases []bodyCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do(method, path, token, tc.body)
			require.Equal(t, tc.status, r.status, "%s %s (%s) = %d %s; want %d", method, path, tc.name, r.status, r.body, tc.status)
			if tc.status >= 400 {
				p := r.problem(t)
				if tc.fields != nil {
					assert.Equal(t, tc.fields, p.fields(), "fields of %s", r.body)
				}
				switch tc.status {
				case http.StatusUnprocessableEntity:
					if tc.fields != nil {
						assert.Equal(t, CodeValidationFailed, p.Code)
					}
				case http.StatusBadRequest:
					assert.Equal(t, CodeMalformedJSON, p.Code)
				}
			}
		})
	}
}

func TestPushTextValidation(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/text"
	a := func(n int) string { return strings.Repeat("a", n) }
	cases := []bodyCase{
		{"text at 4096 bytes", map[string]any{"text": a(4096)}, 202, nil},
		{"text at 4097 bytes", map[string]any{"text": a(4097)}, 422, []string{"text"}},
		{"text of 2048 two-byte runes", map[string]any{"text": strings.Repeat("é", 2048)}, 202, nil},
		{"text of 2049 two-byte runes", map[string]any{"text": strings.Repeat("é", 2049)}, 422, []string{"text"}},
		{"text empty", map[string]any{"text": ""}, 422, []string{"text"}},
		{"text missing", map[string]any{"title": "t"}, 422, []string{"text"}},
		{"text null", `{"text":null}`, 422, []string{"text"}},
		{"text invalid UTF-8", []byte("{\"text\":\"ab\xff\xfecd\"}"), 422, []string{"text"}},
		{"text lone high surrogate", `{"text":"a\ud800b"}`, 422, []string{"text"}},
		{"text lone low surrogate", `{"text":"\udc00"}`, 422, []string{"text"}},
		{"text surrogate pair", `{"text":"\ud83d\ude00"}`, 202, nil},
		{"title invalid UTF-8", []byte("{\"text\":\"x\",\"title\":\"\xc3\"}"), 422, []string{"title"}},
		{"title at 128", map[string]any{"text": "x", "title": a(128)}, 202, nil},
		{"title at 129", map[string]any{"text": "x", "title": a(129)}, 422, []string{"title"}},
		{"ttl 59", map[string]any{"text": "x", "ttl_seconds": 59}, 422, []string{"ttl_seconds"}},
		{"ttl 60", map[string]any{"text": "x", "ttl_seconds": 60}, 202, nil},
		{"ttl 604800", map[string]any{"text": "x", "ttl_seconds": 604800}, 202, nil},
		{"ttl 604801", map[string]any{"text": "x", "ttl_seconds": 604801}, 422, []string{"ttl_seconds"}},
		{"ttl fraction", map[string]any{"text": "x", "ttl_seconds": 60.5}, 422, []string{"ttl_seconds"}},
		{"ttl negative", map[string]any{"text": "x", "ttl_seconds": -1}, 422, []string{"ttl_seconds"}},
		{"ttl huge", `{"text":"x","ttl_seconds":1e300}`, 422, []string{"ttl_seconds"}},
		{"ttl string", `{"text":"x","ttl_seconds":"60"}`, 400, []string{"ttl_seconds"}},
		{"text number", `{"text":5}`, 400, []string{"text"}},
		{"title object", `{"text":"x","title":{}}`, 400, []string{"title"}},
		{"every field bad", map[string]any{"title": a(129), "ttl_seconds": 1}, 422, []string{"text", "title", "ttl_seconds"}},
		{"unknown fields ignored", map[string]any{"text": "x", "colour": "red"}, 202, nil},
		{"not JSON", "text=hello", 400, nil},
		{"array", `[{"text":"x"}]`, 400, nil},
		{"string", `"x"`, 400, nil},
		{"null", `null`, 400, nil},
		{"empty", ``, 400, nil},
		{"truncated", `{"text":"x"`, 400, nil},
		{"trailing data", `{"text":"x"} true`, 400, nil},
		{"two objects", `{"text":"x"}{"text":"y"}`, 400, nil},
	}
	runBodyCases(t, e, "POST", path, tok, cases)

	c := e.cmds.last(t)
	assert.Equal(t, topics.OpPushText, c.Op)
	assert.Equal(t, "dev-1", c.DeviceID)

	t.Run("ttl sets expires_at", func(t *testing.T) {
		before := time.Now()
		r := e.do("POST", path, tok, map[string]any{"text": "x", "ttl_seconds": 3600})
		require.Equal(t, 202, r.status)
		exp, err := time.Parse(time.RFC3339Nano, r.json(t)["expires_at"].(string))
		require.NoError(t, err)
		assert.WithinDuration(t, before.Add(time.Hour), exp, 5*time.Second)
		var p topics.PushText
		require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &p))
		assert.Equal(t, topics.PushText{Text: "x"}, p)
	})
}

func TestContentTypeAndSize(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/text"
	body := `{"text":"hi"}`
	for _, tc := range []struct {
		ctype  string
		status int
	}{
		{"application/json", 202},
		{"application/json; charset=utf-8", 202},
		{"application/json;charset=UTF-8", 202},
		{`application/json; charset="utf-8"`, 202},
		{"application/json; charset=utf8", 202}, // bug 322: UTF-8's other names
		{"application/json; charset=UTF8", 202},
		{"application/json; charset=unicode-1-1-utf-8", 202},
		{"text/plain", 415},
		{"", 415},
		{"application/json; charset=latin1", 415},
		{"application/json; charset=iso-8859-1", 415},
		{"application/json; charset=utf-16", 415},
		{"application/json; charset=utf-8; q=1", 202}, // bug 557: a parameter beside charset is let be
		{"application/x-www-form-urlencoded", 415},
		{"application/jsonx", 415},
		{"garbage;;;", 415},
	} {
		r := e.send(req{method: "POST", path: path, token: tok, body: body, header: map[string]string{"Content-Type": tc.ctype}})
		require.Equal(t, tc.status, r.status, "Content-Type %q = %d %s; want %d", tc.ctype, r.status, r.body, tc.status)
		if tc.status == 415 {
			p := r.problem(t)
			assert.Equal(t, CodeUnsupportedMedia, p.Code)
			if strings.Contains(tc.ctype, "charset") {
				assert.Contains(t, p.Detail, "UTF-8", "Content-Type %q", tc.ctype)
			}
		}
	}

	t.Run("413 over the JSON limit", func(t *testing.T) {
		big := map[string]any{"text": strings.Repeat("a", 70<<10)}
		r := e.do("POST", path, tok, big)
		require.Equal(t, 413, r.status, "%s", r.body)
		assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
	})
	t.Run("413 over the image limit", func(t *testing.T) {
		big := map[string]any{"image": strings.Repeat("A", 6<<20)}
		r := e.do("POST", "/api/v1/devices/dev-1/push/image", tok, big)
		require.Equal(t, 413, r.status, "%s", r.body)
		assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
	})
	t.Run("optional bodies may be empty without a content type", func(t *testing.T) {
		r := e.send(req{method: "POST", path: "/api/v1/devices/dev-1/ota/update", token: tok})
		require.Equal(t, 404, r.status, "%s", r.body) // no firmware: past the body checks
		assert.Equal(t, CodeFirmwareNotFound, r.problem(t).Code)
		r = e.send(req{method: "POST", path: "/api/v1/devices/dev-1/ota/update", token: tok, body: `{}`, header: map[string]string{"Content-Type": "text/plain"}})
		require.Equal(t, 415, r.status, "%s", r.body)
	})
}

func TestPushImageValidation(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/image"
	small := pngOf(t, 8, 4)
	const mib2 = 2 << 20
	cases := []bodyCase{
		{"png", map[string]any{"image": b64(small)}, 202, nil},
		{"png unpadded base64", map[string]any{"image": base64.RawStdEncoding.EncodeToString(small)}, 202, nil},
		{"png with its content type", map[string]any{"image": b64(small), "content_type": "image/png"}, 202, nil},
		{"jpeg", map[string]any{"image": b64(jpegOf(t, 16, 16)), "content_type": "image/jpeg"}, 202, nil},
		{"content type mismatch", map[string]any{"image": b64(small), "content_type": "image/jpeg"}, 422, []string{"content_type"}},
		{"content type not an image we take", map[string]any{"image": b64(small), "content_type": "image/gif"}, 422, []string{"content_type"}},
		{"content type garbage", map[string]any{"image": b64(small), "content_type": ";;"}, 422, []string{"content_type"}},
		{"gif", map[string]any{"image": b64(gifOf(t, 4, 4))}, 422, []string{"image"}},
		{"not an image", map[string]any{"image": b64([]byte("hello, world"))}, 422, []string{"image"}},
		{"garbage base64", map[string]any{"image": "!!!not base64$$$"}, 422, []string{"image"}},
		{"missing", map[string]any{"content_type": "image/png"}, 422, []string{"image"}},
		{"empty", map[string]any{"image": ""}, 422, []string{"image"}},
		{"number", `{"image":12}`, 400, []string{"image"}},
		{"4096 wide", map[string]any{"image": b64(pngOf(t, 4096, 1))}, 202, nil},
		{"4096 high", map[string]any{"image": b64(pngOf(t, 1, 4096))}, 202, nil},
		{"4097 wide", map[string]any{"image": b64(pngOf(t, 4097, 1))}, 422, []string{"image"}},
		{"4097 high", map[string]any{"image": b64(pngOf(t, 1, 4097))}, 422, []string{"image"}},
		{"header claims 100000x100000", map[string]any{"image": b64(pngHeaderOnly(100000, 100000))}, 422, []string{"image"}},
		// The header is not all: a device cannot show an image cut short
		// or damaged after it.
		{"png header only", map[string]any{"image": b64(pngHeaderOnly(8, 4))}, 422, []string{"image"}},
		{"png cut short", map[string]any{"image": b64(small[:len(small)-20])}, 422, []string{"image"}},
		{"png without its IEND", map[string]any{"image": b64(small[:len(small)-12])}, 422, []string{"image"}},
		{"png with a damaged chunk", map[string]any{"image": b64(flipByte(small, len(small)-16))}, 422, []string{"image"}},
		{"png with garbage for chunks", map[string]any{"image": b64(append(pngHeaderOnly(8, 4), "garbage, not chunks"...))}, 422, []string{"image"}},
		{"jpeg cut short", map[string]any{"image": b64(jpegOf(t, 16, 16)[:300])}, 422, []string{"image"}},
		{"jpeg without its EOI", map[string]any{"image": b64(jpegOf(t, 16, 16)[:len(jpegOf(t, 16, 16))-2])}, 422, []string{"image"}},
		{"jpeg with bytes after its EOI", map[string]any{"image": b64(append(jpegOf(t, 16, 16), "trailer"...))}, 202, nil},
		{"jpeg with restart markers", map[string]any{"image": b64(jpegWithRestarts(t))}, 202, nil},
		{"2 MiB decoded", map[string]any{"image": b64(padTo(pngOf(t, 2, 2), mib2))}, 202, nil},
		{"2 MiB + 1 decoded", map[string]any{"image": b64(padTo(pngOf(t, 2, 2), mib2+1))}, 422, []string{"image"}},
		{"ttl 59", map[string]any{"image": b64(small), "ttl_seconds": 59}, 422, []string{"ttl_seconds"}},
		{"ttl 604801 and a gif", map[string]any{"image": b64(gifOf(t, 1, 1)), "ttl_seconds": 604801}, 422, []string{"image", "ttl_seconds"}},
	}
	runBodyCases(t, e, "POST", path, tok, cases)

	t.Run("payload references the blob", func(t *testing.T) {
		img := pngOf(t, 3, 5)
		r := e.do("POST", path, tok, map[string]any{"image": b64(img)})
		require.Equal(t, 202, r.status, "%s", r.body)
		var p topics.PushImage
		require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &p))
		assert.Equal(t, "image/png", p.ContentType)
		assert.Equal(t, 3, p.Width)
		assert.Equal(t, 5, p.Height)
		assert.Equal(t, int64(len(img)), p.Blob.Size)
		assert.Equal(t, "/api/v1/blobs/"+p.Blob.SHA256, p.Blob.URL)
	})
	t.Run("the header is refused with its size", func(t *testing.T) {
		r := e.do("POST", path, tok, map[string]any{"image": b64(pngHeaderOnly(100000, 100000))})
		p := r.problem(t)
		require.Len(t, p.Errors, 1)
		assert.Contains(t, p.Errors[0].Message, "100000×100000")
	})
}

// An int past 2^53 is checked, stored as desired and sent to the device as
// written, not as the float64 nearest it (bug 151): a device's 8-byte int
// setting takes any int64.
func TestSettingsIntsPast2To53AreExact(t *testing.T) {
	e := newEnv(t)
	owner := e.user("owner of other-1")
	e.provision("other-1", "code-other-1", "other-model")
	r := e.do("POST", "/api/v1/devices/register", owner, map[string]any{"device_id": "other-1", "claim_code": "code-other-1"})
	require.Equal(t, 201, r.status, "%s", r.body)
	path := "/api/v1/devices/other-1/settings"
	r = e.do("PUT", path, owner, `{"counter": 9007199254740993, "limit": -9223372036854775808}`)
	require.Equal(t, 202, r.status, "%s", r.body)
	r = e.do("GET", path, owner, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Contains(t, string(r.body), `"desired":{"counter":9007199254740993,"limit":-9223372036854775808}`)
	assert.Contains(t, string(r.body), `"pending":["counter","limit"]`)
	r = e.do("PUT", path, owner, `{"counter": 9223372036854775808}`)
	require.Equal(t, 202, r.status, "a number past int64 of a model the server does not know: the bridge refuses it; %s", r.body)
}

func TestSettingsValidation(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/settings"

	// Before the device reports its schema (a device provisioned, not yet
	// on a bridge), a change is checked against its model's, sim-1's
	// (CONTRACT §4), and waits for the device as any command does.
	runBodyCases(t, e, "PUT", path, tok, []bodyCase{
		{"no schema yet", map[string]any{"brightness": 10}, 202, nil},
		{"no schema yet, unknown key", map[string]any{"bogus": 1}, 422, []string{"bogus"}},
		{"no schema yet, above range", map[string]any{"brightness": 101}, 422, []string{"brightness"}},
	})
	// And GET shows that schema, for a client to build its form from.
	r := e.do("GET", path, tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	want, err := json.Marshal(topics.SimSchema())
	require.NoError(t, err)
	shown, err := json.Marshal(r.json(t)["schema"])
	require.NoError(t, err)
	assert.JSONEq(t, string(want), string(shown), "the schema of a sim-1 device before it reported")
	// Of a model the server does not know, any value a setting can hold:
	// the bridge checks it against the device's schema.
	other := e.user("owner of other-1")
	e.provision("other-1", "code-other-1", "other-model")
	r = e.do("POST", "/api/v1/devices/register", other, map[string]any{"device_id": "other-1", "claim_code": "code-other-1"})
	require.Equal(t, 201, r.status, "%s", r.body)
	r = e.do("GET", "/api/v1/devices/other-1/settings", other, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, map[string]any{}, r.json(t)["schema"], "the schema of a device of a model the server does not know, before it reported")
	runBodyCases(t, e, "PUT", "/api/v1/devices/other-1/settings", other, []bodyCase{
		{"unknown model", map[string]any{"mode": "eco", "level": 3, "on": true}, 202, nil},
		{"unknown model, not a setting's value", map[string]any{"mode": map[string]any{"a": 1}, "level": nil, "on": []any{}}, 422, []string{"level", "mode", "on"}},
		// No setting is named so (bugs 503 and 567).
		{"unknown model, not a setting's name", map[string]any{"": 1, "y\u0000": 2, "tab\t": 3, "ok/name": 4, " ": 5, "\u200b": 6}, 422, []string{"", " ", "tab\t", "y\u0000", "\u200b"}},
	})

	e.reportSettings("dev-1")
	cases := []bodyCase{
		{"one setting", map[string]any{"brightness": 70}, 202, nil},
		{"every type", map[string]any{"volume": 0, "do_not_disturb": true, "timezone": "Europe/Berlin", "language": "ja", "display_timeout_s": 600}, 202, nil},
		{"unknown key", map[string]any{"bogus": 1}, 422, []string{"bogus"}},
		{"wrong type", map[string]any{"brightness": "high"}, 422, []string{"brightness"}},
		{"above range", map[string]any{"brightness": 101}, 422, []string{"brightness"}},
		{"below range", map[string]any{"display_timeout_s": 4}, 422, []string{"display_timeout_s"}},
		{"not an integer", map[string]any{"volume": 1.5}, 422, []string{"volume"}},
		{"bool as number", map[string]any{"do_not_disturb": 1}, 422, []string{"do_not_disturb"}},
		{"enum value", map[string]any{"language": "xx"}, 422, []string{"language"}},
		{"timezone", map[string]any{"timezone": "Mars/Olympus_Mons"}, 422, []string{"timezone"}},
		{"null value", `{"brightness":null}`, 422, []string{"brightness"}},
		{"invalid UTF-8 value", []byte("{\"language\":\"e\xffn\"}"), 422, []string{"language"}},
		{"each bad key named", map[string]any{"brightness": 101, "bogus": 1, "language": "xx", "do_not_disturb": 1, "volume": 50},
			422, []string{"bogus", "brightness", "do_not_disturb", "language"}},
		{"empty object", `{}`, 422, []string{"settings"}},
		{"array", `[]`, 400, nil},
		// JSON numbers have no range: one beyond a float64 is well-formed
		// but invalid (CONTRACT §2), a 422, not a 400.
		{"huge number", `{"brightness":1e999}`, 422, []string{"brightness"}},
		{"trailing", `{"brightness":1}]`, 400, nil},
	}
	runBodyCases(t, e, "PUT", path, tok, cases)

	r = e.do("PUT", path, tok, map[string]any{"brightness": 33})
	require.Equal(t, 202, r.status)
	var p topics.SettingsUpdate
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &p))
	assert.Equal(t, map[string]any{"brightness": 33.0}, p.Settings)

	got := e.do("GET", path, tok, nil)
	require.Equal(t, 200, got.status)
	m := got.json(t)
	assert.Equal(t, 33.0, m["desired"].(map[string]any)["brightness"])
	assert.Equal(t, 50.0, m["reported"].(map[string]any)["brightness"])
	assert.Contains(t, m["pending"], "brightness")
	assert.Contains(t, m["schema"], "language")
	assert.NotNil(t, m["updated_at"])
}

// A device that reported its settings with an empty schema (its bridge read
// none of them, as at MTU 23 without reassembly, README "Running a
// bridge") declares no setting: GET …/settings shows that empty schema, and
// a change is a 422 naming each key (CONTRACT §2), as against any schema a
// device reported. It was checked against the model's schema instead, as
// for a device that never reported, accepted, and failed invalid_payload
// by the bridge.
func TestSettingsOfADeviceThatDeclaresNone(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	_, err := e.db.PutReportedSettings(t.Context(), "dev-1", "", map[string]json.RawMessage{}, json.RawMessage("{}"), time.Now(), uint64(time.Now().UnixNano()))
	require.NoError(t, err)
	path := "/api/v1/devices/dev-1/settings"
	r := e.do("GET", path, tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, map[string]any{}, r.json(t)["schema"], "the schema the device reported")
	runBodyCases(t, e, "PUT", path, tok, []bodyCase{
		{"a setting of its model it does not declare", map[string]any{"volume": 3}, 422, []string{"volume"}},
	})
}

// A number beyond what a float64 holds is well-formed JSON (JSON has no
// range limit), so it is a 422 naming its path, on a struct field and in
// settings alike, while a real wrong type stays a 400.
func TestNumberOutOfRangeIs422(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	small := b64(pngOf(t, 2, 2))
	for _, tc := range []struct {
		method, path, body string
		status             int
		fields             []string
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"x","ttl_seconds":1e400}`, 422, []string{"ttl_seconds"}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"x","ttl_seconds":-1e400}`, 422, []string{"ttl_seconds"}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"x","ttl_seconds":1e-400}`, 422, []string{"ttl_seconds"}}, // 0: below 60
		{"POST", "/api/v1/devices/dev-1/push/image", `{"image":"` + small + `","ttl_seconds":179769313486231570000e300}`, 422, []string{"ttl_seconds"}},
		// A wrong type is a 400 whichever comes first, and a number into
		// a string is one.
		{"POST", "/api/v1/devices/dev-1/push/text", `{"ttl_seconds":1e400,"text":5}`, 400, []string{"text"}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":5,"ttl_seconds":1e400}`, 400, []string{"text"}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":1e400}`, 400, []string{"text"}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"x","ttl_seconds":1e400} true`, 400, nil},
		{"PUT", "/api/v1/devices/dev-1/settings", `{"brightness":1e400}`, 422, []string{"brightness"}},
		{"PUT", "/api/v1/devices/dev-1/settings", `{"volume":50,"brightness":-1E+400,"language":1e999}`, 422, []string{"brightness", "language"}},
		{"PUT", "/api/v1/devices/dev-1/settings", `{"brightness":{"a":[1,{"b":1e400}]}}`, 422, []string{"brightness.a[1].b"}},
		{"PUT", "/api/v1/devices/dev-1/settings", `{"brightness":1e308}`, 422, []string{"brightness"}}, // a float64: out of the schema's range
	} {
		r := e.do(tc.method, tc.path, tok, tc.body)
		require.Equal(t, tc.status, r.status, "%s %s %s = %d %s", tc.method, tc.path, tc.body, r.status, r.body)
		p := r.problem(t)
		if tc.fields != nil {
			assert.Equal(t, tc.fields, p.fields(), "%s: %s", tc.body, r.body)
		}
		switch tc.status {
		case 422:
			assert.Equal(t, CodeValidationFailed, p.Code, tc.body)
		case 400:
			assert.Equal(t, CodeMalformedJSON, p.Code, tc.body)
		}
	}
	r := e.do("PUT", "/api/v1/devices/dev-1/settings", tok, `{"brightness":1e400}`)
	require.Equal(t, 422, r.status)
	assert.Equal(t, []FieldError{{Field: "brightness", Message: "is a number out of range"}}, r.problem(t).Errors)
	assert.Zero(t, e.cmds.count(), "no command for a refused body")
}

func TestAppAndOTAValidation(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.0.0", topicsApp("weather", "1.0.0"))

	put := func(path string, body []byte) {
		t.Helper()
		r := e.send(req{method: "PUT", path: path, token: testAdminToken, body: body, header: map[string]string{"Content-Type": "application/octet-stream"}})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	put("/api/v1/admin/apps/weather/1.0.0", []byte("weather 1.0.0"))
	put("/api/v1/admin/apps/weather/1.2.0", []byte("weather 1.2.0"))
	put("/api/v1/admin/apps/weather/1.10.0", []byte("weather 1.10.0"))

	install := "/api/v1/devices/dev-1/apps/install"
	runBodyCases(t, e, "POST", install, tok, []bodyCase{
		{"app_id missing", map[string]any{}, 422, []string{"app_id"}},
		{"app_id upper case", map[string]any{"app_id": "Weather"}, 422, []string{"app_id"}},
		{"app_id 129", map[string]any{"app_id": strings.Repeat("a", 129)}, 422, []string{"app_id"}},
		{"app_id number", `{"app_id":1}`, 400, []string{"app_id"}},
		{"version not semver", map[string]any{"app_id": "weather", "version": "1.0"}, 422, []string{"version"}},
		{"version with v", map[string]any{"app_id": "weather", "version": "v1.0.0"}, 422, []string{"version"}},
		{"both bad", map[string]any{"app_id": "W", "version": ""}, 422, []string{"app_id", "version"}},
		{"unknown app", map[string]any{"app_id": "nope"}, 404, nil},
		{"unknown version", map[string]any{"app_id": "weather", "version": "9.9.9"}, 404, nil},
		{"latest", map[string]any{"app_id": "weather"}, 202, nil},
	})
	var ai topics.AppInstall
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &ai))
	assert.Equal(t, "1.10.0", ai.Version, "semver order, not text order")
	assert.Equal(t, "/api/v1/blobs/"+ai.Blob.SHA256, ai.Blob.URL)
	r := e.do("POST", install, tok, map[string]any{"app_id": "nope"})
	assert.Equal(t, CodeAppNotFound, r.problem(t).Code)

	update := "/api/v1/devices/dev-1/apps/weather/update"
	runBodyCases(t, e, "PUT", update, tok, []bodyCase{
		{"version bad", map[string]any{"version": "latest"}, 422, []string{"version"}},
		{"version number", `{"version":2}`, 400, []string{"version"}},
		{"already runs it", map[string]any{"version": "1.0.0"}, 409, nil},
		{"unknown version", map[string]any{"version": "3.0.0"}, 404, nil},
		{"explicit", map[string]any{"version": "1.2.0"}, 202, nil},
		{"latest", nil, 202, nil},
	})
	r = e.do("PUT", "/api/v1/devices/dev-1/apps/nope/update", tok, nil)
	assert.Equal(t, 404, r.status)
	assert.Equal(t, CodeAppNotFound, r.problem(t).Code)
	r = e.do("PUT", "/api/v1/devices/dev-1/apps/BAD/update", tok, nil)
	assert.Equal(t, 404, r.status)
	e.report("dev-1", "1.0.0", topicsApp("weather", "1.10.0"))
	r = e.do("PUT", update, tok, nil)
	assert.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, CodeNoUpdate, r.problem(t).Code)

	r = e.do("DELETE", "/api/v1/devices/dev-1/apps/weather", tok, nil)
	require.Equal(t, 202, r.status, "%s", r.body)
	assert.Equal(t, topics.OpAppUninstall, e.cmds.last(t).Op)
	r = e.do("DELETE", "/api/v1/devices/dev-1/apps/Not_Valid", tok, nil)
	assert.Equal(t, 404, r.status)

	// OTA.
	check := func() map[string]any {
		r := e.do("GET", "/api/v1/devices/dev-1/ota/check", tok, nil)
		require.Equal(t, 200, r.status, "%s", r.body)
		return r.json(t)
	}
	assert.Equal(t, map[string]any{"current_version": "1.0.0", "latest_version": nil, "update_available": false, "size": nil, "sha256": nil}, check())
	ota := "/api/v1/devices/dev-1/ota/update"
	r = e.do("POST", ota, tok, nil)
	assert.Equal(t, CodeFirmwareNotFound, r.problem(t).Code)

	put("/api/v1/admin/firmware/sim-1/1.0.0", firmwareImage(t, "1.0.0", 500))
	assert.Equal(t, false, check()["update_available"])
	r = e.do("POST", ota, tok, nil)
	assert.Equal(t, 409, r.status)
	assert.Equal(t, CodeNoUpdate, r.problem(t).Code)

	fw := firmwareImage(t, "1.1.0", 600)
	put("/api/v1/admin/firmware/sim-1/1.1.0", fw)
	m := check()
	assert.Equal(t, "1.1.0", m["latest_version"])
	assert.Equal(t, true, m["update_available"])
	assert.Equal(t, float64(len(fw)), m["size"])
	assert.Len(t, m["sha256"], 64)

	runBodyCases(t, e, "POST", ota, tok, []bodyCase{
		{"version bad", map[string]any{"version": "1"}, 422, []string{"version"}},
		{"version type", `{"version":true}`, 400, []string{"version"}},
		{"already runs it", map[string]any{"version": "1.0.0"}, 409, nil},
		{"unknown version", map[string]any{"version": "2.0.0"}, 404, nil},
		{"latest", `{}`, 202, nil},
		{"explicit", map[string]any{"version": "1.1.0"}, 202, nil},
	})
	var ou topics.OTAUpdate
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &ou))
	assert.Equal(t, "1.1.0", ou.Version)
	assert.Equal(t, int64(len(fw)), ou.Blob.Size)
}

// An OTA to another build of the version the device runs is taken: only
// the very version it runs is a 409 no_update. Without a version, the
// latest must be newer as a semantic version, build numbers aside.
func TestOTAToAnotherBuildOfTheRunningVersion(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.1.0+1")
	for _, v := range []string{"1.1.0+1", "1.1.0+2"} {
		r := e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/" + v, token: testAdminToken, body: firmwareImage(t, v, 600),
			header: map[string]string{"Content-Type": "application/octet-stream"}})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	ota := "/api/v1/devices/dev-1/ota/update"
	runBodyCases(t, e, "POST", ota, tok, []bodyCase{
		{"already runs it", map[string]any{"version": "1.1.0+1"}, 409, nil},
		{"another build", map[string]any{"version": "1.1.0+2"}, 202, nil},
		{"latest", `{}`, 409, nil},
	})
	var ou topics.OTAUpdate
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &ou))
	assert.Equal(t, "1.1.0+2", ou.Version)
}

// Releases of an app that differ only in build metadata order as equal
// semantic versions; the catalog breaks the tie by their text, and an
// install or update without a version takes the release the catalog lists
// as the latest, not another.
func TestAppLatestIsTheCatalogs(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.0.0", topicsApp("weather", "0.9.0"))
	for _, v := range []string{"1.0.0+1", "1.0.0+2"} {
		r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/weather/" + v, token: testAdminToken, body: []byte("weather " + v),
			header: map[string]string{"Content-Type": "application/octet-stream"}})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	r := e.do("GET", "/api/v1/apps", tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	latest := r.json(t)["apps"].([]any)[0].(map[string]any)["version"]
	require.Equal(t, "1.0.0+2", latest, "the catalog's latest")
	for _, tc := range []struct{ method, path, body string }{
		{"POST", "/api/v1/devices/dev-1/apps/install", `{"app_id":"weather"}`},
		{"PUT", "/api/v1/devices/dev-1/apps/weather/update", `{}`},
	} {
		r := e.do(tc.method, tc.path, tok, tc.body)
		require.Equal(t, 202, r.status, "%s", r.body)
		var ai topics.AppInstall
		require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &ai))
		assert.Equal(t, latest, ai.Version, "%s %s", tc.method, tc.path)
	}
}

// Builds of one firmware version (1.1.0+1, +2, +10) are one semantic
// version, but MCUboot's header numbers them: the latest is the highest
// build, as a number, for ota/check and for an update without a version.
// A device on another build of it has no update without a version, and
// the 409 says why.
func TestOTALatestIsTheHighestBuild(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.0.0")
	var want []byte
	for _, v := range []string{"1.1.0+1", "1.1.0+2", "1.1.0+10"} {
		want = firmwareImage(t, v, 600)
		r := e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/" + v, token: testAdminToken, body: want,
			header: map[string]string{"Content-Type": "application/octet-stream"}})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	r := e.do("GET", "/api/v1/devices/dev-1/ota/check", tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	check := r.json(t)
	assert.Equal(t, "1.1.0+10", check["latest_version"])
	assert.Equal(t, fmt.Sprintf("%x", sha256.Sum256(want)), check["sha256"])
	r = e.do("POST", "/api/v1/devices/dev-1/ota/update", tok, `{}`)
	require.Equal(t, 202, r.status, "%s", r.body)
	var ou topics.OTAUpdate
	require.NoError(t, json.Unmarshal(e.cmds.last(t).Payload, &ou))
	assert.Equal(t, "1.1.0+10", ou.Version)

	e.report("dev-1", "1.1.0+2")
	r = e.do("POST", "/api/v1/devices/dev-1/ota/update", tok, `{}`)
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, "the device runs 1.1.0+2, another build of 1.1.0+10, the latest for its model: an update without a version takes only a newer semantic version; ask for 1.1.0+10 to install it", r.problem(t).Detail)
}

// A device that runs a version newer than any published for its model has
// no update: the 409 says which is the latest, not that the device's own
// version is.
func TestOTAOnADeviceAheadOfTheCatalog(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "2.0.0")
	r := e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/1.1.0", token: testAdminToken, body: firmwareImage(t, "1.1.0", 600),
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, 201, r.status, "%s", r.body)
	r = e.do("POST", "/api/v1/devices/dev-1/ota/update", tok, `{}`)
	require.Equal(t, 409, r.status, "%s", r.body)
	p := r.problem(t)
	assert.Equal(t, CodeNoUpdate, p.Code)
	assert.Equal(t, "the device runs 2.0.0, newer than 1.1.0, the latest published for its model", p.Detail)
}

// An optional member that is null is taken as absent, as many JSON
// encoders write an unset field; api/openapi.json says so, so that a
// client checked against it may send one.
func TestOptionalMembersMayBeNull(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "0.9.0")
	r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/weather/1.0.0", token: testAdminToken, body: []byte("pkg"),
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, 201, r.status, "%s", r.body)
	r = e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/1.0.0", token: testAdminToken, body: firmwareImage(t, "1.0.0", 500),
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, 201, r.status, "%s", r.body)
	png := b64(pngOf(t, 2, 2))
	for _, tc := range []struct {
		method, path, body string
		status             int
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":"hi","title":null,"ttl_seconds":null}`, 202},
		{"POST", "/api/v1/devices/dev-1/push/image", `{"image":"` + png + `","content_type":null,"ttl_seconds":null}`, 202},
		{"POST", "/api/v1/devices/dev-1/apps/install", `{"app_id":"weather","version":null}`, 202},
		{"PUT", "/api/v1/devices/dev-1/apps/weather/update", `{"version":null}`, 202},
		{"POST", "/api/v1/devices/dev-1/ota/update", `{"version":null}`, 202},
		{"POST", "/api/v1/devices/register", `{"device_id":"dev-1","claim_code":"code-dev-1","name":null}`, 200},
	} {
		r := e.do(tc.method, tc.path, tok, tc.body)
		require.Equal(t, tc.status, r.status, "%s %s %s: %s", tc.method, tc.path, tc.body, r.body)
	}
	assert.Equal(t, "dev-1", e.do("GET", "/api/v1/devices/dev-1", tok, nil).json(t)["name"], "a null name is the device id")
}

func TestListQueryValidation(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for _, path := range []string{"/api/v1/devices", "/api/v1/devices/dev-1/commands"} {
		for _, tc := range []struct {
			query  string
			status int
			code   string
			fields []string
		}{
			{"", 200, "", nil},
			{"?limit=1", 200, "", nil},
			{"?limit=200", 200, "", nil},
			{"?limit=0", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=201", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=-1", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=ten", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=99999999999999999999", 422, CodeValidationFailed, []string{"limit"}},
			{"?cursor=%21%21%21", 422, CodeInvalidCursor, []string{"cursor"}},
			{"?cursor=" + base64.RawURLEncoding.EncodeToString([]byte("not an id!")), 422, CodeInvalidCursor, []string{"cursor"}},
			{"?cursor=!!!&limit=0", 422, CodeValidationFailed, []string{"limit", "cursor"}},
			// Given twice with different values: which one was meant?
			{"?limit=1&limit=2", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=2&limit=2", 200, "", nil},
			{"?cursor=a&cursor=b", 422, CodeValidationFailed, []string{"cursor"}},
			// A value net/url cannot read is there, and no number or
			// cursor: never read as absent.
			{"?limit=%zz", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=1;cursor=x", 422, CodeValidationFailed, []string{"limit"}},
			{"?limit=1&limit=%zz", 422, CodeValidationFailed, []string{"limit"}},
			{"?cursor=%zz", 422, CodeInvalidCursor, []string{"cursor"}},
			{"?limit=1&x=%zz", 200, "", nil},
			// An empty cursor is the first page's (docs/api.md).
			{"?cursor=", 200, "", nil},
			{"?limit=1&cursor=", 200, "", nil},
		} {
			r := e.do("GET", path+tc.query, tok, nil)
			require.Equal(t, tc.status, r.status, "GET %s%s = %d %s", path, tc.query, r.status, r.body)
			if tc.status != 200 {
				p := r.problem(t)
				assert.Equal(t, tc.code, p.Code, "GET %s%s", path, tc.query)
				assert.Equal(t, tc.fields, p.fields(), "GET %s%s", path, tc.query)
			}
		}
	}
	for _, tc := range []struct {
		query  string
		status int
	}{
		{"?state=queued", 200}, {"?state=succeeded", 200}, {"?state=canceled", 200},
		{"?state=done", 422}, {"?state=QUEUED", 422},
		// Given but empty, or twice with different values, it names no
		// state: never a list of every command.
		{"?state=", 422}, {"?state", 422}, {"?state=&limit=5", 422},
		{"?state=queued&state=failed", 422}, {"?state=queued&state=", 422},
		{"?state=queued&state=queued", 200},
		// Nor a state net/url cannot read (it would drop it).
		{"?state=%zz", 422}, {"?state=queued;x", 422}, {"?state=queued&state=%zz", 422},
		{"?st%61te=done", 422},
	} {
		r := e.do("GET", "/api/v1/devices/dev-1/commands"+tc.query, tok, nil)
		require.Equal(t, tc.status, r.status, "state %s: %s", tc.query, r.body)
		if tc.status == 422 {
			p := r.problem(t)
			assert.Equal(t, CodeValidationFailed, p.Code, "state %s", tc.query)
			assert.Equal(t, []string{"state"}, p.fields(), "state %s", tc.query)
		}
	}

	// An empty cursor reads the first page, as no cursor does.
	for i := range 3 {
		require.Equal(t, 202, e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": fmt.Sprint(i)}).status)
	}
	first := e.do("GET", "/api/v1/devices/dev-1/commands?limit=2", tok, nil)
	require.Equal(t, 200, first.status, "%s", first.body)
	empty := e.do("GET", "/api/v1/devices/dev-1/commands?limit=2&cursor=", tok, nil)
	require.Equal(t, 200, empty.status, "%s", empty.body)
	assert.JSONEq(t, string(first.body), string(empty.body))
	assert.NotNil(t, empty.json(t)["next_cursor"])
}

func TestPathIDs(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	cmdPath := "/api/v1/devices/dev-1/commands/"
	for _, tc := range []struct {
		method, path, code string
	}{
		{"GET", "/api/v1/devices/bad%20id/status", CodeDeviceNotFound},
		{"GET", "/api/v1/devices/" + strings.Repeat("d", 65) + "/status", CodeDeviceNotFound},
		{"GET", "/api/v1/devices/dev%2A1/status", CodeDeviceNotFound},
		{"POST", "/api/v1/devices/d%C3%A9v/push/text", CodeDeviceNotFound},
		{"GET", "/api/v1/devices/dev-2/status", CodeDeviceNotFound},
		{"GET", cmdPath + "not-a-uuid", CodeCommandNotFound},
		{"GET", cmdPath + "0195f3c4-0000-7000-8000-00000000000", CodeCommandNotFound},
		{"GET", cmdPath + "0195f3c4-0000-7000-8000-000000000000", CodeCommandNotFound},
		{"DELETE", cmdPath + "zzz", CodeCommandNotFound},
		{"DELETE", "/api/v1/devices/dev-1/apps/UPPER", CodeAppNotFound},
		{"PUT", "/api/v1/devices/dev-1/apps/a%20b/update", CodeAppNotFound},
		{"GET", "/api/v1/nowhere", CodeNotFound},
		// A trailing slash names no resource: a problem, not a redirect
		// in plain HTML that a POST client would follow or drop.
		{"GET", "/api/v1/devices/", CodeNotFound},
		{"GET", "/api/v1/devices/dev-1/status/", CodeNotFound},
		{"POST", "/api/v1/devices/dev-1/push/text/", CodeNotFound},
		{"DELETE", "/api/v1/devices/dev-1/", CodeNotFound},
	} {
		r := e.do(tc.method, tc.path, tok, nil)
		require.Equal(t, 404, r.status, "%s %s = %d %s", tc.method, tc.path, r.status, r.body)
		assert.Equal(t, tc.code, r.problem(t).Code, "%s %s", tc.method, tc.path)
	}
	r := e.do("PATCH", "/api/v1/devices/dev-1/settings", tok, nil)
	assert.Equal(t, 405, r.status)
	assert.Equal(t, CodeMethodNotAllowed, r.problem(t).Code)
}

// TestNoRouteAnswers5xxOnGarbage throws odd bodies at every JSON route: none may answer 5xx.
func TestNoRouteAnswers5xxOnGarbage(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	routes := []struct{ method, path string }{
		{"POST", "/api/v1/devices/register"},
		{"POST", "/api/v1/devices/dev-1/push/text"},
		{"POST", "/api/v1/devices/dev-1/push/image"},
		{"POST", "/api/v1/devices/dev-1/apps/install"},
		{"PUT", "/api/v1/devices/dev-1/apps/x/update"},
		{"PUT", "/api/v1/devices/dev-1/settings"},
		{"POST", "/api/v1/devices/dev-1/ota/update"},
	}
	bodies := []string{
		``, ` `, `{`, `}`, `{"a":`, `[]`, `[1,2]`, `1`, `-0`, `true`, `null`, `"\u0000"`, `{"":""}`,
		`{"text":{"a":[1,{"b":null}]}}`, `{"image":"` + strings.Repeat("/", 100) + `"}`,
		`{"ttl_seconds":1e400}`, `{"version":"\ud800"}`, `{"app_id":"` + strings.Repeat("a", 5000) + `"}`,
		"{\"device_id\":\"\xff\",\"claim_code\":\"\x00\"}", `{"brightness":[]}`, `{"a":1,"a":2}`,
		`{"image":"iVBORw0KGgo="}`, `{"image":"/9j/4AAQSkZJRg=="}`, `{"image":"R0lGODlhAQABAAAAACw="}`,
	}
	for _, rt := range routes {
		for _, b := range bodies {
			r := e.do(rt.method, rt.path, tok, b)
			require.Less(t, r.status, 500, "%s %s %q = %d %s", rt.method, rt.path, b, r.status, r.body)
			if r.status >= 400 {
				r.problem(t)
			}
		}
	}
}

// topicsApp is an installed app as a status reports it.
func topicsApp(id, version string) companion.App { return companion.App{AppID: id, Version: version} }

// A pushed image is what api/openapi.json says it is, and nothing more:
// standard base64 without line breaks (encoding/base64 skips them), and a
// content_type spelled as one of the two values the document lists.
func TestPushImageAsDocumented(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	img := b64(pngOf(t, 8, 4))
	runBodyCases(t, e, "POST", "/api/v1/devices/dev-1/push/image", tok, []bodyCase{
		{"base64 wrapped with LF", map[string]any{"image": img[:20] + "\n" + img[20:]}, 422, []string{"image"}},
		{"base64 wrapped with CRLF", map[string]any{"image": img[:20] + "\r\n" + img[20:]}, 422, []string{"image"}},
		{"base64 ending in a newline", map[string]any{"image": img + "\n"}, 422, []string{"image"}},
		{"content type in capitals", map[string]any{"image": img, "content_type": "IMAGE/PNG"}, 422, []string{"content_type"}},
		{"content type with a parameter", map[string]any{"image": img, "content_type": "image/png; q=1"}, 422, []string{"content_type"}},
		{"content type with a space", map[string]any{"image": img, "content_type": "image/png "}, 422, []string{"content_type"}},
	})
	assert.Zero(t, e.cmds.count(), "nothing was sent")
}

// An image at its limit passes however its JSON is written: Android's
// org.json (JSONObject.toString) and PHP's json_encode write each "/" of
// the base64 as "\/", two bytes, and the base64 of an image padded with
// 0xff (or an uncompressed white PNG) is nearly all "/". One byte over the
// limit is a 422 naming image, not a 413. (docs/reliability.md, bug 261)
func TestPushImageWithEscapedSlashesAtItsLimit(t *testing.T) {
	escaped := func(img []byte) []byte {
		return []byte(`{"image":"` + strings.ReplaceAll(b64(img), "/", `\/`) + `"}`)
	}
	slashes := func(t *testing.T, n int) []byte { // a PNG padded to n bytes with 0xff
		img := pngOf(t, 2, 2)
		return append(img, bytes.Repeat([]byte{0xff}, n-len(img))...)
	}
	// (A configured limit past the default's would take an image that
	// api/openapi.json, written for the default, refuses: its maxLength.)
	for _, max := range []int64{0, 1 << 20, 1000} { // the default (2 MiB), and two configured
		limit := max
		if limit == 0 {
			limit = DefaultLimits.MaxImageBytes
		}
		t.Run(strconv.FormatInt(limit, 10), func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Limits.MaxImageBytes = max })
			tok := e.bound("dev-1")
			runBodyCases(t, e, "POST", "/api/v1/devices/dev-1/push/image", tok, []bodyCase{
				{"at the limit", escaped(slashes(t, int(limit))), 202, nil},
				{"a byte over", escaped(slashes(t, int(limit)+1)), 422, []string{"image"}},
			})
		})
	}
}

// The text and title limits are bytes of UTF-8, not characters, and a
// configured limit is the one enforced: at it a text passes, a byte past
// it is a 422 naming the field.
func TestPushTextLimitsConfigured(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.MaxTextBytes, o.Limits.MaxTitleBytes = 10, 5 })
	tok := e.bound("dev-1")
	runBodyCases(t, e, "POST", "/api/v1/devices/dev-1/push/text", tok, []bodyCase{
		{"text of 10 bytes in 5 runes", map[string]any{"text": "ééééé"}, 202, nil},
		{"text of 11 bytes in 6 runes", map[string]any{"text": "éééééa"}, 422, []string{"text"}},
		{"text of 10 one-byte runes", map[string]any{"text": "aaaaaaaaaa"}, 202, nil},
		{"text of 11 one-byte runes", map[string]any{"text": "aaaaaaaaaaa"}, 422, []string{"text"}},
		{"title of 5 bytes in 3 runes", map[string]any{"text": "x", "title": "ab€"}, 202, nil},
		{"title of 6 bytes in 4 runes", map[string]any{"text": "x", "title": "abc€"}, 422, []string{"title"}},
	})
}

// An image's pixel size is read from its header, before the rest of it is
// looked at: a PNG or JPEG that is only a header saying 4097×1 is refused
// for its size (with it in the message), not for being cut short. A
// configured side is the one enforced.
func TestImageSideCheckedFromTheHeader(t *testing.T) {
	// A JPEG's header, up to its scan's data: image/jpeg reads a JPEG
	// without a JFIF segment (as its encoder writes them) up to its SOS
	// for its colour model.
	jpegHeader := func(t *testing.T, w, h int) []byte {
		b := jpegOf(t, w, h)
		i := bytes.Index(b, []byte{0xff, 0xda})
		require.Positive(t, i, "no SOS in the JPEG")
		return b[:i+2+(int(b[i+2])<<8|int(b[i+3]))]
	}
	for _, tc := range []struct {
		side, max int // max: the configured side; 0 the default
	}{{4096, 0}, {100, 100}} {
		t.Run(strconv.Itoa(tc.side), func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Limits.MaxImageSide = tc.max })
			tok := e.bound("dev-1")
			over := uint32(tc.side + 1)
			runBodyCases(t, e, "POST", "/api/v1/devices/dev-1/push/image", tok, []bodyCase{
				{"png at the side", map[string]any{"image": b64(pngOf(t, tc.side, 1))}, 202, nil},
				{"png a pixel over, wide", map[string]any{"image": b64(pngOf(t, tc.side+1, 1))}, 422, []string{"image"}},
				{"jpeg at the side", map[string]any{"image": b64(jpegOf(t, 1, tc.side))}, 202, nil},
			})
			for _, img := range []struct {
				name string
				data []byte
				size string
			}{
				{"png header wide", pngHeaderOnly(over, 1), fmt.Sprintf("%d×1", over)},
				{"png header high", pngHeaderOnly(1, over), fmt.Sprintf("1×%d", over)},
				{"jpeg header wide", jpegHeader(t, int(over), 1), fmt.Sprintf("%d×1", over)},
			} {
				r := e.do("POST", "/api/v1/devices/dev-1/push/image", tok, map[string]any{"image": b64(img.data)})
				require.Equal(t, 422, r.status, "%s: %s", img.name, r.body)
				p := r.problem(t)
				require.Len(t, p.Errors, 1, "%s: %s", img.name, r.body)
				want := fmt.Sprintf("must be at most %d×%d pixels (it is %s)", tc.side, tc.side, img.size)
				assert.Equal(t, want, p.Errors[0].Message, img.name)
			}
		})
	}
}

// A body with several members of the wrong JSON type names each of them
// (in the order of their names), not only the first encoding/json meets;
// members of the right type, a number out of range and unknown members
// are not named.
func TestEveryWrongTypeIsNamed(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for _, tc := range []struct {
		method, path, body string
		errors             []FieldError
	}{
		{"POST", "/api/v1/devices/dev-1/push/text", `{"title":[],"text":5,"ttl_seconds":"60"}`, []FieldError{
			{Field: "text", Message: "must be a string"},
			{Field: "title", Message: "must be a string"},
			{Field: "ttl_seconds", Message: "must be a number"},
		}},
		{"POST", "/api/v1/devices/dev-1/push/text", `{"text":5,"title":"ok","ttl_seconds":1e400,"TITLE":3,"other":{}}`, []FieldError{
			{Field: "text", Message: "must be a string"},
		}},
		{"POST", "/api/v1/devices/dev-1/apps/install", `{"app_id":true,"version":7}`, []FieldError{
			{Field: "app_id", Message: "must be a string"},
			{Field: "version", Message: "must be a string"},
		}},
		{"POST", "/api/v1/admin/devices", `{"device_id":1,"claim_code":{},"model":"sim-1","bridge_id":[]}`, []FieldError{
			{Field: "bridge_id", Message: "must be a string"},
			{Field: "claim_code", Message: "must be a string"},
			{Field: "device_id", Message: "must be a string"},
		}},
	} {
		token := tok
		if strings.Contains(tc.path, "/admin/") {
			token = testAdminToken
		}
		r := e.do(tc.method, tc.path, token, tc.body)
		require.Equal(t, 400, r.status, "%s %s %s: %s", tc.method, tc.path, tc.body, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeMalformedJSON, p.Code, tc.body)
		assert.Equal(t, tc.errors, p.Errors, "%s", tc.body)
	}
}

// Every route's path answers a method it does not take with a 405
// method_not_allowed problem and an Allow header that lists exactly the
// methods it takes (RFC 9110 §15.5.6), OPTIONS included, before any
// token is asked for.
func TestWrongMethodIs405WithAllow(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	sample := strings.NewReplacer(":id", "dev-1", ":device_id", "dev-1", ":app_id", "clock", ":command_id",
		"0193e4f2-7c4b-7d1a-9f2c-3b4e5f607182", ":bridge_id", "hub", ":model", "sim-1", ":version", "1.0.0",
		":sha256", strings.Repeat("a", 64))
	for _, route := range e.api.engine.Routes() {
		path := sample.Replace(route.Path)
		// The methods of every route that takes the path: DELETE
		// /devices/:id/apps/:app_id takes /devices/dev-1/apps/install.
		var methods []string
		for _, r := range e.api.engine.Routes() {
			if routeTakes(r.Path, path) && !slices.Contains(methods, r.Method) {
				methods = append(methods, r.Method)
			}
		}
		slices.Sort(methods)
		for _, m := range []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"} {
			if slices.Contains(methods, m) {
				continue
			}
			for _, token := range []string{tok, ""} {
				r := e.do(m, path, token, nil)
				require.Equal(t, 405, r.status, "%s %s: %s", m, path, r.body)
				var allow []string
				for a := range strings.SplitSeq(r.header.Get("Allow"), ",") {
					allow = append(allow, strings.TrimSpace(a))
				}
				slices.Sort(allow)
				assert.Equal(t, methods, allow, "%s %s: Allow", m, path)
				if m != "HEAD" {
					assert.Equal(t, CodeMethodNotAllowed, r.problem(t).Code, "%s %s", m, path)
				}
			}
		}
	}
}

// routeTakes reports whether gin's route pattern takes path: a ":name"
// segment takes any one segment.
func routeTakes(pattern, path string) bool {
	ps, segs := strings.Split(pattern, "/"), strings.Split(path, "/")
	if len(ps) != len(segs) {
		return false
	}
	for i := range ps {
		if ps[i] != segs[i] && !strings.HasPrefix(ps[i], ":") {
			return false
		}
	}
	return true
}

// TestRouteNamesAreIDsToo reads and unbinds the device register, and
// uninstalls the app install, over the real server: ids that are also a
// route's last segment (POST /devices/register, POST …/apps/install) are
// ids like any other (CONTRACT §2), and each answer is checked against
// api/openapi.json. Without the document's operations on those paths the
// check failed them: OpenAPI matches /devices/register to the register
// operation's path, which had POST alone, and the document said 405.
func TestRouteNamesAreIDsToo(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("register")
	r := e.do("GET", "/api/v1/devices/register", tok, nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	assert.Equal(t, "register", r.json(t)["device_id"])
	r = e.do("DELETE", "/api/v1/devices/register/apps/install", tok, nil)
	assert.Equal(t, http.StatusAccepted, r.status, "%s", r.body)
	assert.Equal(t, "app.uninstall", r.json(t)["op"], "%s", r.body)
	e.cmds.mu.Lock()
	assert.Contains(t, string(e.cmds.submitted[len(e.cmds.submitted)-1].Payload), `"app_id":"install"`)
	e.cmds.mu.Unlock()
	r = e.do("DELETE", "/api/v1/devices/register", tok, nil)
	assert.Equal(t, http.StatusNoContent, r.status, "%s", r.body)
	r = e.do("GET", "/api/v1/devices/register", tok, nil)
	assert.Equal(t, http.StatusNotFound, r.status, "%s", r.body)
}

// TestAPathSegmentThatIsNoIDSaysSo sends paths whose app id or model is
// none (upper case, a space) over the real server: each is the 404 of
// CONTRACT §2, and its detail says what an id is. It was "no such
// resource" on an upload, which an operator publishing Clock read as a
// missing app, and "not in the catalog" on an uninstall, which takes apps
// that are not.
func TestAPathSegmentThatIsNoIDSaysSo(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for _, tc := range []struct {
		method, path, token, code, rule string
		body                            any
	}{
		{"PUT", "/api/v1/admin/apps/Clock/1.0.0", testAdminToken, CodeNotFound, "an app id is 1 to 128 of a-z 0-9 . _ -", []byte("package")},
		{"PUT", "/api/v1/admin/firmware/sim%201/1.0.0", testAdminToken, CodeNotFound, "a model is 1 to 64 of A-Z a-z 0-9 . _ : -", []byte("image")},
		{"DELETE", "/api/v1/devices/dev-1/apps/Clock", tok, CodeAppNotFound, "an app id is 1 to 128 of a-z 0-9 . _ -", nil},
		{"PUT", "/api/v1/devices/dev-1/apps/Clock/update", tok, CodeAppNotFound, "an app id is 1 to 128 of a-z 0-9 . _ -", map[string]any{}},
	} {
		r := e.send(req{method: tc.method, path: tc.path, token: tc.token, body: tc.body})
		require.Equal(t, http.StatusNotFound, r.status, "%s %s: %s", tc.method, tc.path, r.body)
		p := r.problem(t)
		assert.Equal(t, tc.code, p.Code, "%s %s", tc.method, tc.path)
		assert.Contains(t, p.Detail, tc.rule, "%s %s", tc.method, tc.path)
	}
}

// TestFreeTextRefusesControlCharacters sends the free text the API takes
// (a push's text and title, a provisioned device's claim code; names are
// checked by checkName) with control characters: each is a 422 naming its
// field and the character, and creates nothing; a text's tabs and line
// breaks, and the emoji and marks of any script, pass. Without the fix a
// title with a NUL was pushed, and shown cut short at it by a device that
// holds it as a C string.
func TestFreeTextRefusesControlCharacters(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/text"
	n := e.cmds.count()
	runBodyCases(t, e, "POST", path, tok, []bodyCase{
		{"title with a NUL", map[string]any{"text": "x", "title": "Din\x00ner"}, 422, []string{"title"}},
		{"title with a line break", map[string]any{"text": "x", "title": "Din\nner"}, 422, []string{"title"}},
		{"title with a tab", map[string]any{"text": "x", "title": "a\tb"}, 422, []string{"title"}},
		{"title with DEL", map[string]any{"text": "x", "title": "a\x7f"}, 422, []string{"title"}},
		{"text with a NUL", map[string]any{"text": "ready\x00secret"}, 422, []string{"text"}},
		{"text with ESC", map[string]any{"text": "\x1b[2Jcleared"}, 422, []string{"text"}},
		{"text with a C1 control", map[string]any{"text": "a\u0085b"}, 422, []string{"text"}},
		{"text escaped NUL", `{"text":"a\u0000b"}`, 422, []string{"text"}},
		{"both", map[string]any{"text": "\x07", "title": "\x08"}, 422, []string{"text", "title"}},
		{"text with lines and tabs", map[string]any{"text": "one\ntwo\r\n\tthree", "title": "Home"}, 202, nil},
		{"text of emoji and marks", map[string]any{"text": "👩‍👩‍👧 שלום \u200f!", "title": "Ça va ✓"}, 202, nil},
	})
	assert.Equal(t, n+2, e.cmds.count(), "commands made: the two pushes that pass")
	r := e.do("POST", path, tok, map[string]any{"text": "ok\x00not"})
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, []FieldError{{Field: "text", Message: "must not contain control characters other than tab and line breaks: it has U+0000 at byte 2"}}, r.problem(t).Errors)

	for _, code := range []string{"ABCD-EFGH\n", "AB\x00CD"} {
		r := e.do("POST", "/api/v1/admin/devices", testAdminToken, map[string]any{"device_id": "dev-2", "claim_code": code, "model": "sim-1"})
		require.Equal(t, 422, r.status, "claim code %q: %s", code, r.body)
		assert.Equal(t, []string{"claim_code"}, r.problem(t).fields(), "claim code %q", code)
	}
	e.provision("dev-2", "ABCD-EFGH", "sim-1")
}
