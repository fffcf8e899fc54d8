package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/testenv"
)

// keysIDP is an identity provider the tests run: OpenID Connect discovery
// and a JWKS, which it can stop answering (503), or leave one request of
// hanging, never answered.
type keysIDP struct {
	srv     *httptest.Server
	mu      sync.Mutex
	up      bool
	keys    []jose.JSONWebKey
	issuer  string       // the discovery document's, when not the URL
	hang    atomic.Bool  // the next /keys request is never answered
	fetches atomic.Int32 // /keys requests
	gone    chan struct{}
}

func newKeysIDP(t *testing.T) *keysIDP {
	t.Helper()
	p := &keysIDP{up: true, gone: make(chan struct{})}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		up, keys, issuer := p.up, p.keys, p.issuer
		p.mu.Unlock()
		if issuer == "" {
			issuer = p.srv.URL
		}
		if r.URL.Path == "/keys" {
			p.fetches.Add(1)
			if p.hang.CompareAndSwap(true, false) {
				select { // a provider that took the request and never answers
				case <-p.gone:
				case <-r.Context().Done():
				}
				return
			}
		}
		if !up {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/.well-known/openid-configuration":
			json.NewEncoder(w).Encode(map[string]any{"issuer": issuer, "jwks_uri": p.srv.URL + "/keys",
				"authorization_endpoint": p.srv.URL + "/auth", "id_token_signing_alg_values_supported": []string{"RS256"}})
		case "/keys":
			json.NewEncoder(w).Encode(jose.JSONWebKeySet{Keys: keys})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(func() { close(p.gone); p.srv.Close() })
	return p
}

func (p *keysIDP) set(up bool, keys ...*rsa.PrivateKey) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.up, p.keys = up, nil
	for i, k := range keys {
		p.keys = append(p.keys, jose.JSONWebKey{Key: &k.PublicKey, KeyID: fmt.Sprintf("k%d", i+1), Algorithm: "RS256", Use: "sig"})
	}
}

