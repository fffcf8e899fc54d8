package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
)

// ErrDamaged means the bbolt file cannot be read as one: cut short, or a
// page of it is not what its tree says it is. Open refuses it and leaves
// it as it is.
var ErrDamaged = errors.New("the file is damaged")

// The bbolt file format (go.etcd.io/bbolt, internal/common), as far as
// checkFile reads it: a page starts with a 16-byte header (id, flags,
// count, overflow); pages 0 and 1 hold the two metas, the newer valid one
// naming the root bucket and the page count; a branch page's elements are
// 16 bytes (pos, ksize, pgid), a leaf page's 16 bytes (flags, pos, ksize,
// vsize), pos counted from the element; a bucket's value is its root page
// id and sequence, followed by its page when the root is 0 (inline).
const (
	boltMagic       = 0xED0CDAED
	boltVersion     = 2
	pageHeaderSize  = 16
	elementSize     = 16
	bucketHeader    = 16
	branchPageFlag  = 0x01
	leafPageFlag    = 0x02
	bucketLeafFlag  = 0x01
	metaChecksumLen = 56 // the meta's fields before its checksum
)

// checkFile reads the bbolt file at path, when there is one, as bbolt will
// and reports what would stop it: bbolt trusts the file, and on a page
// past the file's end (a file cut short) or a page not of the tree (a
// file overwritten in part) it faults or panics, on a goroutine of its
// own, while it opens the file, so that the server ended with a stack
// trace rather than a message. A file that bbolt tells wrong itself (too
// short for its metas, both metas invalid) is left to bbolt.
//
// It walks every page the newer valid meta reaches, once, with one read a
// page: about what bbolt itself reads at Open, which rebuilds its
// freelist (NoFreelistSync) by the same walk.
func checkFile(path string) error {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err // bbolt will say it better (a directory, say)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return nil
	}
	if fi.Size() == 0 {
		// bbolt makes a new store of an empty file; but the server made
		// this one, and wrote its metas into it before anything else,
		// so that a file of no bytes is a store lost (a restore or a
		// copy onto a full disk), which a new store would hide.
		return fmt.Errorf("%w: it is empty (0 bytes)", ErrDamaged)
	}
	c := fileChecker{r: f, size: fi.Size(), seen: make(map[uint64]bool)}
	meta, ok := c.meta()
	if !ok {
		return nil
	}
	c.pageSize, c.pages = uint64(meta.pageSize), meta.pgid
	if end := c.pages * c.pageSize; end > uint64(c.size) || end/c.pageSize != c.pages {
		return fmt.Errorf("%w: it holds %d bytes and its pages reach byte %d: it was cut short (a full disk, an interrupted copy)", ErrDamaged, c.size, end)
	}
	return c.bucket(meta.root, "the root")
}

// boltMeta is what checkFile reads of a meta page.
type boltMeta struct {
	pageSize   uint32
	root, pgid uint64
	txid       uint64
	valid      bool
}

type fileChecker struct {
	r        io.ReaderAt
	size     int64
	pageSize uint64
	pages    uint64 // the page count (the meta's high-water mark)
	seen     map[uint64]bool
}

// meta returns the meta bbolt would take: the valid one of the newer
// transaction. false: none is valid, which bbolt reports itself.
func (c *fileChecker) meta() (boltMeta, bool) {
	m0 := c.readMeta(0)
	off := int64(4096) // bbolt's default, where meta 0 cannot say
	if m0.valid {
		off = int64(m0.pageSize)
	}
	m1 := c.readMeta(off)
	switch {
	case m0.valid && m1.valid && m1.txid > m0.txid:
		return m1, true
	case m0.valid:
		return m0, true
	case m1.valid:
		return m1, true
	}
	return boltMeta{}, false
}

func (c *fileChecker) readMeta(off int64) boltMeta {
	var b [pageHeaderSize + 64]byte
	if _, err := c.r.ReadAt(b[:], off); err != nil {
		return boltMeta{}
	}
	m := b[pageHeaderSize:]
	le := binary.LittleEndian
	if le.Uint32(m[0:]) != boltMagic || le.Uint32(m[4:]) != boltVersion {
		return boltMeta{}
	}
	h := fnv.New64a()
	h.Write(m[:metaChecksumLen])
	ps := le.Uint32(m[8:])
	valid := h.Sum64() == le.Uint64(m[metaChecksumLen:]) && ps >= 512 && ps&(ps-1) == 0
	return boltMeta{
		pageSize: ps,
		root:     le.Uint64(m[16:]), pgid: le.Uint64(m[40:]), txid: le.Uint64(m[48:]),
		valid: valid,
	}
}

