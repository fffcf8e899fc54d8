package store

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

func TestIdempotencyRecords(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	rec := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req"), Status: 201, Body: []byte(`{"ok":true}`), Location: "/x"}

	_, err := db.Idempotency(ctx, "u1", "k1")
	wantErr(t, "Idempotency(absent)", err, companion.ErrNotFound)
	mustNil(t, "PutIdempotency", db.PutIdempotency(ctx, rec))
	wantErr(t, "PutIdempotency(live)", db.PutIdempotency(ctx, rec), companion.ErrExists)
	wantErr(t, "PutIdempotency(no key)", db.PutIdempotency(ctx, companion.Idempotency{UserID: "u1"}), companion.ErrInvalid)

	got, err := db.Idempotency(ctx, "u1", "k1")
	if err != nil || got.Status != 201 || !bytes.Equal(got.Body, rec.Body) || got.Location != "/x" ||
		!bytes.Equal(got.RequestHash, rec.RequestHash) || !got.CreatedAt.Equal(clock.Now()) {
		t.Errorf("Idempotency(u1, k1) = %+v, %v", got, err)
	}
	_, err = db.Idempotency(ctx, "u2", "k1")
	wantErr(t, "Idempotency(other user)", err, companion.ErrNotFound)

	steps := []struct {
		advance time.Duration
		want    error
	}{
		{23*time.Hour + 59*time.Minute, nil},
		{time.Minute, companion.ErrNotFound}, // exactly 24 hours old
	}
	for _, st := range steps {
		clock.Advance(st.advance)
		_, err := db.Idempotency(ctx, "u1", "k1")
		wantErr(t, "Idempotency after "+st.advance.String(), err, st.want)
	}
	// An expired record is replaced.
	rec.Status = 200
	mustNil(t, "PutIdempotency(over expired)", db.PutIdempotency(ctx, rec))
	if got, _ := db.Idempotency(ctx, "u1", "k1"); got.Status != 200 {
		t.Errorf("Idempotency after replace = %+v", got)
	}
}

// A claim (Status 0) holds its key for IdempotencyClaimTTL, to the
// nanosecond: then its key is free for any request.
func TestIdempotencyClaimLifetime(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	claim := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req")}
	mustNil(t, "PutIdempotency(claim)", db.PutIdempotency(ctx, claim))

	clock.Advance(IdempotencyClaimTTL - time.Nanosecond)
	if got, err := db.Idempotency(ctx, "u1", "k1"); err != nil || got.Status != 0 {
		t.Errorf("Idempotency(claim a moment before it runs out) = %+v, %v; want the claim", got, err)
	}
	other := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("other")}
	wantErr(t, "PutIdempotency(another request's claim)", db.PutIdempotency(ctx, other), companion.ErrExists)

	clock.Advance(time.Nanosecond)
	_, err := db.Idempotency(ctx, "u1", "k1")
	wantErr(t, "Idempotency(claim run out)", err, companion.ErrNotFound)
	mustNil(t, "PutIdempotency(another request's claim, after)", db.PutIdempotency(ctx, other))
}
