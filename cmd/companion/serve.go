package main

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/broker/dynsec"
	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/buildinfo"
	"github.com/devicecompanion/companion/internal/flagcheck"
	"github.com/devicecompanion/companion/internal/metrics"
	"github.com/devicecompanion/companion/internal/pprofserver"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/store/postgres"
	"github.com/devicecompanion/companion/topics"
)

// Config is everything `companion serve` can be told.
type Config struct {
	HTTP         string // listen address of the HTTP API
	Data         string // directory of the bbolt file, blobs and tokens
	MQTTListen   string // the embedded broker's address, when MQTTURL is empty
	MQTTURL      string // an external broker; then nothing embedded listens
	MQTTUsername string
	MQTTPassword string
	// MQTTDynsec, with MQTTURL, has the server keep Mosquitto's accounts
	// and ACLs through its dynamic-security plugin (the flag defaults to
	// true; the zero Config leaves them to the operator).
	MQTTDynsec bool
	// MQTTPinClientIDs, with MQTTDynsec, ties each bridge's and user's
	// Mosquitto account to its client id (dynsec.Options.PinClientIDs).
	MQTTPinClientIDs bool
	AdminToken       string // generated into DATA/admin.token when empty
	TopicPrefix      string
	Demo             bool
	LogLevel         string
	Limits           api.Limits    // zero fields take CONTRACT §6's defaults
	Retention        time.Duration // how long final commands are kept
	// ReportRate and ReportBurst bound how often one device's statuses,
	// and its settings, are taken in from MQTT (broker.Options.ReportRate):
	// zero takes the defaults, a negative ReportRate takes every report.
	ReportRate  float64
	ReportBurst int
	ExpiryGrace time.Duration   // how long past its TTL a sent command waits for the bridge
	OIDC        api.OIDCOptions // access tokens of an identity provider, when Issuer is set
	TLSCert     string          // PEM certificate (chain) of the HTTP API; HTTPS when set
	TLSKey      string          // its private key
	MQTTCA      string          // PEM CA bundle to verify an mqtts:// broker with (default: system roots)
	MQTTTLSCert string          // the embedded broker's certificate: it then serves mqtts:// only
	MQTTTLSKey  string
	PProf       string // listen address of net/http/pprof; "" off
	// Metrics is the listen address of GET /metrics (Prometheus); "" off.
	Metrics         string
	metricsOptional bool // the demo's default address: taken is no error
	// Store is a postgres:// URL to keep everything in PostgreSQL; "" keeps
	// it in the bbolt file of Data.
	Store string
	// ReplicaID names this server among replicas sharing one store and
	// broker: its MQTT client id is companion-server-ReplicaID (default
	// with a PostgreSQL store: the host name).
	ReplicaID string
	// NATS, with URL set, answers a NATS cluster's authorization (auth
	// callout) of the MQTT clients; --mqtt-dynsec is then off.
	NATS NATSConfig

	// For tests: a clock, and how often undelivered commands are checked for expiry.
	Now           func() time.Time
	SweepInterval time.Duration
	// For tests: how long the Will of a bridge disconnected for a change
	// of its rights is held (broker.Options.KickGrace, and the embedded
	// broker's); zero takes the default, 10 s.
	KickGrace time.Duration
	// MQTTSessionsPerAccount bounds the embedded broker's sessions of one
	// account (embedded.Options.MaxSessions): 0 its default, negative none.
	MQTTSessionsPerAccount int
	// For tests: the options of GET /api/v1/events (heartbeat, buffer),
	// zero fields taking their defaults.
	Events api.EventsOptions
}

