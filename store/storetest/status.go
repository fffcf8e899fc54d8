package storetest

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testStatus(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"NeverReported", func(t *testing.T, s companion.Store) {
			st, err := s.Status(t.Context(), "d1")
			require.NoError(t, err)
			if st.DeviceID != "d1" || st.Online || st.Battery != nil || st.Seq != 0 || !st.UpdatedAt.IsZero() || !st.LastSeen.IsZero() {
				t.Errorf("Status(d1) = %+v; want the zero status of d1", st)
			}
		}},
		{"Ordering", testPutStatusOrdering},
		{"SeqFromAnotherEra", testStatusSeqFromAnotherEra},
		{"Invalid", func(t *testing.T, s companion.Store) {
			_, err := s.PutStatus(t.Context(), companion.Status{Seq: 1})
			assert.ErrorIs(t, err, companion.ErrInvalid, "PutStatus(no device)")
			_, err = s.PutStatus(t.Context(), companion.Status{DeviceID: "a\x00b", Seq: 1})
			assert.ErrorIs(t, err, companion.ErrInvalid, "PutStatus(NUL in device id)")
		}},
		{"MarkBridgeOffline", testMarkBridgeOffline},
		{"FromTheBridgeItLeft", testStatusFromTheBridgeItLeft},
		{"FromTheBridgeItLeftForNone", testStatusFromTheBridgeItLeftForNone},
		{"SettingsFromTheBridgeItLeft", testSettingsFromTheBridgeItLeft},
	})
}

// A status from a bridge other than the one that serves the device is
// not stored: the broker checks the device's bridge before the write, and
// a move that commits in between set the device offline with seq 0, which
// the old bridge's late report, with its clock for a seq, would overwrite:
// the device read online, on the bridge it left, for good
// (docs/reliability.md, bug 266). A move to no bridge: bug 271, below.
func testStatusFromTheBridgeItLeft(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	put := func(bridge string, seq uint64) bool { t.Helper(); return putD3(t, s, bridge, true, seq) }
	want := func(online bool, bridge string) { t.Helper(); wantD3(t, s, online, bridge) }
	_, err := s.AssignDevice(ctx, "d3", "op1", "")
	require.NoError(t, err)
	require.True(t, put("op1", 10), "a report of the device's bridge")
	_, err = s.AssignDevice(ctx, "d3", "op2", "")
	require.NoError(t, err)
	want(false, "")
	assert.False(t, put("op1", 20), "a report of the bridge it left, after the move")
	want(false, "")
	assert.True(t, put("op2", 5), "a report of its new bridge")
	want(true, "op2")
}

// A status from a bridge, of a device no bridge serves, is not stored:
// the broker drops it (served), but a move to no bridge (the admin's or
// the user's unassignment, the bridge deleted) that commits between its
// check and the write set the device offline, and the bridge it left,
// stored over that, read online on it for good (docs/reliability.md, bug
// 271). A status that names no bridge is taken as before.
func testStatusFromTheBridgeItLeftForNone(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	put := func(bridge string, online bool, seq uint64) bool { t.Helper(); return putD3(t, s, bridge, online, seq) }
	want := func(online bool, bridge string) { t.Helper(); wantD3(t, s, online, bridge) }
	_, err := s.AssignDevice(ctx, "d3", "op1", "")
	require.NoError(t, err)
	require.True(t, put("op1", true, 10), "a report of the device's bridge")
	_, err = s.AssignDevice(ctx, "d3", "", "")
	require.NoError(t, err)
	want(false, "")
	assert.False(t, put("op1", true, 20), "a report of the bridge it left for none, after the move")
	want(false, "")
	assert.True(t, put("", false, 30), "a status naming no bridge")
	want(false, "")

	// Its bridge deleted: the same.
	_, err = s.AssignDevice(ctx, "d3", "op2", "")
	require.NoError(t, err)
	require.True(t, put("op2", true, 5), "a report of its new bridge")
	_, err = s.DeleteBridge(ctx, "op2", "")
	require.NoError(t, err)
	want(false, "")
	assert.False(t, put("op2", true, 40), "a report of its deleted bridge")
	want(false, "")
}

