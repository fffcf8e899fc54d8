// Package boltcheck reads a bbolt file through before bbolt opens it, and
// says what would stop bbolt: the server's store and the bridge's spool
// both check their file with it (docs/reliability.md, bugs 158 and 163).
//
// bbolt trusts its file: opening one for writing it walks the tree (it
// rebuilds the free list, which neither file writes), on a goroutine of its
// own, and panics there on a page that is not what its parent says, which
// no recover reaches; a file shorter than its pages faults in the mapping
// (SIGBUS), which nothing recovers. Both ended the process with a stack
// trace. A file of zero bytes it takes for a new one and writes afresh.
// Check reads the file (it does not map it), each page the newer valid
// meta reaches once: about what bbolt itself reads as it opens the file.
package boltcheck

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"os"
	"slices"
)

// ErrDamaged is what a file Check refuses is: errors.Is(err, ErrDamaged)
// holds for its *DamagedError.
var ErrDamaged = errors.New("the file is damaged")

// DamagedError is the error of a file Check refuses; What says why.
type DamagedError struct {
	What string
}

func (e *DamagedError) Error() string { return ErrDamaged.Error() + ": " + e.What }

// Is makes errors.Is(err, ErrDamaged) hold.
func (e *DamagedError) Is(target error) bool { return target == ErrDamaged }

