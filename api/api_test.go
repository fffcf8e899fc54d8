package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/topics"
)

func TestHealth(t *testing.T) {
	var ready atomic.Bool
	e := newEnv(t, func(o *Options) {
		o.Ready = func(context.Context) error {
			if !ready.Load() {
				return errors.New("MQTT is not connected")
			}
			return nil
		}
	})
	assert.Equal(t, 200, e.do("GET", "/healthz", "", nil).status)
	r := e.do("GET", "/readyz", "", nil)
	require.Equal(t, 503, r.status)
	assert.Equal(t, CodeNotReady, r.problem(t).Code)
	assert.Equal(t, "MQTT is not connected", r.problem(t).Detail, "the answer says what is not ready")
	// HEAD, as some load balancers probe: the same status, no body.
	for path, want := range map[string]int{"/healthz": 200, "/readyz": 503} {
		r := e.do("HEAD", path, "", nil)
		assert.Equal(t, want, r.status, "HEAD %s", path)
		assert.Empty(t, r.body, "HEAD %s", path)
	}
	ready.Store(true)
	assert.Equal(t, 200, e.do("GET", "/readyz", "", nil).status)
	assert.Equal(t, 200, e.do("HEAD", "/readyz", "", nil).status)
}

func TestAuth(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	bridge := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "br-1"})
	require.Equal(t, 201, bridge.status, "%s", bridge.body)
	secret := bridge.json(t)["secret"].(string)
	require.True(t, strings.HasPrefix(secret, bridgeSecretPrefix))

	for _, tc := range []struct {
		name, method, path, auth string
		status                   int
	}{
		{"no token", "GET", "/api/v1/devices", "", 401},
		{"unknown token", "GET", "/api/v1/devices", "Bearer ctk_nope", 401},
		{"wrong scheme", "GET", "/api/v1/devices", "Basic " + tok, 401},
		{"empty bearer", "GET", "/api/v1/devices", "Bearer ", 401},
		{"user token", "GET", "/api/v1/devices", "Bearer " + tok, 200},
		{"scheme in lower case", "GET", "/api/v1/devices", "bearer " + tok, 200},
		{"admin token on user routes", "GET", "/api/v1/devices", "Bearer " + testAdminToken, 401},
		{"bridge secret on user routes", "GET", "/api/v1/devices", "Bearer " + secret, 401},
		{"no token on admin", "POST", "/api/v1/admin/users", "", 401},
		{"user token on admin", "POST", "/api/v1/admin/users", "Bearer " + tok, 401},
		{"bridge secret on admin", "POST", "/api/v1/admin/users", "Bearer " + secret, 401},
		{"user token on blobs", "GET", "/api/v1/blobs/" + strings.Repeat("0", 64), "Bearer " + tok, 401},
		{"no token on blobs", "GET", "/api/v1/blobs/" + strings.Repeat("0", 64), "", 401},
		{"bridge on blobs", "GET", "/api/v1/blobs/" + strings.Repeat("0", 64), "Bearer " + secret, 404},
		{"admin on blobs", "GET", "/api/v1/blobs/" + strings.Repeat("0", 64), "Bearer " + testAdminToken, 404},
		{"no token, device route", "POST", "/api/v1/devices/dev-1/push/text", "", 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.send(req{method: tc.method, path: tc.path, header: map[string]string{"Authorization": tc.auth}})
			require.Equal(t, tc.status, r.status, "%s", r.body)
			if tc.status == 401 {
				assert.Equal(t, CodeUnauthorized, r.problem(t).Code)
				assert.True(t, strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer"), "WWW-Authenticate = %q", r.header.Get("WWW-Authenticate"))
			}
		})
	}

	t.Run("no admin token configured", func(t *testing.T) {
		e := newEnv(t, func(o *Options) { o.AdminToken = "" })
		r := e.send(req{method: "POST", path: "/api/v1/admin/users", body: map[string]any{"name": "x"}, header: map[string]string{"Authorization": "Bearer "}})
		assert.Equal(t, 401, r.status)
	})
}

func TestRegister(t *testing.T) {
	e := newEnv(t)
	alice, bob := e.user("alice"), e.user("bob")
	e.provision("dev-1", "secret-claim", "sim-1")
	path := "/api/v1/devices/register"

	r := e.do("POST", path, alice, map[string]any{"device_id": "dev-1", "claim_code": "secret-claim", "name": "Kitchen"})
	require.Equal(t, 201, r.status, "%s", r.body)
	assert.Equal(t, "/api/v1/devices/dev-1", r.header.Get("Location"))
	dev := r.json(t)
	assert.Equal(t, "dev-1", dev["device_id"])
	assert.Equal(t, "Kitchen", dev["name"])
	assert.Equal(t, "sim-1", dev["model"])
	assert.NotNil(t, dev["bound_at"])
	assert.Equal(t, map[string]any{
		"device_id": "dev-1", "online": false, "battery": nil, "firmware_version": nil,
		"model": "sim-1", "bridge_id": nil, "last_seen": nil, "updated_at": nil,
	}, dev["status"])

	r = e.do("POST", path, alice, map[string]any{"device_id": "dev-1", "claim_code": "secret-claim"})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, "Kitchen", r.json(t)["name"])

	r = e.do("POST", path, bob, map[string]any{"device_id": "dev-1", "claim_code": "secret-claim"})
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, CodeDeviceAlreadyBound, r.problem(t).Code)

	wrong := e.do("POST", path, bob, map[string]any{"device_id": "dev-1", "claim_code": "guess"})
	unknown := e.do("POST", path, bob, map[string]any{"device_id": "dev-404", "claim_code": "guess"})
	require.Equal(t, 422, wrong.status)
	assert.Equal(t, CodeInvalidClaim, wrong.problem(t).Code)
	assert.Equal(t, wrong.body, unknown.body, "an unknown device and a wrong code answer alike")
	assert.Equal(t, wrong.status, unknown.status)

	runBodyCases(t, e, "POST", path, bob, []bodyCase{
		{"nothing", map[string]any{}, 422, []string{"device_id", "claim_code"}},
		{"bad device id", map[string]any{"device_id": "dev 1", "claim_code": "x"}, 422, []string{"device_id"}},
		{"device id 65", map[string]any{"device_id": strings.Repeat("d", 65), "claim_code": "x"}, 422, []string{"device_id"}},
		{"claim code 257", map[string]any{"device_id": "dev-1", "claim_code": strings.Repeat("c", 257)}, 422, []string{"claim_code"}},
		{"name 129", map[string]any{"device_id": "dev-1", "claim_code": "x", "name": strings.Repeat("n", 129)}, 422, []string{"name"}},
		{"name empty", map[string]any{"device_id": "dev-1", "claim_code": "x", "name": ""}, 422, []string{"name"}},
		{"name control", map[string]any{"device_id": "dev-1", "claim_code": "x", "name": "a\nb"}, 422, []string{"name"}},
		{"name invalid UTF-8", []byte("{\"device_id\":\"dev-1\",\"claim_code\":\"x\",\"name\":\"\xff\"}"), 422, []string{"name"}},
		{"claim code number", `{"device_id":"dev-1","claim_code":1234}`, 400, []string{"claim_code"}},
	})

	t.Run("unbind and register again", func(t *testing.T) {
		r := e.do("DELETE", "/api/v1/devices/dev-1", alice, nil)
		require.Equal(t, 204, r.status, "%s", r.body)
		assert.Empty(t, r.body)
		assert.Equal(t, 404, e.do("GET", "/api/v1/devices/dev-1/status", alice, nil).status)
		assert.Equal(t, 404, e.do("DELETE", "/api/v1/devices/dev-1", alice, nil).status)
		r = e.do("POST", path, bob, map[string]any{"device_id": "dev-1", "claim_code": "secret-claim"})
		require.Equal(t, 201, r.status, "%s", r.body)
		assert.Equal(t, "dev-1", r.json(t)["name"], "the name defaults to the id")
	})

	t.Run("rate limited", func(t *testing.T) {
		e := newEnv(t, func(o *Options) { o.Limits.RegisterPerMinute = 2 })
		tok := e.user("carol")
		for i := 0; i < 2; i++ {
			r := e.do("POST", path, tok, map[string]any{"device_id": "nope", "claim_code": "x"})
			require.Equal(t, 422, r.status)
		}
		r := e.do("POST", path, tok, map[string]any{"device_id": "nope", "claim_code": "x"})
		require.Equal(t, 429, r.status)
		assert.Equal(t, CodeRateLimited, r.problem(t).Code)
		assert.NotEmpty(t, r.header.Get("Retry-After"))
	})
}

