package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
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
	// Algorithms the signature may use; default every asymmetric one
	// (RS, PS and ES of 256, 384 and 512 bits, EdDSA). "none" is never
	// accepted.
	Algorithms []string
	Now        func() time.Time
	// KeysTimeout bounds each fetch of the provider's keys (default 10 s).
	KeysTimeout time.Duration
	// Logger says when the provider's keys cannot be fetched, and when they
	// can again; none when nil.
	Logger *slog.Logger
}

// OIDCVerifier verifies JWT access tokens of one issuer against its JWKS,
// with github.com/coreos/go-oidc/v3: signature, iss, aud, exp and nbf.
type OIDCVerifier struct {
	// v is nil until the issuer's discovery worked (RetryingOIDCVerifier);
	// an atomic load, no lock, on every request with an access token.
	v      atomic.Pointer[oidc.IDTokenVerifier]
	now    func() time.Time
	skew   time.Duration
	cfg    *oidc.Config
	issuer string
	log    *slog.Logger
	// keysTimeout bounds each fetch of the keys: go-oidc's had no timeout,
	// and one never answered held every token of a new key, and every
	// fetch after it, until the server restarted (docs/reliability.md,
	// bug 477).
	keysTimeout time.Duration
	ks          atomic.Pointer[keySet] // the last made, for KeysUnavailable
	// nextDiscovery is when the discovery is tried again (UnixNano), while
	// v is nil: the Retry-After of a token meanwhile.
	nextDiscovery atomic.Int64
	// misconfigured is the last failed discovery's error when no retry
	// mends it (bug 491); nil otherwise.
	misconfigured atomic.Pointer[OIDCMisconfiguredError]
}

// ErrOIDCNotDiscovered is why every access token is not judged (a
// KeysUnavailableError, a 503) while the issuer's discovery has not worked
// yet (RetryingOIDCVerifier).
var ErrOIDCNotDiscovered = errors.New("oidc: the issuer's discovery has not worked yet (it could not be reached at the start); access tokens are not judged until it does")

// nbfLeeway is how long before its nbf a token is taken: the library's
// five minutes, which other OpenID Connect libraries allow too.
const nbfLeeway = 5 * time.Minute

// NewOIDCVerifier returns a verifier for the issuer. With no JWKSURL it
// fetches the issuer's discovery document, so ctx bounds that request; the
// keys themselves are fetched (and refreshed on an unknown key id) when
// tokens arrive.
func NewOIDCVerifier(ctx context.Context, o OIDCOptions) (*OIDCVerifier, error) {
	ov, err := newOIDCVerifier(ctx, o)
	if err != nil || ov.v.Load() != nil {
		return ov, err
	}
	if err := ov.discover(ctx); err != nil {
		return nil, err
	}
	return ov, nil
}

// RetryingOIDCVerifier is NewOIDCVerifier for a server's start: an issuer
// whose discovery fails (not reachable yet at boot, or down) is no error.
// The verifier judges no access token (ErrOIDCNotDiscovered, a 503) and
// tries the discovery again, each attempt within attempt, from a second
// apart to a minute apart, until it works or ctx ends; the failure and
// the success are logged. done is closed once that goroutine has ended.
// Before, the server's start ended "oidc discovery: …", exit status 1,
// and systemd restarted the whole server every 2 s for as long as the
// provider was away (docs/reliability.md, bug 440).
func RetryingOIDCVerifier(ctx context.Context, o OIDCOptions, attempt time.Duration, log *slog.Logger) (v *OIDCVerifier, done <-chan struct{}, err error) {
	if o.Logger == nil {
		o.Logger = log
	}
	ov, err := newOIDCVerifier(ctx, o)
	if err != nil {
		return nil, nil, err
	}
	end := make(chan struct{})
	if ov.v.Load() != nil {
		close(end)
		return ov, end, nil
	}
	actx, cancel := context.WithTimeout(ctx, attempt)
	err = ov.discover(actx)
	cancel()
	if err == nil || ctx.Err() != nil {
		close(end)
		if err != nil {
			return nil, nil, err
		}
		return ov, end, nil
	}
	ov.noteDiscovery(err)
	log.Error("oidc discovery failed: access tokens are answered 503 until it works; trying again", discoveryAttrs(o.Issuer, err)...)
	go func() {
		defer close(end)
		wait := time.Second
		for {
			ov.nextDiscovery.Store(ov.now().Add(wait).UnixNano())
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			actx, cancel := context.WithTimeout(ctx, attempt)
			err := ov.discover(actx)
			cancel()
			if err == nil {
				log.Info("oidc discovery works: access tokens are taken", "issuer", o.Issuer)
				return
			}
			// A misconfiguration is said again each attempt (a minute
			// apart at most): one line at the start, perhaps days before,
			// was all an operator had of it (bug 491).
			if ov.noteDiscovery(err) {
				log.Error("oidc discovery failed: access tokens are answered 503 until it works; trying again", discoveryAttrs(o.Issuer, err)...)
			}
			wait = min(2*wait, time.Minute)
		}
	}()
	return ov, end, nil
}

