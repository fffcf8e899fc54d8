package api

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// idp is an identity provider the test runs: a JWKS endpoint and a signer.
type idp struct {
	key    *rsa.PrivateKey
	server *httptest.Server
}

func newIDP(t *testing.T) *idp {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	p := &idp{key: key}
	jwks := jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: "k1", Algorithm: "RS256", Use: "sig"}}}
	p.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(jwks)
	}))
	t.Cleanup(p.server.Close)
	return p
}

func sign(t *testing.T, key *rsa.PrivateKey, kid string, claims map[string]any) string {
	t.Helper()
	s, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key}, (&jose.SignerOptions{}).WithHeader("kid", kid).WithType("JWT"))
	require.NoError(t, err)
	payload, err := json.Marshal(claims)
	require.NoError(t, err)
	jws, err := s.Sign(payload)
	require.NoError(t, err)
	out, err := jws.CompactSerialize()
	require.NoError(t, err)
	return out
}

// unsigned builds a token with "alg": "none".
func unsigned(claims map[string]any) string {
	h := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`))
	p, _ := json.Marshal(claims)
	return h + "." + base64.RawURLEncoding.EncodeToString(p) + "."
}

func TestOIDCAccessTokens(t *testing.T) {
	p := newIDP(t)
	const issuer, audience = "https://idp.example", "companion-api"
	v, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: issuer, Audience: audience, JWKSURL: p.server.URL})
	require.NoError(t, err)
	e := newEnv(t, func(o *Options) { o.Tokens = v })
	e.provision("dev-1", "code-1", "sim-1")

	now := time.Now()
	claims := func(mod func(map[string]any)) map[string]any {
		c := map[string]any{"iss": issuer, "aud": audience, "sub": "alice@idp", "exp": now.Add(time.Hour).Unix(), "iat": now.Unix()}
		if mod != nil {
			mod(c)
		}
		return c
	}
	good := sign(t, p.key, "k1", claims(nil))
	r := e.do("GET", "/api/v1/devices", good, nil)
	require.Equal(t, http.StatusOK, r.status, "%s", r.body)
	r = e.do("POST", "/api/v1/devices/register", good, map[string]any{"device_id": "dev-1", "claim_code": "code-1"})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	r = e.do("GET", "/api/v1/devices/dev-1/status", good, nil)
	assert.Equal(t, http.StatusOK, r.status, "the device is the token's user's")

	other, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	issuedBefore := func(c map[string]any) { c["iat"] = now.Add(-time.Hour).Unix() }
	bad := map[string]string{
		"expired":        sign(t, p.key, "k1", claims(func(c map[string]any) { c["exp"] = now.Add(-2 * time.Minute).Unix() })),
		"wrong issuer":   sign(t, p.key, "k1", claims(func(c map[string]any) { c["iss"] = "https://evil.example" })),
		"wrong audience": sign(t, p.key, "k1", claims(func(c map[string]any) { c["aud"] = "another-api" })),
		// A token no key at hand verifies, issued before the keys were
		// fetched: a fresh one waits, a 503, for the next fetch a few
		// seconds on, which may bring its key (bug 478).
		"wrong key":       sign(t, other, "k1", claims(issuedBefore)),
		"unknown key id":  sign(t, other, "k2", claims(issuedBefore)),
		"alg none":        unsigned(claims(nil)),
		"not yet valid":   sign(t, p.key, "k1", claims(func(c map[string]any) { c["nbf"] = now.Add(time.Hour).Unix() })),
		"no subject":      sign(t, p.key, "k1", claims(func(c map[string]any) { delete(c, "sub") })),
		"garbage":         "a.b.c",
		"tampered claims": tamper(sign(t, p.key, "k1", claims(issuedBefore))),
	}
	for name, tok := range bad {
		r := e.do("GET", "/api/v1/devices", tok, nil)
		assert.Equal(t, http.StatusUnauthorized, r.status, "%s: %s", name, r.body)
		assert.Contains(t, r.header.Get("WWW-Authenticate"), "Bearer", name)
	}
	// Within the clock skew an expired token is still taken.
	late := sign(t, p.key, "k1", claims(func(c map[string]any) { c["exp"] = now.Add(-20 * time.Second).Unix() }))
	assert.Equal(t, http.StatusOK, e.do("GET", "/api/v1/devices", late, nil).status)

	// Another subject sees nothing of alice's.
	bob := sign(t, p.key, "k1", claims(func(c map[string]any) { c["sub"] = "bob@idp" }))
	assert.Equal(t, http.StatusNotFound, e.do("GET", "/api/v1/devices/dev-1/status", bob, nil).status)
}

// tamper changes the payload of a signed token without re-signing it.
func tamper(tok string) string {
	parts := strings.Split(tok, ".")
	p, _ := base64.RawURLEncoding.DecodeString(parts[1])
	p = []byte(strings.Replace(string(p), "alice@idp", "mallory", 1))
	parts[1] = base64.RawURLEncoding.EncodeToString(p)
	return strings.Join(parts, ".")
}

func TestOIDCOptions(t *testing.T) {
	_, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: "x"})
	assert.Error(t, err, "no audience")
	_, err = NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: "x", Audience: "y", JWKSURL: "http://127.0.0.1:1", Algorithms: []string{"none"}})
	assert.Error(t, err, `"none" is refused`)
}

// A clock skew of ten minutes takes a token up to ten minutes past its exp,
// and still a token whose nbf is a moment or a few minutes ahead of the
// server's clock, as the library's five minutes before nbf allow. The skew
// moved the clock the library judges by back for exp, and so for nbf:
// with a skew of five minutes or more, a token fresh from an identity
// provider whose clock ran a moment ahead was refused, and with ten every
// token that has an nbf, for five minutes after it was issued (bug 331).
func TestOIDCClockSkewTakesFreshTokens(t *testing.T) {
	p := newIDP(t)
	const issuer, audience = "https://idp.example", "companion-api"
	now := time.Now()
	v, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: issuer, Audience: audience, JWKSURL: p.server.URL,
		ClockSkew: 10 * time.Minute, Now: func() time.Time { return now }})
	require.NoError(t, err)
	token := func(exp, nbf time.Duration) string {
		c := map[string]any{"iss": issuer, "aud": audience, "sub": "alice@idp", "exp": now.Add(exp).Unix(), "iat": now.Add(nbf).Unix(), "nbf": now.Add(nbf).Unix()}
		return sign(t, p.key, "k1", c)
	}
	for _, tc := range []struct {
		name     string
		exp, nbf time.Duration
		ok       bool
	}{
		{"fresh", time.Hour, 0, true},
		{"issued a second ahead", time.Hour, time.Second, true},
		{"issued four minutes ahead", time.Hour, 4 * time.Minute, true},
		{"issued an hour ahead", 2 * time.Hour, time.Hour, false},
		{"issued centuries ahead", 2 * time.Hour, 1 << 62, false},
		{"expired nine minutes ago", -9 * time.Minute, -time.Hour, true},
		{"expired eleven minutes ago", -11 * time.Minute, -time.Hour, false},
	} {
		_, err := v.Verify(t.Context(), token(tc.exp, tc.nbf))
		assert.Equal(t, tc.ok, err == nil, "%s: Verify = %v", tc.name, err)
	}
}

// A JWKS may hold keys this server cannot verify with: another key type or
// curve (Ed448, secp256k1), an encryption key, a symmetric one. They are
// left out, not the set: the provider's signing key still verifies. A key
// that names its algorithm verifies only that one.
func TestOIDCKeySetSkipsKeysItCannotUse(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	sigKey, err := json.Marshal(jose.JSONWebKey{Key: &key.PublicKey, KeyID: "k1", Use: "sig"})
	require.NoError(t, err)
	pinned, err := json.Marshal(jose.JSONWebKey{Key: &key.PublicKey, KeyID: "k384", Algorithm: "RS384", Use: "sig"})
	require.NoError(t, err)
	jwks := `{"keys": [
		{"kty": "OKP", "crv": "Ed448", "kid": "ed448", "x": "X9dEm1m0Yf0s54fsYWrUah2hNCSFpw4fig6nXYDpZ3jt8SR2m0bHBhvWeD3x5Q9s0foavq_oJWGA"},
		{"kty": "EC", "crv": "secp256k1", "kid": "k256", "alg": "ES256K", "x": "AAAA", "y": "AAAA"},
		{"kty": "RSA", "kid": "enc", "use": "enc", "alg": "RSA-OAEP", "n": "AQAB", "e": "AQAB"},
		{"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
		` + string(sigKey) + `, ` + string(pinned) + `]}`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(jwks))
	}))
	defer srv.Close()
	const issuer, audience = "https://idp.example", "companion-api"
	v, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: issuer, Audience: audience, JWKSURL: srv.URL})
	require.NoError(t, err)
	e := newEnv(t, func(o *Options) { o.Tokens = v })
	now := time.Now()
	claims := map[string]any{"iss": issuer, "aud": audience, "sub": "alice@idp", "exp": now.Add(time.Hour).Unix(), "iat": now.Add(-time.Hour).Unix()}
	r := e.do("GET", "/api/v1/devices", sign(t, key, "k1", claims), nil)
	assert.Equal(t, http.StatusOK, r.status, "a token of the JWKS's usable key: %s", r.body)
	r = e.do("GET", "/api/v1/devices", sign(t, key, "k384", claims), nil)
	assert.Equal(t, http.StatusUnauthorized, r.status, "an RS256 token of a key for RS384 only: %s", r.body)
}

// A discovery that no retry mends (a web page, a 404, another issuer's
// document, none naming a JWKS) is an OIDCMisconfiguredError with a hint;
// a provider down, limiting or slow is not (docs/reliability.md, bug 491).
func TestOIDCDiscoveryMisconfiguration(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		issuer, _ := strings.CutSuffix(r.URL.Path, "/.well-known/openid-configuration")
		switch issuer {
		case "/html":
			w.Header().Set("Content-Type", "text/html")
			_, _ = w.Write([]byte("<html><body>Welcome</body></html>"))
		case "/other":
			w.Header().Set("Content-Type", "application/json")
			_, _ = fmt.Fprintf(w, `{"issuer":"https://elsewhere.example.com","jwks_uri":"https://elsewhere.example.com/keys"}`)
		case "/nokeys":
			w.Header().Set("Content-Type", "application/json")
			_, _ = fmt.Fprintf(w, `{"issuer":"http://%s/nokeys"}`, r.Host)
		case "/busy":
			w.WriteHeader(http.StatusTooManyRequests)
		case "/down":
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	for path, want := range map[string]string{"/html": "answers no JSON document", "/other": `names the issuer "https://elsewhere.example.com"`,
		"/nokeys": "--oidc-jwks-url", "/missing": "answers 404 Not Found", "/busy": "", "/down": ""} {
		_, err := NewOIDCVerifier(context.Background(), OIDCOptions{Issuer: srv.URL + path, Audience: "a"})
		var mc *OIDCMisconfiguredError
		switch {
		case err == nil:
			t.Errorf("%s: no error", path)
		case want == "" && errors.As(err, &mc):
			t.Errorf("%s: %v is a misconfiguration (%s); want one a retry may mend", path, err, mc.Hint)
		case want != "" && (!errors.As(err, &mc) || !strings.Contains(mc.Hint, want)):
			t.Errorf("%s: %v (%T); want a misconfiguration whose hint says %q", path, err, err, want)
		}
	}
}
