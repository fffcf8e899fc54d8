package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// contract is api/openapi.json, loaded once, against which the test
// helpers check every request they send and every answer they get.
type contract struct {
	doc    *openapi3.T
	router routers.Router
}

var loadContract = sync.OnceValues(func() (*contract, error) {
	doc, err := parseOpenAPI(openapiJSON)
	if err != nil {
		return nil, err
	}
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		return nil, fmt.Errorf("routing api/openapi.json: %w", err)
	}
	return &contract{doc: doc, router: router}, nil
})

// parseOpenAPI loads an OpenAPI 3.1 document and checks it: its structure,
// its schemas, and every example against its schema.
func parseOpenAPI(b []byte) (*openapi3.T, error) {
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(b)
	if err != nil {
		return nil, fmt.Errorf("loading the OpenAPI document: %w", err)
	}
	if !doc.IsOpenAPI31OrLater() || !strings.HasPrefix(doc.OpenAPI, "3.1.") {
		return nil, fmt.Errorf("the OpenAPI document is version %q, not 3.1", doc.OpenAPI)
	}
	if err := doc.Validate(loader.Context, openapi3.EnableExamplesValidation()); err != nil {
		return nil, fmt.Errorf("the OpenAPI document is not valid: %w", err)
	}
	return doc, nil
}

func mustContract(tb testing.TB) *contract {
	tb.Helper()
	c, err := loadContract()
	require.NoError(tb, err)
	return c
}

// hasBearer stands in for the server's authentication in the document's
// eyes: a request satisfies a bearer scheme when it carries a bearer
// token at all. Whether the token is the right one is the server's to say.
func hasBearer(_ context.Context, in *openapi3filter.AuthenticationInput) error {
	if tokenOf(in.RequestValidationInput.Request) == "" {
		return in.NewError(errors.New("no bearer token"))
	}
	return nil
}

func tokenOf(r *http.Request) string {
	scheme, tok, _ := strings.Cut(r.Header.Get("Authorization"), " ")
	if !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(tok)
}

// check reports on tb every way in which a request and its answer
// disagree with the document:
//   - a request the document refuses must be refused (4xx; 401 when it
//     lacks the bearer token the operation needs);
//   - a request outside the document's operations must be a 404 not_found
//     or 405 method_not_allowed problem;
//   - every answer must be one the operation documents: status, headers,
//     content type and body;
//   - a problem's type and status must follow from its code (errors.go);
//   - a whole blob must hash to the name it was asked for.
func (c *contract) check(tb testing.TB, r *http.Request, body []byte, got resp) {
	tb.Helper()
	where := fmt.Sprintf("%s %s → %d", r.Method, r.URL.RequestURI(), got.status)
	shown := got.body
	if len(shown) > 600 {
		shown = append(shown[:600:600], "…"...)
	}

	vr := r.Clone(context.Background())
	vr.Body = io.NopCloser(bytes.NewReader(body))
	vr.ContentLength = int64(len(body))
	route, params, err := c.router.FindRoute(vr)
	if err != nil {
		want, code := http.StatusNotFound, CodeNotFound
		if errors.Is(err, routers.ErrMethodNotAllowed) {
			want, code = http.StatusMethodNotAllowed, CodeMethodNotAllowed
		}
		if got.status != want {
			tb.Errorf("openapi: %s: the document has no such operation (%v), so the answer should be %d %s; body: %s", where, err, want, code, shown)
			return
		}
		if r.Method != http.MethodHead {
			c.checkProblem(tb, where, got, code)
		}
		return
	}

	in := &openapi3filter.RequestValidationInput{
		Request:    vr,
		PathParams: params,
		Route:      route,
		Options: &openapi3filter.Options{
			AuthenticationFunc:                hasBearer,
			RejectWhenRequestBodyNotSpecified: true,
		},
	}
	reqErr := openapi3filter.ValidateRequest(context.Background(), in)
	var sec *openapi3filter.SecurityRequirementsError
	switch {
	case errors.As(reqErr, &sec) && got.status != http.StatusUnauthorized:
		tb.Errorf("openapi: %s: the request lacks the bearer token the document asks for, so the answer should be 401; body: %s", where, shown)
	case reqErr != nil && got.status/100 != 4:
		tb.Errorf("openapi: %s: the document refuses this request, yet the server took it (fix api/openapi.json, or the handler if it is wrong against the contract): %v", where, reqErr)
	}

	// HEAD answers carry a GET's headers without its body; the library
	// skips them, so they are checked here as bodiless GETs of the HEAD
	// operation.
	rin := in
	opts := &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true}
	if r.Method == http.MethodHead {
		asGet := *in
		asGet.Request = vr.Clone(context.Background())
		asGet.Request.Method = http.MethodGet
		rin = &asGet
		opts.ExcludeResponseBody = true
	}
	out := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: rin,
		Status:                 got.status,
		Header:                 got.header,
		Options:                opts,
	}
	out.SetBodyBytes(got.body)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		tb.Errorf("openapi: %s: the answer is not one api/openapi.json documents: %v\nbody: %s", where, err, shown)
	}

	if mt, _, _ := mime.ParseMediaType(got.header.Get("Content-Type")); mt == "application/problem+json" && r.Method != http.MethodHead {
		c.checkProblem(tb, where, got, "")
	}
	if route.Operation.OperationID == "getBlob" && got.status == http.StatusOK {
		sum := sha256.Sum256(got.body)
		if hex.EncodeToString(sum[:]) != params["sha256"] {
			tb.Errorf("openapi: %s: the blob's content does not hash to its name", where)
		}
	}
}