func newServeFlags(c *Config) *flag.FlagSet {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	setUsage(fs)
	fs.StringVar(&c.HTTP, "http", "127.0.0.1:8080", "HTTP API listen address")
	fs.StringVar(&c.Data, "data", "./data", "data directory (bbolt file, blobs, admin token)")
	fs.StringVar(&c.MQTTListen, "mqtt-listen", "127.0.0.1:1883", "listen address of the embedded MQTT broker")
	fs.StringVar(&c.MQTTURL, "mqtt-url", "", "external MQTT broker (tcp://host:port), or a comma-separated list of a cluster's nodes to fail over between; disables the embedded one")
	fs.StringVar(&c.MQTTUsername, "mqtt-username", "", "username on the external MQTT broker")
	fs.StringVar(&c.MQTTPassword, "mqtt-password", "", "password on the external MQTT broker")
	fs.BoolVar(&c.MQTTDynsec, "mqtt-dynsec", true, "with --mqtt-url: keep Mosquitto's accounts and ACLs through its dynamic-security plugin (the server's account must be the plugin's admin)")
	fs.BoolVar(&c.MQTTPinClientIDs, "mqtt-pin-client-ids", false, "with --mqtt-dynsec: a bridge may log in to Mosquitto only with client id companion-bridge-ID and a user only with companion-user-ID (one connection each), so that none can take the server's session or another's")
	fs.StringVar(&c.AdminToken, "admin-token", "", "admin API token (default: generated into DATA/admin.token)")
	fs.StringVar(&c.TopicPrefix, "topic-prefix", topics.DefaultPrefix, "MQTT topic prefix")
	fs.BoolVar(&c.Demo, "demo", false, "also run a bridge with three simulated devices and a demo user")
	fs.StringVar(&c.TLSCert, "tls-cert", "", "PEM certificate of the HTTP API (serve HTTPS)")
	fs.StringVar(&c.TLSKey, "tls-key", "", "PEM private key of --tls-cert")
	fs.StringVar(&c.MQTTTLSCert, "mqtt-tls-cert", "", "PEM certificate of the embedded broker (it then serves mqtts:// only)")
	fs.StringVar(&c.MQTTTLSKey, "mqtt-tls-key", "", "PEM private key of --mqtt-tls-cert")
	fs.StringVar(&c.MQTTCA, "mqtt-ca", "", "PEM CA bundle to verify the broker of an mqtts:// --mqtt-url")
	fs.StringVar(&c.OIDC.Issuer, "oidc-issuer", "", "accept access tokens (JWT) of this OpenID Connect issuer; their sub names the user")
	fs.StringVar(&c.OIDC.Audience, "oidc-audience", "", "the aud the issuer's tokens must carry (required with --oidc-issuer)")
	fs.StringVar(&c.OIDC.JWKSURL, "oidc-jwks-url", "", "the issuer's JWKS (default: found by OpenID Connect discovery)")
	fs.DurationVar(&c.OIDC.ClockSkew, "oidc-clock-skew", time.Minute, "how long past exp a token is still taken")
	fs.DurationVar(&c.ExpiryGrace, "expiry-grace", time.Minute, "how long past its TTL a command the broker has waits for the bridge's word before it is called expired (up to ten times as long while its device reads online)")
	fs.DurationVar(&c.Retention, "retention", 30*24*time.Hour, "how long finished commands are kept (at least 24h)")
	fs.StringVar(&c.LogLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.Store, "store", "", "postgres://USER@HOST:PORT/DB keeps everything in PostgreSQL, shared by replicas (run companion migrate first); empty: the bbolt file in --data")
	fs.StringVar(&c.ReplicaID, "replica-id", "", "this replica's name among servers sharing a store and broker; its MQTT client id is companion-server-ID (default with --store postgres://: the host name)")
	fs.StringVar(&c.PProf, "pprof", "", "serve net/http/pprof on this address (off when empty; keep it on loopback)")
	addNATSFlags(fs, &c.NATS)
	fs.StringVar(&c.Metrics, "metrics", "", "serve GET /metrics (Prometheus) on this address (off when empty; --demo: "+demoMetricsAddr+")")
	d, l := api.DefaultLimits, &c.Limits
	fs.IntVar(&l.MaxTextBytes, "max-text-bytes", d.MaxTextBytes, "largest text push, bytes of UTF-8")
	fs.IntVar(&l.MaxTitleBytes, "max-title-bytes", d.MaxTitleBytes, "largest title of a text push")
	fs.Int64Var(&l.MaxImageBytes, "max-image-bytes", d.MaxImageBytes, "largest image push, decoded bytes")
	fs.IntVar(&l.MaxImageSide, "max-image-side", d.MaxImageSide, "largest image width or height, pixels")
	fs.Int64Var(&l.MaxAppBytes, "max-app-bytes", d.MaxAppBytes, "largest app package")
	fs.Int64Var(&l.MaxFirmwareBytes, "max-firmware-bytes", d.MaxFirmwareBytes, "largest firmware image")
	fs.IntVar(&l.MaxOpenCommands, "max-open-commands", d.MaxOpenCommands, "unfinished commands a device may have")
	fs.Float64Var(&l.RequestsPerSecond, "rate-per-token", d.RequestsPerSecond, "requests per second per token (0: no limit)")
	fs.IntVar(&l.RequestBurst, "rate-burst", d.RequestBurst, "burst of requests per token")
	fs.IntVar(&l.RegisterPerMinute, "register-per-minute", d.RegisterPerMinute, "register attempts a minute per user (0: no limit)")
	fs.IntVar(&l.UnauthPerMinute, "unauth-per-minute", d.UnauthPerMinute, "requests without a valid token a minute per source address (0: no limit)")
	fs.IntVar(&l.MaxStreamsPerUser, "max-streams-per-user", d.MaxStreamsPerUser, "event streams (GET /api/v1/events) one user may have open at once on this server; past them a stream is a 429 (0: no limit)")
	fs.IntVar(&l.MaxWaitsPerUser, "max-waits-per-user", d.MaxWaitsPerUser, "requests of one user Prefer: wait may hold at once on this server; past them such a request is a 429 (0: no limit)")
	fs.IntVar(&l.MaxBridgesPerUser, "max-bridges-per-user", d.MaxBridgesPerUser, "bridges of their own one user may have (POST /api/v1/bridges); past them a creation is a 422 (0: no limit)")
	fs.Int64Var(&l.MaxBodyBytesPerUser, "max-body-bytes-per-user", d.MaxBodyBytesPerUser, "bytes of request bodies one user's requests may be sending to this server at once; past them a request is a 429 before its body is read (0: no limit)")
	fs.IntVar(&c.MQTTSessionsPerAccount, "mqtt-sessions-per-account", embedded.DefaultMaxSessions, "embedded broker: MQTT sessions one account (a bridge, a user) may hold, connected or kept for a client that left; past them the oldest offline one ends, or the login is refused (0: no limit)")
	fs.Float64Var(&c.ReportRate, "report-rate", 1, "statuses, and settings, of one device taken in a second from MQTT; a report over it waits its turn, and a newer one takes its place (0: no limit)")
	fs.IntVar(&c.ReportBurst, "report-burst", 10, "burst of --report-rate")
	return fs
}

// minRetention is the shortest --retention the broker takes: an
// Idempotency-Key answers repeats for a day with its command.
const minRetention = 24 * time.Hour

