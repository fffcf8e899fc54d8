package storetest

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// idempotencyClaimTTL is how long a claim (a record with Status 0: its
// request is still being worked on) holds its key.
const idempotencyClaimTTL = time.Minute

// A request claims its key before its work, with a record of Status 0:
// another claim of the key, by any request, is refused, so that two
// overlapping requests with one key do the work once. The claimant then
// puts its answer over the claim, or gives the claim up by putting it
// again as made long ago; nobody else can do either.
func testIdempotencyClaims(t *testing.T, s companion.Store) {
	ctx := t.Context()
	claim := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req")}
	answer := claim
	answer.Status, answer.Body, answer.Location = 201, []byte(`{"id":"x"}`), "/x"
	gaveUp := claim
	gaveUp.CreatedAt = time.Unix(0, 0).UTC()

	require.NoError(t, s.PutIdempotency(ctx, claim), "PutIdempotency(claim)")
	got, err := s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err, "Idempotency(claimed)")
	assert.Equal(t, 0, got.Status, "Idempotency(claimed).Status")
	assert.Equal(t, claim.RequestHash, got.RequestHash)
	near(t, "Idempotency(claimed).CreatedAt", got.CreatedAt)

	other := claim
	other.RequestHash = hashOf("other")
	otherAnswer := answer
	otherAnswer.RequestHash = other.RequestHash
	otherGaveUp := gaveUp
	otherGaveUp.RequestHash = other.RequestHash
	for name, rec := range map[string]companion.Idempotency{
		"the same claim again":       claim,
		"a claim of another request": other,
		"another request's answer":   otherAnswer,
		"another request giving up":  otherGaveUp,
	} {
		assert.ErrorIs(t, s.PutIdempotency(ctx, rec), companion.ErrExists, "PutIdempotency(%s) over a claim", name)
	}
	got, err = s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err)
	assert.Equal(t, 0, got.Status, "still claimed")

	// The answer replaces the claim, and is then there to stay.
	require.NoError(t, s.PutIdempotency(ctx, answer), "PutIdempotency(answer over its claim)")
	got, err = s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err)
	assert.Equal(t, 201, got.Status)
	assert.Equal(t, answer.Body, got.Body)
	assert.Equal(t, "/x", got.Location)
	for name, rec := range map[string]companion.Idempotency{
		"a claim": claim, "the answer again": answer, "giving up": gaveUp,
	} {
		assert.ErrorIs(t, s.PutIdempotency(ctx, rec), companion.ErrExists, "PutIdempotency(%s) over an answer", name)
	}
	got, err = s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err)
	assert.Equal(t, 201, got.Status, "still answered")

	// Given up, the key is free: for another request too.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k2", RequestHash: hashOf("req")}))
	gaveUp.Key = "k2"
	require.NoError(t, s.PutIdempotency(ctx, gaveUp), "PutIdempotency(giving up a claim)")
	_, err = s.Idempotency(ctx, "u1", "k2")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(given up)")
	other.Key = "k2"
	require.NoError(t, s.PutIdempotency(ctx, other), "PutIdempotency(claim after giving up)")
	got, err = s.Idempotency(ctx, "u1", "k2")
	require.NoError(t, err)
	assert.Equal(t, other.RequestHash, got.RequestHash)

	// A claim whose request died frees its key when it runs out, long
	// before an answer would.
	// (A fresh claim holds its key: above.)
	at := now().Add(-idempotencyClaimTTL - maxClockSkew - time.Minute)
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k3", RequestHash: hashOf("req"), CreatedAt: at}))
	_, err = s.Idempotency(ctx, "u1", "k3")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(a claim run out)")
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k3", RequestHash: hashOf("other")}), "PutIdempotency(over a claim run out)")
	// An answer as old is still there.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k4", RequestHash: hashOf("req"), Status: 200, CreatedAt: at}))
	_, err = s.Idempotency(ctx, "u1", "k4")
	assert.NoError(t, err, "Idempotency(an answer as old)")
}

// Of many overlapping claims of one key, by one request or several, the
// store takes exactly one.
func testIdempotencyClaimRace(t *testing.T, s companion.Store) {
	ctx := t.Context()
	const n = 16
	var (
		wg  sync.WaitGroup
		won = make([]error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			won[i] = s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf(fmt.Sprint(i % 2))})
		}()
	}
	wg.Wait()
	taken := 0
	for i, err := range won {
		if err == nil {
			taken++
			continue
		}
		assert.ErrorIs(t, err, companion.ErrExists, "PutIdempotency(claim %d)", i)
	}
	assert.Equal(t, 1, taken, "claims taken")
}
