package store

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/devicecompanion/companion"
)

// newCmd is a command for the device as the broker would submit it.
func newCmd(dev string) companion.Command {
	return companion.Command{DeviceID: dev, UserID: "u1", Op: "push.text", Payload: raw(`{"text":"hi"}`)}
}

// create stores a command or fails the test.
func create(tb testing.TB, db *DB, c companion.Command) companion.Command {
	tb.Helper()
	got, _, err := db.CreateCommand(context.Background(), c, 0, nil)
	if err != nil {
		tb.Fatalf("CreateCommand = %v", err)
	}
	return got
}

// setState moves a command to state or fails the test.
func setState(tb testing.TB, db *DB, id, state string) companion.Command {
	tb.Helper()
	c, err := db.UpdateCommand(context.Background(), id, func(c *companion.Command) error {
		c.State = state
		return nil
	})
	if err != nil {
		tb.Fatalf("UpdateCommand(%s → %s) = %v", id, state, err)
	}
	return c
}

func ids(cs []companion.Command) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.ID
	}
	return out
}

func TestIsFinal(t *testing.T) {
	for state, want := range map[string]bool{
		companion.StateQueued: false, companion.StateSent: false, companion.StateDelivered: false, companion.StateInProgress: false,
		companion.StateSucceeded: true, companion.StateFailed: true, companion.StateExpired: true, companion.StateCanceled: true,
	} {
		if got := companion.IsFinal(state); got != want {
			t.Errorf("IsFinal(%q) = %v; want %v", state, got, want)
		}
	}
}

// BenchmarkCreateCommand measures accepted commands per second with many
// concurrent writers, which bbolt's Batch groups into one fsync.
func BenchmarkCreateCommand(b *testing.B) {
	ctx := context.Background()
	db := openTestDB(b)
	var n atomic.Int64
	b.SetParallelism(64) // 64 × GOMAXPROCS writers, like many API requests at once
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		dev := fmt.Sprintf("d%d", n.Add(1))
		for pb.Next() {
			if _, _, err := db.CreateCommand(ctx, newCmd(dev), 1000000, nil); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cmds/s")
}
