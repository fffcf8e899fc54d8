package store_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/store"
)

// A command's life: accepted (queued, on disk), then moved on by the
// broker until it is final.
func ExampleDB_CreateCommand() {
	dir, err := os.MkdirTemp("", "store-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	db, err := store.Open(filepath.Join(dir, "companion.db"), store.Options{})
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()

	cmd, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "desk-1", Op: "push.text"}, 1000, nil)
	if err != nil {
		panic(err)
	}
	fmt.Println(cmd.State)
	cmd, err = db.UpdateCommand(ctx, cmd.ID, func(c *companion.Command) error {
		c.State = companion.StateSucceeded
		return nil
	})
	fmt.Println(cmd.State, err)
	n, _ := db.CountOpen(ctx, "desk-1")
	fmt.Println(n, "open")
	// Output:
	// queued
	// succeeded <nil>
	// 0 open
}
