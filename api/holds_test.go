package api

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/openapitest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// TestWaitsPerUserAreBounded holds two GETs of a command with Prefer:
// wait for one user whose bound is two: a third request of theirs with
// Prefer: wait, a push or a GET, is a 429 too_many_waits with Retry-After,
// and the push creates no command, while the same push without a wait (or
// with wait=0) and another user's wait go through; once the two are
// answered the user's waits pass again. Without the bound the third push
// was held like the others, and answered 202 when its wait ran out.
func TestWaitsPerUserAreBounded(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Limits.MaxWaitsPerUser = 2 })
	tok := e.bound("dev-1")
	other := e.bound("dev-2")
	push := func(token, dev, prefer string) resp {
		return e.send(req{method: "POST", path: "/api/v1/devices/" + dev + "/push/text", token: token,
			body: map[string]any{"text": "x"}, header: map[string]string{"Prefer": prefer}})
	}
	r := push(tok, "dev-1", "")
	require.Equal(t, http.StatusAccepted, r.status, "%s", r.body)
	id := r.json(t)["id"].(string)

	held := make(chan resp, 2)
	for range 2 {
		go func() {
			held <- e.send(req{method: "GET", path: "/api/v1/devices/dev-1/commands/" + id, token: tok,
				header: map[string]string{"Prefer": "wait=20"}})
		}()
	}
	testenv.Eventually(t, 10*time.Second, "two GETs held by their wait", func() bool { return e.cmds.waiters() == 2 })
	answered := func() {
		t.Helper()
		e.cmds.set(t, id, companion.StateSucceeded)
		for range 2 {
			select {
			case r := <-held:
				require.Equal(t, http.StatusOK, r.status, "%s", r.body)
			case <-time.After(10 * time.Second):
				t.Fatal("a held GET was never answered")
			}
		}
	}

	n := e.cmds.count()
	r = push(tok, "dev-1", "wait=3")
	if r.status != http.StatusTooManyRequests {
		answered()
		t.Fatalf("a third wait: %d %s; want 429", r.status, r.body)
	}
	p := r.problem(t)
	assert.Equal(t, CodeTooManyWaits, p.Code)
	assert.Contains(t, p.Detail, "2 requests")
	assert.Equal(t, "1", r.header.Get("Retry-After"))
	assert.Equal(t, n, e.cmds.count(), "a push refused for its wait created a command")

	r = e.send(req{method: "GET", path: "/api/v1/devices/dev-1/commands/" + id, token: tok, header: map[string]string{"Prefer": "wait=3"}})
	assert.Equal(t, http.StatusTooManyRequests, r.status, "a third GET with a wait: %s", r.body)
	assert.Equal(t, http.StatusAccepted, push(tok, "dev-1", "").status, "without Prefer: wait")
	assert.Equal(t, http.StatusAccepted, push(tok, "dev-1", "wait=0").status, "wait=0 holds nothing")

	// Another user's waits are theirs.
	e.cmds.mu.Lock()
	e.cmds.onSubmit = func(c companion.Command) { go e.cmds.set(t, c.ID, companion.StateSucceeded) }
	e.cmds.mu.Unlock()
	r = push(other, "dev-2", "wait=20")
	require.Equal(t, http.StatusOK, r.status, "another user's wait: %s", r.body)

	answered()
	testenv.Eventually(t, 10*time.Second, "the waits given back", func() bool {
		r := push(tok, "dev-1", "wait=20")
		return r.status == http.StatusOK && r.header.Get("Preference-Applied") == "wait=20"
	})
}

// TestStreamsPerUserAreBounded opens two event streams for a user whose
// bound is two: a third, GET or HEAD, is a 429 too_many_streams with
// Retry-After, another user's stream opens, and once one of the two is
// closed the user's next stream opens. Without the bound the third
// opened.
func TestStreamsPerUserAreBounded(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{}, func(o *Options) { o.Limits.MaxStreamsPerUser = 2 })
	tok := e.bound("dev-1")
	other := e.bound("dev-2")
	first := e.stream(t, tok, "", nil)
	e.stream(t, tok, "?device_id=dev-1", nil)

	for _, method := range []string{"GET", "HEAD"} {
		r := e.refusedStream(t, method, tok, "")
		require.Equal(t, http.StatusTooManyRequests, r.status, "%s a third stream: %s", method, r.body)
		if method == "GET" {
			p := r.problem(t)
			assert.Equal(t, CodeTooManyStreams, p.Code)
			assert.Contains(t, p.Detail, "2 event streams")
		}
		assert.Equal(t, "2", r.header.Get("Retry-After"), method)
	}
	e.stream(t, other, "", nil) // another user's

	first.Close()
	testenv.Eventually(t, 10*time.Second, "the closed stream's place given back", func() bool {
		return e.refusedStream(t, "HEAD", tok, "").status == http.StatusOK
	})
	s := e.stream(t, tok, "", nil)
	e.push(t, tok, "dev-1")
	assert.Equal(t, "command", s.next(t).event)
}

// refusedStream asks for a stream with method and query: a HEAD's answer,
// or a GET's refusal, checked against api/openapi.json. A GET stream that
// opens fails the test at once, rather than being read until it ends.
func (e *eventsEnv) refusedStream(t testing.TB, method, token, query string) resp {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, method, e.srv.URL+"/api/v1/events"+query, nil)
	require.NoError(t, err)
	hr.Header.Set("Authorization", "Bearer "+token)
	res, err := e.srv.Client().Do(hr)
	require.NoError(t, err)
	defer res.Body.Close()
	if method == "GET" {
		require.NotEqual(t, http.StatusOK, res.StatusCode, "GET /api/v1/events%s opened a stream", query)
	}
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	mustContract(t).Check(t, hr, nil, openapitest.Answer{Status: res.StatusCode, Header: res.Header, Body: b})
	return resp{status: res.StatusCode, header: res.Header, body: b}
}
