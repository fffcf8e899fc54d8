//go:build linux

package bluez

import (
	"encoding/json"
	"errors"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
)

// The address → device id map (Connector.ids) is kept in
// Options.StateFile, so that it outlives a restart of the bridge. BlueZ
// keeps its bonds across restarts, and a device whose bond is lost
// refuses every connection before its serial number can be read: with the
// map empty after a restart, its address could not be told to be the
// device a command was for, and the command waited out its 10 minutes
// (docs/reliability.md, bug 495). An entry gone stale (another device now
// at that address) is corrected by the first read there, as one learnt
// since the start is.

// loadIDs fills c.ids from Options.StateFile. A file missing is an empty
// map; one that cannot be read or parsed is logged and ignored: the map is
// learnt again as devices are read.
func (c *Connector) loadIDs() {
	if c.opts.StateFile == "" {
		return
	}
	b, err := os.ReadFile(c.opts.StateFile)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var ids map[string]string
	if err == nil {
		err = json.Unmarshal(b, &ids)
	}
	if err != nil {
		c.log.Warn("bluez: the devices' addresses could not be read back; they are learnt again as devices are reached", "file", c.opts.StateFile, "err", err)
		return
	}
	maps.Copy(c.ids, ids)
}

// saveIDs writes c.ids to Options.StateFile, replacing it whole (a
// temporary file renamed over it), so that a crash leaves the old map or
// the new one. saveMu keeps writes in order: the last write is of the
// latest map. A failure is logged: the map is still held in memory.
func (c *Connector) saveIDs() {
	if c.opts.StateFile == "" {
		return
	}
	c.saveMu.Lock()
	defer c.saveMu.Unlock()
	c.mu.Lock()
	b, err := json.Marshal(c.ids)
	c.mu.Unlock()
	if err == nil {
		err = writeFileAtomic(c.opts.StateFile, b)
	}
	if err != nil {
		c.log.Warn("bluez: the devices' addresses could not be saved; a device whose bond is lost is told apart only once read again after a restart", "file", c.opts.StateFile, "err", err)
	}
}

func writeFileAtomic(name string, b []byte) error {
	// The bridge's --data directory is made by its spool, maybe later.
	if err := os.MkdirAll(filepath.Dir(name), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(name), filepath.Base(name)+".*.tmp")
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), name)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