// checkFlags refuses, naming the flag, a value the server cannot run with
// (exit status 2), where the packages it goes to would take it for their
// default (a zero), fail later with a message of their own, or log it (a
// broker URL's password). onCommandLine names the flags of the command
// line: --mqtt-listen there wins over COMPANION_MQTT_URL, as a flag wins
// over the environment.
func (c *Config) checkFlags(onCommandLine map[string]bool) error {
	switch {
	case onCommandLine["mqtt-listen"] && onCommandLine["mqtt-url"]:
		return usageError{"give --mqtt-listen (the embedded broker) or --mqtt-url (another broker), not both"}
	case onCommandLine["mqtt-listen"]:
		c.MQTTURL = ""
	}
	// A flag of the other kind of broker would be ignored: most likely a
	// mistake (credentials meant for a broker the server does not use, a
	// certificate for one it does not run), and said so rather than run
	// without what the operator meant.
	external := []string{"mqtt-username", "mqtt-password", "mqtt-ca", "mqtt-dynsec", "mqtt-pin-client-ids"}
	embedded := []string{"mqtt-tls-cert", "mqtt-tls-key"}
	for _, name := range external {
		if c.MQTTURL == "" && onCommandLine[name] {
			return usageError{fmt.Sprintf("--%s is for an external broker (--mqtt-url); the embedded one takes the accounts of the store", name)}
		}
	}
	for _, name := range embedded {
		if c.MQTTURL != "" && onCommandLine[name] {
			return usageError{fmt.Sprintf("--%s is for the embedded broker; with --mqtt-url the broker has its own certificate", name)}
		}
	}
	// The callout's account and keys without --nats-callout were ignored:
	// the cluster then waited for a callout nobody answered.
	if c.NATS.URL == "" {
		for _, name := range []string{"nats-callout-user", "nats-callout-password", "nats-system-user", "nats-system-password", "nats-issuer-seed", "nats-account"} {
			if onCommandLine[name] {
				return usageError{fmt.Sprintf("--%s is for --nats-callout URL (answering a NATS cluster's authorization), which is not given", name)}
			}
		}
	}
	// Only the dynamic-security driver pins client ids: without it the
	// flag did nothing, and bridges and users kept taking any client id.
	if c.MQTTURL != "" && c.MQTTPinClientIDs && (!c.MQTTDynsec || c.NATS.URL != "") {
		return usageError{"--mqtt-pin-client-ids is done by --mqtt-dynsec on Mosquitto's accounts; with --mqtt-dynsec=false or --nats-callout it would do nothing"}
	}
	if tlsclient.HasCredentials(c.MQTTURL) {
		return usageError{"--mqtt-url: a broker URL holds credentials (user:password@), which would be printed and logged; give them as --mqtt-username and --mqtt-password"}
	}
	if c.MQTTURL != "" {
		if _, err := tlsclient.BrokerURLs(c.MQTTURL); err != nil {
			return usageError{"--mqtt-url: " + err.Error()}
		}
	}
	// Every store keeps admin.token in --data; an empty one ended the
	// start in "mkdir : no such file or directory", exit status 1.
	if c.Data == "" {
		return usageError{"--data is empty: give the data directory (default ./data)"}
	}
	// An empty --http (COMPANION_HTTP= in an env file) is no "off": to
	// net.Listen it is every interface, on a port it picks.
	if c.HTTP == "" {
		return usageError{"--http is empty: give HOST:PORT for the HTTP API (default 127.0.0.1:8080; port 0: any free one)"}
	}
	listens := c.listens()
	for _, l := range listens {
		if err := flagcheck.ListenAddr(l.Flag, l.Addr); err != nil {
			return usageError{err.Error()}
		}
	}
	// Two on one port: the later listener failed "address already in
	// use", exit status 1, as if another process held it.
	if err := flagcheck.Distinct(listens...); err != nil {
		return usageError{err.Error()}
	}
	// One without a scheme or host would end the start in OIDC discovery
	// ("unsupported protocol scheme", exit status 1), naming no flag.
	for _, f := range []struct{ name, v string }{{"oidc-issuer", c.OIDC.Issuer}, {"oidc-jwks-url", c.OIDC.JWKSURL}} {
		if u, err := url.Parse(f.v); f.v != "" && (err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "") {
			return usageError{fmt.Sprintf("--%s %q: give an https:// (or http://) URL with a host", f.name, f.v)}
		}
	}
	l := c.Limits
	// max: the byte limits are at most api.MaxByteLimit, since near int64's
	// end the body limits worked out from them wrapped (a text past 64 KiB,
	// or every image, was refused); 0 bounds nothing.
	for _, f := range []struct {
		name   string
		v, max int64
	}{
		{"max-text-bytes", int64(l.MaxTextBytes), api.MaxByteLimit},
		{"max-title-bytes", int64(l.MaxTitleBytes), api.MaxByteLimit},
		{"max-image-bytes", l.MaxImageBytes, api.MaxByteLimit},
		{"max-image-side", int64(l.MaxImageSide), 0},
		{"max-app-bytes", l.MaxAppBytes, api.MaxByteLimit},
		{"max-firmware-bytes", l.MaxFirmwareBytes, api.MaxByteLimit},
		{"max-open-commands", int64(l.MaxOpenCommands), 0},
		{"rate-burst", int64(l.RequestBurst), 0},
		{"report-burst", int64(c.ReportBurst), 0},
	} {
		switch {
		case f.v <= 0:
			return usageError{fmt.Sprintf("--%s %d: must be positive", f.name, f.v)}
		case f.max > 0 && f.v > f.max:
			return usageError{fmt.Sprintf("--%s %d: must be at most %d (1 TiB)", f.name, f.v, f.max)}
		}
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"rate-per-token", l.RequestsPerSecond},
		{"register-per-minute", float64(l.RegisterPerMinute)},
		{"unauth-per-minute", float64(l.UnauthPerMinute)},
		{"max-streams-per-user", float64(l.MaxStreamsPerUser)},
		{"max-waits-per-user", float64(l.MaxWaitsPerUser)},
		{"max-bridges-per-user", float64(l.MaxBridgesPerUser)},
		{"max-body-bytes-per-user", float64(l.MaxBodyBytesPerUser)},
		{"mqtt-sessions-per-account", float64(c.MQTTSessionsPerAccount)},
		{"report-rate", c.ReportRate},
	} {
		if !(f.v >= 0) { // NaN too
			return usageError{fmt.Sprintf("--%s %v: must be 0 (no limit) or more", f.name, f.v)}
		}
	}
	switch {
	case c.Retention < minRetention:
		return usageError{fmt.Sprintf("--retention %s: must be at least %s (an Idempotency-Key answers repeats for a day)", c.Retention, minRetention)}
	case c.ExpiryGrace <= 0:
		return usageError{fmt.Sprintf("--expiry-grace %s: must be positive", c.ExpiryGrace)}
	case c.OIDC.ClockSkew <= 0:
		return usageError{fmt.Sprintf("--oidc-clock-skew %s: must be positive", c.OIDC.ClockSkew)}
	case c.OIDC.Issuer != "" && c.OIDC.Audience == "":
		return usageError{"--oidc-issuer needs --oidc-audience: the aud its tokens must carry"}
	case c.OIDC.Issuer == "" && (c.OIDC.Audience != "" || c.OIDC.JWKSURL != ""):
		return usageError{"--oidc-audience and --oidc-jwks-url need --oidc-issuer"}
	}
	return nil
}

