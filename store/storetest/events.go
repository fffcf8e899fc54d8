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

// RunEvents runs the conformance tests of the event log alone (Run runs
// them too), for an engine's quick check of them.
func RunEvents(t *testing.T, open func(t *testing.T) companion.Store) {
	testEvents(t, open)
}

func testEvents(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"CommandStates", testEventsCommandStates},
		{"DeviceStatus", testEventsDeviceStatus},
		{"BridgeOfflineInDeviceOrder", testEventsBridgeOfflineOrder},
		{"ResumeWithoutGap", testEventsResume},
		{"PerUser", testEventsPerUser},
		{"Head", testEventsHead},
		{"InvalidCursor", testEventsInvalidCursor},
		{"Retention", testEventsRetention},
		{"PurgedAfter", testEventsPurgedAfter},
		{"ConcurrentWriters", testEventsConcurrentWriters},
	})
	t.Run("PastEnd", func(t *testing.T) { testEventsPastEnd(t, open) })
}

// eventsAll reads every event of the user after the cursor, a page of
// limit at a time, and returns them with the last cursor.
func eventsAll(t testing.TB, s companion.Store, user, after string, limit int) ([]companion.Event, string) {
	t.Helper()
	var out []companion.Event
	for range 10000 {
		page, next, err := s.Events(t.Context(), user, after, limit)
		require.NoError(t, err, "Events(%q, %q, %d)", user, after, limit)
		require.NotEmpty(t, next, "Events(%q, %q) next cursor", user, after)
		out = append(out, page...)
		after = next
		if len(page) < limit {
			return out, after
		}
	}
	t.Fatal("Events never caught up")
	return nil, ""
}

// eventsOrdered fails the test unless the ids rise, as strings.
func eventsOrdered(t testing.TB, evs []companion.Event) {
	t.Helper()
	for i := 1; i < len(evs); i++ {
		if evs[i-1].ID >= evs[i].ID {
			t.Fatalf("event ids out of order: %q then %q", evs[i-1].ID, evs[i].ID)
		}
	}
}

func eventsStates(evs []companion.Event) []string {
	var out []string
	for _, ev := range evs {
		if ev.Command != nil {
			s := ev.Command.State
			if ev.Command.Progress != nil {
				s += fmt.Sprintf("(%d)", *ev.Command.Progress)
			}
			out = append(out, s)
		}
	}
	return out
}

// Every change of a command's state, progress or error is an event of
// its user, in order, in the transaction of the change.
func testEventsCommandStates(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	c := create(t, s, newCmd("d1"))
	setState(t, s, c.ID, companion.StateSent)
	setState(t, s, c.ID, companion.StateDelivered)
	for _, p := range []int{10, 10, 60} {
		_, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
			c.State, c.Progress = companion.StateInProgress, intp(p)
			return nil
		})
		require.NoError(t, err)
	}
	// Changes that a user does not see are no events.
	_, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.ExpiresAt = c.ExpiresAt.Add(time.Hour)
		return nil
	})
	require.NoError(t, err)
	_, err = s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State, c.Error = companion.StateFailed, &companion.CommandError{Code: "device_error", Message: "no"}
		return nil
	})
	require.NoError(t, err)

	evs, _ := eventsAll(t, s, "u1", "", 100)
	eventsOrdered(t, evs)
	assert.Equal(t, []string{"queued", "sent", "delivered", "in_progress(10)", "in_progress(60)", "failed(60)"}, eventsStates(evs))
	require.Len(t, evs, 6)
	for _, ev := range evs {
		assert.Equal(t, companion.EventCommand, ev.Kind)
		assert.Equal(t, "u1", ev.UserID)
		assert.Equal(t, "d1", ev.DeviceID)
		assert.Equal(t, c.ID, ev.Command.ID)
		assert.Equal(t, "push.text", ev.Command.Op)
		assert.Nil(t, ev.Device)
		near(t, "event At", ev.At)
	}
	assert.Equal(t, &companion.CommandError{Code: "device_error", Message: "no"}, evs[5].Command.Error)
	assert.Nil(t, evs[4].Command.Error)
	stored, err := s.Command(ctx, c.ID)
	require.NoError(t, err)
	assert.True(t, evs[5].At.Equal(stored.UpdatedAt), "last event At %v = the command's UpdatedAt %v", evs[5].At, stored.UpdatedAt)

	// A change refused (final already) is no event.
	_, err = s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
	require.ErrorIs(t, err, companion.ErrFinal)
	again, _ := eventsAll(t, s, "u1", "", 100)
	assert.Len(t, again, 6)
}

