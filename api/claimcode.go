package api

import (
	"slices"
	"strings"
	"unicode"

	"github.com/devicecompanion/companion"
)

// claimMatches reports whether typed, a claim code as a person typed it
// from a device's label, is the code whose hash is hash. Besides the code
// as typed it tries the forms the person meant (claimForms): a label's
// code is in one case and grouped by dashes, and people type it in lower
// case, with spaces around, with the dashes left out or as spaces, with a
// phone's autocorrected dash, or with a 0 or 1 for base32's O or I
// (docs/reliability.md, bug 424). Every form is compared, whichever
// matches, so the time taken depends on what was typed only.
func claimMatches(typed string, hash []byte) bool {
	ok := false
	for _, f := range claimForms(typed) {
		ok = companion.SecretMatches(f, hash) || ok
	}
	return ok
}

// provisionedClaim is the code whose hash is kept for a device
// provisioned with code: without the spaces around it, which a factory
// line's CSV or a spreadsheet's cell carries and its label does not
// show. Registering trims what is typed (claimForms), so the code with
// its spaces registers too (docs/reliability.md, bug 426).
func provisionedClaim(code string) string { return strings.TrimSpace(code) }

// claimForms returns typed and the forms of it a provisioned code may
// have: its case folded either way (a code in one case: base32 upper,
// hex lower), regrouped in fours by dashes (docs/provisioning.md's
// form), and with 0, 1 and 8 read as the O, I and B of base32, whose
// alphabet (A–Z 2–7) has no 0, 1 or 8. A code provisioned in mixed case
// (base64, say) matches only as typed: its case may be what makes it
// secret. At most ten forms: a guess covers ten codes, not one, which
// takes about three bits off a code's eighty or more.
func claimForms(typed string) []string {
	forms := []string{typed}
	add := func(s string) {
		if s != "" && !slices.Contains(forms, s) {
			forms = append(forms, s)
		}
	}
	t := strings.TrimSpace(typed)
	t = strings.Map(func(r rune) rune {
		if unicode.Is(unicode.Pd, r) || r == '−' { // hyphens, en and em dashes, minus
			return '-'
		}
		return r
	}, t)
	add(t)
	add(strings.ToUpper(t))
	add(strings.ToLower(t))
	compact := strings.Map(func(r rune) rune {
		if r == '-' || unicode.IsSpace(r) {
			return -1
		}
		return r
	}, t)
	for _, r := range compact {
		if r > unicode.MaxASCII || !unicode.IsLetter(r) && !unicode.IsDigit(r) {
			return forms
		}
	}
	upper, lower := strings.ToUpper(compact), strings.ToLower(compact)
	add(upper)
	add(lower)
	add(inFours(upper))
	add(inFours(lower))
	if base32 := strings.NewReplacer("0", "O", "1", "I", "8", "B").Replace(upper); base32 != upper && isBase32(base32) {
		add(base32)
		add(inFours(base32))
	}
	return forms
}

// inFours is s in groups of four joined by dashes.
func inFours(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i += 4 {
		if i > 0 {
			b.WriteByte('-')
		}
		b.WriteString(s[i:min(i+4, len(s))])
	}
	return b.String()
}

// isBase32 reports whether s is of RFC 4648's base32 alphabet.
func isBase32(s string) bool {
	return strings.IndexFunc(s, func(r rune) bool { return !('A' <= r && r <= 'Z' || '2' <= r && r <= '7') }) < 0
}
