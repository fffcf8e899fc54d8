package api

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mcuboottest"
	"github.com/devicecompanion/companion/mcuboot"
)

// firmwareImage builds an MCUboot image of version of exactly size bytes.
var firmwareImage = mcuboottest.Image

// A firmware blob must be an MCUboot image whose header holds the version
// it is published as; anything else is a 422 naming what is wrong, and
// leaves nothing stored.
func TestFirmwareMustBeMCUbootImage(t *testing.T) {
	e := newEnv(t)
	put := func(version string, body []byte) resp {
		return e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/" + version, token: testAdminToken, body: body,
			header: map[string]string{"Content-Type": "application/octet-stream"}})
	}
	good := firmwareImage(t, "1.2.0", 4096)
	corrupt := bytes.Clone(good)
	corrupt[1000] ^= 1
	noTLV := bytes.Clone(good)
	binary.LittleEndian.PutUint16(noTLV[len(noTLV)-40:], 0x1234)
	v120 := mcuboot.Version{Major: 1, Minor: 2}
	payload := bytes.Repeat([]byte("firmware 1.2.0 "), 300)
	sha512Image := mcuboot.MustBuild(payload, mcuboot.Options{Version: v120, HeaderSize: 0x200, Hash: mcuboot.TLVSHA512})
	corrupt512 := bytes.Clone(sha512Image)
	corrupt512[1000] ^= 1
	// zephyr.signed.confirmed.bin: imgtool sign --pad --confirm.
	padded := mcuboot.MustBuild(payload, mcuboot.Options{Version: v120, HeaderSize: 0x200, SlotSize: 64 << 10, Confirm: true})
	for _, tt := range []struct {
		name, version string
		body          []byte
		field         string
	}{
		{"raw bytes", "1.2.0", bytes.Repeat([]byte("firmware"), 512), "image.magic"},
		{"short", "1.2.0", good[:16], "image.header"},
		{"truncated", "1.2.0", good[:2000], "image.image_size"},
		{"corrupt", "1.2.0", corrupt, "image.sha256"},
		{"no TLV area", "1.2.0", noTLV, "image.tlv_info"},
		{"bytes after the TLVs", "1.2.0", append(bytes.Clone(good), []byte("junk")...), "image.padding"},
		{"bytes after erased flash", "1.2.0", append(append(bytes.Clone(good), bytes.Repeat([]byte{0xff}, 1000)...), 0), "image.padding"},
		{"bytes after the trailer", "1.2.0", append(bytes.Clone(padded), 0xff), "image.padding"},
		{"corrupt SHA-512 image", "1.2.0", corrupt512, "image.sha512"},
		{"other version", "1.3.0", good, "image.version"},
		{"build number differs", "1.2.0+1", good, "image.version"},
		{"pre-release", "1.3.0-rc1", good, "version"},
		{"past the header's fields", "256.0.0", good, "version"},
		{"build 0 written out", "1.2.0+0", good, "version"},
		{"build with a leading zero", "1.2.0+07", firmwareImage(t, "1.2.0+7", 2048), "version"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := put(tt.version, tt.body)
			require.Equal(t, 422, r.status, "%s", r.body)
			p := r.problem(t)
			assert.Equal(t, CodeValidationFailed, p.Code)
			assert.Equal(t, []string{tt.field}, p.fields())
			assert.NotEmpty(t, p.Detail)
			if tt.field == "image.padding" {
				assert.Contains(t, p.Detail, "only erased flash (0xff) may follow them", "the detail says what may follow the TLVs")
			}
		})
	}
	assert.Empty(t, blobFiles(t, e.db), "a refused image left a blob behind")
	_, err := e.db.Firmware(t.Context(), "sim-1", "1.2.0")
	assert.Error(t, err)

	r := put("1.2.0", good)
	require.Equal(t, 201, r.status, "%s", r.body)
	r = put("1.2.0+7", firmwareImage(t, "1.2.0+7", 2048))
	require.Equal(t, 201, r.status, "the build number is part of the version: %s", r.body)

	// An image carries the hash its MCUboot checks, and may be padded to
	// its slot: each is published as it came.
	for version, body := range map[string][]byte{
		"1.3.0": mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3}, HeaderSize: 0x200, Hash: mcuboot.TLVSHA512}),
		"1.3.1": mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 1}, Hash: mcuboot.TLVSHA384}),
		"1.3.2": mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 2}, HeaderSize: 0x200, SlotSize: 64 << 10, Confirm: true}),
		"1.3.3": mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 3}, SlotSize: 8 << 10, Hash: mcuboot.TLVSHA512, MaxAlign: 32}),
		"1.3.4": append(mcuboot.MustBuild(payload, mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 3, Revision: 4}}), bytes.Repeat([]byte{0xff}, 3000)...),
	} {
		r = put(version, body)
		require.Equal(t, 201, r.status, "%s: %s", version, r.body)
		assert.EqualValues(t, len(body), r.json(t)["size"], "%s: the size published is the file's", version)
	}
}
