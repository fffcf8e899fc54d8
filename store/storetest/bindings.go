package storetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testBindings(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"Bind", testBind},
		{"ConcurrentOneWinner", testBindConcurrent},
		{"Unbind", testUnbind},
		{"UnbindEndsTheUsersCommands", testUnbindEndsCommands},
		{"CommandsOnlyForTheOwner", testCommandsOnlyForTheOwner},
		{"NoCommandOutlivesAConcurrentUnbind", testNoCommandOutlivesUnbind},
		{"DesiredSettingsOnlyForTheOwner", testDesiredSettingsOnlyForTheOwner},
		{"ListBindings", testListBindings},
	})
}

func testBind(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1", "d2")
	fixed := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)

	var first companion.Binding // d1's binding as first stored
	tests := []struct {
		name        string
		b           companion.Binding
		wantCreated bool
		wantName    string
		wantBoundAt time.Time // zero: set by the store, checked loosely
		want        error
	}{
		{"new binding", companion.Binding{DeviceID: "d1", UserID: "u1", Name: "desk", Model: "ignored"}, true, "desk", time.Time{}, nil},
		{"same user again", companion.Binding{DeviceID: "d1", UserID: "u1", Name: "other name", BoundAt: fixed}, false, "desk", time.Time{}, nil},
		{"other user", companion.Binding{DeviceID: "d1", UserID: "u2"}, false, "", time.Time{}, companion.ErrBoundToOther},
		{"not provisioned", companion.Binding{DeviceID: "d9", UserID: "u1"}, false, "", time.Time{}, companion.ErrNotFound},
		{"given BoundAt", companion.Binding{DeviceID: "d2", UserID: "u2", BoundAt: fixed}, true, "", fixed, nil},
		{"no user", companion.Binding{DeviceID: "d2"}, false, "", time.Time{}, companion.ErrInvalid},
		{"no device", companion.Binding{UserID: "u1"}, false, "", time.Time{}, companion.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, created, err := s.Bind(ctx, tt.b)
			wantErr(t, err, tt.want, fmt.Sprintf("Bind(%+v)", tt.b))
			assert.Equal(t, tt.wantCreated, created, "Bind(%+v) created", tt.b)
			if err != nil {
				return
			}
			assert.Equal(t, tt.wantName, got.Name, "Bind(%+v).Name", tt.b)
			assert.Equal(t, "sim-1", got.Model, "Bind(%+v).Model: the registry's", tt.b)
			assert.Equal(t, tt.b.DeviceID, got.DeviceID)
			assert.Equal(t, tt.b.UserID, got.UserID)
			switch {
			case !tt.wantBoundAt.IsZero():
				assert.True(t, got.BoundAt.Equal(tt.wantBoundAt), "Bind(%+v).BoundAt = %v; want %v", tt.b, got.BoundAt, tt.wantBoundAt)
			case created:
				near(t, "Bind().BoundAt", got.BoundAt)
				first = got
			default: // the existing binding, unchanged
				assert.True(t, got.BoundAt.Equal(first.BoundAt), "Bind(same user again).BoundAt = %v; want the first %v", got.BoundAt, first.BoundAt)
			}
		})
	}

	b, err := s.Binding(ctx, "d1")
	require.NoError(t, err, "Binding(d1)")
	assert.Equal(t, "u1", b.UserID)
	assert.Equal(t, "sim-1", b.Model)
	assert.Equal(t, "desk", b.Name)
	_, err = s.Binding(ctx, "d9")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Binding(d9)")
	_, err = s.Binding(ctx, "")
	assert.ErrorIs(t, err, companion.ErrNotFound, `Binding("")`)
}

func testBindConcurrent(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	const n = 20
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		created int
		others  int
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, c, err := s.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: fmt.Sprintf("u%d", i)})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case c && err == nil:
				created++
			case errors.Is(err, companion.ErrBoundToOther):
				others++
			default:
				t.Errorf("Bind(d1, u%d) = %v, %v", i, c, err)
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, 1, created, "bindings created")
	assert.Equal(t, n-1, others, "ErrBoundToOther")
}

