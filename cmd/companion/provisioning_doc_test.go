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
// user's new token, a bridge's new secret and the backup (bug 450).
func TestProvisioningDocNamesEveryAdminRoute(t *testing.T) {
	doc := strings.Join(strings.Fields(string(testenv.ReadRepoFile(t, "docs/provisioning.md"))), " ")
	for _, r := range adminRoutes(t) {
		if !strings.Contains(doc, "`"+r+"`") {
			t.Errorf("docs/provisioning.md does not name the admin route `%s` of api/openapi.json", r)
		}
	}
}

// TestSecurityDocAdminRowNamesEveryAdminRoute checks that the threat
// model's row of the admin token, in docs/security.md, names every admin
// operation of api/openapi.json, as `METHOD PATH`: what one who holds it
// may do. Before, it said "create users and bridges, provision devices and
// assign them to bridges, publish firmware and apps", and not that the
// token replaces any user's API token or bridge's secret (so takes over
// their account) and downloads the whole store (bug 451).
func TestSecurityDocAdminRowNamesEveryAdminRoute(t *testing.T) {
	var row string
	for _, line := range strings.Split(string(testenv.ReadRepoFile(t, "docs/security.md")), "\n") {
		if strings.HasPrefix(line, "| admin / provisioning system |") {
			row = line
		}
	}
	require.NotEmpty(t, row, "docs/security.md's threat model has a row of the admin")
	for _, r := range adminRoutes(t) {
		if !strings.Contains(row, "`"+r+"`") {
			t.Errorf("docs/security.md: the admin token's row does not name `%s` of api/openapi.json", r)
		}
	}
}

// adminRoutes returns the admin operations of api/openapi.json, each as
// "METHOD PATH", sorted.
func adminRoutes(tb testing.TB) []string {
	tb.Helper()
	var api struct {
		Paths map[string]map[string]json.RawMessage
	}
	require.NoError(tb, json.Unmarshal(testenv.ReadRepoFile(tb, "api/openapi.json"), &api))
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
	require.GreaterOrEqual(tb, len(routes), 9, "admin operations in api/openapi.json")
	return routes
}

// TestReadmeNamesEveryAdminRoute checks that the README, where the admin
// CLI's commands are each "one HTTP call that a provisioning system can
// make directly", names every admin operation of api/openapi.json, as
// `METHOD PATH`. Before, it named six, in part abbreviated, and not the
// calls of `user token` and `bridge secret` it shows (bug 452).
func TestReadmeNamesEveryAdminRoute(t *testing.T) {
	doc := strings.Join(strings.Fields(string(testenv.ReadRepoFile(t, "README.md"))), " ")
	for _, r := range adminRoutes(t) {
		if !strings.Contains(doc, "`"+r+"`") {
			t.Errorf("README.md does not name the admin route `%s` of api/openapi.json", r)
		}
	}
}
