package api

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

// heldUsers is a store whose CreateUser waits for release (or fails with
// fail, when set), and which tells waiting each time a request finds an
// Idempotency-Key claimed by a request still at work.
type heldUsers struct {
	*store.DB
	entered chan struct{}
	release chan struct{}
	waiting chan struct{}
	fail    atomic.Bool
}

func (s *heldUsers) CreateUser(ctx context.Context, u companion.User) error {
	if s.fail.Load() {
		return errors.New("disk on fire")
	}
	s.entered <- struct{}{}
	<-s.release
	return s.DB.CreateUser(ctx, u)
}

func (s *heldUsers) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	rec, err := s.DB.Idempotency(ctx, userID, key)
	if err == nil && rec.Status == 0 {
		select {
		case s.waiting <- struct{}{}:
		default:
		}
	}
	return rec, err
}

// A client that hangs up while its handler waits on its request's context
// (here the wait for an Idempotency-Key claimed by a request at work) is
// counted as nginx counts it, 499, not as a 5xx: the CompanionHTTP5xx
// alert of docs/operations.md is for the server's faults. A real fault is
// still a 500 (docs/reliability.md, bug 359).
func TestClientGoneIsNotCountedAs5xx(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	st := &heldUsers{DB: db, entered: make(chan struct{}, 1), release: make(chan struct{}), waiting: make(chan struct{}, 1)}
	seen := make(answers, 16)
	e := newEnvWith(t, db, st, func(o *Options) { o.Requests = seen })
	const route = "/api/v1/admin/users"
	keyed := func(ctx context.Context) (*http.Response, error) {
		hr, err := http.NewRequestWithContext(ctx, "POST", e.srv.URL+route, strings.NewReader(`{"name": "gina"}`))
		require.NoError(t, err)
		hr.Header.Set("Authorization", "Bearer "+testAdminToken)
		hr.Header.Set("Content-Type", "application/json")
		hr.Header.Set("Idempotency-Key", "k-1")
		return http.DefaultClient.Do(hr)
	}

	first := make(chan int, 1)
	go func() {
		r, err := keyed(context.Background())
		if err != nil {
			first <- 0
			return
		}
		r.Body.Close()
		first <- r.StatusCode
	}()
	<-st.entered // the first is at work, its key claimed

	ctx, cancel := context.WithCancel(context.Background())
	gone := make(chan error, 1)
	go func() {
		r, err := keyed(ctx)
		if err == nil {
			r.Body.Close()
		}
		gone <- err
	}()
	select {
	case <-st.waiting:
	case <-time.After(10 * time.Second):
		t.Fatal("the repeat never found the key claimed")
	}
	cancel()
	require.Error(t, <-gone)
	assert.Equal(t, 499, seen.wait(t, 10*time.Second, "POST", route), "a client that hung up is counted as")

	close(st.release)
	require.Equal(t, http.StatusCreated, <-first)
	require.Equal(t, http.StatusCreated, seen.wait(t, 10*time.Second, "POST", route))

	st.fail.Store(true)
	r := e.do("POST", route, testAdminToken, map[string]any{"name": "hal"})
	require.Equal(t, http.StatusInternalServerError, r.status)
	assert.Equal(t, http.StatusInternalServerError, seen.wait(t, 10*time.Second, "POST", route), "a fault of the store is counted as")
}