func testUnbind(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")
	unbind := func(dev, user string) error {
		_, err := s.Unbind(ctx, dev, user)
		return err
	}
	assert.ErrorIs(t, unbind("d1", "u2"), companion.ErrNotFound, "Unbind(other user)")
	assert.ErrorIs(t, unbind("d9", "u1"), companion.ErrNotFound, "Unbind(unknown device)")
	assert.ErrorIs(t, unbind("", "u1"), companion.ErrNotFound, `Unbind("")`)
	require.NoError(t, unbind("d1", "u1"), "Unbind")
	assert.ErrorIs(t, unbind("d1", "u1"), companion.ErrNotFound, "Unbind again")
	_, err := s.Binding(ctx, "d1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Binding after Unbind")
	bs, err := s.ListBindings(ctx, "u1", "", 0)
	require.NoError(t, err)
	assert.Empty(t, bs, "ListBindings after Unbind")
	ds, err := s.ListDevices(ctx, "u1", "", 0)
	require.NoError(t, err)
	assert.Empty(t, ds, "ListDevices after Unbind")
	// The device can be bound again, by anyone.
	_, created, err := s.Bind(ctx, companion.Binding{DeviceID: "d1", UserID: "u2"})
	require.NoError(t, err, "Bind after Unbind")
	assert.True(t, created, "Bind after Unbind created")
}

// What a user asked of a device and it has not done is theirs: after an
// unbind none of it is left to reach the device or its next owner.
func testUnbindEndsCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1", "d2")
	bind(t, s, "u1", "d1", "d2")
	var want []string // d1's unfinished commands, oldest first
	states := []string{companion.StateQueued, companion.StateSent, companion.StateDelivered, companion.StateInProgress}
	for _, st := range states {
		c := create(t, s, newCmd("d1"))
		if st != companion.StateQueued {
			setState(t, s, c.ID, st)
		}
		want = append(want, c.ID)
	}
	done := setState(t, s, create(t, s, newCmd("d1")).ID, companion.StateSucceeded)
	other := create(t, s, newCmd("d2")) // the user keeps d2
	setState(t, s, desire(t, s, "d1", "u1", map[string]string{"language": `"fr"`}).ID, companion.StateSucceeded)
	_, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"language": raw(`"en"`)}, nil, now(), 1)
	require.NoError(t, err)
	_, events, err := s.Events(ctx, "u1", "", 0)
	require.NoError(t, err)

	got, err := s.Unbind(ctx, "d1", "u1")
	require.NoError(t, err, "Unbind")
	require.Equal(t, want, ids(got.Ended), "Unbind ended the unfinished commands, oldest first")
	wantState := []string{companion.StateCanceled, companion.StateCanceled, companion.StateFailed, companion.StateFailed}
	for i, id := range want {
		c, err := s.Command(ctx, id)
		require.NoError(t, err)
		assert.Equal(t, wantState[i], c.State, "%s, %s before the unbind", id, states[i])
		if assert.NotNil(t, c.Error, "%s: error", id) {
			assert.Equal(t, companion.CodeDeviceUnbound, c.Error.Code, "%s: error code", id)
		}
		assert.Equal(t, c.State, got.Ended[i].State, "Unbound.Ended[%d] as stored", i)
	}
	c, err := s.Command(ctx, done.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, c.State, "a finished command stays as it was")
	c, err = s.Command(ctx, other.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateQueued, c.State, "a command of another device stays as it was")

	assert.Zero(t, countOpen(t, s, "d1"), "d1's open commands")
	open, err := s.OpenCommands(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{other.ID}, ids(open), "OpenCommands")
	st, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.Empty(t, st.Desired, "desired settings after the unbind")
	assert.True(t, equalRaw(st.Reported, map[string]string{"language": `"en"`}), "reported settings stay: %s", st.Reported)
	// The user hears of each command's end, as of any change of state.
	evs, _, err := s.Events(ctx, "u1", events, 0)
	require.NoError(t, err)
	var ended []string
	for _, ev := range evs {
		if ev.Command != nil {
			ended = append(ended, ev.Command.ID+" "+ev.Command.State)
		}
	}
	var wantEvents []string
	for i, id := range want {
		wantEvents = append(wantEvents, id+" "+wantState[i])
	}
	assert.Equal(t, wantEvents, ended, "u1's command events after the unbind")

	// The next owner starts with none of it: a queue limit of one takes
	// their first command.
	bind(t, s, "u2", "d1")
	c2 := newCmd("d1")
	c2.UserID = "u2"
	_, _, err = s.CreateCommand(ctx, c2, 1, nil)
	require.NoError(t, err, "the next owner's first command, with room for one")
	got, err = s.Unbind(ctx, "d1", "u2")
	require.NoError(t, err)
	assert.Len(t, got.Ended, 1, "u2's unbind ends u2's command")
}

