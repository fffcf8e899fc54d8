package store

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
)

// A final state and the device state that came with it are stored in one
// transaction: a reader never sees one without the other.
func TestUpdateCommandWithReport(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	c, _, err := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "app.install"}, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, FirmwareVersion: "1.0.0", Seq: 10}); err != nil {
		t.Fatal(err)
	}
	settings, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": json.RawMessage(`70`)}, nil, time.Now(), 11)
	if err != nil {
		t.Fatal(err)
	}
	report := companion.DeviceReport{
		Status:   &companion.Status{DeviceID: "ignored", Online: true, FirmwareVersion: "1.0.0", Apps: []companion.App{{AppID: "clock", Version: "1.0.0"}}, Seq: 11},
		Settings: &settings,
	}
	done := make(chan error, 1)
	db.UpdateCommandWithReportAsync(c.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil }, report, func(_ companion.Command, err error) { done <- err })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s, _ := db.Status(ctx, "d1")
	if len(s.Apps) != 1 || s.Apps[0].AppID != "clock" || s.Seq != 11 {
		t.Errorf("status after the reply = %+v; want the app of the report", s)
	}
	if st, _ := db.Status(ctx, "ignored"); st.Seq != 0 {
		t.Errorf("the report's own device id was used: %+v", st)
	}
	set, _ := db.Settings(ctx, "d1")
	if string(set.Reported["volume"]) != "70" {
		t.Errorf("settings after the reply = %s; want volume 70", set.Reported)
	}

	// A repeat of the final reply (the command is final) changes nothing,
	// and an older report never overwrites a newer one.
	c2, _, _ := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "app.uninstall"}, 0, nil)
	old := companion.DeviceReport{Status: &companion.Status{Online: true, Apps: []companion.App{}, Seq: 5}}
	db.UpdateCommandWithReportAsync(c.ID, func(c *companion.Command) error { return nil }, old, func(_ companion.Command, err error) { done <- err })
	if err := <-done; !errors.Is(err, companion.ErrFinal) {
		t.Errorf("repeat = %v; want ErrFinal", err)
	}
	db.UpdateCommandWithReportAsync(c2.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil }, old, func(_ companion.Command, err error) { done <- err })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s, _ := db.Status(ctx, "d1"); len(s.Apps) != 1 {
		t.Errorf("an older report overwrote the status: %+v", s)
	}

	// A change fn refuses stores no report either.
	c3, _, _ := db.CreateCommand(ctx, companion.Command{DeviceID: "d1", Op: "app.uninstall"}, 0, nil)
	newer := companion.DeviceReport{Status: &companion.Status{Online: true, Apps: []companion.App{}, Seq: 99}}
	refused := errors.New("refused")
	db.UpdateCommandWithReportAsync(c3.ID, func(c *companion.Command) error { return refused }, newer, func(_ companion.Command, err error) { done <- err })
	if err := <-done; !errors.Is(err, refused) {
		t.Errorf("refused change = %v; want its error", err)
	}
	if s, _ := db.Status(ctx, "d1"); s.Seq == 99 {
		t.Errorf("a refused change stored its report")
	}
}