func rsaKey(t *testing.T) *rsa.PrivateKey {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// accessToken is an access token of issuer for companion-api, signed by key
// under kid.
func accessToken(t *testing.T, key *rsa.PrivateKey, kid, issuer, sub string) string {
	t.Helper()
	return accessTokenIssued(t, key, kid, issuer, sub, time.Now())
}

// accessTokenIssued is accessToken issued at iat.
func accessTokenIssued(t *testing.T, key *rsa.PrivateKey, kid, issuer, sub string, iat time.Time) string {
	t.Helper()
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key}, (&jose.SignerOptions{}).WithHeader("kid", kid).WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	claims, _ := json.Marshal(map[string]any{"iss": issuer, "aud": "companion-api", "sub": sub,
		"exp": iat.Add(2 * time.Hour).Unix(), "iat": iat.Unix()})
	jws, err := signer.Sign(claims)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := jws.CompactSerialize()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// checkKeysUnavailable checks that r is the 503 of an access token not
// judged because the provider's keys cannot be fetched: Retry-After, the
// problem of CONTRACT §2, and no word of an invalid token.
func checkKeysUnavailable(t *testing.T, what string, r response) {
	t.Helper()
	var p struct {
		Status int    `json:"status"`
		Code   string `json:"code"`
		Detail string `json:"detail"`
	}
	_ = json.Unmarshal(r.Body, &p)
	if r.Status != http.StatusServiceUnavailable || p.Code != api.CodeUnavailable || p.Status != r.Status ||
		r.Header.Get("Retry-After") == "" || r.Header.Get("Content-Type") != "application/problem+json" || r.Header.Get("WWW-Authenticate") != "" {
		t.Errorf("%s = %d %s (Retry-After %q, WWW-Authenticate %q); want 503 unavailable with Retry-After, which an app retries: "+
			"a 401 tells it to log its user out", what, r.Status, r.Body, r.Header.Get("Retry-After"), r.Header.Get("WWW-Authenticate"))
	}
}

// While the identity provider's keys cannot be fetched (the provider down
// as it rotates its signing key), a valid access token of the new key is a
// 503 with Retry-After: before, it was a 401, on which a phone app logs its
// user out. A token of a key already known is taken, a forged one is a 401
// still, and once the provider answers the new key's token is taken
// (docs/reliability.md, bug 476).
func TestAccessTokenWhileTheProviderKeysCannotBeFetched(t *testing.T) {
	t.Parallel() // it mostly waits
	p := newKeysIDP(t)
	k1, k2, forger := rsaKey(t), rsaKey(t), rsaKey(t)
	p.set(true, k1)
	capture := &logCapture{}
	m := startServerWithLog(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api"}}, capture)
	old := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp"))
	if r := old.do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}

	p.set(false, k1, k2) // rotated, and down
	rotated := newClient(t, m, accessToken(t, k2, "k2", p.srv.URL, "bob@idp"))
	checkKeysUnavailable(t, "a token of the provider's new key while it is down", rotated.do("GET", "/api/v1/devices", nil))
	checkKeysUnavailable(t, "the same token again", rotated.do("GET", "/api/v1/devices", nil))
	if r := old.do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Errorf("a token of a key already known while the provider is down = %d %s; want 200", r.Status, r.Body)
	}
	// The keys are fetched again 5 s after the last fetch at the soonest
	// (bug 478); that fetch fails, and the log says so.
	testenv.Eventually(t, 30*time.Second, "the log saying why access tokens are answered 503", func() bool {
		checkKeysUnavailable(t, "a token of the provider's new key while it is down", rotated.do("GET", "/api/v1/devices", nil))
		return capture.has(slog.LevelWarn, "access token not judged: the identity provider's keys cannot be fetched", "issuer", p.srv.URL)
	})
	checkKeysUnavailable(t, "the same token after a failed fetch", rotated.do("GET", "/api/v1/devices", nil))
	if r := newClient(t, m, accessToken(t, forger, "k1", p.srv.URL, "mallory")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusUnauthorized {
		t.Errorf("a forged token of a known key id while the provider is down = %d; want 401", r.Status)
	}

	p.set(true, k1, k2)
	testenv.Eventually(t, 30*time.Second, "the new key's token taken once the provider answers", func() bool {
		return rotated.do("GET", "/api/v1/devices", nil).Status == http.StatusOK
	})
}

// A fetch of the provider's keys that is never answered (a provider that
// took the connection and hangs, a network that dropped it) ends within
// --oidc's fetch timeout: the token that needed it is a 503, a token of a
// key already known is not held, and the keys are fetched again, the new
// key's token taken. Before, the fetch had no timeout, every token of the
// new key waited on it for as long as its client did, and the keys were
// never fetched again until the server restarted (docs/reliability.md,
// bug 477).
func TestAccessTokenKeyFetchThatHangsEndsAndIsTriedAgain(t *testing.T) {
	t.Parallel() // it mostly waits
	p := newKeysIDP(t)
	k1, k2 := rsaKey(t), rsaKey(t)
	p.set(true, k1)
	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api",
		JWKSURL: p.srv.URL + "/keys", KeysTimeout: time.Second}})
	old := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp"))
	if r := old.do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}

	p.set(true, k1, k2)
	p.hang.Store(true) // the next fetch of the keys is never answered
	tok := accessToken(t, k2, "k2", p.srv.URL, "bob@idp")
	get := func(timeout time.Duration) (int, error) {
		req, _ := http.NewRequest("GET", m.APIURL()+"/api/v1/devices", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := (&http.Client{Timeout: timeout}).Do(req)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if status, err := get(15 * time.Second); err != nil || status != http.StatusServiceUnavailable {
		t.Errorf("a token of the new key while its fetch hangs = %d, %v; want a 503 within the fetch timeout", status, err)
	}
	if r := old.do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Errorf("a token of a key already known while a fetch hangs = %d %s; want 200", r.Status, r.Body)
	}
	testenv.Eventually(t, 30*time.Second, "the new key's token taken once the keys are fetched again", func() bool {
		status, _ := get(3 * time.Second)
		return status == http.StatusOK
	})
}

