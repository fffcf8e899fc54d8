package api

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"
)

// GET /api/v1/events: Server-Sent Events of the caller's command state
// changes and device status changes (CONTRACT §12; docs/api.md "Events").
//
// The store keeps the events in a log, written in the transaction of the
// change each one describes (companion.Store.Events), so that an event is
// announced only once committed, every committed change is announced, and
// any replica can serve any stream: a stream resumes from the log after
// its Last-Event-ID, whichever replica took the change in.
//
// Each process has one hub (Events) that reads the log after its cursor
// whenever it is woken (the bbolt store's signal after a commit, or
// PostgreSQL's NOTIFY from any replica) and at least every PollInterval,
// and hands each event to the streams of its user: each stream has a
// channel of Buffer events, and a stream whose channel is full is
// dropped, never waited for. Its response then ends, and the client
// resumes with its Last-Event-ID from the log. So a slow reader costs the
// server one bounded buffer and never slows anyone else.
//
// A stream that resumes registers with the hub first, then reads the log
// after its Last-Event-ID, then serves what the hub hands it, skipping
// ids it sent already (ids compare as strings in log order): the hub's
// cursor when the stream registered is at or before the end of the read,
// so nothing falls between the two, and nothing comes twice.
//
// A Last-Event-ID past every id the store has assigned was kept across a
// reset of the store (companion.Store.EventsPastEnd): every event the log
// holds is new to that client, so its stream reads the log from its start,
// as after an id older than the log, rather than waiting for the log to
// pass the id.
//
// Either way, and after an id older than the log (events after it were
// purged: companion.Store.EventsPurgedAfter), the client has missed
// events: its stream starts with an event "reset" (resetFrame), before
// the replay, which tells it to read the state again
// (docs/reliability.md, bug 274).

// EventStore is what the event hub and the streams need of the store.
type EventStore interface {
	Events(ctx context.Context, userID, after string, limit int) ([]companion.Event, string, error)
	EventsHead(ctx context.Context) (string, error)
	EventsPastEnd(ctx context.Context, after string) (bool, error)
	EventsPurgedAfter(ctx context.Context, after string) (bool, error)
}

// EventsOptions configure NewEvents. The zero value of each optional
// field means its default.
type EventsOptions struct {
	Store EventStore // required
	// PollInterval is how often the hub reads the log without being
	// woken: the safety net under the store's signals; 1s.
	PollInterval time.Duration
	// Buffer is how many events a stream may have waiting before it is
	// dropped; 256.
	Buffer int
	// Heartbeat is how often an idle stream gets a ": ping" comment; 15s.
	Heartbeat time.Duration
	// WriteTimeout ends a stream whose client takes longer than this to
	// take one write; 30s.
	WriteTimeout time.Duration
	Logger       *slog.Logger // slog.Default() when nil
}

// Events is the hub of a process's event streams. Create it with
// NewEvents, hand it to the API (Options.Events), wake it when the store
// committed events (Wake), and Close it before the HTTP server shuts
// down: Close ends every stream.
type Events struct {
	opts EventsOptions
	log  *slog.Logger

	wake   chan struct{}   // capacity 1
	ctx    context.Context // of the hub's reads; canceled by Close, which its Done announces
	cancel context.CancelFunc
	done   chan struct{}
	ready  chan struct{} // closed once the hub has its first cursor

	mu     sync.Mutex
	users  map[string]map[*eventSub]struct{}
	cursor string
	closed bool

	dropped atomic.Int64
}

// eventSub is one stream's registration.
type eventSub struct {
	hub      *Events
	userID   string
	deviceID string // "" for every device
	ch       chan *encodedEvent
	// gone is closed when the hub drops the stream (its buffer was full)
	// or closes.
	gone chan struct{}
	// rc is the stream's response, once it is written (attach): Close
	// ends a write under way through it. Under the hub's mu.
	rc *http.ResponseController
	// from is the hub's cursor when the stream registered: the stream gets
	// every event after it.
	from string
}

