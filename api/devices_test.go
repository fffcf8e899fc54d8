package api

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
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
}

// answer is what the store answers once the change is on disk: its error
// should ctx end within 2 s, else err.
func (s *hangUpStore) answer(ctx context.Context, err error) error {
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

// hangUp sends a request and hangs up once the store has the change.
func hangUp(t *testing.T, e *env, st *hangUpStore, method, path, token string, body io.Reader) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, method, e.srv.URL+path, body)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
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
