// Package openapitest checks HTTP traffic against api/openapi.json, the
// OpenAPI 3.1 document of CONTRACT §2 and §12, with kin-openapi: every
// request a test sends and every answer it gets, so that the document
// cannot drift from the server unnoticed.
//
// Tests use it in one of two ways: a helper that has read an answer whole
// calls [Contract.Check], and a test that talks to a real server through an
// *http.Client wraps the client's transport with [Transport]. It is for
// tests only; nothing outside _test.go files should import it. It knows the
// conventions of this project's document (bearer tokens, problem codes named
// by the answers that can hold them, blobs named by their SHA-256), so it is
// not a general OpenAPI test kit.
package openapitest

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
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"

	"github.com/devicecompanion/companion/internal/testenv"
)

// Path is where the document lives, relative to the repository's root.
// Package api embeds the same file and serves it.
const Path = "api/openapi.json"

// problemType is what a problem's type is: this prefix and its code.
const problemType = "urn:companion:problem:"

// The codes of the answers to requests outside the document's operations.
const (
	codeNotFound         = "not_found"
	codeMethodNotAllowed = "method_not_allowed"
)

// Contract is a loaded document, against which requests and answers are
// checked. It is safe for concurrent use.
type Contract struct {
	// Doc is the document, validated.
	Doc *openapi3.T

	router routers.Router
	codes  map[string]int // problem code → the status of every answer naming it
}

// Answer is an HTTP answer with its body read whole.
type Answer struct {
	Status int
	Header http.Header
	Body   []byte
}

var parsed sync.Map // string(document) → func() (*Contract, error)

// Parse loads an OpenAPI 3.1 document and checks it: its structure, its
// schemas, and every example against its schema. It also reads from the
// document's problem answers which status each problem code goes with,
// and refuses a document that gives one code two statuses. Each document is
// parsed once per test binary.
func Parse(doc []byte) (*Contract, error) {
	once, _ := parsed.LoadOrStore(string(doc), sync.OnceValues(func() (*Contract, error) { return parse(doc) }))
	return once.(func() (*Contract, error))()
}

func parse(b []byte) (*Contract, error) {
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
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		return nil, fmt.Errorf("routing the OpenAPI document: %w", err)
	}
	codes := map[string]int{}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			for status, ref := range op.Responses.Map() {
				mt := ref.Value.Content.Get("application/problem+json")
				if mt == nil || mt.Schema == nil {
					continue
				}
				n, err := strconv.Atoi(status)
				if err != nil {
					return nil, fmt.Errorf("%s %s: a problem answer with status %q", method, path, status)
				}
				for _, code := range ProblemCodes(mt.Schema.Value) {
					if was, ok := codes[code]; ok && was != n {
						return nil, fmt.Errorf("%s %s: problem code %q is a %d here and a %d elsewhere", method, path, code, n, was)
					}
					codes[code] = n
				}
			}
		}
	}
	return &Contract{Doc: doc, router: router, codes: codes}, nil
}

// ProblemCodes returns the codes a problem answer's schema narrows "code"
// to: those of the members of its allOf other than the Problem schema
// itself, which allows every code.
func ProblemCodes(s *openapi3.Schema) []string {
	var out []string
	for _, sub := range s.AllOf {
		if sub.Ref != "" {
			continue
		}
		if p := sub.Value.Properties["code"]; p != nil {
			for _, v := range p.Value.Enum {
				if code, ok := v.(string); ok {
					out = append(out, code)
				}
			}
		}
	}
	return out
}

// Load parses the repository's api/openapi.json, failing tb if it cannot.
func Load(tb testing.TB) *Contract {
	tb.Helper()
	c, err := Parse(testenv.ReadRepoFile(tb, Path))
	if err != nil {
		tb.Fatalf("%s: %v", Path, err)
	}
	return c
}

// CodeStatus returns the status of the answers that name a problem code,
// and whether any does.
func (c *Contract) CodeStatus(code string) (int, bool) {
	n, ok := c.codes[code]
	return n, ok
}

// hasBearer stands in for the server's authentication in the document's
// eyes: a request satisfies a bearer scheme when it carries a bearer
// token at all. Whether the token is the right one is the server's to say.
func hasBearer(_ context.Context, in *openapi3filter.AuthenticationInput) error {
	scheme, tok, _ := strings.Cut(in.RequestValidationInput.Request.Header.Get("Authorization"), " ")
	if !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(tok) == "" {
		return in.NewError(errors.New("no bearer token"))
	}
	return nil
}