// Every status change of a bound device that a user sees is an event of
// the user it is bound to; a repeated report is not; an unbound device's
// are nobody's.
func testEventsDeviceStatus(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "m", "d1", "d2")
	bind(t, s, "u1", "d1")
	serve(t, s, "br1", "d1", "d2")
	t0 := now()
	put := func(dev string, seq uint64, online bool, battery int, fw string, apps ...companion.App) {
		t.Helper()
		applied, err := s.PutStatus(ctx, companion.Status{DeviceID: dev, Online: online, Battery: intp(battery), FirmwareVersion: fw,
			Model: "m", Apps: apps, BridgeID: "br1", LastSeen: t0.Add(time.Duration(seq) * time.Second), Seq: seq})
		require.NoError(t, err)
		require.True(t, applied)
	}
	put("d1", 1, true, 90, "1.0.0")
	put("d1", 2, true, 90, "1.0.0")                                          // the same: no event
	put("d1", 3, true, 90, "1.0.0", []companion.App{}...)                    // no apps as an empty list: the same
	put("d1", 4, true, 80, "1.0.0")                                          // battery
	put("d1", 5, true, 80, "1.1.0")                                          // firmware
	put("d1", 6, true, 80, "1.1.0", companion.App{AppID: "a", Version: "1"}) // apps
	put("d1", 7, true, 80, "1.1.0", companion.App{AppID: "a", Version: "1"}) // the same again
	put("d2", 1, true, 50, "1.0.0")                                          // bound to no one
	_, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: false, Battery: intp(1), Model: "m", BridgeID: "br1", LastSeen: t0, Seq: 1})
	require.NoError(t, err) // older: not applied, no event
	ids, err := s.MarkBridgeOffline(ctx, "br1")
	require.NoError(t, err)
	require.Equal(t, []string{"d1", "d2"}, ids)
	_, err = s.MarkBridgeOffline(ctx, "br1") // offline already: no event
	require.NoError(t, err)

	evs, _ := eventsAll(t, s, "u1", "", 100)
	eventsOrdered(t, evs)
	require.Len(t, evs, 5, "events: %+v", evs)
	type view struct {
		Online  bool
		Battery int
		FW      string
		Apps    int
	}
	var got []view
	for _, ev := range evs {
		require.Equal(t, companion.EventDevice, ev.Kind)
		require.NotNil(t, ev.Device)
		assert.Equal(t, "d1", ev.DeviceID)
		assert.Equal(t, "u1", ev.UserID)
		assert.NotNil(t, ev.Device.Apps, "apps is a list, never null")
		near(t, "event At", ev.At)
		got = append(got, view{ev.Device.Online, *ev.Device.Battery, ev.Device.FirmwareVersion, len(ev.Device.Apps)})
	}
	assert.Equal(t, []view{
		{true, 90, "1.0.0", 0}, {true, 80, "1.0.0", 0}, {true, 80, "1.1.0", 0}, {true, 80, "1.1.0", 1}, {false, 80, "1.1.0", 1},
	}, got)
	assert.Equal(t, []companion.App{{AppID: "a", Version: "1"}}, evs[3].Device.Apps)

	// A reply's report is an event too, after the command's.
	c := create(t, s, newCmd("d1"))
	st := companion.Status{Online: true, Battery: intp(70), FirmwareVersion: "2.0.0", Model: "m", BridgeID: "br1", LastSeen: t0.Add(time.Minute), Seq: 100}
	updateWithReport(t, s, c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil },
		companion.DeviceReport{Status: &st})
	more, _ := eventsAll(t, s, "u1", evs[len(evs)-1].ID, 100)
	require.Len(t, more, 3, "events: %+v", more)
	assert.Equal(t, []string{"queued", "succeeded"}, eventsStates(more))
	var dev *companion.Event
	for i := range more {
		if more[i].Kind == companion.EventDevice {
			dev = &more[i]
		}
	}
	require.NotNil(t, dev)
	assert.Equal(t, "2.0.0", dev.Device.FirmwareVersion)
}

