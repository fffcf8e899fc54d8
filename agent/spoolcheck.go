package agent

import (
	"errors"
	"fmt"

	"github.com/devicecompanion/companion/internal/boltcheck"
)

// spoolUnreadable is the advice that goes with a spool file the bridge
// will not open. The file is the bridge's memory of the commands it took
// and ran: the bridge neither starts on it nor writes to it, so that
// whoever looks at it finds it as it was.
const spoolUnreadable = "the bridge cannot read its spool, its record of the commands it took and ran, and has not changed it. " +
	"Keep a copy of the file; then restore it from a backup, or move it aside (mv spool.db spool.db.bad) " +
	"to start with an empty spool: once the bridge is online the server sends it the unfinished commands again, " +
	"and a device drops a command id it has already run"

// errSpoolFile is the error of a spool file the bridge refuses.
type errSpoolFile struct {
	path, what string
}

func (e *errSpoolFile) Error() string {
	return fmt.Sprintf("spool %s: %s: %s", e.path, e.what, spoolUnreadable)
}

// ErrSpoolUnreadable is what errors.Is finds in the error of New or Run
// when the spool file is damaged and the bridge refuses it: it would
// refuse it again at every start until a person restores or moves it
// (companion-bridge exits 65 on it, bug 402).
var ErrSpoolUnreadable = errors.New("the spool file is damaged")

// Is makes errors.Is(err, ErrSpoolUnreadable) hold.
func (e *errSpoolFile) Is(target error) bool { return target == ErrSpoolUnreadable }

// checkSpoolFile checks, before bbolt opens the spool at path, that it is
// absent (a new spool) or a bbolt file whose pages are all there and whose
// tree holds together (boltcheck.Check). It returns an *errSpoolFile for
// one that is not: bbolt would crash on it, or, on an empty one, write a
// new spool over what may have been the record of the commands that ran.
func checkSpoolFile(path string) error {
	err := boltcheck.Check(path)
	if d := (*boltcheck.DamagedError)(nil); errors.As(err, &d) {
		return &errSpoolFile{path: path, what: d.What}
	}
	if err != nil {
		return fmt.Errorf("spool %s: %w", path, err)
	}
	return nil
}

// spoolNoRoom is the advice that goes with a spool a first start could not
// make for want of space. bbolt's first growth of the file is 16 MiB
// (sparse where the file system allows: a few pages are written).
const spoolNoRoom = "the bridge cannot make its spool (a first start) for want of space under --data: " +
	"a full disk, a quota or a file size limit. It has left no file behind; " +
	"free space under --data (a new spool is a file of 16 MiB) and start the bridge again"

// errSpoolNoRoom is the error of a spool a first start could not make for
// want of space. Before, the bridge exited with no more than bbolt's
// "file resize error: truncate …: file too large" (docs/reliability.md,
// bug 176).
type errSpoolNoRoom struct {
	path string
	err  error
}

func (e *errSpoolNoRoom) Error() string {
	return fmt.Sprintf("spool %s: %v: %s", e.path, e.err, spoolNoRoom)
}

func (e *errSpoolNoRoom) Unwrap() error { return e.err }

// spoolOpenError is the error of an open of the spool at path that failed
// with err; fresh when the open was making the spool.
func spoolOpenError(path string, err error, fresh bool) error {
	if fresh && diskRefusal(err) != 0 {
		return fmt.Errorf("open spool: %w", &errSpoolNoRoom{path: path, err: err})
	}
	var damaged *errSpoolFile
	var newer *errSpoolNewer
	if errors.As(err, &damaged) || errors.As(err, &newer) {
		return fmt.Errorf("open spool: %w", err) // they name the file
	}
	return fmt.Errorf("open spool: %s: %w", path, err)
}