// noteDiscovery keeps whether the failed discovery's err is a
// misconfiguration, for Verify's 503; it reports whether it is one.
func (o *OIDCVerifier) noteDiscovery(err error) bool {
	var mc *OIDCMisconfiguredError
	if errors.As(err, &mc) {
		o.misconfigured.Store(mc)
		return true
	}
	o.misconfigured.Store(nil)
	return false
}

// discoveryAttrs are the log's attributes of a failed discovery.
func discoveryAttrs(issuer string, err error) []any {
	attrs := []any{"issuer", issuer, "err", err}
	var mc *OIDCMisconfiguredError
	if errors.As(err, &mc) {
		attrs = append(attrs, "misconfigured", true, "hint", mc.Hint)
	}
	return attrs
}

// discover fetches the issuer's discovery document, within ctx, and
// makes the verifier of its keys.
func (o *OIDCVerifier) discover(ctx context.Context) error {
	p, err := oidc.NewProvider(ctx, o.issuer)
	var mismatch *oidc.IssuerMismatchError
	if errors.As(err, &mismatch) && sameIssuer(mismatch.Discovered, o.issuer) {
		// The provider writes its issuer with the trailing slash it was
		// not given (or without the one it was): the same issuer, whose
		// tokens Verify takes either way (docs/reliability.md, bug 480).
		p, err = oidc.NewProvider(oidc.InsecureIssuerURLContext(ctx, mismatch.Discovered), o.issuer)
	}
	if err != nil {
		err = fmt.Errorf("oidc discovery: %w", err)
		if hint := misconfiguration(err, o.issuer); hint != "" {
			return &OIDCMisconfiguredError{Err: err, Hint: hint}
		}
		return err
	}
	var doc struct {
		JWKSURL string `json:"jwks_uri"`
	}
	if err := p.Claims(&doc); err != nil || doc.JWKSURL == "" {
		return &OIDCMisconfiguredError{Err: errors.New("oidc discovery: the issuer's document names no jwks_uri"),
			Hint: "the issuer's discovery document names no JWKS: give its keys' URL with --oidc-jwks-url"}
	}
	o.v.Store(oidc.NewVerifier(o.issuer, o.newKeySet(doc.JWKSURL), o.cfg))
	return nil
}

// OIDCMisconfiguredError is a discovery's error that no retry mends: the
// URL of --oidc-issuer answers no discovery document of that issuer (404,
// a page of HTML, another issuer's document). It is tried again still (a
// provider's deploy may answer 404 for a while), but the log says it at
// Error each time, with what to change, and the 503 of each access token
// says the server's settings are at fault (docs/reliability.md, bug 491).
type OIDCMisconfiguredError struct {
	Err  error
	Hint string // what the operator should change
}

func (e *OIDCMisconfiguredError) Error() string { return e.Err.Error() }
func (e *OIDCMisconfiguredError) Unwrap() error { return e.Err }

// misconfiguration is the hint of a discovery's error err that no retry
// mends, "" for one that may (the provider down, not reachable, 5xx, 408,
// 429).
func misconfiguration(err error, issuer string) string {
	var mismatch *oidc.IssuerMismatchError
	if errors.As(err, &mismatch) {
		return fmt.Sprintf("the discovery document at --oidc-issuer names the issuer %q: give that as --oidc-issuer, if it is the issuer of the app's tokens", mismatch.Discovered)
	}
	msg := strings.TrimPrefix(err.Error(), "oidc discovery: ")
	if len(msg) > 4 && msg[0] == '4' && msg[3] == ' ' && !strings.HasPrefix(msg, "408") && !strings.HasPrefix(msg, "429") {
		status, _, _ := strings.Cut(msg, ":")
		return fmt.Sprintf("%s/.well-known/openid-configuration answers %s: --oidc-issuer is not the URL of an OpenID Connect issuer (its tokens' iss)", strings.TrimSuffix(issuer, "/"), status)
	}
	if strings.Contains(msg, "failed to decode provider discovery object") {
		return fmt.Sprintf("%s/.well-known/openid-configuration answers no JSON document (a web page?): --oidc-issuer is not the URL of an OpenID Connect issuer (its tokens' iss)", strings.TrimSuffix(issuer, "/"))
	}
	return ""
}

// newKeySet is the key set of the JWKS at url: go-oidc's RemoteKeySet
// told no "cannot be fetched" from "no such key" (docs/reliability.md,
// bug 476).
func (o *OIDCVerifier) newKeySet(url string) *keySet {
	ks := newKeySet(url, o.issuer, &http.Client{Timeout: o.keysTimeout}, o.log, o.now, o.skew)
	o.ks.Store(ks)
	return ks
}

