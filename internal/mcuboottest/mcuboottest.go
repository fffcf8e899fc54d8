// Package mcuboottest builds MCUboot images for tests, as a firmware
// engineer's build would publish them.
package mcuboottest

import (
	"bytes"
	"testing"

	"github.com/devicecompanion/companion/mcuboot"
)

// Image builds an MCUboot image (imgtool's format) of version of exactly
// size bytes: header, payload and the SHA-256 TLV.
func Image(tb testing.TB, version string, size int) []byte {
	tb.Helper()
	v, err := mcuboot.ParseVersion(version)
	if err != nil {
		tb.Fatal(err)
	}
	const overhead = mcuboot.HeaderSize + 4 + 4 + 32 // header, TLV info, SHA-256 TLV
	if size < overhead {
		tb.Fatalf("an image of %d bytes; one has at least %d", size, overhead)
	}
	payload := bytes.Repeat([]byte("firmware "+version+" "), size/10+1)[:size-overhead]
	b, err := mcuboot.Build(payload, mcuboot.Options{Version: v})
	if err != nil {
		tb.Fatal(err)
	}
	if len(b) != size {
		tb.Fatalf("built %d bytes; want %d", len(b), size)
	}
	return b
}
