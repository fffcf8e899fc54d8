// Package sim is the simulated device of CONTRACT §4: what
// `companion-bridge --sim-devices` runs and what the tests drive.
//
// A Device keeps pushed texts and images, installed apps and its firmware
// version, checks settings against DefaultSchema, drains its battery slowly
// by its clock, and treats a repeated command id as already done. It
// satisfies agent.Device without importing agent (see Info). It is not a
// model of any real hardware: it has no Bluetooth and no timing of its own
// beyond Options.ExecDelay.
package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion/topics"
)

// Defaults of Options.
const (
	DefaultModel    = "sim-1"
	DefaultFirmware = "1.0.0"
)

// Battery behaviour: it starts full and loses one percent per DrainEvery of
// the device's clock, never going below MinBattery.
const (
	DrainEvery = 10 * time.Minute
	MinBattery = 5
)

// How much a Device remembers. Older entries are forgotten first.
const (
	maxKept    = 256   // texts and images
	maxDoneIDs = 10000 // command ids treated as already done
)

// Errors a Device returns.
var (
	ErrBadSettings     = errors.New("sim: invalid settings")
	ErrAppNotInstalled = errors.New("sim: app not installed")
	ErrBadArgument     = errors.New("sim: invalid argument")
)

// Info is what the device reports about itself. It is an alias of an unnamed
// struct type, identical to agent.Info, so that a *Device satisfies
// agent.Device without this package importing agent.
type Info = struct {
	Model           string
	FirmwareVersion string
	Battery         int
	Apps            []topics.App
}

// Options configure a Device. The zero value of each field means its default.
type Options struct {
	ID       string
	Model    string // default DefaultModel
	Firmware string // default DefaultFirmware
	Now      func() time.Time
	Logger   *slog.Logger
	// ExecDelay, when set, makes every command take at least this long
	// (it ends early when the command's context is done).
	ExecDelay time.Duration
}

// Text is a pushed text as the device keeps it.
type Text struct {
	CmdID string
	Title string
	Text  string
}

// Image is a pushed image as the device keeps it.
type Image struct {
	CmdID       string
	ContentType string
	Data        []byte
}

// Device is a simulated device. It is safe for concurrent use.
type Device struct {
	id, model string
	now       func() time.Time
	log       *slog.Logger
	delay     time.Duration
	born      time.Time

	mu         sync.Mutex
	firmware   string
	settings   map[string]any
	apps       map[string]string
	texts      []Text
	images     []Image
	done       map[string]bool // ids run, bounded by doneOrder
	doneOrder  []string
	executions map[string]int // ids really executed, bounded with done
	failNext   error
	hangNext   bool
}

