// Package testenv holds what every test kit of the project needs of its
// surroundings: the repository's root (for mosquitto.conf and bin/) and a
// free port. mqtttest, pgtest and natstest build on it.
package testenv

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
)

// RepoRoot is the directory of go.mod, found by walking up from the
// working directory (a package's directory under go test).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory: run the tests inside the module")
		}
		dir = parent
	}
}

// ReadRepoFile returns the file at rel, a path from the repository's root,
// failing tb if it cannot be read.
func ReadRepoFile(tb testing.TB, rel string) []byte {
	tb.Helper()
	root, err := RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. Some
// other process may take it before the caller binds it; for servers that can
// listen on port 0 and report their address, prefer that.
func FreePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
