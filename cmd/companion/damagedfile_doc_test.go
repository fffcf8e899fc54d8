package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// docs/operations.md, "A damaged data file at start", quotes what the
// server says of a directory where its file belongs and of a file that is
// not a bbolt file: the server says it, word for word, and exits. The page
// quoted bbolt's own `invalid database` and `is a directory`, which the
// server no longer says since it reads the file through first; an
// operator searching the log for them found nothing (docs/reliability.md,
// bug 420).
func TestOperationsDocQuotesTheDamagedFileMessages(t *testing.T) {
	doc := string(testenv.ReadRepoFile(t, "docs/operations.md"))
	_, section, ok := strings.Cut(doc, "### A damaged data file at start\n")
	require.True(t, ok, "docs/operations.md has the section")
	section, _, _ = strings.Cut(section, "\n## ")
	section = strings.Join(strings.Fields(section), " ")
	for name, damage := range map[string]func(path string) error{
		"a directory": func(path string) error { return os.Mkdir(path, 0o700) },
		"not bbolt":   func(path string) error { return os.WriteFile(path, []byte("hello\n"), 0o600) },
	} {
		t.Run(name, func(t *testing.T) {
			data := t.TempDir()
			require.NoError(t, damage(filepath.Join(data, "companion.db")))
			m := NewMain(Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: data, AdminToken: "test-admin-token", TopicPrefix: "companion/v1"}, testLogger(t))
			err := m.Run(context.Background())
			m.Close()
			require.Error(t, err, "the server started on %s", name)
			_, what, ok := strings.Cut(err.Error(), "the file is damaged: ")
			require.True(t, ok, "the server's error: %v", err)
			what, _, _ = strings.Cut(what, ";")
			assert.Contains(t, section, what, "docs/operations.md does not quote the server's message of %s: %v", name, err)
		})
	}
}
