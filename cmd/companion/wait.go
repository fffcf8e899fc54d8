package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/idleread"
	"github.com/devicecompanion/companion/internal/sse"
)

// The exit statuses of "companion command wait" for a command that ended
// otherwise than succeeded. (1 is any other error, 2 a usage error.)
const (
	exitFailed   = 3
	exitExpired  = 4
	exitCanceled = 5
)

// exitError ends the CLI with its own exit status.
type exitError struct {
	code int
	err  error
}

func (e exitError) Error() string { return e.err.Error() }
func (e exitError) Unwrap() error { return e.err }

// runCommand runs "companion command wait DEVICE ID": a user's client of
// the API, which follows one command from the event stream of its device
// until it is final.
func runCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd, done, err := subCommand(args, stdout, stderr)
	if done {
		return err
	}
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs)
	apiURL := fs.String("api-url", "http://127.0.0.1:8080", "base URL of the running server")
	token := fs.String("token", "", "the user's API token (required)")
	timeout := fs.Duration("timeout", 0, "give up after this long (0: wait until the command is final)")
	ca := caFlag(fs)
	pos, err := parseInterspersed(fs, args[2:])
	if err != nil {
		return err
	}
	if err := applyEnv(fs); err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError{fmt.Sprintf("command wait takes a device id and a command id, got %d arguments", len(pos))}
	}
	if *token == "" {
		return usageError{"command wait needs --token (or COMPANION_TOKEN)"}
	}
	hc, err := apiHTTPClient(*apiURL, *ca)
	if err != nil {
		return err
	}
	if *timeout < 0 {
		return usageError{fmt.Sprintf("--timeout %s: must not be negative (0: wait until the command is final)", *timeout)}
	}
	if *timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *timeout)
		defer cancel()
	}
	w := &waiter{
		// No timeout on the client: a stream is long. The command's
		// GET has its own, and a silent stream is dropped (idle).
		api:      apiClient{apiURL: strings.TrimRight(*apiURL, "/"), token: *token, http: hc},
		deviceID: pos[0],
		id:       pos[1],
		out:      stdout,
		log:      stderr,
		retry:    2 * time.Second,
		idle:     45 * time.Second,
	}
	err = w.run(ctx)
	if errors.Is(err, context.DeadlineExceeded) && *timeout > 0 {
		state := w.shown.State
		if state == "" {
			state = "not final"
		}
		return fmt.Errorf("command %s is still %s after --timeout %s", w.id, state, *timeout)
	}
	return err
}

// waiter follows one command.
//
// It opens GET /api/v1/events?device_id=DEVICE first and reads the command
// (GET …/commands/ID) after, so that a final state reached before the
// stream opened is not missed, and one reached after comes on the stream.
// When the stream drops, it reconnects with the Last-Event-ID it got, and
// reads the command again.
type waiter struct {
	api          apiClient
	deviceID, id string
	out, log     io.Writer
	retry        time.Duration // before a reconnection; the stream's retry field sets it
	idle         time.Duration // a stream that sends nothing for this long is dead

	lastID    string // the stream's last event id
	connected bool   // a stream opened once: errors from now on are retried (before, only notNow ones)
	shown     commandView
}

// commandView is what waiter reads of a command or a command event.
type commandView struct {
	ID       string                  `json:"id"`
	State    string                  `json:"state"`
	Progress *int                    `json:"progress"`
	Error    *companion.CommandError `json:"error"`
}