func TestRequestRateLimit(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.RequestsPerSecond = 0.001; o.Limits.RequestBurst = 3 })
	tok := e.user("dave")
	for i := 0; i < 3; i++ {
		require.Equal(t, 200, e.do("GET", "/api/v1/devices", tok, nil).status)
	}
	r := e.do("GET", "/api/v1/devices", tok, nil)
	require.Equal(t, 429, r.status)
	assert.Equal(t, CodeRateLimited, r.problem(t).Code)
	assert.NotEmpty(t, r.header.Get("Retry-After"))
}

func TestOtherUsersDeviceIsUnknown(t *testing.T) {
	e := newEnv(t)
	owner := e.bound("dev-1")
	e.reportSettings("dev-1")
	other := e.user("mallory")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", owner, map[string]any{"text": "hi"})
	require.Equal(t, 202, r.status)
	cmdID := r.json(t)["id"].(string)

	for _, tc := range []struct {
		method, suffix string
		body           any
	}{
		{"GET", "", nil},
		{"DELETE", "", nil},
		{"GET", "/status", nil},
		{"POST", "/push/text", map[string]any{"text": strings.Repeat("x", 5000)}}, // invalid: still 404
		{"POST", "/push/text", "not json"},
		{"POST", "/push/image", map[string]any{}},
		{"GET", "/apps", nil},
		{"POST", "/apps/install", map[string]any{"app_id": "BAD"}},
		{"DELETE", "/apps/weather", nil},
		{"PUT", "/apps/weather/update", nil},
		{"GET", "/settings", nil},
		{"PUT", "/settings", map[string]any{"bogus": 1}},
		{"GET", "/ota/check", nil},
		{"POST", "/ota/update", map[string]any{"version": "x"}},
		{"GET", "/commands", nil},
		{"GET", "/commands?limit=0", nil},
		{"GET", "/commands/" + cmdID, nil},
		{"DELETE", "/commands/" + cmdID, nil},
	} {
		theirs := e.do(tc.method, "/api/v1/devices/dev-1"+tc.suffix, other, tc.body)
		unknown := e.do(tc.method, "/api/v1/devices/dev-9"+tc.suffix, other, tc.body)
		require.Equal(t, 404, theirs.status, "%s dev-1%s = %d %s", tc.method, tc.suffix, theirs.status, theirs.body)
		assert.Equal(t, CodeDeviceNotFound, theirs.problem(t).Code)
		assert.Equal(t, unknown.status, theirs.status)
		assert.Equal(t, string(unknown.body), string(theirs.body), "%s %s", tc.method, tc.suffix)
	}
	// The list shows only one's own devices.
	r = e.do("GET", "/api/v1/devices", other, nil)
	assert.Equal(t, []any{}, r.json(t)["devices"])
	// And nothing was sent by the other user.
	assert.Equal(t, 1, e.cmds.count())
}

func TestDeviceViews(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.0.0", topicsApp("clock", "2.0.0"))

	r := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
	require.Equal(t, 200, r.status)
	st := r.json(t)
	assert.Equal(t, true, st["online"])
	assert.Equal(t, 80.0, st["battery"])
	assert.Equal(t, "1.0.0", st["firmware_version"])
	assert.Equal(t, "bridge-1", st["bridge_id"])
	assert.NotNil(t, st["last_seen"])
	assert.NotNil(t, st["updated_at"])
	assert.Equal(t, "application/json; charset=utf-8", r.header.Get("Content-Type"))

	r = e.do("GET", "/api/v1/devices/dev-1/apps", tok, nil)
	require.Equal(t, 200, r.status)
	assert.Equal(t, map[string]any{"apps": []any{map[string]any{"app_id": "clock", "version": "2.0.0"}}}, r.json(t))

	r = e.do("GET", "/api/v1/devices/dev-1", tok, nil)
	require.Equal(t, 200, r.status)
	assert.Equal(t, "dev-1", r.json(t)["device_id"])

	// No settings reported yet: sim-1's schema (TestSettingsValidation).
	r = e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
	require.Equal(t, 200, r.status)
	got := r.json(t)
	assert.NotEmpty(t, got["schema"])
	delete(got, "schema")
	assert.Equal(t, map[string]any{"reported": map[string]any{}, "desired": map[string]any{}, "pending": []any{}, "updated_at": nil}, got)
}

func TestDevicePagination(t *testing.T) {
	e := newEnv(t)
	tok := e.user("erin")
	var want []string
	for i := 0; i < 5; i++ {
		id := fmt.Sprintf("dev-%d", i)
		e.provision(id, "c", "sim-1")
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": "c"})
		require.Equal(t, 201, r.status)
		want = append(want, id)
	}
	var got []string
	cursor := ""
	for pages := 0; ; pages++ {
		require.Less(t, pages, 5)
		r := e.do("GET", "/api/v1/devices?limit=2"+cursor, tok, nil)
		require.Equal(t, 200, r.status, "%s", r.body)
		m := r.json(t)
		for _, d := range m["devices"].([]any) {
			got = append(got, d.(map[string]any)["device_id"].(string))
		}
		next, ok := m["next_cursor"].(string)
		if !ok {
			assert.Nil(t, m["next_cursor"])
			break
		}
		cursor = "&cursor=" + next
	}
	assert.Equal(t, want, got)
}

