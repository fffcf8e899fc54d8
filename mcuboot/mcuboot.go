// Package mcuboot reads and writes firmware images in the format MCUboot
// boots and imgtool writes (CONTRACT §10): a 32-byte header (magic
// 0x96f3b83d, load address, header size, protected TLV size, image size,
// flags, version), the image, then the TLV areas, the protected one
// (magic 0x6908) first and covered by the hash, the other (magic 0x6907)
// holding the image's hash TLV: the SHA-256 (type 0x10), SHA-384 (0x11) or
// SHA-512 (0x12) of header, image and protected TLVs, whichever the
// device's MCUboot checks (imgtool sign --sha). An image padded to its
// slot (imgtool sign --pad) goes on with erased flash up to MCUboot's
// image trailer, which ends in the boot magic.
//
// The server uses it to refuse a firmware blob that is not such an image,
// the bridge to learn the hash the device's image state reports, and the
// simulator and the tests to build images. It neither signs nor encrypts,
// and it does not verify signatures: that is the bootloader's job.
package mcuboot

import (
	"bytes"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"slices"
	"strconv"
	"strings"
)

// Format constants, as MCUboot's bootutil/image.h names them.
const (
	Magic                 uint32 = 0x96f3b83d // IMAGE_MAGIC
	HeaderSize                   = 32         // IMAGE_HEADER_SIZE: the fixed part of the header
	TLVInfoMagic          uint16 = 0x6907     // IMAGE_TLV_INFO_MAGIC
	ProtectedTLVInfoMagic uint16 = 0x6908     // IMAGE_TLV_PROT_INFO_MAGIC
	TLVSHA256             uint16 = 0x10       // IMAGE_TLV_SHA256: SHA-256 of header, image and protected TLVs
	TLVSHA384             uint16 = 0x11       // IMAGE_TLV_SHA384: SHA-384 of the same
	TLVSHA512             uint16 = 0x12       // IMAGE_TLV_SHA512: SHA-512 of the same
	TLVSecurityCounter    uint16 = 0x50       // IMAGE_TLV_SEC_CNT

	// FlagEncryptedAES128 and FlagEncryptedAES256 mark an encrypted image,
	// whose hash is over the plain text and so cannot be checked here.
	FlagEncryptedAES128 uint32 = 0x04
	FlagEncryptedAES256 uint32 = 0x08
	FlagNonBootable     uint32 = 0x10

	tlvInfoSize = 4 // magic and total size of a TLV area
	tlvHeadSize = 4 // type and length of one TLV
	maxTLVArea  = 0xffff
)

// hashes are the hash TLVs an image may carry, one of them: the one its
// MCUboot checks (EXPECTED_HASH_TLV), which Zephyr's img_mgmt reports as
// the image's hash (IMAGE_TLV_SHA: SHA-512 with
// CONFIG_MCUBOOT_BOOTLOADER_USES_SHA512, SHA-256 otherwise).
var hashes = []struct {
	typ   uint16
	name  string // as people write it
	field string // the FormatError field of its errors
	size  int
	new   func() hash.Hash
}{
	{TLVSHA256, "SHA-256", "sha256", sha256.Size, sha256.New},
	{TLVSHA384, "SHA-384", "sha384", sha512.Size384, sha512.New384},
	{TLVSHA512, "SHA-512", "sha512", sha512.Size, sha512.New},
}

// hashIndex is the index in hashes of the hash TLV type typ, or -1.
func hashIndex(typ uint16) int {
	for i, h := range hashes {
		if h.typ == typ {
			return i
		}
	}
	return -1
}

// HashSize is the size of the hash a hash TLV of type typ holds: 32 bytes
// for TLVSHA256, 48 for TLVSHA384, 64 for TLVSHA512; 0 for any other type.
func HashSize(typ uint16) int {
	if i := hashIndex(typ); i >= 0 {
		return hashes[i].size
	}
	return 0
}

// HashName names a hash TLV type: "SHA-256", "SHA-384" or "SHA-512", and
// "TLV 0x…" for any other type.
func HashName(typ uint16) string {
	if i := hashIndex(typ); i >= 0 {
		return hashes[i].name
	}
	return fmt.Sprintf("TLV 0x%02x", typ)
}

// Version is an image's version: major.minor.revision and a build number.
type Version struct {
	Major    uint8
	Minor    uint8
	Revision uint16
	Build    uint32
}