func (w *waiter) run(ctx context.Context) error {
	for {
		err := w.follow(ctx)
		if companion.IsFinal(w.shown.State) {
			return w.result()
		}
		var ae *apiError
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.As(err, &ae) && ae.status == http.StatusUnprocessableEntity && w.lastID != "":
			// The id is older than the event log keeps: start afresh;
			// the command's GET covers what the stream cannot.
			w.lastID = ""
		case !retryable(err), !w.connected && !notNow(err):
			// Before a stream ever opened, an error is a wrong URL or a
			// server that is not there: told at once. The server's own
			// "not now" (too many streams of this user open, not ready
			// yet) is waited out then too, as on a reconnection.
			return err
		}
		fmt.Fprintf(w.log, "companion: %v; reconnecting in %s\n", err, w.retry)
		t := time.NewTimer(w.retry)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// follow opens the stream once, reads the command, and follows the stream
// until the command is final or the stream ends (its error).
func (w *waiter) follow(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	path := "/api/v1/events?device_id=" + url.QueryEscape(w.deviceID)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.api.apiURL+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+w.api.token)
	req.Header.Set("Accept", "text/event-stream")
	if w.lastID != "" {
		req.Header.Set("Last-Event-ID", w.lastID)
	}
	resp, err := w.api.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return responseError(http.MethodGet, path, resp)
	}
	w.connected = true

	getCtx, cancelGet := context.WithTimeout(ctx, 30*time.Second)
	b, err := w.api.do(getCtx, http.MethodGet, "/api/v1/devices/"+url.PathEscape(w.deviceID)+"/commands/"+url.PathEscape(w.id), "", nil, 0)
	cancelGet()
	if err != nil {
		return err
	}
	var c commandView
	if err := json.Unmarshal(b, &c); err != nil {
		return fmt.Errorf("reading command %s: %w", w.id, err)
	}
	if w.show(c) {
		return nil
	}

	idle := time.AfterFunc(w.idle, cancel)
	defer idle.Stop()
	// The server sends a ping every 15 s, so a stream silent for longer
	// than a few is a dead connection, which the timer then cancels.
	rd := sse.NewReader(&idleread.Reader{R: resp.Body, Timer: idle, Idle: w.idle})
	for {
		ev, err := rd.Next()
		w.lastID = rd.LastEventID()
		if r := rd.Retry(); r > 0 {
			w.retry = min(max(r, 100*time.Millisecond), time.Minute)
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return errors.New("the event stream ended")
			}
			return fmt.Errorf("the event stream broke off: %w", err)
		}
		if ev.Type != "command" {
			continue
		}
		// A UUID's hex digits are case-insensitive: the API takes an id
		// given in upper case, and its events name it in lower case.
		var c commandView
		if json.Unmarshal([]byte(ev.Data), &c) != nil || !strings.EqualFold(c.ID, w.id) {
			continue
		}
		if w.show(c) {
			return nil
		}
	}
}

// show prints c's state (and progress) when it is news, and reports
// whether the command is final. What the stream says after the command's
// GET may be older than what the GET said: a state earlier in the
// lifecycle, or less progress, is not news.
func (w *waiter) show(c commandView) bool {
	s := w.shown
	switch {
	case s.State == "":
	case companion.Rank(c.State) < companion.Rank(s.State):
		return false
	case c.State == s.State && progressOf(c) <= progressOf(s):
		return false
	}
	w.shown = c
	fmt.Fprintln(w.out, describe(c))
	return companion.IsFinal(c.State)
}

// describe is the line of a command's state: "in_progress 40%",
// "failed: device_error: why", "canceled: by whom".
func describe(c commandView) string {
	line := c.State
	if c.Progress != nil && c.State == companion.StateInProgress {
		line += fmt.Sprintf(" %d%%", *c.Progress)
	}
	if e := c.Error; e != nil {
		line += ": "
		if e.Code != c.State {
			line += e.Code + ": "
		}
		line += e.Message
	}
	return line
}

func progressOf(c commandView) int {
	if c.Progress == nil {
		return -1
	}
	return *c.Progress
}

// result is the CLI's answer for the final state shown.
func (w *waiter) result() error {
	c := w.shown
	switch c.State {
	case companion.StateSucceeded:
		return nil
	case companion.StateFailed:
		return exitError{exitFailed, fmt.Errorf("command %s %s", w.id, describe(c))}
	case companion.StateExpired:
		return exitError{exitExpired, fmt.Errorf("command %s expired before it was delivered", w.id)}
	default:
		return exitError{exitCanceled, fmt.Errorf("command %s was canceled", w.id)}
	}
}

// notNow reports whether err is an answer that asks the client to come
// back later: a 429 or a 503.
func notNow(err error) bool {
	var ae *apiError
	return errors.As(err, &ae) && (ae.status == http.StatusTooManyRequests || ae.status == http.StatusServiceUnavailable)
}

// retryable reports whether err may pass by reconnecting: the network's,
// the stream's end, a 429 or a 5xx, but not an answer such as 401 or
// 404, which a reconnection would only repeat.
func retryable(err error) bool {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae.status == http.StatusTooManyRequests || ae.status >= 500
	}
	return true
}
