// Package mcuboot reads and writes firmware images in the format MCUboot
// boots and imgtool writes (CONTRACT §10): a 32-byte header (magic
// 0x96f3b83d, load address, header size, protected TLV size, image size,
// flags, version), the image, then the TLV areas, the protected one
// (magic 0x6908) first and covered by the hash, the other (magic 0x6907)
// holding at least the SHA-256 TLV (type 0x10) of header, image and
// protected TLVs.
//
// The server uses it to refuse a firmware blob that is not such an image,
// the bridge to learn the hash the device's image state reports, and the
// simulator and the tests to build images. It neither signs nor encrypts,
// and it does not verify signatures: that is the bootloader's job.
package mcuboot

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
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

// HashedSize is how many bytes the SHA-256 TLV covers: header, image and
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
	TLVs      []TLV // the others, the SHA-256 TLV among them
	Hash      []byte
	Size      int64 // bytes of the whole file
}

// FormatError is what is wrong with an image, and where: Field names the
// part ("magic", "header_size", "image_size", "protected_tlv",
// "tlv_info", "tlv", "sha256", "size").
type FormatError struct {
	Field string
	Msg   string
}

func (e *FormatError) Error() string { return "mcuboot: " + e.Field + ": " + e.Msg }

// Parse reads a whole image and checks it as MCUboot does before it boots
// one, signatures aside: magic, sizes, both TLV areas, exactly one SHA-256
// TLV, and that the SHA-256 of header, image and protected TLVs matches it.
// Nothing may follow the TLVs (imgtool's padded images with a trailer are
// flash images, not upload images). The hash of an encrypted image is over
// its plain text, so it is found but not checked.
func Parse(b []byte) (*Image, error) {
	v := NewVerifier()
	v.Write(b)
	return v.Close()
}

// ReadInfo reads an image's header and TLVs without hashing it, as
// img_mgmt reads a slot to report its version and hash.
func ReadInfo(b []byte) (*Image, error) {
	v := &Verifier{skipHash: true}
	v.Write(b)
	return v.Close()
}

// Verifier checks an image as it streams past: Write it every byte, then
// Close. It holds the header and the TLV areas (at most 128 KiB), never
// the image. It is an io.Writer whose Write never fails, so that it can
// sit beside a store that takes the bytes; the verdict comes at Close.
type Verifier struct {
	skipHash bool
	head     []byte // the first HeaderSize bytes
	hdr      Header
	err      error
	h        hash.Hash
	n        int64  // bytes written
	tail     []byte // bytes after header and image: the TLV areas
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
		if !v.skipHash {
			v.h = sha256.New()
			v.h.Write(v.head)
		}
	}
	hashed := v.hdr.HashedSize()
	if v.h != nil && v.n < hashed {
		k := min(int64(len(p)), hashed-v.n)
		v.h.Write(p[:k])
	}
	tlvStart := int64(v.hdr.HeaderSize) + int64(v.hdr.ImageSize)
	if end := v.n + int64(len(p)); end > tlvStart {
		from := max(tlvStart-v.n, 0)
		if int64(len(v.tail))+end-v.n-from > 2*(maxTLVArea+1) {
			v.err = &FormatError{Field: "size", Msg: fmt.Sprintf("more bytes follow the image (of %d bytes) than its TLV areas can hold", v.hdr.ImageSize)}
		} else {
			v.tail = append(v.tail, p[from:]...)
		}
	}
	v.n += int64(len(p))
	return n, nil
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
	img := &Image{Header: h, Size: v.n}
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
	if tot := int(binary.LittleEndian.Uint16(tail[2:])); tot != len(tail) {
		return nil, &FormatError{Field: "size", Msg: fmt.Sprintf("%d bytes follow the TLV area", len(tail)-tot)}
	}
	img.TLVs = tlvs
	for _, t := range tlvs {
		if t.Type != TLVSHA256 {
			continue
		}
		if len(t.Value) != sha256.Size {
			return nil, &FormatError{Field: "sha256", Msg: fmt.Sprintf("the SHA-256 TLV has %d bytes, not 32", len(t.Value))}
		}
		if img.Hash != nil {
			return nil, &FormatError{Field: "sha256", Msg: "more than one SHA-256 TLV"}
		}
		img.Hash = t.Value
	}
	if img.Hash == nil {
		return nil, &FormatError{Field: "sha256", Msg: "no SHA-256 TLV (type 0x10)"}
	}
	if v.h != nil && !h.Encrypted() {
		if sum := v.h.Sum(nil); string(sum) != string(img.Hash) {
			return nil, &FormatError{Field: "sha256", Msg: fmt.Sprintf("the SHA-256 of header, image and protected TLVs is %x; the TLV says %x", sum, img.Hash)}
		}
	}
	return img, nil
}

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
	// TLVs are added to the unprotected area after the SHA-256 TLV.
	TLVs []TLV
}

// Build writes payload as an image, byte for byte as `imgtool sign
// --pad-header` does without a key: header (padded to HeaderSize with
// 0xff), payload, protected TLVs, then the unprotected area with the
// SHA-256 TLV.
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
	out := make([]byte, 0, opts.HeaderSize+len(payload)+len(prot)+tlvInfoSize+tlvHeadSize+sha256.Size)
	out = appendHeader(out, h)
	for range opts.HeaderSize - HeaderSize {
		out = append(out, 0xff) // erased flash, as imgtool's --pad-header leaves it
	}
	out = append(out, payload...)
	out = append(out, prot...)
	sum := sha256.Sum256(out)
	tlvs := append([]TLV{{Type: TLVSHA256, Value: sum[:]}}, opts.TLVs...)
	out, err = appendArea(out, TLVInfoMagic, tlvs)
	if err != nil {
		return nil, err
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
