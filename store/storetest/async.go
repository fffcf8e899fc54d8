package storetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// asyncWait bounds the wait for an async write's done.
const asyncWait = 30 * time.Second

// await waits for ch or fails the test.
func await[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(asyncWait):
		t.Fatalf("%s: done not called within %v", what, asyncWait)
	}
	panic("unreachable")
}

type cmdResult struct {
	cmd companion.Command
	err error
}

// updateWithReport runs UpdateCommandWithReportAsync and waits for it.
func updateWithReport(t *testing.T, s companion.Store, id string, fn func(*companion.Command) error, report companion.DeviceReport) (companion.Command, error) {
	t.Helper()
	ch := make(chan cmdResult, 1)
	s.UpdateCommandWithReportAsync(id, fn, report, func(c companion.Command, err error) { ch <- cmdResult{c, err} })
	r := await(t, "UpdateCommandWithReportAsync("+id+")", ch)
	return r.cmd, r.err
}

func succeed(c *companion.Command) error {
	c.State = companion.StateSucceeded
	return nil
}

func testUpdateCommandWithReport(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"StoredInTheSameWrite", testReportStored},
		{"NewerStoredReportWins", testReportNewerWins},
		{"NotStoredWithoutTheChange", testReportNotStoredWithoutChange},
		{"SettingsFromTheBridgeItLeft", testReportSettingsFromTheBridgeItLeft},
	})
}

// The settings of a final reply of the bridge a device left, taken in as
// it moved, are not stored, as those of the settings topic are not (bug
// 272): the caller checked the device's bridge before the write, and a
// move that committed in between set the settings' seq to 0. Stored over
// that, the old bridge's, its clock ahead, held the new bridge's reports
// off, and GET …/settings read the old bridge's values (docs/reliability.md,
// bug 289). The reply's state is stored all the same.
func testReportSettingsFromTheBridgeItLeft(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	assign(t, s, "d1", "op1", "")
	ahead := now().Add(12 * time.Hour)
	ok, err := s.PutReportedSettings(ctx, "d1", "op1", map[string]json.RawMessage{"volume": raw(`10`)}, nil, ahead, uint64(ahead.UnixNano()))
	require.NoError(t, err)
	require.True(t, ok, "settings of the device's bridge, its clock ahead")
	c := create(t, s, newCmd("d1"))
	assign(t, s, "d1", "op2", "")
	late, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw(`20`)}, nil, ahead, uint64(ahead.UnixNano())+1)
	require.NoError(t, err)
	got, err := updateWithReport(t, s, c.ID, succeed, companion.DeviceReport{Settings: &late, BridgeID: "op1"})
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, got.State, "the final reply of the bridge it left")
	want := func(volume string) {
		t.Helper()
		set, err := s.Settings(ctx, "d1")
		require.NoError(t, err)
		if !equalRaw(set.Reported, map[string]string{"volume": volume}) {
			t.Errorf("Settings(d1).Reported = %s; want volume %s", set.Reported, volume)
		}
	}
	want("10")
	behind := uint64(now().UnixNano())
	ok, err = s.PutReportedSettings(ctx, "d1", "op2", map[string]json.RawMessage{"volume": raw(`30`)}, nil, now(), behind)
	require.NoError(t, err)
	assert.True(t, ok, "settings of its new bridge, its clock behind the old one's")
	want("30")

	// A final reply of the bridge that serves it is stored.
	c2 := create(t, s, newCmd("d1"))
	mine, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw(`40`)}, nil, now(), behind+1)
	require.NoError(t, err)
	_, err = updateWithReport(t, s, c2.ID, succeed, companion.DeviceReport{Settings: &mine, BridgeID: "op2"})
	require.NoError(t, err)
	want("40")
}

