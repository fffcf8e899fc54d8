package api

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
)

// The key of a refused token's line is one of a few kinds, never the
// error's text, which the sender chooses (docs/reliability.md, bug 493).
func TestRefusedKeyIsAKindOfReason(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{&oidc.TokenExpiredError{Expiry: time.Now()}, "expired"},
		{fmt.Errorf("oidc: expected audience %q got %q", "companion-api", "x"), "audience"},
		{fmt.Errorf("oidc: the token was issued by %q, not %q", "a", "b"), "issuer"},
		{errors.New("oidc: current time x before the nbf (not before) time y"), "not yet valid"},
		{errors.New(`oidc: unusable sub claim ""`), "subject"},
		{errors.New("failed to verify signature: oidc: no key of the identity provider verifies the signature"), "signature"},
		{errors.New("oidc: malformed jwt: x"), "signature"},
		{errors.New("something new"), "other"},
	} {
		if got := refusedKey(tc.err); got != tc.want {
			t.Errorf("refusedKey(%v) = %q; want %q", tc.err, got, tc.want)
		}
	}
}