func TestCommandsResource(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	var ids []string
	for i := 0; i < 3; i++ {
		r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": fmt.Sprint(i)})
		require.Equal(t, 202, r.status)
		m := r.json(t)
		ids = append(ids, m["id"].(string))
		assert.Equal(t, "/api/v1/devices/dev-1/commands/"+m["id"].(string), r.header.Get("Location"))
		assert.Equal(t, "queued", m["state"])
		assert.Equal(t, "push.text", m["op"])
		assert.NotContains(t, m, "payload")
		assert.NotContains(t, m, "user_id")
		for _, k := range []string{"id", "device_id", "op", "state", "created_at", "updated_at", "expires_at"} {
			assert.Contains(t, m, k)
		}
	}

	r := e.do("GET", "/api/v1/devices/dev-1/commands/"+ids[0], tok, nil)
	require.Equal(t, 200, r.status)
	assert.Equal(t, ids[0], r.json(t)["id"])

	list := func(q string) ([]string, any) {
		r := e.do("GET", "/api/v1/devices/dev-1/commands"+q, tok, nil)
		require.Equal(t, 200, r.status, "%s", r.body)
		m := r.json(t)
		var out []string
		for _, c := range m["commands"].([]any) {
			out = append(out, c.(map[string]any)["id"].(string))
		}
		return out, m["next_cursor"]
	}
	page1, next := list("?limit=2")
	assert.Equal(t, []string{ids[2], ids[1]}, page1, "newest first")
	require.NotNil(t, next)
	page2, next := list("?limit=2&cursor=" + next.(string))
	assert.Equal(t, []string{ids[0]}, page2)
	assert.Nil(t, next)

	// Cancel one, deliver another.
	r = e.do("DELETE", "/api/v1/devices/dev-1/commands/"+ids[0], tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, "canceled", r.json(t)["state"])
	r = e.do("DELETE", "/api/v1/devices/dev-1/commands/"+ids[0], tok, nil)
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, CodeNotCancelable, r.problem(t).Code)
	e.cmds.set(t, ids[1], companion.StateDelivered)
	r = e.do("DELETE", "/api/v1/devices/dev-1/commands/"+ids[1], tok, nil)
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Equal(t, CodeNotCancelable, r.problem(t).Code)

	canceled, _ := list("?state=canceled")
	assert.Equal(t, []string{ids[0]}, canceled)
	queued, _ := list("?state=queued")
	assert.Equal(t, []string{ids[2]}, queued)

	// Another device's command is not this device's.
	tok2 := e.bound("dev-2")
	r = e.do("GET", "/api/v1/devices/dev-2/commands/"+ids[2], tok2, nil)
	assert.Equal(t, 404, r.status)
	assert.Equal(t, CodeCommandNotFound, r.problem(t).Code)
}

func TestIdempotency(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/text"
	withKey := func(method, path, key string, body any) resp {
		return e.send(req{method: method, path: path, token: tok, body: body, header: map[string]string{"Idempotency-Key": key}})
	}

	first := withKey("POST", path, "k-1", map[string]any{"text": "once"})
	require.Equal(t, 202, first.status, "%s", first.body)
	again := withKey("POST", path, "k-1", map[string]any{"text": "once"})
	require.Equal(t, 202, again.status, "%s", again.body)
	assert.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
	assert.Equal(t, first.json(t)["id"], again.json(t)["id"])
	assert.Equal(t, 1, e.cmds.count(), "a repeat creates nothing")

	// The replay returns the first answer (CONTRACT §2), however the
	// command went since; with Prefer: wait, it waits as the first would
	// have, and answers the command final.
	e.cmds.set(t, first.json(t)["id"].(string), companion.StateSucceeded)
	again = withKey("POST", path, "k-1", map[string]any{"text": "once"})
	require.Equal(t, 202, again.status, "%s", again.body)
	assert.JSONEq(t, string(first.body), string(again.body), "the first answer")
	r := e.send(req{method: "POST", path: path, token: tok, body: map[string]any{"text": "once"},
		header: map[string]string{"Idempotency-Key": "k-1", "Prefer": "wait=5"}})
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, "succeeded", r.json(t)["state"])

	r = withKey("POST", path, "k-1", map[string]any{"text": "other"})
	require.Equal(t, 422, r.status)
	assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)

	// The same JSON serialized anew is the same request: whitespace,
	// members' order, a string's escapes.
	spelled := withKey("POST", path, "k-2", `{"title":"t","text":"<once>"}`)
	require.Equal(t, 202, spelled.status, "%s", spelled.body)
	for _, body := range []string{"{\n  \"text\": \"<once>\",\n  \"title\": \"t\"\n}\n", `{"text":"\u003conce>","title":"t"}`} {
		r = withKey("POST", path, "k-2", body)
		require.Equal(t, 202, r.status, "%s: %s", body, r.body)
		assert.Equal(t, spelled.json(t)["id"], r.json(t)["id"], "the repeat of %s", body)
	}
	r = withKey("POST", path, "k-2", `{"title":"t","text":"<once> "}`)
	require.Equal(t, 422, r.status, "%s", r.body)
	assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)
	// A record the last version made, of the body's bytes, still answers
	// their repeat.
	b, err := e.db.Binding(t.Context(), "dev-1")
	require.NoError(t, err)
	old := "{ \"text\": \"once\" }"
	h := sha256.Sum256([]byte("POST\x00" + path + "\x00" + old))
	require.NoError(t, e.db.PutIdempotency(t.Context(), companion.Idempotency{UserID: b.UserID, Key: "k-old", RequestHash: h[:],
		Status: 202, CommandID: first.json(t)["id"].(string)}))
	r = withKey("POST", path, "k-old", old)
	require.Equal(t, 202, r.status, "%s", r.body)
	assert.Equal(t, first.json(t)["id"], r.json(t)["id"], "the repeat of a request the last version took")
	r = withKey("POST", "/api/v1/devices/dev-1/push/image", "k-1", map[string]any{"image": b64(pngOf(t, 1, 1))})
	require.Equal(t, 422, r.status)
	assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)
	r = withKey("DELETE", "/api/v1/devices/dev-1/commands/"+first.json(t)["id"].(string), "k-1", nil)
	require.Equal(t, 422, r.status)
	assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)

	for _, bad := range []string{strings.Repeat("k", 256), "tab\there", "é"} {
		r = withKey("POST", path, bad, map[string]any{"text": "x"})
		require.Equal(t, 422, r.status, "key %q: %s", bad, r.body)
		assert.Equal(t, []string{"Idempotency-Key"}, r.problem(t).fields())
	}
	r = withKey("POST", path, strings.Repeat("k", 255), map[string]any{"text": "x"})
	assert.Equal(t, 202, r.status)

	t.Run("settings, install, ota, uninstall, update", func(t *testing.T) {
		e.reportSettings("dev-1")
		n := e.cmds.count()
		for i := 0; i < 2; i++ {
			r := withKey("PUT", "/api/v1/devices/dev-1/settings", "s-1", map[string]any{"volume": 3})
			require.Equal(t, 202, r.status, "%s", r.body)
			r = withKey("DELETE", "/api/v1/devices/dev-1/apps/clock", "u-1", nil)
			require.Equal(t, 202, r.status, "%s", r.body)
		}
		assert.Equal(t, n+2, e.cmds.count())
	})

	t.Run("register and unbind", func(t *testing.T) {
		tok := e.user("frank")
		e.provision("dev-f", "cf", "sim-1")
		send := func(method, path string, body any) resp {
			return e.send(req{method: method, path: path, token: tok, body: body, header: map[string]string{"Idempotency-Key": "r-1"}})
		}
		a := send("POST", "/api/v1/devices/register", map[string]any{"device_id": "dev-f", "claim_code": "cf"})
		b := send("POST", "/api/v1/devices/register", map[string]any{"device_id": "dev-f", "claim_code": "cf"})
		require.Equal(t, 201, a.status)
		require.Equal(t, 201, b.status, "the first answer again")
		assert.Equal(t, a.body, b.body)
		assert.Equal(t, a.header.Get("Location"), b.header.Get("Location"))
		r := send("POST", "/api/v1/devices/register", map[string]any{"device_id": "dev-f", "claim_code": "other"})
		assert.Equal(t, 422, r.status)
		assert.Equal(t, CodeIdempotencyKeyReused, r.problem(t).Code)

		del := func() resp {
			return e.send(req{method: "DELETE", path: "/api/v1/devices/dev-f", token: tok, header: map[string]string{"Idempotency-Key": "d-1"}})
		}
		require.Equal(t, 204, del().status)
		require.Equal(t, 204, del().status, "replayed, though the device is no longer bound")
	})

	t.Run("admin user creation keeps the token out of the store", func(t *testing.T) {
		send := func() resp {
			return e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken, body: map[string]any{"name": "gina"}, header: map[string]string{"Idempotency-Key": "u-1"}})
		}
		a, b := send(), send()
		require.Equal(t, 201, a.status)
		require.Equal(t, 201, b.status)
		assert.Equal(t, a.json(t)["user_id"], b.json(t)["user_id"])
		assert.NotEmpty(t, a.json(t)["token"])
		assert.NotContains(t, b.json(t), "token")
	})
}

