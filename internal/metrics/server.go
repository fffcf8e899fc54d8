package metrics

import (
	"context"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/topics"
)

// The kinds of store write, in the order of their pre-bound series. The ops
// and states are topics.Ops and companion.States.
var storeWrites = []string{
	broker.StoreWriteCreate, broker.StoreWriteReply, broker.StoreWriteSent, broker.StoreWriteCancel,
	broker.StoreWriteExpire, broker.StoreWriteStatus, broker.StoreWriteSettings, broker.StoreWriteOffline,
}

// opSeries are the pre-bound series of one op.
type opSeries struct {
	entered []prometheus.Counter  // by index in companion.States
	latency []prometheus.Observer // by index in companion.States; final states only
}

// ServerOptions configure a Server.
type ServerOptions struct {
	// OpenCommands counts the commands accepted and not final yet in the
	// store, every replica's. Without it the open commands gauge is not
	// served.
	OpenCommands func(context.Context) (int, error)
	// Undecodable counts the records of the store met since it opened
	// that do not decode (store.DB.Undecodable). Without it the gauge is
	// not served (PostgreSQL has no such records).
	Undecodable func() int
	// StoreFaults calls its fn with each fault of the store the log says
	// (store.DB.Faults, postgres.Store.Faults) and whether it stands now.
	// Without it the gauge is not served.
	StoreFaults func(fn func(name string, stands bool))
	// IdentityProviderUnavailable reports whether the identity provider's
	// signing keys cannot be fetched now (api.OIDCVerifier.KeysUnavailable).
	// Without it (no --oidc-issuer) the gauge is not served.
	IdentityProviderUnavailable func() bool
	// IdentityProviderMisconfigured reports whether the issuer's
	// discovery fails in a way no retry mends
	// (api.OIDCVerifier.Misconfigured); served with the gauge above.
	IdentityProviderMisconfigured func() bool
	// Logger receives a failed count of the open commands;
	// slog.Default() when nil.
	Logger *slog.Logger
}

// Server holds the figures of companion serve. It implements
// broker.Observer and api.RequestObserver; create it with NewServer.
type Server struct {
	reg *prometheus.Registry

	entered   *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	ops       map[string]*opSeries // read-only after NewServer
	open      *openCommands
	mqtt      prometheus.Gauge
	away      prometheus.Gauge               // bridges the broker takes as away
	unheard   prometheus.Gauge               // bridges with commands sent again and again unanswered
	stateless prometheus.Gauge               // bridges heard from that never said their state
	store     map[string]prometheus.Observer // read-only after NewServer
	storeV    *prometheus.HistogramVec
	// coalesced counts, by kind, the device reports acknowledged unstored
	// (broker.Options.ReportRate).
	coalesced map[string]prometheus.Counter // read-only after NewServer
	coalescV  *prometheus.CounterVec

	httpTotal *prometheus.CounterVec
	httpTime  *prometheus.HistogramVec
	httpMu    sync.RWMutex
	http      map[httpKey]httpSeries
}

type httpKey struct {
	method, route string
	status        int
}

type httpSeries struct {
	total prometheus.Counter
	took  prometheus.Observer
}

