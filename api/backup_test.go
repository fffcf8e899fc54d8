package api

import (
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/boltcheck"
)

// TestAdminBackup: GET /api/v1/admin/backup answers the bbolt file whole,
// of the length it says, which reads as a store; HEAD says the length
// alone; a user's token is refused; and a store that makes no backup
// (PostgreSQL's) is a 409 backup_unsupported saying to use pg_dump.
func TestAdminBackup(t *testing.T) {
	e := newEnv(t)
	r := e.send(req{method: http.MethodGet, path: "/api/v1/admin/backup", token: testAdminToken})
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	assert.Equal(t, "application/octet-stream", r.header.Get("Content-Type"))
	assert.Equal(t, strconv.Itoa(len(r.body)), r.header.Get("Content-Length"))
	file := filepath.Join(t.TempDir(), "companion.db")
	require.NoError(t, os.WriteFile(file, r.body, 0o600))
	assert.NoError(t, boltcheck.Check(file))

	h := e.send(req{method: http.MethodHead, path: "/api/v1/admin/backup", token: testAdminToken})
	require.Equal(t, http.StatusOK, h.status)
	assert.Empty(t, h.body)
	assert.NotEmpty(t, h.header.Get("Content-Length"))

	r = e.send(req{method: http.MethodGet, path: "/api/v1/admin/backup", token: "not-the-admin"})
	assert.Equal(t, http.StatusUnauthorized, r.status)

	type noBackup struct{ Store } // what *postgres.DB offers: no Backup
	pg := newEnvWith(t, e.db, noBackup{e.db})
	r = pg.send(req{method: http.MethodGet, path: "/api/v1/admin/backup", token: testAdminToken})
	require.Equal(t, http.StatusConflict, r.status, "%s", r.body)
	p := r.problem(t)
	assert.Equal(t, CodeBackupUnsupported, p.Code)
	assert.Contains(t, p.Detail, "pg_dump")
}
