package store

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

func TestPurgeCommands(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now})

	newCmd := func(dev string) companion.Command {
		t.Helper()
		c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: dev, Op: "push.text", ExpiresAt: clk.Now().Add(time.Hour)}, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	finish := func(id string) {
		t.Helper()
		if _, err := db.UpdateCommand(ctx, id, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	oldDone := newCmd("d1")
	finish(oldDone.ID)
	oldOpen := newCmd("d1") // never finishes: must survive
	clk.Advance(40 * 24 * time.Hour)
	newDone := newCmd("d1")
	finish(newDone.ID)

	n, err := db.PurgeCommands(ctx, clk.Now().Add(-30*24*time.Hour))
	if err != nil || n != 1 {
		t.Fatalf("PurgeCommands = %d, %v; want 1, nil", n, err)
	}
	if _, err := db.Command(ctx, oldDone.ID); err != companion.ErrNotFound {
		t.Errorf("Command(purged) error = %v; want ErrNotFound", err)
	}
	for _, id := range []string{oldOpen.ID, newDone.ID} {
		if _, err := db.Command(ctx, id); err != nil {
			t.Errorf("Command(%s) = %v; want kept", id, err)
		}
	}
	hist, _, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1"})
	if err != nil || len(hist) != 2 {
		t.Fatalf("history after purge = %d commands, %v; want 2", len(hist), err)
	}
	for _, c := range hist {
		if c.ID == oldDone.ID {
			t.Error("the purged command is still in the device's history")
		}
	}
}

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