// Settings reported through a bridge that no longer serves the device are
// not stored: the broker checks the device's bridge before the write, and
// a move that commits in between set their seq to 0; the old bridge's
// late report, its clock for a seq (up to a day ahead), then held the new
// bridge's reports off: GET …/settings read the old bridge's values, and a
// change that succeeded did not show (docs/reliability.md, bug 272).
// Settings that name no bridge keep the rule of seq alone.
func testSettingsFromTheBridgeItLeft(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	ahead := uint64(time.Now().Add(12 * time.Hour).UnixNano())
	put := func(bridge, volume string, seq uint64) bool {
		t.Helper()
		ok, err := s.PutReportedSettings(ctx, "d3", bridge, map[string]json.RawMessage{"volume": raw(volume)}, nil, now(), seq)
		require.NoError(t, err)
		return ok
	}
	want := func(volume string) {
		t.Helper()
		set, err := s.Settings(ctx, "d3")
		require.NoError(t, err)
		if !equalRaw(set.Reported, map[string]string{"volume": volume}) {
			t.Errorf("Settings(d3).Reported = %s; want volume %s", set.Reported, volume)
		}
	}
	assign(t, s, "d3", "op1", "")
	require.True(t, put("op1", "10", ahead), "settings of the device's bridge, its clock ahead")
	assign(t, s, "d3", "op2", "")
	assert.False(t, put("op1", "20", ahead+1), "settings of the bridge it left, after the move")
	want("10")
	assert.True(t, put("op2", "30", uint64(time.Now().UnixNano())), "settings of its new bridge, its clock behind the old one's")
	want("30")
	assign(t, s, "d3", "", "")
	assert.False(t, put("op2", "40", ahead+2), "settings of the bridge it left for none")
	want("30")
	assert.True(t, put("", "50", ahead+3), "settings naming no bridge: seq alone decides")
	want("50")
}

// A report replaces the stored status when its seq is higher, or equal
// with a later time; never an older one.
func testPutStatusOrdering(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "br1", "d1")
	t0 := now().Add(-72 * time.Hour)

	// Each step is applied to the state the previous steps left.
	steps := []struct {
		name        string
		seq         uint64
		at          time.Time
		battery     int
		wantApplied bool
		wantBattery int
	}{
		{"first report", 10, t0, 90, true, 90},
		{"higher seq", 20, t0.Add(time.Second), 80, true, 80},
		{"lower seq, later time", 15, t0.Add(time.Hour), 70, false, 80},
		{"same seq, same time", 20, t0.Add(time.Second), 60, false, 80},
		{"same seq, earlier time", 20, t0, 60, false, 80},
		{"same seq, later time", 20, t0.Add(2 * time.Second), 50, true, 50},
		{"seq zero", 0, t0.Add(48 * time.Hour), 40, false, 50},
		{"much higher seq, earlier time", 1 << 40, t0.Add(-time.Hour), 30, true, 30},
	}
	var last companion.Status
	for _, st := range steps {
		applied, err := s.PutStatus(ctx, companion.Status{
			DeviceID: "d1", Online: true, Battery: intp(st.battery), BridgeID: "br1",
			FirmwareVersion: "1.0.0", Model: "sim-1", Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}},
			LastSeen: st.at, Seq: st.seq,
		})
		require.NoError(t, err, "%s: PutStatus", st.name)
		assert.Equal(t, st.wantApplied, applied, "%s: PutStatus(seq %d) applied", st.name, st.seq)
		got, err := s.Status(ctx, "d1")
		require.NoError(t, err)
		if got.Battery == nil || *got.Battery != st.wantBattery {
			t.Errorf("%s: battery = %v; want %d", st.name, got.Battery, st.wantBattery)
		}
		if applied {
			assert.Equal(t, st.seq, got.Seq, "%s: Seq", st.name)
			assert.True(t, got.LastSeen.Equal(st.at), "%s: LastSeen = %v; want %v", st.name, got.LastSeen, st.at)
			near(t, st.name+": UpdatedAt", got.UpdatedAt)
			assert.False(t, got.UpdatedAt.Before(last.UpdatedAt), "%s: UpdatedAt %v went back from %v", st.name, got.UpdatedAt, last.UpdatedAt)
		} else {
			sameStatus(t, st.name+": a report not applied changes nothing", got, last)
		}
		last = got
	}
	assert.Equal(t, "d1", last.DeviceID)
	assert.True(t, last.Online)
	assert.Equal(t, "br1", last.BridgeID)
	assert.Equal(t, "1.0.0", last.FirmwareVersion)
	assert.Equal(t, "sim-1", last.Model)
	assert.Equal(t, []companion.App{{AppID: "clock", Version: "1.0.0"}}, last.Apps)
}