// The devices a bridge's Will marks offline are announced in device
// order, as MarkBridgeOffline returns them, whatever order their
// statuses were last written in.
func testEventsBridgeOfflineOrder(t *testing.T, s companion.Store) {
	ctx := t.Context()
	devs := []string{"d1", "d2", "d3", "d4"}
	provision(t, s, "m", devs...)
	bind(t, s, "u1", devs...)
	serve(t, s, "br1", devs...)
	t0 := now()
	seq := uint64(0)
	for _, dev := range []string{"d3", "d1", "d4", "d2", "d1", "d3"} {
		seq++
		_, err := s.PutStatus(ctx, companion.Status{DeviceID: dev, Online: true, Battery: intp(int(seq)), Model: "m",
			BridgeID: "br1", LastSeen: t0.Add(time.Duration(seq) * time.Second), Seq: seq})
		require.NoError(t, err)
	}
	ids, err := s.MarkBridgeOffline(ctx, "br1")
	require.NoError(t, err)
	require.Equal(t, devs, ids, "MarkBridgeOffline")
	evs, _ := eventsAll(t, s, "u1", "", 100)
	var offline []string
	for _, ev := range evs {
		require.NotNil(t, ev.Device, "event %+v", ev)
		if !ev.Device.Online {
			offline = append(offline, ev.DeviceID)
		}
	}
	assert.Equal(t, devs, offline, "the devices of the offline events, in log order")
}

// Events after any event's id are exactly those that follow it, however
// they are paged, and the last cursor picks up what is written later.
func testEventsResume(t *testing.T, s companion.Store) {
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	for range 5 {
		c := create(t, s, newCmd("d1"))
		setState(t, s, c.ID, companion.StateSent)
	}
	all, last := eventsAll(t, s, "u1", "", 1000)
	require.Len(t, all, 10)
	eventsOrdered(t, all)
	for i, ev := range all {
		for _, limit := range []int{1, 3, 100} {
			rest, _ := eventsAll(t, s, "u1", ev.ID, limit)
			require.Equal(t, eventIDs(all[i+1:]), eventIDs(rest), "after event %d, pages of %d", i, limit)
		}
	}
	none, again := eventsAll(t, s, "u1", last, 10)
	assert.Empty(t, none)
	c := create(t, s, newCmd("d1"))
	after, _ := eventsAll(t, s, "u1", again, 10)
	require.Len(t, after, 1)
	assert.Equal(t, c.ID, after[0].Command.ID)
	after, _ = eventsAll(t, s, "u1", last, 10)
	require.Len(t, after, 1)
}

func eventIDs(evs []companion.Event) []string {
	out := []string{}
	for _, ev := range evs {
		out = append(out, ev.ID)
	}
	return out
}

// A user reads their own events only; "" reads everyone's.
func testEventsPerUser(t *testing.T, s companion.Store) {
	provision(t, s, "m", "d1", "d2")
	bind(t, s, "u1", "d1")
	bind(t, s, "u2", "d2")
	c1 := create(t, s, newCmd("d1"))
	c2 := newCmd("d2")
	c2.UserID = "u2"
	create(t, s, c2)
	setState(t, s, c1.ID, companion.StateSent)
	u1, _ := eventsAll(t, s, "u1", "", 100)
	u2, _ := eventsAll(t, s, "u2", "", 100)
	everyone, _ := eventsAll(t, s, "", "", 100)
	require.Len(t, u1, 2)
	require.Len(t, u2, 1)
	require.Len(t, everyone, 3)
	eventsOrdered(t, everyone)
	for _, ev := range u1 {
		assert.Equal(t, "u1", ev.UserID)
	}
	assert.Equal(t, "u2", u2[0].UserID)
	assert.Equal(t, "d2", u2[0].DeviceID)
	nobody, _ := eventsAll(t, s, "u3", "", 100)
	assert.Empty(t, nobody)
}

// EventsHead is the present: what follows it was written after.
func testEventsHead(t *testing.T, s companion.Store) {
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	create(t, s, newCmd("d1"))
	head, err := s.EventsHead(t.Context())
	require.NoError(t, err)
	evs, _ := eventsAll(t, s, "u1", head, 10)
	assert.Empty(t, evs, "events after the head")
	c := create(t, s, newCmd("d1"))
	evs, _ = eventsAll(t, s, "", head, 10)
	require.Len(t, evs, 1)
	assert.Equal(t, c.ID, evs[0].Command.ID)
	assert.Greater(t, evs[0].ID, head)
}

func testEventsInvalidCursor(t *testing.T, s companion.Store) {
	for _, c := range []string{"x", "12", "not-a-cursor-at-all", "-1"} {
		_, _, err := s.Events(t.Context(), "u1", c, 10)
		assert.ErrorIs(t, err, companion.ErrInvalidCursor, "Events(after %q)", c)
	}
}

