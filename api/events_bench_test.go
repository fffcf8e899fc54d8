package api

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/require"
)

// BenchmarkEventsFanOut measures the server's cost of streaming a user's
// command events to 100 open streams of GET /api/v1/events while the
// commands are created by 16 writers at once, as under load: ns/op is per
// command, each delivered to every stream.
func BenchmarkEventsFanOut(b *testing.B) {
	const streams, writers = 100, 16
	// One user's 100 streams, past the bound a user has by default.
	e := newEventsEnv(b, EventsOptions{}, func(o *Options) { o.Limits.MaxStreamsPerUser = -1 })
	tok := e.bound("dev-1")
	bd, err := e.db.Binding(context.Background(), "dev-1")
	require.NoError(b, err)

	var got atomic.Int64
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); wg.Wait() }()
	for range streams {
		req, err := http.NewRequestWithContext(ctx, "GET", e.srv.URL+"/api/v1/events", nil)
		require.NoError(b, err)
		req.Header.Set("Authorization", "Bearer "+tok)
		res, err := e.srv.Client().Do(req)
		require.NoError(b, err)
		require.Equal(b, http.StatusOK, res.StatusCode)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer res.Body.Close()
			sc := bufio.NewScanner(res.Body)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "event: command") {
					got.Add(1)
				}
			}
		}()
	}
	b.ResetTimer()
	var next atomic.Int64
	var ww sync.WaitGroup
	for range writers {
		ww.Add(1)
		go func() {
			defer ww.Done()
			for next.Add(1) <= int64(b.N) {
				c := companion.Command{DeviceID: "dev-1", UserID: bd.UserID, Op: "push.text",
					Payload: []byte(`{"text":"hi"}`), ExpiresAt: time.Now().Add(time.Hour)}
				if _, _, err := e.db.CreateCommand(context.Background(), c, 0, nil); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	ww.Wait()
	deadline := time.Now().Add(time.Minute)
	for got.Load() < int64(streams*b.N) {
		if time.Now().After(deadline) || e.hub.Dropped() > 0 {
			b.Fatalf("%d of %d events streamed, %d streams dropped", got.Load(), streams*b.N, e.hub.Dropped())
		}
		time.Sleep(time.Millisecond)
	}
}