// String is the version as a semantic version: "1.2.3", or "1.2.3+4" when
// the build number is not 0 (imgtool's --version takes the same form).
func (v Version) String() string {
	s := fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Revision)
	if v.Build != 0 {
		s += "+" + strconv.FormatUint(uint64(v.Build), 10)
	}
	return s
}

// MCUmgrString is the version as Zephyr's img_mgmt reports it in the image
// state: "1.2.3", or "1.2.3.4" when the build number is not 0.
func (v Version) MCUmgrString() string {
	s := fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Revision)
	if v.Build != 0 {
		s += "." + strconv.FormatUint(uint64(v.Build), 10)
	}
	return s
}

// Compare orders versions by major, minor, revision, then build number:
// -1 if v < w, 0 if equal, +1 if v > w.
func (v Version) Compare(w Version) int {
	a := [4]uint64{uint64(v.Major), uint64(v.Minor), uint64(v.Revision), uint64(v.Build)}
	b := [4]uint64{uint64(w.Major), uint64(w.Minor), uint64(w.Revision), uint64(w.Build)}
	for i := range a {
		switch {
		case a[i] < b[i]:
			return -1
		case a[i] > b[i]:
			return 1
		}
	}
	return 0
}

// ParseVersion reads a semantic version that an image header can hold:
// "major.minor.revision" with an optional "+build" of digits. Pre-releases
// ("1.2.0-rc1") have no place in the header and are refused, as are
// numbers past the header's fields (255, 255, 65535, 4294967295).
func ParseVersion(s string) (Version, error) {
	core, build, hasBuild := strings.Cut(s, "+")
	if strings.Contains(core, "-") {
		return Version{}, fmt.Errorf("mcuboot: version %q: an image header has no pre-release", s)
	}
	parts := strings.Split(core, ".")
	if len(parts) != 3 {
		return Version{}, fmt.Errorf("mcuboot: version %q is not major.minor.revision", s)
	}
	var n [3]uint64
	for i, p := range parts {
		v, err := parseDecimal(p, []int{8, 8, 16}[i])
		if err != nil {
			return Version{}, fmt.Errorf("mcuboot: version %q: %v", s, err)
		}
		n[i] = v
	}
	v := Version{Major: uint8(n[0]), Minor: uint8(n[1]), Revision: uint16(n[2])}
	if hasBuild {
		b, err := parseDecimal(build, 32)
		if err != nil {
			return Version{}, fmt.Errorf("mcuboot: version %q: build %v", s, err)
		}
		v.Build = uint32(b)
	}
	return v, nil
}

// ParseMCUmgrVersion reads a version as img_mgmt reports it: "1.2.3" or
// "1.2.3.4".
func ParseMCUmgrVersion(s string) (Version, error) {
	parts := strings.Split(s, ".")
	if len(parts) == 4 {
		return ParseVersion(strings.Join(parts[:3], ".") + "+" + parts[3])
	}
	return ParseVersion(s)
}

// parseDecimal reads digits without sign or leading zeros into bits bits.
func parseDecimal(s string, bits int) (uint64, error) {
	if s == "" || (len(s) > 1 && s[0] == '0') || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a number", s)
	}
	v, err := strconv.ParseUint(s, 10, bits)
	if err != nil {
		return 0, fmt.Errorf("%s does not fit in %d bits", s, bits)
	}
	return v, nil
}

// Header is the fixed part of an image header. All its fields are little
// endian on the wire.
type Header struct {
	LoadAddr       uint32
	HeaderSize     uint16 // bytes before the image: the 32 of the header and padding (Zephyr: 0x200)
	ProtectTLVSize uint16 // bytes of the protected TLV area, its info included; 0 when none
	ImageSize      uint32 // bytes of the image, header not included
	Flags          uint32
	Version        Version
}

// Encrypted reports whether the image is encrypted.
func (h Header) Encrypted() bool {
	return h.Flags&(FlagEncryptedAES128|FlagEncryptedAES256) != 0
}

// HashedSize is how many bytes the hash TLV covers: header, image and
// protected TLVs.
func (h Header) HashedSize() int64 {
	return int64(h.HeaderSize) + int64(h.ImageSize) + int64(h.ProtectTLVSize)
}

