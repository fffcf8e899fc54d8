package api

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestClaimCodeAsTyped registers devices with their claim codes as a
// person types them from a label: lower case, spaces around, dashes left
// out or replaced by spaces, an autocorrected dash, a 0 or 1 for the O
// or I that base32 has. Each binds; a wrong code, and a code whose case
// was not one case when provisioned typed in another, stay 422 (bug 424).
func TestClaimCodeAsTyped(t *testing.T) {
	e := newEnv(t)
	const base32Code = "5QDU-622O-U2X4-KPZ2-SFN2" // as --demo and docs/provisioning.md make them
	const hexCode = "3f9a0c41d2e87b65a1c0ffee"    // as README's openssl rand -hex 12 makes them
	for i, c := range []struct {
		code, typed string
		status      int
	}{
		{base32Code, base32Code, http.StatusCreated},
		{base32Code, "5qdu-622o-u2x4-kpz2-sfn2", http.StatusCreated},
		{base32Code, "  5QDU-622O-U2X4-KPZ2-SFN2\n", http.StatusCreated},
		{base32Code, "5QDU622OU2X4KPZ2SFN2", http.StatusCreated},
		{base32Code, "5qdu 622o u2x4 kpz2 sfn2", http.StatusCreated},
		{base32Code, "5QDU–622O–U2X4–KPZ2–SFN2", http.StatusCreated}, // en dashes, as a phone's smart punctuation writes
		{base32Code, "5QDU-6220-U2X4-KPZ2-SFN2", http.StatusCreated}, // a zero for the O
		{base32Code, "5QDU-622O-U2X4-KPZ2-SFN3", http.StatusUnprocessableEntity},
		{base32Code, "5QDU-622O-U2X4-KPZ2", http.StatusUnprocessableEntity},
		{hexCode, "3F9A0C41D2E87B65A1C0FFEE", http.StatusCreated},
		{hexCode, " 3f9a0c41d2e87b65a1c0ffee ", http.StatusCreated},
		{"Ab9-xY7-kk", "ab9-xy7-kk", http.StatusUnprocessableEntity}, // mixed case: its case may be the secret
		{"Ab9-xY7-kk", "Ab9-xY7-kk", http.StatusCreated},
	} {
		id := fmt.Sprintf("dev-%d", i)
		e.provision(id, c.code, "sim-1")
		tok := e.user(fmt.Sprintf("user %d", i))
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": c.typed})
		assert.Equal(t, c.status, r.status, "register with %q for %q: %s", c.typed, c.code, r.body)
	}
}

// TestClaimFormsBounded: however a code is typed, at most ten forms are
// tried, so a guess covers at most ten codes.
func TestClaimFormsBounded(t *testing.T) {
	for _, typed := range []string{" 0o1i-8b0o 1i8b–0o1i ", "abcdefghijklmnopqrstuvwxyz0123456789", "Ab9-xY7-kk", "ünï côdé", ""} {
		forms := claimForms(typed)
		assert.LessOrEqual(t, len(forms), 10, "claimForms(%q) = %q", typed, forms)
		assert.Equal(t, typed, forms[0], "claimForms(%q) tries the code as typed first", typed)
	}
}

// TestClaimCodeProvisionedWithSpaces provisions a code with a space
// around it, as a factory line's CSV or a copy from a spreadsheet
// carries it: the label shows none, so the code registers without it,
// and with it. A code of spaces alone is refused (bug 426).
func TestClaimCodeProvisionedWithSpaces(t *testing.T) {
	e := newEnv(t)
	e.provision("dev-1", " 5QDU-622O-U2X4-KPZ2-SFN2\u00a0", "sim-1")
	for i, typed := range []string{"5QDU-622O-U2X4-KPZ2-SFN2", " 5QDU-622O-U2X4-KPZ2-SFN2\u00a0"} {
		tok := e.user(fmt.Sprintf("user %d", i))
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": "dev-1", "claim_code": typed})
		assert.Equal(t, http.StatusCreated, r.status, "register with %q: %s", typed, r.body)
		if r.status == http.StatusCreated {
			assert.Equal(t, http.StatusNoContent, e.do("DELETE", "/api/v1/devices/dev-1", tok, nil).status, "unbind")
		}
	}
	r := e.do("POST", "/api/v1/admin/devices", testAdminToken, map[string]any{"device_id": "dev-2", "claim_code": "   ", "model": "sim-1"})
	assert.Equal(t, http.StatusUnprocessableEntity, r.status, "%s", r.body)
	assert.Equal(t, []string{"claim_code"}, r.problem(t).fields())
}
