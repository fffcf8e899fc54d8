package mcuboot_test

import (
	"bytes"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/devicecompanion/companion/mcuboot"
)

// The files in testdata were written by MCUboot's imgtool from payload.bin:
//
//	imgtool sign --version 1.2.3+4 --header-size 0x200 --pad-header --slot-size 0x20000 payload.bin imgtool-1.2.3+4.bin
//	imgtool sign --version 2.0.0 --header-size 0x200 --pad-header --slot-size 0x20000 --security-counter 7 payload.bin imgtool-2.0.0-seccnt7.bin
//
// imgtool verify reports the second's digest as below.
func TestImgtoolImages(t *testing.T) {
	payload := readFile(t, "payload.bin")
	for _, tt := range []struct {
		file string
		opts mcuboot.Options
		hash string
	}{
		{"imgtool-1.2.3+4.bin", mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2, Revision: 3, Build: 4}, HeaderSize: 0x200}, ""},
		{"imgtool-2.0.0-seccnt7.bin", mcuboot.Options{Version: mcuboot.Version{Major: 2}, HeaderSize: 0x200,
			Protected: []mcuboot.TLV{{Type: mcuboot.TLVSecurityCounter, Value: []byte{7, 0, 0, 0}}}},
			"b4e288b3a789f0348f0f55d4b8ee81bca86ba1c04c0ef0b345617bb619adebfa"},
	} {
		t.Run(tt.file, func(t *testing.T) {
			want := readFile(t, tt.file)
			img, err := mcuboot.Parse(want)
			if err != nil {
				t.Fatalf("Parse(%s) = %v", tt.file, err)
			}
			if img.Header.Version != tt.opts.Version || img.Header.HeaderSize != 0x200 || int(img.Header.ImageSize) != len(payload) {
				t.Errorf("Parse(%s).Header = %+v", tt.file, img.Header)
			}
			if tt.hash != "" && hex.EncodeToString(img.Hash) != tt.hash {
				t.Errorf("Parse(%s).Hash = %x; want imgtool's %s", tt.file, img.Hash, tt.hash)
			}
			if len(img.Protected) != len(tt.opts.Protected) {
				t.Errorf("Parse(%s) has %d protected TLVs; want %d", tt.file, len(img.Protected), len(tt.opts.Protected))
			}
			got, err := mcuboot.Build(payload, tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("Build(payload, %+v) differs from imgtool's %s", tt.opts, tt.file)
			}
		})
	}
}

