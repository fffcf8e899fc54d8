package api

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// answerLost is a store that fails to store the answer of a keyed request
// (PutIdempotency of a record that is not a claim), as a store that went
// away just after the request's work committed, and counts the writes
// that do a request's work.
type answerLost struct {
	*store.DB
	mu     sync.Mutex
	writes map[string]int
}

func (s *answerLost) did(what string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes[what]++
}

func (s *answerLost) count(what string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.writes[what]
}

func (s *answerLost) PutIdempotency(ctx context.Context, rec companion.Idempotency) error {
	if rec.Status != 0 {
		return errDisk
	}
	return s.DB.PutIdempotency(ctx, rec)
}

func (s *answerLost) CreateUser(ctx context.Context, u companion.User) error {
	s.did("CreateUser")
	return s.DB.CreateUser(ctx, u)
}

func (s *answerLost) SetUserToken(ctx context.Context, userID string, hash []byte) error {
	s.did("SetUserToken")
	return s.DB.SetUserToken(ctx, userID, hash)
}

func (s *answerLost) ProvisionDevice(ctx context.Context, d companion.RegistryDevice) error {
	s.did("ProvisionDevice")
	return s.DB.ProvisionDevice(ctx, d)
}

func (s *answerLost) CreateBridge(ctx context.Context, b companion.Bridge) error {
	s.did("CreateBridge")
	return s.DB.CreateBridge(ctx, b)
}

func (s *answerLost) SetBridgeSecret(ctx context.Context, bridgeID, ownerID string, hash []byte) error {
	s.did("SetBridgeSecret")
	return s.DB.SetBridgeSecret(ctx, bridgeID, ownerID, hash)
}

func (s *answerLost) DeleteBridge(ctx context.Context, bridgeID, ownerID string) ([]string, error) {
	s.did("DeleteBridge")
	return s.DB.DeleteBridge(ctx, bridgeID, ownerID)
}

func (s *answerLost) AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (string, error) {
	s.did("AssignDevice")
	return s.DB.AssignDevice(ctx, deviceID, bridgeID, ownerID)
}

func (s *answerLost) Bind(ctx context.Context, b companion.Binding) (companion.Binding, bool, error) {
	s.did("Bind")
	return s.DB.Bind(ctx, b)
}

func (s *answerLost) Unbind(ctx context.Context, deviceID, userID string) (companion.Unbound, error) {
	s.did("Unbind")
	return s.DB.Unbind(ctx, deviceID, userID)
}