func TestPreferWait(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.MaxWait = 3 * time.Second })
	tok := e.bound("dev-1")
	path := "/api/v1/devices/dev-1/push/text"
	prefer := func(p string) resp {
		return e.send(req{method: "POST", path: path, token: tok, body: map[string]any{"text": "x"}, header: map[string]string{"Prefer": p}})
	}

	t.Run("final in time", func(t *testing.T) {
		e.cmds.mu.Lock()
		e.cmds.onSubmit = func(c companion.Command) {
			go e.cmds.set(t, c.ID, companion.StateSucceeded)
		}
		e.cmds.mu.Unlock()
		defer func() { e.cmds.mu.Lock(); e.cmds.onSubmit = nil; e.cmds.mu.Unlock() }()
		r := prefer("wait=2")
		require.Equal(t, 200, r.status, "%s", r.body)
		assert.Equal(t, "wait=2", r.header.Get("Preference-Applied"))
		assert.Equal(t, "succeeded", r.json(t)["state"])
		assert.NotEmpty(t, r.header.Get("Location"))
	})
	t.Run("not final in time", func(t *testing.T) {
		start := time.Now()
		r := prefer("respond-async, wait=1")
		require.Equal(t, 202, r.status, "%s", r.body)
		assert.GreaterOrEqual(t, time.Since(start), time.Second)
		assert.Empty(t, r.header.Get("Preference-Applied"))
		assert.Equal(t, "queued", r.json(t)["state"])
	})
	t.Run("malformed preferences are ignored", func(t *testing.T) {
		for _, p := range []string{"wait=abc", "wait=-1", "wait", "wait=1.5"} {
			r := prefer(p)
			require.Equal(t, 202, r.status, "Prefer %q", p)
		}
	})
	t.Run("capped at MaxWait, on GET of one command", func(t *testing.T) {
		r := prefer("")
		id := r.json(t)["id"].(string)
		e.cmds.set(t, id, companion.StateFailed)
		r = e.send(req{method: "GET", path: "/api/v1/devices/dev-1/commands/" + id, token: tok, header: map[string]string{"Prefer": "wait=99999999999999999999"}})
		require.Equal(t, 200, r.status)
		assert.Equal(t, "wait=3", r.header.Get("Preference-Applied"))
		assert.Equal(t, "failed", r.json(t)["state"])
	})
	t.Run("GET waits for the command", func(t *testing.T) {
		r := prefer("")
		id := r.json(t)["id"].(string)
		done := make(chan resp)
		go func() {
			done <- e.send(req{method: "GET", path: "/api/v1/devices/dev-1/commands/" + id, token: tok, header: map[string]string{"Prefer": "wait=3"}})
		}()
		e.cmds.set(t, id, companion.StateInProgress)
		e.cmds.set(t, id, companion.StateSucceeded)
		select {
		case r := <-done:
			require.Equal(t, 200, r.status)
			assert.Equal(t, "succeeded", r.json(t)["state"])
		case <-time.After(10 * time.Second):
			t.Fatal("GET with Prefer: wait never answered")
		}
	})
}

func TestQueueFull(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.cmds.mu.Lock()
	e.cmds.queueFull = true
	e.cmds.mu.Unlock()
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "x"})
	require.Equal(t, 429, r.status)
	assert.Equal(t, CodeQueueFull, r.problem(t).Code)
	assert.Equal(t, "5", r.header.Get("Retry-After"))
}

func TestInternalErrorsSayNothing(t *testing.T) {
	for _, mode := range []string{"error", "panic"} {
		t.Run(mode, func(t *testing.T) {
			base := newEnv(t)
			tok := base.bound("dev-1")
			fs := &failingStore{DB: base.db, failStatus: mode == "error", panicStatus: mode == "panic"}
			e := newEnvWith(t, base.db, fs)
			r := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
			require.Equal(t, 500, r.status)
			p := r.problem(t)
			assert.Equal(t, CodeInternal, p.Code)
			assert.Equal(t, "internal error", p.Detail)
			for _, leak := range []string{"/var/lib", "input/output", "secret", "exploded", "goroutine", ".go:"} {
				assert.NotContains(t, string(r.body), leak)
			}
			// The server lives on.
			assert.Equal(t, 200, e.do("GET", "/healthz", "", nil).status)
		})
	}
	t.Run("closed store", func(t *testing.T) {
		e := newEnv(t)
		tok := e.bound("dev-1")
		require.NoError(t, e.db.Close())
		r := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
		require.GreaterOrEqual(t, r.status, 500)
		p := r.problem(t)
		assert.Equal(t, "internal error", p.Detail)
		assert.NotContains(t, string(r.body), "database")
	})
}

