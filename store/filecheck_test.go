package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"

	bolt "go.etcd.io/bbolt"
)

// TestOpenRefusesADamagedFile opens files cut short, emptied and
// overwritten in part: each is refused with ErrDamaged and a message that
// names the file and what to do, and left as it was. bbolt alone faulted
// (SIGBUS) or panicked on a goroutine of its own on every one but the
// empty file, which it made a new store of.
// pageHeaderSize is the size of a bbolt page's header (id, flags, count,
// overflow).
const pageHeaderSize = 16

// branchPageFlag marks a bbolt branch page.
const branchPageFlag = 0x01

func TestOpenRefusesADamagedFile(t *testing.T) {
	good, used, pageSize, commandsRoot := damageableStore(t)
	page := func(b []byte, id uint64) []byte { return b[id*pageSize : (id+1)*pageSize] }
	cases := []struct {
		name   string
		damage func(b []byte) []byte
	}{
		{"empty", func([]byte) []byte { return nil }},
		{"cut to its metas", func(b []byte) []byte { return b[:2*pageSize] }},
		{"cut in half", func(b []byte) []byte { return b[:used/2] }},
		{"cut one page short", func(b []byte) []byte { return b[:used-pageSize] }},
		{"cut mid-page", func(b []byte) []byte { return b[:used-pageSize/2] }},
		{"a page of noise", func(b []byte) []byte {
			r := rand.New(rand.NewPCG(1, 2))
			for i := range page(b, commandsRoot) {
				page(b, commandsRoot)[i] = byte(r.Uint32())
			}
			return b
		}},
		{"a page of zeros", func(b []byte) []byte {
			clear(page(b, commandsRoot))
			return b
		}},
		{"an element past its page", func(b []byte) []byte {
			binary.LittleEndian.PutUint32(page(b, commandsRoot)[pageHeaderSize:], 1<<30) // element 0's pos
			return b
		}},
		{"a child past the end", func(b []byte) []byte {
			binary.LittleEndian.PutUint64(page(b, commandsRoot)[pageHeaderSize+8:], 1<<40) // element 0's pgid
			return b
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "companion.db")
			content := tc.damage(bytes.Clone(good))
			if err := os.WriteFile(path, content, 0o600); err != nil {
				t.Fatal(err)
			}
			db, err := Open(path, Options{Logger: quietLogger()})
			if err == nil {
				db.Close()
				t.Fatalf("Open(%s) = nil error; want ErrDamaged", tc.name)
			}
			if !errors.Is(err, ErrDamaged) {
				t.Errorf("Open(%s) = %v; want ErrDamaged", tc.name, err)
			}
			for _, want := range []string{path, "restore it from a backup"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Open(%s) = %q; want it to name %q", tc.name, err, want)
				}
			}
			after, rerr := os.ReadFile(path)
			if rerr != nil || !bytes.Equal(after, content) {
				t.Errorf("Open(%s) changed the file (%d bytes, was %d; %v)", tc.name, len(after), len(content), rerr)
			}
		})
	}
	t.Run("a directory", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "companion.db")
		if err := os.Mkdir(path, 0o700); err != nil {
			t.Fatal(err)
		}
		_, err := Open(path, Options{Logger: quietLogger()})
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("Open(a directory) = %v; want an error naming %s", err, path)
		}
	})
	t.Run("whole", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "companion.db")
		if err := os.WriteFile(path, good, 0o600); err != nil {
			t.Fatal(err)
		}
		db := openTestDBWith(t, path, Options{})
		if n, err := db.CountAllOpen(context.Background()); err != nil || n != 400 {
			t.Errorf("CountAllOpen() = %d, %v; want 400", n, err)
		}
	})
}

// damageableStore returns the content of a closed store holding 400
// commands, the bytes its pages use, its page size, and the root page of
// its commands bucket (a branch page).
func damageableStore(t *testing.T) (content []byte, used, pageSize, commandsRoot uint64) {
	t.Helper()
	db := openTestDB(t)
	payload := []byte(`"` + strings.Repeat("x", 1000) + `"`)
	for range 400 {
		if _, _, err := db.CreateCommand(context.Background(), companion.Command{DeviceID: "d1", Op: "push.text", State: "queued", Payload: payload}, 0, nil); err != nil {
			t.Fatal(err)
		}
	}
	path := db.Path()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	raw, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	pageSize = uint64(raw.Info().PageSize)
	_ = raw.View(func(tx *bolt.Tx) error {
		used = uint64(tx.Size())
		commandsRoot = uint64(tx.Bucket(bucketCommands).Root())
		return nil
	})
	if err := raw.Close(); err != nil {
		t.Fatal(err)
	}
	content, err = os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if commandsRoot == 0 || binary.LittleEndian.Uint16(content[commandsRoot*pageSize+8:]) != branchPageFlag {
		t.Fatalf("the commands bucket's root (page %d) is not a branch page", commandsRoot)
	}
	return content, used, pageSize, commandsRoot
}