// Tokens of key ids the provider does not have (an app built against
// another tenant, or forged) make at most one fetch of the keys each 5 s,
// however many come: before, each made one, from every source's allowance
// of 600 failures a minute, and a provider that rate-limits its JWKS then
// refused the fetch a real rotation needed. A token of such a kid issued
// before the last fetch is a 401 at once; one issued since (a rotation the
// last fetch may have missed) a 503 with Retry-After until the next fetch,
// which takes it (docs/reliability.md, bug 478).
func TestAccessTokenKeyFetchesAreLimited(t *testing.T) {
	p := newKeysIDP(t)
	k1, k2, forger := rsaKey(t), rsaKey(t), rsaKey(t)
	p.set(true, k1)
	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}})
	if r := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}
	before := p.fetches.Load()
	for i := range 20 {
		r := newClient(t, m, accessToken(t, forger, fmt.Sprintf("other-%d", i), p.srv.URL, "mallory")).do("GET", "/api/v1/devices", nil)
		if r.Status != http.StatusUnauthorized && r.Status != http.StatusServiceUnavailable {
			t.Fatalf("a token of a key id the provider does not have = %d %s; want 401 or 503", r.Status, r.Body)
		}
	}
	if n := p.fetches.Load() - before; n > 2 {
		t.Errorf("20 tokens of key ids the provider does not have made %d fetches of its keys; want at most 2 (one each 5 s)", n)
	}
	stale := accessTokenIssued(t, forger, "retired", p.srv.URL, "carol@idp", time.Now().Add(-time.Hour))
	if r := newClient(t, m, stale).do("GET", "/api/v1/devices", nil); r.Status != http.StatusUnauthorized {
		t.Errorf("a token issued an hour ago of a key id the provider does not have = %d %s; want 401", r.Status, r.Body)
	}

	p.set(true, k1, k2)
	takenInTime(t, newClient(t, m, accessToken(t, k2, "k2", p.srv.URL, "bob@idp")), "a token of the provider's new key")
}

// takenInTime waits for c's access token to be taken, a 503 meanwhile and
// never the 401 that logs its user out.
func takenInTime(t *testing.T, c *client, what string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, what+" taken", func() bool {
		r := c.do("GET", "/api/v1/devices", nil)
		if r.Status == http.StatusUnauthorized {
			t.Fatalf("%s = 401 %s; want 503 until the keys are fetched again, then 200", what, r.Body)
		}
		return r.Status == http.StatusOK
	})
}

// An access token of a user in many groups runs past 8 KiB: Microsoft
// Entra ID puts up to 200 group ids in a JWT (about 11 KiB), Keycloak every
// role. It was taken for no token at all, a 401, the user logged out and
// logged in to the same token (docs/reliability.md, bug 479).
func TestAccessTokenOfAUserInManyGroups(t *testing.T) {
	p := newKeysIDP(t)
	key := rsaKey(t)
	p.set(true, key)
	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}})
	groups := make([]string, 200)
	for i := range groups {
		groups[i] = fmt.Sprintf("%08x-4c2e-4a8e-9b1f-%012x", i, i*7919)
	}
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key}, (&jose.SignerOptions{}).WithHeader("kid", "k1").WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	claims, _ := json.Marshal(map[string]any{"iss": p.srv.URL, "aud": "companion-api", "sub": "alice@idp", "groups": groups,
		"exp": time.Now().Add(time.Hour).Unix(), "iat": time.Now().Unix()})
	jws, err := signer.Sign(claims)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := jws.CompactSerialize()
	if err != nil {
		t.Fatal(err)
	}
	if r := newClient(t, m, tok).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Errorf("an access token of %d bytes (200 groups) = %d %s; want 200", len(tok), r.Status, r.Body)
	}
}

