package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/openapitest"
	"github.com/devicecompanion/companion/store"
)

const testAdminToken = "admin-secret-for-tests"

// fakeCommander stands in for the broker: it stores commands through the
// real store, records what it was given, and lets a test move commands on.
type fakeCommander struct {
	db *store.DB

	mu        sync.Mutex
	submitted []companion.Command
	queueFull bool
	onSubmit  func(companion.Command) // called after each new command, when set
	changed   chan struct{}           // closed and replaced on every change
	waiting   int                     // calls of Wait not yet returned
	ended     []string                // the ids Ended was told of
	moved     []string                // the devices DeviceMoved was told of
	deleted   []string                // the bridges BridgeDeleted was told of
}

func newFakeCommander(db *store.DB) *fakeCommander {
	return &fakeCommander{db: db, changed: make(chan struct{})}
}

func (f *fakeCommander) Submit(ctx context.Context, c companion.Command, idem *companion.Idempotency) (companion.Command, bool, error) {
	f.mu.Lock()
	full := f.queueFull
	f.mu.Unlock()
	if full {
		return companion.Command{}, false, companion.ErrQueueFull
	}
	cmd, replayed, err := f.db.CreateCommand(ctx, c, 1000, idem)
	if err != nil {
		return companion.Command{}, false, err
	}
	if !replayed {
		f.mu.Lock()
		f.submitted = append(f.submitted, cmd)
		hook := f.onSubmit
		f.mu.Unlock()
		if hook != nil {
			hook(cmd)
		}
	}
	return cmd, replayed, nil
}

func (f *fakeCommander) PrepareMove(...string) func() { return func() {} }

func (f *fakeCommander) DeviceMoved(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.moved = append(f.moved, id)
}

// movedIDs returns the devices DeviceMoved was told of, in order.
func (f *fakeCommander) movedIDs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.moved)
}
func (f *fakeCommander) BridgesDisconnecting(...string)            {}
func (f *fakeCommander) BridgesDisconnectingWithoutWill(...string) {}

func (f *fakeCommander) BridgeDeleted(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, id)
}

// deletedBridges returns the bridges BridgeDeleted was told of, in order.
func (f *fakeCommander) deletedBridges() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.deleted)
}

func (f *fakeCommander) Ended(cmds []companion.Command) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range cmds {
		f.ended = append(f.ended, c.ID)
	}
}

// endedIDs returns the ids Ended was told of, in order.
func (f *fakeCommander) endedIDs() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ended)
}

func (f *fakeCommander) Cancel(ctx context.Context, id string) (companion.Command, error) {
	cmd, err := f.db.UpdateCommand(ctx, id, func(c *companion.Command) error {
		if companion.Rank(c.State) >= companion.Rank(companion.StateDelivered) {
			return broker.ErrNotCancelable
		}
		c.State = companion.StateCanceled
		return nil
	})
	f.notify()
	return cmd, err
}

func (f *fakeCommander) Wait(ctx context.Context, id string) (companion.Command, error) {
	f.mu.Lock()
	f.waiting++
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.waiting--
		f.mu.Unlock()
	}()
	for {
		f.mu.Lock()
		ch := f.changed
		f.mu.Unlock()
		cmd, err := f.db.Command(ctx, id)
		if err != nil || companion.IsFinal(cmd.State) {
			return cmd, err
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return cmd, nil
		}
	}
}

// set moves a command to state, as replies from a bridge would. It may be
// called from any goroutine.
func (f *fakeCommander) set(t testing.TB, id, state string) {
	t.Helper()
	_, err := f.db.UpdateCommand(context.Background(), id, func(c *companion.Command) error {
		c.State = state
		return nil
	})
	assert.NoError(t, err)
	f.notify()
}

func (f *fakeCommander) notify() {
	f.mu.Lock()
	close(f.changed)
	f.changed = make(chan struct{})
	f.mu.Unlock()
}

// waiters is how many calls of Wait have not returned.
func (f *fakeCommander) waiters() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.waiting
}

