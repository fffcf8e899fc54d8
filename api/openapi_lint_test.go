package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
)

// The tests of this file check api/openapi.json for what the tools its
// readers point at it (client generators, linters, documentation
// renderers) need of it, beyond what kin-openapi's validation asks.

// oasDocURL is the name under which the document is handed to the JSON
// Schema compiler, so that its "#/components/…" references resolve.
const oasDocURL = "https://companion.invalid/api/v1/openapi.json"

// pointerEscape escapes one JSON Pointer token (RFC 6901).
func pointerEscape(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1")
}

// walkOAS calls schema for every schema of the document (those of
// components/schemas, of each "schema" member, and each within them) and
// holder for every object beside whose "schema" an example may stand: a
// media type, a parameter or a header. Neither looks into examples,
// defaults, enums or consts, which are values, not the document's own
// objects, however they look.
func walkOAS(doc map[string]any, schema func(at string, s map[string]any), holder func(at string, h map[string]any)) {
	var sch func(at string, v any)
	schemas := func(at string, v any) {
		switch v := v.(type) {
		case []any:
			for i, s := range v {
				sch(fmt.Sprintf("%s/%d", at, i), s)
			}
		case map[string]any:
			for k, s := range v {
				sch(at+"/"+pointerEscape(k), s)
			}
		}
	}
	sch = func(at string, v any) {
		m, ok := v.(map[string]any)
		if !ok {
			return
		}
		schema(at, m)
		for k, s := range m {
			switch k {
			case "properties", "patternProperties", "$defs", "dependentSchemas", "allOf", "anyOf", "oneOf", "prefixItems":
				schemas(at+"/"+k, s)
			case "items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
				"unevaluatedItems", "unevaluatedProperties", "contentSchema":
				sch(at+"/"+k, s)
			}
		}
	}
	var node func(at string, v any)
	node = func(at string, v any) {
		switch v := v.(type) {
		case []any:
			for i, e := range v {
				node(fmt.Sprintf("%s/%d", at, i), e)
			}
		case map[string]any:
			if s, ok := v["schema"]; ok {
				sch(at+"/schema", s)
				holder(at, v)
			}
			for k, e := range v {
				switch {
				case k == "schema", k == "example", k == "examples":
				case at == "/components" && k == "schemas":
					schemas(at+"/schemas", e)
				case at == "/components" && k == "examples":
					// Values; each is checked where it is used.
				default:
					node(at+"/"+pointerEscape(k), e)
				}
			}
		}
	}
	node("", doc)
}

// oasExample is one example of the document with the schema it must meet.
type oasExample struct {
	at     string // where the example is, a JSON Pointer
	schema string // where its schema is, a JSON Pointer
	value  any
}

// oasExamples returns every example the document gives, each with the
// location of the schema it illustrates: a media type's, a parameter's or a
// header's example and examples (those of components/examples through
// their $ref), and a schema's own example, examples and default.
func oasExamples(t *testing.T, doc map[string]any) []oasExample {
	t.Helper()
	named, _ := doc["components"].(map[string]any)["examples"].(map[string]any)
	var out []oasExample
	// exampleObject returns an Example Object's value, following its $ref.
	exampleObject := func(at string, v any) (any, bool) {
		m, ok := v.(map[string]any)
		if !ok {
			t.Errorf("%s: an example that is not an Example Object", at)
			return nil, false
		}
		if ref, ok := m["$ref"].(string); ok {
			name, found := strings.CutPrefix(ref, "#/components/examples/")
			target, ok := named[name].(map[string]any)
			if !found || !ok {
				t.Errorf("%s: $ref %q names no example of components/examples", at, ref)
				return nil, false
			}
			m = target
		}
		if _, ok := m["externalValue"]; ok {
			return nil, false
		}
		value, ok := m["value"]
		if !ok {
			t.Errorf("%s: an Example Object without a value", at)
		}
		return value, ok
	}
	walkOAS(doc, func(at string, m map[string]any) {
		if e, ok := m["example"]; ok {
			out = append(out, oasExample{at + "/example", at, e})
		}
		if d, ok := m["default"]; ok {
			out = append(out, oasExample{at + "/default", at, d})
		}
		if es, ok := m["examples"].([]any); ok {
			for i, e := range es {
				out = append(out, oasExample{fmt.Sprintf("%s/examples/%d", at, i), at, e})
			}
		}
	}, func(at string, h map[string]any) {
		if e, ok := h["example"]; ok {
			out = append(out, oasExample{at + "/example", at + "/schema", e})
		}
		if es, ok := h["examples"].(map[string]any); ok {
			for name, e := range es {
				eat := at + "/examples/" + pointerEscape(name)
				if value, ok := exampleObject(eat, e); ok {
					out = append(out, oasExample{eat, at + "/schema", value})
				}
			}
		}
	})
	sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
	return out
}