func testListBindings(t *testing.T, s companion.Store) {
	ctx := t.Context()
	var mine []string
	for i := range 23 {
		mine = append(mine, fmt.Sprintf("dev-%02d", i))
	}
	provision(t, s, "sim-1", mine...)
	provision(t, s, "sim-1", "dev-05x", "zzz", "a")
	// Bind concurrently, as the API does.
	var wg sync.WaitGroup
	for _, id := range mine {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := s.Bind(ctx, companion.Binding{DeviceID: id, UserID: "u1"}); err != nil {
				t.Errorf("Bind(%s) = %v", id, err)
			}
		}()
	}
	bind(t, s, "u2", "dev-05x", "zzz", "a")
	wg.Wait()

	for _, limit := range []int{1, 5, 7, 23, 50} {
		t.Run(fmt.Sprint("limit ", limit), func(t *testing.T) {
			var got []string
			after := ""
			for pages := 0; ; pages++ {
				require.LessOrEqual(t, pages, 30, "pagination does not end")
				page, err := s.ListBindings(ctx, "u1", after, limit)
				require.NoError(t, err)
				require.LessOrEqual(t, len(page), limit, "ListBindings(limit %d)", limit)
				for _, b := range page {
					assert.Equal(t, "u1", b.UserID, "ListBindings(u1) gave %+v", b)
					assert.Equal(t, "sim-1", b.Model)
					got = append(got, b.DeviceID)
				}
				if len(page) < limit {
					break
				}
				after = page[len(page)-1].DeviceID
			}
			assert.Equal(t, mine, got, "pages")
		})
	}

	tests := []struct {
		user, after string
		limit       int
		want        []string
	}{
		{"u2", "", 0, []string{"a", "dev-05x", "zzz"}},
		{"u2", "a", 0, []string{"dev-05x", "zzz"}},
		{"u2", "b", 1, []string{"dev-05x"}},
		{"u2", "zzz", 10, nil},
		{"u1", "dev-21", 10, []string{"dev-22"}},
		{"u1", "", 3, []string{"dev-00", "dev-01", "dev-02"}},
		{"nobody", "", 10, nil},
	}
	for _, tt := range tests {
		page, err := s.ListBindings(ctx, tt.user, tt.after, tt.limit)
		require.NoError(t, err)
		var got []string
		for _, b := range page {
			got = append(got, b.DeviceID)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("ListBindings(%q, %q, %d) = %v; want %v", tt.user, tt.after, tt.limit, got, tt.want)
		}
	}
	_, err := s.ListBindings(ctx, "u1", "a\x00b", 10)
	assert.ErrorIs(t, err, companion.ErrInvalidCursor, "ListBindings(bad cursor)")
}

func testListDevices(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"WithStatus", testListDevicesWithStatus},
		{"Paging", testListDevicesPaging},
		{"PagingWhileTheyChange", testListDevicesPagingWhileTheyChange},
	})
}

// A cursor stays a place in the list when its device is unbound, and
// the pages after it hold every device bound throughout, once, with what
// was bound meanwhile after the cursor and without what was unbound.
func testListDevicesPagingWhileTheyChange(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "dev-0", "dev-1", "dev-2", "dev-3", "dev-4", "dev-5", "dev-6", "dev-2a", "dev-0a")
	bind(t, s, "u1", "dev-0", "dev-1", "dev-2", "dev-3", "dev-4", "dev-5", "dev-6")
	page, err := s.ListDevices(ctx, "u1", "", 3)
	require.NoError(t, err)
	require.Len(t, page, 3)
	cursor := page[2].Binding.DeviceID
	require.Equal(t, "dev-2", cursor)

	for _, dev := range []string{"dev-2", "dev-4"} {
		_, err := s.Unbind(ctx, dev, "u1")
		require.NoError(t, err, "Unbind(%s)", dev)
	}
	bind(t, s, "u1", "dev-2a", "dev-0a")
	var got []string
	for after := cursor; ; {
		page, err := s.ListDevices(ctx, "u1", after, 2)
		require.NoError(t, err, "ListDevices(after %q)", after)
		for _, d := range page {
			got = append(got, d.Binding.DeviceID)
		}
		if len(page) < 2 {
			break
		}
		after = page[len(page)-1].Binding.DeviceID
	}
	assert.Equal(t, []string{"dev-2a", "dev-3", "dev-5", "dev-6"}, got, "the pages after %q, unbound", cursor)
}