func (f *fakeCommander) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.submitted)
}

func (f *fakeCommander) last(t testing.TB) companion.Command {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	require.NotEmpty(t, f.submitted, "no command was submitted")
	return f.submitted[len(f.submitted)-1]
}

// env is a running API on a real HTTP server over a real store.
type env struct {
	t    testing.TB
	db   *store.DB
	cmds *fakeCommander
	srv  *httptest.Server
	api  *Server
}

type envOption func(*Options)

func newEnv(t testing.TB, opts ...envOption) *env {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return newEnvWith(t, db, db, opts...)
}

// newEnvWith serves st (which may wrap db to inject failures).
func newEnvWith(t testing.TB, db *store.DB, st Store, opts ...envOption) *env {
	t.Helper()
	cmds := newFakeCommander(db)
	o := Options{
		Store:      st,
		Commands:   cmds,
		AdminToken: testAdminToken,
		Limits:     Limits{RequestsPerSecond: -1, RegisterPerMinute: 1000, UnauthPerMinute: -1},
		Logger:     slog.New(slog.DiscardHandler),
	}
	for _, opt := range opts {
		opt(&o)
	}
	s, err := New(o)
	require.NoError(t, err)
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	return &env{t: t, db: db, cmds: cmds, srv: srv, api: s}
}

// resp is an answer, read whole.
type resp struct {
	status int
	header http.Header
	body   []byte
}

func (r resp) json(t testing.TB) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(r.body, &m), "body: %s", r.body)
	return m
}

// problem decodes a problem+json answer and checks its shape.
func (r resp) problem(t testing.TB) problem {
	t.Helper()
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"), "body: %s", r.body)
	var raw map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(r.body, &raw))
	for _, k := range []string{"type", "title", "status", "detail", "code", "errors"} {
		require.Contains(t, raw, k, "problem member %q missing: %s", k, r.body)
	}
	var p problem
	require.NoError(t, json.Unmarshal(r.body, &p))
	require.Equal(t, r.status, p.Status)
	require.NotNil(t, p.Errors)
	return p
}

// fields is the set of field names a problem names.
func (p problem) fields() []string {
	var out []string
	for _, f := range p.Errors {
		out = append(out, f.Field)
	}
	return out
}

// req is one request to send.
type req struct {
	method, path, token string
	body                any // []byte and string go as they are; anything else as JSON
	header              map[string]string
	// headers sets each header to all its values (a header sent twice),
	// after header.
	headers map[string][]string
}