// appendHeader appends the 32 bytes of h.
func appendHeader(b []byte, h Header) []byte {
	b = binary.LittleEndian.AppendUint32(b, Magic)
	b = binary.LittleEndian.AppendUint32(b, h.LoadAddr)
	b = binary.LittleEndian.AppendUint16(b, h.HeaderSize)
	b = binary.LittleEndian.AppendUint16(b, h.ProtectTLVSize)
	b = binary.LittleEndian.AppendUint32(b, h.ImageSize)
	b = binary.LittleEndian.AppendUint32(b, h.Flags)
	b = append(b, h.Version.Major, h.Version.Minor)
	b = binary.LittleEndian.AppendUint16(b, h.Version.Revision)
	b = binary.LittleEndian.AppendUint32(b, h.Version.Build)
	return binary.LittleEndian.AppendUint32(b, 0) // _pad1
}

// ParseHeader reads the header at the start of b, as img_mgmt reads the
// first chunk of an upload: it checks the magic and that the header's
// sizes hang together, not the image behind it.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, &FormatError{Field: "header", Msg: fmt.Sprintf("%d bytes; an MCUboot header has %d", len(b), HeaderSize)}
	}
	if m := binary.LittleEndian.Uint32(b); m != Magic {
		return Header{}, &FormatError{Field: "magic", Msg: fmt.Sprintf("0x%08x is not MCUboot's 0x%08x", m, Magic)}
	}
	h := Header{
		LoadAddr:       binary.LittleEndian.Uint32(b[4:]),
		HeaderSize:     binary.LittleEndian.Uint16(b[8:]),
		ProtectTLVSize: binary.LittleEndian.Uint16(b[10:]),
		ImageSize:      binary.LittleEndian.Uint32(b[12:]),
		Flags:          binary.LittleEndian.Uint32(b[16:]),
		Version: Version{
			Major:    b[20],
			Minor:    b[21],
			Revision: binary.LittleEndian.Uint16(b[22:]),
			Build:    binary.LittleEndian.Uint32(b[24:]),
		},
	}
	if h.HeaderSize < HeaderSize {
		return Header{}, &FormatError{Field: "header_size", Msg: fmt.Sprintf("%d is less than the %d bytes of the header", h.HeaderSize, HeaderSize)}
	}
	if h.ProtectTLVSize != 0 && h.ProtectTLVSize < tlvInfoSize {
		return Header{}, &FormatError{Field: "protected_tlv_size", Msg: fmt.Sprintf("%d is less than a TLV area's info", h.ProtectTLVSize)}
	}
	return h, nil
}

// TLV is one entry of a TLV area.
type TLV struct {
	Type  uint16
	Value []byte
}

// Image is a parsed image: its header, TLVs and the hash it carries.
type Image struct {
	Header    Header
	Protected []TLV // the protected TLVs, covered by the hash
	TLVs      []TLV // the others, the hash TLV among them
	// Hash is the value of the image's hash TLV, as img_mgmt reports it
	// in the image state and takes it to mark the image for test.
	Hash     []byte
	HashType uint16 // the hash TLV's type: TLVSHA256, TLVSHA384 or TLVSHA512
	// End is the bytes of header, image and TLV areas: all MCUboot reads
	// of the image, and what an upload sends. Size - End bytes of padding
	// follow in an image padded to its slot.
	End     int64
	Size    int64   // bytes of the whole file
	Trailer Trailer // what the trailer ending the padding asks (Parse only)
}

// FormatError is what is wrong with an image, and where: Field names the
// part ("header", "magic", "header_size", "protected_tlv_size",
// "image_size", "protected_tlv", "tlv_info", "tlv", "hash" when there is
// not exactly one hash TLV, "sha256", "sha384" or "sha512" for a hash TLV
// that is wrong, "padding" for what follows the TLV areas).
type FormatError struct {
	Field string
	Msg   string
}

func (e *FormatError) Error() string { return "mcuboot: " + e.Field + ": " + e.Msg }

