package api

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type slowUsers struct{ Store }

func (s slowUsers) CreateUser(ctx context.Context, u companion.User) error {
	time.Sleep(200 * time.Millisecond)
	return s.Store.CreateUser(ctx, u)
}

// The defect as it was reported: two overlapping requests with one key
// both did the work, and made two users.
func TestIdempotentCreateUserOverlapping(t *testing.T) {
	e0 := newEnv(t)
	e := newEnvWith(t, e0.db, slowUsers{e0.db})
	var wg sync.WaitGroup
	ids := make([]any, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken,
				body: map[string]any{"name": "gina"}, header: map[string]string{"Idempotency-Key": "u-1"}})
			ids[i] = r.json(t)["user_id"]
		}()
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	assert.Equal(t, ids[0], ids[1])
}

// gatedStore holds CreateUser and CreateBridge until the test opens its
// gate, and tells the test when a read finds a key claimed by a request
// still at work.
type gatedStore struct {
	Store
	entered chan struct{} // one send per create that started
	gate    chan struct{} // closed by open: creates go on
	opened  sync.Once
	claimed chan struct{} // one send (when there is room) per read of a claim
	fails   atomic.Int32  // so many creates fail before they start
	creates atomic.Int32  // creates that got through
}

func newGatedStore(t *testing.T, s Store) *gatedStore {
	g := &gatedStore{Store: s, entered: make(chan struct{}, 64), gate: make(chan struct{}), claimed: make(chan struct{}, 1)}
	t.Cleanup(g.open) // a failed test must not leave requests held
	return g
}

func (g *gatedStore) open() { g.opened.Do(func() { close(g.gate) }) }

func (g *gatedStore) hold() error {
	if g.fails.Add(-1) >= 0 {
		return errDisk
	}
	g.entered <- struct{}{}
	select {
	case <-g.gate:
	case <-time.After(10 * time.Second):
		return errors.New("held too long: the test never opened the gate")
	}
	g.creates.Add(1)
	return nil
}

func (g *gatedStore) CreateUser(ctx context.Context, u companion.User) error {
	if err := g.hold(); err != nil {
		return err
	}
	return g.Store.CreateUser(ctx, u)
}

func (g *gatedStore) CreateBridge(ctx context.Context, b companion.Bridge) error {
	if err := g.hold(); err != nil {
		return err
	}
	return g.Store.CreateBridge(ctx, b)
}

func (g *gatedStore) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	rec, err := g.Store.Idempotency(ctx, userID, key)
	if err == nil && rec.Status == 0 {
		select {
		case g.claimed <- struct{}{}:
		default:
		}
	}
	return rec, err
}

// waitFor fails the test unless ch delivers within a few seconds.
func waitFor(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatalf("timed out waiting until %s", what)
	}
}

// shortWait makes a request wait at most d for another with its key.
func shortWait(t *testing.T, d time.Duration) {
	old := idempotencyWait
	idempotencyWait = d
	t.Cleanup(func() { idempotencyWait = old })
}

// A repeat that comes while the first request with its key is still at
// work waits for that answer and creates nothing (CONTRACT §2).
func TestIdempotentOverlapAnswersOnce(t *testing.T) {
	for _, tc := range []struct {
		name, path, token, secret string
		body                      map[string]any
		id                        string // the member naming what was made
	}{
		{"admin user", "/api/v1/admin/users", testAdminToken, "token", map[string]any{"name": "gina"}, "user_id"},
		{"admin bridge", "/api/v1/admin/bridges", testAdminToken, "secret", map[string]any{"bridge_id": "hub-1"}, "bridge_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e0 := newEnv(t)
			g := newGatedStore(t, e0.db)
			e := newEnvWith(t, e0.db, g)
			send := func() resp {
				return e.send(req{method: "POST", path: tc.path, token: tc.token, body: tc.body, header: map[string]string{"Idempotency-Key": "k-1"}})
			}
			answers := make(chan resp, 2)
			go func() { answers <- send() }()
			waitFor(t, g.entered, "the first request is at work")
			go func() { answers <- send() }()
			waitFor(t, g.claimed, "the repeat finds the key claimed")
			g.open()
			a, b := <-answers, <-answers
			require.Equal(t, 201, a.status, "%s", a.body)
			require.Equal(t, 201, b.status, "%s", b.body)
			first, repeat := a.json(t), b.json(t)
			if _, ok := first[tc.secret]; !ok {
				first, repeat = repeat, first
			}
			assert.NotEmpty(t, first[tc.secret], "the first answer carries the secret")
			assert.NotContains(t, repeat, tc.secret, "the repeat is the first answer as stored, without the secret")
			assert.Equal(t, first[tc.id], repeat[tc.id])
			assert.EqualValues(t, 1, g.creates.Load(), "creates")
		})
	}
}

