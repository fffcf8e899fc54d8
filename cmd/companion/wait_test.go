package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/internal/testenv"
)

// waitRun is one "companion command wait" run, its output line by line.
type waitRun struct {
	lines  chan string
	stderr testenv.Buffer
	done   chan error
}

// startWait runs "companion command wait DEV ID" against api as the user
// of token, as a user would from a shell.
func startWait(tb testing.TB, api, token, dev, id string) *waitRun {
	tb.Helper()
	w := &waitRun{lines: make(chan string, 100), done: make(chan error, 1)}
	pr, pw := io.Pipe()
	go func() {
		defer close(w.lines)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			w.lines <- sc.Text()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	go func() {
		err := run(ctx, []string{"command", "wait", dev, id, "--api-url", api, "--token", token}, pw, &w.stderr)
		pw.Close()
		cancel()
		w.done <- err
	}()
	tb.Cleanup(func() {
		cancel()
		for range w.lines {
		}
	})
	return w
}

// line is the next line printed.
func (w *waitRun) line(tb testing.TB) string {
	tb.Helper()
	select {
	case l, ok := <-w.lines:
		require.True(tb, ok, "wait ended without another line; stderr: %s", w.stderr.String())
		return l
	case <-time.After(30 * time.Second):
		tb.Fatal("wait printed nothing for 30s")
		return ""
	}
}

// end returns the rest of the lines and the run's error.
func (w *waitRun) end(tb testing.TB) ([]string, error) {
	tb.Helper()
	var rest []string
	timeout := time.After(60 * time.Second)
	for {
		select {
		case l, ok := <-w.lines:
			if !ok {
				return rest, <-w.done
			}
			rest = append(rest, l)
		case <-timeout:
			tb.Fatalf("wait did not end; printed %q; stderr: %s", rest, w.stderr.String())
		}
	}
}

// waitStatesInOrder checks what wait printed: each line a state (in
// progress with a percentage), each later in the lifecycle than the one
// before or further along, ending with final.
func waitStatesInOrder(tb testing.TB, lines []string, final string) {
	tb.Helper()
	require.NotEmpty(tb, lines)
	assert.True(tb, strings.HasPrefix(lines[len(lines)-1], final), "last line %q; want %s", lines[len(lines)-1], final)
	for i := 1; i < len(lines); i++ {
		prev, _, _ := strings.Cut(lines[i-1], " ")
		cur, _, _ := strings.Cut(lines[i], " ")
		prev, cur = strings.TrimSuffix(prev, ":"), strings.TrimSuffix(cur, ":")
		if prev == cur {
			assert.Equal(tb, companion.StateInProgress, cur, "a state printed twice: %q", lines)
			continue
		}
		assert.Less(tb, companion.Rank(prev), companion.Rank(cur), "states out of order: %q", lines)
	}
}

func exitCode(err error) int {
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	}
	return 1
}

// A command followed from its queue to its success: every state it went
// through printed in order (the OTA's progress too), exit status 0.
func TestWaitFollowsCommandToSuccess(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	eventsRegister(t, f, "dev-1")
	// No bridge yet: the command waits, and wait sees it go.
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/ota/update", map[string]any{})
	w := startWait(t, m.APIURL(), f.user.token, "dev-1", cmd["id"].(string))
	first := w.line(t)
	assert.Contains(t, []string{"queued", "sent"}, first)
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	rest, err := w.end(t)
	require.NoError(t, err, "stderr: %s", w.stderr.String())
	lines := append([]string{first}, rest...)
	waitStatesInOrder(t, lines, "succeeded")
	assert.GreaterOrEqual(t, len(lines), 2, "%q", lines)
	t.Logf("wait printed %q", lines)
}

// A command final before wait starts: its state at once, exit status 0.
func TestWaitAlreadyFinished(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	eventsRegister(t, f, "dev-1")
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "hi"})
	id := cmd["id"].(string)
	require.Equal(t, "succeeded", f.user.waitFinal("dev-1", id)["state"])

	lines, err := startWait(t, m.APIURL(), f.user.token, "dev-1", id).end(t)
	require.NoError(t, err)
	assert.Equal(t, []string{"succeeded"}, lines)
}

// A command that fails, or is canceled, ends wait with its own exit
// status and says why; unknown commands and bad tokens are errors.
func TestWaitFailedCanceledAndErrors(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1", "dev-2")
	eventsRegister(t, f, "dev-1", "dev-2")
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1") // dev-2 has no bridge

	cmd := f.user.accept("DELETE", "/api/v1/devices/dev-1/apps/not-installed", nil)
	lines, err := startWait(t, m.APIURL(), f.user.token, "dev-1", cmd["id"].(string)).end(t)
	assert.Equal(t, exitFailed, exitCode(err), "%v", err)
	assert.ErrorContains(t, err, "failed: ")
	waitStatesInOrder(t, lines, "failed: ")

	cmd = f.user.accept("POST", "/api/v1/devices/dev-2/push/text", map[string]any{"text": "never"})
	id := cmd["id"].(string)
	w := startWait(t, m.APIURL(), f.user.token, "dev-2", id)
	assert.Contains(t, []string{"queued", "sent"}, w.line(t))
	r := f.user.do("DELETE", "/api/v1/devices/dev-2/commands/"+id, nil)
	require.Contains(t, []int{200, 202}, r.Status, "%s", r.Body)
	lines, err = w.end(t)
	assert.Equal(t, exitCanceled, exitCode(err), "%v", err)
	assert.Equal(t, []string{"canceled: canceled by the user"}, lines)

	_, err = startWait(t, m.APIURL(), f.user.token, "dev-1", "0190a000-0000-7000-8000-000000000000").end(t)
	assert.Equal(t, 1, exitCode(err))
	assert.ErrorContains(t, err, "404")
	_, err = startWait(t, m.APIURL(), "wrong", "dev-1", cmd["id"].(string)).end(t)
	assert.ErrorContains(t, err, "401")

	err = run(context.Background(), []string{"command", "wait", "dev-1", "--token", "x"}, io.Discard, io.Discard)
	var ue usageError
	assert.ErrorAs(t, err, &ue)
}