// NewServer registers the server's metrics in a registry of its own.
func NewServer(opts ServerOptions) *Server {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Server{
		reg: newRegistry(),
		entered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_commands_total",
			Help: "Commands that entered a state on this server, by op and state (queued when accepted; sent and delivered may be skipped).",
		}, []string{"op", "state"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "companion_command_duration_seconds",
			Help:    "Time from a command's acceptance to its final state, by op and final state.",
			Buckets: commandBuckets,
		}, []string{"op", "state"}),
		open: &openCommands{
			desc: prometheus.NewDesc("companion_commands_open",
				"Commands accepted and not final yet (counted in the store, so every replica's).", nil, nil),
			count: opts.OpenCommands,
			log:   opts.Logger,
		},
		mqtt: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_mqtt_connected",
			Help: "1 while the server's MQTT connection is up and subscribed, else 0.",
		}),
		away: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridges_away",
			Help: "Bridges whose last word this server took in was their Will (or their offline at shutdown): their devices' commands wait queued in the store until they say online.",
		}),
		unheard: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridges_unheard",
			Help: "Bridges that read online with a command sent again 3 times or more and not answered: the broker does not let them read their commands, or drops their replies.",
		}),
		stateless: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridges_stateless",
			Help: "Bridges whose devices have reported for a minute or more while no state message of theirs (online, offline, their Will) ever reached the server: the broker drops them, and once such a bridge is gone its devices read online for good.",
		}),
		storeV: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "companion_store_write_duration_seconds",
			Help:    "Time for a write of the command broker to be durable in the store, by kind of write.",
			Buckets: storeBuckets,
		}, []string{"write"}),
		coalescV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_device_reports_coalesced_total",
			Help: "Device statuses and settings taken from MQTT and not stored: they came faster than the server takes a device's reports, and a newer one of the device took their place, by kind (status, settings).",
		}, []string{"kind"}),
		httpTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_http_requests_total",
			Help: "HTTP requests answered, by method, route (as registered, not the URL) and status code.",
		}, []string{"method", "route", "code"}),
		httpTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "companion_http_request_duration_seconds",
			Help:    "Time to answer an HTTP request, by method and route.",
			Buckets: prometheus.DefBuckets,
		}, []string{"method", "route"}),
		ops:   make(map[string]*opSeries, len(topics.Ops)),
		store: make(map[string]prometheus.Observer, len(storeWrites)),
		http:  make(map[httpKey]httpSeries),
	}
	s.reg.MustRegister(s.entered, s.latency, s.mqtt, s.away, s.unheard, s.stateless, s.storeV, s.coalescV, s.httpTotal, s.httpTime)
	if s.open.count != nil {
		s.reg.MustRegister(s.open)
	}
	if n := opts.Undecodable; n != nil {
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "companion_store_undecodable_records",
			Help: "Records of the bbolt store met since it opened that do not decode (the file damaged there), each left out of the reads that met it and logged once; restore the file from a backup.",
		}, func() float64 { return float64(n()) }))
	}
	if f := opts.StoreFaults; f != nil {
		s.reg.MustRegister(storeFaults{each: f, desc: prometheus.NewDesc("companion_store_fault",
			"1 while the store's fault stands (the server's log said it, and has not said it gone), by fault: the bbolt store's disk "+
				"refuses writes (cannot write) or keeps one waiting (not answering); PostgreSQL cannot be reached, refuses writes, …; else 0.",
			[]string{"fault"}, nil)})
	}
	if f := opts.IdentityProviderUnavailable; f != nil {
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "companion_identity_provider_unavailable",
			Help: "1 while the identity provider's signing keys cannot be fetched (its discovery has not worked yet, or the last fetch of its keys failed): " +
				"an access token of a key not at hand is answered 503, not judged; else 0. Served with --oidc-issuer.",
		}, func() float64 { return gauge01(f()) }))
	}
	if f := opts.IdentityProviderMisconfigured; f != nil {
		// Of the unavailable ones, those the operator must mend: retrying
		// does not (docs/reliability.md, bug 491).
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "companion_identity_provider_misconfigured",
			Help: "1 while the issuer's discovery fails in a way no retry mends (--oidc-issuer answers 404, a page that is not its document, or another issuer's document): " +
				"every access token is answered 503 until the settings are mended; else 0. Served with --oidc-issuer.",
		}, func() float64 { return gauge01(f()) }))
	}
	for _, op := range topics.Ops {
		o := &opSeries{
			entered: make([]prometheus.Counter, len(companion.States)),
			latency: make([]prometheus.Observer, len(companion.States)),
		}
		for i, st := range companion.States {
			o.entered[i] = s.entered.WithLabelValues(op, st)
			if companion.IsFinal(st) {
				o.latency[i] = s.latency.WithLabelValues(op, st)
			}
		}
		s.ops[op] = o
	}
	for _, w := range storeWrites {
		s.store[w] = s.storeV.WithLabelValues(w)
	}
	s.coalesced = make(map[string]prometheus.Counter, 2)
	for _, k := range []topics.Kind{topics.KindStatus, topics.KindSettings} {
		s.coalesced[k.String()] = s.coalescV.WithLabelValues(k.String())
	}
	return s
}

// Registry is where the server's metrics are registered.
func (s *Server) Registry() *prometheus.Registry { return s.reg }

// CommandState counts a command entering state; a final state also ends
// its accept-to-final time.
func (s *Server) CommandState(op, state string, age time.Duration) {
	final := companion.IsFinal(state)
	if o, i := s.ops[op], slices.Index(companion.States, state); o != nil && i >= 0 {
		o.entered[i].Inc()
		if final {
			o.latency[i].Observe(age.Seconds())
		}
	} else {
		// Not one of the ops or states known at build time (the broker
		// refuses other ops): counted all the same, at the price of a
		// lookup.
		s.entered.WithLabelValues(op, state).Inc()
		if final {
			s.latency.WithLabelValues(op, state).Observe(age.Seconds())
		}
	}
}

// MQTTConnected sets the connection gauge.
func (s *Server) MQTTConnected(up bool) { s.mqtt.Set(gauge01(up)) }

// BridgesAway sets how many bridges the broker takes as away.
func (s *Server) BridgesAway(n int) { s.away.Set(float64(n)) }

// BridgesUnheard sets how many bridges have commands sent again and again
// with no answer (docs/reliability.md, bug 489).
func (s *Server) BridgesUnheard(n int) { s.unheard.Set(float64(n)) }

