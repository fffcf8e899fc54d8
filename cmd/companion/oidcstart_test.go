package main

import (
	"crypto/rand"
	"crypto/rsa"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/testenv"
)

// A server started while its identity provider cannot be reached (at boot
// before the network to it is up, or the provider down) starts all the
// same: its admin token, API tokens, bridges and MQTT work, access tokens
// are answered 503 until the issuer's discovery works, which is tried again
// until it does. Before, the start ended "oidc discovery: …", exit status
// 1, and the unit restarted the whole server every 2 s for as long as the
// provider was away (docs/reliability.md, bug 440).
func TestServerStartsWhileTheIssuerIsDown(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	var up atomic.Bool
	var idp *httptest.Server
	idp = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !up.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/.well-known/openid-configuration":
			json.NewEncoder(w).Encode(map[string]any{"issuer": idp.URL, "jwks_uri": idp.URL + "/keys",
				"authorization_endpoint": idp.URL + "/auth", "id_token_signing_alg_values_supported": []string{"RS256"}})
		case "/keys":
			json.NewEncoder(w).Encode(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: "k1", Algorithm: "RS256", Use: "sig"}}})
		default:
			http.NotFound(w, r)
		}
	}))
	defer idp.Close()

	m := startServer(t, Config{OIDC: api.OIDCOptions{Issuer: idp.URL, Audience: "companion-api"}})
	admin := newClient(t, m, "test-admin-token")
	if r := admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"}); r.Status != http.StatusCreated {
		t.Errorf("an admin request while the issuer is down = %d %s; want 201", r.Status, r.Body)
	}

	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key}, (&jose.SignerOptions{}).WithHeader("kid", "k1").WithType("JWT"))
	if err != nil {
		t.Fatal(err)
	}
	claims, _ := json.Marshal(map[string]any{"iss": idp.URL, "aud": "companion-api", "sub": "alice@idp",
		"exp": time.Now().Add(time.Hour).Unix(), "iat": time.Now().Unix()})
	jws, err := signer.Sign(claims)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := jws.CompactSerialize()
	if err != nil {
		t.Fatal(err)
	}
	user := newClient(t, m, tok)
	// Not judged, so not refused: a 503 the app retries, not the 401 on
	// which it logs its user out (bug 476).
	checkKeysUnavailable(t, "an access token while the issuer is down", user.do("GET", "/api/v1/devices", nil))
	up.Store(true)
	testenv.Eventually(t, 30*time.Second, "an access token taken once the issuer answers", func() bool {
		return user.do("GET", "/api/v1/devices", nil).Status == http.StatusOK
	})
}
