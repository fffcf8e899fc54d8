package api

import (
	"fmt"
	"net/url"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// pages walks a list by its next_cursor and returns the ids of each page.
// member is the list's member ("commands", "devices") and idKey the id of
// an item. It fails the test unless every page but the last is full and
// the walk ends.
func (e *env) pages(t testing.TB, tok, path, member, idKey string, limit int) [][]string {
	t.Helper()
	var pages [][]string
	cursor := ""
	for {
		u, err := url.Parse(path)
		require.NoError(t, err)
		q := u.Query()
		q.Set("limit", fmt.Sprint(limit))
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		u.RawQuery = q.Encode()
		r := e.do("GET", u.String(), tok, nil)
		require.Equal(t, 200, r.status, "GET %s: %s", u, r.body)
		m := r.json(t)
		require.Contains(t, m, "next_cursor", "GET %s: %s", u, r.body)
		page := []string{}
		for _, it := range m[member].([]any) {
			page = append(page, it.(map[string]any)[idKey].(string))
		}
		pages = append(pages, page)
		next, ok := m["next_cursor"].(string)
		if !ok {
			require.Nil(t, m["next_cursor"], "GET %s", u)
			return pages
		}
		require.Len(t, page, limit, "GET %s = %v with a next_cursor: a page before the last must be full", u, page)
		require.Less(t, len(pages), 100, "GET %s: the pages do not end", path)
		cursor = next
	}
}

// wantPages checks a walk of pages against the ids it should have listed:
// all of them in order, in full pages, and no empty page after the last
// full one.
func wantPages(t *testing.T, what string, pages [][]string, want []string, limit int) {
	t.Helper()
	got := append([]string{}, slices.Concat(pages...)...)
	assert.Equal(t, append([]string{}, want...), got, "%s: the ids of the pages %v", what, pages)
	n := max(1, (len(want)+limit-1)/limit)
	assert.Len(t, pages, n, "%s: %d ids in pages of %d come in %d pages: %v", what, len(want), limit, n, pages)
}

// After a device changes hands, each owner lists only their own commands,
// in full pages, and next_cursor is null exactly when nothing follows.
func TestCommandPagesAfterChangeOfOwner(t *testing.T) {
	e := newEnv(t)
	const path = "/api/v1/devices/dev-1/commands"
	alice := e.bound("dev-1") // provisions dev-1 with claim code code-dev-1
	push := func(tok string) string {
		t.Helper()
		r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"})
		require.Equal(t, 202, r.status, "%s", r.body)
		return r.json(t)["id"].(string)
	}
	handOver := func(from, to string) {
		t.Helper()
		r := e.do("DELETE", "/api/v1/devices/dev-1", from, nil)
		require.Equal(t, 204, r.status, "%s", r.body)
		r = e.do("POST", "/api/v1/devices/register", to, map[string]any{"device_id": "dev-1", "claim_code": "code-dev-1"})
		require.Equal(t, 201, r.status, "%s", r.body)
	}
	var alices, bobs []string // newest first
	for range 3 {
		alices = slices.Insert(alices, 0, push(alice))
	}
	bob := e.user("bob")
	handOver(alice, bob)
	for range 5 {
		bobs = slices.Insert(bobs, 0, push(bob))
	}

	t.Run("a short last page", func(t *testing.T) {
		wantPages(t, "bob, 5 commands", e.pages(t, bob, path, "commands", "id", 2), bobs, 2)
	})
	t.Run("an exact multiple of the limit", func(t *testing.T) {
		bobs = slices.Insert(bobs, 0, push(bob))
		for _, limit := range []int{2, 3, 6} {
			wantPages(t, fmt.Sprintf("bob, 6 commands, limit %d", limit), e.pages(t, bob, path, "commands", "id", limit), bobs, limit)
		}
	})
	t.Run("the state filter", func(t *testing.T) {
		// Cancel bob's 1st, 3rd, 5th and 6th; alice's ended with her unbind.
		var canceled, queued []string
		for i, id := range bobs { // newest first: i 0 is the 6th
			if i == 0 || i%2 == 1 {
				r := e.do("DELETE", path+"/"+id, bob, nil)
				require.Equal(t, 200, r.status, "%s", r.body)
				canceled = append(canceled, id)
			} else {
				queued = append(queued, id)
			}
		}
		wantPages(t, "bob's canceled", e.pages(t, bob, path+"?state=canceled", "commands", "id", 2), canceled, 2)
		wantPages(t, "bob's queued", e.pages(t, bob, path+"?state=queued", "commands", "id", 1), queued, 1)
		wantPages(t, "bob's queued", e.pages(t, bob, path+"?state=queued", "commands", "id", 2), queued, 2)
		wantPages(t, "bob's succeeded", e.pages(t, bob, path+"?state=succeeded", "commands", "id", 2), nil, 2)
	})
	t.Run("another owner's commands in between", func(t *testing.T) {
		// Back to alice: bob's six lie between her old commands and her new.
		handOver(bob, alice)
		alices = slices.Insert(alices, 0, push(alice))
		for _, limit := range []int{1, 2, 3} {
			wantPages(t, fmt.Sprintf("alice, limit %d", limit), e.pages(t, alice, path, "commands", "id", limit), alices, limit)
		}
		// Her old ones ended with her unbind (canceled, never run); her
		// new one waits.
		wantPages(t, "alice's queued", e.pages(t, alice, path+"?state=queued", "commands", "id", 2), alices[:1], 2)
		wantPages(t, "alice's canceled", e.pages(t, alice, path+"?state=canceled", "commands", "id", 2), alices[1:], 2)
	})
}

// GET /devices pages over the caller's devices only, in full pages, with
// next_cursor null exactly when nothing follows: also when the last page is
// full, and when devices were unbound or belong to others.
func TestDevicePagesAreFull(t *testing.T) {
	e := newEnv(t)
	erin, frank := e.user("erin"), e.user("frank")
	var want []string
	for i := range 9 {
		id := fmt.Sprintf("dev-%d", i)
		e.provision(id, "c", "sim-1")
		tok := erin
		if i%3 == 1 {
			tok = frank // frank's devices lie between erin's in id order
		}
		r := e.do("POST", "/api/v1/devices/register", tok, map[string]any{"device_id": id, "claim_code": "c"})
		require.Equal(t, 201, r.status, "%s", r.body)
		if tok == erin {
			want = append(want, id)
		}
	}
	// One of erin's is unbound again.
	r := e.do("DELETE", "/api/v1/devices/dev-3", erin, nil)
	require.Equal(t, 204, r.status, "%s", r.body)
	want = slices.DeleteFunc(want, func(id string) bool { return id == "dev-3" })
	require.Len(t, want, 5)
	for _, limit := range []int{1, 2, 4, 5, 6} {
		wantPages(t, fmt.Sprintf("erin's devices, limit %d", limit), e.pages(t, erin, "/api/v1/devices", "devices", "device_id", limit), want, limit)
	}
	wantPages(t, "a user without devices", e.pages(t, e.user("gina"), "/api/v1/devices", "devices", "device_id", 2), nil, 2)
}

// GET /apps pages over the catalog in app id order, in full pages, with
// next_cursor null exactly when nothing follows, each app with its latest
// release and every version.
func TestAppCatalogPagesAreFull(t *testing.T) {
	e := newEnv(t)
	var want []string
	for i := range 7 {
		id := fmt.Sprintf("app-%d", i)
		want = append(want, id)
		for _, v := range []string{"1.10.0", "1.9.0"} {
			r := e.send(req{method: "PUT", path: "/api/v1/admin/apps/" + id + "/" + v, token: testAdminToken,
				body: []byte(id + v), header: map[string]string{"Content-Type": "application/octet-stream"}})
			require.Equal(t, 201, r.status, "%s", r.body)
		}
	}
	tok := e.user("ivy")
	for _, limit := range []int{1, 2, 3, 7, 8} {
		wantPages(t, fmt.Sprintf("the catalog, limit %d", limit), e.pages(t, tok, "/api/v1/apps", "apps", "app_id", limit), want, limit)
	}
	r := e.do("GET", "/api/v1/apps?limit=1&cursor="+*cursorOf("app-5"), tok, nil)
	require.Equal(t, 200, r.status, "%s", r.body)
	apps := r.json(t)["apps"].([]any)
	require.Len(t, apps, 1)
	app := apps[0].(map[string]any)
	assert.Equal(t, "app-6", app["app_id"])
	assert.Equal(t, "1.10.0", app["version"])
	assert.Equal(t, []any{"1.9.0", "1.10.0"}, app["versions"])
	assert.Nil(t, r.json(t)["next_cursor"], "the last app's page")
	wantPages(t, "an empty catalog", e.pages(t, tok, "/api/v1/apps?cursor="+*cursorOf("zzz"), "apps", "app_id", 2), nil, 2)
	for _, q := range []string{"?limit=0", "?limit=201", "?limit=", "?cursor=" + *cursorOf("Not An App")} {
		r := e.do("GET", "/api/v1/apps"+q, tok, nil)
		assert.Equal(t, 422, r.status, "GET /api/v1/apps%s: %s", q, r.body)
	}
}

// TestQueryParameterNamesAreCaseSensitive asks every list, and the event
// stream, for a parameter in another case than its own: each is a 422
// naming the parameter as sent, as a body member in another case is,
// where net/url's exact match had made `?State=failed` no filter (every
// command listed) and `?Device_ID=dev-1` a stream of every device. A
// parameter that resembles none is ignored on all of them alike.
func TestQueryParameterNamesAreCaseSensitive(t *testing.T) {
	e := newEventsEnv(t, EventsOptions{})
	tok := e.bound("dev-1")
	e.push(t, tok, "dev-1")
	for _, tc := range []struct{ path, field, want string }{
		{"/api/v1/devices/dev-1/commands?State=failed", "State", "state"},
		{"/api/v1/devices/dev-1/commands?state=queued&STATE=failed", "STATE", "state"},
		{"/api/v1/devices/dev-1/commands?Limit=1", "Limit", "limit"},
		{"/api/v1/devices?LIMIT=1", "LIMIT", "limit"},
		{"/api/v1/devices?Cursor=ZGV2LTE", "Cursor", "cursor"},
		{"/api/v1/bridges?Limit=1", "Limit", "limit"},
		{"/api/v1/apps?Cursor=", "Cursor", "cursor"},
		{"/api/v1/apps?%4Cimit=1", "Limit", "limit"}, // %4C is L
	} {
		r := e.do("GET", tc.path, tok, nil)
		require.Equal(t, 422, r.status, "GET %s: %s", tc.path, r.body)
		p := r.problem(t)
		assert.Equal(t, CodeValidationFailed, p.Code, "GET %s", tc.path)
		assert.Equal(t, []FieldError{{Field: tc.field, Message: fmt.Sprintf("must be written %q: parameter names are case-sensitive", tc.want)}}, p.Errors, "GET %s", tc.path)
	}
	for _, query := range []string{"?Device_ID=dev-1", "?LAST_EVENT_ID=00000000000000000001"} {
		r := e.refusedStream(t, "GET", tok, query)
		require.Equal(t, 422, r.status, "GET /api/v1/events%s: %s", query, r.body)
		assert.Equal(t, CodeValidationFailed, r.problem(t).Code)
	}
	for _, path := range []string{
		"/api/v1/devices/dev-1/commands?state=queued&colour=red",
		"/api/v1/devices?colour=red&_=1700000000",
		"/api/v1/bridges?colour=red",
		"/api/v1/apps?colour=red",
	} {
		r := e.do("GET", path, tok, nil)
		assert.Equal(t, 200, r.status, "GET %s: an unknown parameter is ignored: %s", path, r.body)
	}
	r := e.refusedStream(t, "HEAD", tok, "?colour=red")
	assert.Equal(t, 200, r.status, "HEAD /api/v1/events?colour=red: %s", r.body)
}
