package api

import (
	"context"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hungUpKeys is a store whose next claim of an Idempotency-Key (armed
// "claim") or next CreateUser (armed "create") commits and then, should
// the request's context end within a second, answers its error: as
// PostgreSQL's do when a client hangs up during the COMMIT. entered gets
// a value once the write is on disk.
type hungUpKeys struct {
	*store.DB
	armed   atomic.Value // "claim", "create" or ""
	entered chan struct{}
	creates atomic.Int32
}

func (s *hungUpKeys) take(what string) bool {
	return s.armed.CompareAndSwap(what, "")
}

func (s *hungUpKeys) answer(ctx context.Context, err error) error {
	s.entered <- struct{}{}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Second):
	}
	return err
}

func (s *hungUpKeys) PutIdempotency(ctx context.Context, rec companion.Idempotency) error {
	if rec.Status == 0 && s.take("claim") {
		return s.answer(ctx, s.DB.PutIdempotency(context.WithoutCancel(ctx), rec))
	}
	return s.DB.PutIdempotency(ctx, rec)
}

func (s *hungUpKeys) CreateUser(ctx context.Context, u companion.User) error {
	s.creates.Add(1)
	if s.take("create") {
		return s.answer(ctx, s.DB.CreateUser(context.WithoutCancel(ctx), u))
	}
	return s.DB.CreateUser(ctx, u)
}

// A keyed request whose client hung up as the store committed (its claim
// of the key, or its work) is answered to its repeat as any keyed request
// whose answer was lost on its way: with the first answer, creating
// nothing (CONTRACT §2). It must neither do the work again (a second user,
// here) nor hold its key, answering the repeat 409 idempotency_key_in_use
// for the minute a claim lasts.
func TestKeyedRequestWhoseClientHungUp(t *testing.T) {
	for _, at := range []string{"claim", "create"} {
		t.Run(at, func(t *testing.T) {
			shortWait(t, 3*time.Second)
			db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
			require.NoError(t, err)
			t.Cleanup(func() { db.Close() })
			st := &hungUpKeys{DB: db, entered: make(chan struct{}, 1)}
			st.armed.Store(at)
			e := newEnvWith(t, db, st)
			body := `{"name": "gina"}`

			ctx, cancel := context.WithCancel(context.Background())
			hr, err := http.NewRequestWithContext(ctx, "POST", e.srv.URL+"/api/v1/admin/users", strings.NewReader(body))
			require.NoError(t, err)
			hr.Header.Set("Authorization", "Bearer "+testAdminToken)
			hr.Header.Set("Content-Type", "application/json")
			hr.Header.Set("Idempotency-Key", "u-1")
			done := make(chan struct{})
			go func() {
				defer close(done)
				if res, err := http.DefaultClient.Do(hr); err == nil {
					res.Body.Close()
				}
			}()
			waitFor(t, st.entered, "the store has the "+at)
			cancel()
			<-done

			r := e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken, body: body,
				header: map[string]string{"Idempotency-Key": "u-1"}})
			require.Equal(t, 201, r.status, "the repeat: %s", r.body)
			assert.NotContains(t, r.json(t), "token", "the repeat is the first answer, as stored")
			assert.EqualValues(t, 1, st.creates.Load(), "users created")
		})
	}
}
