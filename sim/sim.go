// Package sim is the simulated device of CONTRACT §4: what
// `companion-bridge --sim-devices` runs and what the tests drive.
//
// A Device keeps pushed texts and images, installed apps, its settings
// (in use and saved) and its firmware as MCUboot images in two slots that
// a reboot swaps as MCUboot does (boot.go); it checks settings against
// DefaultSchema, drains its battery slowly by its clock, and treats a
// repeated command id as already done. It satisfies agent.Device without
// importing agent. It is not a model of any real hardware: it has no
// Bluetooth and no timing of its own beyond Options.ExecDelay.
package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

// Defaults of Options.
const (
	DefaultModel    = topics.SimModel
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

// MaxImageBytes bounds the bytes of the images a Device keeps, besides
// their count: the newest is kept whatever its size. A watch's flash holds
// a few pictures; 256 of CONTRACT §6's 2 MiB were 512 MiB of memory a
// simulated device (docs/reliability.md, bug 364).
const MaxImageBytes = 16 << 20

// Errors a Device returns.
var (
	ErrBadSettings     = errors.New("sim: invalid settings")
	ErrAppNotInstalled = errors.New("sim: app not installed")
	ErrBadArgument     = errors.New("sim: invalid argument")
)

// Options configure a Device. The zero value of each field means its default.
type Options struct {
	ID       string
	Model    string // default DefaultModel
	Firmware string // the version of the image it starts with; default DefaultFirmware
	Now      func() time.Time
	Logger   *slog.Logger
	// ExecDelay, when set, makes every command take at least this long
	// (it ends early when the command's context is done).
	ExecDelay time.Duration
	// ImageHash is the hash TLV the device's MCUboot checks and its
	// img_mgmt reads as an image's hash: mcuboot.TLVSHA256 (the default)
	// or mcuboot.TLVSHA512, for a build with
	// CONFIG_MCUBOOT_BOOTLOADER_USES_SHA512 (Zephyr's img_mgmt knows no
	// other). An image without that TLV is neither listed nor booted.
	ImageHash uint16
	// StateDir, when set, makes the device remember the commands it ran
	// across processes, as a real device remembers them across restarts of
	// its bridge: each execution appends the command id to the file
	// ExecLogPath(StateDir, ID), fsync'd before the command returns, and
	// Open reads that file back so that a device made again drops the ids
	// it has already run. The file is also the count tests and the soak read
	// (ReadExecLog). The device keeps its state there too (state.go): a
	// device made again runs the firmware, apps and settings it had, and
	// Firmware is only the image of a device made for the first time.
	StateDir string
}

// ExecLogPath is the file in which a device with StateDir dir records the
// command ids it executed, one per line, in order.
func ExecLogPath(dir, deviceID string) string {
	return filepath.Join(dir, deviceID+".executed")
}

// ReadExecLog returns how many times each command id appears in an
// execution log written by a device with a StateDir. A last line without
// its newline (a write cut short) is not counted: it did not happen.
func ReadExecLog(path string) (map[string]int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	counts := map[string]int{}
	for _, id := range completeLines(b) {
		counts[id]++
	}
	return counts, nil
}

// ReadExecOrder returns the command ids of an execution log in the order
// the device ran them, each once (where it first ran), as ReadExecLog
// reads the file.
func ReadExecOrder(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var ids []string
	for _, id := range completeLines(b) {
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// completeLines returns the non-empty lines of b that end in a newline,
// however long: a line a crash damaged is read as one, and the lines after
// it too. A bufio.Scanner stopped at a line over 64 KiB, and the ids after
// it went uncounted (bug 357).
func completeLines(b []byte) []string {
	var ids []string
	for {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			return ids
		}
		if id := strings.TrimSpace(string(b[:i])); id != "" {
			ids = append(ids, id)
		}
		b = b[i+1:]
	}
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
	imageHash uint16 // the hash TLV of MCUboot and img_mgmt
	now       func() time.Time
	log       *slog.Logger
	delay     time.Duration
	born      time.Time

	mu         sync.Mutex
	flash      flash
	settings   map[string]any // in use
	saved      map[string]any // in the settings storage, only the values saved: what settings_load sets
	apps       map[string]string
	texts      []Text
	images     []Image
	done       map[string]bool // ids run, bounded by doneOrder
	doneOrder  []string
	executions map[string]int // ids really executed, bounded with done
	execLog    *os.File       // with Options.StateDir: every execution, appended
	stateDir   string         // Options.StateDir: where the state is kept (state.go)
	written    [2][]byte      // the image slots as last written there
	failNext   error
	hangNext   bool
}

// New returns a device with default settings, full battery, no apps. It
// panics if Options.StateDir is set and its log cannot be read or opened:
// use Open to get that error instead.
func New(opts Options) *Device {
	d, err := Open(opts)
	if err != nil {
		panic(err)
	}
	return d
}

// Open is New, reading back the ids a device of the same id ran before when
// Options.StateDir is set. Close the device to close its log.
func Open(opts Options) (*Device, error) {
	if opts.Model == "" {
		opts.Model = DefaultModel
	}
	if opts.Firmware == "" {
		opts.Firmware = DefaultFirmware
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	switch opts.ImageHash {
	case 0:
		opts.ImageHash = mcuboot.TLVSHA256
	case mcuboot.TLVSHA256, mcuboot.TLVSHA512:
	default:
		return nil, fmt.Errorf("sim: device %s: image hash %s: Zephyr's img_mgmt reads SHA-256 or SHA-512", opts.ID, mcuboot.HashName(opts.ImageHash))
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	d := &Device{
		id:         opts.ID,
		model:      opts.Model,
		imageHash:  opts.ImageHash,
		now:        opts.Now,
		log:        opts.Logger.With("device_id", opts.ID),
		delay:      opts.ExecDelay,
		apps:       map[string]string{},
		done:       map[string]bool{},
		executions: map[string]int{},
	}
	d.born = d.now()
	v, err := mcuboot.ParseVersion(opts.Firmware)
	if err != nil {
		return nil, fmt.Errorf("sim: device %s: firmware %w", opts.ID, err)
	}
	d.flash.primary = firstImage(opts.Model, v, opts.ImageHash)
	d.settings, d.saved = defaultSettings(), map[string]any{}
	if opts.StateDir != "" {
		if err := d.openExecLog(ExecLogPath(opts.StateDir, opts.ID)); err != nil {
			return nil, fmt.Errorf("sim: device %s: %w", opts.ID, err)
		}
		d.stateDir = opts.StateDir
		if err := d.loadState(opts.StateDir); err != nil {
			d.execLog.Close()
			return nil, fmt.Errorf("sim: device %s: state: %w", opts.ID, err)
		}
		if err := d.saveLocked(); err != nil { // a new device's age
			d.execLog.Close()
			return nil, fmt.Errorf("sim: device %s: state: %w", opts.ID, err)
		}
	}
	return d, nil
}

// execLogTail is how much of its execution log a device reads back at
// Open: the lines of its last maxDoneIDs commands (ids of 36 characters)
// more than twice over. It remembers no more ids than those; the log
// before them is the tests' record (ReadExecLog), which a device read
// whole at every start, the time and memory of it growing with every
// command it ever ran (docs/reliability.md, bug 365).
const execLogTail = 1 << 20

// openExecLog reads the ids executed by an earlier life of the device (the
// log's last execLogTail bytes) and opens the log for appending. A last
// line cut short by a crash is cut off the file, so that the next id
// starts on a line of its own.
func (d *Device) openExecLog(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	b, from, err := readTail(f, execLogTail)
	if err != nil {
		f.Close()
		return err
	}
	if from > 0 {
		// Its first line may be the end of one: the lines after it.
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			f.Close()
			return fmt.Errorf("execution log %s: no line in its last %d bytes", path, len(b))
		}
		b, from = b[i+1:], from+int64(i+1)
	}
	keep := from + int64(bytes.LastIndexByte(b, '\n')+1)
	if keep != from+int64(len(b)) {
		if err := f.Truncate(keep); err != nil {
			f.Close()
			return err
		}
	}
	if _, err := f.Seek(keep, io.SeekStart); err != nil {
		f.Close()
		return err
	}
	for _, id := range completeLines(b) {
		if !d.done[id] {
			d.markDone(id)
		} else {
			d.executions[id]++ // a promise broken in an earlier life: keep the count
		}
	}
	d.execLog = f
	return nil
}

// readTail returns the last n bytes of f (all of it when shorter) and
// where they start.
func readTail(f *os.File, n int64) ([]byte, int64, error) {
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, 0, err
	}
	from := max(size-n, 0)
	b := make([]byte, size-from)
	if _, err := f.ReadAt(b, from); err != nil && !errors.Is(err, io.EOF) {
		return nil, 0, err
	}
	return b, from, nil
}

// Close closes the execution log of a device with a StateDir. The device
// must not run commands after it.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.execLog == nil {
		return nil
	}
	err := d.execLog.Close()
	d.execLog = nil
	return err
}