// NewEvents checks the options and starts the hub's goroutine.
func NewEvents(opts EventsOptions) (*Events, error) {
	if opts.Store == nil {
		return nil, errors.New("api: events: no store")
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = time.Second
	}
	if opts.Buffer <= 0 {
		opts.Buffer = 256
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = 15 * time.Second
	}
	if opts.WriteTimeout <= 0 {
		opts.WriteTimeout = 30 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	h := &Events{
		ctx:    ctx,
		cancel: cancel,
		opts:   opts,
		log:    opts.Logger.With("component", "events"),
		wake:   make(chan struct{}, 1),
		done:   make(chan struct{}),
		ready:  make(chan struct{}),
		users:  map[string]map[*eventSub]struct{}{},
	}
	go h.run()
	return h, nil
}

// WriteTimeout is the time a stream's client has to take one write
// (EventsOptions.WriteTimeout, its default filled in).
func (h *Events) WriteTimeout() time.Duration { return h.opts.WriteTimeout }

// Wake has the hub read the log now. It never blocks.
func (h *Events) Wake() {
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// Close ends every stream and stops the hub; it returns once the hub's
// goroutine has.
func (h *Events) Close() {
	h.mu.Lock()
	if !h.closed {
		h.closed = true
		h.cancel()
		for _, subs := range h.users {
			for sub := range subs {
				close(sub.gone)
				// A write under way ends now, not at its timeout: the
				// shutdown waited for it (bug 326). The stream's handler
				// takes it off the hub, under mu, before it returns.
				if sub.rc != nil {
					_ = sub.rc.SetWriteDeadline(time.Now())
				}
			}
		}
		h.users = map[string]map[*eventSub]struct{}{}
	}
	h.mu.Unlock()
	<-h.done
}

// Dropped is how many streams the hub dropped for falling behind.
func (h *Events) Dropped() int64 { return h.dropped.Load() }

// errEventsClosed is the answer to a stream that starts while the hub
// closes.
var errEventsClosed = errors.New("api: events: closed")

// subscribe registers a stream of the user's events (of one device
// when deviceID is set), once the hub has its cursor: errEventsClosed
// when it has none within a few seconds (the store cannot be read) or
// is closed.
func (h *Events) subscribe(ctx context.Context, userID, deviceID string) (*eventSub, error) {
	wait := time.NewTimer(5 * time.Second)
	defer wait.Stop()
	select {
	case <-h.ready:
	case <-h.ctx.Done():
		return nil, errEventsClosed
	case <-wait.C:
		return nil, errEventsClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	sub := &eventSub{hub: h, userID: userID, deviceID: deviceID, ch: make(chan *encodedEvent, h.opts.Buffer), gone: make(chan struct{})}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, errEventsClosed
	}
	subs := h.users[userID]
	if subs == nil {
		subs = map[*eventSub]struct{}{}
		h.users[userID] = subs
	}
	subs[sub] = struct{}{}
	sub.from = h.cursor
	return sub, nil
}

// attach gives the hub the stream's response, for Close.
func (sub *eventSub) attach(rc *http.ResponseController) {
	sub.hub.mu.Lock()
	defer sub.hub.mu.Unlock()
	sub.rc = rc
}

// close takes the stream off the hub.
func (sub *eventSub) close() {
	h := sub.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	h.remove(sub)
}

// reached returns the hub's cursor when sub has taken every event up to
// it that it wants: sub is still on the hub (not dropped, which loses
// events) and its buffer is empty. The hub hands a page's events out and
// moves its cursor under one hold of h.mu, and the stream writes each
// event it takes before it asks. "" otherwise.
func (h *Events) reached(sub *eventSub) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, on := h.users[sub.userID][sub]; !on || len(sub.ch) > 0 {
		return ""
	}
	return h.cursor
}

// remove takes sub off the hub, if it is on; h.mu held.
func (h *Events) remove(sub *eventSub) {
	subs := h.users[sub.userID]
	delete(subs, sub)
	if len(subs) == 0 {
		delete(h.users, sub.userID)
	}
}

func (h *Events) run() {
	defer close(h.done)
	ctx := h.ctx
	poll := time.NewTicker(h.opts.PollInterval)
	defer poll.Stop()
	for {
		head, err := h.opts.Store.EventsHead(ctx)
		if err == nil {
			h.mu.Lock()
			h.cursor = head
			h.mu.Unlock()
			close(h.ready)
			break
		}
		h.log.Warn("reading the event log's head", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-poll.C:
		}
	}
	// After a wake that found nothing, look again a little later: on
	// PostgreSQL an event shows only once the transactions older than
	// its own have ended, and those may announce nothing themselves.
	var retry <-chan time.Time
	backoff := 10 * time.Millisecond
	for {
		select {
		case <-ctx.Done():
			return
		case <-h.wake:
			backoff = 10 * time.Millisecond
		case <-poll.C:
		case <-retry:
		}
		retry = nil
		n, err := h.read(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			h.log.Error("reading the event log", "err", err)
		case n == 0 && backoff < h.opts.PollInterval:
			retry = time.After(backoff)
			backoff *= 4
		}
	}
}

// read hands every event of the log after the hub's cursor to the
// streams, and returns how many it read.
//
// With no stream open it only moves the cursor to the log's head: a hub
// nobody listens to costs each commit one small read, not the decoding of
// every event (make bench's command path runs with no stream). A stream
// that opens later starts from the cursor, as it would have anyway.
func (h *Events) read(ctx context.Context) (int, error) {
	h.mu.Lock()
	idle := len(h.users) == 0
	h.mu.Unlock()
	if idle {
		head, err := h.opts.Store.EventsHead(ctx)
		if err != nil {
			return 0, err
		}
		h.mu.Lock()
		if len(h.users) == 0 {
			h.cursor = head
		}
		h.mu.Unlock()
		// Not 0: with nobody listening there is nothing to look again for.
		return 1, nil
	}
	const page = 500
	total := 0
	for {
		h.mu.Lock()
		after := h.cursor
		h.mu.Unlock()
		evs, next, err := h.opts.Store.Events(ctx, "", after, page)
		if err != nil {
			return total, err
		}
		h.mu.Lock()
		for _, ev := range evs {
			h.fanOut(ev)
		}
		h.cursor = next
		h.mu.Unlock()
		total += len(evs)
		if len(evs) < page {
			return total, nil
		}
	}
}

// encodedEvent is an event of the log as the streams write it: its frame is
// encoded once, by the hub, and the same bytes go to every stream that
// wants the event. With 100 streams of one user's events each event was
// encoded 100 times, a quarter of the server's CPU streaming them.
type encodedEvent struct {
	id    string
	frame []byte // nil for an event of a kind this build does not know
}

// fanOut hands ev to the streams that want it, dropping those that are
// full; h.mu held. It encodes ev only if a stream wants it.
func (h *Events) fanOut(ev companion.Event) {
	var out *encodedEvent
	for sub := range h.users[ev.UserID] {
		if sub.deviceID != "" && sub.deviceID != ev.DeviceID {
			continue
		}
		if out == nil {
			out = &encodedEvent{id: ev.ID, frame: eventFrame(ev)}
		}
		select {
		case sub.ch <- out:
		default:
			h.remove(sub)
			close(sub.gone)
			h.dropped.Add(1)
			h.log.Info("dropped an event stream that fell behind", "user_id", sub.userID, "buffer", cap(sub.ch))
		}
	}
}

// The shapes of the events' data (docs/api.md "Events"), named as the
// commands and statuses of the rest of the API.

type commandEventJSON struct {
	ID       string                  `json:"id"`
	DeviceID string                  `json:"device_id"`
	Op       string                  `json:"op"`
	State    string                  `json:"state"`
	Progress *int                    `json:"progress,omitempty"`
	Error    *companion.CommandError `json:"error,omitempty"`
	At       apiTime                 `json:"at"`
}

type deviceEventJSON struct {
	DeviceID        string    `json:"device_id"`
	Online          bool      `json:"online"`
	Battery         *int      `json:"battery"`
	FirmwareVersion *string   `json:"firmware_version"`
	Apps            []appJSON `json:"apps"`
	At              apiTime   `json:"at"`
}

// eventFrame is ev as a stream writes it, its id, name and data lines
// and the blank line that ends it; nil for an event of a kind this build
// does not know. Its bytes are shared by every stream that writes it.
func eventFrame(ev companion.Event) []byte {
	name, data, ok := eventData(ev)
	if !ok {
		return nil
	}
	b := make([]byte, 0, len("id: \nevent: \ndata: \n\n")+len(ev.ID)+len(name)+len(data))
	b = append(append(b, "id: "...), ev.ID...)
	b = append(append(b, "\nevent: "...), name...)
	b = append(append(b, "\ndata: "...), data...)
	return append(b, "\n\n"...)
}

// eventData is the SSE event name and data of ev; false for an event of a
// kind this build does not know.
func eventData(ev companion.Event) (string, []byte, bool) {
	var v any
	switch {
	case ev.Kind == companion.EventCommand && ev.Command != nil:
		c := ev.Command
		v = commandEventJSON{ID: c.ID, DeviceID: ev.DeviceID, Op: c.Op, State: c.State, Progress: c.Progress, Error: c.Error, At: timeOrNull(ev.At)}
	case ev.Kind == companion.EventDevice && ev.Device != nil:
		d := ev.Device
		v = deviceEventJSON{DeviceID: ev.DeviceID, Online: d.Online, Battery: d.Battery, FirmwareVersion: stringOrNull(d.FirmwareVersion),
			Apps: toApps(d.Apps), At: timeOrNull(ev.At)}
	default:
		return "", nil, false
	}
	b, err := fastjson.Marshal(v)
	if err != nil {
		return "", nil, false
	}
	return ev.Kind, b, true
}

// eventsBacklogPage is how many events a resuming stream reads at a time.
const eventsBacklogPage = 200

// streamEvents serves GET /api/v1/events.
func (s *Server) streamEvents(c *gin.Context) error {
	hub := s.events
	if hub == nil {
		return errNotFound
	}
	ctx := c.Request.Context()
	user := currentUser(c)
	// A parameter given twice with different values names no one
	// device, or no one event: refused, as the lists refuse it, never
	// read as its first value (a stream of one of two devices).
	deviceID, filtered, twice := queryOnce(c, "device_id")
	fields := queryCaseErrors(c, "device_id", "last_event_id")
	if twice {
		fields = append(fields, FieldError{Field: "device_id", Message: "must be given once"})
	}
	// EventSource sends Last-Event-ID when it reconnects; the query is
	// for clients that cannot set a header on their first request. The
	// header wins: EventSource reconnects to the URL it opened, whose
	// ?last_event_id= is then older than its header. Either given twice
	// with different values names no one event, and is refused as the
	// query is; the header was read as its first (bug 368).
	headers := c.Request.Header.Values("Last-Event-ID")
	var last string
	if len(headers) > 0 {
		last = headers[0]
	}
	if slices.ContainsFunc(headers, func(v string) bool { return v != last }) {
		fields = append(fields, FieldError{Field: "Last-Event-ID", Message: "must be given once"})
	}
	field := "Last-Event-ID"
	query, _, twice := queryOnce(c, "last_event_id")
	if twice {
		fields = append(fields, FieldError{Field: "last_event_id", Message: "must be given once"})
	}
	if last == "" {
		last, field = query, "last_event_id"
	}
	if err := validationError(fields); err != nil {
		return err
	}
	if filtered {
		if !topics.ValidDeviceID(deviceID) {
			return errDeviceNotFound
		}
		b, err := s.store.Binding(ctx, deviceID)
		switch {
		case errors.Is(err, companion.ErrNotFound):
			return errDeviceNotFound
		case err != nil:
			return err
		case b.UserID != user.ID:
			return errDeviceNotFound
		}
	}
	release, err := s.streamSlot(user.ID)
	if err != nil {
		return err
	}
	defer release()
	sub, err := hub.subscribe(ctx, user.ID, deviceID)
	if err != nil {
		if errors.Is(err, errEventsClosed) {
			return &Error{Code: CodeNotReady}
		}
		return err
	}
	defer sub.close()

	// The id is checked, and the first page of the backlog read, before
	// the answer's status, so that an id that is no cursor is a 422
	// problem.
	var backlog []companion.Event
	var reset string // why the client missed events: resetExpired, resetUnknown
	after, caughtUp := last, last == ""
	if !caughtUp {
		pastEnd, err := hub.opts.Store.EventsPastEnd(ctx, last)
		if errors.Is(err, companion.ErrInvalidCursor) {
			return &Error{Code: CodeInvalidCursor, Fields: []FieldError{{Field: field, Message: "is not the id of an event"}}}
		}
		if err != nil {
			return err
		}
		if pastEnd {
			// Kept across a reset of the store: all the log holds is new
			// to the client.
			last, after = "", ""
			reset = resetUnknown
		} else if purged, err := hub.opts.Store.EventsPurgedAfter(ctx, last); err != nil {
			return err
		} else if purged {
			reset = resetExpired
		}
	}
	if c.Request.Method == http.MethodHead {
		// The status and headers of a stream that would open, and no
		// stream: a HEAD has no body to wait in.
		streamHeaders(c)
		return nil
	}
	if !caughtUp {
		if backlog, after, err = hub.opts.Store.Events(ctx, user.ID, after, eventsBacklogPage); err != nil {
			return err
		}
		caughtUp = len(backlog) < eventsBacklogPage
	}

	w := &sseWriter{c: c, rc: http.NewResponseController(c.Writer), timeout: hub.opts.WriteTimeout, last: last,
		http2: c.Request.ProtoMajor >= 2, gone: sub.gone}
	sub.attach(w.rc)
	// The deadline stays on the connection, which may serve another
	// request once the stream ends.
	defer func() { _ = w.rc.SetWriteDeadline(time.Time{}) }()
	streamHeaders(c)
	// The request's time, for the metrics, ends here: the rest is the
	// stream's life, as long as the client stays (docs/reliability.md,
	// bug 273).
	c.Set(ctxStreamBegan, time.Now())
	// A stream that starts from now gets its starting point as its first
	// id, in an event without data (EventSource keeps the id and fires
	// nothing): a client that loses the stream before any event came
	// resumes from there, instead of from whatever is "now" when it is back.
	// A stream after an id past the end gets it too when its backlog has
	// nothing for it (the old id would replay the log's start only while
	// the log has not passed it), not before a backlog: resumed after the
	// hub's cursor, the client would miss the backlog.
	hello := "retry: 2000\n\n"
	fromNow := last == "" && caughtUp && !slices.ContainsFunc(backlog, func(ev companion.Event) bool {
		return !filtered || ev.DeviceID == deviceID
	})
	if fromNow && sub.from != "" {
		hello = "retry: 2000\nid: " + sub.from + "\n\n"
	}
	if reset != "" {
		hello += resetFrame(reset)
	}
	if err := w.write([]byte(hello)); err != nil {
		return nil
	}
	for {
		for _, ev := range backlog {
			if filtered && ev.DeviceID != deviceID {
				continue
			}
			if err := w.event(ev); err != nil {
				return nil
			}
		}
		if caughtUp {
			break
		}
		if backlog, after, err = hub.opts.Store.Events(ctx, user.ID, after, eventsBacklogPage); err != nil {
			s.log.ErrorContext(ctx, "reading an event stream's backlog", requestIDAttr(c), "err", err)
			return nil // the client resumes from its last id
		}
		caughtUp = len(backlog) < eventsBacklogPage
	}

	ping := time.NewTicker(hub.opts.Heartbeat)
	defer ping.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-sub.gone:
			return nil // dropped, or the hub closed: the client resumes
		case ev := <-sub.ch:
			if err := w.events(ev, sub.ch); err != nil {
				return nil
			}
		case <-ping.C:
			if !s.streamAllowed(c, user.ID, deviceID) {
				// The client's reconnection is answered why: 401, or 404
				// device_not_found (docs/reliability.md, bug 275).
				return nil
			}
			// The ping carries the place the stream has reached, as an
			// id without data (EventSource keeps it as its last event id):
			// a stream that gets no event for hours (its device quiet, or
			// its user's) resumes from there, not from its last event,
			// whose successors, anyone's, the log has purged since; and a
			// stream of one device does not read its user's other devices'
			// events again (docs/reliability.md, bug 366).
			frame := []byte(": ping\n\n")
			at := hub.reached(sub)
			if at > w.last {
				frame = []byte("id: " + at + "\n: ping\n\n")
			}
			if err := w.write(frame); err != nil {
				return nil
			}
			w.last = max(w.last, at)
		}
	}
}

