package store

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

func intp(i int) *int { return &i }

func TestStatusNeverReported(t *testing.T) {
	db := openTestDB(t)
	s, err := db.Status(context.Background(), "d1")
	if err != nil {
		t.Fatal(err)
	}
	if s.DeviceID != "d1" || s.Online || s.Battery != nil || s.Seq != 0 || !s.UpdatedAt.IsZero() {
		t.Errorf("Status(d1) = %+v; want the zero status of d1", s)
	}
}

func TestPutStatusOrdering(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

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
	for _, st := range steps {
		clock.Advance(time.Minute)
		applied, err := db.PutStatus(ctx, companion.Status{
			DeviceID: "d1", Online: true, Battery: intp(st.battery), BridgeID: "br1",
			FirmwareVersion: "1.0.0", Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}},
			LastSeen: st.at, Seq: st.seq,
		})
		if err != nil {
			t.Fatalf("%s: PutStatus = %v", st.name, err)
		}
		if applied != st.wantApplied {
			t.Errorf("%s: PutStatus(seq %d) applied = %v; want %v", st.name, st.seq, applied, st.wantApplied)
		}
		s, err := db.Status(ctx, "d1")
		if err != nil {
			t.Fatal(err)
		}
		if s.Battery == nil || *s.Battery != st.wantBattery {
			t.Errorf("%s: battery = %v; want %d", st.name, s.Battery, st.wantBattery)
		}
		if applied && !s.UpdatedAt.Equal(clock.Now()) {
			t.Errorf("%s: UpdatedAt = %v; want %v", st.name, s.UpdatedAt, clock.Now())
		}
	}
	s, _ := db.Status(ctx, "d1")
	if len(s.Apps) != 1 || s.Apps[0].AppID != "clock" || s.FirmwareVersion != "1.0.0" {
		t.Errorf("Status = %+v", s)
	}
	if _, err := db.PutStatus(ctx, companion.Status{}); err == nil {
		t.Error("PutStatus(no device) = nil; want an error")
	}
}

func TestMarkBridgeOffline(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	put := func(dev, bridge string, seq uint64) {
		t.Helper()
		if ok, err := db.PutStatus(ctx, companion.Status{DeviceID: dev, Online: true, BridgeID: bridge, Seq: seq}); err != nil || !ok {
			t.Fatalf("PutStatus(%s, %s) = %v, %v", dev, bridge, ok, err)
		}
	}
	put("d1", "br1", 1)
	put("d2", "br1", 1)
	put("d3", "br2", 1)
	put("d4", "br1", 1)
	put("d4", "br2", 2) // d4 moved to br2: br1's Will must not touch it
	if ids, err := db.BridgeDevices(ctx, "br1"); err != nil || !slices.Equal(ids, []string{"d1", "d2"}) {
		t.Errorf("BridgeDevices(br1) = %v, %v; want [d1 d2]", ids, err)
	}

	clock.Advance(time.Hour)
	ids, err := db.MarkBridgeOffline(ctx, "br1")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ids, []string{"d1", "d2"}) {
		t.Errorf("MarkBridgeOffline(br1) = %v; want [d1 d2]", ids)
	}
	for _, c := range []struct {
		dev    string
		online bool
	}{{"d1", false}, {"d2", false}, {"d3", true}, {"d4", true}} {
		s, _ := db.Status(ctx, c.dev)
		if s.Online != c.online {
			t.Errorf("Status(%s).Online = %v; want %v", c.dev, s.Online, c.online)
		}
		if !c.online && (s.Seq != 1 || !s.UpdatedAt.Equal(clock.Now())) {
			t.Errorf("Status(%s) = %+v; want seq 1 and UpdatedAt now", c.dev, s)
		}
	}
	// The bridge's next report (a higher seq) brings the device back.
	put("d1", "br1", 2)
	if s, _ := db.Status(ctx, "d1"); !s.Online {
		t.Error("d1 still offline after a newer report")
	}
	if ids, err := db.MarkBridgeOffline(ctx, "br9"); err != nil || len(ids) != 0 {
		t.Errorf("MarkBridgeOffline(br9) = %v, %v; want none", ids, err)
	}
}

func raw(s string) json.RawMessage { return json.RawMessage(s) }