// DefaultSchema is the settings schema of CONTRACT §4.
func DefaultSchema() topics.Schema { return topics.SimSchema() }

// ID returns the device id.
func (d *Device) ID() string { return d.id }

// Info reports model, firmware, battery and installed apps (sorted by id).
func (d *Device) Info(ctx context.Context) (companion.DeviceInfo, error) {
	if err := ctx.Err(); err != nil {
		return companion.DeviceInfo{}, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	apps := make([]companion.App, 0, len(d.apps))
	for id, v := range d.apps {
		apps = append(apps, companion.App{AppID: id, Version: v})
	}
	sort.Slice(apps, func(i, j int) bool { return apps[i].AppID < apps[j].AppID })
	return companion.DeviceInfo{Model: d.model, FirmwareVersion: d.versionLocked(), Battery: d.battery(), Apps: apps}, nil
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
		d.log.Debug("repeated command ignored", "command_id", cmdID, "op", op)
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
	// Its change kept before it is recorded as run (state.go).
	if err := d.saveLocked(); err != nil {
		return fmt.Errorf("sim: keeping the state of command %s: %w", cmdID, err)
	}
	if d.execLog != nil {
		// On disk before the command reports success: a crash after this
		// point leaves a device that knows it ran the command.
		if _, err := d.execLog.WriteString(cmdID + "\n"); err != nil {
			return fmt.Errorf("sim: recording command %s: %w", cmdID, err)
		}
		if err := d.execLog.Sync(); err != nil {
			return fmt.Errorf("sim: recording command %s: %w", cmdID, err)
		}
	}
	d.markDone(cmdID)
	d.log.Debug("command done", "command_id", cmdID, "op", op)
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
		d.images = keepImages(d.images, Image{CmdID: cmdID, ContentType: contentType, Data: append([]byte(nil), data...)})
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

// keepImages is keep, the images also bounded by MaxImageBytes.
func keepImages(s []Image, v Image) []Image {
	s = keep(s, v)
	n := 0
	for i := len(s) - 1; i >= 0; i-- {
		if n += len(s[i].Data); n > MaxImageBytes && i < len(s)-1 {
			return append(s[:0:0], s[i+1:]...)
		}
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
			switch x := v.(type) { // ints arrive as float64 from JSON, past 2^53 as int64
			case float64:
				v = int(x)
			case int64:
				v = int(x)
			}
			d.settings[k] = v
			d.saved[k] = v
		}
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

// Firmware returns the version of the image the device runs.
func (d *Device) Firmware() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.versionLocked()
}