// KeysUnavailable reports whether the issuer's keys cannot be fetched now:
// its discovery has not worked yet, or the last fetch of its keys failed.
// Meanwhile a token of a key not at hand is answered 503 (bug 476); the
// metrics say so (docs/reliability.md, bug 481).
func (o *OIDCVerifier) KeysUnavailable() bool {
	if o.v.Load() == nil {
		return true
	}
	ks := o.ks.Load()
	if ks == nil {
		return false
	}
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return ks.lastErr != nil
}

// Misconfigured reports whether the issuer's discovery has not worked and
// last failed in a way no retry mends (OIDCMisconfiguredError): the
// metrics say so (docs/reliability.md, bug 491).
func (o *OIDCVerifier) Misconfigured() bool {
	return o.v.Load() == nil && o.misconfigured.Load() != nil
}

// newOIDCVerifier checks o and returns its verifier, ready with
// o.JWKSURL, to discover without.
func newOIDCVerifier(_ context.Context, o OIDCOptions) (*OIDCVerifier, error) {
	if o.Issuer == "" || o.Audience == "" {
		return nil, errors.New("oidc: an issuer and an audience are required")
	}
	if o.ClockSkew <= 0 {
		o.ClockSkew = time.Minute
	}
	if o.KeysTimeout <= 0 {
		o.KeysTimeout = 10 * time.Second
	}
	if len(o.Algorithms) == 0 {
		// Every asymmetric algorithm: the key is the provider's own, and
		// it, not this server, chooses (Keycloak's realm keys may be ES384
		// or PS256). RS256 and ES256 alone refused every token of such a
		// provider, and no flag chose others (docs/reliability.md, bug
		// 469). HMAC is never among them: the JWKS is public.
		o.Algorithms = []string{oidc.RS256, oidc.RS384, oidc.RS512, oidc.ES256, oidc.ES384, oidc.ES512,
			oidc.PS256, oidc.PS384, oidc.PS512, oidc.EdDSA}
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
		// iss is checked in Verify, a trailing slash aside (bug 480).
		SkipIssuerCheck: true,
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ov := &OIDCVerifier{now: now, skew: o.ClockSkew, cfg: cfg, issuer: o.Issuer, log: log, keysTimeout: o.KeysTimeout}
	if o.JWKSURL != "" {
		ov.v.Store(oidc.NewVerifier(o.Issuer, ov.newKeySet(o.JWKSURL), cfg))
	}
	return ov, nil
}

// Verify implements TokenVerifier.
func (o *OIDCVerifier) Verify(ctx context.Context, raw string) (string, error) {
	v := o.v.Load()
	if v == nil {
		err := ErrOIDCNotDiscovered
		if mc := o.misconfigured.Load(); mc != nil {
			err = &OIDCMisconfiguredError{Err: fmt.Errorf("%w: %w", ErrOIDCNotDiscovered, mc.Err), Hint: mc.Hint}
		}
		return "", &KeysUnavailableError{Err: err, RetryAfter: time.Duration(o.nextDiscovery.Load() - o.now().UnixNano())}
	}
	note := &keysNote{}
	tok, err := v.Verify(context.WithValue(ctx, keysNoteKey{}, note), raw)
	if note.err != nil {
		return "", note.err // not judged: a 503, not a 401 (bug 476)
	}
	if err != nil {
		return "", err
	}
	if !sameIssuer(tok.Issuer, o.issuer) {
		return "", fmt.Errorf("oidc: the token was issued by %q, not %q", tok.Issuer, o.issuer)
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

// sameIssuer reports whether the issuer iss is want: the same string, but
// for one trailing slash, which operators leave out or add where their
// provider does not (Auth0's issuer ends in one, Keycloak's does not); and
// Google's tokens that say their issuer without its scheme, as go-oidc
// takes them. Before, go-oidc's exact comparison refused every token, and
// the discovery of such an issuer failed for ever (docs/reliability.md,
// bug 480).
func sameIssuer(iss, want string) bool {
	if iss == want || strings.TrimSuffix(iss, "/") == strings.TrimSuffix(want, "/") {
		return iss != ""
	}
	return want == "https://accounts.google.com" && iss == "accounts.google.com"
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

// refusedKey is the kind of reason of a refused access token, the key of
// the API's line of them (docs/reliability.md, bug 493): its text names
// times, issuers and key ids, which a forger chooses.
func refusedKey(err error) string {
	var expired *oidc.TokenExpiredError
	msg := err.Error()
	switch {
	case errors.As(err, &expired):
		return "expired"
	case strings.Contains(msg, "audience"):
		return "audience"
	case strings.Contains(msg, "issued by"):
		return "issuer"
	case strings.Contains(msg, "nbf"):
		return "not yet valid"
	case strings.Contains(msg, "sub claim"):
		return "subject"
	case strings.Contains(msg, "signature"), strings.Contains(msg, "key"), strings.Contains(msg, "malformed"), strings.Contains(msg, "algorithm"):
		return "signature"
	default:
		return "other"
	}
}