// listens is the server's listen addresses and their flags ("" is off).
func (c *Config) listens() []flagcheck.Listen {
	l := []flagcheck.Listen{{Flag: "http", Addr: c.HTTP}, {Flag: "metrics", Addr: c.Metrics}, {Flag: "pprof", Addr: c.PProf}}
	if c.MQTTURL == "" { // --mqtt-listen is not used with --mqtt-url
		l = append(l, flagcheck.Listen{Flag: "mqtt-listen", Addr: c.MQTTListen})
	}
	return l
}

// fromFlags turns the flags' "0 means no limit" into api.Limits' negative.
func (c *Config) fromFlags() {
	if c.Limits.RequestsPerSecond == 0 {
		c.Limits.RequestsPerSecond = -1
	}
	if c.Limits.RegisterPerMinute == 0 {
		c.Limits.RegisterPerMinute = -1
	}
	if c.Limits.UnauthPerMinute == 0 {
		c.Limits.UnauthPerMinute = -1
	}
	if c.Limits.MaxStreamsPerUser == 0 {
		c.Limits.MaxStreamsPerUser = -1
	}
	if c.Limits.MaxWaitsPerUser == 0 {
		c.Limits.MaxWaitsPerUser = -1
	}
	if c.Limits.MaxBridgesPerUser == 0 {
		c.Limits.MaxBridgesPerUser = -1
	}
	if c.Limits.MaxBodyBytesPerUser == 0 {
		c.Limits.MaxBodyBytesPerUser = -1
	}
	if c.MQTTSessionsPerAccount == 0 {
		c.MQTTSessionsPerAccount = -1
	}
	if c.ReportRate == 0 {
		c.ReportRate = -1
	}
}

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var cfg Config
	fs := newServeFlags(&cfg)
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		return flagError(err)
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("serve takes no arguments, got %q", fs.Args())}
	}
	onCommandLine := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { onCommandLine[f.Name] = true })
	if err := applyEnv(fs); err != nil {
		return err
	}
	if err := cfg.checkFlags(onCommandLine); err != nil {
		return err
	}
	cfg.fromFlags()
	logger, err := newLogger(cfg.LogLevel, stderr)
	if err != nil {
		return err
	}
	cfg.demoMetrics(fs, logger)
	m := NewMain(cfg, logger)
	if err := m.Run(ctx); err != nil {
		m.Close()
		return err
	}
	fmt.Fprintln(stdout, m.startupLine())
	if m.Demo != nil {
		m.Demo.PrintQuickStart(stdout)
	}
	<-ctx.Done()
	logger.Info("shutting down")
	return m.shutdown()
}

// shutdownWithin bounds the shutdown on a signal (bug 343); tests shorten
// it.
var shutdownWithin = time.Minute

// shutdown closes m, and gives up once that has taken shutdownWithin: a
// disk that does not answer holds the store's commit under way, and so
// its Close, for as long as it does not (a network volume gone), and a
// server that waited for it could be stopped only by SIGKILL, without a
// word. It then says so and what waits, and the server exits 1 without
// closing the rest: what was answered 201 or 202 is on disk (a commit is
// synced before its answer), and the writes waiting were not answered.
func (m *Main) shutdown() error {
	done := make(chan error, 1)
	go func() { done <- m.Close() }()
	t := time.NewTimer(shutdownWithin)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
	}
	waits := "a part of the server that does not stop (see the goroutines with --pprof)"
	if m.bolt != nil {
		if d := m.bolt.WriteWaiting(); d > 0 {
			waits = fmt.Sprintf("a write of the data directory, for %v (its disk not answering: see the system's log for the "+
				"disk's errors); what was answered 201 or 202 is on disk, the writes waiting were not answered", d.Round(time.Second))
		}
	}
	m.Logger.Error("shutdown has not finished; exiting without it", "after", shutdownWithin, "waiting", waits)
	return exitError{1, fmt.Errorf("shutdown has not finished in %v: waiting for %s", shutdownWithin, waits)}
}

// startupLine is what `companion serve` prints once it is listening,
// with the build's version: after an upgrade the binary on disk
// (--version) is not always the build that runs (bug 407).
func (m *Main) startupLine() string {
	return fmt.Sprintf("companion: HTTP API on %s, MQTT on %s, data in %s, version %s",
		m.APIURL(), m.MQTTURL(), m.Config.Data, buildinfo.Version(version))
}

func newLogger(level string, w io.Writer) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, usageError{fmt.Sprintf("--log-level %q: give debug, info, warn or error", level)}
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

// Main is the whole server: store, MQTT broker (embedded or not), command
// broker, HTTP API and, with --demo, a bridge of simulated devices. Tests run
// the same Main on port 0 and a temp dir.
type Main struct {
	Config Config
	Logger *slog.Logger

	DB     companion.Store
	MQTT   *embedded.Server // nil with --mqtt-url
	Broker *broker.Broker
	Dynsec *dynsec.Driver // with --mqtt-url and --mqtt-dynsec
	Demo   *Demo
	PProf  *pprofserver.Server // with --pprof
	// Metrics holds what GET /metrics serves, with --metrics.
	Metrics   *metrics.Server
	metricsLn *metrics.Listener

	// NATSAuth answers the NATS cluster's authorization, with --nats-callout.
	NATSAuth *natsauth.Responder

	pg         *postgres.Store // the store, when it is PostgreSQL
	bolt       *store.DB       // the store, when it is the bbolt file
	stopListen context.CancelFunc
	stopOIDC   func() // ends the retries of the issuer's discovery, and waits for them
	// oidc is the access tokens' verifier once serveHTTP made it, for the
	// metrics (bug 481).
	oidc       atomic.Pointer[api.OIDCVerifier]
	listenDone chan struct{}

	// Events is the hub of GET /api/v1/events (events.go).
	Events     *api.Events
	stopEvents func()

	adminToken string
	mqttURL    string
	mqttTLS    *tls.Config // how this server's clients verify an mqtts:// broker
	ln         net.Listener
	api        *api.Server
	srv        *http.Server
	serveDone  chan struct{}
	// handlers is read-locked by each HTTP handler for as long as it
	// runs; Close takes it, so that it closes the brokers and the store
	// only once the last handler has returned (bug 356).
	handlers sync.RWMutex
	// shutdownGrace is how long Close lets the requests in flight
	// finish (httpShutdownGrace when 0; tests shorten it).
	shutdownGrace time.Duration
	closeOnce     sync.Once
	closeErr      error
}

