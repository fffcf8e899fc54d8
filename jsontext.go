package companion

import (
	"encoding/json"
	"unicode/utf8"
)

// UnicodeJSON returns v, a JSON text, with its strings made valid
// Unicode as encoding/json decodes them: each byte that is not part of
// UTF-8 becomes U+FFFD, and each \u escape of a surrogate not in a pair
// becomes \ufffd. Everything else stays as written (its numbers' digits,
// its members' order). v itself is returned when there is nothing to
// change, which is what every JSON encoder writes.
//
// A value that reaches clients as the bridge wrote it (a reply's result)
// goes through it: bytes that are not UTF-8 in an answer make the whole
// answer no JSON text (RFC 8259 §8.1), which Swift's JSONDecoder and
// others refuse whole, and PostgreSQL refuses to store
// (docs/reliability.md, bug 370).
func UnicodeJSON(v json.RawMessage) json.RawMessage {
	if validUnicodeJSON(v) {
		return v
	}
	out := make(json.RawMessage, 0, len(v)+8)
	for i := 0; i < len(v); {
		c := v[i]
		switch {
		case c == '\\' && i+1 < len(v) && v[i+1] == 'u':
			n, lone := surrogateEscape(v[i:])
			if lone {
				out = append(out, `\ufffd`...)
			} else {
				out = append(out, v[i:i+n]...)
			}
			i += n
		case c == '\\':
			out = append(out, v[i:min(i+2, len(v))]...)
			i += 2
		case c < utf8.RuneSelf:
			out = append(out, c)
			i++
		default:
			r, size := utf8.DecodeRune(v[i:])
			if r == utf8.RuneError && size == 1 {
				out = append(out, "\uFFFD"...)
			} else {
				out = append(out, v[i:i+size]...)
			}
			i += size
		}
	}
	return out
}

// validUnicodeJSON reports whether v is UTF-8 with no \u escape of a lone
// surrogate.
func validUnicodeJSON(v []byte) bool {
	if !utf8.Valid(v) {
		return false
	}
	for i := 0; i < len(v); i++ {
		if v[i] != '\\' {
			continue
		}
		if i+1 < len(v) && v[i+1] == 'u' {
			n, lone := surrogateEscape(v[i:])
			if lone {
				return false
			}
			i += n - 1
			continue
		}
		i++ // the escaped character
	}
	return true
}

// surrogateEscape reads the \u escape at the start of b: its length (a
// surrogate pair's two escapes are one), and whether it is a surrogate
// not in a pair. An escape cut short is its bytes, not lone.
func surrogateEscape(b []byte) (n int, lone bool) {
	r, ok := hex4(b, 2)
	switch {
	case !ok:
		return min(len(b), 6), false
	case r >= 0xDC00 && r < 0xE000:
		return 6, true
	case r < 0xD800 || r >= 0xDC00:
		return 6, false
	}
	if len(b) >= 12 && b[6] == '\\' && b[7] == 'u' {
		if lo, ok := hex4(b, 8); ok && lo >= 0xDC00 && lo < 0xE000 {
			return 12, false
		}
	}
	return 6, true
}

// hex4 reads the four hex digits at b[at:].
func hex4(b []byte, at int) (rune, bool) {
	if len(b) < at+4 {
		return 0, false
	}
	var r rune
	for _, c := range b[at : at+4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}
