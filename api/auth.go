package api

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"
)

// Prefixes of the secrets the API hands out, so that a leaked one is
// recognisable for what it is.
const (
	userTokenPrefix    = "ctk_"
	bridgeSecretPrefix = "cbs_"
)

// adminUserID scopes the admin's Idempotency-Key records; user ids are
// UUIDs, so it cannot collide with one.
const adminUserID = "admin"

// Keys of what the auth middlewares leave in the gin context.
const (
	ctxUser      = "companion.user"
	ctxPrincipal = "companion.principal" // the rate limiter's key
	ctxBridge    = "companion.bridge"    // the bridge blobAuth admitted
	ctxSpent     = "companion.spent"     // the source's allowance of failures is spent: its Retry-After
)

var errUnauthorized = &Error{Code: CodeUnauthorized}

// newSecret returns a prefixed 256-bit random secret and its SHA-256.
func newSecret(prefix string) (string, []byte, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", nil, err
	}
	s := prefix + base64.RawURLEncoding.EncodeToString(b[:])
	return s, companion.HashSecret(s), nil
}

// bearer returns the SHA-256 of the request's bearer token, or nil when
// there is none.
func bearer(c *gin.Context) []byte {
	tok := bearerToken(c)
	if tok == "" {
		return nil
	}
	return companion.HashSecret(tok)
}

// maxBearer bounds a bearer token. An identity provider's JWT of a user in
// many groups runs past 8 KiB, the bound before: Microsoft Entra ID puts up
// to 200 group ids in one (about 11 KiB), Keycloak every role; it was taken
// for no token, a 401 (docs/reliability.md, bug 479). Go's server takes
// headers to 1 MiB; checking 64 KiB costs some microseconds.
const maxBearer = 64 << 10

// bearerToken returns the request's bearer token, or "".
//
// A request with the Authorization header more than once is taken only
// when every one carries the same token: one with two different tokens
// (an app's interceptor that adds its account's token beside the one the
// call set, a proxy that adds its own) names two principals, and acting
// as the first, as Go's Header.Get reads, did the work as one of them
// without a word, while a proxy or a log that reads the last saw the
// other. It has none, and is a 401 (docs/reliability.md, bug 501), as
// a Last-Event-ID (bug 368) or a query parameter given twice with
// different values is refused.
func bearerToken(c *gin.Context) string {
	vs := c.Request.Header.Values("Authorization")
	if len(vs) == 0 {
		return ""
	}
	tok := parseBearer(vs[0])
	for _, v := range vs[1:] {
		if parseBearer(v) != tok {
			return ""
		}
	}
	return tok
}

// parseBearer returns the token of one Authorization value of the Bearer
// scheme, or "".
func parseBearer(v string) string {
	scheme, tok, ok := strings.Cut(v, " ")
	tok = strings.TrimSpace(tok)
	if !ok || !strings.EqualFold(scheme, "Bearer") || len(tok) > maxBearer {
		return ""
	}
	return tok
}

func (s *Server) isAdmin(hash []byte) bool {
	return s.adminHash != nil && hash != nil && subtle.ConstantTimeCompare(hash, s.adminHash) == 1
}

// userAuth admits a user's API token, or an identity provider's access
// token when a TokenVerifier is configured.
func (s *Server) userAuth(c *gin.Context) {
	if tok := bearerToken(c); s.tokens != nil && looksLikeJWT(tok) {
		if _, spent := c.Get(ctxSpent); spent {
			s.unauthorized(c) // a signature not checked for a source that spent its allowance
			return
		}
		sub, err := s.tokens.Verify(c.Request.Context(), tok)
		var ku *KeysUnavailableError
		if errors.As(err, &ku) {
			// Not judged, so not refused: a 401 tells a phone app to log
			// its user out, for a provider that is only away. A 503 it
			// retries, and the source is not counted a failure
			// (docs/reliability.md, bug 476).
			// Once a minute a reason, with a count: one line a request
			// was one for every request of every user while the provider
			// was away (docs/reliability.md, bug 490).
			s.notJudged.Log(slog.LevelInfo, notJudgedKey(ku), "access token not judged", requestIDAttr(c), "reason", err)
			var lately *errFetchedLately
			if errors.As(ku.Err, &lately) {
				// No key fetched moments ago verifies it: the provider
				// answers, so this is a token of a key it did not have
				// then (one it rotated to since, or forged), not the
				// provider away. It is counted against the source like a
				// 401: uncounted, a forger sent them without end, each a
				// signature check (docs/reliability.md, bug 492). A
				// genuine one is one or two, retried after the fetch.
				ok, wait, lerr := s.allow(c, s.unauth, c.ClientIP())
				switch {
				case lerr != nil:
					s.log.WarnContext(c.Request.Context(), "a request without a valid token was not counted against its source", requestIDAttr(c), "err", lerr)
				case !ok:
					s.fail(c, &Error{Code: CodeRateLimited, RetryAfter: ceilSeconds(wait)})
					return
				}
			}
			detail := "the access token could not be checked now: the identity provider's signing key it needs is not at hand (the provider cannot be reached, or its keys are fetched again in a moment); send the request again"
			var mc *OIDCMisconfiguredError
			if errors.As(err, &mc) {
				// Not the provider away, nor the token at fault: the
				// server's own settings, which its log says at Error.
				// Still a 503 (a 401 would log the user out, to the same
				// answer after each login), but saying so (bug 491).
				detail = "the access token could not be checked: this server's settings of its identity provider are wrong, and no token of it is taken until its operator mends them (its log says how); send the request again later"
			}
			s.fail(c, &Error{Code: CodeUnavailable, RetryAfter: ceilSeconds(ku.RetryAfter), Detail: detail})
			return
		}
		if err != nil {
			// Why a token was refused is for the log, never the caller.
			// At Info once a minute a kind of reason, with a count, and
			// each at Debug: a source's allowance bounds its 401s, but
			// many sources together made a line each without end
			// (docs/reliability.md, bug 493). The request id is in both,
			// to tie a complaint to its reason.
			if !s.refused.Logged(slog.LevelInfo, refusedKey(err), "access token refused", requestIDAttr(c), "reason", err) {
				s.log.DebugContext(c.Request.Context(), "access token refused", requestIDAttr(c), "reason", err)
			}
			s.unauthorized(c)
			return
		}
		u := companion.User{ID: oidcUserPrefix + sub, Name: sub}
		c.Set(ctxUser, u)
		c.Set(ctxPrincipal, "user:"+u.ID)
		c.Next()
		return
	}
	hash := bearer(c)
	if hash == nil {
		s.unauthorized(c)
		return
	}
	u, err := s.store.UserByTokenHash(c.Request.Context(), hash)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		s.unauthorized(c)
		return
	case err != nil:
		s.fail(c, err)
		return
	case subtle.ConstantTimeCompare(u.TokenHash, hash) != 1:
		s.unauthorized(c)
		return
	}
	c.Set(ctxUser, u)
	c.Set(ctxPrincipal, "user:"+u.ID)
	c.Next()
}

