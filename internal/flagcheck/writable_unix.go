//go:build unix

package flagcheck

import (
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// WritableDir refuses, naming the flag, a directory the process cannot
// write, or, when it does not exist yet, whose nearest existing parent it
// cannot write in (where it would be made): one on a read-only file
// system, as systemd's ProtectSystem=strict leaves every directory but the
// unit's StateDirectory and its ReadWritePaths=, or one the process's user
// may not write (systemd's DynamicUser= a directory it does not own). Each
// fails again at every start, as a flag's wrong value does: before, the
// binary exited with status 1, "mkdir …: read-only file system", and its
// unit restarted it every 2 s for good (bug 435). unit names the systemd
// unit the binary is installed as, and state its StateDirectory, for the
// advice. Other errors are left to the open that follows.
func WritableDir(flagName, dir, unit, state string) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil
	}
	for p := abs; ; {
		err := unix.Access(p, unix.W_OK)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, unix.ENOENT):
			parent := filepath.Dir(p)
			if parent == p {
				return nil
			}
			p = parent
			continue
		case errors.Is(err, unix.EROFS):
			return fmt.Errorf("--%s %s: %s is on a read-only file system; the directory must be writable: "+
				"under systemd, %s's ProtectSystem=strict makes all but %s read-only, so add ReadWritePaths=%s to the unit "+
				"(systemctl edit %s) or keep it under %s", flagName, dir, p, unit, state, abs, unit, state)
		case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
			return fmt.Errorf("--%s %s: %s: permission denied; the directory must be writable by the user the binary runs as: "+
				"under systemd, %s's DynamicUser= owns %s alone, so keep it there or add ReadWritePaths=%s to the unit "+
				"(systemctl edit %s) and give the directory to the unit's user", flagName, dir, p, unit, state, abs, unit)
		default:
			return nil
		}
	}
}
