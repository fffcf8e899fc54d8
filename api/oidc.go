package api

import (
	"context"
	"encoding/json"
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
	// A token is taken from nbfLeeway before its nbf, whatever the skew.
	ClockSkew time.Duration
	// Algorithms the signature may use; default RS256 and ES256. "none" is
	// never accepted.
	Algorithms []string
	Now        func() time.Time
}

// OIDCVerifier verifies JWT access tokens of one issuer against its JWKS,
// with github.com/coreos/go-oidc/v3: signature, iss, aud, exp and nbf.
type OIDCVerifier struct {
	v    *oidc.IDTokenVerifier
	now  func() time.Time
	skew time.Duration
}

// nbfLeeway is how long before its nbf a token is taken: the library's
// five minutes, which other OpenID Connect libraries allow too.
const nbfLeeway = 5 * time.Minute

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
	// exp and nbf are checked here (Verify): the library judges both at
	// its Now, and a Now moved back by the skew, which took a token that
	// long past exp, refused a token until nbfLeeway less the skew after
	// its nbf: with a skew of 10 minutes, every token that has an nbf for
	// the first 5 minutes (docs/reliability.md, bug 331).
	cfg := &oidc.Config{
		ClientID:             o.Audience,
		SupportedSigningAlgs: o.Algorithms,
		SkipExpiryCheck:      true,
	}
	ov := &OIDCVerifier{now: now, skew: o.ClockSkew}
	if o.JWKSURL != "" {
		keys := oidc.NewRemoteKeySet(context.WithoutCancel(ctx), o.JWKSURL)
		ov.v = oidc.NewVerifier(o.Issuer, keys, cfg)
		return ov, nil
	}
	p, err := oidc.NewProvider(ctx, o.Issuer)
	if err != nil {
		return nil, fmt.Errorf("oidc discovery: %w", err)
	}
	ov.v = p.Verifier(cfg)
	return ov, nil
}

// Verify implements TokenVerifier.
func (o *OIDCVerifier) Verify(ctx context.Context, raw string) (string, error) {
	tok, err := o.v.Verify(ctx, raw)
	if err != nil {
		return "", err
	}
	var claims struct {
		NotBefore *json.Number `json:"nbf"`
	}
	if err := tok.Claims(&claims); err != nil {
		return "", fmt.Errorf("oidc: %w", err)
	}
	now := o.now()
	if tok.Expiry.Before(now.Add(-o.skew)) {
		return "", &oidc.TokenExpiredError{Expiry: tok.Expiry}
	}
	if claims.NotBefore != nil {
		nbf, err := claims.NotBefore.Float64()
		if err != nil {
			return "", fmt.Errorf("oidc: unusable nbf claim %q", *claims.NotBefore)
		}
		if float64(now.Add(nbfLeeway).UnixNano())/1e9 < nbf {
			return "", fmt.Errorf("oidc: current time %v before the nbf (not before) time %s", now, claims.NotBefore)
		}
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
