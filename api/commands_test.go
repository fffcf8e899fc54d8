package api

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/store"
)

// unbindingStore unbinds each device right after the API has read its
// binding: an unbind that commits while the request's body is read.
type unbindingStore struct{ *store.DB }

func (s unbindingStore) Binding(ctx context.Context, id string) (companion.Binding, error) {
	b, err := s.DB.Binding(ctx, id)
	if err == nil {
		_, _ = s.DB.Unbind(ctx, id, b.UserID)
	}
	return b, err
}

// A command whose device is unbound after the API checked it is refused
// as the device of another (404), not stored for the device's next owner
// (CONTRACT §9).
func TestCommandAcrossAnUnbindIsRefused(t *testing.T) {
	base := newEnv(t)
	tok := base.bound("dev-1")
	e := newEnvWith(t, base.db, unbindingStore{base.db})
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "too late"})
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, CodeDeviceNotFound, r.problem(t).Code)
	n, err := base.db.CountOpen(context.Background(), "dev-1")
	require.NoError(t, err)
	assert.Zero(t, n, "a command was stored for the unbound device")
}

// A command id in the path is a UUID, whose hex digits are case-insensitive
// on input (RFC 9562 §4), as api/openapi.json's pattern for it allows:
// Swift's UUID.uuidString writes them in upper case. Such an id names the
// command as the lower-case one does, for a read and for a cancel.
func TestCommandIDInUpperCase(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
	require.Equal(t, 202, r.status, "%s", r.body)
	id := r.json(t)["id"].(string)
	upper := "/api/v1/devices/dev-1/commands/" + strings.ToUpper(id)

	r = e.do("GET", upper, tok, nil)
	require.Equal(t, 200, r.status, "GET %s: %s", upper, r.body)
	assert.Equal(t, id, r.json(t)["id"], "the id as the API writes it")

	r = e.do("DELETE", upper, tok, nil)
	require.Equal(t, 200, r.status, "DELETE %s: %s", upper, r.body)
	assert.Equal(t, companion.StateCanceled, r.json(t)["state"])

	// Another user's command stays unknown in any case.
	other := e.bound("dev-2")
	r = e.do("GET", "/api/v1/devices/dev-2/commands/"+strings.ToUpper(id), other, nil)
	require.Equal(t, 404, r.status, "%s", r.body)
	assert.Equal(t, CodeCommandNotFound, r.problem(t).Code)
}

// A cancel repeated with its Idempotency-Key is the same request whatever
// the case of the command id in its path (bug 55 made ids
// case-insensitive): it is answered with the first answer, never 422
// idempotency_key_reused, and in either order of the two spellings.
func TestCancelRepeatWithTheIDInAnotherCase(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	for i, spell := range []func(string) string{strings.ToUpper, strings.ToLower} {
		r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
		require.Equal(t, 202, r.status, "%s", r.body)
		id := r.json(t)["id"].(string)
		key := fmt.Sprintf("cancel-%d", i)
		cancel := func(path string) resp {
			return e.send(req{method: "DELETE", path: path, token: tok, header: map[string]string{"Idempotency-Key": key}})
		}
		first := cancel("/api/v1/devices/dev-1/commands/" + spell(id))
		require.Equal(t, 200, first.status, "%s", first.body)
		other := strings.ToUpper(id)
		if spell(id) == other {
			other = id
		}
		repeat := cancel("/api/v1/devices/dev-1/commands/" + other)
		require.Equal(t, 200, repeat.status, "the repeat, id %s after %s: %s", other, spell(id), repeat.body)
		assert.JSONEq(t, string(first.body), string(repeat.body), "the repeat is the first answer")
	}
}

