package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/devicecompanion/companion/topics"
)

// What a device with Options.StateDir keeps across processes, as a real
// device keeps it across restarts of its bridge (which do not restart the
// device): its firmware (both image slots and MCUboot's flags), its apps,
// its settings in use and saved, and its battery's age. Without it, a
// bridge started again brought its devices back on their first firmware,
// with no apps and default settings, while the server read the commands
// that changed them as succeeded. The texts and images it showed are not
// kept.
//
// The state is written after every change, before the command that made it
// is recorded as run (run): a process killed between the two leaves a
// device that has the change and runs the command again, never one that
// thinks it ran a command whose change it lost. Each file is replaced
// whole (a temp file renamed over it): a kill leaves the old one or the
// new one. It is not fsync'd: a killed process's writes survive in the
// page cache, and the simulator stands for no power loss.

// stateFile is the device's state but for its image slots.
type stateFile struct {
	Born      time.Time         `json:"born"`
	Apps      map[string]string `json:"apps"`
	Settings  map[string]any    `json:"settings"`
	Saved     map[string]any    `json:"saved"`
	Pending   bool              `json:"pending"`
	Permanent bool              `json:"permanent"`
	Testing   bool              `json:"testing"`
	Boots     int               `json:"boots"`
}

func statePath(dir, deviceID string) string { return filepath.Join(dir, deviceID+".state") }

func slotPath(dir, deviceID string, slot int) string {
	return filepath.Join(dir, fmt.Sprintf("%s.slot%d", deviceID, slot))
}

// loadState reads the state an earlier life of the device left in dir, if
// any, over the device's first state.
func (d *Device) loadState(dir string) error {
	b, err := os.ReadFile(statePath(dir, d.id))
	if errors.Is(err, fs.ErrNotExist) {
		return nil // a new device
	}
	if err != nil {
		return err
	}
	var st stateFile
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("%s: %w", statePath(dir, d.id), err)
	}
	primary, err := os.ReadFile(slotPath(dir, d.id, 0))
	if err != nil {
		return fmt.Errorf("the running image: %w", err)
	}
	secondary, err := os.ReadFile(slotPath(dir, d.id, 1))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	d.born = st.Born
	if st.Apps != nil {
		d.apps = st.Apps
	}
	d.settings, d.saved = defaultSettings(), map[string]any{}
	fromJSON(d.settings, st.Settings)
	fromJSON(d.saved, st.Saved)
	f := &d.flash
	f.primary, f.secondary = primary, secondary
	f.pending, f.permanent, f.testing, f.boots = st.Pending, st.Permanent, st.Testing, st.Boots
	d.written = [2][]byte{primary, secondary}
	return nil
}

// fromJSON copies the settings of the schema from src, as encoding/json
// decoded them, into dst, their integers as the device keeps them (int).
func fromJSON(dst, src map[string]any) {
	schema := DefaultSchema()
	for k, v := range src {
		spec, ok := schema[k]
		if !ok {
			continue
		}
		if f, ok := v.(float64); ok && spec.Type == topics.SettingInt {
			v = int(f)
		}
		dst[k] = v
	}
}

// saveLocked writes the device's state to its StateDir, if it has one: the
// state file, and each image slot that changed since it was last written.
// Under d.mu.
func (d *Device) saveLocked() error {
	if d.stateDir == "" {
		return nil
	}
	f := &d.flash
	for i, slot := range [2][]byte{f.primary, f.secondary} {
		if sameSlice(slot, d.written[i]) {
			continue
		}
		path := slotPath(d.stateDir, d.id, i)
		if len(slot) == 0 {
			if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		} else if err := writeFile(path, slot); err != nil {
			return err
		}
		d.written[i] = slot
	}
	b, err := json.Marshal(stateFile{Born: d.born, Apps: d.apps, Settings: d.settings, Saved: d.saved,
		Pending: f.pending, Permanent: f.permanent, Testing: f.testing, Boots: f.boots})
	if err != nil {
		return err
	}
	return writeFile(statePath(d.stateDir, d.id), b)
}

// saveOrLog is saveLocked for the changes that cannot fail on its error (a
// settings_mgmt write, a reboot): it is logged.
func (d *Device) saveOrLog() {
	if err := d.saveLocked(); err != nil {
		d.log.Error("saving the device's state", "err", err)
	}
}

// sameSlice reports whether a and b are the same bytes of the same array:
// a slot is replaced, never changed in place, once written.
func sameSlice(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// writeFile replaces the file at path with b, whole.
func writeFile(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