// BridgesStateless sets how many bridges have had their devices heard from
// while none of their state messages reached the server.
func (s *Server) BridgesStateless(n int) { s.stateless.Set(float64(n)) }

// StoreWrite observes how long a write of the broker took.
func (s *Server) StoreWrite(kind string, took time.Duration) {
	h := s.store[kind]
	if h == nil {
		h = s.storeV.WithLabelValues(kind)
	}
	h.Observe(took.Seconds())
}

// ReportCoalesced counts a device's report acknowledged unstored.
func (s *Server) ReportCoalesced(kind string) {
	if c := s.coalesced[kind]; c != nil {
		c.Inc()
	}
}

// Request counts an answered HTTP request. Routes are the API's own, a
// bounded set; a request no route matched counts under route "unmatched",
// and a method outside HTTP's usual ones as "other", so that no client can
// make up series.
func (s *Server) Request(method, route string, status int, took time.Duration) {
	method = knownMethod(method)
	if route == "" {
		route = "unmatched"
	}
	k := httpKey{method, route, status}
	s.httpMu.RLock()
	hs, ok := s.http[k]
	s.httpMu.RUnlock()
	if !ok {
		hs = httpSeries{
			total: s.httpTotal.WithLabelValues(method, route, strconv.Itoa(status)),
			took:  s.httpTime.WithLabelValues(method, route),
		}
		s.httpMu.Lock()
		s.http[k] = hs
		s.httpMu.Unlock()
	}
	hs.total.Inc()
	hs.took.Observe(took.Seconds())
}

// knownMethods are the methods of net/http, which HTTP requests are
// counted by; any other counts as "other".
var knownMethods = []string{
	http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
	http.MethodPatch, http.MethodDelete, http.MethodOptions,
}

// knownMethod returns m as the constant string of net/http, or "other".
func knownMethod(m string) string {
	if i := slices.Index(knownMethods, m); i >= 0 {
		return knownMethods[i]
	}
	return "other"
}

// openCommands is the open commands gauge, counted in the store when
// scraped. Followed here from the states this server saw, it would miss
// what other replicas of a shared store end (PostgreSQL): each replica
// would count those open for good.
//
// A count is the store's (companion.Store.CountAllOpen: the keys of an
// index on bbolt, a sum of the devices' counts on PostgreSQL), cheap but
// not free at a million devices: a count is served again, rather than made
// anew, for openReuse times as long as it took, which bounds the time spent
// counting to about a tenth whatever the scrapers do, and keeps the figure
// fresh when counting is cheap. Scrapes at the same time wait for one count.
type openCommands struct {
	desc  *prometheus.Desc
	count func(context.Context) (int, error)
	log   *slog.Logger

	mu   sync.Mutex
	n    int
	err  error         // of the last count, then n means nothing
	at   time.Time     // when the last count began; zero before the first
	took time.Duration // how long the last count took
}

const (
	// openReuse is how many times as long as it took a count is served.
	openReuse = 10
	// openTimeout bounds a count: the scrape itself gives up after 10 s.
	openTimeout = 9 * time.Second
)

// Describe implements prometheus.Collector.
func (o *openCommands) Describe(ch chan<- *prometheus.Desc) { ch <- o.desc }

// Collect implements prometheus.Collector. A count that failed (or timed
// out) leaves the gauge out (and logs why): no figure rather than a wrong
// one. It is not tried again sooner than a count that succeeded would be.
func (o *openCommands) Collect(ch chan<- prometheus.Metric) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.at.IsZero() || time.Since(o.at) >= openReuse*o.took {
		ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
		defer cancel()
		o.at = time.Now()
		o.n, o.err = o.count(ctx)
		o.took = time.Since(o.at)
		if o.err != nil {
			o.log.Warn("metrics: counting the open commands", "err", o.err, "took", o.took)
		}
	}
	if o.err == nil {
		ch <- prometheus.MustNewConstMetric(o.desc, prometheus.GaugeValue, float64(o.n))
	}
}

// storeFaults serves companion_store_fault from the store's log of its
// faults, at each scrape (bug 340).
type storeFaults struct {
	each func(fn func(name string, stands bool))
	desc *prometheus.Desc
}

// Describe implements prometheus.Collector.
func (f storeFaults) Describe(ch chan<- *prometheus.Desc) { ch <- f.desc }

// Collect implements prometheus.Collector.
func (f storeFaults) Collect(ch chan<- prometheus.Metric) {
	f.each(func(name string, stands bool) {
		ch <- prometheus.MustNewConstMetric(f.desc, prometheus.GaugeValue, gauge01(stands), name)
	})
}

// The server's metrics serve what these packages ask of an observer.
var (
	_ broker.Observer     = (*Server)(nil)
	_ api.RequestObserver = (*Server)(nil)
)
