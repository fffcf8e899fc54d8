package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// docs/security.md's threat model says what anyone on the network reaches
// without a credential: every path api/openapi.json serves with no
// security requirement, and the server answers each without a token. The
// row named /healthz and /readyz only, and said everything else answers
// 401: the OpenAPI document is served to anyone too, with the limits the
// server is configured with (docs/reliability.md, bug 421).
func TestSecurityDocNamesEveryOpenPath(t *testing.T) {
	var row string
	for _, line := range strings.Split(string(testenv.ReadRepoFile(t, "docs/security.md")), "\n") {
		if strings.HasPrefix(line, "| anyone on the network |") {
			row = line
		}
	}
	require.NotEmpty(t, row, "docs/security.md's threat model has a row of anyone on the network")
	var doc struct {
		Security []map[string][]string
		Paths    map[string]map[string]json.RawMessage
	}
	require.NoError(t, json.Unmarshal(testenv.ReadRepoFile(t, "api/openapi.json"), &doc))
	require.NotEmpty(t, doc.Security, "api/openapi.json asks a token by default")
	m := startServer(t, Config{})
	open := 0
	for path, item := range doc.Paths {
		for method, raw := range item {
			var op struct {
				Security  *[]map[string][]string
				Responses map[string]json.RawMessage
			}
			if json.Unmarshal(raw, &op) != nil || op.Responses == nil || op.Security == nil || len(*op.Security) > 0 {
				continue
			}
			open++
			assert.Contains(t, row, "`"+path+"`", "docs/security.md: anyone on the network reaches %s %s, which the row does not name", strings.ToUpper(method), path)
			req, err := http.NewRequest(strings.ToUpper(method), m.APIURL()+path, nil)
			require.NoError(t, err)
			res, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			res.Body.Close()
			assert.NotEqual(t, http.StatusUnauthorized, res.StatusCode, "%s %s without a token", method, path)
		}
	}
	require.GreaterOrEqual(t, open, 4, "operations with no security requirement")
}