// A final state and the device state that came with it are stored in one
// write: whoever reads the one reads the other (CONTRACT §8).
func testReportStored(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "br1", "d1")
	bind(t, s, "u1", "d1")
	c := create(t, s, companion.Command{DeviceID: "d1", UserID: "u1", Op: "app.install", ExpiresAt: now().Add(time.Hour)})
	_, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, FirmwareVersion: "1.0.0", BridgeID: "br1", LastSeen: now(), Seq: 10})
	require.NoError(t, err)
	at := now()
	settings, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw(`70`)}, raw(`{"volume":{"type":"int"}}`), at, 11)
	require.NoError(t, err)
	report := companion.DeviceReport{
		Status: &companion.Status{
			DeviceID: "ignored", Online: true, FirmwareVersion: "1.1.0", BridgeID: "br1",
			Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}}, LastSeen: at, Seq: 11,
		},
		Settings: &settings,
	}
	got, err := updateWithReport(t, s, c.ID, succeed, report)
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, got.State, "the command done gives")
	assert.Equal(t, c.ID, got.ID)

	cmd, err := s.Command(ctx, c.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, cmd.State)
	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.Equal(t, []companion.App{{AppID: "clock", Version: "1.0.0"}}, st.Apps, "status after the reply: the report's apps")
	assert.Equal(t, "1.1.0", st.FirmwareVersion)
	assert.Equal(t, uint64(11), st.Seq)
	assert.Equal(t, "d1", st.DeviceID)
	near(t, "Status.UpdatedAt after the reply", st.UpdatedAt)
	other, err := s.Status(ctx, "ignored")
	require.NoError(t, err)
	assert.Zero(t, other.Seq, "the report's own device id was used: %+v", other)
	set, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, equalRaw(set.Reported, map[string]string{"volume": "70"}), "settings after the reply = %s; want volume 70", set.Reported)
	assert.Equal(t, uint64(11), set.Seq)
	assert.JSONEq(t, `{"volume":{"type":"int"}}`, string(set.Schema))
	// The report's status is stored as PutStatus stores it: it names the
	// bridge, so the bridge's Will reaches it.
	ids, err := s.BridgeDevices(ctx, "br1")
	require.NoError(t, err)
	assert.Equal(t, []string{"d1"}, ids, "BridgeDevices(br1)")

	// A report with only settings leaves the status alone, and the
	// other way round.
	c2 := create(t, s, newCmd("d1"))
	only, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw(`30`)}, nil, at, 12)
	require.NoError(t, err)
	_, err = updateWithReport(t, s, c2.ID, succeed, companion.DeviceReport{Settings: &only})
	require.NoError(t, err)
	st, err = s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.Equal(t, uint64(11), st.Seq, "status after a settings-only report")
	set, err = s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, equalRaw(set.Reported, map[string]string{"volume": "30"}), "settings after a settings-only report = %s", set.Reported)
	assert.JSONEq(t, `{"volume":{"type":"int"}}`, string(set.Schema), "schema kept by a report without one")

	// An empty report stores the change alone.
	c3 := create(t, s, newCmd("d1"))
	got, err = updateWithReport(t, s, c3.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil }, companion.DeviceReport{})
	require.NoError(t, err)
	assert.Equal(t, companion.StateSent, got.State)
}

// An older report never overwrites a newer one stored already; the
// command's change is stored all the same.
func testReportNewerWins(t *testing.T, s companion.Store) {
	ctx := t.Context()
	at := now()
	_, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, Apps: []companion.App{{AppID: "clock", Version: "2.0.0"}}, LastSeen: at, Seq: 20})
	require.NoError(t, err)
	_, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw("20")}, nil, at, 20)
	require.NoError(t, err)

	c := create(t, s, newCmd("d1"))
	oldSettings, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw("5")}, nil, at.Add(time.Hour), 5)
	require.NoError(t, err)
	old := companion.DeviceReport{Status: &companion.Status{Online: true, Apps: []companion.App{}, LastSeen: at.Add(time.Hour), Seq: 5}, Settings: &oldSettings}
	got, err := updateWithReport(t, s, c.ID, succeed, old)
	require.NoError(t, err)
	assert.Equal(t, companion.StateSucceeded, got.State, "the change is stored with an older report")
	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.Equal(t, uint64(20), st.Seq, "an older report overwrote the status")
	assert.Len(t, st.Apps, 1, "an older report overwrote the status")
	set, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, equalRaw(set.Reported, map[string]string{"volume": "20"}), "an older report overwrote the settings: %s", set.Reported)

	// Same seq, later time: newer, as with PutStatus.
	c2 := create(t, s, newCmd("d1"))
	same := companion.DeviceReport{Status: &companion.Status{Online: true, Apps: []companion.App{}, LastSeen: at.Add(time.Second), Seq: 20}}
	_, err = updateWithReport(t, s, c2.ID, succeed, same)
	require.NoError(t, err)
	st, err = s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.Empty(t, st.Apps, "a report of the same seq and a later time is newer")
}

