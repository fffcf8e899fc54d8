package sim_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
)

func TestRepeatedCommandRunsOnce(t *testing.T) {
	d := sim.New(sim.Options{ID: "d"})
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := d.PushText(ctx, "cmd-1", "t", "hello"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := d.Executions("cmd-1"); n != 1 {
		t.Errorf("Executions = %d; want 1", n)
	}
	if n := len(d.Texts()); n != 1 {
		t.Errorf("%d texts; want 1", n)
	}
}

func TestSettings(t *testing.T) {
	d := sim.New(sim.Options{ID: "d"})
	ctx := context.Background()
	tests := []struct {
		values map[string]any
		ok     bool
	}{
		{map[string]any{"brightness": float64(80), "timezone": "Europe/Berlin", "language": "ja"}, true},
		{map[string]any{"brightness": float64(101)}, false},
		{map[string]any{"display_timeout_s": float64(4)}, false},
		{map[string]any{"language": "xx"}, false},
		{map[string]any{"timezone": "Mars/Olympus"}, false},
		{map[string]any{"do_not_disturb": "yes"}, false},
		{map[string]any{"colour": "red"}, false},
	}
	for i, tt := range tests {
		err := d.UpdateSettings(ctx, "cmd-"+string(rune('a'+i)), tt.values)
		if (err == nil) != tt.ok || (err != nil && !errors.Is(err, sim.ErrBadSettings)) {
			t.Errorf("UpdateSettings(%v) = %v; want ok %v", tt.values, err, tt.ok)
		}
	}
	got, schema, _ := d.Settings(ctx)
	if got["brightness"] != 80 || got["timezone"] != "Europe/Berlin" || got["language"] != "ja" || got["volume"] != 50 {
		t.Errorf("Settings() = %v", got)
	}
	if len(schema) != 6 {
		t.Errorf("schema has %d settings; want 6", len(schema))
	}
}

func TestBatteryDrains(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	d := sim.New(sim.Options{ID: "d", Now: clock})
	for _, tt := range []struct {
		after time.Duration
		want  int
	}{{0, 100}, {sim.DrainEvery, 99}, {10 * sim.DrainEvery, 90}, {1000 * sim.DrainEvery, sim.MinBattery}} {
		mu.Lock()
		now = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).Add(tt.after)
		mu.Unlock()
		info, _ := d.Info(context.Background())
		if info.Battery != tt.want {
			t.Errorf("battery after %v = %d; want %d", tt.after, info.Battery, tt.want)
		}
	}
}

