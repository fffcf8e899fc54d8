package topics

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"time"
)

// A bridge's messages carry `at` as RFC 3339 (docs/asyncapi.yaml), and
// the server reads it only as a status's last_seen and to order two
// reports of one seq; a reply's is not read at all. A bridge written in
// another language may write a naive time (Python's datetime.isoformat,
// no time zone) or a number of seconds since 1970 (time.time()): either
// made the whole message malformed, and it was dropped, a final reply and
// with it the end of its command (docs/reliability.md, bug 425). A number
// is its seconds since 1970 (a fraction is taken); anything else that is
// no time is taken as no `at`, as a message without one is, and kept in
// BadAt for the server to log: a time without a zone names no instant
// (it may be UTC or the bridge's local time), so it is not guessed.

// maxBadAt bounds the text kept of an unreadable `at`.
const maxBadAt = 64

// bridgeTime is the `at` of a bridge's message.
type bridgeTime struct {
	t   time.Time
	bad string // the value as written when it is no time
}

func (b *bridgeTime) UnmarshalJSON(v []byte) error {
	s := bytes.TrimSpace(v)
	switch {
	case string(s) == "null":
		return nil
	case len(s) > 0 && s[0] == '"':
		var str string
		if err := json.Unmarshal(s, &str); err != nil {
			return err
		}
		if t, err := time.Parse(time.RFC3339Nano, str); err == nil {
			b.t = t
			return nil
		}
	case len(s) > 0 && (s[0] == '-' || '0' <= s[0] && s[0] <= '9'):
		if t, ok := unixSeconds(string(s)); ok {
			b.t = t
			return nil
		}
	}
	b.bad = string(s)
	if len(b.bad) > maxBadAt {
		b.bad = b.bad[:maxBadAt] + "…"
	}
	return nil
}

// maxUnix is 10000-01-01T00:00:00Z, the first instant RFC 3339 cannot
// write: a number at or past it (milliseconds since 1970, say) is no
// time of seconds.
const maxUnix = 253402300800

// unixSeconds reads s, a JSON number, as seconds since 1970, to the
// nanosecond.
func unixSeconds(s string) (time.Time, bool) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || f >= maxUnix || math.IsNaN(f) {
		return time.Time{}, false
	}
	sec, frac, _ := bytes.Cut([]byte(s), []byte("."))
	if n, err := strconv.ParseInt(string(sec), 10, 64); err == nil && !bytes.ContainsAny(frac, "eE") {
		// Digits as written: a float64 of today's seconds keeps only
		// microseconds.
		ns := 0
		for i, scale := 0, int(1e8); i < len(frac) && scale > 0; i, scale = i+1, scale/10 {
			ns += int(frac[i]-'0') * scale
		}
		return time.Unix(n, int64(ns)).UTC(), true
	}
	sf, ff := math.Modf(f)
	return time.Unix(int64(sf), int64(ff*1e9)).UTC(), true
}
