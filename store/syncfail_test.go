//go:build linux

package store

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"
)

// A write whose commit failed as the disk failed the sync of its meta page
// (EIO from the second fdatasync, the pages' own having succeeded) fails
// ErrUnwritable and is not kept: not read back, not queued, not there
// after a reopen; the writes after it are, grouped (a command) or not (a
// user). bbolt wrote the meta page before its sync failed and rolled the
// transaction back in memory only, while it reads its metas from the
// mapped file: the write answered as failed read as stored, and the next
// commit made it durable (bug 337). The faults are a seccomp filter's
// (testenv.FailSyscalls), in a child process, which it outlives.
func TestAWriteWhoseSyncFailedIsNotKept(t *testing.T) {
	if !testenv.InChild(t) {
		return
	}
	faults := testenv.FailSyscalls(t, unix.SYS_FDATASYNC)
	ctx := context.Background()
	var log testenv.Buffer
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "companion.db"), Options{
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	create := func() (string, error) {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued"}, 0, nil)
		return c.ID, err
	}
	queued := func() []string {
		t.Helper()
		cmds, err := db.QueuedCommandsWith(ctx, []string{"d1"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, c := range cmds {
			ids = append(ids, c.ID)
		}
		return ids
	}
	first, err := create()
	if err != nil {
		t.Fatal(err)
	}

	faults.Next(unix.SYS_FDATASYNC, 0, syscall.EIO) // the pages' sync, then the meta's
	if _, err := create(); !errors.Is(err, ErrUnwritable) {
		t.Fatalf("CreateCommand(the meta's sync failed) = %v; want ErrUnwritable", err)
	}
	if ids := queued(); len(ids) != 1 {
		t.Errorf("queued after a command whose sync failed: %q; want only %s", ids, first)
	}
	second, err := create()
	if err != nil {
		t.Fatalf("CreateCommand after = %v", err)
	}

	// The store's own write that finds the fault gone (a second after it
	// began) must not take the next fault.
	testenv.Eventually(t, time.Minute, "the store to say it takes writes again", func() bool {
		return strings.Contains(log.String(), "takes writes again")
	})
	faults.Next(unix.SYS_FDATASYNC, 0, syscall.EIO)
	lost := companion.User{ID: "u-lost", TokenHash: []byte("lost"), CreatedAt: db.now()}
	if err := db.CreateUser(ctx, lost); !errors.Is(err, ErrUnwritable) {
		t.Fatalf("CreateUser(the meta's sync failed) = %v; want ErrUnwritable", err)
	}
	if _, err := db.User(ctx, lost.ID); !errors.Is(err, companion.ErrNotFound) {
		t.Errorf("User(%s) = %v after its sync failed; want ErrNotFound", lost.ID, err)
	}
	kept := companion.User{ID: "u-kept", TokenHash: []byte("kept"), CreatedAt: db.now()}
	if err := db.CreateUser(ctx, kept); err != nil {
		t.Fatalf("CreateUser after = %v", err)
	}

	db = reopen(t, db, Options{})
	if ids := queued(); len(ids) != 2 || ids[0] != first || ids[1] != second {
		t.Errorf("queued after a reopen: %q; want %s and %s", ids, first, second)
	}
	if _, err := db.User(ctx, lost.ID); !errors.Is(err, companion.ErrNotFound) {
		t.Errorf("User(%s) = %v after a reopen; want ErrNotFound", lost.ID, err)
	}
	if _, err := db.User(ctx, kept.ID); err != nil {
		t.Errorf("User(%s) = %v after a reopen", kept.ID, err)
	}
	if err := db.bolt.View(func(tx *bolt.Tx) error { return errors.Join(collect(tx.Check())...) }); err != nil {
		t.Errorf("the file: %v", err)
	}
}

// A blob the disk refuses as it fails (EIO from a directory's sync) or
// as its file system goes read-only (EROFS, as ext4 remounts itself on
// errors) is ErrUnwritable, as a command's commit is then, and as a blob
// that does not fit is: the API's 503 with Retry-After, not a 500
// logged for every upload (bug 338).
func TestABlobTheDiskFailsIsUnwritable(t *testing.T) {
	if !testenv.InChild(t) {
		return
	}
	faults := testenv.FailSyscalls(t, unix.SYS_OPENAT, unix.SYS_FSYNC)
	ctx := context.Background()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "companion.db"), Options{})
	put := func(content string) error {
		_, err := db.PutBlob(ctx, strings.NewReader(content), 0)
		return err
	}
	faults.Next(unix.SYS_OPENAT, syscall.EROFS) // its temp file
	if err := put("read-only"); !errors.Is(err, ErrUnwritable) {
		t.Errorf("PutBlob(a read-only file system) = %v; want ErrUnwritable", err)
	}
	faults.Next(unix.SYS_FSYNC, 0, syscall.EIO) // its content's sync, then its directory's
	if err := put("failing"); !errors.Is(err, ErrUnwritable) {
		t.Errorf("PutBlob(its directory's sync failing) = %v; want ErrUnwritable", err)
	}
	if err := put("healthy"); err != nil {
		t.Errorf("PutBlob(after) = %v", err)
	}
}

