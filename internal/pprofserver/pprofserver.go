// Package pprofserver serves net/http/pprof and expvar's /debug/vars on a
// listener of its own, for the --pprof flag of companion serve and
// companion-bridge. It is off unless asked for: the profiles say much about
// the process and need no token, so the address should be a loopback one.
package pprofserver

import (
	"errors"
	"expvar"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Server is a running pprof listener.
type Server struct {
	ln   net.Listener
	srv  *http.Server
	done chan struct{}
}

// Start listens on addr and serves /debug/pprof/ there until Close.
func Start(addr string, log *slog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	// The process's counters (memstats, and what it publishes with expvar).
	mux.Handle("/debug/vars", expvar.Handler())
	s := &Server{
		ln: ln,
		srv: &http.Server{
			Handler:           boundWrites(mux),
			ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout:       2 * time.Minute,
		},
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("pprof server", "err", err)
		}
	}()
	log.Info("pprof listening", "addr", ln.Addr().String())
	return s, nil
}

// writeTimeout is how long an answer may take to write, past the seconds
// it asks to run for (boundWrites).
var writeTimeout = time.Minute

// maxSeconds caps the seconds boundWrites adds for a profile: a day.
const maxSeconds = 24 * 60 * 60

// boundWrites gives each answer writeTimeout, plus the seconds it asks to
// run for (a CPU profile, a trace or a delta profile of seconds=N runs N s
// before it writes), to be written: a client that stops reading (a
// stalled profiler, a half-dead connection) held its handler, with the
// profile in its buffers, for ever (docs/reliability.md, bug 362). The
// server's WriteTimeout would bound it too, but pprof answers a profile of
// that many seconds or more 400 under it; hence a deadline per request.
func boundWrites(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d := writeTimeout
		if sec, err := strconv.ParseInt(r.URL.Query().Get("seconds"), 10, 64); err == nil && sec > 0 {
			d += time.Duration(min(sec, maxSeconds)) * time.Second
		}
		// It fails only on a connection that cannot have one (none here).
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(d))
		h.ServeHTTP(w, r)
	})
}

var (
	publishMu sync.Mutex
	published = map[string]*atomic.Pointer[func() any]{}
)

// Publish shows what f returns under name in /debug/vars. expvar allows a
// name once per process; a later Publish of the same name (a test that runs
// a second server in the process) replaces f.
func Publish(name string, f func() any) {
	publishMu.Lock()
	defer publishMu.Unlock()
	p := published[name]
	if p == nil {
		p = new(atomic.Pointer[func() any])
		published[name] = p
		expvar.Publish(name, expvar.Func(func() any { return (*p.Load())() }))
	}
	p.Store(&f)
}

// Addr is the address it listens on (useful with port 0).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the listener, cuts profiles in progress (a CPU profile may
// run for many seconds) and waits for the serving goroutine.
func (s *Server) Close() error {
	err := s.srv.Close()
	<-s.done
	return err
}
