package topics

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// bug 373: a message's integers are whole numbers in any spelling.
func TestWholeNumbers(t *testing.T) {
	for _, tc := range []struct {
		battery string
		want    int
		ok      bool
	}{
		{"87", 87, true}, {"87.0", 87, true}, {"8.7e1", 87, true}, {"870E-1", 87, true},
		{"-0.0", 0, true}, {"87.5", 0, false}, {`"87"`, 0, false}, {"1e400", 0, false},
		{"true", 0, false}, {"[87]", 0, false}, {"1e19", 0, false},
	} {
		s, err := ParseStatus([]byte(`{"online":true,"battery":` + tc.battery + `,"apps":[],"seq":1}`))
		if !tc.ok {
			assert.Error(t, err, tc.battery)
			continue
		}
		require.NoError(t, err, tc.battery)
		require.NotNil(t, s.Battery, tc.battery)
		assert.Equal(t, tc.want, *s.Battery, tc.battery)
	}
	s, err := ParseStatus([]byte(`{"online":true,"battery":null,"seq":18446744073709551615}`))
	require.NoError(t, err)
	assert.Nil(t, s.Battery)
	assert.Equal(t, uint64(math.MaxUint64), s.Seq)
	_, err = ParseStatus([]byte(`{"online":true,"seq":-1}`))
	assert.Error(t, err, "a negative seq")

	st, err := ParseSettings([]byte(`{"reported":{"n":9007199254740993},"schema":{"n":{"type":"int","min":0.0,"max":9.9e1,"max_len":0,"default":9007199254740993}},"seq":2.0}`))
	require.NoError(t, err)
	assert.Equal(t, uint64(2), st.Seq)
	assert.Equal(t, 0, *st.Schema["n"].Min)
	assert.Equal(t, 99, *st.Schema["n"].Max)
	assert.Equal(t, int64(9007199254740993), st.Schema["n"].Default, "the default exact (bug 151)")
	assert.Equal(t, int64(9007199254740993), st.Reported["n"])
}

func TestExactWhole(t *testing.T) {
	for _, tc := range []struct {
		lit         string
		n           int64
		whole, fits bool
	}{
		{"0", 0, true, true},
		{"-0", 0, true, true},
		{"0.000e99999999999999999999", 0, true, true},
		{"60", 60, true, true},
		{"6e1", 60, true, true},
		{"6E+1", 60, true, true},
		{"60.000", 60, true, true},
		{"600e-1", 60, true, true},
		{"-600e-1", -60, true, true},
		{"60.5", 0, false, false},
		{"59.99999999999999999", 0, false, false},
		{"1e-400", 0, false, false},
		{"1e-99999999999999999999", 0, false, false},
		{"1e99999999999999999999", 0, true, false},
		{"9223372036854775807", 9223372036854775807, true, true},
		{"9223372036854775808", 0, true, false},
		{"-9223372036854775808", -9223372036854775808, true, true},
		{"-9223372036854775809", 0, true, false},
		{"9007199254740993.0", 9007199254740993, true, true},
		{"92233720368547758070e-1", 9223372036854775807, true, true},
		{"1e19", 0, true, false},
		{`"60"`, 0, false, false},
		{"true", 0, false, false},
		{"", 0, false, false},
	} {
		n, whole, fits := ExactWhole([]byte(tc.lit))
		if n != tc.n || whole != tc.whole || fits != tc.fits {
			t.Errorf("ExactWhole(%q) = %d, %v, %v; want %d, %v, %v", tc.lit, n, whole, fits, tc.n, tc.whole, tc.fits)
		}
	}
}