func testListDevicesWithStatus(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "a", "b", "c", "other")
	for _, id := range []string{"a", "b", "c"} {
		_, _, err := s.Bind(ctx, companion.Binding{DeviceID: id, UserID: "u1", Name: "name " + id})
		require.NoError(t, err)
	}
	bind(t, s, "u2", "other")
	for _, id := range []string{"a", "c"} {
		_, err := s.PutStatus(ctx, companion.Status{
			DeviceID: id, Online: true, Battery: intp(70), FirmwareVersion: "1.0.0",
			Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}}, LastSeen: now(), Seq: 1,
		})
		require.NoError(t, err)
	}

	tests := []struct {
		user, after string
		limit       int
		want        []string // device ids
		online      []bool
	}{
		{"u1", "", 0, []string{"a", "b", "c"}, []bool{true, false, true}},
		{"u1", "a", 1, []string{"b"}, []bool{false}},
		{"u1", "b", 10, []string{"c"}, []bool{true}},
		{"u2", "", 10, []string{"other"}, []bool{false}},
		{"nobody", "", 10, nil, nil},
	}
	for _, tt := range tests {
		ds, err := s.ListDevices(ctx, tt.user, tt.after, tt.limit)
		require.NoError(t, err)
		var got []string
		var online []bool
		for _, d := range ds {
			got = append(got, d.Binding.DeviceID)
			online = append(online, d.Status.Online)
			if d.Status.DeviceID != d.Binding.DeviceID || d.Binding.UserID != tt.user || d.Binding.Model != "sim-1" {
				t.Errorf("ListDevices(%q) gave %+v", tt.user, d)
			}
			if tt.user == "u1" && d.Binding.Name != "name "+d.Binding.DeviceID {
				t.Errorf("ListDevices(%q) gave %s named %q", tt.user, d.Binding.DeviceID, d.Binding.Name)
			}
			// The same as the single reads.
			st, err := s.Status(ctx, d.Binding.DeviceID)
			require.NoError(t, err)
			sameStatus(t, "ListDevices status of "+d.Binding.DeviceID, d.Status, st)
		}
		if !slices.Equal(got, tt.want) || !slices.Equal(online, tt.online) {
			t.Errorf("ListDevices(%q, %q, %d) = %v online %v; want %v online %v", tt.user, tt.after, tt.limit, got, online, tt.want, tt.online)
		}
	}
	_, err := s.ListDevices(ctx, "u1", "a\x00b", 10)
	assert.ErrorIs(t, err, companion.ErrInvalidCursor, "ListDevices(bad cursor)")
}

// ListDevices pages by device id like ListBindings, only the user's.
func testListDevicesPaging(t *testing.T, s companion.Store) {
	ctx := t.Context()
	var mine []string
	for i := range 11 {
		mine = append(mine, fmt.Sprintf("dev-%02d", i))
	}
	provision(t, s, "sim-1", mine...)
	provision(t, s, "sim-1", "dev-03x", "dev-99", "0")
	bind(t, s, "u1", mine...)
	bind(t, s, "u2", "dev-03x", "dev-99", "0")
	for _, limit := range []int{1, 3, 4, 11, 12} {
		var got []string
		after := ""
		for pages := 0; ; pages++ {
			require.LessOrEqual(t, pages, len(mine)+1, "ListDevices(limit %d) does not end", limit)
			page, err := s.ListDevices(ctx, "u1", after, limit)
			require.NoError(t, err)
			require.LessOrEqual(t, len(page), limit)
			if rest := len(mine) - len(got); len(page) != min(limit, rest) {
				t.Fatalf("ListDevices(u1, %q, %d) gave %d; want %d (a full page)", after, limit, len(page), min(limit, rest))
			}
			for _, d := range page {
				got = append(got, d.Binding.DeviceID)
			}
			if len(page) < limit {
				break
			}
			after = page[len(page)-1].Binding.DeviceID
		}
		assert.Equal(t, mine, got, "ListDevices(u1) pages of %d", limit)
	}
}

