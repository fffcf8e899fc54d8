package broker

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

var benchOpen = flag.Int("bench-open", 10000, "open commands in the store of BenchmarkResendPass and BenchmarkRetrySent (make bench: 10,000, a few seconds each with the setup)")

// openBacklog is a store holding n commands written sent, over 1,000
// devices that read offline: what a bridge away left behind when the
// outbox handed it every command.
func openBacklog(b *testing.B, n int) *store.DB {
	return openBacklogIn(b, n, companion.StateSent)
}

// openBacklogIn is openBacklog with the commands left in state: queued,
// for those the outbox holds for a bridge away.
func openBacklogIn(b *testing.B, n int, state string) *store.DB {
	b.Helper()
	db, err := store.Open(filepath.Join(b.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { db.Close() })
	var wg sync.WaitGroup
	errs := make(chan error, 1)
	fail := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	for i := range n {
		wg.Add(1)
		c := companion.Command{DeviceID: fmt.Sprintf("dev-%04d", i%1000), Op: "push.text",
			Payload: []byte(`{"text":"the weather today: sunny, then clouds from the west; 21 degrees"}`), ExpiresAt: time.Now().Add(24 * time.Hour)}
		db.CreateCommandAsync(c, 0, nil, func(c companion.Command, _ bool, err error) {
			if err != nil {
				fail(err)
				wg.Done()
				return
			}
			if state == companion.StateQueued {
				wg.Done()
				return
			}
			db.UpdateCommandAsync(c.ID, func(c *companion.Command) error { c.State = state; return nil },
				func(_ companion.Command, err error) {
					if err != nil {
						fail(err)
					}
					wg.Done()
				})
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	return db
}

// BenchmarkResendPass measures the outbox's read of the store for a pass
// that sends one device's unfinished commands again (its bridge came
// back, it read online again), with -bench-open commands open for 1,000
// devices: ns/op per pass.
func BenchmarkResendPass(b *testing.B) {
	db := openBacklog(b, *benchOpen)
	br := &Broker{st: db, log: slog.New(slog.DiscardHandler)}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		dev := fmt.Sprintf("dev-%04d", i%1000)
		cmds, err := br.pendingFromStore(false, map[string]bool{dev: true}, nil)
		if err != nil || len(cmds) != *benchOpen/1000 {
			b.Fatalf("pendingFromStore = %d commands, %v; want %d", len(cmds), err, *benchOpen/1000)
		}
	}
}

// BenchmarkRetrySent measures retrySent, the minute's look for commands
// sent long ago to online devices, with -bench-open commands sent to
// 1,000 devices that read offline: ns/op per look.
func BenchmarkRetrySent(b *testing.B) {
	db := openBacklog(b, *benchOpen)
	br, err := New(Options{Store: db, MQTTURL: "tcp://127.0.0.1:1", Logger: slog.New(slog.DiscardHandler), Now: func() time.Time { return time.Now().Add(time.Hour) }})
	if err != nil {
		b.Fatal(err)
	}
	retried := map[string]time.Time{}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		br.retrySent(context.Background(), retried)
	}
	b.StopTimer()
	br.mu.Lock()
	defer br.mu.Unlock()
	if len(br.resend) != 0 {
		b.Fatalf("retrySent sent again to %d devices, which read offline", len(br.resend))
	}
}

// BenchmarkHeldAwayRead measures the outbox's read of the queued commands
// (every 5 s, and with replicas on every command accepted) with
// -bench-open commands held queued for 1,000 devices of a bridge away,
// and one other queued command: "left-out" as it runs, the held devices
// left out (heldAway), "read-whole" as once a minute, every one read and
// decoded. ns/op per read.
func BenchmarkHeldAwayRead(b *testing.B) {
	db := openBacklogIn(b, *benchOpen, companion.StateQueued)
	if _, _, err := db.CreateCommand(context.Background(), companion.Command{DeviceID: "dev-other", Op: "push.text",
		Payload: []byte(`{"text":"x"}`), ExpiresAt: time.Now().Add(24 * time.Hour)}, 0, nil); err != nil {
		b.Fatal(err)
	}
	devices := make([]string, 1000)
	for i := range devices {
		devices[i] = fmt.Sprintf("dev-%04d", i)
	}
	for _, whole := range []bool{false, true} {
		name := map[bool]string{false: "left-out", true: "read-whole"}[whole]
		b.Run(name, func(b *testing.B) {
			br := &Broker{st: db, log: slog.New(slog.DiscardHandler), away: map[string]bool{"b1": true},
				awayDevices: map[string]string{}, lastFullRead: time.Now()}
			want := 1
			if whole {
				want += *benchOpen
			}
			b.ReportAllocs()
			for b.Loop() {
				br.mu.Lock()
				for _, d := range devices {
					br.awayDevices[d] = "b1" // a full read clears them, and publish holds them again
				}
				if whole {
					br.lastFullRead = time.Time{}
				}
				br.mu.Unlock()
				cmds, err := br.pendingFromStore(false, nil, nil)
				if err != nil || len(cmds) != want {
					b.Fatalf("pendingFromStore = %d commands, %v; want %d", len(cmds), err, want)
				}
			}
		})
	}
}