// Parse reads a whole image and checks it as MCUboot does before it boots
// one, signatures aside: magic, sizes, both TLV areas, exactly one hash
// TLV (SHA-256, SHA-384 or SHA-512), and that the hash of header, image
// and protected TLVs matches it. The hash of an encrypted image is over
// its plain text, so it is found but not checked. What follows the TLV
// areas may only be the padding of an image padded to its slot (imgtool
// sign --pad): erased flash (0xff), ending in MCUboot's image trailer
// (the boot magic last, image_ok set or not) or not.
//
// With the whole image at hand, Parse reads its TLVs first and hashes it
// once, with the hash it carries; a Verifier, which sees the TLVs only
// after the bytes they hash, hashes with each.
func Parse(b []byte) (*Image, error) {
	v := NewVerifier()
	if info, err := ReadInfo(b); err == nil {
		for _, t := range info.TLVs {
			if i := hashIndex(t.Type); i >= 0 {
				v.only = append(v.only, i)
			}
		}
	}
	v.Write(b)
	return v.Close()
}

// ReadInfo reads an image's header and TLVs without hashing it, as
// img_mgmt reads a slot to report its version and hash; like img_mgmt it
// does not look at what follows the TLVs.
func ReadInfo(b []byte) (*Image, error) {
	v := &Verifier{infoOnly: true}
	v.Write(b)
	return v.Close()
}

// Verifier checks an image as it streams past: Write it every byte, then
// Close. It holds the header and the TLV areas (at most 128 KiB) and the
// last bytes of any padding, never the image. It is an io.Writer whose
// Write never fails, so that it can sit beside a store that takes the
// bytes; the verdict comes at Close.
type Verifier struct {
	infoOnly bool // ReadInfo: neither hash nor padding checked
	head     []byte
	hdr      Header
	err      error
	// hs hash the image with each algorithm of hashes, hs[i] with
	// hashes[i]: which one the image carries is known only from its TLVs,
	// after the bytes hashed. With only set (Parse, which read the TLVs
	// first), just those are made; the others stay nil.
	hs   []hash.Hash
	only []int
	n    int64  // bytes written
	tail []byte // bytes after header and image: the TLV areas
	pad  padding
}

// NewVerifier returns a Verifier for one image.
func NewVerifier() *Verifier { return &Verifier{} }

// Write takes the next bytes of the image. It always returns len(p), nil.
func (v *Verifier) Write(p []byte) (int, error) {
	n := len(p)
	if v.err != nil {
		v.n += int64(n)
		return n, nil
	}
	if len(v.head) < HeaderSize {
		k := min(HeaderSize-len(v.head), len(p))
		v.head = append(v.head, p[:k]...)
		p = p[k:]
		v.n += int64(k)
		if len(v.head) < HeaderSize {
			return n, nil
		}
		v.hdr, v.err = ParseHeader(v.head)
		if v.err != nil {
			v.n += int64(len(p))
			return n, nil
		}
		if !v.infoOnly {
			v.hs = make([]hash.Hash, len(hashes))
			for i, h := range hashes {
				if v.only == nil || slices.Contains(v.only, i) {
					v.hs[i] = h.new()
					v.hs[i].Write(v.head)
				}
			}
		}
	}
	if hashed := v.hdr.HashedSize(); v.n < hashed {
		k := min(int64(len(p)), hashed-v.n)
		for _, h := range v.hs {
			if h != nil {
				h.Write(p[:k])
			}
		}
	}
	tlvStart := int64(v.hdr.HeaderSize) + int64(v.hdr.ImageSize)
	if end := v.n + int64(len(p)); end > tlvStart {
		rest := p[max(tlvStart-v.n, 0):]
		for len(rest) > 0 {
			need := v.tlvNeed()
			if need == 0 {
				break
			}
			k := min(need, len(rest))
			v.tail = append(v.tail, rest[:k]...)
			rest = rest[k:]
		}
		if !v.infoOnly {
			v.pad.write(rest)
		}
	}
	v.n += int64(len(p))
	return n, nil
}

// tlvNeed is how many more bytes the TLV areas take: up to the info of the
// unprotected area (after the protected area the header sizes), then as
// many as that info says. A broken info is found at Close.
func (v *Verifier) tlvNeed() int {
	prot := int(v.hdr.ProtectTLVSize)
	if info := prot + tlvInfoSize; len(v.tail) < info {
		return info - len(v.tail)
	}
	tot := max(int(binary.LittleEndian.Uint16(v.tail[prot+2:])), tlvInfoSize)
	return prot + tot - len(v.tail)
}

