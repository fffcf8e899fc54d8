package topics

import (
	"strings"
	"unicode"
)

// TextControls are the control characters a pushed text may hold: its
// lines and tabs. A title is one line and holds none. A device's firmware
// holds each as a C string (a NUL would end it there) and draws it, with
// no glyph for the rest (docs/gatt.md).
const TextControls = "\t\n\r"

// ControlChar finds the first control character of s (C0, DEL or C1:
// NUL, ESC, a line break…) that allowed does not hold: it and its byte
// offset, or -1 when s has none. The server checks a push's text and title
// with it before it takes the push, and the bridge before it writes one to
// a device.
func ControlChar(s, allowed string) (rune, int) {
	for i, r := range s {
		if unicode.IsControl(r) && !strings.ContainsRune(allowed, r) {
			return r, i
		}
	}
	return 0, -1
}

// Blank reports whether s draws nothing: white space alone (U+0020,
// U+00A0, U+3000…) or format characters (a zero-width space, a BOM, a
// direction mark); "" too. Such a device or user name passed as not empty,
// and its device was listed with no name to tell it by (docs/reliability.md,
// bug 558); such a setting name is none (ValidSettingName).
func Blank(s string) bool {
	for _, r := range s {
		if !unicode.IsSpace(r) && !unicode.Is(unicode.Cf, r) {
			return false
		}
	}
	return true
}
