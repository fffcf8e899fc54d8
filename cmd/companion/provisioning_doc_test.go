package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestProvisioningDocNamesEveryAdminRoute checks that docs/provisioning.md,
// where an operator reads what the admin API can and cannot do to a device
// and its claim code, names every admin operation of api/openapi.json, as
// `METHOD PATH`. Before, it listed the routes in words and left out a
// user's new token, a bridge's new secret and the backup (bug 592).
func TestProvisioningDocNamesEveryAdminRoute(t *testing.T) {
	doc := strings.Join(strings.Fields(string(testenv.ReadRepoFile(t, "docs/provisioning.md"))), " ")
	var api struct {
		Paths map[string]map[string]json.RawMessage
	}
	require.NoError(t, json.Unmarshal(testenv.ReadRepoFile(t, "api/openapi.json"), &api))
	var routes []string
	for path, item := range api.Paths {
		if !strings.HasPrefix(path, "/api/v1/admin/") {
			continue
		}
		for method := range item {
			switch method {
			case "get", "put", "post", "delete", "patch":
				routes = append(routes, strings.ToUpper(method)+" "+path)
			}
		}
	}
	slices.Sort(routes)
	require.GreaterOrEqual(t, len(routes), 9, "admin operations in api/openapi.json")
	for _, r := range routes {
		if !strings.Contains(doc, "`"+r+"`") {
			t.Errorf("docs/provisioning.md does not name the admin route `%s` of api/openapi.json", r)
		}
	}
}