// TestOpenAPIExamplesMeetTheirSchemas validates every example of the
// document against its schema with a JSON Schema 2020-12 validator that
// asserts formats, as the document's dialect is: client generators,
// documentation renderers and mock servers show or serve these examples
// as answers, and a linter (Redocly's, Spectral's) refuses one that its
// schema does not allow.
func TestOpenAPIExamplesMeetTheirSchemas(t *testing.T) {
	var doc map[string]any
	require.NoError(t, json.Unmarshal(openapiJSON, &doc))
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(openapiJSON))
	require.NoError(t, err)
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	c.AssertFormat()
	require.NoError(t, c.AddResource(oasDocURL, inst))

	examples := oasExamples(t, doc)
	require.NotEmpty(t, examples)
	for _, ex := range examples {
		s, err := c.Compile(oasDocURL + "#" + ex.schema)
		if !assert.NoError(t, err, "%s: its schema %s", ex.at, ex.schema) {
			continue
		}
		// Through JSON again, so that numbers are what the validator reads.
		b, err := json.Marshal(ex.value)
		require.NoError(t, err)
		v, err := jsonschema.UnmarshalJSON(bytes.NewReader(b))
		require.NoError(t, err)
		assert.NoError(t, s.Validate(v), "%s does not meet its schema %s", ex.at, ex.schema)
	}
}

// TestOpenAPIComponentNamesDistinct checks that no two components of
// different kinds share a name unless one is the other's schema: client
// generators make one type of each schema, parameter, header, request body
// and response, all in one namespace, and oapi-codegen stops at the first
// name it would declare twice ("duplicate typename 'Cursor' detected").
// A parameter named as a schema is let be when its schema is that schema:
// the generators then use the schema's type.
func TestOpenAPIComponentNamesDistinct(t *testing.T) {
	var doc struct {
		Components map[string]map[string]json.RawMessage `json:"components"`
	}
	require.NoError(t, json.Unmarshal(openapiJSON, &doc))
	kinds := []string{"parameters", "headers", "requestBodies", "responses"}
	seen := map[string]string{} // name → its kind, among kinds
	for _, kind := range kinds {
		for name, raw := range doc.Components[kind] {
			if was, ok := seen[name]; ok {
				t.Errorf("components.%s.%s and components.%s.%s share a name", was, name, kind, name)
			}
			seen[name] = kind
			if _, ok := doc.Components["schemas"][name]; !ok {
				continue
			}
			var c struct {
				Schema struct {
					Ref string `json:"$ref"`
				} `json:"schema"`
			}
			require.NoError(t, json.Unmarshal(raw, &c))
			assert.Equal(t, "#/components/schemas/"+name, c.Schema.Ref,
				"components.%s.%s is named as components.schemas.%s but is not that schema: generated clients get two types of one name", kind, name, name)
		}
	}
}

// TestOpenAPIEnumsAndConstsTyped checks that every schema with an enum or
// a const says its type too. JSON Schema does not need it, but oapi-codegen
// makes a member without a type an interface{}: the problems' narrowing
// of status and code (an allOf of Problem and {"status": {"const": 404},
// "code": {"enum": […]}}) left a Go client's Status and Code untyped, a
// float64 and a string behind an any, where every other generator, and
// the Problem schema itself, say an integer and a code.
func TestOpenAPIEnumsAndConstsTyped(t *testing.T) {
	var doc map[string]any
	require.NoError(t, json.Unmarshal(openapiJSON, &doc))
	var untyped []string
	walkOAS(doc, func(at string, s map[string]any) {
		_, isEnum := s["enum"]
		_, isConst := s["const"]
		if _, typed := s["type"]; (isEnum || isConst) && !typed {
			untyped = append(untyped, at)
		}
	}, func(string, map[string]any) {})
	sort.Strings(untyped)
	assert.Empty(t, untyped, "schemas with an enum or a const and no type")
}

// TestOpenAPIServers checks that the document names its server. Without
// servers, OpenAPI takes "/", but Redocly's recommended rules refuse the
// document (no-empty-servers is an error), so that a reader's lint of it
// fails, and renderers and generators have no URL to show or start from.
func TestOpenAPIServers(t *testing.T) {
	c := mustContract(t)
	require.NotEmpty(t, c.Doc.Servers, "servers")
	// The paths begin with /api/v1: the server is the host's root, which
	// "/" names relative to wherever the document was fetched from.
	assert.Equal(t, "/", c.Doc.Servers[0].URL)
}