// An id that a client kept across a reset of the store (here: an id of
// another store, whose log is longer) is past the end until the new log
// has assigned it, and no id that the store handed out ever is: its
// events' ids, its cursors, its head, the ids of events purged since.
func testEventsPastEnd(t *testing.T, open Opener) {
	ctx := t.Context()
	before := open(t)
	provision(t, before, "m", "d1")
	bind(t, before, "u1", "d1")
	for range 6 {
		create(t, before, newCmd("d1"))
	}
	kept, _ := eventsAll(t, before, "u1", "", 100)
	require.Len(t, kept, 6)
	keptID := kept[5].ID

	s := open(t) // after the reset
	pastEnd := func(id string) bool {
		t.Helper()
		past, err := s.EventsPastEnd(ctx, id)
		require.NoError(t, err, "EventsPastEnd(%q)", id)
		return past
	}
	head, err := s.EventsHead(ctx)
	require.NoError(t, err)
	assert.False(t, pastEnd(""), "EventsPastEnd(\"\") of an empty store")
	assert.False(t, pastEnd(head), "EventsPastEnd(head %q) of an empty store", head)
	assert.True(t, pastEnd(keptID), "EventsPastEnd(%q) of an empty store", keptID)

	// Five events: the last assigned is one before the kept id's.
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	for range 5 {
		create(t, s, newCmd("d1"))
	}
	evs, next := eventsAll(t, s, "u1", "", 100)
	require.Len(t, evs, 5)
	head, err = s.EventsHead(ctx)
	require.NoError(t, err)
	for _, id := range append(eventIDs(evs), next, head) {
		assert.False(t, pastEnd(id), "EventsPastEnd(%q), an id or cursor of the store", id)
	}
	assert.True(t, pastEnd(keptID), "EventsPastEnd(%q), past the last of 5 events %q", keptID, evs[4].ID)

	// The sixth: the kept id's place is assigned now.
	create(t, s, newCmd("d1"))
	assert.False(t, pastEnd(keptID), "EventsPastEnd(%q) once the store assigned 6 events", keptID)

	// A purge leaves the ids assigned.
	n, err := s.PurgeEvents(ctx, time.Now().Add(maxClockSkew))
	require.NoError(t, err)
	require.Equal(t, 6, n)
	for _, id := range append(eventIDs(evs), keptID) {
		assert.False(t, pastEnd(id), "EventsPastEnd(%q) after a purge", id)
	}

	for _, c := range []string{"x", "12", "not-a-cursor-at-all", "-1"} {
		_, err := s.EventsPastEnd(ctx, c)
		assert.ErrorIs(t, err, companion.ErrInvalidCursor, "EventsPastEnd(%q)", c)
	}
}

