package store

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/devicecompanion/companion"
)

// FuzzEventCursor hands the event log whatever a client sends as its
// Last-Event-ID (or last_event_id): it is an event's id, which reads back
// as itself (in lower case), or ErrInvalidCursor, the same for Events and
// EventsPastEnd; and a page read after it holds only later events.
func FuzzEventCursor(f *testing.F) {
	for _, s := range []string{"", "0000000000000001", "00000000000000AB", "ffffffffffffffff", "+000000000000001", "0x00000000000001", "000000000000001", "0000_00000000001", "\u0660000000000000001"} {
		f.Add(s)
	}
	db := openTestDB(f)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, s string) {
		v, err := parseEventID(s)
		_, perr := db.EventsPastEnd(ctx, s)
		evs, next, eerr := db.Events(ctx, "", s, 5)
		if err != nil {
			if !errors.Is(err, companion.ErrInvalidCursor) || !errors.Is(perr, companion.ErrInvalidCursor) || !errors.Is(eerr, companion.ErrInvalidCursor) {
				t.Fatalf("cursor %q: parse %v, EventsPastEnd %v, Events %v; want ErrInvalidCursor from each", s, err, perr, eerr)
			}
			return
		}
		if perr != nil || eerr != nil {
			t.Fatalf("cursor %q read as %d, then EventsPastEnd %v, Events %v", s, v, perr, eerr)
		}
		if s != "" && eventID(v) != strings.ToLower(s) {
			t.Fatalf("cursor %q read as %d, whose id is %s", s, v, eventID(v))
		}
		for _, ev := range evs {
			if n, _ := parseEventID(ev.ID); n <= v {
				t.Fatalf("after %q, event %s", s, ev.ID)
			}
		}
		if n, err := parseEventID(next); err != nil || n < v {
			t.Fatalf("after %q, next cursor %q (%v)", s, next, err)
		}
	})
}