// Check reports on tb every way in which a request (whose body, already
// sent, is body) and its answer, read whole, disagree with the document:
//   - a request the document refuses must be refused (4xx; 401 when it
//     lacks the bearer token the operation needs);
//   - a request outside the document's operations must be a 404 not_found
//     or 405 method_not_allowed problem;
//   - every answer must be one the operation documents: status, headers,
//     content type and body;
//   - a problem's type and status must follow from its code;
//   - a whole blob must hash to the name it was asked for.
func (c *Contract) Check(tb testing.TB, r *http.Request, body []byte, a Answer) {
	tb.Helper()
	if sha := c.check(tb, r, body, a, true); sha != "" {
		if sum := sha256.Sum256(a.Body); hex.EncodeToString(sum[:]) != sha {
			tb.Errorf("openapi: %s: the blob's content does not hash to its name", where(r, a.Status))
		}
	}
}

func where(r *http.Request, status int) string {
	return fmt.Sprintf("%s %s → %d", r.Method, r.URL.RequestURI(), status)
}

// check is Check with the body's checks left out unless withBody, and the
// blob's hash left to the caller: it returns the SHA-256 a whole blob's
// content must hash to, or "" when the answer is not a whole blob.
func (c *Contract) check(tb testing.TB, r *http.Request, body []byte, a Answer, withBody bool) (blob string) {
	tb.Helper()
	where := where(r, a.Status)
	shown := a.Body
	if len(shown) > 600 {
		shown = append(shown[:600:600], "…"...)
	}
	withBody = withBody && r.Method != http.MethodHead

	vr := r.Clone(context.Background())
	vr.Body = io.NopCloser(bytes.NewReader(body))
	vr.ContentLength = int64(len(body))
	route, params, err := c.router.FindRoute(vr)
	if err != nil {
		want, code := http.StatusNotFound, codeNotFound
		if errors.Is(err, routers.ErrMethodNotAllowed) {
			want, code = http.StatusMethodNotAllowed, codeMethodNotAllowed
		}
		if a.Status != want {
			tb.Errorf("openapi: %s: the document has no such operation (%v), so the answer should be %d %s; body: %s", where, err, want, code, shown)
			return ""
		}
		if withBody {
			c.checkProblem(tb, where, a, code)
		}
		return ""
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
	case errors.As(reqErr, &sec) && a.Status != http.StatusUnauthorized:
		tb.Errorf("openapi: %s: the request lacks the bearer token the document asks for, so the answer should be 401; body: %s", where, shown)
	case reqErr != nil && a.Status/100 != 4:
		tb.Errorf("openapi: %s: the document refuses this request, yet the server took it (fix api/openapi.json, or the handler if it is wrong against the contract): %v", where, reqErr)
	}

	// HEAD answers carry a GET's headers without its body; the library
	// skips them, so they are checked here as bodiless GETs of the HEAD
	// operation.
	rin := in
	opts := &openapi3filter.Options{IncludeResponseStatus: true, MultiError: true, ExcludeResponseBody: !withBody}
	if r.Method == http.MethodHead {
		asGet := *in
		asGet.Request = vr.Clone(context.Background())
		asGet.Request.Method = http.MethodGet
		rin = &asGet
	}
	out := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: rin,
		Status:                 a.Status,
		Header:                 a.Header,
		Options:                opts,
	}
	out.SetBodyBytes(a.Body)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		tb.Errorf("openapi: %s: the answer is not one api/openapi.json documents: %v\nbody: %s", where, err, shown)
	}

	if mt, _, _ := mime.ParseMediaType(a.Header.Get("Content-Type")); mt == "application/problem+json" && withBody {
		c.checkProblem(tb, where, a, "")
	}
	if route.Operation.OperationID == "getBlob" && a.Status == http.StatusOK {
		return params["sha256"]
	}
	return ""
}

// checkProblem checks a problem's type and status against its code, and,
// when want is set, the code.
func (c *Contract) checkProblem(tb testing.TB, where string, a Answer, want string) {
	tb.Helper()
	var p struct {
		Type   string `json:"type"`
		Status int    `json:"status"`
		Code   string `json:"code"`
	}
	if err := json.Unmarshal(a.Body, &p); err != nil {
		tb.Errorf("openapi: %s: the problem is not JSON: %v", where, err)
		return
	}
	status, ok := c.codes[p.Code]
	switch {
	case want != "" && p.Code != want:
		tb.Errorf("openapi: %s: problem code %q; want %q", where, p.Code, want)
	case want == "" && !ok:
		tb.Errorf("openapi: %s: problem code %q is named by none of the document's answers", where, p.Code)
	case p.Status != a.Status || ok && status != a.Status:
		tb.Errorf("openapi: %s: problem %q says status %d, the document's answers naming it are %d", where, p.Code, p.Status, status)
	case p.Type != problemType+p.Code:
		tb.Errorf("openapi: %s: problem type %q does not name its code %q", where, p.Type, p.Code)
	}
}