// checkProblem checks a problem's type and status against its code's row
// of errors.go, and, when want is set, the code.
func (c *contract) checkProblem(tb testing.TB, where string, got resp, want string) {
	tb.Helper()
	var p problem
	if err := json.Unmarshal(got.body, &p); err != nil {
		tb.Errorf("openapi: %s: the problem is not JSON: %v", where, err)
		return
	}
	info, ok := codes[p.Code]
	switch {
	case want != "" && p.Code != want:
		tb.Errorf("openapi: %s: problem code %q; want %q", where, p.Code, want)
	case !ok:
		tb.Errorf("openapi: %s: problem code %q is not in errors.go's table", where, p.Code)
	case p.Status != got.status || info.status != got.status:
		tb.Errorf("openapi: %s: problem %q says status %d, its row says %d", where, p.Code, p.Status, info.status)
	case p.Type != "urn:companion:problem:"+p.Code:
		tb.Errorf("openapi: %s: problem type %q does not name its code %q", where, p.Type, p.Code)
	}
}

func TestOpenAPIDocumentIsValid31(t *testing.T) {
	c := mustContract(t)
	assert.Equal(t, "3.1.0", c.doc.OpenAPI)
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
	for path, item := range c.doc.Paths.Map() {
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
		assert.Contains(t, served, op, "operation %s is in api/openapi.json but not served", op)
	}
}