func TestAdmin(t *testing.T) {
	e := newEnv(t, func(o *Options) {
		o.Limits.MaxFirmwareBytes = 1000
		o.Limits.MaxAppBytes = 500
	})
	admin := func(method, path string, body any) resp {
		return e.do(method, path, testAdminToken, body)
	}
	raw := func(path string, body []byte) resp {
		return e.send(req{method: "PUT", path: path, token: testAdminToken, body: body, header: map[string]string{"Content-Type": "application/octet-stream"}})
	}

	r := admin("POST", "/api/v1/admin/users", map[string]any{"name": "hank"})
	require.Equal(t, 201, r.status)
	u := r.json(t)
	assert.Len(t, u["user_id"], 36)
	assert.Equal(t, "hank", u["name"])
	runBodyCases(t, e, "POST", "/api/v1/admin/users", testAdminToken, []bodyCase{
		{"name missing", map[string]any{}, 422, []string{"name"}},
		{"name 129", map[string]any{"name": strings.Repeat("n", 129)}, 422, []string{"name"}},
		{"name type", `{"name":[]}`, 400, []string{"name"}},
	})

	runBodyCases(t, e, "POST", "/api/v1/admin/devices", testAdminToken, []bodyCase{
		{"ok", map[string]any{"device_id": "d-1", "claim_code": "c", "model": "sim-1"}, 201, nil},
		{"again", map[string]any{"device_id": "d-1", "claim_code": "c", "model": "sim-1"}, 409, nil},
		{"all bad", map[string]any{"device_id": "d 1", "claim_code": "", "model": "a/b"}, 422, []string{"device_id", "claim_code", "model"}},
	})
	runBodyCases(t, e, "POST", "/api/v1/admin/bridges", testAdminToken, []bodyCase{
		{"ok", map[string]any{"bridge_id": "b-1"}, 201, nil},
		{"again", map[string]any{"bridge_id": "b-1"}, 409, nil},
		{"bad id", map[string]any{"bridge_id": "b/1"}, 422, []string{"bridge_id"}},
		{"missing", map[string]any{}, 422, []string{"bridge_id"}},
	})

	fw := firmwareImage(t, "1.0.0", 1000)
	r = raw("/api/v1/admin/firmware/sim-1/1.0.0", fw)
	require.Equal(t, 201, r.status, "%s", r.body)
	sum := sha256.Sum256(fw)
	assert.Equal(t, map[string]any{"model": "sim-1", "version": "1.0.0", "sha256": hex.EncodeToString(sum[:]), "size": 1000.0}, r.json(t))
	r = raw("/api/v1/admin/firmware/sim-1/1.0.0", fw)
	assert.Less(t, r.status, 300, "the same content again is fine: %s", r.body)
	r = raw("/api/v1/admin/firmware/sim-1/1.0.0", firmwareImage(t, "1.0.0", 900))
	assert.Equal(t, 409, r.status)
	assert.Equal(t, CodeFirmwareExists, r.problem(t).Code)
	r = raw("/api/v1/admin/firmware/sim-1/1.0.1", append(fw, 'x'))
	assert.Equal(t, 413, r.status)
	assert.Equal(t, CodeBodyTooLarge, r.problem(t).Code)
	r = raw("/api/v1/admin/firmware/sim-1/1.0", fw)
	assert.Equal(t, 422, r.status)
	assert.Equal(t, []string{"version"}, r.problem(t).fields())
	r = raw("/api/v1/admin/firmware/sim%201/1.0.0", fw)
	assert.Equal(t, 404, r.status)
	r = raw("/api/v1/admin/firmware/sim-1/2.0.0", nil)
	assert.Equal(t, 422, r.status)
	assert.Equal(t, []string{"body"}, r.problem(t).fields())

	r = raw("/api/v1/admin/apps/clock/1.0.0", []byte("clock"))
	require.Equal(t, 201, r.status, "%s", r.body)
	assert.Equal(t, "clock", r.json(t)["app_id"])
	r = raw("/api/v1/admin/apps/clock/1.0.1", bytes.Repeat([]byte("a"), 501))
	assert.Equal(t, 413, r.status)
	r = raw("/api/v1/admin/apps/Clock/1.0.0", []byte("x"))
	assert.Equal(t, 404, r.status)
	r = raw("/api/v1/admin/apps/clock/1.0.0", []byte("other"))
	assert.Equal(t, 409, r.status)
	assert.Equal(t, CodeAppReleaseExists, r.problem(t).Code)
	raw("/api/v1/admin/apps/clock/1.2.0", []byte("clock 1.2"))
	raw("/api/v1/admin/apps/alarm/0.1.0", []byte("alarm"))

	tok := e.user("ivy")
	r = e.do("GET", "/api/v1/apps", tok, nil)
	require.Equal(t, 200, r.status)
	apps := r.json(t)["apps"].([]any)
	require.Len(t, apps, 2)
	clock := apps[1].(map[string]any)
	assert.Equal(t, "clock", clock["app_id"])
	assert.Equal(t, "1.2.0", clock["version"])
	assert.Equal(t, []any{"1.0.0", "1.2.0"}, clock["versions"])
}

// Publishing a firmware image or an app package again with the same
// content changes nothing, and says so with a 200 (docs/api.md, and the
// 200 of api/openapi.json); only the first upload created the release.
func TestRepublishingTheSameContentIs200(t *testing.T) {
	e := newEnv(t)
	for _, tt := range []struct {
		name, path string
		body       []byte
	}{
		{"firmware", "/api/v1/admin/firmware/sim-1/1.0.0", firmwareImage(t, "1.0.0", 1000)},
		{"app", "/api/v1/admin/apps/clock/1.0.0", []byte("clock")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			put := func() resp {
				return e.send(req{method: "PUT", path: tt.path, token: testAdminToken, body: tt.body,
					header: map[string]string{"Content-Type": "application/octet-stream"}})
			}
			first := put()
			require.Equal(t, 201, first.status, "%s", first.body)
			again := put()
			assert.Equal(t, 200, again.status, "PUT %s again with the same content: %s", tt.path, again.body)
			assert.Equal(t, first.json(t), again.json(t))
		})
	}
}

// putFirmware publishes firmware 1.0.0 of sim-1, an image of size bytes,
// and returns it with its SHA-256.
func putFirmware(t *testing.T, e *env, size int) (content []byte, sha string) {
	t.Helper()
	content = firmwareImage(t, "1.0.0", size)
	r := e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/1.0.0", token: testAdminToken, body: content,
		header: map[string]string{"Content-Type": "application/octet-stream"}})
	require.Equal(t, 201, r.status, "%s", r.body)
	return content, r.json(t)["sha256"].(string)
}

