package api

import (
	"context"
	"encoding/base64"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recordingAccounts is a BrokerAccounts that writes down what it is told.
type recordingAccounts struct {
	mu    sync.Mutex
	calls []string
}

func (a *recordingAccounts) add(format string, args ...any) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, fmt.Sprintf(format, args...))
	return nil
}

func (a *recordingAccounts) UserCreated(_ context.Context, userID, _ string) error {
	return nil // user ids are random: not worth recording
}
func (a *recordingAccounts) UserTokenChanged(_ context.Context, userID, _ string) error {
	return a.add("new token %s", userID)
}
func (a *recordingAccounts) BridgeCreated(_ context.Context, bridgeID, _ string) error {
	return a.add("created %s", bridgeID)
}
func (a *recordingAccounts) BridgeDeleted(_ context.Context, bridgeID string) error {
	return a.add("deleted %s", bridgeID)
}
func (a *recordingAccounts) BridgeSecretChanged(_ context.Context, bridgeID, _ string) error {
	return a.add("new secret %s", bridgeID)
}
func (a *recordingAccounts) Bound(context.Context, string, string) error   { return nil }
func (a *recordingAccounts) Unbound(context.Context, string, string) error { return nil }
func (a *recordingAccounts) Assigned(_ context.Context, deviceID, from, to string) error {
	return a.add("%s: %q → %q", deviceID, from, to)
}

// took returns what the accounts were told since the last call.
func (a *recordingAccounts) took() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := a.calls
	a.calls = nil
	return out
}

// bridgesEnv is an API with the operator's bridge op-1, the users alice
// and bob with one device each (dev-a, dev-b), and the accounts recorder.
type bridgesEnv struct {
	*env
	acc        *recordingAccounts
	alice, bob string // tokens
}

func newBridgesEnv(t *testing.T) *bridgesEnv {
	t.Helper()
	acc := &recordingAccounts{}
	e := &bridgesEnv{env: newEnv(t, func(o *Options) { o.BrokerAccounts, o.ServerMQTTUsername = acc, "companion-server" }), acc: acc}
	r := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "op-1"})
	require.Equal(t, 201, r.status, "%s", r.body)
	e.alice, e.bob = e.bound("dev-a"), e.bound("dev-b")
	acc.took()
	return e
}

