package main

import (
	"bytes"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

// TestOfflineBackupIsMarked backs up the store of a stopped server with
// companion backup --offline, restores it after the lost store made
// events a client saw, and runs the restored store on past the client's
// id: the client must be told it missed events (the copy is marked as a
// backup, bug 397). Before, the only backup of a stopped server was a cp
// of its file, unmarked: the restored store gave the forgotten ids to new
// events, and the client skipped them silently. With the server running
// (the file locked), --offline refuses at once and says why.
func TestOfflineBackupIsMarked(t *testing.T) {
	ctx := t.Context()
	data := t.TempDir()
	path := filepath.Join(data, "companion.db")
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	open := func(path string) *store.DB {
		t.Helper()
		db, err := store.Open(path, store.Options{Logger: quiet})
		require.NoError(t, err)
		return db
	}
	create := func(db *store.DB, n int) string {
		t.Helper()
		for range n {
			_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", UserID: "u1", Op: "push.text", ExpiresAt: time.Now().Add(time.Hour)}, 0, nil)
			require.NoError(t, err)
		}
		head, err := db.EventsHead(ctx)
		require.NoError(t, err)
		return head
	}
	db := open(path)
	require.NoError(t, db.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "m"}))
	_, _, err := db.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	create(db, 3)

	// The server runs: the file is locked.
	file := filepath.Join(t.TempDir(), "companion.bak")
	var stdout, stderr bytes.Buffer
	err = runBackup(ctx, []string{"--offline", "--data", data, file}, &stdout, &stderr)
	require.Error(t, err, "companion backup --offline of a running server's store")
	assert.Contains(t, err.Error(), "running", "companion backup --offline of a running server's store")
	assert.NoFileExists(t, file)

	require.NoError(t, db.Close()) // the server stops
	stdout.Reset()
	require.NoError(t, runBackup(ctx, []string{"--offline", "--data", data, file}, &stdout, &stderr), "stderr: %s", stderr.String())
	assert.Contains(t, stdout.String(), `"file":`)

	db = open(path)
	seen := create(db, 5) // a client saw these, then the store was lost
	require.NoError(t, db.Close())

	restored := filepath.Join(t.TempDir(), "companion.db")
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(restored, b, 0o600))
	db = open(restored)
	defer db.Close()
	create(db, 20) // the restored server runs on past the client's id
	past, err := db.EventsPastEnd(ctx, seen)
	require.NoError(t, err)
	purged, err := db.EventsPurgedAfter(ctx, seen)
	require.NoError(t, err)
	assert.True(t, past || purged, "a client at %s, an event the restored store forgot, is not told it missed events", seen)
}

// TestBackupOverTheLiveStoreRefused gives companion backup the running
// server's own store as the file to write: it must refuse and leave the
// store as it is. Before, it renamed its copy over the live file: the
// server went on writing to the file it had open, no longer in the
// directory, and its next start opened the copy, without every change
// made since.
func TestBackupOverTheLiveStoreRefused(t *testing.T) {
	dir := t.TempDir()
	m := startServer(t, Config{Data: dir})
	live := filepath.Join(dir, "companion.db")
	before, err := os.Stat(live)
	require.NoError(t, err)
	var out, errOut bytes.Buffer
	err = run(t.Context(), []string{"backup", live, "--api-url", m.APIURL(), "--admin-token", m.AdminToken()}, &out, &errOut)
	require.Error(t, err, "companion backup over the running server's store")
	assert.Contains(t, err.Error(), "open")
	after, err := os.Stat(live)
	require.NoError(t, err)
	assert.True(t, os.SameFile(before, after), "the running server's store was replaced by its backup")
}