// TestOpenAPIProblemCodes checks the document's problem codes against
// errors.go: the enum holds every code of the table, and each answer
// names only codes whose status is the answer's.
func TestOpenAPIProblemCodes(t *testing.T) {
	c := mustContract(t)
	var enum []string
	for _, v := range c.doc.Components.Schemas["ProblemCode"].Value.Enum {
		enum = append(enum, v.(string))
	}
	var table []string
	for code := range codes {
		table = append(table, code)
	}
	assert.ElementsMatch(t, table, enum, "components.schemas.ProblemCode against the codes of errors.go")

	for path, item := range c.doc.Paths.Map() {
		for method, op := range item.Operations() {
			for status, ref := range op.Responses.Map() {
				mt := ref.Value.Content.Get("application/problem+json")
				if mt == nil {
					continue
				}
				n, err := strconv.Atoi(status)
				require.NoError(t, err, "%s %s: status %q", method, path, status)
				named := problemCodes(mt.Schema.Value)
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
}

// problemCodes returns the codes a problem schema narrows "code" to.
func problemCodes(s *openapi3.Schema) []string {
	var out []string
	for _, sub := range s.AllOf {
		if sub.Ref != "" {
			continue // the Problem schema itself, which allows every code
		}
		if p := sub.Value.Properties["code"]; p != nil {
			for _, v := range p.Value.Enum {
				out = append(out, v.(string))
			}
		}
	}
	return out
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
	doc, err := parseOpenAPI(b)
	require.NoError(t, err)
	assert.Equal(t, "3.1.0", doc.OpenAPI)
	assert.NotNil(t, doc.Paths.Find("/api/v1/devices/{id}/commands/{command_id}"))

	// And through the helpers, which check the answer against the document.
	assert.Equal(t, http.StatusOK, e.do("GET", "/api/v1/openapi.json", "", nil).status)
}

// TestOpenAPICatchesDrift shows the helpers' check failing on answers and
// requests that disagree with the document.
func TestOpenAPICatchesDrift(t *testing.T) {
	c := mustContract(t)
	get := func(path, token string) *http.Request {
		r := httptest.NewRequest("GET", "http://127.0.0.1"+path, nil)
		if token != "" {
			r.Header.Set("Authorization", "Bearer "+token)
		}
		return r
	}
	head := func(path string) *http.Request {
		r := get(path, "t")
		r.Method = http.MethodHead
		return r
	}
	jsonResp := func(status int, body string) resp {
		return resp{status: status, header: http.Header{"Content-Type": {"application/json; charset=utf-8"}}, body: []byte(body)}
	}
	for _, tc := range []struct {
		name string
		req  *http.Request
		resp resp
		want string // in the error reported
	}{
		{"undocumented member", get("/api/v1/devices/d-1/apps", "t"), jsonResp(200, `{"apps": [], "extra": 1}`), "extra"},
		{"missing member", get("/api/v1/devices/d-1/ota/check", "t"), jsonResp(200, `{"current_version": null}`), "latest_version"},
		{"undocumented status", get("/api/v1/devices", "t"), jsonResp(418, `{}`), "status is not supported"},
		{"code of another status", get("/api/v1/devices/d-1", "t"), resp{status: 404,
			header: http.Header{"Content-Type": {"application/problem+json"}},
			body:   []byte(`{"type":"urn:companion:problem:app_not_found","title":"App not found","status":404,"detail":"x","code":"app_not_found","errors":[]}`)}, "app_not_found"},
		{"refused request taken", get("/api/v1/devices?limit=0", "t"), jsonResp(200, `{"devices": [], "next_cursor": null}`), "refuses this request"},
		{"no token taken", get("/api/v1/devices", ""), jsonResp(200, `{"devices": [], "next_cursor": null}`), "should be 401"},
		{"unknown path answered", get("/api/v1/nowhere", "t"), jsonResp(200, `{}`), "no such operation"},
		{"HEAD without the blob's headers", head("/api/v1/blobs/" + strings.Repeat("a", 64)), resp{status: 200, header: http.Header{}}, `header "Accept-Ranges" missing`},
		{"blob of other content", get("/api/v1/blobs/"+strings.Repeat("a", 64), "t"), resp{status: 200,
			header: http.Header{"Content-Type": {"application/octet-stream"}, "Etag": {`"` + strings.Repeat("a", 64) + `"`}, "Accept-Ranges": {"bytes"}},
			body:   []byte("not what was asked for")}, "does not hash"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &recordingTB{TB: t}
			c.check(rec, tc.req, nil, tc.resp)
			assert.Contains(t, strings.Join(rec.errors, "\n"), tc.want, "the check let it through")
		})
	}

	t.Run("agreeing", func(t *testing.T) {
		rec := &recordingTB{TB: t}
		c.check(rec, get("/api/v1/devices?limit=2", "t"), nil, jsonResp(200, `{"devices": [], "next_cursor": null}`))
		assert.Empty(t, rec.errors)
	})
}

// recordingTB keeps the errors reported to it instead of failing.
type recordingTB struct {
	testing.TB
	mu     sync.Mutex
	errors []string
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recordingTB) Helper() {}

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
		{"HEAD", map[string]string{"Range": "bytes=100-"}, http.StatusPartialContent},
		{"GET", map[string]string{"Range": "bytes=99999-"}, http.StatusRequestedRangeNotSatisfiable},
		{"HEAD", map[string]string{"Range": "bytes=99999-"}, http.StatusRequestedRangeNotSatisfiable},
		{"GET", map[string]string{"If-None-Match": etag}, http.StatusNotModified},
		{"HEAD", map[string]string{"If-None-Match": etag}, http.StatusNotModified},
	} {
		got := e.send(req{method: tc.method, path: path, token: testAdminToken, header: tc.header})
		assert.Equal(t, tc.status, got.status, "%s %v", tc.method, tc.header)
	}
	missing := "/api/v1/blobs/" + strings.Repeat("0", 64)
	assert.Equal(t, http.StatusNotFound, e.send(req{method: "HEAD", path: missing, token: testAdminToken}).status)
	assert.Equal(t, http.StatusUnauthorized, e.send(req{method: "HEAD", path: missing}).status)
}