// New returns a device with default settings, full battery, no apps.
func New(opts Options) *Device {
	if opts.Model == "" {
		opts.Model = DefaultModel
	}
	if opts.Firmware == "" {
		opts.Firmware = DefaultFirmware
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	d := &Device{
		id:         opts.ID,
		model:      opts.Model,
		now:        opts.Now,
		log:        opts.Logger.With("device", opts.ID),
		delay:      opts.ExecDelay,
		firmware:   opts.Firmware,
		settings:   map[string]any{},
		apps:       map[string]string{},
		done:       map[string]bool{},
		executions: map[string]int{},
	}
	d.born = d.now()
	for name, spec := range DefaultSchema() {
		d.settings[name] = spec.Default
	}
	return d
}

func intp(i int) *int { return &i }

// DefaultSchema is the settings schema of CONTRACT §4.
func DefaultSchema() topics.Schema {
	return topics.Schema{
		"brightness":        {Type: topics.SettingInt, Min: intp(0), Max: intp(100), Default: 50},
		"volume":            {Type: topics.SettingInt, Min: intp(0), Max: intp(100), Default: 50},
		"do_not_disturb":    {Type: topics.SettingBool, Default: false},
		"timezone":          {Type: topics.SettingTimezone, Default: "UTC"},
		"language":          {Type: topics.SettingEnum, Values: []string{"en", "de", "fr", "es", "zh", "ja"}, Default: "en"},
		"display_timeout_s": {Type: topics.SettingInt, Min: intp(5), Max: intp(600), Default: 30},
	}
}

// ID returns the device id.
func (d *Device) ID() string { return d.id }

// Info reports model, firmware, battery and installed apps (sorted by id).
func (d *Device) Info(ctx context.Context) (Info, error) {
	if err := ctx.Err(); err != nil {
		return Info{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	apps := make([]topics.App, 0, len(d.apps))
	for id, v := range d.apps {
		apps = append(apps, topics.App{AppID: id, Version: v})
	}
	sort.Slice(apps, func(i, j int) bool { return apps[i].AppID < apps[j].AppID })
	return Info{Model: d.model, FirmwareVersion: d.firmware, Battery: d.battery(), Apps: apps}, nil
}

func (d *Device) battery() int {
	b := 100 - int(d.now().Sub(d.born)/DrainEvery)
	return max(min(b, 100), MinBattery)
}

// Settings returns a copy of the current settings and the schema.
func (d *Device) Settings(ctx context.Context) (map[string]any, topics.Schema, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.settings), DefaultSchema(), nil
}

// run is the frame of every command: a repeated id is done already; then the
// test hooks, the delay and the work itself, which runs under d.mu.
func (d *Device) run(ctx context.Context, cmdID, op string, work func() error) error {
	d.mu.Lock()
	if d.done[cmdID] {
		d.mu.Unlock()
		d.log.Debug("repeated command ignored", "cmd", cmdID, "op", op)
		return nil
	}
	fail, hang := d.failNext, d.hangNext
	d.failNext, d.hangNext = nil, false
	d.mu.Unlock()

	if fail != nil {
		return fail
	}
	if hang {
		<-ctx.Done()
		return ctx.Err()
	}
	if d.delay > 0 {
		t := time.NewTimer(d.delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.done[cmdID] { // a concurrent repeat got here first
		return nil
	}
	if err := work(); err != nil {
		return err
	}
	d.markDone(cmdID)
	d.log.Debug("command done", "cmd", cmdID, "op", op)
	return nil
}

func (d *Device) markDone(cmdID string) {
	d.done[cmdID] = true
	d.executions[cmdID]++
	d.doneOrder = append(d.doneOrder, cmdID)
	if len(d.doneOrder) > maxDoneIDs {
		old := d.doneOrder[0]
		d.doneOrder = d.doneOrder[1:]
		delete(d.done, old)
		delete(d.executions, old)
	}
}

// PushText shows a text.
func (d *Device) PushText(ctx context.Context, cmdID, title, text string) error {
	return d.run(ctx, cmdID, topics.OpPushText, func() error {
		d.texts = keep(d.texts, Text{CmdID: cmdID, Title: title, Text: text})
		return nil
	})
}

// PushImage shows an image.
func (d *Device) PushImage(ctx context.Context, cmdID, contentType string, data []byte) error {
	if len(data) == 0 {
		return fmt.Errorf("%w: empty image", ErrBadArgument)
	}
	return d.run(ctx, cmdID, topics.OpPushImage, func() error {
		d.images = keep(d.images, Image{CmdID: cmdID, ContentType: contentType, Data: append([]byte(nil), data...)})
		return nil
	})
}

func keep[T any](s []T, v T) []T {
	s = append(s, v)
	if len(s) > maxKept {
		s = append(s[:0:0], s[len(s)-maxKept:]...)
	}
	return s
}

// InstallApp installs or updates an app.
func (d *Device) InstallApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error {
	if !topics.ValidAppID(appID) || !topics.ValidVersion(version) {
		return fmt.Errorf("%w: app %q version %q", ErrBadArgument, appID, version)
	}
	return d.run(ctx, cmdID, topics.OpAppInstall, func() error {
		d.apps[appID] = version
		return nil
	})
}

// UninstallApp removes an app; removing one that is not installed fails
// with ErrAppNotInstalled.
func (d *Device) UninstallApp(ctx context.Context, cmdID, appID string) error {
	return d.run(ctx, cmdID, topics.OpAppUninstall, func() error {
		if _, ok := d.apps[appID]; !ok {
			return fmt.Errorf("%w: %q", ErrAppNotInstalled, appID)
		}
		delete(d.apps, appID)
		return nil
	})
}

// UpdateSettings changes some settings. Values are as encoding/json decodes
// them; an unknown key or a bad value rejects the whole update with
// ErrBadSettings.
func (d *Device) UpdateSettings(ctx context.Context, cmdID string, values map[string]any) error {
	if errs := DefaultSchema().Validate(values); len(errs) > 0 {
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Field + ": " + e.Message
		}
		return fmt.Errorf("%w: %s", ErrBadSettings, strings.Join(msgs, "; "))
	}
	return d.run(ctx, cmdID, topics.OpSettingsUpdate, func() error {
		for k, v := range values {
			if f, ok := v.(float64); ok { // ints arrive as float64 from JSON
				v = int(f)
			}
			d.settings[k] = v
		}
		return nil
	})
}

// UpdateFirmware "writes" the image in ten steps, calling progress after
// each, then "reboots" into version.
func (d *Device) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	if !topics.ValidVersion(version) || len(image) == 0 {
		return fmt.Errorf("%w: firmware %q of %d bytes", ErrBadArgument, version, len(image))
	}
	return d.run(ctx, cmdID, topics.OpOTAUpdate, func() error {
		for pct := 10; pct <= 100; pct += 10 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if progress != nil {
				progress(pct)
			}
		}
		d.firmware = version
		d.log.Info("rebooted", "firmware", version)
		return nil
	})
}

// FailNext makes the next command (of any op) fail with err without running.
func (d *Device) FailNext(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.failNext = err
}

// HangNext makes the next command (of any op) hang until its context is done.
func (d *Device) HangNext() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hangNext = true
}

// Executions reports how many times the device really did the command with
// this id: 0 or 1, unless a promise was broken.
func (d *Device) Executions(cmdID string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.executions[cmdID]
}

// Texts returns the texts pushed, oldest first.
func (d *Device) Texts() []Text {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Text(nil), d.texts...)
}

// Images returns the images pushed, oldest first.
func (d *Device) Images() []Image {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Image(nil), d.images...)
}

// Apps returns the installed apps, id → version.
func (d *Device) Apps() map[string]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.apps)
}

// Firmware returns the firmware version the device runs.
func (d *Device) Firmware() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.firmware
}
