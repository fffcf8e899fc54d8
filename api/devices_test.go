package api

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store"
)

// hangUpStore is a store whose Unbind and AssignDevice commit and then,
// should the request's context end meanwhile, answer its error: as
// PostgreSQL's do when a client hangs up during the COMMIT. entered gets
// a value once the change is on disk.
type hangUpStore struct {
	*store.DB
	entered chan struct{}
	armed   atomic.Bool // while hangUp's request is on
}

// answer is what the store answers once the change is on disk: while
// armed, its error should ctx end within 2 s, else err.
func (s *hangUpStore) answer(ctx context.Context, err error) error {
	if !s.armed.Load() {
		return err
	}
	s.entered <- struct{}{}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(2 * time.Second):
	}
	return err
}

func (s *hangUpStore) Unbind(ctx context.Context, deviceID, userID string) (companion.Unbound, error) {
	u, err := s.DB.Unbind(context.WithoutCancel(ctx), deviceID, userID)
	return u, s.answer(ctx, err)
}

func (s *hangUpStore) AssignDevice(ctx context.Context, deviceID, bridgeID, ownerID string) (string, error) {
	prev, err := s.DB.AssignDevice(context.WithoutCancel(ctx), deviceID, bridgeID, ownerID)
	return prev, s.answer(ctx, err)
}

func (s *hangUpStore) Bind(ctx context.Context, b companion.Binding) (companion.Binding, bool, error) {
	got, created, err := s.DB.Bind(context.WithoutCancel(ctx), b)
	return got, created, s.answer(ctx, err)
}

func (s *hangUpStore) CreateBridge(ctx context.Context, b companion.Bridge) error {
	return s.answer(ctx, s.DB.CreateBridge(context.WithoutCancel(ctx), b))
}

func (s *hangUpStore) CreateUser(ctx context.Context, u companion.User) error {
	return s.answer(ctx, s.DB.CreateUser(context.WithoutCancel(ctx), u))
}

// toldAccounts is a recordingAccounts that also records bindings and
// users made.
type toldAccounts struct{ *recordingAccounts }

func (a toldAccounts) Bound(_ context.Context, userID, deviceID string) error {
	return a.add("bound %s", deviceID)
}

func (a toldAccounts) UserCreated(_ context.Context, _, _ string) error {
	return a.add("user created")
}

// A registration, a bridge and a user whose client hung up as the store
// committed them still reach the broker's accounts: else the user's MQTT
// rights lacked the device (the repeat finds it bound, and tells
// nothing), and the bridge and the user had no account on Mosquitto (the
// bridge's repeat is a 409) (docs/reliability.md, bug 280).
func TestACreationWhoseClientHungUpIsFollowedThrough(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	st := &hangUpStore{DB: db, entered: make(chan struct{}, 1)}
	acc := toldAccounts{&recordingAccounts{}}
	e := newEnvWith(t, db, st, func(o *Options) { o.BrokerAccounts = acc })
	tok := e.user("hana")
	e.provision("dev-1", "code-1", "sim-1")
	told := func(what string) {
		t.Helper()
		testenv.Eventually(t, 10*time.Second, "the broker's accounts told: "+what, func() bool {
			return slices.Contains(acc.took(), what)
		})
	}

	hangUp(t, e, st, "POST", "/api/v1/devices/register", tok, strings.NewReader(`{"device_id": "dev-1", "claim_code": "code-1"}`))
	told("bound dev-1")
	hangUp(t, e, st, "POST", "/api/v1/bridges", tok, strings.NewReader(`{"bridge_id": "hana-hub"}`))
	told("created hana-hub")
	hangUp(t, e, st, "POST", "/api/v1/admin/users", testAdminToken, strings.NewReader(`{"name": "ines"}`))
	told("user created")
}

// hangUp sends a request and hangs up once the store has the change.
func hangUp(t *testing.T, e *env, st *hangUpStore, method, path, token string, body io.Reader) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, method, e.srv.URL+path, body)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	st.armed.Store(true)
	defer st.armed.Store(false)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-st.entered
	cancel()
	<-done
}

// An unbinding whose client hung up as the store committed it still ends
// its commands in the broker (Ended): else they stayed in the outbox and
// on the bridge, and ran on the device, though they read canceled. And a
// move of a device so hung up on still moves its commands and rights
// (DeviceMoved) (docs/reliability.md, bug 277).
func TestAChangeWhoseClientHungUpIsFollowedThrough(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	st := &hangUpStore{DB: db, entered: make(chan struct{}, 1)}
	e := newEnvWith(t, db, st)
	tok := e.bound("dev-1")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "ended by the unbinding"})
	require.Equal(t, http.StatusAccepted, r.status, "%s", r.body)
	id, _ := r.json(t)["id"].(string)
	require.NoError(t, db.CreateBridge(context.Background(), companion.Bridge{ID: "bridge-1", SecretHash: []byte("x")}))

	hangUp(t, e, st, "PUT", "/api/v1/admin/devices/dev-1/bridge", testAdminToken, strings.NewReader(`{"bridge_id": "bridge-1"}`))
	testenv.Eventually(t, 10*time.Second, "the broker told of the move", func() bool {
		return slices.Contains(e.cmds.movedIDs(), "dev-1")
	})
	hangUp(t, e, st, "DELETE", "/api/v1/devices/dev-1", tok, nil)
	testenv.Eventually(t, 10*time.Second, "the broker told of the ended command", func() bool {
		return slices.Contains(e.cmds.endedIDs(), id)
	})
}