func TestFirmwareAndApps(t *testing.T) {
	d := sim.New(sim.Options{ID: "d"})
	ctx := context.Background()
	var steps []int
	if err := d.UpdateFirmware(ctx, "ota", "2.0.0", []byte("image"), nil); !errors.Is(err, sim.ErrBadArgument) {
		t.Errorf("UpdateFirmware(not an MCUboot image) = %v; want ErrBadArgument", err)
	}
	img := mcuboot.MustBuild([]byte("application 2.0.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2}})
	if err := d.UpdateFirmware(ctx, "ota", "2.1.0", img, nil); !errors.Is(err, sim.ErrBadArgument) {
		t.Errorf("UpdateFirmware(2.0.0 as 2.1.0) = %v; want ErrBadArgument", err)
	}
	if err := d.UpdateFirmware(ctx, "ota", "2.0.0", img, func(p int) { steps = append(steps, p) }); err != nil {
		t.Fatal(err)
	}
	if d.Firmware() != "2.0.0" || !d.FirmwareConfirmed() || d.Boots() != 1 || len(steps) != 10 || steps[9] != 100 {
		t.Errorf("firmware %q (confirmed %v, %d boots), progress %v", d.Firmware(), d.FirmwareConfirmed(), d.Boots(), steps)
	}
	d.CrashNextBoot()
	img2 := mcuboot.MustBuild([]byte("application 2.1.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2, Minor: 1}})
	if err := d.UpdateFirmware(ctx, "ota-2", "2.1.0", img2, nil); !errors.Is(err, sim.ErrReverted) || d.Firmware() != "2.0.0" {
		t.Errorf("UpdateFirmware with a crashing image = %v, firmware %s; want ErrReverted, 2.0.0", err, d.Firmware())
	}
	// A padded image goes in without its padding; an image without the
	// hash TLV of the device's MCUboot is not booted.
	img3 := mcuboot.MustBuild([]byte("application 2.2.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2, Minor: 2}, SlotSize: 4096, Confirm: true})
	if err := d.UpdateFirmware(ctx, "ota-3", "2.2.0", img3, nil); err != nil || d.Firmware() != "2.2.0" {
		t.Errorf("UpdateFirmware with a padded image = %v, firmware %s; want 2.2.0", err, d.Firmware())
	}
	img4 := mcuboot.MustBuild([]byte("application 2.3.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2, Minor: 3}, Hash: mcuboot.TLVSHA512})
	if err := d.UpdateFirmware(ctx, "ota-4", "2.3.0", img4, nil); !errors.Is(err, sim.ErrReverted) || d.Firmware() != "2.2.0" {
		t.Errorf("UpdateFirmware with a SHA-512 image on a SHA-256 build = %v, firmware %s; want ErrReverted, 2.2.0", err, d.Firmware())
	}
	d512 := sim.New(sim.Options{ID: "d512", ImageHash: mcuboot.TLVSHA512})
	if err := d512.UpdateFirmware(ctx, "ota", "2.3.0", img4, nil); err != nil || d512.Firmware() != "2.3.0" {
		t.Errorf("UpdateFirmware with a SHA-512 image on a SHA-512 build = %v, firmware %s; want 2.3.0", err, d512.Firmware())
	}
	if err := d.InstallApp(ctx, "i1", "clock", "1.0.0", []byte("pkg")); err != nil {
		t.Fatal(err)
	}
	info, _ := d.Info(ctx)
	if info.FirmwareVersion != "2.2.0" || len(info.Apps) != 1 || info.Apps[0].AppID != "clock" {
		t.Errorf("Info() = %+v", info)
	}
	if err := d.UninstallApp(ctx, "u1", "clock"); err != nil {
		t.Fatal(err)
	}
	if err := d.UninstallApp(ctx, "u2", "clock"); !errors.Is(err, sim.ErrAppNotInstalled) {
		t.Errorf("second uninstall = %v; want ErrAppNotInstalled", err)
	}
}

func TestHooks(t *testing.T) {
	d := sim.New(sim.Options{ID: "d"})
	boom := errors.New("boom")
	d.FailNext(boom)
	if err := d.PushText(context.Background(), "c1", "", "x"); !errors.Is(err, boom) {
		t.Errorf("after FailNext: %v; want boom", err)
	}
	d.HangNext()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := d.PushText(ctx, "c2", "", "x"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("after HangNext: %v; want deadline exceeded", err)
	}
	if err := d.PushText(context.Background(), "c1", "", "x"); err != nil || d.Executions("c1") != 1 {
		t.Errorf("retry after failure: %v, executions %d; want it done once", err, d.Executions("c1"))
	}
}

// A device made again with the same StateDir drops the ids its earlier life
// ran, and its log counts each execution once; a line cut short by a crash
// is not an execution.
func TestStateDirSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	d, err := sim.Open(sim.Options{ID: "d", StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"cmd-1", "cmd-2", "cmd-1"} {
		if err := d.PushText(ctx, id, "", "hello"); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	path := sim.ExecLogPath(dir, "d")
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("cmd-3") // a crash in the middle of a write
	f.Close()

	d2, err := sim.Open(sim.Options{ID: "d", StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if n := d2.Executions("cmd-1"); n != 1 {
		t.Errorf("after reopening, Executions(%q) = %d; want 1", "cmd-1", n)
	}
	for _, id := range []string{"cmd-1", "cmd-2", "cmd-3"} {
		if err := d2.PushText(ctx, id, "", "again"); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(d2.Texts()); n != 1 {
		t.Errorf("%d texts after reopening; want 1 (only cmd-3 is new)", n)
	}
	counts, err := sim.ReadExecLog(path)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"cmd-1": 1, "cmd-2": 1, "cmd-3": 1}
	if len(counts) != len(want) {
		t.Errorf("ReadExecLog = %v; want %v", counts, want)
	}
	for id, n := range want {
		if counts[id] != n {
			t.Errorf("ReadExecLog(%q)[%q] = %d; want %d", path, id, counts[id], n)
		}
	}
}

// A device made again with the same StateDir is the device it was: its
// firmware (the old image kept in the secondary slot, the boot count), its
// apps, its settings, its battery's age. Firmware is only that of a new
// device.
func TestStateDirKeepsTheDevice(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	start := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	now := start
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	open := func() *sim.Device {
		t.Helper()
		d, err := sim.Open(sim.Options{ID: "d", StateDir: dir, Now: clock, Firmware: "1.0.0"})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	d := open()
	img := mcuboot.MustBuild([]byte("application 2.0.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2}})
	if err := d.UpdateFirmware(ctx, "ota", "2.0.0", img, nil); err != nil {
		t.Fatal(err)
	}
	if err := d.InstallApp(ctx, "i1", "clock", "1.2.0", []byte("pkg")); err != nil {
		t.Fatal(err)
	}
	if err := d.UpdateSettings(ctx, "s1", map[string]any{"volume": float64(7), "language": "fr", "do_not_disturb": true}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	now = start.Add(3 * sim.DrainEvery)
	mu.Unlock()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	d2 := open()
	defer d2.Close()
	info, err := d2.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.FirmwareVersion != "2.0.0" || !d2.FirmwareConfirmed() || d2.Boots() != 1 || info.Battery != 97 {
		t.Errorf("firmware %s (confirmed %v, %d boots), battery %d; want 2.0.0 confirmed after 1 boot, battery 97",
			info.FirmwareVersion, d2.FirmwareConfirmed(), d2.Boots(), info.Battery)
	}
	if want := map[string]string{"clock": "1.2.0"}; !maps.Equal(d2.Apps(), want) {
		t.Errorf("apps %v; want %v", d2.Apps(), want)
	}
	got, _, err := d2.Settings(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got["volume"] != 7 || got["language"] != "fr" || got["do_not_disturb"] != true || got["brightness"] != 50 {
		t.Errorf("settings %v; want volume 7, language fr, do_not_disturb, the others default", got)
	}
	// The image it ran before is in the secondary slot: an OTA back to it
	// swaps it in.
	back := mcuboot.MustBuild([]byte("application 2.1.0"), mcuboot.Options{Version: mcuboot.Version{Major: 2, Minor: 1}})
	if err := d2.UpdateFirmware(ctx, "ota-2", "2.1.0", back, nil); err != nil || d2.Firmware() != "2.1.0" || d2.Boots() != 2 {
		t.Errorf("OTA after reopening = %v, firmware %s after %d boots; want 2.1.0 after 2", err, d2.Firmware(), d2.Boots())
	}
	if err := d2.InstallApp(ctx, "i1", "clock", "9.9.9", nil); err != nil || d2.Apps()["clock"] != "1.2.0" {
		t.Errorf("a command run before reopening, again: %v, apps %v; want it dropped", err, d2.Apps())
	}
}

// A device keeps the images it was last sent up to MaxImageBytes, the
// newest whatever its size, as a watch's flash holds a few pictures: it
// kept 256 of them whatever their size, 512 MiB of 2 MiB images a device
// (docs/reliability.md, bug 364).
func TestImagesAreBoundedByTheirBytes(t *testing.T) {
	d := sim.New(sim.Options{ID: "d"})
	ctx := context.Background()
	const size = 2 << 20 // CONTRACT §6's largest image
	pushed := 3 * sim.MaxImageBytes / size
	for i := range pushed {
		img := make([]byte, size)
		img[0] = byte(i)
		if err := d.PushImage(ctx, fmt.Sprintf("cmd-%d", i), "image/png", img); err != nil {
			t.Fatal(err)
		}
	}
	imgs := d.Images()
	total := 0
	for _, img := range imgs {
		total += len(img.Data)
	}
	if total > sim.MaxImageBytes || len(imgs) == 0 || imgs[len(imgs)-1].CmdID != fmt.Sprintf("cmd-%d", pushed-1) {
		t.Errorf("the device keeps %d images of %d bytes in all, the newest %q; want at most %d bytes, the newest cmd-%d",
			len(imgs), total, imgs[len(imgs)-1].CmdID, sim.MaxImageBytes, pushed-1)
	}
	big := make([]byte, sim.MaxImageBytes+1)
	if err := d.PushImage(ctx, "cmd-big", "image/png", big); err != nil {
		t.Fatal(err)
	}
	if imgs := d.Images(); len(imgs) != 1 || imgs[0].CmdID != "cmd-big" {
		t.Errorf("after an image larger than the bound, the device keeps %d images; want that one", len(imgs))
	}
}

// A device with a StateDir reads back the end of its execution log, the
// ids it remembers, not the whole log: the log gains a line a command for
// as long as the device runs (it is the tests' record), and a device read
// it all at every start, in time and memory (docs/reliability.md, bug
// 382). The log here has 16 MiB of lines before the ids of its last
// commands.
func TestStateDirReadsTheEndOfALongLog(t *testing.T) {
	dir := t.TempDir()
	path := sim.ExecLogPath(dir, "d")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(f)
	line := []byte("00000000-0000-7000-8000-000000000000\n")
	for i := range (16 << 20) / len(line) { // 16 MiB of ids
		copy(line[24:36], fmt.Appendf(nil, "%012x", i))
		w.Write(line)
	}
	w.WriteString("cmd-1\ncmd-2\ncmd-3") // the last one cut short by a crash
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	d, err := sim.Open(sim.Options{ID: "d", StateDir: dir})
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if read := after.TotalAlloc - before.TotalAlloc; read > 8<<20 {
		t.Errorf("Open allocated %d MiB for a log whose last lines it needs", read>>20)
	}
	ctx := context.Background()
	for _, id := range []string{"cmd-1", "cmd-2", "cmd-3"} {
		if err := d.PushText(ctx, id, "", "again"); err != nil {
			t.Fatal(err)
		}
	}
	if texts := d.Texts(); len(texts) != 1 || texts[0].CmdID != "cmd-3" {
		t.Errorf("after reopening, the device showed %v; want only cmd-3 (cmd-1 and cmd-2 ran before)", texts)
	}
}

// A line of an execution log longer than 64 KiB (a write that a crash
// left damaged) is read as one line: the ids after it are counted, by
// ReadExecLog and ReadExecOrder, and remembered by a device opened on the
// log. The scan of the lines stopped at it, its error unread: every id
// after it was missed, the tests' and the soak's counts of executions
// silently short, and the device ran those commands again.
// docs/reliability.md, bug 357.
func TestExecLogReadsPastALongLine(t *testing.T) {
	dir := t.TempDir()
	path := sim.ExecLogPath(dir, "d")
	log := "cmd-1\n" + strings.Repeat("x", 100<<10) + "\ncmd-2\ncmd-2\n"
	if err := os.WriteFile(path, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	counts, err := sim.ReadExecLog(path)
	if err != nil {
		t.Fatal(err)
	}
	if counts["cmd-1"] != 1 || counts["cmd-2"] != 2 {
		t.Errorf("ReadExecLog: cmd-1 %d times, cmd-2 %d times; want 1 and 2", counts["cmd-1"], counts["cmd-2"])
	}
	order, err := sim.ReadExecOrder(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(order) != 3 || order[0] != "cmd-1" || order[2] != "cmd-2" {
		t.Errorf("ReadExecOrder = %d ids, ending %q; want cmd-1, the long line, cmd-2", len(order), order[len(order)-1])
	}

	d, err := sim.Open(sim.Options{ID: "d", StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.PushText(context.Background(), "cmd-2", "", "again"); err != nil {
		t.Fatal(err)
	}
	if texts := d.Texts(); len(texts) != 0 {
		t.Errorf("after reopening, the device ran cmd-2 again, which its log holds")
	}
}
