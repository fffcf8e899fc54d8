package store

import (
	"crypto/sha256"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

func hashOf(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

// UserByTokenHash keeps its answers in memory; a token replaced while
// requests of its user go on finds nothing once SetUserToken returns,
// whatever those requests read before: an answer read before the change
// must not be kept after it.
func TestAReplacedTokenIsNotKeptByRequestsUnderWay(t *testing.T) {
	db := openTestDB(t)
	ctx := t.Context()
	require.NoError(t, db.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t0")}))
	for round := 1; round <= 50; round++ {
		old, next := hashOf(fmt.Sprint("t", round-1)), hashOf(fmt.Sprint("t", round))
		var (
			stop  atomic.Bool
			wg    sync.WaitGroup
			found atomic.Int64
		)
		for range 4 {
			wg.Go(func() {
				for !stop.Load() {
					if _, err := db.UserByTokenHash(ctx, old); err == nil {
						found.Add(1)
					}
				}
			})
		}
		require.NoError(t, db.SetUserToken(ctx, "u1", next))
		stop.Store(true)
		wg.Wait()
		_, err := db.UserByTokenHash(ctx, old)
		require.ErrorIs(t, err, companion.ErrNotFound, "round %d: the replaced token after SetUserToken returned (found %d times while it ran)", round, found.Load())
		u, err := db.UserByTokenHash(ctx, next)
		require.NoError(t, err, "round %d: the new token", round)
		assert.Equal(t, "u1", u.ID)
	}
}

// BenchmarkUserByTokenHash is the lookup every request of a user's makes.
func BenchmarkUserByTokenHash(b *testing.B) {
	db := openTestDB(b)
	require.NoError(b, db.CreateUser(b.Context(), companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))
	hash := hashOf("t1")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := db.UserByTokenHash(b.Context(), hash); err != nil {
				b.Fatal(err)
			}
		}
	})
}