func testMarkBridgeOffline(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "br1", "d1", "d2", "d4")
	serve(t, s, "br2", "d3")
	put := func(dev, bridge string, seq uint64) {
		t.Helper()
		ok, err := s.PutStatus(ctx, companion.Status{DeviceID: dev, Online: true, BridgeID: bridge, LastSeen: now(), Seq: seq})
		require.NoError(t, err, "PutStatus(%s, %s)", dev, bridge)
		require.True(t, ok, "PutStatus(%s, %s) applied", dev, bridge)
	}
	put("d1", "br1", 1)
	put("d2", "br1", 1)
	put("d3", "br2", 1)
	put("d4", "br1", 1)
	serve(t, s, "br2", "d4")
	put("d4", "br2", 2) // d4 moved to br2: br1's Will must not touch it
	ids, err := s.BridgeDevices(ctx, "br1")
	require.NoError(t, err)
	assert.Equal(t, []string{"d1", "d2"}, ids, "BridgeDevices(br1)")
	ids, err = s.BridgeDevices(ctx, "br2")
	require.NoError(t, err)
	assert.Equal(t, []string{"d3", "d4"}, ids, "BridgeDevices(br2)")

	before := map[string]companion.Status{}
	for _, dev := range []string{"d1", "d2", "d3", "d4"} {
		before[dev], err = s.Status(ctx, dev)
		require.NoError(t, err)
	}
	ids, err = s.MarkBridgeOffline(ctx, "br1")
	require.NoError(t, err)
	assert.Equal(t, []string{"d1", "d2"}, ids, "MarkBridgeOffline(br1)")
	for _, c := range []struct {
		dev    string
		online bool
	}{{"d1", false}, {"d2", false}, {"d3", true}, {"d4", true}} {
		st, err := s.Status(ctx, c.dev)
		require.NoError(t, err)
		assert.Equal(t, c.online, st.Online, "Status(%s).Online", c.dev)
		if c.online {
			sameStatus(t, "Status("+c.dev+") of another bridge", st, before[c.dev])
			continue
		}
		// Seq and LastSeen are kept, so the bridge's next report applies.
		assert.Equal(t, uint64(1), st.Seq, "Status(%s).Seq", c.dev)
		assert.True(t, st.LastSeen.Equal(before[c.dev].LastSeen), "Status(%s).LastSeen = %v; want kept %v", c.dev, st.LastSeen, before[c.dev].LastSeen)
		assert.Equal(t, "br1", st.BridgeID, "Status(%s).BridgeID", c.dev)
		near(t, "Status("+c.dev+").UpdatedAt", st.UpdatedAt)
		assert.False(t, st.UpdatedAt.Before(before[c.dev].UpdatedAt), "Status(%s).UpdatedAt went back", c.dev)
	}
	// A Will again (the bridge came back and went before it reported
	// anything), or one of a bridge that reported its devices offline
	// itself (out of its radio's range): none is written again, nor
	// returned, for the broker republishes the status of each it returns
	// (bug 456).
	ids, err = s.MarkBridgeOffline(ctx, "br1")
	require.NoError(t, err)
	assert.Empty(t, ids, "MarkBridgeOffline(br1) with its devices offline already")
	// The bridge's next report (a higher seq) brings the device back.
	put("d1", "br1", 2)
	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, st.Online, "d1 online after a newer report")
	ids, err = s.MarkBridgeOffline(ctx, "br9")
	require.NoError(t, err)
	assert.Empty(t, ids, "MarkBridgeOffline(br9)")
	ids, err = s.BridgeDevices(ctx, "br9")
	require.NoError(t, err)
	assert.Empty(t, ids, "BridgeDevices(br9)")
}