func readFile(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// Every way an image can be broken is refused naming the part.
func TestParseRefuses(t *testing.T) {
	good := mcuboot.MustBuild(bytes.Repeat([]byte{0xa5}, 300), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 1}})
	edit := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	tlvStart := 32 + 300
	for _, tt := range []struct {
		name  string
		b     []byte
		field string
	}{
		{"empty", nil, "header"},
		{"short header", good[:20], "header"},
		{"not an image", bytes.Repeat([]byte("firmware"), 100), "magic"},
		{"header size below 32", edit(func(b []byte) []byte { b[8] = 16; return b }), "header_size"},
		{"truncated image", good[:200], "image_size"},
		{"no TLVs", good[:tlvStart], "image_size"},
		{"image size too large", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[12:], 1<<20); return b }), "image_size"},
		{"bad TLV magic", edit(func(b []byte) []byte { b[tlvStart] = 0; return b }), "tlv_info"},
		{"bytes after the TLVs", append(bytes.Clone(good), 0xff, 0x00, 0xff), "padding"},
		{"a zero after the TLVs", append(bytes.Clone(good), 0x00), "padding"},
		{"junk before the boot magic", append(append(bytes.Clone(good), bytes.Repeat([]byte{0xff, 0x5a}, 100)...), mcuboot.BootMagic[:]...), "padding"},
		{"the boot magic cut short", append(append(bytes.Clone(good), bytes.Repeat([]byte{0xff}, 100)...), mcuboot.BootMagic[:15]...), "padding"},
		{"bytes after the boot magic", append(append(bytes.Clone(good), mcuboot.BootMagic[:]...), 0xff), "padding"},
		{"image_ok neither set nor erased", edit(func(b []byte) []byte {
			b = append(b, bytes.Repeat([]byte{0xff}, 100)...)
			b = append(b, mcuboot.BootMagic[:]...)
			b[len(b)-24] = 0x02
			return b
		}), "padding"},
		{"area size past the end", edit(func(b []byte) []byte { b[tlvStart+2]++; return b }), "tlv_info"},
		{"corrupt image byte", edit(func(b []byte) []byte { b[100] ^= 1; return b }), "sha256"},
		{"corrupt hash", edit(func(b []byte) []byte { b[len(b)-1] ^= 1; return b }), "sha256"},
		{"no hash TLV", edit(func(b []byte) []byte { b[tlvStart+4] = 0x20; return b }), "hash"},
		{"SHA-384 TLV of 32 bytes", edit(func(b []byte) []byte { b[tlvStart+4] = 0x11; return b }), "sha384"},
		{"SHA-512 TLV of 32 bytes", edit(func(b []byte) []byte { b[tlvStart+4] = 0x12; return b }), "sha512"},
		{"two hash TLVs", mcuboot.MustBuild(bytes.Repeat([]byte{0xa5}, 300), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 1},
			TLVs: []mcuboot.TLV{{Type: mcuboot.TLVSHA512, Value: make([]byte, 64)}}}), "hash"},
		{"corrupt SHA-512 image", func() []byte {
			b := mcuboot.MustBuild(bytes.Repeat([]byte{0xa5}, 300), mcuboot.Options{Hash: mcuboot.TLVSHA512})
			b[100] ^= 1
			return b
		}(), "sha512"},
		{"protected area not in header", edit(func(b []byte) []byte {
			binary.LittleEndian.PutUint16(b[tlvStart:], mcuboot.ProtectedTLVInfoMagic)
			return b
		}), "protected_tlv"},
		{"protected size without area", edit(func(b []byte) []byte { binary.LittleEndian.PutUint16(b[10:], 8); return b }), "protected_tlv"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := mcuboot.Parse(tt.b)
			var fe *mcuboot.FormatError
			if !errors.As(err, &fe) || fe.Field != tt.field {
				t.Errorf("Parse(%s) = %v; want a FormatError of field %q", tt.name, err, tt.field)
			}
		})
	}
}

// A Verifier fed a byte at a time agrees with Parse; ReadInfo skips the
// hash (as img_mgmt does) but checks the structure.
func TestVerifierStreams(t *testing.T) {
	payload := make([]byte, 5000)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	b := mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 3, Minor: 1, Revision: 4, Build: 1},
		HeaderSize: 0x200, Protected: []mcuboot.TLV{{Type: mcuboot.TLVSecurityCounter, Value: []byte{1, 0, 0, 0}}},
		TLVs: []mcuboot.TLV{{Type: 0x01, Value: make([]byte, 32)}}})
	v := mcuboot.NewVerifier()
	for i := range b {
		v.Write(b[i : i+1])
	}
	img, err := v.Close()
	if err != nil {
		t.Fatalf("streamed: %v", err)
	}
	sum := sha256.Sum256(b[:img.Header.HashedSize()])
	if !bytes.Equal(img.Hash, sum[:]) || img.Size != int64(len(b)) || len(img.TLVs) != 2 {
		t.Errorf("streamed image %+v", img)
	}
	b[300] ^= 0xff
	if _, err := mcuboot.Parse(b); err == nil {
		t.Error("Parse of a corrupt image succeeded")
	}
	if img, err := mcuboot.ReadInfo(b); err != nil || img.Header.Version.String() != "3.1.4+1" {
		t.Errorf("ReadInfo of a corrupt image = %v, %v; want its info", img, err)
	}
}