func TestBlobs(t *testing.T) {
	e := newEnv(t)
	content, sha := putFirmware(t, e, 10000)
	br := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "b-1"})
	secret := br.json(t)["secret"].(string)
	other := e.do("POST", "/api/v1/admin/bridges", testAdminToken, map[string]any{"bridge_id": "b-2"}).json(t)["secret"].(string)
	path := "/api/v1/blobs/" + sha

	// A bridge gets a blob only while an unfinished command of a device it
	// serves references it (CONTRACT §9).
	r := e.do("GET", path, secret, nil)
	require.Equal(t, 404, r.status, "a blob no command of the bridge's needs")
	assert.Equal(t, CodeBlobNotFound, r.problem(t).Code)
	r = e.do("POST", "/api/v1/admin/devices", testAdminToken, map[string]any{"device_id": "dev-b", "claim_code": "code-b", "model": "sim-1", "bridge_id": "b-1"})
	require.Equal(t, 201, r.status, "%s", r.body)
	ctx := context.Background()
	cmd, _, err := e.db.CreateCommand(ctx, companion.Command{DeviceID: "dev-b", Op: topics.OpOTAUpdate, Payload: []byte(`{}`), Blob: sha}, 0, nil)
	require.NoError(t, err)
	r = e.do("GET", path, other, nil)
	assert.Equal(t, 404, r.status, "another bridge's device's blob")

	r = e.do("GET", path, secret, nil)
	require.Equal(t, 200, r.status)
	assert.Equal(t, content, r.body)
	assert.Equal(t, "bytes", r.header.Get("Accept-Ranges"))

	r = e.send(req{method: "GET", path: path, token: secret, header: map[string]string{"Range": "bytes=1000-1999"}})
	require.Equal(t, http.StatusPartialContent, r.status)
	assert.Equal(t, content[1000:2000], r.body)
	assert.Equal(t, "bytes 1000-1999/10000", r.header.Get("Content-Range"))

	r = e.send(req{method: "GET", path: path, token: secret, header: map[string]string{"Range": "bytes=9990-"}})
	require.Equal(t, http.StatusPartialContent, r.status)
	assert.Equal(t, content[9990:], r.body)

	// A range it cannot serve is a problem (CONTRACT §2), with the
	// content's length (RFC 9110 §15.5.17); one that is not a range at
	// all is ignored (TestBlobRanges).
	for _, rng := range []string{"bytes=20000-"} {
		r = e.send(req{method: "GET", path: path, token: secret, header: map[string]string{"Range": rng}})
		require.Equal(t, http.StatusRequestedRangeNotSatisfiable, r.status, rng)
		assert.Equal(t, CodeRangeNotSatisfiable, r.problem(t).Code, rng)
		assert.Equal(t, "bytes */10000", r.header.Get("Content-Range"), rng)
		assert.Empty(t, r.header.Get("ETag"), "%s: a problem is not the blob", rng)
	}

	r = e.do("GET", path, testAdminToken, nil)
	assert.Equal(t, 200, r.status)

	for _, bad := range []string{strings.Repeat("a", 64), strings.ToUpper(sha), "abc", sha + "0"} {
		r = e.do("GET", "/api/v1/blobs/"+bad, secret, nil)
		require.Equal(t, 404, r.status, bad)
		assert.Equal(t, CodeBlobNotFound, r.problem(t).Code)
	}

	// Once the command is final, the bridge needs it no more.
	_, err = e.db.UpdateCommand(ctx, cmd.ID, func(c *companion.Command) error { c.State = companion.StateSucceeded; return nil })
	require.NoError(t, err)
	r = e.do("GET", path, secret, nil)
	assert.Equal(t, 404, r.status, "the blob of a finished command")
	r = e.do("GET", path, testAdminToken, nil)
	assert.Equal(t, 200, r.status, "the admin gets any blob")
}

// A blob's If-Match or If-Unmodified-Since that fails is the client's
// 412 (RFC 9110 §13.1.1, §13.1.4), as a problem: never a 500, and never
// with the cache headers of the content.
func TestBlobPreconditions(t *testing.T) {
	e := newEnv(t)
	_, sha := putFirmware(t, e, 1000)
	path := "/api/v1/blobs/" + sha
	hourAgo := time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat)
	for _, method := range []string{"GET", "HEAD"} {
		for _, tc := range []struct {
			name   string
			header map[string]string
			status int
		}{
			{"If-Match another", map[string]string{"If-Match": `"0000"`}, http.StatusPreconditionFailed},
			{"If-Match another, with a range", map[string]string{"If-Match": `"0000"`, "Range": "bytes=10-"}, http.StatusPreconditionFailed},
			{"If-Unmodified-Since before it was stored", map[string]string{"If-Unmodified-Since": hourAgo}, http.StatusPreconditionFailed},
			{"If-Match its ETag", map[string]string{"If-Match": `"` + sha + `"`}, http.StatusOK},
			{"If-Match any", map[string]string{"If-Match": "*"}, http.StatusOK},
		} {
			r := e.send(req{method: method, path: path, token: testAdminToken, header: tc.header})
			require.Equal(t, tc.status, r.status, "%s %s: %s", method, tc.name, r.body)
			if tc.status != http.StatusPreconditionFailed {
				continue
			}
			for _, h := range []string{"ETag", "Cache-Control", "Last-Modified", "Content-Range"} {
				assert.Empty(t, r.header.Get(h), "%s %s: %s of a problem", method, tc.name, h)
			}
			if method == "GET" {
				assert.Equal(t, CodePreconditionFailed, r.problem(t).Code, tc.name)
			}
		}
	}
}

// A suffix range of length 0 ("bytes=-0") is unsatisfiable (RFC 9110
// §14.1.1): alone it is a 416 with the content's length, never the 206 of
// an empty part that http.ServeContent gives it; beside a satisfiable
// range it is left out. Preconditions and If-Range still come first.
func TestBlobEmptySuffixRange(t *testing.T) {
	e := newEnv(t)
	content, sha := putFirmware(t, e, 1000)
	path := "/api/v1/blobs/" + sha
	etag := `"` + sha + `"`
	for _, method := range []string{"GET", "HEAD"} {
		for _, tc := range []struct {
			header map[string]string
			status int
			rng    string // the Content-Range of the answer
		}{
			{map[string]string{"Range": "bytes=-0"}, http.StatusRequestedRangeNotSatisfiable, "bytes */1000"},
			{map[string]string{"Range": "bytes=-000"}, http.StatusRequestedRangeNotSatisfiable, "bytes */1000"},
			{map[string]string{"Range": "bytes= -0 , -0"}, http.StatusRequestedRangeNotSatisfiable, "bytes */1000"},
			{map[string]string{"Range": "bytes=-0,5000-"}, http.StatusRequestedRangeNotSatisfiable, "bytes */1000"},
			{map[string]string{"Range": "bytes=-0", "If-Range": etag}, http.StatusRequestedRangeNotSatisfiable, "bytes */1000"},
			{map[string]string{"Range": "bytes=-0,10-19"}, http.StatusPartialContent, "bytes 10-19/1000"},
			{map[string]string{"Range": "bytes=-1"}, http.StatusPartialContent, "bytes 999-999/1000"},
			// If-Range of another version: the whole content, as always.
			{map[string]string{"Range": "bytes=-0", "If-Range": `"other"`}, http.StatusOK, ""},
			{map[string]string{"Range": "bytes=-0", "If-None-Match": etag}, http.StatusNotModified, ""},
			{map[string]string{"Range": "bytes=-0", "If-Match": `"other"`}, http.StatusPreconditionFailed, ""},
		} {
			r := e.send(req{method: method, path: path, token: testAdminToken, header: tc.header})
			require.Equal(t, tc.status, r.status, "%s %v: %s", method, tc.header, r.body)
			assert.Equal(t, tc.rng, r.header.Get("Content-Range"), "%s %v", method, tc.header)
			if method != "GET" {
				continue
			}
			switch tc.status {
			case http.StatusRequestedRangeNotSatisfiable:
				assert.Equal(t, CodeRangeNotSatisfiable, r.problem(t).Code)
			case http.StatusPartialContent:
				if tc.rng == "bytes 10-19/1000" {
					assert.Equal(t, content[10:20], r.body)
				} else {
					assert.Equal(t, content[999:], r.body)
				}
			case http.StatusOK:
				assert.Equal(t, content, r.body)
			}
		}
	}
}

