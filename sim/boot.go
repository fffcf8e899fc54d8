package sim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

// ErrReverted is returned by UpdateFirmware when the device came back on
// its old image.
var ErrReverted = errors.New("sim: MCUboot kept the old image")

// flash is the device's two image slots and MCUboot's view of them, as a
// single-image Zephyr build with MCUboot in swap mode has them: the
// primary slot holds the running image; the secondary takes uploads, and
// after a swap for test holds the old image until the new one is
// confirmed or reverted. Guarded by Device.mu.
type flash struct {
	primary   []byte // the running image
	secondary []byte // an upload, or the image swapped out
	pending   bool   // the secondary boots next…
	permanent bool   // …for good rather than for test
	testing   bool   // the primary was swapped in for test and is not confirmed: the next boot reverts it
	boots     int

	failNextBoot      bool // MCUboot finds the next image to boot invalid
	crashNextBoot     bool // the next image booted for test crashes before it is confirmed
	corruptNextUpload bool // the next upload's first write lands with a bit flipped
}

// firstImage is the image a device of this model and version starts with,
// carrying the hash TLV its MCUboot checks.
func firstImage(model string, v mcuboot.Version, hash uint16) []byte {
	payload := bytes.Repeat([]byte(model+" application "+v.String()+"\n"), 64)
	return mcuboot.MustBuild(payload, mcuboot.Options{Version: v, HeaderSize: 0x200, Hash: hash})
}

// versionLocked is the version of the running image.
func (d *Device) versionLocked() string {
	img, err := mcuboot.ReadInfo(d.flash.primary)
	if err != nil {
		return "" // cannot happen: only images MCUboot checked get there
	}
	return img.Header.Version.String()
}

// imageState is the image state as img_mgmt reports it (group 1, command
// 0): the slots that hold an image, with their flags and its hash, the
// value of the hash TLV of the device's build (IMAGE_TLV_SHA). A slot
// whose image has no such TLV is left out, as img_mgmt_read_info fails on
// it (IMG_MGMT_ERR_HASH_NOT_FOUND).
func (d *Device) imageState() []gatt.ImageSlot {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.imageStateLocked()
}

func (d *Device) imageStateLocked() []gatt.ImageSlot {
	f := &d.flash
	var out []gatt.ImageSlot
	if img, err := mcuboot.ReadInfo(f.primary); err == nil && img.HashType == d.imageHash {
		out = append(out, gatt.ImageSlot{Slot: 0, Version: img.Header.Version.MCUmgrString(), Hash: img.Hash,
			Bootable: img.Header.Flags&mcuboot.FlagNonBootable == 0, Active: true, Confirmed: !f.testing})
	}
	if img, err := mcuboot.ReadInfo(f.secondary); err == nil && img.HashType == d.imageHash {
		out = append(out, gatt.ImageSlot{Slot: 1, Version: img.Header.Version.MCUmgrString(), Hash: img.Hash,
			Bootable: img.Header.Flags&mcuboot.FlagNonBootable == 0,
			Pending:  f.pending, Permanent: f.pending && f.permanent, Confirmed: f.testing})
	}
	return out
}

// secondaryInUse is img_mgmt_slot_in_use for the secondary slot: it is
// to boot next, or holds the confirmed image a test would revert to.
func (d *Device) secondaryInUse() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.flash.pending || d.flash.testing
}

// secondaryUsed reports whether the secondary slot holds anything, which
// an upload erases first (img_mgmt_flash_check_empty).
func (d *Device) secondaryUsed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.flash.secondary) > 0
}

// eraseSecondary starts an upload into the secondary slot.
func (d *Device) eraseSecondary() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flash.secondary = nil
	d.saveOrLog()
}

// hashSize is the size of an image hash as img_mgmt takes and reports it
// (IMAGE_SHA_LEN).
func (d *Device) hashSize() int { return mcuboot.HashSize(d.imageHash) }

// writeSecondary appends an upload's bytes to the secondary slot.
func (d *Device) writeSecondary(data []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	start := len(d.flash.secondary)
	d.flash.secondary = append(d.flash.secondary, data...)
	if d.flash.corruptNextUpload && len(data) > 0 {
		d.flash.corruptNextUpload = false
		d.flash.secondary[start+len(data)/2] ^= 0x10
	}
}

// uploadDone is the end of an upload into a secondary slot of slotSize
// bytes. One that wrote the slot to its end wrote MCUboot's image trailer
// too (an image padded by imgtool sign --pad, sent whole): its boot magic
// asks MCUboot to swap the image in at the next boot, for test, or for
// good when image_ok is set, as boot_swap_type reads the secondary slot's
// trailer. Without the magic the trailer is erased, as img_mgmt leaves it
// when it opens an upload.
func (d *Device) uploadDone(slotSize int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.saveOrLog()
	f := &d.flash
	if len(f.secondary) != slotSize {
		return
	}
	switch mcuboot.ReadTrailer(f.secondary) {
	case mcuboot.TrailerTest:
		f.pending, f.permanent = true, false
	case mcuboot.TrailerPermanent:
		f.pending, f.permanent = true, true
	}
}