// An image carries the hash its MCUboot checks, SHA-256, SHA-384 or
// SHA-512 (imgtool sign --sha): Parse finds and checks whichever it is,
// at once or streamed, and ReadInfo reports it as img_mgmt does.
func TestHashTypes(t *testing.T) {
	payload := bytes.Repeat([]byte("the application "), 400)
	for _, tt := range []struct {
		typ  uint16
		sum  func([]byte) []byte
		name string
	}{
		{0, func(b []byte) []byte { s := sha256.Sum256(b); return s[:] }, "SHA-256"},
		{mcuboot.TLVSHA256, func(b []byte) []byte { s := sha256.Sum256(b); return s[:] }, "SHA-256"},
		{mcuboot.TLVSHA384, func(b []byte) []byte { s := sha512.Sum384(b); return s[:] }, "SHA-384"},
		{mcuboot.TLVSHA512, func(b []byte) []byte { s := sha512.Sum512(b); return s[:] }, "SHA-512"},
	} {
		b := mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 2}, HeaderSize: 0x200, Hash: tt.typ,
			Protected: []mcuboot.TLV{{Type: mcuboot.TLVSecurityCounter, Value: []byte{3, 0, 0, 0}}}})
		v := mcuboot.NewVerifier()
		for rest := b; len(rest) > 0; rest = rest[min(len(rest), 7):] {
			v.Write(rest[:min(len(rest), 7)])
		}
		streamed, err := v.Close()
		if err != nil {
			t.Fatalf("%s image, streamed: %v", tt.name, err)
		}
		img, err := mcuboot.Parse(b)
		if err != nil {
			t.Fatalf("Parse(%s image) = %v", tt.name, err)
		}
		want := tt.sum(b[:img.Header.HashedSize()])
		if !bytes.Equal(img.Hash, want) || !bytes.Equal(streamed.Hash, want) || mcuboot.HashName(img.HashType) != tt.name ||
			len(img.Hash) != mcuboot.HashSize(img.HashType) || img.End != int64(len(b)) || img.Trailer != mcuboot.TrailerNone {
			t.Errorf("Parse(%s image) = hash %x of %s, end %d, trailer %v; want %x, end %d", tt.name, img.Hash, mcuboot.HashName(img.HashType), img.End, img.Trailer, want, len(b))
		}
		if info, err := mcuboot.ReadInfo(b); err != nil || !bytes.Equal(info.Hash, want) || info.HashType != img.HashType {
			t.Errorf("ReadInfo(%s image) = %+v, %v", tt.name, info, err)
		}
	}
	if mcuboot.HashSize(mcuboot.TLVSecurityCounter) != 0 {
		t.Errorf("HashSize(0x50) = %d; want 0: not a hash", mcuboot.HashSize(mcuboot.TLVSecurityCounter))
	}
}

