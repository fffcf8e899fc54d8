package agent

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/boltcheck"
	"github.com/devicecompanion/companion/topics"
)

// spoolOnDisk makes a closed spool in a new directory with enough commands
// for a tree of several pages, and returns the spool file's path.
func spoolOnDisk(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	s, err := openSpool(dir)
	if err != nil {
		tb.Fatal(err)
	}
	var cmds []topics.Command
	for range 60 {
		cmds = append(cmds, testCommand(tb, "dev-1", topics.OpPushText, topics.PushText{Text: strings.Repeat("t", 2000)}))
	}
	if _, err := s.accept(cmds, time.Now()); err != nil {
		tb.Fatal(err)
	}
	if err := s.close(); err != nil {
		tb.Fatal(err)
	}
	return filepath.Join(dir, "spool.db")
}

// spoolMeta reads the spool file's newest meta page.
func spoolMeta(tb testing.TB, path string) boltcheck.Meta {
	tb.Helper()
	m, ok, err := boltcheck.NewestMeta(path)
	if err != nil || !ok {
		tb.Fatalf("the spool's meta: %v (valid %v)", err, ok)
	}
	return m
}

// patch writes b at off in the file at path.
func patch(tb testing.TB, path string, off int64, b []byte) {
	tb.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		tb.Fatal(err)
	}
}

// TestSpoolDamagedRefused opens spools damaged as disks and people damage
// them. bbolt panicked on a goroutine of its own, or faulted on a page past
// the end of the file, ending the bridge with a stack trace, or took an
// empty file for a new spool; each must be an error that names the file and
// says what to do, and the file must be left as it was (docs/reliability.md,
// bug 163).
func TestSpoolDamagedRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, path string)
		want   string
	}{
		{"zero bytes", func(t *testing.T, path string) {
			if err := os.Truncate(path, 0); err != nil {
				t.Fatal(err)
			}
		}, "empty"},
		{"shorter than its meta pages", func(t *testing.T, path string) {
			if err := os.Truncate(path, 5000); err != nil {
				t.Fatal(err)
			}
		}, "truncated"},
		{"shorter than its pages", func(t *testing.T, path string) {
			m := spoolMeta(t, path)
			if err := os.Truncate(path, int64((m.PageCount-2)*m.PageSize)); err != nil {
				t.Fatal(err)
			}
		}, "truncated"},
		{"both meta pages overwritten", func(t *testing.T, path string) {
			patch(t, path, 0, make([]byte, 8192))
		}, "meta pages"},
		{"the root page zeroed", func(t *testing.T, path string) {
			m := spoolMeta(t, path)
			patch(t, path, int64(m.Root*m.PageSize), make([]byte, m.PageSize))
		}, "damaged"},
		{"a page's type garbled", func(t *testing.T, path string) {
			m := spoolMeta(t, path)
			patch(t, path, int64((m.PageCount-1)*m.PageSize+8), []byte{0x02, 0x5e})
		}, "damaged"},
		{"keys out of order", func(t *testing.T, path string) {
			// The root bucket's leaf holds the spool's four buckets,
			// "commands" first: renamed "zommands", it sorts last.
			m := spoolMeta(t, path)
			off := int64(m.Root * m.PageSize)
			f, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			pos := binary.LittleEndian.Uint32(f[off+16+4:])
			key := off + 16 + int64(pos)
			if !bytes.HasPrefix(f[key:], []byte("commands")) {
				t.Fatalf("the root leaf's first key is %q", f[key:key+8])
			}
			patch(t, path, key, []byte("z"))
		}, "out of order"},
		{"a record not JSON", func(t *testing.T, path string) {
			f, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			i := bytes.Index(f, []byte(`{"cmd":`))
			if i < 0 {
				t.Fatal("no record found")
			}
			patch(t, path, int64(i), []byte("#"))
		}, "spool record"},
		{"a directory in its place", func(t *testing.T, path string) {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(path, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(path, "keep"), []byte("x"), 0o600); err != nil {
				t.Fatal(err)
			}
		}, "directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := spoolOnDisk(t)
			tc.damage(t, path)
			before := fileSum(t, path)
			s, err := openSpool(filepath.Dir(path))
			if err == nil {
				s.close()
				t.Fatalf("openSpool of a spool with %s = nil; want an error", tc.name)
			}
			msg := err.Error()
			for _, want := range []string{path, tc.want, "move it aside", "has not changed it"} {
				if !strings.Contains(msg, want) {
					t.Errorf("openSpool of a spool with %s = %q; want it to say %q", tc.name, msg, want)
				}
			}
			if after := fileSum(t, path); after != before {
				t.Errorf("the spool with %s was changed: %s, was %s", tc.name, after, before)
			}
		})
	}
}