func testSettings(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"Empty", func(t *testing.T, s companion.Store) {
			st, err := s.Settings(t.Context(), "d1")
			require.NoError(t, err)
			if st.DeviceID != "d1" || st.Reported == nil || st.Desired == nil || len(st.Reported)+len(st.Desired) != 0 || st.Seq != 0 {
				t.Errorf("Settings(d1) = %+v; want empty non-nil maps", st)
			}
		}},
		{"ReportedDesiredMerge", testReportedSettings},
		{"SeqFromAnotherEra", testSettingsSeqFromAnotherEra},
		{"DesiredFollowsTheCommands", testDesiredFollowsTheCommands},
		{"DesiredOnlyWithTheCommand", testDesiredOnlyWithTheCommand},
		{"DesiredWithdrawnWhenTheChangeEnds", testDesiredWithdrawnWhenTheChangeEnds},
		{"DesiredDroppedWhenTheChangeSucceededBehindANewerReport", testDesiredDroppedWhenTheChangeSucceededBehindANewerReport},
		{"DesiredBackToAnEarlierChange", testDesiredBackToAnEarlierChange},
		{"DesiredBeforeAnyReport", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			desire(t, s, "d1", "", map[string]string{"volume": "30"})
			st, err := s.Settings(ctx, "d1")
			require.NoError(t, err)
			assert.True(t, equalRaw(st.Desired, map[string]string{"volume": "30"}), "Desired = %s", st.Desired)
			assert.NotNil(t, st.Reported)
			assert.Empty(t, st.Reported)
			// A first report is applied whatever its seq.
			ok, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw("30")}, nil, now(), 1)
			require.NoError(t, err)
			assert.True(t, ok, "first PutReportedSettings applied")
			st, err = s.Settings(ctx, "d1")
			require.NoError(t, err)
			assert.Empty(t, st.Desired, "Desired once the device reports the value")
		}},
		{"Invalid", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			_, err := s.PutReportedSettings(ctx, "", "", map[string]json.RawMessage{"x": raw("1")}, nil, now(), 1)
			assert.ErrorIs(t, err, companion.ErrInvalid, "PutReportedSettings(no device)")
			_, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"x": raw("{")}, nil, now(), 1)
			assert.ErrorIs(t, err, companion.ErrInvalid, "PutReportedSettings(bad JSON value)")
			_, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"x": raw("1")}, raw("{"), now(), 1)
			assert.ErrorIs(t, err, companion.ErrInvalid, "PutReportedSettings(bad JSON schema)")
			st, err := s.Settings(ctx, "d1")
			require.NoError(t, err)
			assert.Empty(t, st.Reported, "Settings(d1) after refused reports")
			assert.Zero(t, st.Seq)
		}},
	})
}

func testReportedSettings(t *testing.T, s companion.Store) {
	ctx := t.Context()
	t0 := now().Add(-time.Hour)
	schema := raw(`{"brightness": {"type": "int", "min": 0, "max": 100}}`)

	ok, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{
		"brightness": raw("50"), "volume": raw("50"), "language": raw(`"en"`),
	}, schema, t0, 1)
	require.NoError(t, err)
	require.True(t, ok, "PutReportedSettings applied")
	desire(t, s, "d1", "", map[string]string{"brightness": " 80 ", "volume": "20", "language": `"de"`})
	desire(t, s, "d1", "", map[string]string{"volume": "30"})

	st, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	if want := map[string]string{"brightness": "80", "volume": "30", "language": `"de"`}; !equalRaw(st.Desired, want) {
		t.Errorf("Desired = %s; want %v (merged, compacted)", st.Desired, want)
	}
	near(t, "Settings.UpdatedAt after a merge", st.UpdatedAt)

	// The device applied brightness and language (with other spacing);
	// volume is still pending.
	ok, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{
		"brightness": raw("80"), "volume": raw("50"), "language": raw(` "de"`),
	}, nil, t0.Add(time.Minute), 2)
	require.NoError(t, err)
	require.True(t, ok, "PutReportedSettings(seq 2) applied")
	st, err = s.Settings(ctx, "d1")
	require.NoError(t, err)
	if want := map[string]string{"volume": "30"}; !equalRaw(st.Desired, want) {
		t.Errorf("Desired after report = %s; want %v", st.Desired, want)
	}
	if want := map[string]string{"brightness": "80", "volume": "50", "language": `"de"`}; !equalRaw(st.Reported, want) {
		t.Errorf("Reported = %s; want %v", st.Reported, want)
	}
	assert.JSONEq(t, `{"brightness":{"type":"int","min":0,"max":100}}`, string(st.Schema), "Schema: the first report's, kept by a report without one")
	assert.Equal(t, uint64(2), st.Seq)
	assert.True(t, st.At.Equal(t0.Add(time.Minute)), "At = %v; want %v", st.At, t0.Add(time.Minute))
	near(t, "Settings.UpdatedAt", st.UpdatedAt)
	assert.Equal(t, "d1", st.DeviceID)

	// An older report changes nothing; so does one of the same seq and time.
	for _, old := range []struct {
		seq uint64
		at  time.Time
	}{{1, t0.Add(time.Hour)}, {2, t0.Add(time.Minute)}, {2, t0}} {
		ok, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw("30")}, raw(`{}`), old.at, old.seq)
		require.NoError(t, err)
		assert.False(t, ok, "PutReportedSettings(seq %d, at %v) applied", old.seq, old.at)
	}
	got, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.Len(t, got.Desired, 1, "Desired after older reports")
	assert.Len(t, got.Reported, 3, "Reported after older reports")
	assert.Equal(t, uint64(2), got.Seq)
	assert.JSONEq(t, string(st.Schema), string(got.Schema), "Schema after older reports")

	// Returned maps are copies.
	got.Desired["volume"] = raw("99")
	got.Reported["new"] = raw("1")
	again, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	if canon(again.Desired["volume"]) != "30" || len(again.Reported) != 3 {
		t.Errorf("Settings changed through a returned map: %+v", again)
	}

	// A newer report replaces the reported set (a key it lacks goes) and
	// a new schema replaces the old one.
	ok, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw("30")}, raw(`{"volume": {"type": "int"}}`), t0, 3)
	require.NoError(t, err)
	require.True(t, ok, "PutReportedSettings(seq 3) applied")
	got, err = s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, equalRaw(got.Reported, map[string]string{"volume": "30"}), "Reported = %s", got.Reported)
	assert.Empty(t, got.Desired, "Desired once volume is reported")
	assert.JSONEq(t, `{"volume":{"type":"int"}}`, string(got.Schema), "Schema of a newer report")
}

