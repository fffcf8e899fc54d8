package store

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"
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

// Asking for the sent commands alone reads and decodes those, not every
// open command: the broker asks every minute (retrySent), and most open
// commands are queued (their device has no bridge, or is offline) or
// delivered (the bridge holds them while its device is out of reach).
// Here every other command is unreadable, so a read of any fails.
func TestOpenCommandsSentReadsOnlyThose(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	db := openTestDBWith(t, filepath.Join(t.TempDir(), "db"), Options{Now: clk.Now, Logger: quietLogger()})
	mk := func(ttl time.Duration) companion.Command {
		t.Helper()
		c := newCmd("d1")
		c.ExpiresAt = clk.Now().Add(ttl)
		return create(t, db, c)
	}
	late, queued, soon, delivered, running, done := mk(time.Hour), mk(time.Hour), mk(time.Minute), mk(time.Hour), mk(time.Hour), mk(time.Hour)
	setState(t, db, late.ID, companion.StateSent)
	setState(t, db, soon.ID, companion.StateSent) // expires before late, accepted after it
	setState(t, db, delivered.ID, companion.StateDelivered)
	setState(t, db, running.ID, companion.StateInProgress)
	setState(t, db, done.ID, companion.StateSucceeded)
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		for _, id := range []string{queued.ID, delivered.ID, running.ID, done.ID} {
			if err := tx.Bucket(bucketCommands).Put([]byte(id), []byte("not a command")); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := db.OpenCommands(ctx, companion.StateSent)
	if want := []string{late.ID, soon.ID}; err != nil || !slices.Equal(ids(got), want) {
		t.Errorf("OpenCommands(sent) = %v, %v; want %v (oldest first), reading no other command", ids(got), err, want)
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