// Close checks what was written and returns the image, or a *FormatError.
func (v *Verifier) Close() (*Image, error) {
	if v.err != nil {
		return nil, v.err
	}
	if len(v.head) < HeaderSize {
		return nil, &FormatError{Field: "header", Msg: fmt.Sprintf("%d bytes; an MCUboot header has %d", len(v.head), HeaderSize)}
	}
	h := v.hdr
	tlvStart := int64(h.HeaderSize) + int64(h.ImageSize)
	if v.n < tlvStart+tlvInfoSize {
		return nil, &FormatError{Field: "image_size", Msg: fmt.Sprintf("the header says %d bytes of header and %d of image; the file has %d bytes and no TLVs after them", h.HeaderSize, h.ImageSize, v.n)}
	}
	img := &Image{Header: h, Size: v.n, End: tlvStart + int64(len(v.tail))}
	tail := v.tail
	if h.ProtectTLVSize > 0 {
		tlvs, err := readArea(tail, ProtectedTLVInfoMagic, "protected_tlv")
		if err != nil {
			return nil, err
		}
		if tot := binary.LittleEndian.Uint16(tail[2:]); tot != h.ProtectTLVSize {
			return nil, &FormatError{Field: "protected_tlv", Msg: fmt.Sprintf("the area's info says %d bytes; the header's protected TLV size is %d", tot, h.ProtectTLVSize)}
		}
		img.Protected = tlvs
		tail = tail[h.ProtectTLVSize:]
	} else if len(tail) >= 2 && binary.LittleEndian.Uint16(tail) == ProtectedTLVInfoMagic {
		return nil, &FormatError{Field: "protected_tlv", Msg: "a protected TLV area follows the image, but the header's protected TLV size is 0"}
	}
	tlvs, err := readArea(tail, TLVInfoMagic, "tlv_info")
	if err != nil {
		return nil, err
	}
	img.TLVs = tlvs
	if !v.infoOnly {
		if img.Trailer, err = v.pad.verdict(img.End); err != nil {
			return nil, err
		}
	}
	hashAt := -1
	for _, t := range tlvs {
		i := hashIndex(t.Type)
		if i < 0 {
			continue
		}
		if img.Hash != nil {
			return nil, &FormatError{Field: "hash", Msg: fmt.Sprintf("two hash TLVs, %s and %s; an image carries the one its MCUboot checks", HashName(img.HashType), hashes[i].name)}
		}
		if size := hashes[i].size; len(t.Value) != size {
			return nil, &FormatError{Field: hashes[i].field, Msg: fmt.Sprintf("the %s TLV has %d bytes, not %d", hashes[i].name, len(t.Value), size)}
		}
		img.Hash, img.HashType, hashAt = t.Value, t.Type, i
	}
	if img.Hash == nil {
		return nil, &FormatError{Field: "hash", Msg: "no hash TLV: an image carries its SHA-256 (type 0x10), SHA-384 (0x11) or SHA-512 (0x12)"}
	}
	if v.hs != nil && !h.Encrypted() {
		// v.hs[hashAt] is nil only if the TLVs Parse read first were not
		// these, which the same bytes cannot be.
		if sum := v.hs[hashAt].Sum(nil); !bytes.Equal(sum, img.Hash) {
			return nil, &FormatError{Field: hashes[hashAt].field, Msg: fmt.Sprintf("the %s of header, image and protected TLVs is %x; the TLV says %x", hashes[hashAt].name, sum, img.Hash)}
		}
	}
	return img, nil
}

// padding checks, as they stream past, the bytes that follow an image's
// TLV areas: erased flash (0xff) but for the trailer at the end, whose
// last trailerWindow bytes it keeps to read at the end.
type padding struct {
	n       int64  // bytes seen
	last    []byte // the last trailerWindow of them, or fewer
	bad     bool   // a byte before last is not 0xff…
	badAt   int64  // …the first, at this offset in the padding…
	badByte byte   // …of this value
}

// trailerWindow is the end of an image trailer that is read: the boot
// magic and image_ok before it, with BOOT_MAX_ALIGN 32 at most.
const trailerWindow = 64

func (p *padding) write(b []byte) {
	if len(b) == 0 {
		return
	}
	p.n += int64(len(b))
	if len(b) >= trailerWindow {
		p.check(p.last, p.n-int64(len(b))-int64(len(p.last)))
		p.check(b[:len(b)-trailerWindow], p.n-int64(len(b)))
		p.last = append(p.last[:0], b[len(b)-trailerWindow:]...)
		return
	}
	p.last = append(p.last, b...)
	if k := len(p.last) - trailerWindow; k > 0 {
		p.check(p.last[:k], p.n-int64(len(p.last)))
		p.last = append(p.last[:0], p.last[k:]...)
	}
}