// dropProxy stands between wait and the server, and breaks the first
// event stream through it off after its first event, as a network or a
// restarting replica does.
type dropProxy struct {
	target string

	mu      sync.Mutex
	streams []http.Header // the request headers of each event stream
	cutAt   string        // the id of the event after which it broke off
}

func (p *dropProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	req, err := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	if r.URL.Path != "/api/v1/events" {
		_, _ = io.Copy(w, resp.Body)
		return
	}
	p.mu.Lock()
	first := len(p.streams) == 0
	p.streams = append(p.streams, r.Header.Clone())
	p.mu.Unlock()
	rd := bufio.NewReader(resp.Body)
	var id string
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			return
		}
		if _, err := io.WriteString(w, line); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		if v, ok := strings.CutPrefix(line, "id: "); ok {
			id = strings.TrimSpace(v)
		}
		if first && line == "\n" && id != "" {
			p.mu.Lock()
			p.cutAt = id
			p.mu.Unlock()
			panic(http.ErrAbortHandler) // the connection breaks
		}
	}
}

// A stream that breaks off mid-way: wait reconnects with the id of the
// last event it got, and follows the command to its end.
func TestWaitResumesAfterStreamDrops(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	eventsRegister(t, f, "dev-1")
	proxy := &dropProxy{target: m.APIURL()}
	srv := httptest.NewServer(proxy)
	t.Cleanup(srv.Close)

	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "through a bad network"})
	w := startWait(t, srv.URL, f.user.token, "dev-1", cmd["id"].(string))
	first := w.line(t)
	startBridge(t, m, m.MQTTURL(), f, "", "dev-1") // events start: the first breaks the stream
	rest, err := w.end(t)
	require.NoError(t, err, "stderr: %s", w.stderr.String())
	waitStatesInOrder(t, append([]string{first}, rest...), "succeeded")

	proxy.mu.Lock()
	defer proxy.mu.Unlock()
	require.GreaterOrEqual(t, len(proxy.streams), 2, "wait reconnected")
	assert.Empty(t, proxy.streams[0].Get("Last-Event-ID"))
	assert.NotEmpty(t, proxy.cutAt)
	assert.Equal(t, proxy.cutAt, proxy.streams[1].Get("Last-Event-ID"), "resumed after the last event it got")
	assert.Contains(t, w.stderr.String(), "reconnecting")
	t.Logf("wait said on stderr: %s", w.stderr.String())
}

// A command id given in upper case (as Swift's UUID.uuidString writes
// it), which the API takes as the same command: wait follows the command
// on the stream, whose events name it in lower case, to its end.
func TestWaitTakesAnUpperCaseCommandID(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1")
	eventsRegister(t, f, "dev-1") // no bridge: the command waits
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "never"})
	id := cmd["id"].(string)
	w := startWait(t, m.APIURL(), f.user.token, "dev-1", strings.ToUpper(id))
	assert.Contains(t, []string{"queued", "sent"}, w.line(t))
	r := f.user.do("DELETE", "/api/v1/devices/dev-1/commands/"+id, nil)
	require.Contains(t, []int{200, 202}, r.Status, "%s", r.Body)
	select {
	case l := <-w.lines:
		assert.Equal(t, "canceled: canceled by the user", l)
	case <-time.After(15 * time.Second):
		t.Fatalf("wait did not see the command canceled on the stream; stderr: %s", w.stderr.String())
	}
	lines, err := w.end(t)
	assert.Equal(t, exitCanceled, exitCode(err), "%v", err)
	assert.Empty(t, lines)
}

// A wait started while the user has every event stream the server allows
// open (429 too_many_streams, "try again in 2 s") waits for a place, as
// it does when the same answer comes on a reconnection, rather than give
// up on a command still under way.
func TestWaitWaitsForAStreamOfItsOwn(t *testing.T) {
	m := startServer(t, Config{Limits: api.Limits{MaxStreamsPerUser: 1}})
	f := setupFleet(t, m, "dev-1")
	eventsRegister(t, f, "dev-1") // no bridge: the command waits
	cmd := f.user.accept("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": "never"})
	id := cmd["id"].(string)
	other := sseOpen(t, f.user, "") // the user's one stream

	w := startWait(t, m.APIURL(), f.user.token, "dev-1", id)
	testenv.Eventually(t, 10*time.Second, "wait refused a stream, and waiting", func() bool {
		select {
		case err := <-w.done:
			t.Fatalf("wait gave up: %v", err)
		default:
		}
		return strings.Contains(w.stderr.String(), "429")
	})
	other.Close()
	assert.Contains(t, []string{"queued", "sent"}, w.line(t))
	r := f.user.do("DELETE", "/api/v1/devices/dev-1/commands/"+id, nil)
	require.Contains(t, []int{200, 202}, r.Status, "%s", r.Body)
	lines, err := w.end(t)
	assert.Equal(t, exitCanceled, exitCode(err), "%v", err)
	assert.Equal(t, []string{"canceled: canceled by the user"}, lines)
}
