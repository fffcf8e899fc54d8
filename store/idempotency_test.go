package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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

// PurgeIdempotency walks the records in bounded write transactions: a
// command accepted between two of them commits while the purge is under
// way, and the purge still deletes every old record and no young one.
func TestPurgeIdempotencyInBatches(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	db.purgeBatch = 3 // 48 records read a transaction at most
	cut := clock.Now()
	old, young := 0, 0
	for i := range 200 {
		at := cut.Add(-time.Hour)
		if i%4 == 0 {
			at, young = cut.Add(time.Hour), young+1
		} else {
			old++
		}
		mustNil(t, "PutIdempotency", db.PutIdempotency(ctx, companion.Idempotency{UserID: fmt.Sprint("u", i%7), Key: fmt.Sprint("k", i), Status: 200, CreatedAt: at}))
	}
	between := 0
	db.afterPurgeBatch = func() {
		between++
		done := make(chan error, 1)
		go func() {
			_, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d", Op: "push.text"}, 0, nil)
			done <- err
		}()
		select {
		case err := <-done:
			mustNil(t, "CreateCommand between the purge's transactions", err)
		case <-time.After(15 * time.Second): // only a deadlock takes this long
			t.Fatal("a command accepted between the purge's transactions did not commit")
		}
	}
	n, err := db.PurgeIdempotency(ctx, cut)
	if err != nil || n != old {
		t.Fatalf("PurgeIdempotency = %d, %v; want %d", n, err, old)
	}
	if between+1 < old/3 {
		t.Errorf("the purge ran in %d write transactions; want at least %d, a batch of 3 each", between+1, old/3)
	}
	for i := range 200 {
		_, err := db.Idempotency(ctx, fmt.Sprint("u", i%7), fmt.Sprint("k", i))
		if i%4 == 0 && err != nil {
			t.Errorf("young record k%d: %v", i, err)
		}
		if i%4 != 0 && !errors.Is(err, companion.ErrNotFound) {
			t.Errorf("old record k%d: %v; want purged", i, err)
		}
	}
}
