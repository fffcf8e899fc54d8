package api

import (
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/boltcheck"
	"github.com/devicecompanion/companion/store"
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

// TestAdminBackupWithoutRoom takes a backup of a store on a file system
// with less room than a copy of it and the store's own headroom: the
// backup is refused with a 507 that says so, and the disk is left as it
// was; with room, it is taken. Before, the copy the backup makes beside
// the store (bug 427) took the room the store's commits need, or failed
// as a 500 "internal error".
func TestAdminBackupWithoutRoom(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small file system needs root")
	}
	dir, err := os.MkdirTemp("", "companion-backup")
	require.NoError(t, err)
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=128m,mode=0700"); err != nil {
		os.Remove(dir)
		t.Skip("cannot mount a tmpfs:", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
		os.Remove(dir)
	})
	db, err := store.Open(filepath.Join(dir, "companion.db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	e := newEnvWith(t, db, db)

	// Leave 40 MiB: more than the store, less than the store and the
	// headroom a backup leaves it.
	var st syscall.Statfs_t
	require.NoError(t, syscall.Statfs(dir, &st))
	filler := filepath.Join(dir, "filler")
	require.NoError(t, os.WriteFile(filler, make([]byte, int64(st.Bavail)*st.Bsize-40<<20), 0o600))
	require.NoError(t, syscall.Statfs(dir, &st))
	free := int64(st.Bavail) * st.Bsize

	r := e.send(req{method: http.MethodGet, path: "/api/v1/admin/backup", token: testAdminToken})
	require.Equal(t, http.StatusInsufficientStorage, r.status, "a backup without room for its copy: %s", r.body)
	p := r.problem(t)
	assert.Equal(t, CodeBackupNoRoom, p.Code)
	assert.Contains(t, p.Detail, "free")
	assert.NotContains(t, p.Detail, dir, "a 5xx names no path")
	require.NoError(t, syscall.Statfs(dir, &st))
	assert.Equal(t, free, int64(st.Bavail)*st.Bsize, "the free space after a backup refused")

	require.NoError(t, os.Remove(filler))
	r = e.send(req{method: http.MethodGet, path: "/api/v1/admin/backup", token: testAdminToken})
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
}