// A disk that stops answering (every fdatasync held, as on a network
// volume gone) is the store's fault as soon as a write has waited
// stallAfter: CheckWrites (/readyz) reports it, and the log says it once,
// with what it is; once the disk answers, the write waiting is stored,
// and the fault is said gone (bug 339).
func TestADiskThatStopsAnsweringIsSaid(t *testing.T) {
	if !testenv.InChild(t) {
		return
	}
	faults := testenv.FailSyscalls(t, unix.SYS_FDATASYNC)
	stallAfter = 200 * time.Millisecond // this child's alone
	var log testenv.Buffer
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "companion.db"), Options{
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	ctx := context.Background()
	create := func() error {
		_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued"}, 0, nil)
		return err
	}
	if err := create(); err != nil {
		t.Fatal(err)
	}

	release := faults.Hold(unix.SYS_FDATASYNC)
	defer release()
	done := make(chan error, 1)
	go func() { done <- create() }()
	testenv.Eventually(t, 10*time.Second, "CheckWrites to say the disk does not answer", func() bool {
		return errors.Is(db.CheckWrites(ctx), ErrUnwritable)
	})
	testenv.Eventually(t, 10*time.Second, "the log to say the disk does not answer", func() bool {
		return strings.Contains(log.String(), "has not finished")
	})
	release()
	if err := <-done; err != nil {
		t.Errorf("CreateCommand(held until the disk answered) = %v", err)
	}
	testenv.Eventually(t, 10*time.Second, "CheckWrites once the disk answers", func() bool {
		return db.CheckWrites(ctx) == nil
	})
	testenv.Eventually(t, 10*time.Second, "the log to say the disk takes writes again", func() bool {
		return strings.Contains(log.String(), "takes writes again")
	})
	if n, err := db.CountAllOpen(ctx); err != nil || n != 2 {
		t.Errorf("CountAllOpen() = %d, %v; want 2", n, err)
	}
	out := log.String()
	t.Logf("the store's log:\n%s", out)
	if n := strings.Count(out, "level=ERROR") + strings.Count(out, "level=WARN"); n != 1 {
		t.Errorf("%d errors and warnings; want 1", n)
	}
}

// Once the disk has refused a command for want of room to grow the file,
// CheckWrites (/readyz) answers ErrUnwritable for as long as the file
// cannot grow, though its small write of its own fits in pages the file
// has free; it answers nil, and commands are stored, once it can (bug
// 350). The file may grow up to the end of the zeros ahead (a file size
// limit there): the blocks a full disk had allocated before it filled.
func TestCheckWritesWhileTheFileCannotGrow(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openTestDB(t)
	ctx := context.Background()
	payload := []byte(`"` + strings.Repeat("x", 4000) + `"`)
	create := func() error {
		_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "push.text", State: "queued", Payload: payload}, 0, nil)
		return err
	}
	for range 5 {
		if err := create(); err != nil {
			t.Fatal(err)
		}
	}
	var used int64
	_ = db.bolt.View(func(tx *bolt.Tx) error { used = tx.Size(); return nil })
	f, err := os.Open(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	zeroed, err := f.Seek(used, unix.SEEK_HOLE)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}

	lift := testenv.LimitFileSize(t, zeroed)
	for i := 0; ; i++ {
		err := create()
		if errors.Is(err, ErrUnwritable) {
			break
		}
		if err != nil || i == 10000 {
			t.Fatalf("CreateCommand(%d) = %v; want one ErrUnwritable past %d bytes", i, err, zeroed)
		}
	}
	for range 3 {
		if err := db.CheckWrites(ctx); !errors.Is(err, ErrUnwritable) {
			t.Fatalf("CheckWrites() = %v while the file cannot grow; want ErrUnwritable", err)
		}
		if err := create(); !errors.Is(err, ErrUnwritable) {
			t.Fatalf("CreateCommand(the file cannot grow) = %v; want ErrUnwritable", err)
		}
	}

	lift()
	awaitWrites(t, db) // within commitRetry (bug 342)
	if err := create(); err != nil {
		t.Fatalf("CreateCommand(the file can grow) = %v", err)
	}
}