// page reads page id, with its overflow.
func (c *fileChecker) page(id uint64, what string) ([]byte, error) {
	if id < 2 || id >= c.pages {
		return nil, fmt.Errorf("%w: %s names page %d, outside its %d pages", ErrDamaged, what, id, c.pages)
	}
	if c.seen[id] {
		return nil, fmt.Errorf("%w: page %d is reached twice", ErrDamaged, id)
	}
	c.seen[id] = true
	p := make([]byte, c.pageSize)
	if _, err := c.r.ReadAt(p, int64(id*c.pageSize)); err != nil {
		return nil, fmt.Errorf("%w: page %d cannot be read: %v", ErrDamaged, id, err)
	}
	le := binary.LittleEndian
	if got := le.Uint64(p); got != id {
		return nil, fmt.Errorf("%w: page %d holds page %d's header", ErrDamaged, id, got)
	}
	if over := uint64(le.Uint32(p[12:])); over > 0 {
		if over >= c.pages-id {
			return nil, fmt.Errorf("%w: page %d overflows past the file's %d pages", ErrDamaged, id, c.pages)
		}
		p = make([]byte, (over+1)*c.pageSize)
		if _, err := c.r.ReadAt(p, int64(id*c.pageSize)); err != nil {
			return nil, fmt.Errorf("%w: page %d cannot be read: %v", ErrDamaged, id, err)
		}
	}
	return p, nil
}

// bucket walks the bucket whose root is page root.
func (c *fileChecker) bucket(root uint64, what string) error {
	p, err := c.page(root, what)
	if err != nil {
		return err
	}
	return c.node(p, fmt.Sprintf("page %d", root))
}

// node walks the branch or leaf page p (a page of the file, or an inline
// bucket's), checking that each element lies within it.
func (c *fileChecker) node(p []byte, what string) error {
	le := binary.LittleEndian
	flags, count := le.Uint16(p[8:]), int(le.Uint16(p[10:]))
	if flags != branchPageFlag && flags != leafPageFlag {
		return fmt.Errorf("%w: %s is neither a branch nor a leaf (flags %#x)", ErrDamaged, what, flags)
	}
	if pageHeaderSize+count*elementSize > len(p) {
		return fmt.Errorf("%w: %s's %d elements overrun it", ErrDamaged, what, count)
	}
	var prev []byte
	for i := range count {
		e := pageHeaderSize + i*elementSize
		var pos, ksize, vsize uint64
		if flags == branchPageFlag {
			pos, ksize = uint64(le.Uint32(p[e:])), uint64(le.Uint32(p[e+4:]))
		} else {
			pos, ksize, vsize = uint64(le.Uint32(p[e+4:])), uint64(le.Uint32(p[e+8:])), uint64(le.Uint32(p[e+12:]))
		}
		start := uint64(e) + pos
		if start+ksize+vsize > uint64(len(p)) {
			return fmt.Errorf("%w: %s's element %d lies past its end", ErrDamaged, what, i)
		}
		k := p[start : start+ksize]
		if prev != nil && bytes.Compare(prev, k) >= 0 {
			return fmt.Errorf("%w: %s's keys are out of order", ErrDamaged, what)
		}
		prev = k
		switch {
		case flags == branchPageFlag:
			child := le.Uint64(p[e+8:])
			if err := c.bucket(child, what); err != nil {
				return err
			}
		case le.Uint32(p[e:])&bucketLeafFlag != 0:
			v := p[start+ksize : start+ksize+vsize]
			if len(v) < bucketHeader {
				return fmt.Errorf("%w: %s's bucket %q is too short", ErrDamaged, what, k)
			}
			if root := le.Uint64(v); root != 0 {
				if err := c.bucket(root, fmt.Sprintf("bucket %q", k)); err != nil {
					return err
				}
			} else if len(v) < bucketHeader+pageHeaderSize {
				return fmt.Errorf("%w: %s's inline bucket %q is too short", ErrDamaged, what, k)
			} else if err := c.node(v[bucketHeader:], fmt.Sprintf("inline bucket %q", k)); err != nil {
				return err
			}
		}
	}
	return nil
}