func TestSettingsEmpty(t *testing.T) {
	db := openTestDB(t)
	s, err := db.Settings(context.Background(), "d1")
	if err != nil {
		t.Fatal(err)
	}
	if s.DeviceID != "d1" || s.Reported == nil || s.Desired == nil || len(s.Reported)+len(s.Desired) != 0 {
		t.Errorf("Settings(d1) = %+v; want empty non-nil maps", s)
	}
}

func TestReportedSettingsClearDesired(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	schema := raw(`{"brightness": {"type": "int", "min": 0, "max": 100}}`)

	ok, err := db.PutReportedSettings(ctx, "d1", map[string]json.RawMessage{
		"brightness": raw("50"), "volume": raw("50"), "language": raw(`"en"`),
	}, schema, t0, 1)
	if err != nil || !ok {
		t.Fatalf("PutReportedSettings = %v, %v", ok, err)
	}
	mustNil(t, "MergeDesiredSettings", db.MergeDesiredSettings(ctx, "d1", map[string]json.RawMessage{
		"brightness": raw(" 80 "), "volume": raw("20"), "language": raw(`"de"`),
	}))
	mustNil(t, "MergeDesiredSettings", db.MergeDesiredSettings(ctx, "d1", map[string]json.RawMessage{"volume": raw("30")}))
	wantErr(t, "MergeDesiredSettings(bad JSON)", db.MergeDesiredSettings(ctx, "d1", map[string]json.RawMessage{"x": raw("{")}), companion.ErrInvalid)

	s, _ := db.Settings(ctx, "d1")
	if want := map[string]string{"brightness": "80", "volume": "30", "language": `"de"`}; !equalRaw(s.Desired, want) {
		t.Errorf("Desired = %s; want %v", s.Desired, want)
	}

	// The device applied brightness and language (with other spacing);
	// volume is still pending.
	clock.Advance(time.Minute)
	ok, err = db.PutReportedSettings(ctx, "d1", map[string]json.RawMessage{
		"brightness": raw("80"), "volume": raw("50"), "language": raw(` "de"`),
	}, nil, t0.Add(time.Minute), 2)
	if err != nil || !ok {
		t.Fatalf("PutReportedSettings = %v, %v", ok, err)
	}
	s, _ = db.Settings(ctx, "d1")
	if want := map[string]string{"volume": "30"}; !equalRaw(s.Desired, want) {
		t.Errorf("Desired after report = %s; want %v", s.Desired, want)
	}
	if want := map[string]string{"brightness": "80", "volume": "50", "language": `"de"`}; !equalRaw(s.Reported, want) {
		t.Errorf("Reported = %s; want %v", s.Reported, want)
	}
	if string(s.Schema) != `{"brightness":{"type":"int","min":0,"max":100}}` {
		t.Errorf("Schema = %s; want the first report's, compacted", s.Schema)
	}
	if s.Seq != 2 || !s.At.Equal(t0.Add(time.Minute)) || !s.UpdatedAt.Equal(clock.Now()) {
		t.Errorf("Settings = %+v; want seq 2, at t0+1m, updated now", s)
	}

	// An older report changes nothing.
	ok, err = db.PutReportedSettings(ctx, "d1", map[string]json.RawMessage{"volume": raw("30")}, nil, t0.Add(time.Hour), 1)
	if err != nil || ok {
		t.Errorf("PutReportedSettings(older) = %v, %v; want not applied", ok, err)
	}
	s, _ = db.Settings(ctx, "d1")
	if len(s.Desired) != 1 || len(s.Reported) != 3 {
		t.Errorf("Settings after older report = %+v", s)
	}

	// Returned maps are copies.
	s.Desired["volume"] = raw("99")
	s.Reported["new"] = raw("1")
	s2, _ := db.Settings(ctx, "d1")
	if string(s2.Desired["volume"]) != "30" || len(s2.Reported) != 3 {
		t.Errorf("Settings changed through a returned map: %+v", s2)
	}
}

// equalRaw compares JSON values with their expected text.
func equalRaw(got map[string]json.RawMessage, want map[string]string) bool {
	g := make(map[string]string, len(got))
	for k, v := range got {
		g[k] = string(v)
	}
	return maps.Equal(g, want)
}
