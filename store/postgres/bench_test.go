package postgres_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
)

// BenchmarkCommandLife times what a command costs the PostgreSQL store
// from many writers at once (64 × GOMAXPROCS, like many API requests and
// replies): its creation (the 202), and creation with the three updates
// of its life (sent, delivered, succeeded), on a PostgreSQL of its own on
// this machine, synchronous_commit on. With the updates it also reports
// the bytes a finished command keeps on disk (the commands and events
// tables with their indexes, after VACUUM, per command): the B of
// docs/scale-out.md's sizing.
func BenchmarkCommandLife(b *testing.B) {
	srv := pgtest.Start(b)
	for _, updates := range []int{0, 3} {
		b.Run(fmt.Sprintf("updates=%d", updates), func(b *testing.B) {
			dsn := srv.NewDatabase(b)
			s, err := postgres.Open(context.Background(), dsn, postgres.Options{Migrate: true})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			ctx := context.Background()
			var n atomic.Int64
			states := []string{companion.StateSent, companion.StateDelivered, companion.StateSucceeded}[:updates]
			b.SetParallelism(64)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				dev := fmt.Sprintf("d%d", n.Add(1))
				for pb.Next() {
					c, _, err := s.CreateCommand(ctx, cmd(dev), 0, nil)
					if err != nil {
						b.Error(err)
						return
					}
					for _, st := range states {
						if _, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = st; return nil }); err != nil {
							b.Error(err)
							return
						}
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cmds/s")
			if updates > 0 {
				b.ReportMetric(bytesPerCommand(b, dsn), "disk_B/cmd")
			}
		})
	}
}

// bytesPerCommand is what the commands kept in dsn's database take on disk
// with their events and indexes, per command, after VACUUM frees the
// versions their updates left behind.
func bytesPerCommand(b *testing.B, dsn string) float64 {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "VACUUM commands, events"); err != nil {
		b.Fatal(err)
	}
	var per float64
	err = conn.QueryRow(ctx, `SELECT (pg_total_relation_size('commands') + pg_total_relation_size('events'))::float8 / greatest(count(*), 1) FROM commands`).Scan(&per)
	if err != nil {
		b.Fatal(err)
	}
	return per
}
