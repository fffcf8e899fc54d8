package topics

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Settings values travel as JSON numbers, which encoding/json decodes into
// an any as a float64: an 8-byte int setting past 2^53 (a counter, an id)
// lost its last digits on the way from the device to GET …/settings and
// from PUT …/settings to the device (docs/reliability.md, bug 151). The
// values of settings, reported, defaulted and asked for, are decoded here
// instead: a number is a float64 as before, unless it is written as an
// integer past ±2^53 that an int64 holds, which is then that int64. So
// every value of an int setting a device holds comes through exactly, in
// its digits, and every other value as encoding/json gives it.

// maxExact is 2^53: a float64 holds every integer up to it.
const maxExact = 1 << 53

// DecodeValue decodes one JSON value as settings values are (see above):
// in maps and arrays too.
func DecodeValue(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("topics: data after a JSON value")
	}
	return exactNumbers(v), nil
}

// exactNumbers replaces each json.Number in v (decoded with UseNumber) by
// the float64 encoding/json would give, or the int64 it is when a float64
// cannot hold it.
func exactNumbers(v any) any {
	switch x := v.(type) {
	case json.Number:
		return number(x)
	case map[string]any:
		for k, e := range x {
			x[k] = exactNumbers(e)
		}
	case []any:
		for i, e := range x {
			x[i] = exactNumbers(e)
		}
	}
	return v
}

func number(n json.Number) any {
	if !strings.ContainsAny(string(n), ".eE") {
		// Past ±2^53 a float64 holds some integers only, and encodes
		// even those it holds in other digits (-2^63 as
		// -9223372036854776000): the store compares a desired value
		// with the reported one as text.
		if i, err := strconv.ParseInt(string(n), 10, 64); err == nil && (i > maxExact || i < -maxExact) {
			return i
		}
	}
	// As encoding/json, but a number out of float64's range, which
	// encoding/json refuses, is the infinity ParseFloat gives: encoding it
	// back fails, and the settings with it, as before. (The API refuses
	// such a number before it decodes settings values.)
	f, _ := strconv.ParseFloat(string(n), 64)
	return f
}

// UnmarshalJSON decodes a settings message with its values and defaults
// exact (DecodeValue).
func (s *Settings) UnmarshalJSON(b []byte) error {
	type plain Settings
	var w struct {
		plain
		Seq wholeUint64 `json:"seq"` // bug 373
		At  bridgeTime  `json:"at"`  // bug 425
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&w); err != nil {
		return err
	}
	p := w.plain
	p.Seq = uint64(w.Seq)
	p.At, p.BadAt = w.At.t, w.At.bad
	for k, v := range p.Reported {
		p.Reported[k] = exactNumbers(v)
	}
	for k, spec := range p.Schema {
		if spec.Default != nil {
			spec.Default = exactNumbers(spec.Default)
			p.Schema[k] = spec
		}
	}
	*s = Settings(p)
	return nil
}

// UnmarshalJSON decodes a settings command's payload with its values exact
// (DecodeValue), and each number judged by its digits (askedNumber).
func (u *SettingsUpdate) UnmarshalJSON(b []byte) error {
	type plain SettingsUpdate
	var p plain
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&p); err != nil {
		return err
	}
	for k, v := range p.Settings {
		if n, ok := v.(json.Number); ok {
			p.Settings[k] = askedNumber(n)
			continue
		}
		p.Settings[k] = exactNumbers(v)
	}
	*u = SettingsUpdate(p)
	return nil
}

// askedNumber is a number a settings command asks for, as its digits say
// (ExactWhole), not as the float64 nearest them: the bridge checks it
// against the device's schema and writes it. A whole number is the int64
// it is past ±2^53 (9007199254740993.0 too), and otherwise the float64
// that holds it exactly; a number with a fraction stays a json.Number in
// its digits, which no int setting takes ("must be an integer"). The
// server sends a device whose schema it does not know yet such a number
// as written, for the bridge to judge (docs/reliability.md, bug 511), and
// the bridge read it as the float64 nearest it: 100.00000000000000000000001
// as 100, within a max of 100, and 1e-400 as 0, each written to the device
// (bug 575).
func askedNumber(n json.Number) any {
	i, whole, fits := ExactWhole([]byte(n))
	switch {
	case !whole:
		return n
	case fits && (i > maxExact || i < -maxExact):
		return i
	}
	return number(n)
}