// An issuer given without the trailing slash its provider writes (Auth0's
// is "https://TENANT.auth0.com/"), or with one it does not, is the same
// issuer: before, the discovery failed "did not match the issuer URL
// returned by provider", tried again for ever, and with --oidc-jwks-url
// every token was refused "issued by a different provider"
// (docs/reliability.md, bug 480).
func TestAccessTokenOfAnIssuerWithATrailingSlash(t *testing.T) {
	for _, jwks := range []bool{false, true} {
		t.Run(fmt.Sprintf("jwks-url=%v", jwks), func(t *testing.T) {
			p := newKeysIDP(t)
			key := rsaKey(t)
			p.set(true, key)
			p.mu.Lock()
			p.issuer = p.srv.URL + "/"
			p.mu.Unlock()
			o := api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api"}
			if jwks {
				o.JWKSURL = p.srv.URL + "/keys"
			}
			m := startServer(t, Config{OIDC: o})
			user := newClient(t, m, accessToken(t, key, "k1", p.srv.URL+"/", "alice@idp"))
			if r := user.do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
				t.Errorf("--oidc-issuer %s, a token of iss %s/ = %d %s; want 200", p.srv.URL, p.srv.URL, r.Status, r.Body)
			}
			other := newClient(t, m, accessToken(t, key, "k1", p.srv.URL+"/other", "mallory"))
			if r := other.do("GET", "/api/v1/devices", nil); r.Status == http.StatusOK {
				t.Errorf("a token of iss %s/other = 200; want it refused", p.srv.URL)
			}
		})
	}
}

// A provider that rotates its key under the same key id (some keep one kid,
// "sig", for whatever key is current) has its keys fetched again for a
// token that the key of that id does not verify, as go-oidc did: the new
// key's token is a 503 until then, never a 401, then taken; a token issued
// an hour before the fetch is a 401 at once (bugs 476 and 478).
func TestAccessTokenOfAKeyRotatedUnderItsKeyID(t *testing.T) {
	p := newKeysIDP(t)
	old, rotated := rsaKey(t), rsaKey(t)
	p.set(true, old)
	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}})
	if r := newClient(t, m, accessToken(t, old, "k1", p.srv.URL, "alice@idp")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}
	p.set(true, rotated) // k1 now names the new key
	stale := accessTokenIssued(t, rsaKey(t), "k1", p.srv.URL, "mallory", time.Now().Add(-time.Hour))
	if r := newClient(t, m, stale).do("GET", "/api/v1/devices", nil); r.Status != http.StatusUnauthorized {
		t.Errorf("a forged token of kid k1 issued an hour ago = %d %s; want 401", r.Status, r.Body)
	}
	takenInTime(t, newClient(t, m, accessToken(t, rotated, "k1", p.srv.URL, "bob@idp")), "a token of the key rotated under kid k1")
}

