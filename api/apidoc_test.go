package api

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// apiDocErrorRows returns the rows of docs/api.md's table of errors, by
// status.
func apiDocErrorRows(tb testing.TB) map[int]string {
	tb.Helper()
	md := string(testenv.ReadRepoFile(tb, "docs/api.md"))
	_, table, ok := strings.Cut(md, "| status | codes |\n|---|---|\n")
	require.True(tb, ok, "docs/api.md has a table of errors")
	rows := map[int]string{}
	for _, line := range strings.Split(table, "\n") {
		if !strings.HasPrefix(line, "| ") {
			break
		}
		cells := strings.SplitN(line, " | ", 2)
		status, err := strconv.Atoi(strings.TrimPrefix(cells[0], "| "))
		require.NoError(tb, err, "docs/api.md: %s", line)
		rows[status] = cells[1]
	}
	return rows
}

// docs/api.md's table of errors lists every problem code under the status
// the server answers it with, and says the headers of a 401 as the server
// sends them: with a token sent, WWW-Authenticate also carries
// error="invalid_token" (RFC 6750 §3.1), which the table left out
// (docs/reliability.md, bug 419).
func TestAPIDocErrorTable(t *testing.T) {
	rows := apiDocErrorRows(t)
	for code, info := range codes {
		if !strings.Contains(rows[info.status], "`"+code+"`") {
			t.Errorf("docs/api.md's row of %d does not list %s", info.status, code)
		}
	}
	e := newEnv(t)
	for _, token := range []string{"", "ctk_not-a-token"} {
		r := e.do("GET", "/api/v1/devices", token, nil)
		require.Equal(t, http.StatusUnauthorized, r.status, "%s", r.body)
		h := r.header.Get("WWW-Authenticate")
		require.NotEmpty(t, h)
		assert.Contains(t, rows[http.StatusUnauthorized], "`WWW-Authenticate: "+h+"`", "token %q: docs/api.md's 401 row does not say the header the server sends", token)
	}
}
