package store_test

import (
	"io"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/store/storetest"
)

// TestEventsConformance runs the event log's conformance tests alone
// (TestConformance runs them too).
func TestEventsConformance(t *testing.T) {
	storetest.RunEvents(t, func(t *testing.T) companion.Store {
		t.Helper()
		db, err := store.Open(filepath.Join(t.TempDir(), "companion.db"), store.Options{
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			t.Fatalf("store.Open = %v", err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	})
}
