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

	// A claim made an hour ahead of the clock was made before the clock
	// stepped back: its request died with it, and its key is free. It held
	// the key for the hour the clock took to catch up, every repeat
	// answered 409 idempotency_key_in_use (bug 336).
	ahead := now().Add(time.Hour)
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k5", RequestHash: hashOf("req"), CreatedAt: ahead}))
	_, err = s.Idempotency(ctx, "u1", "k5")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(a claim made before the clock stepped back)")
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k5", RequestHash: hashOf("req")}),
		"PutIdempotency(over a claim made before the clock stepped back)")
	// An answer made then still answers: a repeat gets it, not new work.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k6", RequestHash: hashOf("req"), Status: 200, CreatedAt: ahead}))
	_, err = s.Idempotency(ctx, "u1", "k6")
	assert.NoError(t, err, "Idempotency(an answer made before the clock stepped back)")
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

// A write given a request's answer (companion.WithAnswer) stores it over
// the request's claim in its own transaction: with the work, or not at
// all when the write fails, does nothing (Bind of a device bound
// already), or finds the key held by another request (ErrIdemConflict,
// and then the work is not done either). docs/reliability.md, bug 308.
func testAnswerWithWork(t *testing.T, s companion.Store) {
	ctx := t.Context()
	claim := func(key, req string) companion.Idempotency {
		t.Helper()
		c := companion.Idempotency{UserID: "admin", Key: key, RequestHash: hashOf(req)}
		require.NoError(t, s.PutIdempotency(ctx, c), "PutIdempotency(claim %s)", key)
		c.Status, c.Body = 201, []byte(`{"made":"`+key+`"}`)
		return c
	}
	status := func(key string) int {
		t.Helper()
		got, err := s.Idempotency(ctx, "admin", key)
		require.NoError(t, err, "Idempotency(%s)", key)
		return got.Status
	}

	answer := claim("k1", "user")
	require.NoError(t, s.CreateUser(companion.WithAnswer(ctx, answer), companion.User{ID: "u1", Name: "gina", TokenHash: hashOf("t1")}))
	got, err := s.Idempotency(ctx, "admin", "k1")
	require.NoError(t, err)
	assert.Equal(t, 201, got.Status, "the answer stored with the user")
	assert.Equal(t, answer.Body, got.Body)
	near(t, "CreatedAt of the answer", got.CreatedAt)

	answer = claim("k2", "user again")
	err = s.CreateUser(companion.WithAnswer(ctx, answer), companion.User{ID: "u1", Name: "gina", TokenHash: hashOf("t2")})
	require.ErrorIs(t, err, companion.ErrExists)
	assert.Equal(t, 0, status("k2"), "a write that failed stores no answer")

	require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "m", ClaimHash: hashOf("c")}))
	answer = claim("k3", "bind")
	_, created, err := s.Bind(companion.WithAnswer(ctx, answer), companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	require.True(t, created)
	assert.Equal(t, 201, status("k3"), "the answer stored with the binding")
	answer = claim("k4", "bind again")
	_, created, err = s.Bind(companion.WithAnswer(ctx, answer), companion.Binding{DeviceID: "d1", UserID: "u1"})
	require.NoError(t, err)
	require.False(t, created)
	assert.Equal(t, 0, status("k4"), "a Bind that binds nothing stores no answer")

	claim("k5", "someone else's")
	answer = companion.Idempotency{UserID: "admin", Key: "k5", RequestHash: hashOf("bridge"), Status: 201}
	err = s.CreateBridge(companion.WithAnswer(ctx, answer), companion.Bridge{ID: "b1", SecretHash: hashOf("s1")})
	require.ErrorIs(t, err, companion.ErrIdemConflict, "CreateBridge with a key another request holds")
	_, err = s.Bridge(ctx, "b1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "the bridge of a refused answer")
	assert.Equal(t, 0, status("k5"), "the other request's claim stays")
}

// A claimant gives up its own claim only: a claim's Body is its token,
// which giving it up carries. A request that stalled past its claim's
// minute, while a repeat of it claimed the key anew, and then failed gave
// up the repeat's claim, and a third repeat did the work alongside the
// second (docs/reliability.md, bug 311).
func testIdempotencyGiveUpOwnClaim(t *testing.T, s companion.Store) {
	ctx := t.Context()
	stalled := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req"), Body: []byte("first"),
		CreatedAt: now().Add(-idempotencyClaimTTL - maxClockSkew - time.Minute)}
	require.NoError(t, s.PutIdempotency(ctx, stalled), "PutIdempotency(a claim run out)")
	repeat := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req"), Body: []byte("second")}
	require.NoError(t, s.PutIdempotency(ctx, repeat), "PutIdempotency(a repeat's claim over it)")

	gaveUp := stalled
	gaveUp.CreatedAt = time.Unix(0, 0).UTC()
	assert.ErrorIs(t, s.PutIdempotency(ctx, gaveUp), companion.ErrExists, "PutIdempotency(the stalled request giving up)")
	got, err := s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err, "Idempotency: the repeat's claim, after the stalled request gave up")
	assert.Equal(t, []byte("second"), got.Body, "the claim holding the key")
	third := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req"), Body: []byte("third")}
	assert.ErrorIs(t, s.PutIdempotency(ctx, third), companion.ErrExists, "PutIdempotency(a third repeat's claim)")

	// The repeat gives up its own.
	gaveUp = repeat
	gaveUp.CreatedAt = time.Unix(0, 0).UTC()
	require.NoError(t, s.PutIdempotency(ctx, gaveUp), "PutIdempotency(the repeat giving up)")
	_, err = s.Idempotency(ctx, "u1", "k1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(given up)")
}