// While the identity provider's keys cannot be fetched, /metrics says so:
// companion_identity_provider_unavailable is 1 from the failed discovery or
// fetch until one works, for an alert on the 503s its access tokens get
// (docs/reliability.md, bug 481).
func TestIdentityProviderUnavailableMetric(t *testing.T) {
	p := newKeysIDP(t)
	key := rsaKey(t)
	p.set(false, key)
	m := startServer(t, Config{Metrics: "127.0.0.1:0", OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api"}})
	metricsExpect(t, metricsScrape(t, m), 1, "companion_identity_provider_unavailable")
	p.set(true, key)
	user := newClient(t, m, accessToken(t, key, "k1", p.srv.URL, "alice@idp"))
	testenv.Eventually(t, 30*time.Second, "an access token taken once the provider answers", func() bool {
		return user.do("GET", "/api/v1/devices", nil).Status == http.StatusOK
	})
	metricsExpect(t, metricsScrape(t, m), 0, "companion_identity_provider_unavailable")
}

// A provider that signs with another asymmetric algorithm than RS256 or
// ES256 (Keycloak's realm keys may be ES384 or PS256, and no flag chose
// the algorithms) had every access token refused, each user logged out at
// once (docs/reliability.md, bug 482).
func TestAccessTokenOfAnotherAsymmetricAlgorithm(t *testing.T) {
	p := newKeysIDP(t)
	ec, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	rs := rsaKey(t)
	p.mu.Lock()
	p.keys = []jose.JSONWebKey{{Key: &ec.PublicKey, KeyID: "e1", Algorithm: "ES384", Use: "sig"},
		{Key: &rs.PublicKey, KeyID: "p1", Algorithm: "PS256", Use: "sig"}}
	p.mu.Unlock()
	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api"}})
	for _, k := range []struct {
		alg jose.SignatureAlgorithm
		kid string
		key any
	}{{jose.ES384, "e1", ec}, {jose.PS256, "p1", rs}} {
		signer, err := jose.NewSigner(jose.SigningKey{Algorithm: k.alg, Key: k.key}, (&jose.SignerOptions{}).WithHeader("kid", k.kid).WithType("JWT"))
		if err != nil {
			t.Fatal(err)
		}
		claims, _ := json.Marshal(map[string]any{"iss": p.srv.URL, "aud": "companion-api", "sub": "alice@idp",
			"exp": time.Now().Add(time.Hour).Unix(), "iat": time.Now().Unix()})
		jws, err := signer.Sign(claims)
		if err != nil {
			t.Fatal(err)
		}
		tok, _ := jws.CompactSerialize()
		if r := newClient(t, m, tok).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
			t.Errorf("an access token signed %s = %d %s; want 200", k.alg, r.Status, r.Body)
		}
	}
	hs, _ := jose.NewSigner(jose.SigningKey{Algorithm: jose.HS256, Key: []byte("a secret of thirty-two bytes or more")}, (&jose.SignerOptions{}).WithHeader("kid", "p1"))
	claims, _ := json.Marshal(map[string]any{"iss": p.srv.URL, "aud": "companion-api", "sub": "mallory", "exp": time.Now().Add(time.Hour).Unix()})
	jws, _ := hs.Sign(claims)
	tok, _ := jws.CompactSerialize()
	if r := newClient(t, m, tok).do("GET", "/api/v1/devices", nil); r.Status != http.StatusUnauthorized {
		t.Errorf("an access token signed HS256 = %d %s; want 401", r.Status, r.Body)
	}
}

// countLogs is how many records of at least level with msg were logged.
func (h *logCapture) countLogs(level slog.Level, msg string) int {
	l := h.logs()
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.records {
		if r.level >= level && r.msg == msg {
			n++
		}
	}
	return n
}

// Access tokens not judged (a 503) are logged once a minute a reason, with
// a count: forged tokens of made-up key ids issued now, and a token of a
// key the provider rotated to while it is down, each sent again and again,
// make a line or two, not one a request, and the forged ones no more than
// one fetch of the keys each 5 s. Before, each was an Info line: one for
// every request of every user while the provider was away
// (docs/reliability.md, bug 490).
func TestAccessTokensNotJudgedAreLoggedOnceAMinute(t *testing.T) {
	p := newKeysIDP(t)
	k1, k2, forger := rsaKey(t), rsaKey(t), rsaKey(t)
	p.set(true, k1)
	capture := &logCapture{}
	m := startServerWithLog(t, Config{OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}}, capture)
	if r := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}
	before := p.fetches.Load()
	forged := 0
	for i := range 40 {
		r := newClient(t, m, accessToken(t, forger, fmt.Sprintf("made-up-%d", i), p.srv.URL, "mallory")).do("GET", "/api/v1/devices", nil)
		switch r.Status {
		case http.StatusServiceUnavailable:
			forged++
		case http.StatusUnauthorized:
		default:
			t.Fatalf("a forged token of a made-up key id issued now = %d %s; want 503 or 401", r.Status, r.Body)
		}
	}
	if forged < 2 {
		t.Fatalf("only %d of 40 forged tokens issued now were 503s; the test needs some", forged)
	}
	if n := p.fetches.Load() - before; n > 2 {
		t.Errorf("40 forged tokens of made-up key ids made %d fetches of the keys; want at most 2 (one each 5 s)", n)
	}

	p.set(false, k1, k2) // rotated, and down
	rotated := newClient(t, m, accessToken(t, k2, "k2", p.srv.URL, "bob@idp"))
	testenv.Eventually(t, 30*time.Second, "a fetch of the keys failing", func() bool {
		checkKeysUnavailable(t, "a token of the provider's new key while it is down", rotated.do("GET", "/api/v1/devices", nil))
		return capture.has(slog.LevelWarn, "access token not judged: the identity provider's keys cannot be fetched", "issuer", p.srv.URL)
	})
	for range 40 {
		checkKeysUnavailable(t, "a token of the provider's new key while it is down", rotated.do("GET", "/api/v1/devices", nil))
	}
	// A line for the forged tokens, one for the fetch failed; none more
	// within the minute.
	if n := capture.countLogs(slog.LevelDebug, "access token not judged"); n > 2 {
		t.Errorf("%d forged tokens and 40+ tokens while the provider is down made %d lines \"access token not judged\"; want at most 2, once a minute a reason", forged, n)
	}
}

