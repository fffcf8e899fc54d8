package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
)

// No token, secret or claim code ever reaches a log line, at debug level,
// over a full run of every operation.
func TestLogsHoldNoSecrets(t *testing.T) {
	var logs testenv.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg := Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: t.TempDir(), AdminToken: "admin-token-never-logged", TopicPrefix: "companion/v1", LogLevel: "debug"}
	m := NewMain(cfg, logger)
	require.NoError(t, m.Run(context.Background()))
	t.Cleanup(func() { m.Close() })

	f := setupFleet(t, m, "dev-1")
	// The bridge logs into the same buffer.
	s := sim.New(sim.Options{ID: "dev-1", Logger: logger})
	b := runBridge(t, m, m.MQTTURL(), f, []agent.Device{s}, map[string]*sim.Device{"dev-1": s}, func(o *agent.Options) {
		o.Logger = logger
	})
	exerciseEveryOperation(t, f, b, "dev-1")
	// A wrong token and a wrong claim code are not logged either.
	bad := newClient(t, m, "ctk_wrong-token-never-logged")
	bad.do("GET", "/api/v1/devices", nil)
	f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": "wrong-claim-never-logged"})
	// Nor a new secret and token (bugs 278 and 279), nor the old ones a
	// client still uses after them: the bridge runs on with its old
	// secret, refused, and the user asks with their old token.
	r := f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	newSecret := r.JSON(t)["secret"].(string)
	r = f.admin.do("POST", "/api/v1/admin/users/"+f.userID+"/token", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	newToken := r.JSON(t)["token"].(string)
	require.Equal(t, 401, f.user.do("GET", "/api/v1/devices", nil).Status)
	newUser := newClient(t, m, newToken)
	require.Equal(t, 200, newUser.do("GET", "/api/v1/devices", nil).Status)
	require.Equal(t, 404, newUser.do("POST", "/api/v1/bridges/"+f.bridgeID+"/secret", nil).Status, "the operator's bridge")
	r = newUser.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "own-1"})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	ownSecret := r.JSON(t)["secret"].(string)
	r = newUser.do("POST", "/api/v1/bridges/own-1/secret", nil)
	require.Equal(t, 200, r.Status, "%s", r.Body)
	ownNewSecret := r.JSON(t)["secret"].(string)
	b.stop()
	require.NoError(t, m.Close())

	out := logs.String()
	require.NotEmpty(t, out)
	for name, secret := range map[string]string{
		"admin token":   cfg.AdminToken,
		"user token":    f.user.token,
		"bridge secret": f.bridgeSecret,
		"new secret":    newSecret,
		"new token":     newToken,
		"own secret":    ownSecret,
		"its new one":   ownNewSecret,
		"claim code":    f.claims["dev-1"],
		"wrong token":   "wrong-token-never-logged",
		"wrong claim":   "wrong-claim-never-logged",
	} {
		if strings.Contains(out, secret) {
			t.Errorf("the logs contain the %s", name)
		}
	}
}

// Without --admin-token the server makes one, readable by its owner only,
// and keeps it across restarts.
func TestGeneratedAdminTokenFile(t *testing.T) {
	dir := t.TempDir()
	m := NewMain(Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: dir, TopicPrefix: "companion/v1"}, testLogger(t))
	require.NoError(t, m.Run(context.Background()))
	tok := m.AdminToken()
	require.NoError(t, m.Close())
	fi, err := os.Stat(filepath.Join(dir, "admin.token"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	require.GreaterOrEqual(t, len(tok), 40, "a 256-bit token")

	m2 := NewMain(Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: dir, TopicPrefix: "companion/v1"}, testLogger(t))
	require.NoError(t, m2.Run(context.Background()))
	defer m2.Close()
	require.Equal(t, tok, m2.AdminToken())
}

// CONTRACT §7.4: tokens, bridge secrets and claim codes are stored hashed.
// After every request that makes one (with an Idempotency-Key, whose
// recorded answer is kept 24 h), the store's file holds each one's SHA-256
// and never the secret itself. docs/reliability.md's table of promises
// names this test as the proof of §7.4; the test it named did not exist
// (docs/reliability.md, bug 418).
func TestSecretsAreStoredHashed(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	r := f.admin.do("POST", "/api/v1/admin/users", map[string]string{"name": "bob"}, "Idempotency-Key", "user-bob")
	require.Equal(t, 201, r.Status, "%s", r.Body)
	bob := newClient(t, m, r.JSON(t)["token"].(string))
	r = f.admin.do("POST", "/api/v1/admin/users/"+f.userID+"/token", nil, "Idempotency-Key", "token-alice")
	require.Equal(t, 200, r.Status, "%s", r.Body)
	alice := newClient(t, m, r.JSON(t)["token"].(string))
	r = alice.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]}, "Idempotency-Key", "register-1")
	require.Equal(t, 201, r.Status, "%s", r.Body)
	r = bob.do("POST", "/api/v1/bridges", map[string]string{"bridge_id": "own-1"}, "Idempotency-Key", "bridge-own-1")
	require.Equal(t, 201, r.Status, "%s", r.Body)
	ownSecret := r.JSON(t)["secret"].(string)
	r = bob.do("POST", "/api/v1/bridges/own-1/secret", nil, "Idempotency-Key", "secret-own-1")
	require.Equal(t, 200, r.Status, "%s", r.Body)
	ownNewSecret := r.JSON(t)["secret"].(string)
	r = f.admin.do("POST", "/api/v1/admin/bridges/"+f.bridgeID+"/secret", nil, "Idempotency-Key", "secret-bridge-1")
	require.Equal(t, 200, r.Status, "%s", r.Body)
	newSecret := r.JSON(t)["secret"].(string)

	// Every write was committed (fsync'd) before its answer.
	db, err := os.ReadFile(filepath.Join(m.Config.Data, "companion.db"))
	require.NoError(t, err)
	for name, secret := range map[string]string{
		"user token":          bob.token,
		"new user token":      alice.token,
		"user's bridge's":     ownNewSecret,
		"operator's bridge's": newSecret,
		"claim code":          f.claims["dev-1"],
	} {
		if bytes.Contains(db, []byte(secret)) {
			t.Errorf("companion.db holds the %s %q as it is", name, secret)
		}
		h := companion.HashSecret(secret)
		if !bytes.Contains(db, h) && !bytes.Contains(db, []byte(hex.EncodeToString(h))) && !bytes.Contains(db, []byte(base64.StdEncoding.EncodeToString(h))) {
			t.Errorf("companion.db holds no SHA-256 of the %s", name)
		}
	}
	if bytes.Contains(db, []byte(ownSecret)) {
		t.Error("companion.db holds the user's bridge's first secret as it is")
	}
	if bytes.Contains(db, []byte(m.AdminToken())) {
		t.Error("companion.db holds the admin token")
	}
}