// streamAllowed reports whether the caller of a stream open since its
// request was admitted may still have it, as a new request would be
// answered: its identity provider's access token not expired (nor
// otherwise refused), its API token still the user's (not replaced), and
// the device of a stream of one device (deviceID) still bound to it. It is
// asked at every heartbeat: a token checked anew (a signature, in memory,
// or a read of the token's user), a binding read. A store that cannot
// answer keeps the stream: its client is not refused for it.
// docs/reliability.md, bug 275.
func (s *Server) streamAllowed(c *gin.Context, userID, deviceID string) bool {
	ctx := c.Request.Context()
	if tok := bearerToken(c); s.tokens != nil && looksLikeJWT(tok) {
		_, err := s.tokens.Verify(ctx, tok)
		var ku *KeysUnavailableError
		if errors.As(err, &ku) {
			return true // not judged: kept, as for a store that cannot answer (bug 476)
		}
		if err != nil {
			s.log.InfoContext(ctx, "event stream ended: its access token is refused now", requestIDAttr(c), "reason", err)
			return false
		}
	} else {
		u, err := s.store.UserByTokenHash(ctx, bearer(c))
		switch {
		case errors.Is(err, companion.ErrNotFound) || err == nil && u.ID != userID:
			s.log.InfoContext(ctx, "event stream ended: its API token was replaced", requestIDAttr(c))
			return false
		case err != nil:
			return true
		}
	}
	if deviceID == "" {
		return true
	}
	b, err := s.store.Binding(ctx, deviceID)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return false
	case err != nil:
		return true
	}
	return b.UserID == userID
}