// TestCancelWithPreferWait cancels a command with Prefer: wait: the
// answer is the command canceled, final, so it says Preference-Applied as
// any command request's final answer does (CONTRACT §2), also the repeat
// of its Idempotency-Key; a cancel refused (409) does not. Without the fix
// the 200 had no Preference-Applied.
func TestCancelWithPreferWait(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
	require.Equal(t, 202, r.status, "%s", r.body)
	path := "/api/v1/devices/dev-1/commands/" + r.json(t)["id"].(string)
	cancel := func(header map[string]string) resp {
		return e.send(req{method: "DELETE", path: path, token: tok, header: header})
	}
	header := map[string]string{"Prefer": "wait=5", "Idempotency-Key": "cancel-1"}
	for _, what := range []string{"the cancel", "its repeat"} {
		r := cancel(header)
		require.Equal(t, 200, r.status, "%s: %s", what, r.body)
		assert.Equal(t, "canceled", r.json(t)["state"], what)
		assert.Equal(t, "wait=5", r.header.Get("Preference-Applied"), what)
	}
	r = cancel(map[string]string{"Prefer": "wait=5"})
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Empty(t, r.header.Get("Preference-Applied"), "a refused cancel")
	r = cancel(nil)
	require.Equal(t, 409, r.status, "%s", r.body)
	assert.Empty(t, r.header.Get("Preference-Applied"), "without Prefer")
}

// staleIdemStore answers the first read of the key `key` with what the
// store held then, but only once `release` is closed, having said on
// `read` that it read: a request whose read of its key came before the
// first request with the key stored its command.
type staleIdemStore struct {
	*store.DB
	key     string
	held    atomic.Bool
	read    chan struct{}
	release chan struct{}
}

func (s *staleIdemStore) Idempotency(ctx context.Context, userID, key string) (companion.Idempotency, error) {
	rec, err := s.DB.Idempotency(ctx, userID, key)
	if key == s.key && s.held.CompareAndSwap(false, true) {
		close(s.read)
		<-s.release
	}
	return rec, err
}

// A repeat of a settings change that overlaps its first request is
// answered with the first request's command by the store (which checks
// the key as it stores the command), and creates nothing: it must not
// write its values into the desired settings again either, over those of a
// change accepted after the first (CONTRACT §2, Idempotency-Key; §8).
func TestOverlappingSettingsRepeatChangesNothing(t *testing.T) {
	base := newEnv(t)
	tok := base.bound("dev-1")
	base.reportSettings("dev-1")
	st := &staleIdemStore{DB: base.db, key: "s-A", read: make(chan struct{}), release: make(chan struct{})}
	e := newEnvWith(t, base.db, st)
	put := func(key string, volume int) resp {
		return e.send(req{method: "PUT", path: "/api/v1/devices/dev-1/settings", token: tok,
			body: map[string]any{"volume": volume}, header: map[string]string{"Idempotency-Key": key}})
	}

	// Released on any return, so that a failure does not leave the
	// server's Close waiting for the held request.
	release := sync.OnceFunc(func() { close(st.release) })
	defer release()
	late := make(chan resp, 1)
	go func() { late <- put("s-A", 3) }() // its read of s-A finds nothing yet
	<-st.read
	first := put("s-A", 3)
	require.Equal(t, 202, first.status, "%s", first.body)
	next := put("s-B", 7)
	require.Equal(t, 202, next.status, "%s", next.body)
	release()
	repeat := <-late
	require.Equal(t, 202, repeat.status, "%s", repeat.body)
	assert.Equal(t, first.json(t)["id"], repeat.json(t)["id"], "the repeat answers the first command")
	assert.Equal(t, 2, e.cmds.count(), "the repeat created no command")

	r := e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	assert.Equal(t, float64(7), r.json(t)["desired"].(map[string]any)["volume"],
		"desired holds the last change accepted, not the repeat's")
}