// The user's bridge routes: creation (validated, 409 for an id any bridge
// has, replayed without the secret), the list in full pages, deletion (404
// for another's, alike an unknown one), and what the broker's accounts are
// told of each.
func TestUserBridges(t *testing.T) {
	e := newBridgesEnv(t)
	path := "/api/v1/bridges"

	runBodyCases(t, e.env, "POST", path, e.alice, []bodyCase{
		{"nothing", map[string]any{}, 422, []string{"bridge_id"}},
		{"empty id", map[string]any{"bridge_id": ""}, 422, []string{"bridge_id"}},
		{"bad id", map[string]any{"bridge_id": "my hub"}, 422, []string{"bridge_id"}},
		{"id 65", map[string]any{"bridge_id": strings.Repeat("h", 65)}, 422, []string{"bridge_id"}},
		{"id a number", `{"bridge_id": 7}`, 400, []string{"bridge_id"}},
		{"not JSON", `{"bridge_id":`, 400, nil},
		{"an array", `["hub"]`, 400, nil},
	})
	r := e.send(req{method: "POST", path: path, token: e.alice, body: `{"bridge_id":"x"}`, header: map[string]string{"Content-Type": "text/plain"}})
	assert.Equal(t, 415, r.status, "%s", r.body)
	assert.Equal(t, 401, e.do("POST", path, "", map[string]any{"bridge_id": "x"}).status)
	assert.Equal(t, 401, e.do("POST", path, testAdminToken, map[string]any{"bridge_id": "x"}).status, "the admin token on a user's route")

	r = e.do("POST", path, e.alice, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 201, r.status, "%s", r.body)
	created := r.json(t)
	assert.Equal(t, "alice-hub", created["bridge_id"])
	assert.True(t, strings.HasPrefix(created["secret"].(string), bridgeSecretPrefix), "%v", created)
	assert.Equal(t, []string{"created alice-hub"}, e.acc.took())
	for _, taken := range []struct{ token, id string }{{e.alice, "alice-hub"}, {e.bob, "alice-hub"}, {e.bob, "op-1"}} {
		r := e.do("POST", path, taken.token, map[string]any{"bridge_id": taken.id})
		require.Equal(t, 409, r.status, "%s", r.body)
		assert.Equal(t, CodeBridgeExists, r.problem(t).Code)
	}
	r = e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "alice-hub"})
	assert.Equal(t, 409, r.status, "the operator takes a user's bridge id: %s", r.body)
	// A bridge logs in to the broker under its id, as a user under theirs
	// and the server under its account's name: none may take another's.
	r = e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "carol"})
	require.Equal(t, 201, r.status, "%s", r.body)
	carol := r.json(t)["user_id"].(string)
	for _, taken := range []struct{ token, id string }{{e.bob, carol}, {testAdminToken, carol}, {e.bob, "companion-server"}, {testAdminToken, "companion-server"}} {
		p := path
		if taken.token == testAdminToken {
			p = "/api/v1/admin/bridges"
		}
		r := e.do("POST", p, taken.token, map[string]any{"bridge_id": taken.id})
		require.Equal(t, 409, r.status, "a bridge named %s: %s", taken.id, r.body)
		assert.Equal(t, CodeBridgeExists, r.problem(t).Code)
	}
	assert.Empty(t, e.acc.took(), "a refused bridge was told to the broker")

	t.Run("idempotent creation", func(t *testing.T) {
		send := func(body any) resp {
			return e.send(req{method: "POST", path: path, token: e.bob, body: body, header: map[string]string{"Idempotency-Key": "b-1"}})
		}
		a := send(map[string]any{"bridge_id": "bob-hub"})
		require.Equal(t, 201, a.status, "%s", a.body)
		assert.NotEmpty(t, a.json(t)["secret"])
		b := send(map[string]any{"bridge_id": "bob-hub"})
		require.Equal(t, 201, b.status, "the first answer again: %s", b.body)
		assert.Equal(t, map[string]any{"bridge_id": "bob-hub"}, b.json(t), "the secret exists only in the first answer")
		r := send(map[string]any{"bridge_id": "bob-hub-2"})
		require.Equal(t, 422, r.status, "%s", r.body)
		assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)
		assert.Equal(t, []string{"created bob-hub"}, e.acc.took())
	})

	t.Run("list in full pages", func(t *testing.T) {
		for _, id := range []string{"alice-a", "alice-b", "alice-c"} {
			require.Equal(t, 201, e.do("POST", path, e.alice, map[string]any{"bridge_id": id}).status)
		}
		e.acc.took()
		r := e.do("PUT", "/api/v1/devices/dev-a/bridge", e.alice, map[string]any{"bridge_id": "alice-b"})
		require.Equal(t, 200, r.status, "%s", r.body)
		assert.Equal(t, []string{`dev-a: "" → "alice-b"`}, e.acc.took())
		var got []any
		cursor := ""
		pages := 0
		for {
			p := path + "?limit=2"
			if cursor != "" {
				p += "&cursor=" + cursor
			}
			r := e.do("GET", p, e.alice, nil)
			require.Equal(t, 200, r.status, "%s", r.body)
			page := r.json(t)
			got = append(got, page["bridges"].([]any)...)
			pages++
			if page["next_cursor"] == nil {
				break
			}
			cursor = page["next_cursor"].(string)
		}
		assert.Equal(t, 2, pages, "four bridges in pages of two")
		require.Len(t, got, 4)
		ids := []string{}
		for _, b := range got {
			b := b.(map[string]any)
			ids = append(ids, b["bridge_id"].(string))
			assert.NotNil(t, b["created_at"])
			want := []any{}
			if b["bridge_id"] == "alice-b" {
				want = []any{"dev-a"}
			}
			assert.Equal(t, want, b["devices"], "devices of %s", b["bridge_id"])
			assert.NotContains(t, b, "secret")
		}
		assert.Equal(t, []string{"alice-a", "alice-b", "alice-c", "alice-hub"}, ids)
		r = e.do("GET", path, e.bob, nil)
		require.Equal(t, 200, r.status)
		assert.JSONEq(t, `{"bridges":[{"bridge_id":"bob-hub","devices":[],"created_at":`+jsonString(r.json(t)["bridges"].([]any)[0].(map[string]any)["created_at"])+`}],"next_cursor":null}`, string(r.body))

		for _, q := range []string{"?limit=0", "?limit=201", "?limit=x"} {
			r := e.do("GET", path+q, e.alice, nil)
			assert.Equal(t, 422, r.status, "%s: %s", q, r.body)
			assert.Equal(t, []string{"limit"}, r.problem(t).fields())
		}
		for _, c := range []string{"!!", base64.RawURLEncoding.EncodeToString([]byte("bad id"))} {
			r := e.do("GET", path+"?cursor="+c, e.alice, nil)
			assert.Equal(t, 422, r.status, "%s: %s", c, r.body)
			assert.Equal(t, CodeInvalidCursor, r.problem(t).Code)
		}
	})

	t.Run("delete", func(t *testing.T) {
		unknown := e.do("DELETE", path+"/no-such-hub", e.alice, nil)
		require.Equal(t, 404, unknown.status, "%s", unknown.body)
		assert.Equal(t, CodeBridgeNotFound, unknown.problem(t).Code)
		for _, other := range []struct{ token, id string }{{e.bob, "alice-b"}, {e.alice, "bob-hub"}, {e.alice, "op-1"}} {
			r := e.do("DELETE", path+"/"+other.id, other.token, nil)
			require.Equal(t, 404, r.status, "%s", r.body)
			assert.JSONEq(t, string(unknown.body), string(r.body), "another's bridge reads as none")
		}
		for _, bad := range []string{strings.Repeat("h", 65), "a%20b"} {
			r := e.do("DELETE", path+"/"+bad, e.alice, nil)
			assert.Equal(t, 404, r.status, "%s", r.body)
			assert.Equal(t, CodeBridgeNotFound, r.problem(t).Code)
		}
		assert.Empty(t, e.acc.took())

		del := func() resp {
			return e.send(req{method: "DELETE", path: path + "/alice-b", token: e.alice, header: map[string]string{"Idempotency-Key": "del-1"}})
		}
		r := del()
		require.Equal(t, 204, r.status, "%s", r.body)
		assert.Empty(t, r.body)
		assert.Equal(t, []string{`dev-a: "alice-b" → ""`, "deleted alice-b"}, e.acc.took())
		assert.Equal(t, []string{"alice-b"}, e.cmds.deletedBridges(), "the command broker told")
		b, err := e.db.DeviceBridge(context.Background(), "dev-a")
		require.NoError(t, err)
		assert.Empty(t, b, "dev-a still served by the deleted bridge")
		require.Equal(t, 204, del().status, "replayed")
		assert.Empty(t, e.acc.took(), "a replay does it again")
		r = e.do("DELETE", path+"/alice-b", e.alice, nil)
		assert.Equal(t, 404, r.status, "%s", r.body)
	})
}