// Check checks that the file at path is absent (a new one) or a bbolt file
// whose pages are all there and whose tree holds together. It returns a
// *DamagedError, saying what is wrong, for one that is not (a directory or
// an empty file in its place included), and the error of a file it cannot
// open.
func Check(path string) error {
	fi, err := os.Stat(path) // a link to the file elsewhere is the file
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	switch {
	case fi.IsDir():
		return damaged("a directory stands where the file belongs")
	case !fi.Mode().IsRegular():
		return damaged("it is not a regular file (%s)", fi.Mode().Type())
	case fi.Size() == 0:
		return damaged("it is empty (0 bytes): it was truncated, or a first start stopped as it created it")
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	c := &boltCheck{f: f, size: fi.Size()}
	if what := c.check(); what != "" {
		return damaged("%s", what)
	}
	return nil
}

func damaged(format string, args ...any) error {
	return &DamagedError{What: fmt.Sprintf(format, args...)}
}

// The bbolt file format, as far as Check reads it (bbolt's
// internal/common: page.go, meta.go, bucket.go).
const (
	boltMagic          = 0xED0CDAED
	boltVersion        = 2
	boltPageHeader     = 16 // id u64, flags u16, count u16, overflow u32
	boltElement        = 16 // a branch's or a leaf's element
	boltMetaSum        = 56 // the meta's bytes the checksum covers
	boltBucketHeader   = 16 // root u64, sequence u64
	boltBranch         = 0x01
	boltLeaf           = 0x02
	boltFreelist       = 0x10
	boltBucketLeafFlag = 0x01
	boltNoFreelist     = math.MaxUint64
)

// boltCheck walks a bbolt file's tree from its meta page, reading the
// file (not mapping it), and says what is wrong with it.
type boltCheck struct {
	f    io.ReaderAt
	size int64
	ps   uint64   // page size
	hwm  uint64   // pages in use: the meta's high-water mark
	seen []uint64 // pages reached, a bit each (made once hwm is known)
}

type boltMeta struct {
	pageSize, root, freelist, hwm, txid uint64
}

// readMeta decodes the meta page in buf and reports whether it is valid.
func readMeta(buf []byte) (boltMeta, bool) {
	if len(buf) < boltPageHeader+boltMetaSum+8 {
		return boltMeta{}, false
	}
	m := buf[boltPageHeader:]
	le := binary.LittleEndian
	h := fnv.New64a()
	h.Write(m[:boltMetaSum])
	if le.Uint32(m[0:]) != boltMagic || le.Uint32(m[4:]) != boltVersion || le.Uint64(m[boltMetaSum:]) != h.Sum64() {
		return boltMeta{}, false
	}
	return boltMeta{
		pageSize: uint64(le.Uint32(m[8:])),
		root:     le.Uint64(m[16:]),
		freelist: le.Uint64(m[32:]),
		hwm:      le.Uint64(m[40:]),
		txid:     le.Uint64(m[48:]),
	}, true
}

// metaAt reads the meta page at off.
func (c *boltCheck) metaAt(off int64) (boltMeta, bool) {
	buf := make([]byte, 0x1000)
	n, err := c.f.ReadAt(buf, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return boltMeta{}, false
	}
	return readMeta(buf[:n])
}

func (c *boltCheck) check() string {
	// The page size, as bbolt finds it: from the first meta page, else
	// from the second, wherever a page size puts it.
	m0, ok0 := c.metaAt(0)
	ps := m0.pageSize
	if !ok0 {
		for i := 0; i <= 14; i++ {
			pos := int64(1024) << i
			if pos >= c.size-1024 {
				break
			}
			if m, ok := c.metaAt(pos); ok && m.pageSize == uint64(pos) {
				ps = m.pageSize
				break
			}
		}
	}
	if ps < 1024 || ps > 1<<24 || ps&(ps-1) != 0 {
		return "neither of its two meta pages is valid: it is not a bbolt file, or both were overwritten"
	}
	c.ps = ps
	m1, ok1 := c.metaAt(int64(ps))
	// The newest valid meta, as bbolt takes it.
	m := m0
	if !ok0 || ok1 && m1.txid > m0.txid {
		m = m1
	}
	if m.pageSize != ps {
		return fmt.Sprintf("its meta pages disagree on the page size (%d, %d)", m0.pageSize, m1.pageSize)
	}
	c.hwm = m.hwm
	if c.hwm > uint64(c.size)/ps {
		return fmt.Sprintf("it is %d bytes and its %d pages of %d bytes need more: it was truncated", c.size, c.hwm, ps)
	}
	c.seen = make([]uint64, (c.hwm+63)/64)
	if m.freelist != boltNoFreelist {
		if _, what := c.pageOf(m.freelist, boltFreelist); what != "" {
			return what
		}
	}
	return c.tree(m.root)
}

// page reads page id, a branch or a leaf, whole.
func (c *boltCheck) page(id uint64) ([]byte, string) {
	return c.pageOf(id, boltBranch, boltLeaf)
}

// pageOf reads page id, whose flags must be one of flags, whole.
func (c *boltCheck) pageOf(id uint64, flags ...uint16) ([]byte, string) {
	if id < 2 || id >= c.hwm {
		return nil, fmt.Sprintf("a page refers to page %d, outside its %d pages", id, c.hwm)
	}
	if c.seen[id/64]&(1<<(id%64)) != 0 {
		return nil, fmt.Sprintf("page %d is reached twice", id)
	}
	c.seen[id/64] |= 1 << (id % 64)
	// One read of the page, the common case; its overflow pages, if it
	// has any, in a second.
	buf := make([]byte, c.ps)
	if _, err := c.f.ReadAt(buf, int64(id*c.ps)); err != nil {
		return nil, fmt.Sprintf("page %d cannot be read: %v", id, err)
	}
	le := binary.LittleEndian
	if got := le.Uint64(buf); got != id {
		return nil, fmt.Sprintf("page %d is damaged: it says it is page %d", id, got)
	}
	if !slices.Contains(flags, le.Uint16(buf[8:])) {
		return nil, fmt.Sprintf("page %d is damaged: it is not of the type its parent expects (flags %#x)", id, le.Uint16(buf[8:]))
	}
	overflow := uint64(le.Uint32(buf[12:]))
	if id+overflow >= c.hwm {
		return nil, fmt.Sprintf("page %d is damaged: its %d overflow pages run past the file's %d", id, overflow, c.hwm)
	}
	if overflow == 0 {
		return buf, ""
	}
	for i := id + 1; i <= id+overflow; i++ {
		c.seen[i/64] |= 1 << (i % 64)
	}
	buf = slices.Grow(buf, int(overflow*c.ps))[:(overflow+1)*c.ps]
	if _, err := c.f.ReadAt(buf[c.ps:], int64((id+1)*c.ps)); err != nil {
		return nil, fmt.Sprintf("page %d cannot be read: %v", id, err)
	}
	return buf, ""
}

// tree checks the pages of the bucket whose root is page root, and of the
// buckets in it, as bbolt's own check does (tx_check.go): each page reached
// once, of the type its parent expects, its elements within it, its keys
// in order and within the bounds its parent sets.
func (c *boltCheck) tree(root uint64) string {
	buckets := []uint64{root}
	for len(buckets) > 0 {
		b := buckets[len(buckets)-1]
		buckets = buckets[:len(buckets)-1]
		_, more, what := c.subtree(b, nil, nil)
		if what != "" {
			return what
		}
		buckets = append(buckets, more...)
	}
	return ""
}

// subtree checks the pages under page id, whose keys must be at least min
// (nil: no bound) and less than max (nil: no bound). It returns the
// subtree's largest key and the roots of the buckets its leaves hold.
func (c *boltCheck) subtree(id uint64, min, max []byte) (last []byte, buckets []uint64, what string) {
	p, what := c.page(id)
	if what != "" {
		return nil, nil, what
	}
	name := fmt.Sprintf("page %d", id)
	es, what := elements(p, name)
	if what != "" {
		return nil, nil, what
	}
	prev := min
	for i, e := range es {
		switch {
		case i == 0 && prev != nil && bytes.Compare(prev, e.key) > 0,
			i > 0 && bytes.Compare(prev, e.key) >= 0,
			max != nil && bytes.Compare(e.key, max) >= 0:
			return nil, nil, fmt.Sprintf("%s is damaged: its key %d is out of order", name, i)
		}
		if p[8]&boltBranch != 0 {
			next := max
			if i < len(es)-1 {
				next = es[i+1].key
			}
			sub, more, what := c.subtree(e.child, e.key, next)
			if what != "" {
				return nil, nil, what
			}
			buckets = append(buckets, more...)
			prev, last = sub, sub
			continue
		}
		prev, last = e.key, e.key
		if !e.bucket {
			continue
		}
		more, what := inlineBuckets(e.value, fmt.Sprintf("%s's bucket %d", name, i))
		if what != "" {
			return nil, nil, what
		}
		buckets = append(buckets, more...)
	}
	return last, buckets, ""
}

// inlineBuckets reads the header of a bucket (a leaf's value) and returns
// the root page of the bucket, or, for a bucket kept inline in the value,
// the roots of the buckets in it.
func inlineBuckets(v []byte, name string) ([]uint64, string) {
	if len(v) < boltBucketHeader {
		return nil, name + " is damaged: it has no header"
	}
	if root := binary.LittleEndian.Uint64(v); root != 0 {
		return []uint64{root}, ""
	}
	inline := v[boltBucketHeader:]
	if len(inline) < boltPageHeader || binary.LittleEndian.Uint16(inline[8:]) != boltLeaf {
		return nil, name + " is damaged: it is not a leaf"
	}
	es, what := elements(inline, name)
	if what != "" {
		return nil, what
	}
	var roots []uint64
	for _, e := range es {
		if !e.bucket {
			continue
		}
		more, what := inlineBuckets(e.value, name+"'s bucket")
		if what != "" {
			return nil, what
		}
		roots = append(roots, more...)
	}
	return roots, ""
}

// element is what Check reads of a page's element.
type element struct {
	key, value []byte // value: a leaf's
	child      uint64 // a branch's
	bucket     bool   // a leaf's value is a bucket
}

// elements reads the elements of a branch or leaf page p (a page of the
// file, or a bucket's inline page), each within p.
func elements(p []byte, name string) ([]element, string) {
	le := binary.LittleEndian
	branch, count := le.Uint16(p[8:]) == boltBranch, uint64(le.Uint16(p[10:]))
	if uint64(len(p)) < boltPageHeader+count*boltElement {
		return nil, fmt.Sprintf("%s is damaged: %d elements do not fit in it", name, count)
	}
	es := make([]element, count)
	for i := range count {
		off := boltPageHeader + i*boltElement
		e := p[off : off+boltElement]
		if branch {
			pos, ksize := off+uint64(le.Uint32(e[0:])), uint64(le.Uint32(e[4:]))
			if pos+ksize > uint64(len(p)) {
				return nil, fmt.Sprintf("%s is damaged: element %d runs past it", name, i)
			}
			es[i] = element{key: p[pos : pos+ksize], child: le.Uint64(e[8:])}
			continue
		}
		pos := off + uint64(le.Uint32(e[4:]))
		ksize, vsize := uint64(le.Uint32(e[8:])), uint64(le.Uint32(e[12:]))
		if pos+ksize+vsize > uint64(len(p)) {
			return nil, fmt.Sprintf("%s is damaged: element %d runs past it", name, i)
		}
		es[i] = element{key: p[pos : pos+ksize], value: p[pos+ksize : pos+ksize+vsize], bucket: le.Uint32(e[0:])&boltBucketLeafFlag != 0}
	}
	return es, ""
}

// Meta is what a bbolt file's newest valid meta page says: for tests that
// damage a file where it matters.
type Meta struct {
	PageSize, Root, PageCount, TxID uint64
}

// NewestMeta returns the newest valid meta of the bbolt file at path, as
// bbolt takes it; false when neither meta is valid.
func NewestMeta(path string) (Meta, bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return Meta{}, false, err
	}
	defer f.Close()
	c := &boltCheck{f: f}
	m0, ok0 := c.metaAt(0)
	off := int64(0x1000)
	if ok0 {
		off = int64(m0.pageSize)
	}
	m1, ok1 := c.metaAt(off)
	if !ok0 || ok1 && m1.txid > m0.txid {
		m0, ok0 = m1, ok1
	}
	return Meta{PageSize: m0.pageSize, Root: m0.root, PageCount: m0.hwm, TxID: m0.txid}, ok0, nil
}