// A repeat that has waited idempotencyWait for the first request answers
// 409 idempotency_key_in_use; once the first has answered, a repeat gets
// that answer.
func TestIdempotencyKeyInUse(t *testing.T) {
	shortWait(t, 50*time.Millisecond)
	e0 := newEnv(t)
	g := newGatedStore(t, e0.db)
	e := newEnvWith(t, e0.db, g)
	send := func() resp {
		return e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken,
			body: map[string]any{"name": "gina"}, header: map[string]string{"Idempotency-Key": "u-1"}})
	}
	first := make(chan resp, 1)
	go func() { first <- send() }()
	waitFor(t, g.entered, "the first request is at work")

	r := send()
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, CodeIdempotencyKeyInUse, r.problem(t).Code)

	g.open()
	a := <-first
	require.Equal(t, 201, a.status, "%s", a.body)
	r = send()
	require.Equal(t, 201, r.status, "%s", r.body)
	assert.Equal(t, a.json(t)["user_id"], r.json(t)["user_id"])
	assert.EqualValues(t, 1, g.creates.Load(), "creates")
}

// A request that fails records no answer and gives its key up: a repeat
// does the work again at once, rather than wait for an answer that never
// comes and answer 409.
func TestIdempotentFailureFreesTheKey(t *testing.T) {
	e0 := newEnv(t)
	g := newGatedStore(t, e0.db)
	g.open()
	e := newEnvWith(t, e0.db, g)
	require.Equal(t, 201, e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "hub-1"}).status)
	shortWait(t, time.Second)
	send := func(key, path string, body map[string]any) resp {
		return e.send(req{method: "POST", path: path, token: testAdminToken, body: body, header: map[string]string{"Idempotency-Key": key}})
	}

	g.fails.Store(1)
	r := send("k-500", "/api/v1/admin/users", map[string]any{"name": "gina"})
	require.Equal(t, 500, r.status, "%s", r.body)
	r = send("k-500", "/api/v1/admin/users", map[string]any{"name": "gina"})
	assert.Equal(t, 201, r.status, "after a 500: %s", r.body)
	for i := range 2 {
		r = send("k-422", "/api/v1/admin/bridges", map[string]any{"bridge_id": "bad id"})
		assert.Equal(t, 422, r.status, "invalid, %d: %s", i, r.body)
		r = send("k-409", "/api/v1/admin/bridges", map[string]any{"bridge_id": "hub-1"})
		require.Equal(t, 409, r.status, "taken, %d: %s", i, r.body)
		assert.Equal(t, CodeBridgeExists, r.problem(t).Code)
	}
}

// panicOnce panics in its first CreateUser, as a bug would.
type panicOnce struct {
	Store
	panicked atomic.Bool
}

func (p *panicOnce) CreateUser(ctx context.Context, u companion.User) error {
	if p.panicked.CompareAndSwap(false, true) {
		panic("create user exploded")
	}
	return p.Store.CreateUser(ctx, u)
}

