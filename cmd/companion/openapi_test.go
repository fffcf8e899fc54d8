package main

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/openapitest"
)

// TestOpenAPIDocumentServed fetches GET /api/v1/openapi.json from the real
// server without a token and loads it as a valid OpenAPI 3.1 document
// (CONTRACT §12), the one in the repository.
func TestOpenAPIDocumentServed(t *testing.T) {
	m := startServer(t, Config{})
	res, err := openapitest.Client(t, httpClientFor(m)).Get(m.APIURL() + "/api/v1/openapi.json")
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode, "%s", b)
	assert.True(t, strings.HasPrefix(res.Header.Get("Content-Type"), "application/json"), "Content-Type %q", res.Header.Get("Content-Type"))

	served, err := openapitest.Parse(b) // checked as 3.1, valid, examples included
	require.NoError(t, err)
	assert.Same(t, openapitest.Load(t), served, "the served document is not api/openapi.json")
	for _, p := range []string{"/api/v1/devices/register", "/api/v1/devices/{id}/commands/{command_id}", "/api/v1/blobs/{sha256}", "/api/v1/openapi.json"} {
		assert.NotNil(t, served.Doc.Paths.Find(p), "path %s", p)
	}
}
