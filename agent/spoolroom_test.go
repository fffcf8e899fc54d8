package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/devicecompanion/companion/internal/testenv"
)

// TestSpoolOutOfSpaceEmptiesTheBlobCache fails a write of the spool as a
// full disk does (ENOSPC, and a quota's EDQUOT): the blob cache's blobs
// that no command uses are deleted to give the spool room, and those in
// use and partial downloads are left; a file size limit (EFBIG), which
// deleting files does not relieve, deletes nothing. Before, the cache kept
// its up to 512 MiB while the spool refused every command
// (docs/reliability.md, bug 166). bbolt's error of a growth of the spool
// the disk refused tells the errno in its text only: it counts the same
// (bug 195); another error that merely reads so does not.
func TestSpoolOutOfSpaceEmptiesTheBlobCache(t *testing.T) {
	// bbolt's errors of its file's growth, which carry the errno as text
	// only (fmt.Errorf with %s).
	grown := func(what, op string, errno syscall.Errno) error {
		return fmt.Errorf("%s error: %s", what, &os.PathError{Op: op, Path: "spool.db", Err: errno})
	}
	for _, tc := range []struct {
		err  error
		want []string // what is left of the cache
	}{
		{&os.PathError{Op: "write", Path: "spool.db", Err: syscall.ENOSPC}, []string{"inuse", "new.part"}},
		{&os.PathError{Op: "write", Path: "spool.db", Err: syscall.EDQUOT}, []string{"inuse", "new.part"}},
		{&os.PathError{Op: "write", Path: "spool.db", Err: syscall.EFBIG}, []string{"inuse", "new.part", "old1", "old2"}},
		// bug 195
		{grown("file resize", "truncate", syscall.ENOSPC), []string{"inuse", "new.part"}},
		{grown("file sync", "sync", syscall.EDQUOT), []string{"inuse", "new.part"}},
		{grown("file resize", "truncate", syscall.EFBIG), []string{"inuse", "new.part", "old1", "old2"}},
		{errors.New("commit: no space left on device"), []string{"inuse", "new.part", "old1", "old2"}},
	} {
		b := newTestBlobs(t, "http://127.0.0.1:1")
		for _, name := range []string{"old1", "old2", "inuse", "new.part"} {
			if err := os.WriteFile(filepath.Join(b.dir, name), []byte("cached"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		unlock := b.lock("inuse") // a command is transferring it
		a := &Agent{log: slog.New(slog.DiscardHandler), blobs: b, spoolPath: "spool.db", outboxWake: make(chan struct{}, 1)}
		a.spoolFailed("taking commands in", tc.err)
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
			t.Errorf("after a spool write failed (%v), the cache holds %q; want %q", tc.err, left, tc.want)
		}
	}
}

// A spool that must grow under a file size limit: bbolt's growth of the
// real file fails, with the limit's EFBIG in the text of its error only
// ("file resize error: truncate …: file too large"). The bridge tells it
// for what it is, as the first start does (bug 176): it deletes no cached
// blob, and says to lift the limit, not to free space, which would not
// help. Before, the limit was told only at a first start, by a text match
// of its own; the running spool's log said to free space
// (docs/reliability.md, bug 195).
func TestSpoolGrowthUnderAFileSizeLimit(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	s, err := openSpool(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	fi, err := os.Stat(s.db.Path())
	if err != nil {
		t.Fatal(err)
	}
	lift := testenv.LimitFileSize(t, fi.Size())
	// More than the file holds: bbolt grows it before it writes a page.
	err = s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketStatus).Put([]byte("big"), make([]byte, fi.Size()+1<<20))
	})
	lift()
	if err == nil || !strings.Contains(err.Error(), "file resize error") || errors.Is(err, syscall.EFBIG) {
		t.Fatalf("the growth past the limit failed %v; want bbolt's file resize error, its EFBIG as text only", err)
	}
	if got := diskRefusal(err); got != syscall.EFBIG {
		t.Errorf("diskRefusal(%q) = %v; want EFBIG", err, got)
	}
	if err := spoolOpenError(s.db.Path(), err, true); !strings.Contains(err.Error(), "cannot make its spool") {
		t.Errorf("a first start's error of it does not say so: %v", err)
	}

	b := newTestBlobs(t, "http://127.0.0.1:1")
	if err := os.WriteFile(filepath.Join(b.dir, "old"), []byte("cached"), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs testenv.Buffer
	a := &Agent{log: slog.New(slog.NewTextHandler(&logs, nil)), blobs: b, spoolPath: s.db.Path(), outboxWake: make(chan struct{}, 1)}
	a.spoolFailed("keeping a device's status", err)
	if _, serr := os.Stat(filepath.Join(b.dir, "old")); serr != nil {
		t.Errorf("a file size limit deleted the cached blobs: %v", serr)
	}
	out := logs.String()
	if !strings.Contains(out, "the spool cannot be written") || !strings.Contains(out, "lift the bridge's (ulimit -f") || strings.Contains(out, "free space") {
		t.Errorf("the log of a spool a file size limit refuses does not say to lift the limit (and not to free space):\n%s", out)
	}
}
