package agent

import (
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

// TestSpoolOutOfSpaceEmptiesTheBlobCache fails a write of the spool as a
// full disk does (ENOSPC, and a quota's EDQUOT): the blob cache's blobs
// that no command uses are deleted to give the spool room, and those in
// use and partial downloads are left; a file size limit (EFBIG), which
// deleting files does not relieve, deletes nothing. Before, the cache kept
// its up to 512 MiB while the spool refused every command
// (docs/reliability.md, bug 166).
func TestSpoolOutOfSpaceEmptiesTheBlobCache(t *testing.T) {
	for _, tc := range []struct {
		errno syscall.Errno
		want  []string // what is left of the cache
	}{
		{syscall.ENOSPC, []string{"inuse", "new.part"}},
		{syscall.EDQUOT, []string{"inuse", "new.part"}},
		{syscall.EFBIG, []string{"inuse", "new.part", "old1", "old2"}},
	} {
		b := newTestBlobs(t, "http://127.0.0.1:1")
		for _, name := range []string{"old1", "old2", "inuse", "new.part"} {
			if err := os.WriteFile(filepath.Join(b.dir, name), []byte("cached"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		unlock := b.lock("inuse") // a command is transferring it
		a := &Agent{log: slog.New(slog.DiscardHandler), blobs: b, spoolPath: "spool.db", outboxWake: make(chan struct{}, 1)}
		a.spoolFailed("taking commands in", &os.PathError{Op: "write", Path: "spool.db", Err: tc.errno})
		unlock()
		entries, err := os.ReadDir(b.dir)
		if err != nil {
			t.Fatal(err)
		}
		var left []string
		for _, e := range entries {
			left = append(left, e.Name())
		}
		slices.Sort(left)
		if !slices.Equal(left, tc.want) {
			t.Errorf("after a spool write failed %v, the cache holds %q; want %q", tc.errno, left, tc.want)
		}
	}
}
