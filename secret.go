package companion

import (
	"crypto/sha256"
	"crypto/subtle"
)

// HashSecret is how the service keeps a secret (CONTRACT §7): API tokens
// (User.TokenHash, the admin token), bridge secrets (Bridge.SecretHash),
// claim codes (RegistryDevice.ClaimHash) and the server's broker login are
// kept and compared as their SHA-256, never as themselves. The secrets the
// service makes are 256-bit random strings, for which a fast hash is
// enough.
func HashSecret(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

// SecretMatches reports whether secret is the one whose HashSecret is hash,
// in constant time. Hashing first also makes the time independent of the
// secret's length.
func SecretMatches(secret string, hash []byte) bool {
	return subtle.ConstantTimeCompare(HashSecret(secret), hash) == 1
}