// A seq stored past companion.SeqLimit (before the broker refused such
// reports: a bridge's clock once years ahead, or 2^64−1) gives way to the
// next report within the limit, or the device's status would stay frozen
// at it; a seq within the limit is kept as ever.
func testStatusSeqFromAnotherEra(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "br1", "d1")
	put := func(seq uint64, battery int) bool {
		t.Helper()
		ok, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, Battery: intp(battery), BridgeID: "br1",
			LastSeen: now(), Seq: seq})
		require.NoError(t, err)
		return ok
	}
	battery := func() int {
		t.Helper()
		st, err := s.Status(ctx, "d1")
		require.NoError(t, err)
		require.NotNil(t, st.Battery)
		return *st.Battery
	}
	require.True(t, put(math.MaxUint64, 10), "a report of 2^64-1 stored")
	fresh := uint64(time.Now().UnixNano())
	assert.True(t, put(fresh, 20), "a report at the server's time after 2^64-1")
	assert.Equal(t, 20, battery())
	assert.False(t, put(fresh-1, 30), "an older report after it")
	ahead := companion.SeqLimit(time.Now()) - uint64(time.Hour)
	assert.True(t, put(ahead, 40), "a report within the limit")
	assert.False(t, put(fresh+1, 50), "a lower report after one within the limit")
	assert.Equal(t, 40, battery())
}

func testSettingsSeqFromAnotherEra(t *testing.T, s companion.Store) {
	ctx := t.Context()
	put := func(seq uint64, volume string) bool {
		t.Helper()
		ok, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw(volume)}, nil, now(), seq)
		require.NoError(t, err)
		return ok
	}
	require.True(t, put(math.MaxUint64, "1"), "a report of 2^64-1 stored")
	fresh := uint64(time.Now().UnixNano())
	assert.True(t, put(fresh, "2"), "a report at the server's time after 2^64-1")
	assert.False(t, put(fresh-1, "3"), "an older report after it")
	st, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.JSONEq(t, "2", string(st.Reported["volume"]))
	assert.Equal(t, fresh, st.Seq)
}

// putD3 stores a status of d3 as bridge reported it, and says whether the
// store took it.
func putD3(t *testing.T, s companion.Store, bridge string, online bool, seq uint64) bool {
	t.Helper()
	ok, err := s.PutStatus(t.Context(), companion.Status{DeviceID: "d3", Online: online, Battery: intp(50), FirmwareVersion: "1.0.0",
		BridgeID: bridge, LastSeen: now(), Seq: seq})
	require.NoError(t, err)
	return ok
}

// wantD3 checks that d3 reads online (or not) on bridge.
func wantD3(t *testing.T, s companion.Store, online bool, bridge string) {
	t.Helper()
	st, err := s.Status(t.Context(), "d3")
	require.NoError(t, err)
	if st.Online != online || st.BridgeID != bridge {
		t.Errorf("Status(d3) online %v on %q; want %v on %q", st.Online, st.BridgeID, online, bridge)
	}
}
