package postgres_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/store/postgres"
)

// BenchmarkCommandLife times what a command costs the PostgreSQL store
// from many writers at once (64 × GOMAXPROCS, like many API requests and
// replies): its creation (the 202), and creation with the three updates
// of its life (sent, delivered, succeeded), on a PostgreSQL of its own on
// this machine, synchronous_commit on.
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
		})
	}
}
