package groupcommit

import "os"

// zeroFillChunk is how much a transaction writes of zeros at most: under
// load the fill keeps up a megabyte at a time, and the commit that carries
// one pays for it about 0.75 ms more on this machine's disk. (Four
// megabytes at once made that commit 15 ms longer.)
const zeroFillChunk = 1 << 20

// zeroFill keeps the end of a bbolt file written with zeros ahead of the
// pages bbolt adds.
//
// bbolt grows its file with ftruncate, which leaves the new space a hole:
// the file system allocates its blocks only when a commit writes pages
// there, and that commit's fdatasync then also commits the allocation to
// the file system's journal. On this machine a commit's two fdatasyncs
// took 0.70 ms into a hole against 0.45 ms into blocks written before,
// and a store that grows under load (every accepted command adds to it)
// pays that on most commits. With the space written ahead, the allocation
// happens once a megabyte instead, and bbolt does not grow the file while
// the zeros last (it grows only past the file's size).
//
// fill runs in a write transaction before its writes, on the committer's
// goroutine: bbolt writes no page past tx.Size() until that transaction
// commits, and holds every other writer off until then, so the zeros
// never land on a page in use.
type zeroFill struct {
	f      *os.File // nil once closed
	ahead  int64    // how far past the last page in use to keep zeros
	zeroed int64    // the file is written (with pages or zeros) up to here
	failed bool     // the last write of zeros failed: the file cannot grow now
	zeros  []byte
}

// newZeroFill opens the bbolt file at path for writing zeros ahead. It
// returns nil, and bbolt grows the file as it would alone, when the file
// cannot be opened.
func newZeroFill(path string, ahead int64) *zeroFill {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return nil
	}
	return &zeroFill{f: f, ahead: ahead}
}

// fill writes a chunk of zeros after what the file holds when a whole
// chunk of ahead is missing past used, the end of the last page in use
// (tx.Size() of the write transaction). It reports whether the file
// could grow when it last tried: false from a write of the zeros that
// failed until one succeeds.
func (z *zeroFill) fill(used int64) (grows bool) {
	if z.f == nil {
		return true
	}
	if z.zeroed < used {
		// The first transaction, or bbolt outgrew the zeros (or wrote its
		// pages past them from a transaction of its own): what lies
		// beyond its pages may be a hole.
		z.zeroed = used
	}
	if used+z.ahead-z.zeroed < zeroFillChunk {
		// Less than a chunk to go: wait for a whole one. Topping up
		// by the few pages each commit adds would allocate blocks in
		// every commit again, a little further on.
		return !z.failed
	}
	if z.zeros == nil {
		z.zeros = make([]byte, zeroFillChunk)
	}
	// A write that fails (a full disk, say) keeps what it wrote, and the
	// next transaction that finds a chunk missing tries again: one failed
	// write a commit while the disk is full, and the zeros ahead again as
	// soon as it is not. (Closed at the first failure, the file was left
	// to bbolt's holes until a restart, long after space was back.)
	n, err := z.f.WriteAt(z.zeros, z.zeroed)
	z.zeroed += int64(n)
	z.failed = err != nil
	return !z.failed
}

func (z *zeroFill) close() {
	if z.f != nil {
		_ = z.f.Close()
		z.f = nil
	}
}
