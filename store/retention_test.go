package store

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

func TestPurgeCommandsInBatches(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})
	db.purgeBatch = 10
	const total = 27
	for i := 0; i < total; i++ {
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text"}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateFailed; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(time.Hour)
	n, err := db.PurgeCommands(ctx, clk.Now())
	if err != nil || n != total {
		t.Fatalf("PurgeCommands = %d, %v; want %d", n, err, total)
	}
}
