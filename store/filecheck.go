package store

import "github.com/devicecompanion/companion/internal/boltcheck"

// ErrDamaged means the bbolt file cannot be read as one: cut short, empty,
// a directory in its place, or a page of it not what its tree says it is
// (boltcheck.ErrDamaged). Open refuses it and leaves it as it is.
var ErrDamaged = boltcheck.ErrDamaged

// checkFile reads the bbolt file at path, when there is one, as bbolt will,
// and reports what would stop it (boltcheck.Check): on a page past the
// file's end (a file cut short) or a page not of the tree (a file
// overwritten in part) bbolt faults or panics, on a goroutine of its own,
// while it opens the file, so that the server ended with a stack trace
// rather than a message; an empty file it took for a new store, which hid
// a store lost (a restore or a copy onto a full disk).
func checkFile(path string) error {
	return boltcheck.Check(path)
}