// adminAuth admits the admin token.
func (s *Server) adminAuth(c *gin.Context) {
	if !s.isAdmin(bearer(c)) {
		s.unauthorized(c)
		return
	}
	c.Set(ctxPrincipal, "admin")
	c.Next()
}

// blobAuth admits a bridge's secret, or the admin token.
func (s *Server) blobAuth(c *gin.Context) {
	hash := bearer(c)
	if hash == nil {
		s.unauthorized(c)
		return
	}
	if s.isAdmin(hash) {
		c.Set(ctxPrincipal, "admin")
		c.Next()
		return
	}
	b, err := s.store.BridgeBySecretHash(c.Request.Context(), hash)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		s.unauthorized(c)
		return
	case err != nil:
		s.fail(c, err)
		return
	case subtle.ConstantTimeCompare(b.SecretHash, hash) != 1:
		s.unauthorized(c)
		return
	}
	c.Set(ctxPrincipal, "bridge:"+b.ID)
	c.Set(ctxBridge, b.ID)
	c.Next()
}

// currentBridge is the bridge blobAuth admitted, "" for the admin.
func currentBridge(c *gin.Context) string {
	return c.GetString(ctxBridge)
}

// currentUser is the user userAuth admitted.
func currentUser(c *gin.Context) companion.User {
	u, _ := c.Get(ctxUser)
	user, _ := u.(companion.User)
	return user
}

// sourceLimit notes whether the source address has spent its allowance of
// requests without a valid token (see unauthorized): its requests with a
// wrong token are then a 429, and an identity provider's token is not even
// verified. A valid token still passes: the tokens the server makes are
// 256 bits, hopeless to guess at any rate, and a client that sent many
// wrong ones (a test suite checking its 401s, a misconfigured sidecar on
// the same host) must not lock out every other client at its address.
func (s *Server) sourceLimit(c *gin.Context) {
	ok, wait, err := s.peek(c, s.unauth, c.ClientIP())
	switch {
	case err != nil:
		s.fail(c, err)
		return
	case !ok:
		c.Set(ctxSpent, ceilSeconds(wait))
	}
	c.Next()
}

// unauthorized answers 401 and counts the failure against the source, or,
// for a wrong token, 429 once the source has spent its allowance
// (sourceLimit); a request with no token at all guesses nothing, and is a
// 401 always. A failure the RateLimiter could not count is logged: the
// answer is a 401 all the same.
func (s *Server) unauthorized(c *gin.Context) {
	if wait, spent := c.Get(ctxSpent); spent && bearerToken(c) != "" {
		s.fail(c, &Error{Code: CodeRateLimited, RetryAfter: wait.(int)})
		return
	}
	if _, _, err := s.allow(c, s.unauth, c.ClientIP()); err != nil {
		s.log.WarnContext(c.Request.Context(), "a request without a valid token was not counted against its source", requestIDAttr(c), "err", err)
	}
	s.fail(c, errUnauthorized)
}

// rateLimit applies the per-token request rate.
func (s *Server) rateLimit(c *gin.Context) {
	ok, wait, err := s.allow(c, s.rate, c.GetString(ctxPrincipal))
	switch {
	case err != nil:
		s.fail(c, err)
		return
	case !ok:
		s.fail(c, &Error{Code: CodeRateLimited, RetryAfter: ceilSeconds(wait)})
		return
	}
	c.Next()
}

func ceilSeconds(d time.Duration) int {
	return int(math.Ceil(d.Seconds()))
}
