package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

	"github.com/coreos/go-oidc/v3/oidc"
)

// TokenVerifier checks an access token from an identity provider and
// returns the user it names. The API tries it for bearer tokens that are not
// its own API tokens.
type TokenVerifier interface {
	Verify(ctx context.Context, rawToken string) (subject string, err error)
}

// OIDCOptions configure an OIDC verifier.
type OIDCOptions struct {
	Issuer   string // required: the iss every token must carry
	Audience string // required: a value the aud claim must contain
	// JWKSURL is where the issuer's signing keys are; when empty they are
	// found through the issuer's /.well-known/openid-configuration.
	JWKSURL string
	// ClockSkew is how far past exp a token is still taken (default 1 min).
	// The library allows 5 minutes before nbf.
	ClockSkew time.Duration
	// Algorithms the signature may use; default RS256 and ES256. "none" is
	// never accepted.
	Algorithms []string
	Now        func() time.Time
}

// OIDCVerifier verifies JWT access tokens of one issuer against its JWKS,
// with github.com/coreos/go-oidc/v3: signature, iss, aud, exp and nbf.
type OIDCVerifier struct {
	v *oidc.IDTokenVerifier
}

// NewOIDCVerifier returns a verifier for the issuer. With no JWKSURL it
// fetches the issuer's discovery document, so ctx bounds that request; the
// keys themselves are fetched (and refreshed on an unknown key id) when
// tokens arrive.
func NewOIDCVerifier(ctx context.Context, o OIDCOptions) (*OIDCVerifier, error) {
	if o.Issuer == "" || o.Audience == "" {
		return nil, errors.New("oidc: an issuer and an audience are required")
	}
	if o.ClockSkew <= 0 {
		o.ClockSkew = time.Minute
	}
	if len(o.Algorithms) == 0 {
		o.Algorithms = []string{oidc.RS256, oidc.ES256}
	}
	for _, a := range o.Algorithms {
		if strings.EqualFold(a, "none") {
			return nil, errors.New(`oidc: the "none" algorithm is never accepted`)
		}
	}
	now := o.Now
	if now == nil {
		now = time.Now
	}
	cfg := &oidc.Config{
		ClientID:             o.Audience,
		SupportedSigningAlgs: o.Algorithms,
		Now:                  func() time.Time { return now().Add(-o.ClockSkew) },
	}
	if o.JWKSURL != "" {
		keys := oidc.NewRemoteKeySet(context.WithoutCancel(ctx), o.JWKSURL)
		return &OIDCVerifier{v: oidc.NewVerifier(o.Issuer, keys, cfg)}, nil
	}
	p, err := oidc.NewProvider(ctx, o.Issuer)
	if err != nil {
		return nil, fmt.Errorf("oidc discovery: %w", err)
	}
	return &OIDCVerifier{v: p.Verifier(cfg)}, nil
}

// Verify implements TokenVerifier.
func (o *OIDCVerifier) Verify(ctx context.Context, raw string) (string, error) {
	tok, err := o.v.Verify(ctx, raw)
	if err != nil {
		return "", err
	}
	if !validSubject(tok.Subject) {
		return "", fmt.Errorf("oidc: unusable sub claim %q", tok.Subject)
	}
	return tok.Subject, nil
}

// validSubject keeps a sub usable as part of a user id: 1–200 printable
// characters, no spaces.
func validSubject(s string) bool {
	if s == "" || len(s) > 200 {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return false
		}
	}
	return true
}

// oidcUserPrefix starts the user id of a user known by an identity
// provider's sub, so it can never collide with our own UUID user ids.
const oidcUserPrefix = "oidc:"

// looksLikeJWT reports whether a bearer token has the three dot-separated
// parts of a compact JWS.
func looksLikeJWT(tok string) bool {
	return strings.Count(tok, ".") == 2 && !strings.HasPrefix(tok, userTokenPrefix)
}
