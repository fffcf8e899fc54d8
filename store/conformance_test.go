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

// TestConformance runs the tests every companion.Store passes against the
// bbolt store, each on a new file of its own.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) companion.Store {
		t.Helper()
		db, err := store.Open(filepath.Join(t.TempDir(), "companion.db"), store.Options{
			Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		if err != nil {
			t.Fatalf("store.Open = %v", err)
		}
		t.Cleanup(func() {
			if err := db.Close(); err != nil {
				t.Errorf("Close = %v", err)
			}
		})
		return db
	})
}