// A request that panics is answered 500 as any failure is, and gives its
// Idempotency-Key up as any failure does: a repeat does the work again,
// rather than wait for an answer that never comes and answer 409
// idempotency_key_in_use until the claim runs out a minute later.
func TestPanicGivesUpTheIdempotencyKey(t *testing.T) {
	shortWait(t, 200*time.Millisecond)
	e0 := newEnv(t)
	e := newEnvWith(t, e0.db, &panicOnce{Store: e0.db})
	send := func() resp {
		return e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken,
			body: map[string]any{"name": "gina"}, header: map[string]string{"Idempotency-Key": "u-1"}})
	}
	r := send()
	require.Equal(t, 500, r.status, "%s", r.body)
	assert.Equal(t, CodeInternal, r.problem(t).Code)
	r = send()
	require.Equal(t, 201, r.status, "the repeat does the work: %s", r.body)
	assert.NotEmpty(t, r.json(t)["token"], "it is the first answer with a token")
}

// clock is a settable clock for a store.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

// forgetKeys reads no idempotency record: the API's read of a key comes
// before the record is there, and only the store's own check, in the
// write that would store the command, finds it.
type forgetKeys struct{ *store.DB }

func (forgetKeys) Idempotency(context.Context, string, string) (companion.Idempotency, error) {
	return companion.Idempotency{}, companion.ErrNotFound
}

// A repeat of a command request whose Idempotency-Key record still
// answers (its 24 h have not quite run out by the answering server's
// clock) but whose command has been purged (--retention 24h, the minimum,
// by a dispatcher whose clock runs two seconds ahead) cannot be given its
// first answer. It is a 404 command_not_found that says so, never a 500,
// and it creates nothing; once the record has run out, the same request
// is a new one (CONTRACT §2: a repeat within 24 h).
func TestReplayOfAPurgedCommand(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store func(*store.DB) Store
	}{
		{"record read by the API", func(db *store.DB) Store { return db }},
		{"record found as the command is stored", func(db *store.DB) Store { return forgetKeys{db} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now().UTC().Truncate(time.Second)
			clk := &clock{now: start}
			db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler), Now: clk.Now})
			require.NoError(t, err)
			t.Cleanup(func() { db.Close() })
			e := newEnvWith(t, db, tc.store(db), func(o *Options) { o.Now = clk.Now })
			tok := e.bound("dev-1")
			push := func() resp {
				return e.send(req{method: "POST", path: "/api/v1/devices/dev-1/push/text", token: tok,
					body: map[string]any{"text": "hi"}, header: map[string]string{"Idempotency-Key": "k-1"}})
			}
			r := push()
			require.Equal(t, 202, r.status, "%s", r.body)
			e.cmds.set(t, r.json(t)["id"].(string), companion.StateSucceeded)

			clk.Set(start.Add(24*time.Hour - time.Second))
			ahead := clk.Now().Add(2 * time.Second)
			n, err := db.PurgeCommands(context.Background(), ahead.Add(-24*time.Hour))
			require.NoError(t, err)
			require.Equal(t, 1, n, "the command was purged")

			r = push()
			require.Equal(t, 404, r.status, "%s", r.body)
			assert.Equal(t, CodeCommandNotFound, r.problem(t).Code)
			assert.Equal(t, 1, e.cmds.count(), "the repeat created nothing")

			clk.Set(start.Add(24*time.Hour + time.Second))
			r = push()
			require.Equal(t, 202, r.status, "after 24 h the key is free: %s", r.body)
			assert.Equal(t, 2, e.cmds.count())
		})
	}
}