// Reasons of an event "reset": why a stream's client has missed events.
const (
	// resetExpired: its Last-Event-ID is older than the log keeps
	// (companion.EventRetention): events after it were purged.
	resetExpired = "expired"
	// resetUnknown: its Last-Event-ID is past every id the store has
	// assigned: one of another store's log, or of this one before a reset.
	resetUnknown = "unknown_id"
)

// resetFrame is the event "reset" of reason: it has no id, so that a
// client that loses the stream before a later event resumes with its old
// id, and is told again.
func resetFrame(reason string) string {
	return "event: reset\ndata: {\"reason\":\"" + reason + "\"}\n\n"
}

// streamHeaders sets the status and headers of an event stream.
func streamHeaders(c *gin.Context) {
	h := c.Writer.Header()
	h.Set("Content-Type", "text/event-stream")
	// no-transform: a proxy or CDN that compresses what it passes on
	// (Cloudflare, Express's compression, an API gateway) holds a
	// stream's events in its compressor's buffer, for minutes at the
	// rate of a quiet stream, unless told not to transform it (RFC 9111
	// §5.2.2.6); it then passes the bytes as they come
	// (docs/reliability.md, bug 507).
	h.Set("Cache-Control", "no-store, no-transform")
	h.Set("X-Accel-Buffering", "no") // no proxy buffering
	c.Status(http.StatusOK)
}