// EventsPurgedAfter tells the cursors before an event that PurgeEvents
// deleted, whoever's, from those the log still covers
// (docs/reliability.md, bug 274).
func testEventsPurgedAfter(t *testing.T, s companion.Store) {
	ctx := t.Context()
	purgedAfter := func(id string) bool {
		t.Helper()
		purged, err := s.EventsPurgedAfter(ctx, id)
		require.NoError(t, err, "EventsPurgedAfter(%q)", id)
		return purged
	}
	assert.False(t, purgedAfter(""), "EventsPurgedAfter(\"\") of an empty store")
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	provision(t, s, "m", "d2")
	bind(t, s, "u2", "d2")
	ofU2 := func() companion.Command {
		c := newCmd("d2")
		c.UserID = "u2"
		return c
	}
	create(t, s, newCmd("d1"))
	create(t, s, ofU2())
	create(t, s, newCmd("d1"))
	evs, _ := eventsAll(t, s, "", "", 10)
	require.Len(t, evs, 3)
	head, err := s.EventsHead(ctx)
	require.NoError(t, err)
	for _, id := range append(eventIDs(evs), "", head) {
		assert.False(t, purgedAfter(id), "EventsPurgedAfter(%q) before any purge", id)
	}
	n, err := s.PurgeEvents(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	require.Zero(t, n)
	assert.False(t, purgedAfter(""), "EventsPurgedAfter(\"\") after a purge that deleted nothing")

	n, err = s.PurgeEvents(ctx, time.Now().Add(maxClockSkew))
	require.NoError(t, err)
	require.Equal(t, 3, n)
	for _, id := range []string{"", evs[0].ID, evs[1].ID} {
		assert.True(t, purgedAfter(id), "EventsPurgedAfter(%q), before the purged %q", id, evs[2].ID)
	}
	assert.False(t, purgedAfter(evs[2].ID), "EventsPurgedAfter(%q), the last purged", evs[2].ID)
	head, err = s.EventsHead(ctx)
	require.NoError(t, err)
	assert.False(t, purgedAfter(head), "EventsPurgedAfter(head %q)", head)

	// A new event, and a purge that deletes nothing: the mark stays.
	create(t, s, ofU2())
	now, _ := eventsAll(t, s, "", evs[2].ID, 10)
	require.Len(t, now, 1)
	n, err = s.PurgeEvents(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	require.Zero(t, n)
	assert.False(t, purgedAfter(now[0].ID), "EventsPurgedAfter(%q), kept", now[0].ID)
	assert.True(t, purgedAfter(evs[1].ID), "EventsPurgedAfter(%q) after a purge that deleted nothing", evs[1].ID)

	for _, c := range []string{"x", "12", "not-a-cursor-at-all", "-1"} {
		_, err := s.EventsPurgedAfter(ctx, c)
		assert.ErrorIs(t, err, companion.ErrInvalidCursor, "EventsPurgedAfter(%q)", c)
	}
}

// PurgeEvents deletes the events older than its time, no others.
func testEventsRetention(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "m", "d1")
	bind(t, s, "u1", "d1")
	c := create(t, s, newCmd("d1"))
	setState(t, s, c.ID, companion.StateSent)
	n, err := s.PurgeEvents(ctx, time.Now().Add(-time.Hour))
	require.NoError(t, err)
	assert.Zero(t, n)
	evs, _ := eventsAll(t, s, "u1", "", 10)
	require.Len(t, evs, 2)
	n, err = s.PurgeEvents(ctx, time.Now().Add(maxClockSkew))
	require.NoError(t, err)
	assert.Equal(t, 2, n)
	gone, _ := eventsAll(t, s, "u1", "", 10)
	assert.Empty(t, gone)
	gone, _ = eventsAll(t, s, "", "", 10)
	assert.Empty(t, gone)
	// The log goes on after the purge, past the old ids.
	setState(t, s, c.ID, companion.StateDelivered)
	after, _ := eventsAll(t, s, "u1", evs[1].ID, 10)
	require.Len(t, after, 1)
	assert.Equal(t, companion.StateDelivered, after[0].Command.State)
}

// Writers on many devices at once, and a reader that keeps resuming from
// its last cursor meanwhile: the reader ends with every event, in order,
// none twice. (A log ordered by an id taken before commit would let it
// skip an event that took a lower id and committed later.)
func testEventsConcurrentWriters(t *testing.T, s companion.Store) {
	const writers, each = 8, 15
	for w := range writers {
		dev := fmt.Sprintf("d%d", w)
		provision(t, s, "m", dev)
		bind(t, s, "u1", dev)
	}
	stop := make(chan struct{})
	var (
		got     []companion.Event
		readErr error
		readers sync.WaitGroup
	)
	readers.Go(func() {
		after := ""
		for {
			select {
			case <-stop:
				return
			default:
			}
			page, next, err := s.Events(t.Context(), "u1", after, 7)
			if err != nil {
				readErr = err
				return
			}
			got = append(got, page...)
			after = next
		}
	})
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			dev := fmt.Sprintf("d%d", w)
			for range each {
				c, _, err := s.CreateCommand(t.Context(), newCmd(dev), 0, nil)
				if !assert.NoError(t, err) {
					return
				}
				ch := make(chan error, 1)
				s.UpdateCommandAsync(c.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil },
					func(_ companion.Command, err error) { ch <- err })
				assert.NoError(t, <-ch)
			}
		})
	}
	wg.Wait()
	all, _ := eventsAll(t, s, "u1", "", 1000)
	require.Len(t, all, writers*each*2)
	close(stop)
	readers.Wait()
	require.NoError(t, readErr)
	eventsOrdered(t, got)
	last := ""
	if len(got) > 0 {
		last = got[len(got)-1].ID
	}
	rest, _ := eventsAll(t, s, "u1", last, 1000)
	got = append(got, rest...)
	assert.Equal(t, eventIDs(all), eventIDs(got), "the reader's events, then the rest after its last one")
}
