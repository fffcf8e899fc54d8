package topics

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBridgeAt reads the `at`s bridges write: RFC 3339, seconds since
// 1970, and what is no time, taken as none and kept as written (bug 425).
func TestBridgeAt(t *testing.T) {
	id := "01890a5d-ac96-774b-bcce-b302099a8057"
	for _, c := range []struct {
		at   string
		want time.Time
		bad  string
	}{
		{`"2026-11-23T15:04:05Z"`, time.Date(2026, 11, 23, 15, 4, 5, 0, time.UTC), ""},
		{`"2026-11-23T16:04:05.123456789+01:00"`, time.Date(2026, 11, 23, 15, 4, 5, 123456789, time.UTC), ""},
		{`1795446245`, time.Date(2026, 11, 23, 15, 4, 5, 0, time.UTC), ""},
		{`1795446245.123456`, time.Date(2026, 11, 23, 15, 4, 5, 123456000, time.UTC), ""},
		{`1.795446245e9`, time.Date(2026, 11, 23, 15, 4, 5, 0, time.UTC), ""},
		{`null`, time.Time{}, ""},
		{`"2026-11-23T15:04:05"`, time.Time{}, `"2026-11-23T15:04:05"`},
		{`"2026-11-23 15:04:05"`, time.Time{}, `"2026-11-23 15:04:05"`},
		{`1795446245123`, time.Time{}, `1795446245123`}, // milliseconds: year 58865 in seconds
		{`-1`, time.Time{}, `-1`},
		{`true`, time.Time{}, `true`},
		{`{"s":1}`, time.Time{}, `{"s":1}`},
	} {
		r, err := ParseReply([]byte(`{"command_id":"` + id + `","state":"delivered","at":` + c.at + `}`))
		require.NoError(t, err, "ParseReply with at %s", c.at)
		assert.True(t, c.want.Equal(r.At), "ParseReply with at %s: At = %v; want %v", c.at, r.At, c.want)
		assert.Equal(t, c.bad, r.BadAt, "ParseReply with at %s: BadAt", c.at)
		s, err := ParseStatus([]byte(`{"online":true,"apps":[],"seq":1,"at":` + c.at + `}`))
		require.NoError(t, err, "ParseStatus with at %s", c.at)
		assert.True(t, c.want.Equal(s.At), "ParseStatus with at %s: At = %v; want %v", c.at, s.At, c.want)
		assert.Equal(t, c.bad, s.BadAt, "ParseStatus with at %s: BadAt", c.at)
		st, err := ParseSettings([]byte(`{"reported":{},"schema":{},"seq":1,"at":` + c.at + `}`))
		require.NoError(t, err, "ParseSettings with at %s", c.at)
		assert.True(t, c.want.Equal(st.At), "ParseSettings with at %s: At = %v; want %v", c.at, st.At, c.want)
		assert.Equal(t, c.bad, st.BadAt, "ParseSettings with at %s: BadAt", c.at)
	}
}