// A repeat of a register answered from its Idempotency-Key's record is the
// first answer (CONTRACT §2), and no register attempt: it tries no claim
// code. A phone whose answer was lost, retrying, must not spend the
// user's attempts and read 429 rate_limited instead of its device; nor
// may a repeat that waits for the first request. A new request with
// another key is still an attempt, and still limited.
func TestRegisterRepeatIsNoAttempt(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.RegisterPerMinute = 2 })
	tok := e.user("carol")
	e.provision("dev-c", "cc", "sim-1")
	register := func(key, device string) resp {
		return e.send(req{method: "POST", path: "/api/v1/devices/register", token: tok,
			body: map[string]any{"device_id": device, "claim_code": "cc"}, header: map[string]string{"Idempotency-Key": key}})
	}
	first := register("r-1", "dev-c")
	require.Equal(t, 201, first.status, "%s", first.body)
	for i := range 3 {
		r := register("r-1", "dev-c")
		require.Equal(t, 201, r.status, "repeat %d: %s", i, r.body)
		assert.Equal(t, first.body, r.body, "repeat %d", i)
		assert.Equal(t, first.header.Get("Location"), r.header.Get("Location"), "repeat %d", i)
	}
	r := register("r-2", "nope")
	require.Equal(t, 422, r.status, "the second attempt: %s", r.body)
	r = register("r-3", "nope")
	require.Equal(t, 429, r.status, "the third attempt: %s", r.body)
	assert.Equal(t, CodeRateLimited, r.problem(t).Code)
	r = register("r-3", "nope")
	require.Equal(t, 429, r.status, "refused, it recorded nothing: %s", r.body)
	r = register("r-1", "dev-c")
	require.Equal(t, 201, r.status, "a repeat, with the attempts spent: %s", r.body)
	assert.Equal(t, first.body, r.body)
}

// stallUsers holds the CreateUser calls of a test: the first waits for
// failFirst and fails, the second waits for releaseSecond, the others go
// through. Each says it entered on entered.
type stallUsers struct {
	Store
	calls                    atomic.Int32
	entered                  chan int32
	failFirst, releaseSecond chan struct{}
}

func (s *stallUsers) CreateUser(ctx context.Context, u companion.User) error {
	n := s.calls.Add(1)
	s.entered <- n
	switch n {
	case 1:
		<-s.failFirst
		return errors.New("disk on fire")
	case 2:
		<-s.releaseSecond
	}
	return s.Store.CreateUser(ctx, u)
}

// A request that stalled past its claim's minute, while a repeat claimed
// the key anew, and then failed gives up its own claim only: it gave up
// the repeat's, and a third repeat did the work while the second was at
// it (docs/reliability.md, bug 311).
func TestAStalledRequestGivesUpItsOwnClaimOnly(t *testing.T) {
	shortWait(t, 200*time.Millisecond)
	start := time.Now().UTC().Truncate(time.Second)
	clk := &clock{now: start}
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler), Now: clk.Now})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	st := &stallUsers{Store: db, entered: make(chan int32, 8), failFirst: make(chan struct{}), releaseSecond: make(chan struct{})}
	e := newEnvWith(t, db, st, func(o *Options) { o.Now = clk.Now })
	send := func() resp {
		return e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken,
			body: map[string]any{"name": "gina"}, header: map[string]string{"Idempotency-Key": "u-1"}})
	}
	entered := func(want int32) {
		t.Helper()
		select {
		case n := <-st.entered:
			require.Equal(t, want, n)
		case <-time.After(10 * time.Second):
			t.Fatalf("CreateUser %d not entered", want)
		}
	}
	first, second := make(chan resp, 1), make(chan resp, 1)
	go func() { first <- send() }()
	entered(1)
	clk.Set(start.Add(2 * time.Minute)) // the first request's claim runs out
	go func() { second <- send() }()
	entered(2)
	close(st.failFirst)
	r := <-first
	require.Equal(t, 500, r.status, "the stalled request fails: %s", r.body)

	r = send()
	assert.Equal(t, 409, r.status, "a third repeat while the second is at work: %s", r.body)
	close(st.releaseSecond)
	r = <-second
	assert.Equal(t, 201, r.status, "the second: %s", r.body)
	assert.Equal(t, int32(2), st.calls.Load(), "CreateUser calls: the stalled request's and the second's")
}