// NewMain returns a Main for cfg; nothing starts until Run.
func NewMain(cfg Config, logger *slog.Logger) *Main {
	if logger == nil {
		logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Main{Config: cfg, Logger: logger}
}

// HTTPAddr is the address the API listens on (useful with port 0).
func (m *Main) HTTPAddr() string { return m.ln.Addr().String() }

// APIURL is the base URL of the HTTP API (https with --tls-cert), on the
// loopback address when it listens on every address (dialAddr).
func (m *Main) APIURL() string {
	if m.Config.TLSCert != "" {
		return "https://" + dialAddr(m.HTTPAddr())
	}
	return "http://" + dialAddr(m.HTTPAddr())
}

// dialAddr is addr, a listener's address, with the loopback address
// 127.0.0.1 for a host that is every address (--http 0.0.0.0:PORT, which
// Go reports as [::]:PORT): the address this server's own clients dial,
// and one a user can paste, as the quick start's mosquitto_sub line has
// it. http://[::]:PORT, printed in the start-up line, demo.json and the
// quick start's curl lines, is no address to send a request to
// (docs/reliability.md, bug 306). A listener on "tcp" for every address
// takes both families, so 127.0.0.1 reaches it.
func dialAddr(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if ip := net.ParseIP(host); err == nil && ip != nil && ip.IsUnspecified() {
		return net.JoinHostPort("127.0.0.1", port)
	}
	return addr
}

// MQTTURL is the broker URL the server (and a bridge) connects to.
func (m *Main) MQTTURL() string { return m.mqttURL }

// AdminToken is the admin API token in force.
func (m *Main) AdminToken() string { return m.adminToken }

// Run opens the store, starts the MQTT side and the HTTP API, and returns
// once all of them are listening. Close stops them.
func (m *Main) Run(ctx context.Context) error {
	cfg := m.Config
	tree, err := topics.New(cfg.TopicPrefix)
	if err != nil {
		return usageError{fmt.Sprintf("bad --topic-prefix: %v", err)}
	}
	httpCert, mqttServerTLS, err := serverTLS(cfg)
	if err != nil {
		return err
	}
	// A --data the unit's sandbox leaves read-only (ProtectSystem=strict)
	// fails at every start: a usage error, not restarted (bug 435).
	if err := flagcheck.WritableDir("data", cfg.Data, "companion.service", "/var/lib/companion"); err != nil {
		return usageError{err.Error()}
	}
	if err := os.MkdirAll(cfg.Data, 0o700); err != nil {
		return err
	}
	if cfg.PProf != "" {
		if m.PProf, err = pprofserver.Start(cfg.PProf, m.Logger); err != nil {
			if flagcheck.CannotListen(err) {
				return flagcheck.ListenFailed("pprof", cfg.PProf, err)
			}
			return fmt.Errorf("--pprof: %w", err)
		}
	}
	if err := m.openStore(ctx); err != nil {
		return err
	}
	if err := m.startEvents(); err != nil {
		return err
	}
	if err := m.startMetrics(ctx); err != nil {
		return err
	}
	if m.adminToken, err = loadAdminToken(cfg); err != nil {
		return err
	}
	if n := len(cfg.AdminToken); n > 0 && n < minAdminToken {
		m.Logger.Warn(fmt.Sprintf("--admin-token has %d characters: whoever guesses it administers every user and device; "+
			"give at least %d random ones (openssl rand -hex 32), or none to have one generated into DATA/admin.token", n, minAdminToken))
	}
	if path, stale := staleAdminTokenFile(cfg); stale {
		m.Logger.Warn("the admin token in "+path+" is not in force: --admin-token is; the admin CLI reads that file when "+
			"it is given no --admin-token, and is refused with 401: give it --admin-token (or COMPANION_ADMIN_TOKEN), or delete the file",
			"file", path)
	}
	if err := m.startNATSAuth(tree); err != nil {
		return err
	}
	if err := m.startMQTT(tree, mqttServerTLS); err != nil {
		return err
	}
	if err := m.newBroker(tree, mqttServerTLS != nil); err != nil {
		return err
	}
	accounts, err := m.brokerAccounts(tree)
	if err != nil {
		return err
	}
	if err := m.Broker.Start(); err != nil {
		return err
	}
	m.joinReplicas()
	if m.Dynsec != nil {
		m.Dynsec.Start()
	}
	if err := m.serveHTTP(ctx, accounts, httpCert); err != nil {
		return err
	}
	if cfg.Demo {
		m.Demo, err = startDemo(ctx, m, tree)
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
	}
	return nil
}

// serverTLS checks the TLS flags and loads what they name: the API's
// certificate (nil without --tls-cert) and the embedded broker's TLS
// settings (nil without --mqtt-tls-cert).
func serverTLS(cfg Config) (httpCert *tls.Certificate, mqttTLS *tls.Config, err error) {
	if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
		return nil, nil, usageError{"--tls-cert and --tls-key go together"}
	}
	if cfg.TLSCert != "" {
		c, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			// A usage error (exit status 2), which systemd does not
			// restart: a key the unit's dynamic user cannot read fails
			// at every start (bug 404).
			return nil, nil, usageError{fmt.Sprintf("--tls-cert %s, --tls-key %s: %v", cfg.TLSCert, cfg.TLSKey, err)}
		}
		httpCert = &c
	}
	if (cfg.MQTTTLSCert == "") != (cfg.MQTTTLSKey == "") {
		return nil, nil, usageError{"--mqtt-tls-cert and --mqtt-tls-key go together"}
	}
	if cfg.MQTTTLSCert != "" {
		if cfg.MQTTURL != "" {
			return nil, nil, usageError{"--mqtt-tls-cert is for the embedded broker; it has no use with --mqtt-url"}
		}
		c, err := tls.LoadX509KeyPair(cfg.MQTTTLSCert, cfg.MQTTTLSKey)
		if err != nil {
			return nil, nil, usageError{fmt.Sprintf("--mqtt-tls-cert %s, --mqtt-tls-key %s: %v", cfg.MQTTTLSCert, cfg.MQTTTLSKey, err)}
		}
		mqttTLS = &tls.Config{Certificates: []tls.Certificate{c}, MinVersion: tls.VersionTLS12}
	}
	return httpCert, mqttTLS, nil
}

