package main

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOpenAPIDocumentServed fetches GET /api/v1/openapi.json from the real
// server without a token and loads it as a valid OpenAPI 3.1 document
// (CONTRACT §12).
func TestOpenAPIDocumentServed(t *testing.T) {
	m := startServer(t, Config{})
	res, err := httpClientFor(m).Get(m.APIURL() + "/api/v1/openapi.json")
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode, "%s", b)
	assert.True(t, strings.HasPrefix(res.Header.Get("Content-Type"), "application/json"), "Content-Type %q", res.Header.Get("Content-Type"))

	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(b)
	require.NoError(t, err)
	require.True(t, doc.IsOpenAPI31OrLater(), "openapi %q", doc.OpenAPI)
	assert.True(t, strings.HasPrefix(doc.OpenAPI, "3.1."), "openapi %q", doc.OpenAPI)
	require.NoError(t, doc.Validate(loader.Context, openapi3.EnableExamplesValidation()))
	for _, p := range []string{"/api/v1/devices/register", "/api/v1/devices/{id}/commands/{command_id}", "/api/v1/blobs/{sha256}", "/api/v1/openapi.json"} {
		assert.NotNil(t, doc.Paths.Find(p), "path %s", p)
	}
}