// An --oidc-issuer whose discovery no retry mends (its document names
// another issuer; the URL answers 404, or a web page) is said for what it
// is: each access token is a 503 whose detail blames the server's
// settings, not the provider's absence; the log says it at Error with what
// to change at each attempt, not once at the start; and
// companion_identity_provider_misconfigured is 1. Once the provider's
// document is right the tokens are taken. Before, it looked like a
// provider away: one Error line at the start, every token a 503 "the
// provider cannot be reached" for ever (docs/reliability.md, bug 491).
func TestAccessTokenWhileTheIssuerIsMisconfigured(t *testing.T) {
	key := rsaKey(t)
	for _, tc := range []struct {
		name  string
		spoil func(p *keysIDP) (issuer string)
		hint  string
	}{
		{"another issuer", func(p *keysIDP) string {
			p.mu.Lock()
			p.issuer = "https://login.example.com/other-tenant"
			p.mu.Unlock()
			return p.srv.URL
		}, "names the issuer \"https://login.example.com/other-tenant\""},
		{"404", func(p *keysIDP) string { return p.srv.URL + "/not-an-issuer" }, "answers 404 Not Found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newKeysIDP(t)
			p.set(true, key)
			issuer := tc.spoil(p)
			capture := &logCapture{}
			m := startServerWithLog(t, Config{Metrics: "127.0.0.1:0", OIDC: api.OIDCOptions{Issuer: issuer, Audience: "companion-api"}}, capture)
			user := newClient(t, m, accessToken(t, key, "k1", issuer, "alice@idp"))
			r := user.do("GET", "/api/v1/devices", nil)
			checkKeysUnavailable(t, "an access token while --oidc-issuer is misconfigured", r)
			if !strings.Contains(string(r.Body), "settings") {
				t.Errorf("an access token while --oidc-issuer is misconfigured = %d %s; want a detail saying the server's settings are wrong, not that the provider cannot be reached", r.Status, r.Body)
			}
			metricsExpect(t, metricsScrape(t, m), 1, "companion_identity_provider_misconfigured")
			// Said at Error with its hint, again at the next attempts.
			testenv.Eventually(t, 30*time.Second, "the misconfiguration said twice at Error", func() bool {
				n := 0
				l := capture.logs()
				l.mu.Lock()
				defer l.mu.Unlock()
				for _, rec := range l.records {
					if rec.level >= slog.LevelError && strings.HasPrefix(rec.msg, "oidc discovery failed") && strings.Contains(rec.attrs["hint"], tc.hint) {
						n++
					}
				}
				return n >= 2
			})
			p.mu.Lock()
			p.issuer = ""
			p.mu.Unlock()
			if tc.name == "404" {
				return // the URL is the operator's to mend
			}
			testenv.Eventually(t, 90*time.Second, "the token taken once the provider's document is right", func() bool {
				return user.do("GET", "/api/v1/devices", nil).Status == http.StatusOK
			})
			metricsExpect(t, metricsScrape(t, m), 0, "companion_identity_provider_misconfigured")
		})
	}
}