// A report comes in only with its change: a refused change, a final
// command or an unknown one store no report.
func testReportNotStoredWithoutChange(t *testing.T, s companion.Store) {
	ctx := t.Context()
	c := create(t, s, newCmd("d1"))
	_, err := updateWithReport(t, s, c.ID, succeed, companion.DeviceReport{Status: &companion.Status{Online: true, Seq: 10}})
	require.NoError(t, err)

	newer := func(seq uint64) companion.DeviceReport {
		rs, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw("99")}, nil, now(), seq)
		require.NoError(t, err)
		return companion.DeviceReport{Status: &companion.Status{Online: true, FirmwareVersion: "9.9.9", Seq: seq}, Settings: &rs}
	}
	// A repeat of the final reply: the command is final.
	called := false
	got, err := updateWithReport(t, s, c.ID, func(*companion.Command) error { called = true; return nil }, newer(50))
	assert.ErrorIs(t, err, companion.ErrFinal, "a repeat on a final command")
	assert.False(t, called, "fn called on a final command")
	assert.Equal(t, companion.StateSucceeded, got.State, "ErrFinal comes with the stored command")

	// A change fn refuses.
	c2 := create(t, s, newCmd("d1"))
	refused := errors.New("refused")
	_, err = updateWithReport(t, s, c2.ID, func(*companion.Command) error { return refused }, newer(99))
	assert.ErrorIs(t, err, refused, "refused change")
	stored, err := s.Command(ctx, c2.ID)
	require.NoError(t, err)
	assert.Equal(t, companion.StateQueued, stored.State, "a refused change stored its command")

	// No such command.
	_, err = updateWithReport(t, s, uuid.NewString(), succeed, newer(100))
	assert.ErrorIs(t, err, companion.ErrNotFound, "unknown command")
	_, err = updateWithReport(t, s, "", succeed, newer(101))
	assert.ErrorIs(t, err, companion.ErrNotFound, `command ""`)

	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.Equal(t, uint64(10), st.Seq, "a report without its change was stored: %+v", st)
	set, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.Empty(t, set.Reported, "settings of a report without its change were stored")
}

// counter counts the calls of one done func.
type counter struct {
	name  string
	n     atomic.Int32
	first chan struct{}
}

func newCounter(name string) *counter { return &counter{name: name, first: make(chan struct{})} }

func (c *counter) hit() {
	if c.n.Add(1) == 1 {
		close(c.first)
	}
}

func testAsync(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"DoneCalledExactlyOnce", testDoneOnce},
		{"OneDeviceInOrder", testAsyncOrder},
	})
}