// An image padded to its slot (imgtool sign --pad; --confirm, as Zephyr's
// zephyr.signed.confirmed.bin) is an image followed by erased flash and
// MCUboot's trailer: Parse takes it, says where the image ends and what
// the trailer asks, whichever the magic's alignment; the bytes up to End
// are the image itself. Erased flash alone after the TLVs is taken too.
func TestPaddedImages(t *testing.T) {
	payload := bytes.Repeat([]byte("the application "), 400)
	base := mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 4}, HeaderSize: 0x200}
	plain := mcuboot.MustBuild(payload, base)
	for _, tt := range []struct {
		name    string
		opts    func(o mcuboot.Options) mcuboot.Options
		trailer mcuboot.Trailer
	}{
		{"--pad", func(o mcuboot.Options) mcuboot.Options { o.SlotSize = 0x8000; return o }, mcuboot.TrailerTest},
		{"--confirm", func(o mcuboot.Options) mcuboot.Options { o.SlotSize, o.Confirm = 0x8000, true; return o }, mcuboot.TrailerPermanent},
		{"--confirm --max-align 16", func(o mcuboot.Options) mcuboot.Options {
			o.SlotSize, o.Confirm, o.MaxAlign = 0x8000, true, 16
			return o
		}, mcuboot.TrailerPermanent},
		{"--pad --max-align 32", func(o mcuboot.Options) mcuboot.Options { o.SlotSize, o.MaxAlign = 0x8000, 32; return o }, mcuboot.TrailerTest},
		{"--confirm --sha 512", func(o mcuboot.Options) mcuboot.Options {
			o.SlotSize, o.Confirm, o.Hash = 0x8000, true, mcuboot.TLVSHA512
			return o
		}, mcuboot.TrailerPermanent},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o := tt.opts(base)
			b := mcuboot.MustBuild(payload, o)
			o.SlotSize, o.Confirm, o.MaxAlign = 0, false, 0
			unpadded := mcuboot.MustBuild(payload, o)
			if len(b) != 0x8000 || !bytes.Equal(b[:len(unpadded)], unpadded) {
				t.Fatalf("Build padded: %d bytes, starting with the image: %v", len(b), bytes.Equal(b[:len(unpadded)], unpadded))
			}
			v := mcuboot.NewVerifier()
			for rest := b; len(rest) > 0; rest = rest[min(len(rest), 1000):] {
				v.Write(rest[:min(len(rest), 1000)])
			}
			img, err := v.Close()
			if err != nil {
				t.Fatalf("Parse(%s image) = %v", tt.name, err)
			}
			if img.End != int64(len(unpadded)) || img.Size != 0x8000 || img.Trailer != tt.trailer || mcuboot.ReadTrailer(b) != tt.trailer {
				t.Errorf("Parse(%s image): end %d, size %d, trailer %v (ReadTrailer %v); want end %d, size %d, trailer %v",
					tt.name, img.End, img.Size, img.Trailer, mcuboot.ReadTrailer(b), len(unpadded), 0x8000, tt.trailer)
			}
			if first, err := mcuboot.Parse(b[:img.End]); err != nil || !bytes.Equal(first.Hash, img.Hash) || first.Trailer != mcuboot.TrailerNone {
				t.Errorf("Parse(the first End bytes) = %+v, %v; want the same image, no trailer", first, err)
			}
		})
	}
	erased := append(bytes.Clone(plain), bytes.Repeat([]byte{0xff}, 5000)...)
	if img, err := mcuboot.Parse(erased); err != nil || img.End != int64(len(plain)) || img.Trailer != mcuboot.TrailerNone {
		t.Errorf("Parse(image and erased flash) = %+v, %v; want end %d, no trailer", img, err, len(plain))
	}
	if _, err := mcuboot.Build(payload, mcuboot.Options{HeaderSize: 0x200, SlotSize: len(plain) + 100}); err == nil {
		t.Error("Build padded to a slot too small for the image and its trailer succeeded")
	}
	if _, err := mcuboot.Build(payload, mcuboot.Options{Confirm: true}); err == nil {
		t.Error("Build with Confirm and no slot succeeded")
	}
	if _, err := mcuboot.Build(payload, mcuboot.Options{Hash: mcuboot.TLVSecurityCounter}); err == nil {
		t.Error("Build with a hash TLV of type 0x50 succeeded")
	}
}

func TestVersions(t *testing.T) {
	for _, tt := range []struct {
		in, semver, mcumgr string
		ok                 bool
	}{
		{"1.2.3", "1.2.3", "1.2.3", true},
		{"1.2.3+4", "1.2.3+4", "1.2.3.4", true},
		{"255.255.65535+4294967295", "255.255.65535+4294967295", "255.255.65535.4294967295", true},
		{"1.2.3+0", "1.2.3", "1.2.3", true},
		{"256.0.0", "", "", false},
		{"1.2.65536", "", "", false},
		{"1.2.0-rc1", "", "", false},
		{"1.2", "", "", false},
		{"01.2.3", "", "", false},
		{"1.2.3+build", "", "", false},
	} {
		v, err := mcuboot.ParseVersion(tt.in)
		if (err == nil) != tt.ok {
			t.Errorf("ParseVersion(%q) = %v; want ok %v", tt.in, err, tt.ok)
			continue
		}
		if !tt.ok {
			continue
		}
		if v.String() != tt.semver || v.MCUmgrString() != tt.mcumgr {
			t.Errorf("ParseVersion(%q) = %s / %s; want %s / %s", tt.in, v, v.MCUmgrString(), tt.semver, tt.mcumgr)
		}
		if w, err := mcuboot.ParseMCUmgrVersion(v.MCUmgrString()); err != nil || w != v {
			t.Errorf("ParseMCUmgrVersion(%q) = %v, %v; want %v", v.MCUmgrString(), w, err, v)
		}
	}
	a, b := mcuboot.Version{Major: 1, Minor: 2, Revision: 3}, mcuboot.Version{Major: 1, Minor: 2, Revision: 3, Build: 1}
	if a.Compare(b) != -1 || b.Compare(a) != 1 || a.Compare(a) != 0 {
		t.Errorf("Compare(%s, %s) = %d", a, b, a.Compare(b))
	}
}