// check notes the first byte of b (at offset off of the padding) that is
// not erased flash, unless one was noted before.
func (p *padding) check(b []byte, off int64) {
	if p.bad {
		return
	}
	for i, c := range b {
		if c != 0xff {
			p.bad, p.badAt, p.badByte = true, off+int64(i), c
			return
		}
	}
}

// verdict is what the trailer at the padding's end asks, or the
// *FormatError of a byte that has no place in padding (end is where the
// TLV areas end and the padding starts, for the message).
func (p *padding) verdict(end int64) (Trailer, error) {
	fail := func(off int64, c byte) error {
		return &FormatError{Field: "padding", Msg: fmt.Sprintf("byte 0x%02x at offset %d after the TLV areas, which end at %d: only erased flash (0xff) may follow them, ending in MCUboot's image trailer as imgtool sign --pad writes it", c, off, end)}
	}
	if p.bad {
		return TrailerNone, fail(end+p.badAt, p.badByte)
	}
	w, base := p.last, end+p.n-int64(len(p.last))
	t, fill, okAt := TrailerNone, len(w), -1
	if align := magicAlign(w); align > 0 {
		t, fill, okAt = TrailerTest, len(w)-len(BootMagic), imageOKOffset(len(w), align)
		if okAt >= 0 && w[okAt] == flagSet {
			t = TrailerPermanent
		}
	}
	for i, c := range w[:fill] {
		if c != 0xff && (i != okAt || c != flagSet) {
			return TrailerNone, fail(base+int64(i), c)
		}
	}
	return t, nil
}

// BootMagic ends an MCUboot image trailer (boot_img_magic) when the
// flash's largest write alignment, BOOT_MAX_ALIGN, is 8, as in most
// builds. With 16 or 32 the 16 bytes of the magic are that alignment
// (little endian) and the 14 of alignedMagic.
var BootMagic = [16]byte{0x77, 0xc2, 0x95, 0xf3, 0x60, 0xd2, 0xef, 0x7f, 0x35, 0x52, 0x50, 0x0f, 0x2c, 0xb6, 0x79, 0x80}

var alignedMagic = [14]byte{0x2d, 0xe1, 0x5d, 0x29, 0x41, 0x0b, 0x8d, 0x77, 0x67, 0x9c, 0x11, 0x0f, 0x1f, 0x8a}

// flagSet is a trailer flag set (BOOT_FLAG_SET); an erased one is unset.
const flagSet = 0x01

// Trailer is what the image trailer at the end of a slot asks of MCUboot,
// as boot_read_swap_state reads the secondary slot's: its boot magic, and
// image_ok.
type Trailer int

const (
	// TrailerNone: no boot magic; nothing is asked.
	TrailerNone Trailer = iota
	// TrailerTest: the magic with image_ok unset (imgtool sign --pad or
	// --test): MCUboot swaps the image in for test at the next boot.
	TrailerTest
	// TrailerPermanent: the magic with image_ok set (imgtool sign
	// --confirm, Zephyr's zephyr.signed.confirmed.bin): MCUboot swaps it
	// in for good, with no revert.
	TrailerPermanent
)

func (t Trailer) String() string {
	switch t {
	case TrailerTest:
		return "test"
	case TrailerPermanent:
		return "permanent"
	}
	return "none"
}

// ReadTrailer reads the image trailer at the end of slot, the bytes of a
// whole slot: the boot magic in its last 16 bytes, and image_ok
// BOOT_MAX_ALIGN bytes before the magic's aligned start.
func ReadTrailer(slot []byte) Trailer {
	align := magicAlign(slot)
	if align == 0 {
		return TrailerNone
	}
	if at := imageOKOffset(len(slot), align); at >= 0 && slot[at] == flagSet {
		return TrailerPermanent
	}
	return TrailerTest
}

// magicAlign is the BOOT_MAX_ALIGN of the boot magic that ends b: 8 for
// BootMagic, 16 or 32 for the aligned form, 0 when b does not end in one.
func magicAlign(b []byte) int {
	if len(b) < len(BootMagic) {
		return 0
	}
	m := b[len(b)-len(BootMagic):]
	if bytes.Equal(m, BootMagic[:]) {
		return 8
	}
	if a := int(binary.LittleEndian.Uint16(m)); (a == 16 || a == 32) && bytes.Equal(m[2:], alignedMagic[:]) {
		return a
	}
	return 0
}

