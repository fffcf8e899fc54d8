package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// KeysUnavailableError is Verify's error for an access token it could not
// judge: the identity provider's signing keys it needs could not be
// fetched (the provider down or not reachable, at the start or as it
// rotates its keys). The token is not refused: the API answers 503 with
// Retry-After, not the 401 on which a phone app logs its user out
// (docs/reliability.md, bug 476).
type KeysUnavailableError struct {
	Err        error         // why the keys could not be fetched
	RetryAfter time.Duration // until the next attempt to fetch them
}

func (e *KeysUnavailableError) Error() string {
	return "oidc: the identity provider's signing keys cannot be fetched now: " + e.Err.Error()
}

func (e *KeysUnavailableError) Unwrap() error { return e.Err }

// notJudgedKey is the kind of reason ku gives, the key of the API's line
// of tokens not judged (docs/reliability.md, bug 490): its text names
// durations, a new one each request.
func notJudgedKey(ku *KeysUnavailableError) string {
	var lately *errFetchedLately
	var mc *OIDCMisconfiguredError
	switch {
	case errors.As(ku.Err, &mc):
		return "misconfigured"
	case errors.Is(ku.Err, ErrOIDCNotDiscovered):
		return "not discovered"
	case errors.As(ku.Err, &lately):
		return "fetched lately"
	default:
		return "cannot be fetched"
	}
}

// jwksMinInterval is the least time between two fetches of the keys that
// worked: tokens of key ids the provider does not have (an app built
// against another tenant, or forged) fetched them once each, up to every
// source's 600 failures a minute (docs/reliability.md, bug 478).
const jwksMinInterval = 5 * time.Second

// errFetchedLately is fetch's error for a fetch not made: the keys were
// fetched less than jwksMinInterval ago.
type errFetchedLately struct {
	at    time.Time     // when the last fetch began
	ago   time.Duration // since then
	until time.Duration // till the next may
}

func (e *errFetchedLately) Error() string {
	return fmt.Sprintf("the keys were fetched %v ago, and are fetched again in %v at the soonest", e.ago.Round(time.Millisecond), e.until.Round(time.Millisecond))
}

// jwksMaxBody bounds a JWKS document: a provider's runs to a few KiB.
const jwksMaxBody = 1 << 20

// keySet is the signing keys of an identity provider, fetched from its
// JWKS and kept; fetched again for a token whose key id it does not have
// (a rotation). It replaces go-oidc's RemoteKeySet, which could not tell
// "no such key" from "the keys could not be fetched" (both ended in a 401)
// and fetched again at once after a failure, for every token.
type keySet struct {
	url    string
	issuer string
	client *http.Client
	log    *slog.Logger
	now    func() time.Time
	skew   time.Duration // how far the provider's clock may be from ours

	mu       sync.Mutex
	keys     []jose.JSONWebKey
	inflight *keyFetch
	failures int       // consecutive failed fetches
	lastErr  error     // of the last fetch, nil when it worked
	retryAt  time.Time // after a failure: no fetch before then
	fetched  time.Time // when the last fetch that worked began
}

// keyFetch is one fetch of the JWKS, which every token that needs it waits
// for.
type keyFetch struct {
	done  chan struct{}
	start time.Time
	keys  []jose.JSONWebKey
	err   error
}

// keysNote is where VerifySignature leaves the KeysUnavailableError of a
// token it could not judge: go-oidc's verifier wraps its error with %v.
type keysNote struct{ err *KeysUnavailableError }

type keysNoteKey struct{}

func newKeySet(url, issuer string, client *http.Client, log *slog.Logger, now func() time.Time, skew time.Duration) *keySet {
	return &keySet{url: url, issuer: issuer, client: client, log: log, now: now, skew: skew}
}

// VerifySignature implements oidc.KeySet: the token's signature checked
// against the key its kid names (every key, without a kid). A kid not
// among the keys fetches them again; while they cannot be fetched, the
// token is not judged (KeysUnavailableError, noted in ctx).
func (k *keySet) VerifySignature(ctx context.Context, jwt string) ([]byte, error) {
	// The verifier has parsed it already, with the algorithms it takes.
	jws, err := jose.ParseSigned(jwt, []jose.SignatureAlgorithm{jose.RS256, jose.RS384, jose.RS512,
		jose.ES256, jose.ES384, jose.ES512, jose.PS256, jose.PS384, jose.PS512, jose.EdDSA})
	if err != nil || len(jws.Signatures) != 1 {
		return nil, fmt.Errorf("oidc: malformed jwt: %v", err)
	}
	k.mu.Lock()
	keys := k.keys
	k.mu.Unlock()
	payload, known := verifyWith(jws, keys)
	if payload != nil {
		return payload, nil
	}
	// A key id not among the keys, or one whose key does not verify it (a
	// provider that rotates its key under the same kid, as go-oidc took
	// them): the keys are fetched again.
	keys, err = k.fetch(ctx)
	var lately *errFetchedLately
	if errors.As(err, &lately) {
		// The keys were fetched moments ago. A token issued before that
		// (by the provider's clock, give or take the skew) names a key
		// the provider did not have then: no such key. One issued since
		// may be of a key the provider has rotated to meanwhile: not
		// judged until the next fetch, a 503, never the 401 that logs
		// its user out. Its iat is read unverified, only to choose.
		var claims struct {
			IssuedAt *json.Number `json:"iat"`
		}
		_ = json.Unmarshal(jws.UnsafePayloadWithoutVerification(), &claims)
		if claims.IssuedAt != nil {
			if iat, err := claims.IssuedAt.Float64(); err == nil && iat < float64(lately.at.Add(-k.skew).UnixNano())/1e9 {
				return nil, fmt.Errorf("oidc: no key of the identity provider has the token's key id (%s)", lately)
			}
		}
		err = &KeysUnavailableError{Err: lately, RetryAfter: lately.until}
	} else if known && err != nil {
		// The keys cannot be fetched, and the key of that id does not
		// verify it: judged by the key at hand, a forged token is a 401
		// while the provider is away.
		return nil, fmt.Errorf("oidc: the signature does not verify with the key of its key id, and the keys cannot be fetched again: %v", err)
	}
	if err != nil {
		var ku *KeysUnavailableError
		if errors.As(err, &ku) {
			if n, ok := ctx.Value(keysNoteKey{}).(*keysNote); ok {
				n.err = ku
			}
		}
		return nil, err
	}
	if payload, _ := verifyWith(jws, keys); payload != nil {
		return payload, nil
	}
	return nil, errors.New("oidc: no key of the identity provider verifies the signature")
}

