package topics

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// The integers of a bridge's messages (a status's battery and seq, a
// reply's progress, a settings message's seq and its schema's min, max
// and max_len) are read as JSON Schema reads docs/asyncapi.yaml's
// "integer": any number whose fraction is zero, 87.0 and 8.7e1 as 87.
// Gson and kotlinx.serialization write a Kotlin Double so, Python a
// float; encoding/json refused them into an int, and the whole message
// was dropped as malformed (docs/reliability.md, bug 373). A number with
// a fraction, or one out of the field's range, is refused as before.

// wholeInt is an int field of a message.
type wholeInt int

func (w *wholeInt) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil // as encoding/json leaves an int
	}
	n, err := wholeNumber(b, math.MinInt, math.MaxInt)
	if err != nil {
		return err
	}
	*w = wholeInt(n)
	return nil
}

// wholeUint64 is a uint64 field of a message.
type wholeUint64 uint64

func (w *wholeUint64) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	if u, err := strconv.ParseUint(string(b), 10, 64); err == nil {
		*w = wholeUint64(u)
		return nil
	}
	n, err := wholeNumber(b, 0, math.MaxInt64)
	if err != nil {
		return err
	}
	*w = wholeUint64(n)
	return nil
}

// wholeNumber reads b, a JSON value, as an integer from lo to hi.
func wholeNumber(b []byte, lo, hi int64) (int64, error) {
	s := string(bytes.TrimSpace(b))
	if i, err := strconv.ParseInt(s, 10, 64); err == nil {
		if i < lo || i > hi {
			return 0, fmt.Errorf("json: number %s is out of range", s)
		}
		return i, nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil || n == "" || s[0] == '"' {
		return 0, fmt.Errorf("json: cannot unmarshal %s into an integer", jsonKind(s))
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || f < float64(lo) || f >= -float64(math.MinInt64) || f > float64(hi) {
		return 0, fmt.Errorf("json: number %s is not an integer in range", s)
	}
	return int64(f), nil
}

func jsonKind(s string) string {
	switch {
	case s == "":
		return "nothing"
	case s[0] == '"':
		return "string"
	case s[0] == '{':
		return "object"
	case s[0] == '[':
		return "array"
	case s == "true" || s == "false":
		return "bool"
	}
	return "value " + s
}

func intOf(w *wholeInt) *int {
	if w == nil {
		return nil
	}
	v := int(*w)
	return &v
}

// UnmarshalJSON decodes a status, its integers whole numbers.
func (s *Status) UnmarshalJSON(b []byte) error {
	type plain Status
	var p struct {
		plain
		Battery *wholeInt   `json:"battery"`
		Seq     wholeUint64 `json:"seq"`
		At      bridgeTime  `json:"at"`
	}
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	*s = Status(p.plain)
	s.Battery, s.Seq = intOf(p.Battery), uint64(p.Seq)
	s.At, s.BadAt = p.At.t, p.At.bad
	return nil
}

// UnmarshalJSON decodes a reply, its integers whole numbers.
func (r *Reply) UnmarshalJSON(b []byte) error {
	var w wireReply
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*r = w.reply()
	return nil
}

// wireReply is a reply as a bridge writes it: its integers whole numbers,
// its time as written. ParseReply decodes into it directly: through
// Reply's UnmarshalJSON, encoding/json scans a message three times.
type wireReply struct {
	plainReply
	Progress *wholeInt  `json:"progress"`
	At       bridgeTime `json:"at"`
}

type plainReply Reply

func (w *wireReply) reply() Reply {
	r := Reply(w.plainReply)
	r.Progress = intOf(w.Progress)
	r.At, r.BadAt = w.At.t, w.At.bad
	return r
}

// UnmarshalJSON decodes a setting's description, its integers whole
// numbers and its default exact (DecodeValue).
func (spec *SettingSpec) UnmarshalJSON(b []byte) error {
	type plain SettingSpec
	var p struct {
		plain
		Min    *wholeInt `json:"min"`
		Max    *wholeInt `json:"max"`
		MaxLen wholeInt  `json:"max_len"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&p); err != nil {
		return err
	}
	*spec = SettingSpec(p.plain)
	spec.Min, spec.Max, spec.MaxLen = intOf(p.Min), intOf(p.Max), int(p.MaxLen)
	if spec.Default != nil {
		spec.Default = exactNumbers(spec.Default)
	}
	return nil
}

// ExactWhole reads the JSON number lit exactly, by its digits and not as
// the float64 nearest them: whether it is a whole number ("60", "6e1",
// "60.0", "600e-1", "-0"; not "60.5", nor "59.99999999999999999" or
// "1e-400", which a float64 reads as 60 and 0), whether an int64 holds
// it, and then its value. lit that is no JSON number is neither. The
// server judges a ttl_seconds and a setting so (docs/reliability.md, bug
// 511), and the bridge the settings a command asks for (bug 575).
func ExactWhole(lit []byte) (n int64, whole, fits bool) {
	s := string(lit)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	mant, exp, hasExp := strings.Cut(strings.ToLower(s), "e")
	intPart, frac, _ := strings.Cut(mant, ".")
	if intPart == "" || strings.Trim(intPart+frac, "0123456789") != "" {
		return 0, false, false
	}
	digits := strings.TrimLeft(intPart+frac, "0")
	if digits == "" {
		return 0, true, true // 0, however written
	}
	e := 0
	if hasExp {
		var err error
		if e, err = strconv.Atoi(exp); err != nil {
			// An exponent past an int: a fraction far below 1, or a
			// number far past an int64.
			neg := strings.HasPrefix(exp, "-")
			return 0, !neg, false
		}
	}
	switch { // far past what the digits, at most a body's, make up for
	case e > 1<<30:
		return 0, true, false
	case e < -1<<30:
		return 0, false, false
	}
	// The value is digits × 10^e, less the fraction's digits.
	sig := strings.TrimRight(digits, "0")
	e += len(digits) - len(sig) - len(frac)
	switch {
	case e < 0:
		return 0, false, false
	case len(sig)+e > 19: // past 9223372036854775807's 19 digits
		return 0, true, false
	}
	u, err := strconv.ParseUint(sig+strings.Repeat("0", e), 10, 64)
	switch {
	case err != nil, !neg && u > math.MaxInt64, neg && u > 1<<63:
		return 0, true, false
	case neg:
		return int64(-u), true, true
	}
	return int64(u), true, true
}