// magicBytes is the boot magic for a BOOT_MAX_ALIGN of align.
func magicBytes(align int) []byte {
	if align == 8 {
		return BootMagic[:]
	}
	return append(binary.LittleEndian.AppendUint16(nil, uint16(align)), alignedMagic[:]...)
}

// imageOKOffset is where image_ok is in the last n bytes of a slot whose
// magic is for a BOOT_MAX_ALIGN of align: one alignment unit before the
// magic, itself aligned up to align.
func imageOKOffset(n, align int) int {
	return n - (alignUp(len(BootMagic), align) + align)
}

func alignUp(n, align int) int { return (n + align - 1) / align * align }

// readArea reads the TLV area at the start of b: its info (magic and total
// size, info included) and its entries, which must fill it exactly.
func readArea(b []byte, magic uint16, field string) ([]TLV, error) {
	if len(b) < tlvInfoSize {
		return nil, &FormatError{Field: field, Msg: "missing"}
	}
	if m := binary.LittleEndian.Uint16(b); m != magic {
		return nil, &FormatError{Field: field, Msg: fmt.Sprintf("magic 0x%04x is not 0x%04x", m, magic)}
	}
	tot := int(binary.LittleEndian.Uint16(b[2:]))
	if tot < tlvInfoSize || tot > len(b) {
		return nil, &FormatError{Field: field, Msg: fmt.Sprintf("the area's size %d does not fit the %d bytes after the image", tot, len(b))}
	}
	var tlvs []TLV
	for off := tlvInfoSize; off < tot; {
		if off+tlvHeadSize > tot {
			return nil, &FormatError{Field: "tlv", Msg: fmt.Sprintf("a TLV header at %d runs past the area's end", off)}
		}
		typ := binary.LittleEndian.Uint16(b[off:])
		n := int(binary.LittleEndian.Uint16(b[off+2:]))
		off += tlvHeadSize
		if off+n > tot {
			return nil, &FormatError{Field: "tlv", Msg: fmt.Sprintf("TLV 0x%02x of %d bytes runs past the area's end", typ, n)}
		}
		tlvs = append(tlvs, TLV{Type: typ, Value: append([]byte(nil), b[off:off+n]...)})
		off += n
	}
	return tlvs, nil
}

// Options shape an image Build writes. The zero value of a field means its
// default.
type Options struct {
	Version    Version
	LoadAddr   uint32
	HeaderSize int // default HeaderSize (32); Zephyr's builds use 0x200
	Flags      uint32
	// Protected are TLVs of the protected area (a security counter, …);
	// the hash covers them.
	Protected []TLV
	// Hash is the type of the hash TLV: TLVSHA256 (the default),
	// TLVSHA384 or TLVSHA512, as imgtool sign's --sha 256, 384 or 512.
	Hash uint16
	// TLVs are added to the unprotected area after the hash TLV.
	TLVs []TLV
	// SlotSize, when set, pads the image to a slot of that many bytes as
	// imgtool sign's --pad with --slot-size does: erased flash (0xff) to
	// the end, where the image trailer ends in the boot magic (a request
	// to swap the image in for test).
	SlotSize int
	// Confirm sets image_ok in the trailer of a padded image (a request
	// to swap it in for good), as imgtool sign --confirm does and
	// Zephyr's zephyr.signed.confirmed.bin has it.
	Confirm bool
	// MaxAlign is imgtool's --max-align for a padded image, the
	// bootloader's BOOT_MAX_ALIGN: 8 (the default), 16 or 32.
	MaxAlign int
}