// startMQTT starts the embedded broker, serving TLS with mqttServerTLS
// when set, unless --mqtt-url names another; either way it sets the URL
// the server and the demo bridge connect to.
func (m *Main) startMQTT(tree topics.Tree, mqttServerTLS *tls.Config) error {
	cfg := m.Config
	if cfg.MQTTURL != "" {
		m.mqttURL = cfg.MQTTURL
		return nil
	}
	// No server account: the server's own connection to its embedded
	// broker is in-process (see newBroker), and nobody connects as the
	// server over the network.
	var err error
	m.MQTT, err = embedded.New(embedded.Options{
		Listen:    cfg.MQTTListen,
		TLSConfig: mqttServerTLS,
		Topics:    tree,
		Accounts:  broker.Accounts{Store: m.DB},
		KickGrace: cfg.KickGrace,
		// 0 (a Config made in code) is the default; the flag's 0, no
		// limit, is -1 by then (fromFlags).
		MaxSessions: cfg.MQTTSessionsPerAccount,
		Logger:      m.Logger,
	})
	if err != nil {
		return err
	}
	if err := m.MQTT.Start(); err != nil {
		if flagcheck.CannotListen(err) {
			return flagcheck.ListenFailed("mqtt-listen", cfg.MQTTListen, err)
		}
		return fmt.Errorf("embedded MQTT broker: %w", err)
	}
	if m.PProf != nil {
		mq := m.MQTT
		pprofserver.Publish("mqtt", func() any { return mq.Stats() })
	}
	m.mqttURL = "tcp://" + dialAddr(m.MQTT.Addr())
	if mqttServerTLS != nil {
		m.mqttURL = "mqtts://" + dialAddr(m.MQTT.Addr())
	}
	return nil
}

// newBroker makes the command broker on the MQTT broker that startMQTT
// chose; ownTLS says the embedded broker serves TLS, whose certificate the
// server then trusts.
func (m *Main) newBroker(tree topics.Tree, ownTLS bool) error {
	cfg := m.Config
	ca := cfg.MQTTCA
	if ca == "" && ownTLS {
		ca = cfg.MQTTTLSCert // our own broker: trust its certificate's chain
	}
	mqttTLS, err := clientTLS(m.mqttURL, ca)
	if err != nil {
		return err
	}
	m.mqttTLS = mqttTLS
	clientID, err := replicaClientID(cfg)
	if err != nil {
		return err
	}
	var newClient func(*mqtt.ClientOptions) mqtt.Client
	if m.MQTT != nil {
		// In-process: no socket, no MQTT encoding and no PUBACK round trip
		// between the server and its own broker (docs/performance.md).
		newClient = m.MQTT.NewClient
	}
	m.Broker, err = broker.New(broker.Options{
		ClientID:        clientID,
		Dispatcher:      m.dispatcher(),
		TLSConfig:       mqttTLS,
		Store:           m.DB,
		MQTTURL:         m.mqttURL,
		Username:        cfg.MQTTUsername,
		Password:        cfg.MQTTPassword,
		Topics:          tree,
		SweepInterval:   cfg.SweepInterval,
		KickGrace:       cfg.KickGrace,
		MaxOpenCommands: cfg.Limits.MaxOpenCommands,
		Retention:       cfg.Retention,
		ExpiryGrace:     cfg.ExpiryGrace,
		ReportRate:      cfg.ReportRate,
		ReportBurst:     cfg.ReportBurst,
		Observer:        m.brokerObserver(),
		Logger:          m.storeLogger(),
		Now:             cfg.Now,
		NewClient:       newClient,
	})
	return err
}

// The PostgreSQL store, shared by replicas, holds a bridge's creation
// while the Mosquitto driver writes its account (docs/reliability.md, bug
// 257).
var _ dynsec.AccountLocker = (*postgres.Store)(nil)

// brokerAccounts is what the API tells of changes to who may use the MQTT
// broker: the NATS callout, the embedded broker, or Mosquitto's
// dynamic-security plugin (whose driver it makes; Run starts it). Nil for
// an external broker that the server does not manage.
func (m *Main) brokerAccounts(tree topics.Tree) (api.BrokerAccounts, error) {
	cfg := m.Config
	switch {
	case m.NATSAuth != nil:
		return m.NATSAuth, nil
	case m.MQTT != nil:
		return embeddedAccounts{m.MQTT}, nil
	case cfg.MQTTDynsec:
		var err error
		m.Dynsec, err = dynsec.New(dynsec.Options{
			Conn:           m.Broker,
			Store:          m.DB,
			ServerUsername: cfg.MQTTUsername,
			PinClientIDs:   cfg.MQTTPinClientIDs,
			Topics:         tree,
			Logger:         m.Logger,
			// A bridge's retried account closes its connections without
			// their Will (bug 301).
			DisconnectedWithoutWill: m.Broker.BridgesDisconnectingWithoutWill,
		})
		if err != nil {
			return nil, err
		}
		return m.Dynsec, nil
	}
	return nil, nil
}

