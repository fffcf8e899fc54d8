package api

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/openapitest"
)

// mustContract is api/openapi.json as embedded, against which the test
// helpers check every request they send and every answer they get.
func mustContract(tb testing.TB) *openapitest.Contract {
	tb.Helper()
	c, err := openapitest.Parse(openapiJSON)
	require.NoError(tb, err)
	return c
}

func TestOpenAPIDocumentIsValid31(t *testing.T) {
	c := mustContract(t)
	assert.Equal(t, "3.1.0", c.Doc.OpenAPI)
}

// ginPath turns gin's ":name" segments into OpenAPI's "{name}".
func ginPath(p string) string {
	segs := strings.Split(p, "/")
	for i, s := range segs {
		if strings.HasPrefix(s, ":") || strings.HasPrefix(s, "*") {
			segs[i] = "{" + s[1:] + "}"
		}
	}
	return strings.Join(segs, "/")
}

// TestOpenAPIHasEveryRoute checks that the document and the router list
// the same operations.
func TestOpenAPIHasEveryRoute(t *testing.T) {
	c := mustContract(t)
	e := newEnv(t)

	var served []string
	for _, r := range e.api.engine.Routes() {
		served = append(served, r.Method+" "+ginPath(r.Path))
	}
	var documented []string
	for path, item := range c.Doc.Paths.Map() {
		for method := range item.Operations() {
			documented = append(documented, method+" "+path)
		}
	}
	sort.Strings(served)
	sort.Strings(documented)
	for _, op := range served {
		assert.Contains(t, documented, op, "route %s is served but not in api/openapi.json", op)
	}
	for _, op := range documented {
		if !slices.Contains(served, op) {
			// A path without parameters may name an operation that a
			// route with parameters serves (GET /devices/register, of
			// GET /devices/:id): see TestOpenAPIPathsTakeTheirRoutesMethods.
			method, path, _ := strings.Cut(op, " ")
			assert.True(t, slices.ContainsFunc(e.api.engine.Routes(), func(r gin.RouteInfo) bool {
				return r.Method == method && routeTakes(r.Path, path)
			}), "operation %s is in api/openapi.json but not served", op)
		}
	}
}

// TestOpenAPIPathsTakeTheirRoutesMethods checks every path of the
// document against the server's routes: each method of a route that takes
// the path must be an operation of the path. OpenAPI matches a path
// without parameters before one with them (3.1 §4.8.8.2), and gin keeps a
// tree a method: GET /devices/register is gin's GET /devices/:id, of the
// device register, and must be written on /devices/register too, or the
// document makes it a 405 that the server does not answer.
func TestOpenAPIPathsTakeTheirRoutesMethods(t *testing.T) {
	c := mustContract(t)
	e := newEnv(t)
	for path, item := range c.Doc.Paths.Map() {
		sample := path
		for _, p := range item.Parameters {
			sample = strings.ReplaceAll(sample, "{"+p.Value.Name+"}", "x-"+p.Value.Name)
		}
		for _, r := range e.api.engine.Routes() {
			if routeTakes(r.Path, sample) {
				assert.NotNil(t, item.GetOperation(r.Method), "%s %s is served (route %s) but api/openapi.json has no %s on %s", r.Method, sample, r.Path, r.Method, path)
			}
		}
	}
}

// TestOpenAPIProblemCodes checks the document's problem codes against
// errors.go: the enum holds every code of the table, each answer names
// only codes whose status is the answer's, and every code is named by some
// answer.
func TestOpenAPIProblemCodes(t *testing.T) {
	c := mustContract(t)
	var enum []string
	for _, v := range c.Doc.Components.Schemas["ProblemCode"].Value.Enum {
		enum = append(enum, v.(string))
	}
	var table []string
	for code := range codes {
		table = append(table, code)
	}
	assert.ElementsMatch(t, table, enum, "components.schemas.ProblemCode against the codes of errors.go")

	for path, item := range c.Doc.Paths.Map() {
		for method, op := range item.Operations() {
			for status, ref := range op.Responses.Map() {
				mt := ref.Value.Content.Get("application/problem+json")
				if mt == nil {
					continue
				}
				n, err := strconv.Atoi(status)
				require.NoError(t, err, "%s %s: status %q", method, path, status)
				named := openapitest.ProblemCodes(mt.Schema.Value)
				require.NotEmpty(t, named, "%s %s %s: the problem names no codes", method, path, status)
				for _, code := range named {
					info, ok := codes[code]
					if assert.True(t, ok, "%s %s %s: code %q is not in errors.go", method, path, status, code) {
						assert.Equal(t, n, info.status, "%s %s %s: code %q", method, path, status, code)
					}
				}
			}
		}
	}
	// openapitest checks a problem's status against the answers that name
	// its code: each code must be named by some, so that check is this
	// table's.
	for code, info := range codes {
		if code == CodeMethodNotAllowed {
			continue // answered only outside the document's operations
		}
		n, ok := c.CodeStatus(code)
		if assert.True(t, ok, "code %q is named by no answer of api/openapi.json", code) {
			assert.Equal(t, info.status, n, "code %q", code)
		}
	}
}

