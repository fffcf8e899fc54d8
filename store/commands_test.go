package store

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/google/uuid"
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

// A server whose clock went back while it was down (an NTP step, a clock
// set by hand) still gives its new commands ids above those it gave
// before: the outbox and the bridge run a device's commands in id order,
// and GET …/commands lists them newest first by id.
func TestCommandIDsRiseAfterTheClockWentBack(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	// The process that accepted the first commands had its clock an hour
	// ahead.
	ahead := time.Now().Add(time.Hour)
	db.uuidV7 = func() (uuid.UUID, error) {
		u, err := uuid.NewV7()
		ahead = ahead.Add(time.Millisecond)
		ms := uint64(ahead.UnixMilli())
		for i := range 6 {
			u[i] = byte(ms >> (40 - 8*i))
		}
		return u, err
	}
	var want []string // d1's commands in the order they were accepted
	for range 2 {
		want = append(want, create(t, db, newCmd("d1")).ID)
	}

	// Started again with the clock right.
	db = reopen(t, db, Options{})
	for range 3 {
		c := create(t, db, newCmd("d1"))
		if u, err := uuid.Parse(c.ID); err != nil || u.Version() != 7 || u.Variant() != uuid.RFC4122 || u.String() != c.ID {
			t.Fatalf("id %q after the clock went back is not a canonical UUIDv7 (%v)", c.ID, err)
		}
		want = append(want, c.ID)
	}
	if !slices.IsSorted(want) {
		t.Errorf("ids in acceptance order = %v; want them rising", want)
	}
	queued, err := db.OpenCommands(ctx, companion.StateQueued)
	if err != nil || !slices.Equal(ids(queued), want) {
		t.Errorf("OpenCommands(queued) = %v, %v; want %v, in acceptance order", ids(queued), err, want)
	}
	list, _, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1", Limit: 2})
	if err != nil || !slices.Equal(ids(list), []string{want[4], want[3]}) {
		t.Errorf("ListCommands(d1, 2) = %v, %v; want the last two accepted, newest first", ids(list), err)
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