// A keyed request whose work committed but whose answer the store then
// failed to keep is answered to its repeat with the first answer, and the
// work is not done again (CONTRACT §2): the answer is stored in the
// transaction that does the work. Before, the key stayed claimed: every
// repeat waited and was answered 409 idempotency_key_in_use, and once the
// claim ran out (a minute on) the repeat did the work again: a second
// user with a second token, a second new secret, a 409 for a bridge or a
// device the first request had made, a 404 for one it had unbound.
func TestKeyedWorkAndItsAnswerCommitTogether(t *testing.T) {
	for _, tc := range []struct {
		name, method, path string
		body               any
		admin              bool
		status             int
		write              string                            // the store write that does the work
		setup              func(t *testing.T, e *env) string // returns the user's token
	}{
		{name: "admin user", method: "POST", path: "/api/v1/admin/users", body: map[string]any{"name": "gina"}, admin: true, status: 201, write: "CreateUser"},
		{name: "admin bridge", method: "POST", path: "/api/v1/admin/bridges", body: map[string]any{"bridge_id": "hub-1"}, admin: true, status: 201, write: "CreateBridge"},
		{name: "provision", method: "POST", path: "/api/v1/admin/devices", body: map[string]any{"device_id": "dev-9", "claim_code": "c-9", "model": "sim-1"}, admin: true, status: 201, write: "ProvisionDevice"},
		{name: "new user token", method: "POST", path: "/api/v1/admin/users/{user}/token", admin: true, status: 200, write: "SetUserToken"},
		{name: "admin new bridge secret", method: "POST", path: "/api/v1/admin/bridges/hub-1/secret", admin: true, status: 200, write: "SetBridgeSecret",
			setup: func(t *testing.T, e *env) string {
				require.NoError(t, e.db.CreateBridge(context.Background(), companion.Bridge{ID: "hub-1", SecretHash: []byte("s-1")}))
				return ""
			}},
		{name: "admin assign", method: "PUT", path: "/api/v1/admin/devices/dev-1/bridge", body: map[string]any{"bridge_id": "hub-1"}, admin: true, status: 200, write: "AssignDevice",
			setup: func(t *testing.T, e *env) string {
				e.provision("dev-1", "code-dev-1", "sim-1")
				require.NoError(t, e.db.CreateBridge(context.Background(), companion.Bridge{ID: "hub-1", SecretHash: []byte("s-1")}))
				return ""
			}},
		{name: "register", method: "POST", path: "/api/v1/devices/register", body: map[string]any{"device_id": "dev-1", "claim_code": "code-dev-1"}, status: 201, write: "Bind",
			setup: func(t *testing.T, e *env) string {
				e.provision("dev-1", "code-dev-1", "sim-1")
				return e.user("ula")
			}},
		{name: "unbind", method: "DELETE", path: "/api/v1/devices/dev-1", status: 204, write: "Unbind",
			setup: func(t *testing.T, e *env) string { return e.bound("dev-1") }},
		{name: "user bridge", method: "POST", path: "/api/v1/bridges", body: map[string]any{"bridge_id": "my-hub"}, status: 201, write: "CreateBridge",
			setup: func(t *testing.T, e *env) string { return e.user("ula") }},
		{name: "user new bridge secret", method: "POST", path: "/api/v1/bridges/my-hub/secret", status: 200, write: "SetBridgeSecret",
			setup: func(t *testing.T, e *env) string {
				tok := e.user("ula")
				require.Equal(t, 201, e.do("POST", "/api/v1/bridges", tok, map[string]any{"bridge_id": "my-hub"}).status)
				return tok
			}},
		{name: "user delete bridge", method: "DELETE", path: "/api/v1/bridges/my-hub", status: 204, write: "DeleteBridge",
			setup: func(t *testing.T, e *env) string {
				tok := e.user("ula")
				require.Equal(t, 201, e.do("POST", "/api/v1/bridges", tok, map[string]any{"bridge_id": "my-hub"}).status)
				return tok
			}},
		{name: "user assign", method: "PUT", path: "/api/v1/devices/dev-1/bridge", body: map[string]any{"bridge_id": "my-hub"}, status: 200, write: "AssignDevice",
			setup: func(t *testing.T, e *env) string {
				tok := e.bound("dev-1")
				require.Equal(t, 201, e.do("POST", "/api/v1/bridges", tok, map[string]any{"bridge_id": "my-hub"}).status)
				return tok
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shortWait(t, 200*time.Millisecond)
			start := time.Now().UTC().Truncate(time.Second)
			clk := &clock{now: start}
			db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler), Now: clk.Now})
			require.NoError(t, err)
			t.Cleanup(func() { db.Close() })
			st := &answerLost{DB: db, writes: map[string]int{}}
			e := newEnvWith(t, db, st, func(o *Options) { o.Now = clk.Now })
			token := testAdminToken
			if tc.setup != nil {
				if tok := tc.setup(t, e); !tc.admin {
					token = tok
				}
			}
			path := tc.path
			if tc.write == "SetUserToken" {
				r := e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "gina"})
				require.Equal(t, 201, r.status, "%s", r.body)
				path = "/api/v1/admin/users/" + r.json(t)["user_id"].(string) + "/token"
			}
			before := st.count(tc.write)
			send := func() resp {
				return e.send(req{method: tc.method, path: path, token: token, body: tc.body, header: map[string]string{"Idempotency-Key": "k-1"}})
			}
			first := send()
			require.Equal(t, tc.status, first.status, "the first request: %s", first.body)

			again := send()
			assert.Equal(t, tc.status, again.status, "the repeat at once: %s", again.body)

			clk.Set(start.Add(2 * store.IdempotencyClaimTTL))
			again = send()
			assert.Equal(t, tc.status, again.status, "the repeat after a claim's minute: %s", again.body)
			assert.NotContains(t, string(again.body), `"token"`, "the repeat is the first answer, as stored")
			assert.NotContains(t, string(again.body), `"secret"`, "the repeat is the first answer, as stored")
			assert.Equal(t, 1, st.count(tc.write)-before, "%s done for the request and its repeats", tc.write)
		})
	}
}
