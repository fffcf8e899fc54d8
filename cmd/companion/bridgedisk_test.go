package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// A first start of the real companion-bridge on a full disk, where it
// cannot make its spool: under a file size limit below the 16 MiB of
// bbolt's first growth (prlimit), and, where a private mount namespace may
// be made (unshare), on a tmpfs of 8 KiB, a real ENOSPC. It exits 1 with a
// line that names the spool and says what to do, leaves no spool behind,
// and starts once the space is back. Before, it said no more than bbolt's
// "file resize error: truncate …: file too large" or "write …: no space
// left on device" (docs/reliability.md, bug 176).
func TestProcessBridgeFirstStartOnAFullDisk(t *testing.T) {
	_, bridge := procBinaries(t)
	const bridgeUp = "companion-bridge starting"
	args := func(data string) []string {
		return []string{"--mqtt-url", "tcp://127.0.0.1:1", "--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1", "--data", data}
	}
	check := func(t *testing.T, code int, out, spool string) {
		t.Helper()
		assert.Equal(t, 1, code, "exit status (-1: it started)\n%s", out)
		assert.Contains(t, out, "spool "+spool+": ")
		assert.Contains(t, out, "the bridge cannot make its spool")
		assert.Contains(t, out, "free space under --data")
		assert.NotContains(t, out, "goroutine ")
	}

	t.Run("file size limit", func(t *testing.T) {
		prlimit, err := exec.LookPath("prlimit")
		if err != nil {
			t.Skip("prlimit (util-linux) is not installed")
		}
		data := t.TempDir()
		spool := filepath.Join(data, "spool.db")
		code, out := procExit(t, bridgeUp, nil, prlimit, append([]string{"--fsize=1000000", "--", bridge}, args(data)...)...)
		check(t, code, out, spool)
		assert.Contains(t, out, "file resize error")
		_, err = os.Lstat(spool)
		assert.True(t, os.IsNotExist(err), "a spool that could not be made was left behind (%v)", err)
		code, out = procExit(t, bridgeUp, nil, bridge, args(data)...)
		assert.Equal(t, -1, code, "with the space back: exit status (-1: it started)\n%s", out)
	})

	t.Run("no space", func(t *testing.T) {
		unshare, err := exec.LookPath("unshare")
		if err != nil {
			t.Skip("unshare (util-linux) is not installed")
		}
		mnt := t.TempDir()
		data := filepath.Join(mnt, "data")
		// The tmpfs is gone with the namespace: what the bridge left on
		// it is listed there.
		code, out := procExit(t, bridgeUp, nil, unshare, append([]string{"--map-root-user", "--mount", "sh", "-c",
			`mount -t tmpfs -o size=8k tmpfs "$1" || { echo NOMOUNT; exit 0; }; data=$2; shift 2; "$@"; rc=$?; echo LEFT: $(ls -A "$data"); exit $rc`,
			"sh", mnt, data, bridge}, args(data)...)...)
		if strings.HasPrefix(out, "unshare:") || strings.Contains(out, "NOMOUNT") {
			t.Skipf("no tmpfs in a private mount namespace here:\n%s", out)
		}
		check(t, code, out, filepath.Join(data, "spool.db"))
		assert.Contains(t, out, "no space left on device")
		assert.Contains(t, out, "LEFT: blobs\n", "what the bridge left under --data")
	})
}