func jsonString(v any) string { return fmt.Sprintf("%q", v) }

// PUT /devices/{id}/bridge: a user assigns their own device to one of their
// own bridges or to none; anyone else's device is not found (alike an
// unknown one), and so is anyone else's bridge, the operator's included.
func TestAssignUserDevice(t *testing.T) {
	e := newBridgesEnv(t)
	for _, hub := range []struct{ token, id string }{{e.alice, "alice-hub"}, {e.alice, "alice-car"}, {e.bob, "bob-hub"}} {
		require.Equal(t, 201, e.do("POST", "/api/v1/bridges", hub.token, map[string]any{"bridge_id": hub.id}).status)
	}
	e.acc.took()
	path := "/api/v1/devices/dev-a/bridge"
	bridgeOf := func(dev string) string {
		t.Helper()
		b, err := e.db.DeviceBridge(context.Background(), dev)
		require.NoError(t, err)
		return b
	}

	runBodyCases(t, e.env, "PUT", path, e.alice, []bodyCase{
		{"no bridge_id", map[string]any{}, 422, []string{"bridge_id"}},
		{"a misspelt member", map[string]any{"bridgeId": "alice-hub"}, 422, []string{"bridge_id"}},
		{"bad id", map[string]any{"bridge_id": "a hub"}, 422, []string{"bridge_id"}},
		{"empty id", map[string]any{"bridge_id": ""}, 422, []string{"bridge_id"}},
		{"id 65", map[string]any{"bridge_id": strings.Repeat("h", 65)}, 422, []string{"bridge_id"}},
		{"id a number", `{"bridge_id": 1}`, 400, []string{"bridge_id"}},
		{"not JSON", `{`, 400, nil},
		{"empty body", ``, 400, nil},
	})
	assert.Empty(t, bridgeOf("dev-a"), "a refused request assigned")
	assert.Empty(t, e.acc.took())

	r := e.do("PUT", path, e.alice, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.JSONEq(t, `{"device_id":"dev-a","bridge_id":"alice-hub"}`, string(r.body))
	assert.Equal(t, "alice-hub", bridgeOf("dev-a"))
	r = e.do("PUT", path, e.alice, map[string]any{"bridge_id": "alice-car"})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, []string{`dev-a: "" → "alice-hub"`, `dev-a: "alice-hub" → "alice-car"`}, e.acc.took())
	r = e.do("PUT", path, e.alice, map[string]any{"bridge_id": "alice-car"})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Empty(t, e.acc.took(), "no move, nothing to tell")

	// Not alice's device: not found, whatever the bridge.
	unknown := e.do("PUT", "/api/v1/devices/no-such-dev/bridge", e.alice, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 404, unknown.status, "%s", unknown.body)
	assert.Equal(t, CodeDeviceNotFound, unknown.problem(t).Code)
	for _, to := range []any{"alice-hub", "bob-hub", "op-1", nil} {
		r := e.do("PUT", "/api/v1/devices/dev-b/bridge", e.alice, map[string]any{"bridge_id": to})
		require.Equal(t, 404, r.status, "alice moved dev-b to %v: %s", to, r.body)
		assert.JSONEq(t, string(unknown.body), strings.ReplaceAll(string(r.body), "dev-b", "no-such-dev"))
	}
	for _, bad := range []string{strings.Repeat("d", 65), "d%20b"} {
		r := e.do("PUT", "/api/v1/devices/"+bad+"/bridge", e.alice, map[string]any{"bridge_id": "alice-hub"})
		assert.Equal(t, 404, r.status, "%s", r.body)
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
	}

	// Not alice's bridge: not found, alike one that does not exist.
	none := e.do("PUT", path, e.alice, map[string]any{"bridge_id": "no-such-hub"})
	require.Equal(t, 404, none.status, "%s", none.body)
	assert.Equal(t, CodeBridgeNotFound, none.problem(t).Code)
	for _, to := range []string{"bob-hub", "op-1"} {
		r := e.do("PUT", path, e.alice, map[string]any{"bridge_id": to})
		require.Equal(t, 404, r.status, "alice moved dev-a to %s: %s", to, r.body)
		assert.JSONEq(t, string(none.body), string(r.body))
	}
	assert.Equal(t, "alice-car", bridgeOf("dev-a"))
	assert.Equal(t, "", bridgeOf("dev-b"))
	assert.Empty(t, e.acc.took())

	// null: no bridge. With an Idempotency-Key, a repeat is the first
	// answer and changes nothing, even after another assignment.
	send := func(body any) resp {
		return e.send(req{method: "PUT", path: path, token: e.alice, body: body, header: map[string]string{"Idempotency-Key": "a-1"}})
	}
	r = send(map[string]any{"bridge_id": nil})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.JSONEq(t, `{"device_id":"dev-a","bridge_id":null}`, string(r.body))
	assert.Empty(t, bridgeOf("dev-a"))
	require.Equal(t, 200, e.do("PUT", path, e.alice, map[string]any{"bridge_id": "alice-hub"}).status)
	again := send(map[string]any{"bridge_id": nil})
	require.Equal(t, 200, again.status, "%s", again.body)
	assert.Equal(t, r.body, again.body)
	assert.Equal(t, "alice-hub", bridgeOf("dev-a"), "a replay assigned again")
	r = send(map[string]any{"bridge_id": "alice-car"})
	assert.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)
	assert.Equal(t, []string{`dev-a: "alice-car" → ""`, `dev-a: "" → "alice-hub"`}, e.acc.took())

	// Unbinding takes the device off alice's bridge, and says so.
	r = e.do("DELETE", "/api/v1/devices/dev-a", e.alice, nil)
	require.Equal(t, 204, r.status, "%s", r.body)
	assert.Empty(t, bridgeOf("dev-a"))
	assert.Equal(t, []string{`dev-a: "alice-hub" → ""`}, e.acc.took())
	assert.Equal(t, 404, e.do("PUT", path, e.alice, map[string]any{"bridge_id": "alice-hub"}).status, "unbound, no longer alice's")
}

