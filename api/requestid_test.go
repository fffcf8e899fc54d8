package api

import (
	"log/slog"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// linesOf returns the lines of log that hold substr.
func linesOf(log, substr string) []string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return out
}

// A user who reports a 500 "internal error" can quote something the
// operator finds in the log: the answer's X-Request-Id is on the log line
// of the failure. A client's own
// X-Request-Id, when it is a plain token, is taken as the request's id;
// one that is not is replaced (bug 378).
func TestInternalErrorTiesToItsLogLine(t *testing.T) {
	var logs testenv.Buffer
	base := newEnv(t)
	tok := base.bound("dev-1")
	fs := &failingStore{DB: base.db, failStatus: true}
	e := newEnvWith(t, base.db, fs, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})

	r := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
	require.Equal(t, 500, r.status)
	id := r.header.Get("X-Request-Id")
	require.NotEmpty(t, id, "the answer carries no X-Request-Id")
	assert.Regexp(t, regexp.MustCompile(`^[A-Za-z0-9._:-]{8,}$`), id)
	failed := linesOf(logs.String(), `msg="request failed"`)
	require.Len(t, failed, 1, "log:\n%s", logs.String())
	assert.Contains(t, failed[0], "request_id="+id)

	// Another request has another id.
	r2 := e.do("GET", "/api/v1/devices/dev-1/status", tok, nil)
	assert.NotEqual(t, id, r2.header.Get("X-Request-Id"))

	// The client's own id is honoured, and named in the log.
	r3 := e.send(req{method: "GET", path: "/api/v1/devices/dev-1/status", token: tok,
		header: map[string]string{"X-Request-Id": "ticket-4711.a"}})
	assert.Equal(t, "ticket-4711.a", r3.header.Get("X-Request-Id"))
	assert.Len(t, linesOf(logs.String(), `msg="request failed" component=api request_id=ticket-4711.a `), 1, "log:\n%s", logs.String())

	// One that is no plain token (spaces, quotes, too long) is not echoed.
	for _, bad := range []string{`a b" forged=1`, strings.Repeat("x", 200)} {
		r := e.send(req{method: "GET", path: "/api/v1/devices/dev-1/status", token: tok,
			header: map[string]string{"X-Request-Id": bad}})
		got := r.header.Get("X-Request-Id")
		assert.NotEmpty(t, got)
		assert.NotEqual(t, bad, got)
	}

	// A success carries one too, and the debug line of the request names it.
	ok := e.do("GET", "/api/v1/devices", tok, nil)
	require.Equal(t, 200, ok.status)
	okID := ok.header.Get("X-Request-Id")
	require.NotEmpty(t, okID)
	assert.Len(t, linesOf(logs.String(), "request_id="+okID), 1, "log:\n%s", logs.String())
}