// A blob's Range is read as RFC 9110 §14.1-14.2 have it: a header that
// is not a valid byte-ranges specifier (another unit, not digits, a
// last-pos before its first-pos) is ignored and the whole content served
// (200); 416 is only for valid ranges none of which is satisfiable; the
// unit is case-insensitive, and numbers of any length are numbers.
// http.ServeContent alone answers 416 to the first four kinds.
func TestBlobRanges(t *testing.T) {
	e := newEnv(t)
	content, sha := putFirmware(t, e, 1000)
	path := "/api/v1/blobs/" + sha
	const huge = "99999999999999999999" // past an int64
	for _, tc := range []struct {
		rng    string
		status int
		cr     string // the answer's Content-Range
		body   []byte // of a 200 or a 206 of one range
	}{
		{"bytes=5-1", http.StatusOK, "", content},
		{"bytes=0-9,5-1", http.StatusOK, "", content},
		{"bytes=-0,5-1", http.StatusOK, "", content},
		{"items=0-9", http.StatusOK, "", content},
		{"bytes=x-y", http.StatusOK, "", content},
		{"bytes=", http.StatusOK, "", content},
		{"bytes=,", http.StatusOK, "", content},
		{"bytes=-", http.StatusOK, "", content},
		{"bytes=5", http.StatusOK, "", content},
		{"bytes=1-2-3", http.StatusOK, "", content},
		{"bytes=+5-", http.StatusOK, "", content},
		{"bytes=-+5", http.StatusOK, "", content},
		{"bytes=5 - 9", http.StatusOK, "", content},
		{"bytes 0-9", http.StatusOK, "", content},
		{huge + "-" + huge[1:], http.StatusOK, "", content},
		{"bytes=" + huge + "-" + huge[1:], http.StatusOK, "", content},
		{"Bytes=0-9", http.StatusPartialContent, "bytes 0-9/1000", content[:10]},
		{"BYTES=990-", http.StatusPartialContent, "bytes 990-999/1000", content[990:]},
		{"bytes=0-" + huge, http.StatusPartialContent, "bytes 0-999/1000", content},
		{"bytes=-" + huge, http.StatusPartialContent, "bytes 0-999/1000", content},
		{"bytes=-1000", http.StatusPartialContent, "bytes 0-999/1000", content},
		{"bytes=007-009", http.StatusPartialContent, "bytes 7-9/1000", content[7:10]},
		{"bytes=999-", http.StatusPartialContent, "bytes 999-999/1000", content[999:]},
		{"bytes=5-5", http.StatusPartialContent, "bytes 5-5/1000", content[5:6]},
		{"bytes= , 0-9 ,", http.StatusPartialContent, "bytes 0-9/1000", content[:10]},
		{"bytes=0-0,2000-", http.StatusPartialContent, "bytes 0-0/1000", content[:1]},
		{"bytes=0-9,20-29", http.StatusPartialContent, "", nil}, // multipart/byteranges
		{"bytes=1000-", http.StatusRequestedRangeNotSatisfiable, "bytes */1000", nil},
		{"bytes=1000-1000", http.StatusRequestedRangeNotSatisfiable, "bytes */1000", nil},
		{"bytes=" + huge + "-", http.StatusRequestedRangeNotSatisfiable, "bytes */1000", nil},
		{"bytes=-0,1000-", http.StatusRequestedRangeNotSatisfiable, "bytes */1000", nil},
	} {
		r := e.send(req{method: "GET", path: path, token: testAdminToken, header: map[string]string{"Range": tc.rng}})
		if !assert.Equal(t, tc.status, r.status, "Range: %s: %.200s", tc.rng, r.body) {
			continue
		}
		assert.Equal(t, tc.cr, r.header.Get("Content-Range"), "Range: %s", tc.rng)
		switch {
		case tc.status == http.StatusRequestedRangeNotSatisfiable:
			assert.Equal(t, CodeRangeNotSatisfiable, r.problem(t).Code, "Range: %s", tc.rng)
		case tc.body != nil:
			assert.Equal(t, tc.body, r.body, "Range: %s", tc.rng)
		default:
			assert.True(t, strings.HasPrefix(r.header.Get("Content-Type"), "multipart/byteranges;"), "Range: %s: %s", tc.rng, r.header.Get("Content-Type"))
		}
	}
	// Up to 200 ranges are served as parts; more, however short, are
	// served as the whole content, as Apache's MaxRanges has it. Each
	// case's ranges add up to no more than the content, which
	// ServeContent alone serves as parts, however many.
	ranges := func(n int) string {
		specs := make([]string, n)
		for i := range specs {
			specs[i] = fmt.Sprintf("%d-%d", i%500*2, i%500*2)
		}
		return "bytes=" + strings.Join(specs, ",")
	}
	for _, tc := range []struct {
		n      int
		status int
	}{{2, http.StatusPartialContent}, {200, http.StatusPartialContent}, {201, http.StatusOK}, {1000, http.StatusOK}} {
		r := e.send(req{method: "GET", path: path, token: testAdminToken, header: map[string]string{"Range": ranges(tc.n)}})
		assert.Equal(t, tc.status, r.status, "%d ranges", tc.n)
		if tc.status == http.StatusOK {
			assert.True(t, bytes.Equal(content, r.body), "%d ranges: the whole content", tc.n)
			continue
		}
		_, params, err := mime.ParseMediaType(r.header.Get("Content-Type"))
		require.NoError(t, err)
		parts := 0
		for mr := multipart.NewReader(bytes.NewReader(r.body), params["boundary"]); ; parts++ {
			if _, err := mr.NextPart(); err != nil {
				require.ErrorIs(t, err, io.EOF)
				break
			}
		}
		assert.Equal(t, tc.n, parts, "%d ranges", tc.n)
	}
	// An ignored Range leaves the preconditions as they are.
	r := e.send(req{method: "GET", path: path, token: testAdminToken, header: map[string]string{"Range": "bytes=5-1", "If-Match": `"other"`}})
	assert.Equal(t, http.StatusPreconditionFailed, r.status, "%s", r.body)
	r = e.send(req{method: "GET", path: path, token: testAdminToken, header: map[string]string{"Range": "bytes=5-1", "If-None-Match": `"` + sha + `"`}})
	assert.Equal(t, http.StatusNotModified, r.status, "%s", r.body)
}