// Every async method calls done exactly once, whether the write is
// applied, not applied, or refused; and done gets the outcome.
func testDoneOnce(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "br1", "d1")
	bind(t, s, "u1", "d1")
	open := create(t, s, newCmd("d1"))
	final := create(t, s, newCmd("d1"))
	setState(t, s, final.ID, companion.StateSucceeded)
	_, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "br1", Seq: 10})
	require.NoError(t, err)
	_, _, err = s.CreateCommand(ctx, newCmd("full"), 0, nil)
	require.NoError(t, err)

	var counters []*counter
	check := func(name string, start func(hit func())) {
		c := newCounter(name)
		counters = append(counters, c)
		start(c.hit)
	}
	type boolResult struct {
		ok  bool
		err error
	}
	boolDone := func(name string, ch chan boolResult, want boolResult) {
		t.Helper()
		r := await(t, name, ch)
		if r.ok != want.ok || !errors.Is(r.err, want.err) || (want.err == nil && r.err != nil) {
			t.Errorf("%s: done(%v, %v); want (%v, %v)", name, r.ok, r.err, want.ok, want.err)
		}
	}

	for _, c := range []struct {
		name string
		st   companion.Status
		want boolResult
	}{
		{"PutStatusAsync(newer)", companion.Status{DeviceID: "d1", Online: true, BridgeID: "br1", Seq: 11}, boolResult{true, nil}},
		{"PutStatusAsync(older)", companion.Status{DeviceID: "d1", Online: true, BridgeID: "br1", Seq: 3}, boolResult{false, nil}},
		{"PutStatusAsync(no device)", companion.Status{Seq: 3}, boolResult{false, companion.ErrInvalid}},
	} {
		ch := make(chan boolResult, 2)
		check(c.name, func(hit func()) {
			s.PutStatusAsync(c.st, func(ok bool, err error) { hit(); ch <- boolResult{ok, err} })
		})
		boolDone(c.name, ch, c.want)
	}

	for _, c := range []struct {
		name     string
		dev      string
		reported map[string]json.RawMessage
		seq      uint64
		want     boolResult
	}{
		{"PutReportedSettingsAsync(newer)", "d1", map[string]json.RawMessage{"x": raw("1")}, 5, boolResult{true, nil}},
		{"PutReportedSettingsAsync(older)", "d1", map[string]json.RawMessage{"x": raw("2")}, 4, boolResult{false, nil}},
		{"PutReportedSettingsAsync(bad JSON)", "d1", map[string]json.RawMessage{"x": raw("{")}, 9, boolResult{false, companion.ErrInvalid}},
		{"PutReportedSettingsAsync(no device)", "", map[string]json.RawMessage{"x": raw("1")}, 9, boolResult{false, companion.ErrInvalid}},
	} {
		ch := make(chan boolResult, 2)
		check(c.name, func(hit func()) {
			s.PutReportedSettingsAsync(c.dev, "", c.reported, nil, now(), c.seq, func(ok bool, err error) { hit(); ch <- boolResult{ok, err} })
		})
		boolDone(c.name, ch, c.want)
	}

	for _, c := range []struct {
		name   string
		bridge string
		want   []string
	}{{"MarkBridgeOfflineAsync(br1)", "br1", []string{"d1"}}, {"MarkBridgeOfflineAsync(nope)", "nope", nil}, {`MarkBridgeOfflineAsync("")`, "", nil}} {
		type res struct {
			ids []string
			err error
		}
		ch := make(chan res, 2)
		check(c.name, func(hit func()) {
			s.MarkBridgeOfflineAsync(c.bridge, func(ids []string, err error) { hit(); ch <- res{ids, err} })
		})
		r := await(t, c.name, ch)
		if r.err != nil || !slices.Equal(r.ids, c.want) {
			t.Errorf("%s: done(%v, %v); want (%v, nil)", c.name, r.ids, r.err, c.want)
		}
	}

	for _, c := range []struct {
		name    string
		cmd     companion.Command
		maxOpen int
		want    error
	}{
		{"CreateCommandAsync", newCmd("d2"), 0, nil},
		{"CreateCommandAsync(no device)", companion.Command{}, 0, companion.ErrInvalid},
		{"CreateCommandAsync(queue full)", newCmd("full"), 1, companion.ErrQueueFull},
	} {
		type res struct {
			cmd    companion.Command
			replay bool
			err    error
		}
		ch := make(chan res, 2)
		check(c.name, func(hit func()) {
			s.CreateCommandAsync(c.cmd, c.maxOpen, nil, func(cmd companion.Command, replay bool, err error) { hit(); ch <- res{cmd, replay, err} })
		})
		r := await(t, c.name, ch)
		if !errors.Is(r.err, c.want) || (c.want == nil && r.err != nil) || r.replay {
			t.Errorf("%s: done(%v, %v); want error %v", c.name, r.replay, r.err, c.want)
		}
		if c.want == nil && (r.cmd.ID == "" || r.cmd.State != companion.StateQueued) {
			t.Errorf("%s: done(%+v); want the new command", c.name, r.cmd)
		}
	}

	boom := errors.New("boom")
	for _, c := range []struct {
		name string
		id   string
		fn   func(*companion.Command) error
		want error
	}{
		{"UpdateCommandAsync", open.ID, func(c *companion.Command) error { c.State = companion.StateSent; return nil }, nil},
		{"UpdateCommandAsync(fn fails)", open.ID, func(*companion.Command) error { return boom }, boom},
		{"UpdateCommandAsync(final)", final.ID, func(*companion.Command) error { return nil }, companion.ErrFinal},
		{"UpdateCommandAsync(unknown)", uuid.NewString(), func(*companion.Command) error { return nil }, companion.ErrNotFound},
		{`UpdateCommandAsync("")`, "", func(*companion.Command) error { return nil }, companion.ErrNotFound},
	} {
		ch := make(chan cmdResult, 2)
		check(c.name, func(hit func()) {
			s.UpdateCommandAsync(c.id, c.fn, func(cmd companion.Command, err error) { hit(); ch <- cmdResult{cmd, err} })
		})
		r := await(t, c.name, ch)
		if !errors.Is(r.err, c.want) || (c.want == nil && r.err != nil) {
			t.Errorf("%s: done(%v); want %v", c.name, r.err, c.want)
		}
	}

	for _, c := range []struct {
		name string
		id   string
		want error
	}{
		{"UpdateCommandWithReportAsync", open.ID, nil},
		{"UpdateCommandWithReportAsync(final)", final.ID, companion.ErrFinal},
		{"UpdateCommandWithReportAsync(unknown)", uuid.NewString(), companion.ErrNotFound},
		{`UpdateCommandWithReportAsync("")`, "", companion.ErrNotFound},
	} {
		ch := make(chan cmdResult, 2)
		report := companion.DeviceReport{Status: &companion.Status{Online: true, Seq: 12}}
		check(c.name, func(hit func()) {
			s.UpdateCommandWithReportAsync(c.id, succeed, report, func(cmd companion.Command, err error) { hit(); ch <- cmdResult{cmd, err} })
		})
		r := await(t, c.name, ch)
		if !errors.Is(r.err, c.want) || (c.want == nil && r.err != nil) {
			t.Errorf("%s: done(%v); want %v", c.name, r.err, c.want)
		}
	}

	// Every done was called; a second call would come soon after the
	// first, before a write made after them all is done, or shortly after.
	for _, c := range counters {
		await(t, c.name, c.first)
	}
	_, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, Seq: 100})
	require.NoError(t, err)
	assert.Never(t, func() bool {
		for _, c := range counters {
			if c.n.Load() != 1 {
				return true
			}
		}
		return false
	}, 100*time.Millisecond, 5*time.Millisecond, "a done func was called more than once")
	for _, c := range counters {
		assert.Equal(t, int32(1), c.n.Load(), "calls of %s's done", c.name)
	}
}