// secondaryMatches reports whether the SHA-256 of the secondary slot's
// bytes is sha (img_mgmt's match).
func (d *Device) secondaryMatches(sha []byte) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	sum := sha256.Sum256(d.flash.secondary)
	return bytes.Equal(sum[:], sha)
}

// slotOfHash is the slot whose image has this hash, or -1.
func (d *Device) slotOfHash(hash []byte) int {
	for _, s := range d.imageState() {
		if bytes.Equal(s.Hash, hash) {
			return s.Slot
		}
	}
	return -1
}

// setNextBoot is img_mgmt's image state write for slot (0 the running
// image, 1 the other): confirm makes it permanent, test boots it once. It
// returns an image group error, 0 when done; the rules are those of
// img_mgmt_set_next_boot_slot.
func (d *Device) setNextBoot(slot int, confirm bool) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	defer d.saveOrLog()
	f := &d.flash
	const (
		normal = iota
		test
		revert
	)
	typ, next := normal, 0
	switch {
	case f.testing:
		typ, next = revert, 1
	case f.pending && !f.permanent:
		typ, next = test, 1
	case f.pending:
		next = 1
	}
	if !confirm && slot == 0 {
		return gatt.ImgErrTestToActiveDenied
	}
	switch typ {
	case test:
		if !confirm && slot == next {
			return 0
		}
		return gatt.ImgErrImageAlreadyPending
	case normal:
		if confirm && slot == next {
			return 0
		}
		if (slot == 0 && next != 0) || (!confirm && slot != 0 && slot == next) {
			return gatt.ImgErrImageAlreadyPending
		}
	case revert:
		if confirm && slot == next {
			return 0
		}
		if !confirm {
			return gatt.ImgErrImageAlreadyPending
		}
	}
	if slot == 0 {
		f.testing = false // the running image confirmed: no revert
		d.log.Info("image confirmed", "firmware", d.versionLocked())
		return 0
	}
	f.pending, f.permanent = true, confirm
	return 0
}

// reboot restarts the device as MCUboot does: a test image not confirmed
// is reverted; a pending image is checked (header, TLVs, the hash of the
// build's hash TLV) and swapped in, for test or for good, or erased when
// it is not valid. The application then loads its saved settings.
func (d *Device) reboot() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rebootLocked()
}

func (d *Device) rebootLocked() {
	f := &d.flash
	f.boots++
	switch {
	case f.testing:
		f.primary, f.secondary, f.testing = f.secondary, f.primary, false
		d.log.Info("rebooted: MCUboot reverted the unconfirmed image", "firmware", d.versionLocked())
	case f.pending:
		f.pending = false
		img, err := mcuboot.Parse(f.secondary)
		if err == nil && img.HashType != d.imageHash {
			// bootutil_img_validate finds no EXPECTED_HASH_TLV.
			err = fmt.Errorf("no %s TLV", mcuboot.HashName(d.imageHash))
		}
		if err == nil && f.failNextBoot {
			err = errors.New("refused by the test hook")
		}
		f.failNextBoot = false
		if err != nil {
			f.secondary, f.permanent = nil, false
			d.log.Info("rebooted: MCUboot erased an invalid image", "err", err, "firmware", d.versionLocked())
			break
		}
		f.primary, f.secondary = f.secondary, f.primary
		f.testing, f.permanent = !f.permanent, false
		d.log.Info("rebooted into the new image", "firmware", d.versionLocked(), "test", f.testing)
		if f.testing && f.crashNextBoot {
			// The new application faults before it confirms itself; the
			// watchdog resets, and MCUboot reverts.
			f.crashNextBoot = false
			f.boots++
			f.primary, f.secondary, f.testing = f.secondary, f.primary, false
			d.log.Info("the new image crashed: MCUboot reverted it", "firmware", d.versionLocked())
		}
	default:
		d.log.Info("rebooted", "firmware", d.versionLocked())
	}
	d.settings = defaultSettings()
	maps.Copy(d.settings, d.saved)
	d.saveOrLog()
}

// defaultSettings are the values the application starts with, before
// settings_load sets the saved ones.
func defaultSettings() map[string]any {
	vals := map[string]any{}
	for name, spec := range DefaultSchema() {
		vals[name] = spec.Default
	}
	return vals
}

// FailNextBoot makes MCUboot find the next image it is to boot invalid
// (as a bad signature would): it erases it and boots the old one.
func (d *Device) FailNextBoot() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flash.failNextBoot = true
}

// CrashNextBoot makes the next image booted for test crash before anyone
// confirms it, so that MCUboot reverts to the old one.
func (d *Device) CrashNextBoot() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flash.crashNextBoot = true
}

