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