// TestOpenAPIServed fetches the document over a real HTTP server without
// a token and loads it as OpenAPI 3.1.
func TestOpenAPIServed(t *testing.T) {
	e := newEnv(t)
	res, err := http.Get(e.srv.URL + "/api/v1/openapi.json")
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode, "%s", b)
	mt, _, err := mime.ParseMediaType(res.Header.Get("Content-Type"))
	require.NoError(t, err)
	assert.Equal(t, "application/json", mt)
	served, err := openapitest.Parse(b)
	require.NoError(t, err)
	assert.Equal(t, "3.1.0", served.Doc.OpenAPI)
	assert.NotNil(t, served.Doc.Paths.Find("/api/v1/devices/{id}/commands/{command_id}"))

	// And through the helpers, which check the answer against the document.
	assert.Equal(t, http.StatusOK, e.do("GET", "/api/v1/openapi.json", "", nil).status)
}

// TestOpenAPIBlobAnswers sends the blob route's binary answers through the
// helpers, HEAD and conditional requests included, so that the document's
// account of them is checked too.
func TestOpenAPIBlobAnswers(t *testing.T) {
	e := newEnv(t)
	content := bytes.Repeat([]byte("package "), 300)
	r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/weather/1.0.0", token: testAdminToken, body: content,
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	sum := sha256.Sum256(content)
	path := "/api/v1/blobs/" + hex.EncodeToString(sum[:])
	etag := `"` + hex.EncodeToString(sum[:]) + `"`

	for _, tc := range []struct {
		method string
		header map[string]string
		status int
	}{
		{"GET", nil, http.StatusOK},
		{"HEAD", nil, http.StatusOK},
		{"GET", map[string]string{"Range": "bytes=100-199"}, http.StatusPartialContent},
		{"GET", map[string]string{"Range": "bytes=0-9,100-109"}, http.StatusPartialContent},
		{"HEAD", map[string]string{"Range": "bytes=100-"}, http.StatusPartialContent},
		{"GET", map[string]string{"Range": "bytes=99999-"}, http.StatusRequestedRangeNotSatisfiable},
		{"HEAD", map[string]string{"Range": "bytes=99999-"}, http.StatusRequestedRangeNotSatisfiable},
		{"GET", map[string]string{"If-None-Match": etag}, http.StatusNotModified},
		{"HEAD", map[string]string{"If-None-Match": etag}, http.StatusNotModified},
	} {
		got := e.send(req{method: tc.method, path: path, token: testAdminToken, header: tc.header})
		assert.Equal(t, tc.status, got.status, "%s %v", tc.method, tc.header)
		if tc.status == http.StatusPartialContent && tc.method == "GET" {
			mt, _, _ := mime.ParseMediaType(got.header.Get("Content-Type"))
			if strings.Contains(tc.header["Range"], ",") {
				assert.Equal(t, "multipart/byteranges", mt)
			} else {
				assert.Equal(t, "application/octet-stream", mt)
				assert.Equal(t, "bytes 100-199/2400", got.header.Get("Content-Range"))
			}
		}
		if tc.status == http.StatusRequestedRangeNotSatisfiable {
			assert.Equal(t, fmt.Sprintf("bytes */%d", len(content)), got.header.Get("Content-Range"), "%s %v", tc.method, tc.header)
			if tc.method == "GET" {
				assert.Equal(t, CodeRangeNotSatisfiable, got.problem(t).Code)
			}
		}
	}
	missing := "/api/v1/blobs/" + strings.Repeat("0", 64)
	assert.Equal(t, http.StatusNotFound, e.send(req{method: "HEAD", path: missing, token: testAdminToken}).status)
	assert.Equal(t, http.StatusUnauthorized, e.send(req{method: "HEAD", path: missing}).status)
}

// TestOpenAPIPreferOnEveryCommandAnswer checks that every operation that
// answers a command, 200 or 202, lists the Prefer parameter and says
// Preference-Applied on its 200, as the server answers each (the cancel
// said neither).
func TestOpenAPIPreferOnEveryCommandAnswer(t *testing.T) {
	c := mustContract(t)
	isCommand := func(r *openapi3.ResponseRef) bool {
		if r == nil || r.Value == nil {
			return false
		}
		mt := r.Value.Content.Get("application/json")
		return mt != nil && mt.Schema != nil && mt.Schema.Ref == "#/components/schemas/Command"
	}
	n := 0
	for path, item := range c.Doc.Paths.Map() {
		for method, op := range item.Operations() {
			ok200 := isCommand(op.Responses.Status(200))
			if !ok200 && !isCommand(op.Responses.Status(202)) {
				continue
			}
			n++
			assert.True(t, slices.ContainsFunc(op.Parameters, func(p *openapi3.ParameterRef) bool {
				return p.Value != nil && p.Value.Name == "Prefer"
			}), "%s %s answers a command without listing Prefer", method, path)
			if ok200 {
				assert.Contains(t, op.Responses.Status(200).Value.Headers, "Preference-Applied", "%s %s: its 200", method, path)
			}
		}
	}
	assert.GreaterOrEqual(t, n, 10, "operations that answer a command")
}