// send makes the request and reads the answer, and checks both against
// api/openapi.json (see openapitest.Contract.Check): a disagreement fails
// the test.
func (e *env) send(r req) resp {
	e.t.Helper()
	var raw []byte
	switch b := r.body.(type) {
	case nil:
	case []byte:
		raw = b
	case string:
		raw = []byte(b)
	default:
		j, err := json.Marshal(b)
		require.NoError(e.t, err)
		raw = j
	}
	var body io.Reader
	ctype := ""
	if r.body != nil {
		body, ctype = bytes.NewReader(raw), "application/json"
	}
	hr, err := http.NewRequest(r.method, e.srv.URL+r.path, body)
	require.NoError(e.t, err)
	if ctype != "" {
		hr.Header.Set("Content-Type", ctype)
	}
	if r.token != "" {
		hr.Header.Set("Authorization", "Bearer "+r.token)
	}
	for k, v := range r.header {
		if v == "" {
			hr.Header.Del(k)
		} else {
			hr.Header.Set(k, v)
		}
	}
	for k, vs := range r.headers {
		hr.Header.Del(k)
		for _, v := range vs {
			hr.Header.Add(k, v)
		}
	}
	res, err := e.srv.Client().Do(hr)
	require.NoError(e.t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(e.t, err)
	mustContract(e.t).Check(e.t, hr, raw, openapitest.Answer{Status: res.StatusCode, Header: res.Header, Body: b})
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

func (e *env) do(method, path, token string, body any) resp {
	e.t.Helper()
	return e.send(req{method: method, path: path, token: token, body: body})
}

// user creates a user through the admin API and returns its token.
func (e *env) user(name string) string {
	e.t.Helper()
	r := e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": name})
	require.Equal(e.t, http.StatusCreated, r.status, "%s", r.body)
	tok, _ := r.json(e.t)["token"].(string)
	require.True(e.t, strings.HasPrefix(tok, userTokenPrefix))
	return tok
}

func (e *env) provision(id, code, model string) {
	e.t.Helper()
	r := e.do("POST", "/api/v1/admin/devices", testAdminToken, map[string]any{"device_id": id, "claim_code": code, "model": model})
	require.Equal(e.t, http.StatusCreated, r.status, "%s", r.body)
}

// bound provisions a device and binds it to a new user, whose token it
// returns.
func (e *env) bound(id string) string {
	e.t.Helper()
	tok := e.user("owner of " + id)
	e.provision(id, "code-"+id, "sim-1")
	r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": "code-" + id})
	require.Equal(e.t, http.StatusCreated, r.status, "%s", r.body)
	return tok
}

// serve makes bridge-1 (created if need be) serve the device: the store
// takes a status naming a bridge only from the bridge that serves its
// device (docs/reliability.md, bug 271).
func (e *env) serve(id string) {
	e.t.Helper()
	ctx := context.Background()
	if bridge, err := e.db.DeviceBridge(ctx, id); err == nil && bridge == "bridge-1" {
		return
	}
	if err := e.db.CreateBridge(ctx, companion.Bridge{ID: "bridge-1", SecretHash: []byte("x")}); !errors.Is(err, companion.ErrExists) {
		require.NoError(e.t, err)
	}
	_, err := e.db.AssignDevice(ctx, id, "bridge-1", "")
	require.NoError(e.t, err)
}

// report stores a status for the device as a bridge would, bridge-1
// serving it.
func (e *env) report(id, firmware string, apps ...companion.App) {
	e.t.Helper()
	e.serve(id)
	battery := 80
	_, err := e.db.PutStatus(context.Background(), companion.Status{
		DeviceID: id, Online: true, Battery: &battery, FirmwareVersion: firmware, Model: "sim-1",
		Apps: apps, BridgeID: "bridge-1", LastSeen: time.Now(), Seq: uint64(time.Now().UnixNano()),
	})
	require.NoError(e.t, err)
}

// simSchema is the settings schema of CONTRACT §4.
const simSchema = `{
	"brightness": {"type": "int", "min": 0, "max": 100, "default": 50},
	"volume": {"type": "int", "min": 0, "max": 100, "default": 50},
	"do_not_disturb": {"type": "bool", "default": false},
	"timezone": {"type": "timezone", "default": "UTC"},
	"language": {"type": "enum", "values": ["en","de","fr","es","zh","ja"], "default": "en"},
	"display_timeout_s": {"type": "int", "min": 5, "max": 600, "default": 30}
}`

func (e *env) reportSettings(id string) {
	e.t.Helper()
	reported := map[string]json.RawMessage{
		"brightness": json.RawMessage("50"), "volume": json.RawMessage("50"), "do_not_disturb": json.RawMessage("false"),
		"timezone": json.RawMessage(`"UTC"`), "language": json.RawMessage(`"en"`), "display_timeout_s": json.RawMessage("30"),
	}
	_, err := e.db.PutReportedSettings(context.Background(), id, "", reported, json.RawMessage(simSchema), time.Now(), uint64(time.Now().UnixNano()))
	require.NoError(e.t, err)
}

// failingStore fails (or panics in) the calls a test picks.
type failingStore struct {
	*store.DB
	failStatus  bool
	panicStatus bool
}

var errDisk = errors.New("/var/lib/companion/db: input/output error at bucket status")

func (f *failingStore) Status(ctx context.Context, id string) (companion.Status, error) {
	if f.panicStatus {
		panic("status exploded: /secret/path")
	}
	if f.failStatus {
		return companion.Status{}, errDisk
	}
	return f.DB.Status(ctx, id)
}
