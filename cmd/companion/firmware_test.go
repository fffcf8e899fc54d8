package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/mcuboot"
)

// firmwareImage builds an MCUboot image (imgtool's format) of version of
// exactly size bytes, as a firmware engineer's build would publish it.
func firmwareImage(tb testing.TB, version string, size int) []byte {
	tb.Helper()
	v, err := mcuboot.ParseVersion(version)
	require.NoError(tb, err)
	const overhead = mcuboot.HeaderSize + 4 + 4 + 32 // header, TLV info, SHA-256 TLV
	require.GreaterOrEqual(tb, size, overhead)
	payload := bytes.Repeat([]byte("firmware "+version+" "), size/10+1)[:size-overhead]
	b, err := mcuboot.Build(payload, mcuboot.Options{Version: v})
	require.NoError(tb, err)
	require.Len(tb, b, size)
	return b
}
