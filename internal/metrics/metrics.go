// Package metrics is the Prometheus side of --metrics, for companion serve
// and companion-bridge: it keeps each program's figures in a registry of
// its own (with the Go runtime's and the process's), serves them as
// GET /metrics in the Prometheus text format on a listener of its own, and
// implements the observer interfaces that the packages doing the work
// declare: broker.Observer and api.RequestObserver (Server),
// agent.Observer and gatt.Observer (Bridge). docs/operations.md lists every
// metric.
//
// Why observers rather than Prometheus in those packages: the broker, the
// API, the agent and the Bluetooth side each say in a few methods what
// they have to tell, and are handed nil when nobody listens. They then
// neither import the client library nor depend on a registry (the global
// default one is shared by everything in the process, tests included, and
// refuses a second registration of a name: two servers in one test binary
// would collide), their tests need no metrics, and another backend
// (OpenTelemetry, expvar) would be one more implementation here.
//
// The calls come on hot paths (every command, every request, every store
// commit), so every series a call can touch is created up front, its
// labels bound once: a call is a map lookup or two and an atomic add,
// with no allocation. The series exist from the start, at zero, so that
// rate() and increase() see their first events.
//
// It is not an exporter of the store or of the broker's internals: those
// have their own counters (/debug/vars with --pprof).
package metrics

import (
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// newRegistry returns a registry of its own with the Go runtime's and the
// process's collectors.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}

// handler serves what reg gathers in the Prometheus text format (or
// OpenMetrics, when the scraper asks for it), and counts its scrapes and
// its failures in reg.
func handler(reg *prometheus.Registry) http.Handler {
	return promhttp.InstrumentMetricHandler(reg, promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		Registry:          reg,
		EnableOpenMetrics: true,
		// A scrape that takes this long is a scrape of a stuck process:
		// answer 503 rather than pile up goroutines.
		Timeout: 10 * time.Second,
	}))
}

// writeTimeout is how long a scrape may take to be written: past the
// handler's own Timeout, and the time to send its text.
var writeTimeout = 30 * time.Second

// Listener serves GET /metrics on an address of its own.
type Listener struct {
	ln   net.Listener
	srv  *http.Server
	done chan struct{}
}

// Listen listens on addr and serves reg's metrics at /metrics there until
// Close. The metrics need no token (Prometheus scrapes without one): keep
// the address on loopback or a network only the scraper reaches.
func Listen(addr string, reg *prometheus.Registry, log *slog.Logger) (*Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", handler(reg))
	l := &Listener{
		ln: ln,
		srv: &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: 10 * time.Second,
			// A scraper that stops reading held its handler, and the
			// scrape in its buffers, for ever (docs/reliability.md,
			// bug 362).
			WriteTimeout: writeTimeout,
			IdleTimeout:  2 * time.Minute,
			ErrorLog:     slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		done: make(chan struct{}),
	}
	go func() {
		defer close(l.done)
		if err := l.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server", "err", err)
		}
	}()
	log.Info("metrics listening", "url", "http://"+ln.Addr().String()+"/metrics")
	return l, nil
}

// Addr is the address it listens on (useful with port 0).
func (l *Listener) Addr() string { return l.ln.Addr().String() }

// Close stops the listener, cuts scrapes in progress and waits for the
// serving goroutine.
func (l *Listener) Close() error {
	err := l.srv.Close()
	<-l.done
	return err
}

// Buckets, in seconds.
var (
	// commandBuckets span a quick command (a text push answers in tens of
	// milliseconds) to a firmware update over Bluetooth (minutes) and a
	// command that waited for its device for an hour.
	commandBuckets = []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600}
	// storeBuckets span a grouped bbolt commit (one fsync, about a
	// millisecond) to a PostgreSQL round trip under load.
	storeBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}
	// transferBuckets span a small image over BLE 2M (tenths of a second)
	// to a large firmware image over a slow link (many minutes).
	transferBuckets = []float64{.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800}
)

// gauge01 is 1 for true, 0 for false.
func gauge01(v bool) float64 {
	if v {
		return 1
	}
	return 0
}