// serveHTTP makes the API's handler and serves it, with TLS when cert is
// set, until Close.
func (m *Main) serveHTTP(ctx context.Context, accounts api.BrokerAccounts, cert *tls.Certificate) error {
	cfg := m.Config
	var tokens api.TokenVerifier
	if cfg.OIDC.Issuer != "" {
		// An issuer not reachable yet (at boot) or down is tried again
		// until it answers, access tokens answered 503 meanwhile (bug
		// 463); the rest of the server works (bug 440).
		octx, stop := context.WithCancel(context.Background())
		v, done, err := api.RetryingOIDCVerifier(octx, cfg.OIDC, 15*time.Second, m.Logger)
		if err != nil {
			stop()
			return err
		}
		m.stopOIDC = func() {
			stop()
			<-done
		}
		tokens = v
		m.oidc.Store(v)
	}
	handler, err := api.New(api.Options{
		Store:          m.DB,
		Commands:       m.Broker,
		Tokens:         tokens,
		BrokerAccounts: accounts,
		// The embedded broker's server connects in-process, under no name.
		ServerMQTTUsername: cfg.MQTTUsername,
		AdminToken:         m.adminToken,
		Limits:             cfg.Limits,
		Ready:              m.ready,
		Unavailable:        m.storeUnavailable,
		Events:             m.Events,
		RateLimiter:        m.rateLimiter(),
		Requests:           m.requestObserver(),
		Logger:             m.storeLogger(),
		Now:                cfg.Now,
	})
	if err != nil {
		return err
	}
	m.api = handler
	m.ln, err = listenHTTP(cfg.HTTP)
	if err != nil {
		if flagcheck.CannotListen(err) {
			return flagcheck.ListenFailed("http", cfg.HTTP, err)
		}
		return fmt.Errorf("HTTP listen: %w", err)
	}
	m.srv = &http.Server{
		Handler: m.countHandlers(handler.Handler()),
		// No ReadTimeout: it would bound a whole upload, however steadily
		// it comes. The API cuts a request body that stalls instead
		// (api.Limits.BodyIdle).
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          serverErrorLog(m.Logger),
		// Over HTTP/2 an event stream's write timeout resets the stream
		// with a frame written on the connection: a client that stopped
		// reading its socket entirely takes no frame, so the stream
		// stayed, holding its place, until TCP_USER_TIMEOUT or longer.
		// The connection is closed once it takes nothing for as long
		// (bug 324).
		HTTP2: &http.HTTP2Config{WriteByteTimeout: m.Events.WriteTimeout()},
	}
	serve := m.srv.Serve
	if cert != nil {
		m.srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{*cert}, MinVersion: tls.VersionTLS12}
		serve = func(l net.Listener) error { return m.srv.ServeTLS(l, "", "") }
	}
	m.serveDone = make(chan struct{})
	go func() {
		defer close(m.serveDone)
		if err := serve(m.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			m.Logger.Error("HTTP server", "err", err)
		}
	}()
	return nil
}

// countHandlers runs h under a read lock of m.handlers, which Close takes
// once the HTTP server is shut down, to wait for the handlers still
// running (bug 356). A request that comes as Close waits is dropped: its
// connection is being closed.
func (m *Main) countHandlers(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !m.handlers.TryRLock() {
			panic(http.ErrAbortHandler)
		}
		defer m.handlers.RUnlock()
		h.ServeHTTP(w, r)
	})
}

// serverErrorLog is the HTTP server's ErrorLog: net/http's errors are
// warnings, but for those of a client (clientFaults), which are debug.
// Most failed TLS handshakes are a client that went away during one (a
// phone whose link dropped, a load balancer's TCP health check that
// connects and closes: "EOF"), or a scanner; none is the server's to fix,
// and as warnings they filled an operator's log (bug 323).
func serverErrorLog(logger *slog.Logger) *log.Logger {
	return log.New(errorLogWriter{logger}, "", 0)
}

type errorLogWriter struct{ log *slog.Logger }

// clientFaults are the beginnings of net/http's lines of what a client
// did, not the server: a TLS handshake given up (bug 323), and HTTP/2
// spoken wrong (a bad preface, a frame the protocol forbids, a GOAWAY with
// an error, SETTINGS or a PING answer that never came). Anyone who reaches
// the port can make them once a connection: as warnings they were a flood
// any client could force (bug 383).
var clientFaults = []string{
	"http: TLS handshake error from ",
	"http2: server: error reading preface from client ",
	"http2: server connection error from ",
	"http2: server closing client connection",
	"http2: received GOAWAY ",
	"timeout waiting for SETTINGS frames from ",
	"timeout waiting for PING response",
}

func (w errorLogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSuffix(string(p), "\n")
	level := slog.LevelWarn
	for _, prefix := range clientFaults {
		if strings.HasPrefix(msg, prefix) {
			level = slog.LevelDebug
			break
		}
	}
	w.log.Log(context.Background(), level, msg)
	return len(p), nil
}

// httpShutdownGrace is how long Close lets the HTTP requests in flight
// finish before it closes their connections.
const httpShutdownGrace = 15 * time.Second