// sseWriter writes a stream's events, each flushed within its deadline.
//
// Over HTTP/1 the deadline is the connection's: it matters only while a
// write is under way, and stays set between writes. Over HTTP/2 it is the
// stream's, a timer that resets the stream when it fires, whether or not
// a write is under way: it is cleared after each write, or a stream with
// nothing to write for the timeout (its heartbeat's check waiting on the
// store) was reset as if its client had stopped reading
// (docs/reliability.md, bug 321).
type sseWriter struct {
	c       *gin.Context
	rc      *http.ResponseController
	timeout time.Duration
	last    string // the id of the last event written
	http2   bool   // the deadline is the stream's timer
	gone    <-chan struct{}
}

// event writes ev, an event of the stream's backlog, and flushes it.
func (w *sseWriter) event(ev companion.Event) error {
	frame := eventFrame(ev)
	if frame == nil {
		return nil
	}
	if err := w.write(frame); err != nil {
		return err
	}
	w.last = ev.ID
	return nil
}

// events writes ev and the events already waiting behind it in more (a
// buffer's worth at most), then flushes them together: under load a flush
// per event was a system call per event and stream, half of the server's
// CPU with 200 streams open, and commands were accepted at a twentieth of
// their rate. An event already written from the backlog is skipped.
func (w *sseWriter) events(ev *encodedEvent, more <-chan *encodedEvent) error {
	if err := w.deadline(); err != nil {
		return err
	}
	for n := cap(more); ; n-- {
		if ev.frame != nil && (w.last == "" || ev.id > w.last) {
			// The hub's bytes, shared with the other streams: written,
			// never changed.
			if _, err := w.c.Writer.Write(ev.frame); err != nil {
				return err
			}
			w.last = ev.id
		}
		if n <= 0 {
			break
		}
		select {
		case ev = <-more:
			continue
		default:
		}
		break
	}
	return w.flush()
}

func (w *sseWriter) write(b []byte) error {
	// A client that does not take a write in time is dropped as one
	// that falls behind is.
	if err := w.deadline(); err != nil {
		return err
	}
	if _, err := w.c.Writer.Write(b); err != nil {
		return err
	}
	return w.flush()
}

// deadline sets the deadline of the next write, and refuses it once the
// hub dropped the stream or closed. Set, then looked at: either this sees
// the hub closed, or Close's own deadline, set after it closed the
// stream, comes after this one and ends the write (bug 326).
func (w *sseWriter) deadline() error {
	if err := w.rc.SetWriteDeadline(time.Now().Add(w.timeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	select {
	case <-w.gone:
		return errEventsClosed
	default:
		return nil
	}
}

// flush sends what was written; over HTTP/2 it then clears the deadline
// (see sseWriter).
func (w *sseWriter) flush() error {
	if err := w.rc.Flush(); err != nil || !w.http2 {
		return err
	}
	if err := w.rc.SetWriteDeadline(time.Time{}); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}