// A forged access token of a made-up key id, issued now, sent within the
// 5 s after a fetch of the keys is a 503 (bug 478: it may be a key the
// provider has just rotated to), but it is counted against its source's
// allowance of failures: once the source has spent it, its tokens are 429s
// and no signature is checked. Before, those 503s were not counted, and a
// forger sent them without end (docs/reliability.md, bug 492). A genuine
// token of a key the provider rotated to is still never a 401.
func TestForgedAccessTokensAfterAFetchAreCountedAgainstTheirSource(t *testing.T) {
	p := newKeysIDP(t)
	k1, k2, forger := rsaKey(t), rsaKey(t), rsaKey(t)
	p.set(true, k1)
	const allowance = 10
	m := startServer(t, Config{Limits: api.Limits{UnauthPerMinute: allowance},
		OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}})
	if r := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}
	// Each forged token of a made-up kid, and one of the known kid whose
	// signature does not verify: 503s (fetched lately), 401s (a fetch made
	// for it), then 429s once the allowance is spent.
	statuses := map[int]int{}
	for i := range 4 * allowance {
		kid := fmt.Sprintf("made-up-%d", i)
		if i%2 == 1 {
			kid = "k1"
		}
		r := newClient(t, m, accessToken(t, forger, kid, p.srv.URL, "mallory")).do("GET", "/api/v1/devices", nil)
		switch r.Status {
		case http.StatusServiceUnavailable, http.StatusUnauthorized, http.StatusTooManyRequests:
			statuses[r.Status]++
		default:
			t.Fatalf("forged token %d = %d %s; want 503, 401 or 429", i, r.Status, r.Body)
		}
	}
	if statuses[http.StatusServiceUnavailable] == 0 {
		t.Fatalf("no forged token issued now was a 503 (%v); the test needs some", statuses)
	}
	if got := statuses[http.StatusServiceUnavailable] + statuses[http.StatusUnauthorized]; got > allowance+1 {
		t.Errorf("%d forged tokens from one source were answered %v: %d judged or not judged, not 429; want at most %d, its allowance of failures", 4*allowance, statuses, got, allowance+1)
	}

	// A genuine token of a key the provider rotates to, from another
	// source's point of view the same: never a 401.
	p.set(true, k1, k2)
	takenInTime(t, newClient(t, m, accessToken(t, k2, "k2", p.srv.URL, "bob@idp")), "a token of the provider's new key")
}

// Refused access tokens are logged at Info once a minute a kind of reason,
// with a count, and each at Debug, with its request id: before, each 401
// was an Info line, which a source's allowance of failures bounds but
// many sources together do not (docs/reliability.md, bug 493).
func TestRefusedAccessTokensAreLoggedOnceAMinute(t *testing.T) {
	p := newKeysIDP(t)
	k1, forger := rsaKey(t), rsaKey(t)
	p.set(true, k1)
	capture := &logCapture{}
	m := startServerWithLog(t, Config{Limits: api.Limits{UnauthPerMinute: -1},
		OIDC: api.OIDCOptions{Issuer: p.srv.URL, Audience: "companion-api", JWKSURL: p.srv.URL + "/keys"}}, capture)
	if r := newClient(t, m, accessToken(t, k1, "k1", p.srv.URL, "alice@idp")).do("GET", "/api/v1/devices", nil); r.Status != http.StatusOK {
		t.Fatalf("an access token while the provider answers = %d %s", r.Status, r.Body)
	}
	expired := accessTokenIssued(t, k1, "k1", p.srv.URL, "bob@idp", time.Now().Add(-5*time.Hour))
	forged := accessTokenIssued(t, forger, "k1", p.srv.URL, "mallory", time.Now().Add(-time.Hour))
	var ids []string
	for i := range 60 {
		tok := expired
		if i%2 == 1 {
			tok = forged
		}
		r := newClient(t, m, tok).do("GET", "/api/v1/devices", nil)
		if r.Status != http.StatusUnauthorized {
			t.Fatalf("a refused access token = %d %s; want 401", r.Status, r.Body)
		}
		ids = append(ids, r.Header.Get("X-Request-Id"))
	}
	if n := capture.countLogs(slog.LevelInfo, "access token refused"); n > 2 {
		t.Errorf("60 refused access tokens of two reasons made %d Info lines \"access token refused\"; want at most 2, once a minute a reason", n)
	}
	for _, id := range ids {
		if !capture.has(slog.LevelDebug, "access token refused", "request_id", id) {
			t.Fatalf("no line \"access token refused\" with request_id=%s: an operator cannot tie a complaint to it", id)
		}
	}
}