// CorruptNextUpload makes the next image upload land in flash with one bit
// flipped, so that the device answers its last chunk with match false.
func (d *Device) CorruptNextUpload() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flash.corruptNextUpload = true
}

// FirmwareConfirmed reports whether the running image is confirmed (it
// stays at the next reboot).
func (d *Device) FirmwareConfirmed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return !d.flash.testing
}

// Boots counts the device's reboots.
func (d *Device) Boots() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.flash.boots
}

// UpdateFirmware is the whole update at once, for a device driven without
// a Bluetooth link: the image (an MCUboot image of version; of a padded
// one, the image without its padding, as the bridge uploads it) goes to
// the secondary slot, the device reboots into it for test and confirms
// it. It fails with ErrReverted when MCUboot kept the old image.
func (d *Device) UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error {
	img, err := mcuboot.Parse(image)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrBadArgument, err)
	}
	if img.Header.Version.String() != version {
		return fmt.Errorf("%w: the image is version %s, not %s", ErrBadArgument, img.Header.Version, version)
	}
	return d.run(ctx, cmdID, topics.OpOTAUpdate, func() error {
		for pct := 10; pct <= 90; pct += 10 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if progress != nil {
				progress(pct)
			}
		}
		f := &d.flash
		if f.testing || f.pending {
			return fmt.Errorf("%w: an update is pending already", ErrBadArgument)
		}
		f.secondary, f.pending, f.permanent = bytes.Clone(image[:img.End]), true, false
		d.rebootLocked()
		if cur, _ := mcuboot.ReadInfo(f.primary); cur == nil || !bytes.Equal(cur.Hash, img.Hash) {
			return fmt.Errorf("%w: it runs %s", ErrReverted, d.versionLocked())
		}
		f.testing = false
		if progress != nil {
			progress(100)
		}
		return nil
	})
}

// setting reads a setting by its settings key ("companion/brightness") as
// settings_mgmt does: its bytes, or a settings group error.
func (d *Device) setting(key string) ([]byte, int) {
	name, ok := cutPrefix(key)
	if !ok {
		return nil, gatt.SettingsErrRootKeyNotFound
	}
	spec, known := DefaultSchema()[name]
	d.mu.Lock()
	v := d.settings[name]
	d.mu.Unlock()
	if !known {
		return nil, gatt.SettingsErrKeyNotFound
	}
	if spec.Type == topics.SettingInt {
		v = float64(v.(int))
	}
	b, err := gatt.EncodeSetting(v)
	if err != nil {
		return nil, gatt.SettingsErrUnknown
	}
	return b, 0
}

// setSetting is the application's settings handler taking a value: it
// decodes and checks it against the schema and applies it at once (it
// persists on save).
func (d *Device) setSetting(key string, val []byte) int {
	name, ok := cutPrefix(key)
	if !ok {
		return gatt.SettingsErrRootKeyNotFound
	}
	spec, known := DefaultSchema()[name]
	if !known {
		return gatt.SettingsErrKeyNotFound
	}
	// A handler refuses a value with -EINVAL, which settings_mgmt reports
	// as "root key not found".
	v, err := gatt.DecodeSetting(spec, val)
	if err != nil {
		return gatt.SettingsErrRootKeyNotFound
	}
	if i, ok := v.(int64); ok {
		v = float64(i) // the schema check speaks JSON's types
	}
	if errs := DefaultSchema().Validate(map[string]any{name: v}); len(errs) > 0 {
		return gatt.SettingsErrRootKeyNotFound
	}
	if f, ok := v.(float64); ok {
		v = int(f)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.settings[name] = v
	d.saveOrLog()
	return 0
}

// deleteSetting removes a saved value (settings_delete): the value in use
// stays, and the default comes back at the next boot.
func (d *Device) deleteSetting(key string) int {
	name, ok := cutPrefix(key)
	if !ok {
		return gatt.SettingsErrRootKeyNotFound
	}
	if _, known := DefaultSchema()[name]; !known {
		return gatt.SettingsErrKeyNotFound
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.saved, name)
	d.saveOrLog()
	return 0
}

// saveSettings persists the values in use (settings_save).
func (d *Device) saveSettings() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.saved = maps.Clone(d.settings)
	d.saveOrLog()
}

// loadSettings reads the saved values back (settings_load): it calls the
// handler for each value the storage holds, so a value never saved (or
// deleted) stays as it is in use.
func (d *Device) loadSettings() {
	d.mu.Lock()
	defer d.mu.Unlock()
	maps.Copy(d.settings, d.saved)
	d.saveOrLog()
}

func cutPrefix(key string) (string, bool) {
	if len(key) <= len(gatt.SettingsPrefix) || key[:len(gatt.SettingsPrefix)] != gatt.SettingsPrefix {
		return "", false
	}
	return key[len(gatt.SettingsPrefix):], true
}