// A server whose limits are configured serves api/openapi.json with them:
// a client generated from the document (and a test that checks traffic
// against it) takes what this server takes. It served the defaults: with
// --max-text-bytes 8192 the document refused a text of 5000 bytes that the
// server took (docs/reliability.md, bug 262). At the defaults the document
// served is the file as it is.
func TestOpenAPIServedWithTheLimits(t *testing.T) {
	assert.Equal(t, string(openapiJSON), string(servedOpenAPI(t, newEnv(t, func(o *Options) { o.Limits = Limits{} }))), "at the default limits")

	e := newEnv(t, func(o *Options) {
		o.Limits = Limits{MaxTextBytes: 8192, MaxTitleBytes: 200, MaxImageBytes: 3 << 20, MaxImageSide: 5000,
			MaxAppBytes: 1000, MaxFirmwareBytes: 5 << 20, RegisterPerMinute: 20, RequestsPerSecond: -1, UnauthPerMinute: -1}
	})
	b := servedOpenAPI(t, e)
	doc, err := openapitest.Parse(b)
	require.NoError(t, err, "the document served")
	schema := func(name, prop string) *openapi3.Schema {
		s := doc.Doc.Components.Schemas[name].Value.Properties[prop].Value
		require.NotNil(t, s, "%s.%s", name, prop)
		return s
	}
	assert.EqualValues(t, 8192, *schema("PushTextRequest", "text").MaxLength)
	assert.EqualValues(t, 200, *schema("PushTextRequest", "title").MaxLength)
	assert.EqualValues(t, (3<<20+2)/3*4, *schema("PushImageRequest", "image").MaxLength)
	for _, says := range []string{"At most 8192 bytes of UTF-8", "At most 200 bytes of UTF-8", "at most 5000×5000 pixels, at most 3 MiB decoded",
		"at most 3 MiB decoded and 5000×5000 pixels", "At most 1000 bytes.", "At most 5 MiB.", "20 attempts a minute per user."} {
		assert.Contains(t, string(b), says)
	}
	for _, stale := range []string{"4096×", "4096 bytes", `"maxLength": 4096`, "At most 128 bytes", "2 MiB", "16 MiB", "64 MiB", "10 attempts", "2796204"} {
		assert.NotContains(t, string(b), stale, "a default left in the document served")
	}

	// A request the server takes is one the document it serves takes.
	tok := e.bound("dev-1")
	body := []byte(`{"text":"` + strings.Repeat("a", 5000) + `"}`)
	hr, err := http.NewRequest("POST", e.srv.URL+"/api/v1/devices/dev-1/push/text", bytes.NewReader(body))
	require.NoError(t, err)
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("Authorization", "Bearer "+tok)
	res, err := e.srv.Client().Do(hr)
	require.NoError(t, err)
	answer, err := io.ReadAll(res.Body)
	res.Body.Close()
	require.NoError(t, err)
	require.Equal(t, 202, res.StatusCode, "%s", answer)
	doc.Check(t, hr, body, openapitest.Answer{Status: res.StatusCode, Header: res.Header, Body: answer})
}

// The bounds of a user's held requests, event streams and a device's
// unfinished commands the served document states are the server's
// (--max-waits-per-user, --max-streams-per-user, --max-open-commands), or
// say there is none: it said 100, 32 and 1000 whatever they were
// (docs/reliability.md, bug 264).
func TestOpenAPIServedWithTheHoldLimits(t *testing.T) {
	for _, tc := range []struct {
		name          string
		limits        Limits
		says, defunct []string
	}{
		{"configured", Limits{MaxWaitsPerUser: 7, MaxStreamsPerUser: 9, MaxOpenCommands: 500},
			[]string{"A caller may have 7 requests held so at once (`--max-waits-per-user`)", "A caller may have 9 streams open at once on a server (`--max-streams-per-user`)",
				"too many unfinished commands (500)"},
			[]string{"100 requests held", "32 streams open", "(1000)"}},
		{"no limit", Limits{MaxWaitsPerUser: -1, MaxStreamsPerUser: -1},
			[]string{"The requests a caller may have held so at once are not limited on this server (`--max-waits-per-user` 0).",
				"The streams a caller may have open at once are not limited on this server (`--max-streams-per-user` 0)."},
			[]string{"100 requests held", "32 streams open", "too_many_waits` with", "too_many_streams` with"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Limits = tc.limits })
			b := servedOpenAPI(t, e)
			_, err := openapitest.Parse(b)
			require.NoError(t, err, "the document served")
			for _, says := range tc.says {
				assert.True(t, strings.Contains(string(b), says), "the document served does not say %q", says)
			}
			for _, stale := range tc.defunct {
				assert.False(t, strings.Contains(string(b), stale), "the document served says %q: a default left in it", stale)
			}
		})
	}
}

// servedOpenAPI fetches the document e's server serves, without a token.
func servedOpenAPI(t *testing.T, e *env) []byte {
	t.Helper()
	res, err := http.Get(e.srv.URL + "/api/v1/openapi.json")
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode, "%s", b)
	return b
}