// Whatever a user uploads as firmware, the image checks answer without a
// panic, and the same whether the bytes come at once or in pieces (as an
// upload streams them), with or without the hash.
func FuzzParse(f *testing.F) {
	f.Add(readFile(f, "imgtool-1.2.3+4.bin"), uint16(7))
	f.Add(readFile(f, "imgtool-2.0.0-seccnt7.bin"), uint16(512))
	f.Add(mcuboot.MustBuild([]byte("hello"), mcuboot.Options{}), uint16(1))
	f.Add(mcuboot.MustBuild(nil, mcuboot.Options{Protected: []mcuboot.TLV{{Type: 0x50, Value: []byte{7, 0, 0, 0}}}}), uint16(3))
	f.Add(mcuboot.MustBuild([]byte("hello"), mcuboot.Options{Hash: mcuboot.TLVSHA512}), uint16(5))
	f.Add(mcuboot.MustBuild([]byte("hello"), mcuboot.Options{Hash: mcuboot.TLVSHA384, SlotSize: 1024, Confirm: true}), uint16(63))
	f.Fuzz(func(t *testing.T, b []byte, chunk uint16) {
		whole, err := mcuboot.Parse(b)
		v := mcuboot.NewVerifier()
		for rest := b; len(rest) > 0; {
			n := min(len(rest), int(chunk)+1)
			v.Write(rest[:n])
			rest = rest[n:]
		}
		streamed, err2 := v.Close()
		if (err == nil) != (err2 == nil) {
			t.Fatalf("at once: %v; in pieces of %d: %v", err, int(chunk)+1, err2)
		}
		info, err3 := mcuboot.ReadInfo(b)
		if err == nil {
			if !bytes.Equal(whole.Hash, streamed.Hash) {
				t.Fatalf("hash %x at once, %x in pieces", whole.Hash, streamed.Hash)
			}
			if err3 != nil || !bytes.Equal(info.Hash, whole.Hash) {
				t.Fatalf("parsed, but ReadInfo: %v", err3)
			}
		}
	})
}

// BenchmarkParse checks a 4 MiB image as the bridge does before an OTA:
// whole, once per hash type.
func BenchmarkParse(b *testing.B) {
	payload := bytes.Repeat([]byte("the application "), 4<<20/16)
	for _, typ := range []uint16{mcuboot.TLVSHA256, mcuboot.TLVSHA512} {
		img := mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1}, HeaderSize: 0x200, Hash: typ})
		b.Run(mcuboot.HashName(typ), func(b *testing.B) {
			b.SetBytes(int64(len(img)))
			for b.Loop() {
				if _, err := mcuboot.Parse(img); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A version a user names (ParseVersion) or a device reports in its image
// state (ParseMCUmgrVersion) reads back as itself from either of its
// forms: what is accepted fits the header's fields, and the bridge's
// comparison of versions is the header's.
func FuzzParseVersion(f *testing.F) {
	for _, s := range []string{"1.2.3", "1.2.3+4", "1.2.3.4", "255.255.65535+4294967295", "0.0.0", "1.2.3-rc1", "01.2.3", "1.2.3.4.5", "1.2.3+0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for name, parse := range map[string]func(string) (mcuboot.Version, error){
			"ParseVersion": mcuboot.ParseVersion, "ParseMCUmgrVersion": mcuboot.ParseMCUmgrVersion,
		} {
			v, err := parse(s)
			if err != nil {
				continue
			}
			if w, err := mcuboot.ParseVersion(v.String()); err != nil || w != v {
				t.Fatalf("%s(%q) = %+v; its String %q reads %+v, %v", name, s, v, v.String(), w, err)
			}
			if w, err := mcuboot.ParseMCUmgrVersion(v.MCUmgrString()); err != nil || w != v {
				t.Fatalf("%s(%q) = %+v; its MCUmgrString %q reads %+v, %v", name, s, v, v.MCUmgrString(), w, err)
			}
			if v.Compare(v) != 0 {
				t.Fatalf("%+v does not equal itself", v)
			}
		}
	})
}
