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
// devices that read offline: what a bridge away leaves behind.
func openBacklog(b *testing.B, n int) *store.DB {
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
			db.UpdateCommandAsync(c.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil },
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
