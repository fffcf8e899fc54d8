package store

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/pgctl"
)

// TestOpenOfAFileTheServerMayNotRead opens, as the server's own user, a
// store restored by root into its data directory (install -m 600 as root,
// which docs/operations.md said): the server must say whose the file is
// and to give it to the server's user, not that it is damaged. Before, it
// said to restore it from a backup or move it aside to start with an
// empty store: an operator who did lost the store just restored.
func TestOpenOfAFileTheServerMayNotRead(t *testing.T) {
	if path := os.Getenv("COMPANION_TEST_OPEN"); path != "" {
		_, err := Open(path, Options{Logger: quietLogger()})
		fmt.Printf("Open: %v\n", err)
		return
	}
	cred, err := pgctl.Credential()
	require.NoError(t, err)
	if cred == nil {
		t.Skip("opening as another user needs root")
	}
	dir, err := os.MkdirTemp("", "companion-restore")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	db := openTestDBWith(t, filepath.Join(dir, "companion.db"), Options{})
	require.NoError(t, db.Close())
	// The data directory is the server's; the restored file is root's.
	require.NoError(t, os.Chown(dir, int(cred.Uid), int(cred.Gid)))
	require.NoError(t, os.Chown(filepath.Join(dir, "blobs"), int(cred.Uid), int(cred.Gid)))
	require.NoError(t, pgctl.CheckReachable(dir, cred))

	// The test binary, where that user may run it.
	binDir, err := os.MkdirTemp("", "companion-restore-bin")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(binDir) })
	require.NoError(t, os.Chmod(binDir, 0o755))
	self, err := os.ReadFile(os.Args[0])
	require.NoError(t, err)
	bin := filepath.Join(binDir, "store.test")
	require.NoError(t, os.WriteFile(bin, self, 0o755))

	cmd := exec.Command(bin, "-test.run=^TestOpenOfAFileTheServerMayNotRead$")
	cmd.Env = append(os.Environ(), "COMPANION_TEST_OPEN="+filepath.Join(dir, "companion.db"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Logf("%s", out)
	assert.Contains(t, string(out), "permission denied")
	assert.Contains(t, string(out), "chown", "the store restored as root, opened as the server's user: %s", out)
	assert.NotContains(t, string(out), "move it aside", "the store restored as root, opened as the server's user")
}