// TestOpenAPIRequiredPropertiesDefined checks that each name a schema
// requires is one of its properties (Redocly's
// no-required-schema-properties-undefined): a generator makes a field of
// each property only, so a required member it was not told the shape of is
// missing from the type it makes.
func TestOpenAPIRequiredPropertiesDefined(t *testing.T) {
	var doc map[string]any
	require.NoError(t, json.Unmarshal(openapiJSON, &doc))
	walkOAS(doc, func(at string, s map[string]any) {
		required, _ := s["required"].([]any)
		if len(required) == 0 {
			return
		}
		props, _ := s["properties"].(map[string]any)
		for _, r := range required {
			name, _ := r.(string)
			assert.Contains(t, props, name, "%s requires %q, which is not among its properties", at, name)
		}
	}, func(string, map[string]any) {})
}

// TestOpenAPIOperations checks what every client generator needs of each
// operation: an operationId, unique and a plain identifier (it names the
// generated method), and each parameter of the path template declared as a
// required path parameter, and no other path parameter.
func TestOpenAPIOperations(t *testing.T) {
	c := mustContract(t)
	ids := map[string]string{}
	ident := regexp.MustCompile(`^[a-z][A-Za-z0-9]*$`)
	for path, item := range c.Doc.Paths.Map() {
		var inTemplate []string
		for _, m := range regexp.MustCompile(`\{([^}]*)\}`).FindAllStringSubmatch(path, -1) {
			inTemplate = append(inTemplate, m[1])
		}
		sort.Strings(inTemplate)
		for method, op := range item.Operations() {
			where := method + " " + path
			if assert.Regexp(t, ident, op.OperationID, "%s: operationId", where) {
				if was, ok := ids[op.OperationID]; ok {
					t.Errorf("%s and %s share operationId %q", was, where, op.OperationID)
				}
				ids[op.OperationID] = where
			}
			declared := map[string]bool{}
			for _, ps := range []openapi3.Parameters{item.Parameters, op.Parameters} {
				for _, p := range ps {
					if p.Value.In == openapi3.ParameterInPath {
						assert.True(t, p.Value.Required, "%s: path parameter %s is not required", where, p.Value.Name)
						declared[p.Value.Name] = true
					}
				}
			}
			var names []string
			for name := range declared {
				names = append(names, name)
			}
			sort.Strings(names)
			assert.Equal(t, inTemplate, names, "%s: the path's parameters against those declared", where)
		}
	}
}

// TestOpenAPICommandErrorCodes checks that the description of a command's
// error names every failure code docs/api.md lists: it is what a client's
// generated type shows a reader of error.code, which is a string (a bridge
// may name codes of its own), so a code left out is one a client's switch
// does not handle.
func TestOpenAPICommandErrorCodes(t *testing.T) {
	c := mustContract(t)
	desc := c.Doc.Components.Schemas["Command"].Value.Properties["error"].Value.Description
	md := string(testenv.ReadRepoFile(t, "docs/api.md"))
	_, list, ok := strings.Cut(md, "A failed command's `error.code` is one of ")
	require.True(t, ok, "docs/api.md lists the failure codes")
	list, _, _ = strings.Cut(list, "[gatt.md]")
	// The codes, without what the parentheses say of them.
	var bare strings.Builder
	depth := 0
	for _, r := range list {
		switch {
		case r == '(':
			depth++
		case r == ')':
			depth--
		case depth == 0:
			bare.WriteRune(r)
		}
	}
	var codes []string
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(bare.String(), -1) {
		codes = append(codes, m[1])
	}
	require.Contains(t, codes, companion.CodeDeviceUnbound)
	require.Contains(t, codes, companion.CodeDeviceNotServed)
	named := map[string]bool{}
	for _, w := range regexp.MustCompile(`[a-z_]+`).FindAllString(desc, -1) {
		named[w] = true
	}
	for _, code := range codes {
		assert.True(t, named[code], "components.schemas.Command.properties.error does not name %q", code)
	}
}

// TestOpenAPIBlobConditionalHeaders checks that the blob operations declare
// the request headers that make their 304 and 412 answers, and If-Range,
// which a resumed download sends beside Range (RFC 9110): a generated
// client sends only the parameters it was told of (ogen's, short of a
// transport that adds them), so without them a bridge built on one could
// neither revalidate nor resume as the RFC has it.
func TestOpenAPIBlobConditionalHeaders(t *testing.T) {
	c := mustContract(t)
	item := c.Doc.Paths.Find("/api/v1/blobs/{sha256}")
	require.NotNil(t, item)
	for method, op := range map[string]*openapi3.Operation{"GET": item.Get, "HEAD": item.Head} {
		require.NotNil(t, op, method)
		for _, h := range []string{"Range", "If-Range", "If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since"} {
			p := op.Parameters.GetByInAndName(openapi3.ParameterInHeader, h)
			if p == nil {
				p = item.Parameters.GetByInAndName(openapi3.ParameterInHeader, h)
			}
			assert.NotNil(t, p, "%s /api/v1/blobs/{sha256} does not declare header %s", method, h)
		}
	}
}