// sameStatus fails the test unless a and b are the same status, times
// compared as instants.
func sameStatus(t *testing.T, what string, a, b companion.Status) {
	t.Helper()
	norm := func(s companion.Status) companion.Status {
		s.LastSeen, s.UpdatedAt = s.LastSeen.UTC(), s.UpdatedAt.UTC()
		if len(s.Apps) == 0 {
			s.Apps = nil
		}
		return s
	}
	assert.Equal(t, norm(b), norm(a), what)
}

// A store takes a user's command for a device of the registry only while
// the device is bound to that user: not after the unbind, nor once another
// user has bound it (the API checks before it reads the body; the store
// checks in the write, CONTRACT §9).
func testCommandsOnlyForTheOwner(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")
	create(t, s, newCmd("d1"))
	if _, err := s.Unbind(ctx, "d1", "u1"); err != nil {
		t.Fatalf("Unbind = %v", err)
	}
	if _, _, err := s.CreateCommand(ctx, newCmd("d1"), 0, nil); !errors.Is(err, companion.ErrNotOwned) {
		t.Errorf("CreateCommand after the unbind = %v; want ErrNotOwned", err)
	}
	bind(t, s, "u2", "d1")
	if _, _, err := s.CreateCommand(ctx, newCmd("d1"), 0, nil); !errors.Is(err, companion.ErrNotOwned) {
		t.Errorf("CreateCommand of the previous owner = %v; want ErrNotOwned", err)
	}
	c := newCmd("d1")
	c.UserID = "u2"
	create(t, s, c)
	if n, err := s.CountOpen(ctx, "d1"); err != nil || n != 1 {
		t.Errorf("CountOpen(d1) = %d, %v; want 1, the new owner's", n, err)
	}
}

// Desired settings are recorded for the device's owner only, with the
// command that carries them: a settings command refused because the
// device is no longer the user's (an unbind committed after the API
// checked the binding) records nothing, and the old owner's values must
// not come back for the next one.
func testDesiredSettingsOnlyForTheOwner(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")
	desire(t, s, "d1", "u1", map[string]string{"volume": "10"})
	if _, err := s.Unbind(ctx, "d1", "u1"); err != nil {
		t.Fatalf("Unbind = %v", err)
	}
	_, _, err := s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"language": `"fr"`}), 0, nil)
	assert.ErrorIs(t, err, companion.ErrNotOwned, "settings command after the unbind")
	bind(t, s, "u2", "d1")
	_, _, err = s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"language": `"de"`}), 0, nil)
	assert.ErrorIs(t, err, companion.ErrNotOwned, "settings command of the previous owner")
	assert.Empty(t, desired(t, s, "d1"), "the next owner's desired settings")
	desire(t, s, "d1", "u2", map[string]string{"volume": "20"})
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "20"}), "Desired = %s", got)
}

// An unbind and a command of the same user racing each other: either the
// command is refused, or it is stored and the unbind ends it. None is
// left unfinished for the device's next owner.
func testNoCommandOutlivesUnbind(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	for i := range 30 {
		bind(t, s, "u1", "d1")
		var (
			wg      sync.WaitGroup
			cmd     companion.Command
			err     error
			unbound error
		)
		wg.Go(func() { cmd, _, err = s.CreateCommand(ctx, newCmd("d1"), 0, nil) })
		wg.Go(func() { _, unbound = s.Unbind(ctx, "d1", "u1") })
		wg.Wait()
		require.NoError(t, unbound, "round %d: Unbind", i)
		if err != nil {
			require.ErrorIs(t, err, companion.ErrNotOwned, "round %d: CreateCommand", i)
			continue
		}
		got, err := s.Command(ctx, cmd.ID)
		require.NoError(t, err)
		assert.True(t, companion.IsFinal(got.State), "round %d: a command stored across the unbind is %s", i, got.State)
	}
}