// Build writes payload as an image, byte for byte as `imgtool sign
// --pad-header` does without a key: header (padded to HeaderSize with
// 0xff), payload, protected TLVs, then the unprotected area with the
// hash TLV; and with a SlotSize, the padding and trailer of --pad.
func Build(payload []byte, opts Options) ([]byte, error) {
	if opts.HeaderSize == 0 {
		opts.HeaderSize = HeaderSize
	}
	if opts.HeaderSize < HeaderSize || opts.HeaderSize > 0xffff {
		return nil, fmt.Errorf("mcuboot: header size %d is not in %d…65535", opts.HeaderSize, HeaderSize)
	}
	if uint64(len(payload)) > 0xffffffff {
		return nil, fmt.Errorf("mcuboot: %d bytes do not fit an image", len(payload))
	}
	if opts.Hash == 0 {
		opts.Hash = TLVSHA256
	}
	hi := hashIndex(opts.Hash)
	if hi < 0 {
		return nil, fmt.Errorf("mcuboot: TLV 0x%02x is not a hash TLV (0x10, 0x11 or 0x12)", opts.Hash)
	}
	if opts.MaxAlign == 0 {
		opts.MaxAlign = 8
	}
	switch {
	case opts.MaxAlign != 8 && opts.MaxAlign != 16 && opts.MaxAlign != 32:
		return nil, fmt.Errorf("mcuboot: max align %d is not 8, 16 or 32", opts.MaxAlign)
	case opts.SlotSize == 0 && (opts.Confirm || opts.MaxAlign != 8):
		return nil, errors.New("mcuboot: Confirm and MaxAlign shape the trailer of a padded image: set SlotSize")
	}
	prot, err := appendArea(nil, ProtectedTLVInfoMagic, opts.Protected)
	if err != nil {
		return nil, err
	}
	h := Header{
		LoadAddr:       opts.LoadAddr,
		HeaderSize:     uint16(opts.HeaderSize),
		ProtectTLVSize: uint16(len(prot)),
		ImageSize:      uint32(len(payload)),
		Flags:          opts.Flags,
		Version:        opts.Version,
	}
	out := make([]byte, 0, max(opts.HeaderSize+len(payload)+len(prot)+tlvInfoSize+tlvHeadSize+sha512.Size, opts.SlotSize))
	out = appendHeader(out, h)
	for range opts.HeaderSize - HeaderSize {
		out = append(out, 0xff) // erased flash, as imgtool's --pad-header leaves it
	}
	out = append(out, payload...)
	out = append(out, prot...)
	sum := hashes[hi].new()
	sum.Write(out)
	tlvs := append([]TLV{{Type: opts.Hash, Value: sum.Sum(nil)}}, opts.TLVs...)
	out, err = appendArea(out, TLVInfoMagic, tlvs)
	if err != nil {
		return nil, err
	}
	if opts.SlotSize == 0 {
		return out, nil
	}
	// imgtool's _trailer_size with its defaults (--align 1, --max-sectors
	// 128, swap rather than overwrite-only): the status area, four flags
	// and the magic.
	trailer := 128*3*1 + opts.MaxAlign*4 + alignUp(len(BootMagic), opts.MaxAlign)
	if len(out)+trailer > opts.SlotSize {
		return nil, fmt.Errorf("mcuboot: the image (%d bytes) and its trailer (%d) do not fit a slot of %d", len(out), trailer, opts.SlotSize)
	}
	start := len(out)
	for range opts.SlotSize - len(out) - len(BootMagic) {
		out = append(out, 0xff)
	}
	out = append(out, magicBytes(opts.MaxAlign)...)
	if opts.Confirm {
		out[start+imageOKOffset(opts.SlotSize-start, opts.MaxAlign)] = flagSet
	}
	return out, nil
}

// MustBuild is Build for callers whose options are known to be good (tests,
// the simulator's first image); it panics on an error.
func MustBuild(payload []byte, opts Options) []byte {
	b, err := Build(payload, opts)
	if err != nil {
		panic(err)
	}
	return b
}

// appendArea appends a TLV area; an empty protected area is no area at all.
func appendArea(b []byte, magic uint16, tlvs []TLV) ([]byte, error) {
	if len(tlvs) == 0 && magic == ProtectedTLVInfoMagic {
		return b, nil
	}
	tot := tlvInfoSize
	for _, t := range tlvs {
		tot += tlvHeadSize + len(t.Value)
	}
	if tot > maxTLVArea {
		return nil, fmt.Errorf("mcuboot: TLV area of %d bytes is over %d", tot, maxTLVArea)
	}
	b = binary.LittleEndian.AppendUint16(b, magic)
	b = binary.LittleEndian.AppendUint16(b, uint16(tot))
	for _, t := range tlvs {
		b = binary.LittleEndian.AppendUint16(b, t.Type)
		b = binary.LittleEndian.AppendUint16(b, uint16(len(t.Value)))
		b = append(b, t.Value...)
	}
	return b, nil
}