func TestProblemShape(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "", "title": strings.Repeat("t", 200)})
	require.Equal(t, 422, r.status)
	p := r.problem(t)
	assert.Equal(t, "urn:companion:problem:validation_failed", p.Type)
	assert.NotEmpty(t, p.Title)
	assert.NotEmpty(t, p.Detail)
	assert.Equal(t, CodeValidationFailed, p.Code)
	assert.Equal(t, []FieldError{{Field: "text", Message: "is required"}, {Field: "title", Message: "must be at most 128 bytes"}}, p.Errors)
}

func TestNewChecksOptions(t *testing.T) {
	_, err := New(Options{})
	assert.Error(t, err)
	e := newEnv(t)
	_, err = New(Options{Store: e.db, Commands: e.cmds, Limits: Limits{MinTTL: time.Hour, MaxTTL: time.Minute}})
	assert.Error(t, err)
	s, err := New(Options{Store: e.db, Commands: e.cmds})
	require.NoError(t, err)
	assert.Equal(t, DefaultLimits, s.limits)
	// Near int64's end the body limits wrapped: a text past 64 KiB, or
	// every image, was refused; with MaxJSONBody every body read empty.
	for _, l := range []Limits{
		{MaxTextBytes: math.MaxInt64}, {MaxTextBytes: 1 << 61}, {MaxTitleBytes: int(MaxByteLimit + 1)},
		{MaxImageBytes: math.MaxInt64}, {MaxAppBytes: math.MaxInt64}, {MaxFirmwareBytes: MaxByteLimit + 1}, {MaxJSONBody: math.MaxInt64},
	} {
		if _, err := New(Options{Store: e.db, Commands: e.cmds, Limits: l}); err == nil || !strings.Contains(err.Error(), "1 TiB") {
			t.Errorf("New with limits %+v = %v; want an error: over 1 TiB", l, err)
		}
	}
	l := Limits{MaxTextBytes: int(MaxByteLimit), MaxTitleBytes: int(MaxByteLimit), MaxImageBytes: MaxByteLimit, MaxAppBytes: MaxByteLimit, MaxFirmwareBytes: MaxByteLimit, MaxJSONBody: MaxByteLimit}
	s, err = New(Options{Store: e.db, Commands: e.cmds, Limits: l})
	require.NoError(t, err)
	if tb, ib := s.limits.textBody(), s.limits.imageBody(); tb < 12*MaxByteLimit || ib < MaxByteLimit*4/3 {
		t.Errorf("at 1 TiB limits, text body limit %d and image body limit %d; want 12 TiB and 4/3 TiB and more", tb, ib)
	}
}

// Requests without a valid token are limited per source address, so that
// guessing tokens is hopeless; the address is the TCP peer, whatever
// X-Forwarded-For says, and a valid token from elsewhere is unaffected.
func TestUnauthenticatedRequestsAreLimitedPerSource(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.UnauthPerMinute = 5 })
	tok := e.user("alice")
	for i := 0; i < 5; i++ {
		r := e.send(req{method: "GET", path: "/api/v1/devices", token: fmt.Sprintf("ctk_guess-%d", i)})
		require.Equal(t, http.StatusUnauthorized, r.status)
	}
	for _, h := range []map[string]string{nil, {"X-Forwarded-For": "203.0.113.9"}} {
		r := e.send(req{method: "GET", path: "/api/v1/devices", token: "ctk_guess-again", header: h})
		assert.Equal(t, http.StatusTooManyRequests, r.status, "%s", r.body)
		assert.Equal(t, CodeRateLimited, r.problem(t).Code)
		assert.NotEmpty(t, r.header.Get("Retry-After"))
	}
	// A valid token from the same address still passes, and spends
	// nothing: the allowance is of failures.
	for range 3 {
		r := e.send(req{method: "GET", path: "/api/v1/devices", token: tok})
		assert.Equal(t, http.StatusOK, r.status, "%s", r.body)
	}
	// Admin and blob routes count too; the admin token passes.
	r := e.send(req{method: "POST", path: "/api/v1/admin/users", token: "wrong", body: map[string]any{"name": "x"}})
	assert.Equal(t, http.StatusTooManyRequests, r.status)
	r = e.send(req{method: "GET", path: "/api/v1/blobs/" + strings.Repeat("0", 64), token: "wrong"})
	assert.Equal(t, http.StatusTooManyRequests, r.status)
	r = e.send(req{method: "POST", path: "/api/v1/admin/users", token: testAdminToken, body: map[string]any{"name": "x"}})
	assert.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	r = e.send(req{method: "GET", path: "/api/v1/devices"})
	assert.Equal(t, http.StatusUnauthorized, r.status, "no token at all guesses nothing")
}

// A command without ttl_seconds lives 86400 s (CONTRACT §2).
func TestDefaultTTL(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
	require.Equal(t, http.StatusAccepted, r.status, "%s", r.body)
	var cmd struct {
		CreatedAt time.Time `json:"created_at"`
		ExpiresAt time.Time `json:"expires_at"`
	}
	require.NoError(t, json.Unmarshal(r.body, &cmd))
	ttl := cmd.ExpiresAt.Sub(cmd.CreatedAt)
	assert.InDelta(t, (86400 * time.Second).Seconds(), ttl.Seconds(), 1, "ttl %v", ttl)
}

// An upload is taken with no Content-Type (curl -T sends none) or any
// label of bytes, JSON included; one sent as a form (curl -F, curl -d
// @FILE), whose body is not the file's bytes, is a 415 and publishes
// nothing.
func TestUploadContentTypes(t *testing.T) {
	e := newEnv(t)
	for i, tc := range []struct {
		ctype  string
		status int
	}{
		{"", 201},
		{"application/octet-stream", 201},
		{"application/zip", 201},
		{"application/json", 201},
		{"text/plain; charset=utf-8", 201},
		{"multipart/form-data; boundary=------------------------abc", 415},
		{"Multipart/Form-Data; boundary=x", 415},
		{"application/x-www-form-urlencoded", 415},
	} {
		version := fmt.Sprintf("1.0.%d", i)
		path := "/api/v1/admin/apps/clock/" + version
		r := e.send(req{method: "PUT", path: path, token: testAdminToken, body: []byte("clock " + version), header: map[string]string{"Content-Type": tc.ctype}})
		require.Equal(t, tc.status, r.status, "Content-Type %q: %s", tc.ctype, r.body)
		if tc.status == 415 {
			assert.Equal(t, CodeUnsupportedMedia, r.problem(t).Code)
			_, err := e.db.AppRelease(context.Background(), "clock", version)
			assert.ErrorIs(t, err, companion.ErrNotFound, "Content-Type %q: published", tc.ctype)
		}
	}
	fw := firmwareImage(t, "1.0.0", 1000)
	r := e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/1.0.0", token: testAdminToken, body: fw, header: map[string]string{"Content-Type": "multipart/form-data; boundary=x"}})
	require.Equal(t, 415, r.status, "%s", r.body)
	r = e.send(req{method: "PUT", path: "/api/v1/admin/firmware/sim-1/1.0.0", token: testAdminToken, body: fw, header: map[string]string{"Content-Type": ""}})
	require.Equal(t, 201, r.status, "%s", r.body)
}