// verifyWith checks jws against the keys of its kid (every key when it has
// none), a key that names an algorithm only for that one. known reports
// whether a key of that kid is among them.
func verifyWith(jws *jose.JSONWebSignature, keys []jose.JSONWebKey) (payload []byte, known bool) {
	h := jws.Signatures[0].Header
	for i := range keys {
		key := &keys[i]
		if h.KeyID != "" && key.KeyID != h.KeyID {
			continue
		}
		known = h.KeyID != ""
		if key.Algorithm != "" && key.Algorithm != h.Algorithm {
			continue
		}
		if p, err := jws.Verify(key); err == nil {
			return p, true
		}
	}
	return nil, known
}

// fetch fetches the keys again, or waits for the fetch under way, within
// ctx. After a failure no fetch is made before retryAt (a second, doubled
// up to a minute as failures follow): meanwhile a token that needs one is
// answered at once, KeysUnavailableError, and the provider not asked for
// every request.
func (k *keySet) fetch(ctx context.Context) ([]jose.JSONWebKey, error) {
	k.mu.Lock()
	f := k.inflight
	if f == nil {
		now := k.now()
		if wait := k.retryAt.Sub(now); k.lastErr != nil && wait > 0 {
			err := &KeysUnavailableError{Err: k.lastErr, RetryAfter: wait}
			k.mu.Unlock()
			return nil, err
		}
		if next := k.fetched.Add(jwksMinInterval); k.lastErr == nil && !k.fetched.IsZero() && now.Before(next) {
			k.mu.Unlock()
			return nil, &errFetchedLately{at: k.fetched, ago: now.Sub(k.fetched), until: next.Sub(now)}
		}
		f = &keyFetch{done: make(chan struct{}), start: now}
		k.inflight = f
		go k.run(f)
	}
	k.mu.Unlock()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-f.done:
	}
	if f.err != nil {
		k.mu.Lock()
		wait := k.retryAt.Sub(k.now())
		k.mu.Unlock()
		return nil, &KeysUnavailableError{Err: f.err, RetryAfter: wait}
	}
	return f.keys, nil
}

// run makes the fetch f, and keeps what it found.
func (k *keySet) run(f *keyFetch) {
	f.keys, f.err = k.get()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.inflight = nil
	if f.err == nil {
		if k.lastErr != nil {
			k.log.Info("the identity provider's keys are fetched again: access tokens are judged", "issuer", k.issuer, "jwks", k.url)
		}
		k.keys, k.lastErr, k.failures, k.fetched = f.keys, nil, 0, f.start
		close(f.done)
		return
	}
	if k.lastErr == nil {
		k.log.Warn("access token not judged: the identity provider's keys cannot be fetched", "issuer", k.issuer, "jwks", k.url, "err", f.err)
	}
	k.lastErr = f.err
	k.retryAt = k.now().Add(min(time.Second<<min(k.failures, 6), time.Minute))
	k.failures++
	close(f.done)
}

// get fetches the JWKS: the keys it has that can verify a signature. A key
// of a type or use this cannot verify with is left out, not the set.
func (k *keySet) get() ([]jose.JSONWebKey, error) {
	req, err := http.NewRequest(http.MethodGet, k.url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := k.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, jwksMaxBody+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("reading the JWKS: %w", err)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("the JWKS answered %s", resp.Status)
	case len(body) > jwksMaxBody:
		return nil, fmt.Errorf("the JWKS is over %d bytes", jwksMaxBody)
	}
	var set struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := json.Unmarshal(body, &set); err != nil {
		return nil, fmt.Errorf("the JWKS is not a JWK set: %w", err)
	}
	var keys []jose.JSONWebKey
	for _, raw := range set.Keys {
		var key jose.JSONWebKey
		if err := json.Unmarshal(raw, &key); err != nil || !key.IsPublic() || key.Use == "enc" {
			continue // RFC 7517 §5: a key not understood is ignored
		}
		keys = append(keys, key)
	}
	return keys, nil
}