// Two settings changes that overlap keep, as desired, the values of the
// one accepted last: the device runs the commands in the order of their
// ids and reports the last one's values, so desired must follow that
// order, whatever order the two requests finish in (CONTRACT §2, §8). The
// first request is held right after the store took its command, until
// the second has been answered: when the desired values were merged in a
// write of their own after the command, the first's came last, and
// GET …/settings showed them as desired, pending for ever.
func TestOverlappingSettingsChangesKeepTheirOrder(t *testing.T) {
	e := newEnv(t)
	tok := e.bound("dev-1")
	e.reportSettings("dev-1")
	put := func(volume int) resp {
		return e.do("PUT", "/api/v1/devices/dev-1/settings", tok, map[string]any{"volume": volume})
	}

	var held atomic.Bool
	stored := make(chan struct{})
	release := make(chan struct{})
	// Released on any return, so that a failure does not leave the
	// server's Close waiting for the held request.
	done := sync.OnceFunc(func() { close(release) })
	defer done()
	e.cmds.mu.Lock()
	e.cmds.onSubmit = func(companion.Command) {
		if held.CompareAndSwap(false, true) {
			close(stored)
			<-release
		}
	}
	e.cmds.mu.Unlock()

	slow := make(chan resp, 1)
	go func() { slow <- put(3) }()
	<-stored
	fast := put(7)
	require.Equal(t, 202, fast.status, "%s", fast.body)
	done()
	first := <-slow
	require.Equal(t, 202, first.status, "%s", first.body)
	require.Less(t, first.json(t)["id"].(string), fast.json(t)["id"].(string), "the held request's command is the first")

	r := e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	s := r.json(t)
	assert.Equal(t, float64(7), s["desired"].(map[string]any)["volume"],
		"desired holds the value of the command accepted last, which the device runs last")
	assert.Contains(t, s["pending"], "volume")
}

// A setting's value asked for in another spelling of the same number
// (7.0, 7e0 for the int 7) is the value the device is sent, 7, and the one
// it reports back. Once reported it is no longer desired, as with 7: when
// desired kept the spelling as sent, the store (which drops a desired
// value the device reports by its text) kept it for good, and once the
// device changed the setting itself, GET …/settings listed it as pending
// for ever (CONTRACT §2, §8).
func TestSettingSpelledOtherwiseIsNotDesiredOnceReported(t *testing.T) {
	for _, tt := range []struct{ spelling, value string }{
		{"7", "7"}, {"7.0", "7"}, {"7e0", "7"}, {"70e-1", "7"}, {"7.000000000000000000", "7"},
		{"-0", "0"}, {"-0.0", "0"}, {"0e5", "0"}, // -0 is 0, as the device reports it
	} {
		spelling := tt.spelling
		t.Run(spelling, func(t *testing.T) {
			e := newEnv(t)
			tok := e.bound("dev-1")
			e.reportSettings("dev-1")
			report := func(volume string) {
				t.Helper()
				reported := map[string]json.RawMessage{
					"brightness": json.RawMessage("50"), "volume": json.RawMessage(volume), "do_not_disturb": json.RawMessage("false"),
					"timezone": json.RawMessage(`"UTC"`), "language": json.RawMessage(`"en"`), "display_timeout_s": json.RawMessage("30"),
				}
				_, err := e.db.PutReportedSettings(t.Context(), "dev-1", "", reported, nil, time.Now(), uint64(time.Now().UnixNano()))
				require.NoError(t, err)
			}
			r := e.do("PUT", "/api/v1/devices/dev-1/settings", tok, `{"volume": `+spelling+`}`)
			require.Equal(t, 202, r.status, "%s", r.body)

			report(tt.value)
			r = e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
			require.Equal(t, 200, r.status, "%s", r.body)
			assert.Empty(t, r.json(t)["desired"], "desired after the device reported volume %s, asked for as %s", tt.value, spelling)

			report("9") // changed on the device
			r = e.do("GET", "/api/v1/devices/dev-1/settings", tok, nil)
			require.Equal(t, 200, r.status, "%s", r.body)
			assert.Empty(t, r.json(t)["pending"], "pending after the device applied volume %s, then changed it itself", spelling)
		})
	}
}
