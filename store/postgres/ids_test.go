package postgres

import (
	"testing"
	"time"

	"github.com/google/uuid"
)

// Ids are UUIDv7 that rise with the clock, and within one millisecond;
// stay above the device's last id however far behind the clock is; and
// carry the device's hash.
func TestCommandIDs(t *testing.T) {
	var g idGen
	base := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	clock := base
	now := func() time.Time { return clock }
	var prev uuid.UUID
	for i := range 5000 {
		if i%1000 == 999 {
			clock = clock.Add(-time.Second) // a clock stepped back
		} else {
			clock = clock.Add(time.Microsecond)
		}
		at, id, err := g.next(now, "dev-1", uuid.UUID{})
		if err != nil {
			t.Fatal(err)
		}
		if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
			t.Fatalf("id %s: version %d, variant %v; want 7, RFC 4122", id, id.Version(), id.Variant())
		}
		if id.String() <= prev.String() {
			t.Fatalf("id %d: %s after %s; want rising", i, id, prev)
		}
		if !at.Equal(clock.Truncate(time.Microsecond)) {
			t.Fatalf("time %v; want the clock's %v", at, clock)
		}
		if commandHash(id) != deviceHash("dev-1") {
			t.Fatalf("id %s carries hash %#x; want %#x", id, commandHash(id), deviceHash("dev-1"))
		}
		prev = id
	}
	sec, nsec := id7Time(prev)
	if got := time.Unix(sec, nsec); got.Before(base) || got.After(base.Add(time.Minute)) {
		t.Errorf("last id's time %v; want near %v", got, base)
	}

	// Another replica's id, an hour ahead: the next id of the device is
	// above it.
	var other idGen
	_, ahead, err := other.next(func() time.Time { return base.Add(time.Hour) }, "dev-1", uuid.UUID{})
	if err != nil {
		t.Fatal(err)
	}
	_, id, err := g.next(now, "dev-1", ahead)
	if err != nil {
		t.Fatal(err)
	}
	if id.String() <= ahead.String() || id.Version() != 7 {
		t.Errorf("id %s after %s of a clock ahead; want above it, version 7", id, ahead)
	}
}

// id7Time is the time of a UUIDv7 to the millisecond.
func id7Time(u uuid.UUID) (sec, nsec int64) {
	ms := int64(stampOf(u) >> 12)
	return ms / 1000, ms % 1000 * 1e6
}