// Close shuts down in reverse order: HTTP (letting requests in flight
// finish, those held by Prefer: wait answered at once, those whose body
// is still coming answered 503, the connections of those still running
// after httpShutdownGrace closed, and every handler returned), the demo
// bridge,
// the dynamic-security driver, the command broker, the MQTT broker, the
// store, the pprof listener.
func (m *Main) Close() error {
	m.closeOnce.Do(func() {
		var errs []error
		// The event streams never idle: end them, or Shutdown waits.
		if m.stopEvents != nil {
			m.stopEvents()
		}
		if m.srv != nil {
			// Requests held by Prefer: wait are answered now (202, as when
			// their time runs out), or Shutdown waits for them.
			if m.Broker != nil {
				m.Broker.Release()
			}
			// A body still coming holds nothing durable: its request is
			// answered 503 now, or Shutdown waits for a stalled upload
			// (bug 325).
			m.api.EndBodyReads()
			grace := m.shutdownGrace
			if grace == 0 {
				grace = httpShutdownGrace
			}
			ctx, cancel := context.WithTimeout(context.Background(), grace)
			err := m.srv.Shutdown(ctx)
			cancel()
			if errors.Is(err, context.DeadlineExceeded) {
				// A request still answering (a download its client does
				// not read) has its connection closed: its handler's
				// next write fails, and it returns. The brokers and the
				// store are closed under no handler (bug 356).
				m.Logger.Warn("requests still running after the shutdown's grace; closing their connections", "grace", grace)
				err = m.srv.Close()
			}
			errs = append(errs, err)
			if m.serveDone != nil {
				<-m.serveDone
			}
			m.handlers.Lock()
		}
		if m.Demo != nil {
			errs = append(errs, m.Demo.Close())
		}
		if m.Dynsec != nil {
			errs = append(errs, m.Dynsec.Close())
		}
		if m.stopListen != nil {
			m.stopListen()
			<-m.listenDone
		}
		if m.stopOIDC != nil {
			m.stopOIDC()
		}
		if m.Broker != nil {
			errs = append(errs, m.Broker.Close())
		}
		if m.NATSAuth != nil {
			errs = append(errs, m.NATSAuth.Close())
		}
		if m.MQTT != nil {
			errs = append(errs, m.MQTT.Close())
		}
		// The metrics are served until the store closes, not after: a
		// scrape then would count the open commands in a closed store
		// (bug 415).
		errs = append(errs, m.closeMetrics())
		if m.DB != nil {
			errs = append(errs, m.DB.Close())
		}
		if m.PProf != nil {
			errs = append(errs, m.PProf.Close())
		}
		m.closeErr = errors.Join(errs...)
	})
	return m.closeErr
}

// embeddedAccounts is what the API tells the embedded broker of changes
// to who may do what. The broker reads accounts, bindings and assignments
// from the store on every check, so it has only one thing to do: when the
// devices a bridge serves change, its connections are closed, as
// Mosquitto's plugin does (see embedded.Server.DisconnectBridge); when the
// bridge is deleted, its persistent sessions go too, so that a bridge
// created later under the same id inherits nothing (DeleteBridge).
type embeddedAccounts struct{ mqtt *embedded.Server }

func (embeddedAccounts) UserCreated(context.Context, string, string) error   { return nil }
func (embeddedAccounts) BridgeCreated(context.Context, string, string) error { return nil }
func (embeddedAccounts) Bound(context.Context, string, string) error         { return nil }
func (embeddedAccounts) Unbound(context.Context, string, string) error       { return nil }

func (a embeddedAccounts) BridgeDeleted(_ context.Context, bridgeID string) error {
	a.mqtt.DeleteBridge(bridgeID)
	return nil
}

// UserTokenChanged closes the user's connections, made with the old
// token; the broker asks the store at the next login.
func (a embeddedAccounts) UserTokenChanged(_ context.Context, userID, _ string) error {
	a.mqtt.DisconnectUser(userID)
	return nil
}

// BridgeSecretChanged closes the bridge's connections, made with the old
// secret; the broker asks the store at the next login. Its sessions stay:
// it is the same bridge.
func (a embeddedAccounts) BridgeSecretChanged(_ context.Context, bridgeID, _ string) error {
	a.mqtt.DisconnectBridge(bridgeID)
	return nil
}

func (a embeddedAccounts) Assigned(_ context.Context, _, from, to string) error {
	for _, b := range []string{from, to} {
		if b != "" {
			a.mqtt.DisconnectBridge(b)
		}
	}
	return nil
}

// clientTLS returns the TLS settings for a broker URL: nil for plain
// tcp:// or mqtt://, and for ssl://, tls://, mqtts:// a config that verifies
// the broker with the CA bundle in caFile (the system roots when empty).
func clientTLS(url, caFile string) (*tls.Config, error) {
	if !tlsclient.IsTLSURL(url) {
		if caFile != "" {
			return nil, usageError{"--mqtt-ca needs an mqtts:// broker URL"}
		}
		return nil, nil
	}
	c, err := tlsclient.Config(caFile)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--mqtt-ca: %v", err)} // bug 404
	}
	return c, nil
}

// minAdminToken is the length under which serve warns of a guessable
// --admin-token: 16 characters of hex are 64 bits. It only warns, so that a
// test's or a demo's short token still starts.
const minAdminToken = 16

// loadAdminToken returns --admin-token, or the token in DATA/admin.token,
// creating it (mode 0600) on first start.
func loadAdminToken(cfg Config) (string, error) {
	if cfg.AdminToken != "" {
		return cfg.AdminToken, nil
	}
	path := filepath.Join(cfg.Data, "admin.token")
	b, err := os.ReadFile(path)
	if err == nil {
		if tok := strings.TrimSpace(string(b)); tok != "" {
			return tok, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	tok := randomToken("cat_")
	if err := writeFileAtomic(path, []byte(tok+"\n"), 0o600); err != nil {
		return "", err
	}
	return tok, nil
}

// staleAdminTokenFile reports DATA/admin.token when --admin-token is given
// and the file holds another token: generated by an earlier start, it is
// no longer accepted, yet the admin CLI reads it when given no token.
func staleAdminTokenFile(cfg Config) (path string, stale bool) {
	if cfg.AdminToken == "" {
		return "", false
	}
	path = filepath.Join(cfg.Data, "admin.token")
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false
	}
	tok := strings.TrimSpace(string(b))
	return path, tok != "" && subtle.ConstantTimeCompare([]byte(tok), []byte(cfg.AdminToken)) != 1
}

// randomToken returns prefix and 256 random bits, base64url.
func randomToken(prefix string) string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return prefix + base64.RawURLEncoding.EncodeToString(b)
}

// writeFileAtomic writes data to path through a temp file and a rename, so
// a crash leaves either the old file or the new one.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