// fileSum is the SHA-256 of the file at path, or of the names under it
// for a directory.
func fileSum(tb testing.TB, path string) string {
	tb.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		tb.Fatal(err)
	}
	if fi.IsDir() {
		names, err := os.ReadDir(path)
		if err != nil {
			tb.Fatal(err)
		}
		var b strings.Builder
		for _, n := range names {
			b.WriteString(n.Name() + "\n")
		}
		return "dir:" + b.String()
	}
	b, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	return fmt.Sprintf("%d bytes, SHA-256 %x", len(b), sha256.Sum256(b))
}

// TestSpoolWholeOpens is the other side of TestSpoolDamagedRefused: a
// spool as the bridge leaves it, one whose first meta page alone is gone
// (bbolt then reads the second, as it is made to), and one linked to from
// the data directory (kept on another disk) open with every command queued.
func TestSpoolWholeOpens(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, path string) (dir string)
	}{
		{"as left", func(t *testing.T, path string) string { return filepath.Dir(path) }},
		{"first meta page zeroed", func(t *testing.T, path string) string {
			patch(t, path, 0, make([]byte, 4096))
			return filepath.Dir(path)
		}},
		{"a symbolic link", func(t *testing.T, path string) string {
			dir := t.TempDir()
			if err := os.Symlink(path, filepath.Join(dir, "spool.db")); err != nil {
				t.Fatal(err)
			}
			return dir
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.change(t, spoolOnDisk(t))
			s, err := openSpool(dir)
			if err != nil {
				t.Fatalf("openSpool of a spool %s: %v", tc.name, err)
			}
			s.mu.Lock()
			n := len(s.queues["dev-1"])
			s.mu.Unlock()
			s.close()
			if n != 60 {
				t.Errorf("openSpool of a spool %s queued %d commands; want 60", tc.name, n)
			}
		})
	}
}

// TestSpoolFirstOpenOnAFullDisk starts a spool in a process that cannot
// write a file past 8 KiB (RLIMIT_FSIZE: a full disk, as bbolt meets it).
// It fails, saying to free space under --data (bug 176), and leaves no
// file behind: left half written, the next start, with the space back,
// took it for a damaged spool (bug 163).
func TestSpoolFirstOpenOnAFullDisk(t *testing.T) {
	if dir := os.Getenv("AGENT_SPOOL_OPEN_DIR"); dir != "" {
		s, err := openSpool(dir)
		if err == nil {
			s.close()
			t.Fatal("openSpool with a file size limit of 8 KiB = nil; want an error")
		}
		t.Log(err)
		return
	}
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("prlimit (util-linux) is not installed")
	}
	dir := t.TempDir()
	cmd := exec.Command(prlimit, "--fsize=8192", "--", os.Args[0], "-test.run=^TestSpoolFirstOpenOnAFullDisk$", "-test.v")
	cmd.Env = append(os.Environ(), "AGENT_SPOOL_OPEN_DIR="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the child: %v\n%s", err, out)
	}
	if !bytes.Contains(out, []byte("open spool")) {
		t.Fatalf("the child did not fail to open its spool:\n%s", out)
	}
	if !bytes.Contains(out, []byte("free space under --data")) {
		t.Errorf("the error of a spool a full disk could not make does not say to free space under --data (bug 176):\n%s", out)
	}
	if _, err := os.Lstat(filepath.Join(dir, "spool.db")); !os.IsNotExist(err) {
		t.Errorf("a spool that could not be made was left behind (%v)", err)
	}
	s, err := openSpool(dir)
	if err != nil {
		t.Fatalf("openSpool with the space back: %v", err)
	}
	s.close()
}
