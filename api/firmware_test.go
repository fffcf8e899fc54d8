package api

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/mcuboottest"
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
		{"trailing bytes", "1.2.0", append(bytes.Clone(good), 0xff), "image.size"},
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
		})
	}
	assert.Empty(t, blobFiles(t, e.db), "a refused image left a blob behind")
	_, err := e.db.Firmware(t.Context(), "sim-1", "1.2.0")
	assert.Error(t, err)

	r := put("1.2.0", good)
	require.Equal(t, 201, r.status, "%s", r.body)
	r = put("1.2.0+7", firmwareImage(t, "1.2.0+7", 2048))
	require.Equal(t, 201, r.status, "the build number is part of the version: %s", r.body)
}