// Writes to one device are applied in the order they were made, however
// many are under way at once.
func testAsyncOrder(t *testing.T, s companion.Store) {
	const n = 20
	type res struct {
		i   int
		cmd companion.Command
		err error
	}
	ch := make(chan res, n)
	for i := range n {
		s.CreateCommandAsync(newCmd("d1"), 0, nil, func(cmd companion.Command, _ bool, err error) { ch <- res{i, cmd, err} })
	}
	made := make([]string, n)
	for range n {
		r := await(t, "CreateCommandAsync", ch)
		require.NoError(t, r.err, "CreateCommandAsync #%d", r.i)
		made[r.i] = r.cmd.ID
	}
	assert.True(t, slices.IsSorted(made), "ids of commands created one after the other: %v; want them rising", made)

	// Each change sees the one made before it.
	target := made[0]
	done := make(chan cmdResult, n)
	for i := range n {
		s.UpdateCommandAsync(target, func(c *companion.Command) error {
			if p := c.Progress; (p == nil && i != 0) || (p != nil && *p != i-1) {
				return fmt.Errorf("change %d saw progress %v", i, p)
			}
			c.State = companion.StateInProgress
			c.Progress = intp(i)
			return nil
		}, func(c companion.Command, err error) { done <- cmdResult{c, err} })
	}
	for range n {
		r := await(t, "UpdateCommandAsync", done)
		assert.NoError(t, r.err)
	}
	c, err := s.Command(t.Context(), target)
	require.NoError(t, err)
	if assert.NotNil(t, c.Progress) {
		assert.Equal(t, n-1, *c.Progress, "progress after %d changes in order", n)
	}

	// Status reports of one device likewise.
	sdone := make(chan error, n)
	for i := range n {
		s.PutStatusAsync(companion.Status{DeviceID: "d2", Online: true, Battery: intp(i), Seq: uint64(i + 1)}, func(ok bool, err error) {
			if err == nil && !ok {
				err = fmt.Errorf("report %d not applied", i)
			}
			sdone <- err
		})
	}
	for range n {
		assert.NoError(t, await(t, "PutStatusAsync", sdone))
	}
	st, err := s.Status(t.Context(), "d2")
	require.NoError(t, err)
	assert.Equal(t, uint64(n), st.Seq)
}