// The admin's routes: POST /admin/devices with a bridge, PUT
// /admin/devices/{id}/bridge; the operator's bridges take any device, a
// user's bridge only that user's.
func TestAdminAssignDevice(t *testing.T) {
	e := newBridgesEnv(t)
	require.Equal(t, 201, e.do("POST", "/api/v1/bridges", e.alice, map[string]any{"bridge_id": "alice-hub"}).status)
	require.Equal(t, 201, e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "op-2"}).status)
	e.acc.took()
	bridgeOf := func(dev string) string {
		t.Helper()
		b, err := e.db.DeviceBridge(context.Background(), dev)
		require.NoError(t, err)
		return b
	}

	t.Run("provision", func(t *testing.T) {
		path := "/api/v1/admin/devices"
		runBodyCases(t, e.env, "POST", path, testAdminToken, []bodyCase{
			{"bad bridge id", map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": "op 1"}, 422, []string{"bridge_id"}},
			{"empty bridge id", map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": ""}, 422, []string{"bridge_id"}},
			{"bridge id a number", `{"device_id":"dev-p","claim_code":"c","model":"sim-1","bridge_id":1}`, 400, []string{"bridge_id"}},
		})
		for _, to := range []string{"no-such-hub", "alice-hub"} {
			r := e.do("POST", path, testAdminToken, map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": to})
			require.Equal(t, 404, r.status, "%s", r.body)
			assert.Equal(t, CodeBridgeNotFound, r.problem(t).Code)
		}
		r := e.do("POST", path, testAdminToken, map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": "op-1"})
		require.Equal(t, 201, r.status, "%s", r.body)
		assert.JSONEq(t, `{"device_id":"dev-p","model":"sim-1","bridge_id":"op-1"}`, string(r.body))
		assert.Equal(t, "op-1", bridgeOf("dev-p"))
		assert.Equal(t, []string{`dev-p: "" → "op-1"`}, e.acc.took())
		r = e.do("POST", path, testAdminToken, map[string]any{"device_id": "dev-q", "claim_code": "c", "model": "sim-1", "bridge_id": nil})
		require.Equal(t, 201, r.status, "%s", r.body)
		assert.JSONEq(t, `{"device_id":"dev-q","model":"sim-1","bridge_id":null}`, string(r.body))
		assert.Empty(t, e.acc.took())
	})

	t.Run("assign", func(t *testing.T) {
		path := "/api/v1/admin/devices/dev-b/bridge"
		runBodyCases(t, e.env, "PUT", path, testAdminToken, []bodyCase{
			{"no bridge_id", map[string]any{}, 422, []string{"bridge_id"}},
			{"bad id", map[string]any{"bridge_id": "op/1"}, 422, []string{"bridge_id"}},
			{"id a number", `{"bridge_id": 1}`, 400, []string{"bridge_id"}},
		})
		assert.Equal(t, 401, e.do("PUT", path, e.bob, map[string]any{"bridge_id": "op-1"}).status, "a user on the admin route")

		r := e.do("PUT", "/api/v1/admin/devices/no-such-dev/bridge", testAdminToken, map[string]any{"bridge_id": "op-1"})
		require.Equal(t, 404, r.status, "%s", r.body)
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
		r = e.do("PUT", "/api/v1/admin/devices/no-such-dev/bridge", testAdminToken, map[string]any{"bridge_id": nil})
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
		r = e.do("PUT", "/api/v1/admin/devices/"+strings.Repeat("d", 65)+"/bridge", testAdminToken, map[string]any{"bridge_id": "op-1"})
		assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
		r = e.do("PUT", path, testAdminToken, map[string]any{"bridge_id": "no-such-hub"})
		require.Equal(t, 404, r.status, "%s", r.body)
		assert.Equal(t, CodeBridgeNotFound, r.problem(t).Code)
		// bob's device on alice's bridge: a user's bridge serves only
		// that user's devices, whoever asks.
		r = e.do("PUT", path, testAdminToken, map[string]any{"bridge_id": "alice-hub"})
		require.Equal(t, 404, r.status, "%s", r.body)
		assert.Equal(t, CodeBridgeNotFound, r.problem(t).Code)
		assert.Empty(t, bridgeOf("dev-b"))
		assert.Empty(t, e.acc.took())

		for _, step := range []struct {
			to   any
			want string
		}{{"op-1", `dev-b: "" → "op-1"`}, {"op-2", `dev-b: "op-1" → "op-2"`}, {nil, `dev-b: "op-2" → ""`}} {
			r := e.do("PUT", path, testAdminToken, map[string]any{"bridge_id": step.to})
			require.Equal(t, 200, r.status, "%s", r.body)
			want := `null`
			if step.to != nil {
				want = `"` + step.to.(string) + `"`
			}
			assert.JSONEq(t, `{"device_id":"dev-b","bridge_id":`+want+`}`, string(r.body))
			assert.Equal(t, []string{step.want}, e.acc.took())
		}
		// alice's device on alice's bridge: the operator may.
		r = e.do("PUT", "/api/v1/admin/devices/dev-a/bridge", testAdminToken, map[string]any{"bridge_id": "alice-hub"})
		require.Equal(t, 200, r.status, "%s", r.body)
		assert.Equal(t, "alice-hub", bridgeOf("dev-a"))
		e.acc.took()

		// Unbinding leaves a device on the operator's bridge.
		r = e.do("PUT", path, testAdminToken, map[string]any{"bridge_id": "op-1"})
		require.Equal(t, 200, r.status, "%s", r.body)
		e.acc.took()
		require.Equal(t, 204, e.do("DELETE", "/api/v1/devices/dev-b", e.bob, nil).status)
		assert.Equal(t, "op-1", bridgeOf("dev-b"))
		assert.Empty(t, e.acc.took())
	})
}

// movingStore moves a device to another bridge once, just after the first
// read of a bridge's devices: as another request's move would fall
// between two reads.
type movingStore struct {
	*store.DB
	once sync.Once
	move func()
}

func (s *movingStore) ServedDevices(ctx context.Context, bridgeID string) ([]string, error) {
	ids, err := s.DB.ServedDevices(ctx, bridgeID)
	s.once.Do(s.move)
	return ids, err
}

// A device moved while a page of bridges is read shows on one of them,
// before the move or after it, never on none (nor on two): the page and
// the devices of its bridges are read at one instant.
func TestBridgePageIsReadAtOneInstant(t *testing.T) {
	base := newEnv(t)
	tok := base.bound("dev-1")
	for _, id := range []string{"hub-a", "hub-b"} {
		r := base.do("POST", "/api/v1/bridges", tok, map[string]any{"bridge_id": id})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	r := base.do("PUT", "/api/v1/devices/dev-1/bridge", tok, map[string]any{"bridge_id": "hub-b"})
	require.Equal(t, 200, r.status, "%s", r.body)
	b, err := base.db.Binding(context.Background(), "dev-1")
	require.NoError(t, err)
	ms := &movingStore{DB: base.db, move: func() {
		_, err := base.db.AssignDevice(context.Background(), "dev-1", "hub-a", b.UserID)
		assert.NoError(t, err, "moving dev-1 to hub-a")
	}}
	e := newEnvWith(t, base.db, ms)
	r = e.do("GET", "/api/v1/bridges", tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	var on []string
	for _, it := range r.json(t)["bridges"].([]any) {
		br := it.(map[string]any)
		for _, d := range br["devices"].([]any) {
			if d == "dev-1" {
				on = append(on, br["bridge_id"].(string))
			}
		}
	}
	assert.Len(t, on, 1, "dev-1 is on bridges %v of the page: %s", on, r.body)
}

// TestAdminNotFoundSaysWhatIsMissing asks the admin routes for devices and
// bridges that are not there, or that may not serve each other: each 404
// keeps its code and says what is missing from the service, never "among
// yours" (an operator has no devices or bridges of their own), and a
// user's bridge that exists is not called missing. The user's routes keep
// their wording. Without the fix every one said "no such device among
// yours" or "no such bridge among yours".
func TestAdminNotFoundSaysWhatIsMissing(t *testing.T) {
	e := newBridgesEnv(t)
	require.Equal(t, 201, e.do("POST", "/api/v1/bridges", e.alice, map[string]any{"bridge_id": "alice-hub"}).status)
	for _, tc := range []struct {
		name, method, path string
		body               map[string]any
		code, detail       string
	}{
		{"assign an unknown device", "PUT", "/api/v1/admin/devices/no-such-dev/bridge", map[string]any{"bridge_id": "op-1"},
			CodeDeviceNotFound, "no device with that id is provisioned"},
		{"unassign an unknown device", "PUT", "/api/v1/admin/devices/no-such-dev/bridge", map[string]any{"bridge_id": nil},
			CodeDeviceNotFound, "no device with that id is provisioned"},
		{"a path that is no device id", "PUT", "/api/v1/admin/devices/" + strings.Repeat("d", 65) + "/bridge", map[string]any{"bridge_id": "op-1"},
			CodeDeviceNotFound, "no device with that id is provisioned"},
		{"assign to an unknown bridge", "PUT", "/api/v1/admin/devices/dev-b/bridge", map[string]any{"bridge_id": "no-such-hub"},
			CodeBridgeNotFound, "no bridge with that id exists"},
		{"assign to another user's bridge", "PUT", "/api/v1/admin/devices/dev-b/bridge", map[string]any{"bridge_id": "alice-hub"},
			CodeBridgeNotFound, errAdminUsersBridge.Detail},
		{"provision onto an unknown bridge", "POST", "/api/v1/admin/devices", map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": "no-such-hub"},
			CodeBridgeNotFound, errAdminNoOperatorBridge.Detail},
		{"provision onto a user's bridge", "POST", "/api/v1/admin/devices", map[string]any{"device_id": "dev-p", "claim_code": "c", "model": "sim-1", "bridge_id": "alice-hub"},
			CodeBridgeNotFound, errAdminNoOperatorBridge.Detail},
	} {
		r := e.do(tc.method, tc.path, testAdminToken, tc.body)
		require.Equal(t, 404, r.status, "%s: %s", tc.name, r.body)
		p := r.problem(t)
		assert.Equal(t, tc.code, p.Code, tc.name)
		assert.Equal(t, tc.detail, p.Detail, tc.name)
		assert.NotContains(t, p.Detail, "yours", tc.name)
	}
	// A user's own routes: the device and the bridge among theirs.
	r := e.do("PUT", "/api/v1/devices/dev-b/bridge", e.bob, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, "no such bridge among yours", r.problem(t).Detail)
	r = e.do("PUT", "/api/v1/devices/dev-a/bridge", e.bob, map[string]any{"bridge_id": nil})
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, "no such device among yours", r.problem(t).Detail)
}

// A bridge's new secret: the operator may give any bridge one, a user
// only their own (404 for another's, alike an unknown one); the answer
// carries it once, a repeat with the same Idempotency-Key answers without
// it; from then on the old secret opens nothing and the new one does, and
// the broker's accounts are told.
func TestNewBridgeSecret(t *testing.T) {
	e := newBridgesEnv(t)
	r := e.do("POST", "/api/v1/bridges", e.alice, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 201, r.status, "%s", r.body)
	aliceSecret := r.json(t)["secret"].(string)
	e.acc.took()

	// opens says whether secret opens the blob route as a bridge: an
	// unknown blob is 404 to a bridge, 401 to anyone else.
	opens := func(secret string) bool {
		t.Helper()
		r := e.do("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), secret, nil)
		require.Contains(t, []int{401, 404}, r.status, "%s", r.body)
		return r.status == 404
	}
	require.True(t, opens(aliceSecret))

	for _, c := range []struct{ name, token, id string }{
		{"another user's", e.bob, "alice-hub"},
		{"the operator's, by a user", e.alice, "op-1"},
		{"unknown", e.alice, "nope"},
		{"not an id", e.alice, "a%20hub"},
	} {
		r := e.do("POST", "/api/v1/bridges/"+c.id+"/secret", c.token, nil)
		require.Equal(t, 404, r.status, "%s: %s", c.name, r.body)
		assert.Equal(t, CodeBridgeNotFound, r.problem(t).Code, c.name)
	}
	assert.Equal(t, 401, e.do("POST", "/api/v1/bridges/alice-hub/secret", "", nil).status)
	assert.Equal(t, 401, e.do("POST", "/api/v1/admin/bridges/alice-hub/secret", e.alice, nil).status, "a user's token on the admin route")
	assert.Equal(t, 404, e.do("POST", "/api/v1/admin/bridges/nope/secret", testAdminToken, nil).status)
	assert.Empty(t, e.acc.took(), "a refused change was told to the broker")
	assert.True(t, opens(aliceSecret), "a refused change changed the secret")

	send := func(path, token string) resp {
		return e.send(req{method: "POST", path: path, token: token, header: map[string]string{"Idempotency-Key": "rotate-1"}})
	}
	r = send("/api/v1/bridges/alice-hub/secret", e.alice)
	require.Equal(t, 200, r.status, "%s", r.body)
	got := r.json(t)
	assert.Equal(t, "alice-hub", got["bridge_id"])
	newSecret, _ := got["secret"].(string)
	assert.True(t, strings.HasPrefix(newSecret, bridgeSecretPrefix), "%v", got)
	assert.NotEqual(t, aliceSecret, newSecret)
	assert.Equal(t, []string{"new secret alice-hub"}, e.acc.took())
	assert.False(t, opens(aliceSecret), "the old secret still opens")
	assert.True(t, opens(newSecret), "the new secret does not open")

	r = send("/api/v1/bridges/alice-hub/secret", e.alice)
	require.Equal(t, 200, r.status, "the first answer again: %s", r.body)
	assert.Equal(t, map[string]any{"bridge_id": "alice-hub"}, r.json(t), "the secret exists only in the first answer")
	assert.Empty(t, e.acc.took(), "a repeat changed the secret again")
	assert.True(t, opens(newSecret), "a repeat changed the secret again")

	// The operator, any bridge: the user's, and their own.
	for _, id := range []string{"alice-hub", "op-1"} {
		r := e.do("POST", "/api/v1/admin/bridges/"+id+"/secret", testAdminToken, nil)
		require.Equal(t, 200, r.status, "%s: %s", id, r.body)
		s := r.json(t)["secret"].(string)
		assert.True(t, opens(s), "%s's new secret", id)
		assert.Equal(t, []string{"new secret " + id}, e.acc.took())
	}
	assert.False(t, opens(newSecret), "the user's secret once the operator gave the bridge another")

	// The bridge keeps its devices.
	r = e.do("PUT", "/api/v1/devices/dev-a/bridge", e.alice, map[string]any{"bridge_id": "alice-hub"})
	require.Equal(t, 200, r.status, "%s", r.body)
	r = e.do("POST", "/api/v1/bridges/alice-hub/secret", e.alice, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	r = e.do("GET", "/api/v1/bridges", e.alice, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, []any{"dev-a"}, r.json(t)["bridges"].([]any)[0].(map[string]any)["devices"])
}

// A user's new API token (POST /api/v1/admin/users/{id}/token, the
// operator's only): 404 user_not_found for no such user; the answer
// carries it once, a repeat with the same Idempotency-Key answers without
// it; from then on the old token is a 401 and the new one opens the API,
// with the user's devices; the broker's accounts are told.
func TestNewUserToken(t *testing.T) {
	e := newBridgesEnv(t)
	r := e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "carol"})
	require.Equal(t, 201, r.status, "%s", r.body)
	id, old := r.json(t)["user_id"].(string), r.json(t)["token"].(string)
	e.acc.took()

	for _, c := range []struct{ name, token, id string }{
		{"no such user", testAdminToken, "6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f"},
		{"not an id", testAdminToken, "a%00b"},
	} {
		r := e.do("POST", "/api/v1/admin/users/"+c.id+"/token", c.token, nil)
		require.Equal(t, 404, r.status, "%s: %s", c.name, r.body)
		assert.Equal(t, CodeUserNotFound, r.problem(t).Code, c.name)
	}
	assert.Equal(t, 401, e.do("POST", "/api/v1/admin/users/"+id+"/token", old, nil).status, "the user's own token on the admin route")
	assert.Equal(t, 401, e.do("POST", "/api/v1/admin/users/"+id+"/token", "", nil).status)
	assert.Empty(t, e.acc.took(), "a refused change was told to the broker")

	send := func() resp {
		return e.send(req{method: "POST", path: "/api/v1/admin/users/" + id + "/token", token: testAdminToken,
			header: map[string]string{"Idempotency-Key": "token-1"}})
	}
	r = send()
	require.Equal(t, 200, r.status, "%s", r.body)
	got := r.json(t)
	assert.Equal(t, id, got["user_id"])
	assert.Equal(t, "carol", got["name"])
	tok, _ := got["token"].(string)
	assert.True(t, strings.HasPrefix(tok, userTokenPrefix), "%v", got)
	assert.Equal(t, []string{"new token " + id}, e.acc.took())
	assert.Equal(t, 401, e.do("GET", "/api/v1/devices", old, nil).status, "the old token")
	r = e.do("GET", "/api/v1/devices", tok, nil)
	assert.Equal(t, 200, r.status, "the new token: %s", r.body)

	r = send()
	require.Equal(t, 200, r.status, "the first answer again: %s", r.body)
	assert.Equal(t, map[string]any{"user_id": id, "name": "carol"}, r.json(t), "the token exists only in the first answer")
	assert.Empty(t, e.acc.took(), "a repeat changed the token again")
	assert.Equal(t, 200, e.do("GET", "/api/v1/devices", tok, nil).status, "a repeat changed the token again")

	// The user keeps their devices: alice, given a new token, has dev-a.
	b, err := e.db.Binding(t.Context(), "dev-a")
	require.NoError(t, err)
	r = e.do("POST", "/api/v1/admin/users/"+b.UserID+"/token", testAdminToken, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	r = e.do("GET", "/api/v1/devices/dev-a", r.json(t)["token"].(string), nil)
	assert.Equal(t, 200, r.status, "alice's device with her new token: %s", r.body)
}

// userReadFailingStore fails every read of a user by id (User).
type userReadFailingStore struct{ *store.DB }

func (userReadFailingStore) User(context.Context, string) (companion.User, error) {
	return companion.User{}, errDisk
}

// A new token whose answer fails (a 500) changes nothing: the user's old
// token still opens the API, and the broker is told of no new one. Read
// after the store's write, the user's name failed the answer once the
// token was replaced: the old token was refused, the new one shown to no
// one, and the broker, not told, still took the old one on Mosquitto
// (docs/reliability.md, bug 302).
func TestANewTokenThatFailsChangesNothing(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "db"), store.Options{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	acc := &recordingAccounts{}
	e := newEnvWith(t, db, userReadFailingStore{db}, func(o *Options) { o.BrokerAccounts = acc })
	r := e.do("POST", "/api/v1/admin/users", testAdminToken, map[string]any{"name": "carol"})
	require.Equal(t, 201, r.status, "%s", r.body)
	id, old := r.json(t)["user_id"].(string), r.json(t)["token"].(string)
	acc.took()

	r = e.do("POST", "/api/v1/admin/users/"+id+"/token", testAdminToken, nil)
	require.Equal(t, 500, r.status, "%s", r.body)
	assert.Equal(t, 200, e.do("GET", "/api/v1/devices", old, nil).status, "a failed new token replaced the old one")
	assert.Empty(t, acc.took(), "a failed new token was told to the broker")
}
