package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/flagcheck"
	"github.com/devicecompanion/companion/internal/metrics"
)

// demoMetricsAddr is where --demo serves its metrics unless --metrics says
// otherwise (CONTRACT §12).
const demoMetricsAddr = "127.0.0.1:9464"

// demoMetrics gives --demo its metrics address when neither --metrics nor
// COMPANION_METRICS was given (--metrics= turns them off). Another process
// may hold that port: the demo then runs without metrics rather than fail.
// So too when another of the server's own listeners is given that port
// (--http 127.0.0.1:9464): the metrics, listening first, made that one
// fail the start.
func (c *Config) demoMetrics(fs *flag.FlagSet, log *slog.Logger) {
	if !c.Demo || c.Metrics != "" {
		return
	}
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "metrics" })
	if _, ok := os.LookupEnv("COMPANION_METRICS"); ok || given {
		return
	}
	if err := flagcheck.Distinct(append(c.listens(), flagcheck.Listen{Flag: "metrics", Addr: demoMetricsAddr})...); err != nil {
		log.Warn("the demo's metrics are off: their address is the server's own; give --metrics ADDR", "addr", demoMetricsAddr, "err", err)
		return
	}
	c.Metrics, c.metricsOptional = demoMetricsAddr, true
}

// startMetrics, with --metrics, serves GET /metrics on its own listener;
// the broker and the API are then given m.Metrics as their observer. The
// open commands are counted in the store at each scrape (not followed from
// this replica's changes, which would miss what other replicas end).
func (m *Main) startMetrics(_ context.Context) error {
	addr := m.Config.Metrics
	if addr == "" {
		return nil
	}
	opts := metrics.ServerOptions{OpenCommands: m.countOpenCommands, Logger: m.Logger}
	if m.bolt != nil {
		opts.Undecodable = m.bolt.Undecodable
		opts.StoreFaults = m.bolt.Faults
	}
	if m.pg != nil {
		opts.StoreFaults = m.pg.Faults
	}
	if m.Config.OIDC.Issuer != "" {
		// Access tokens answered 503 while the provider is away (bug 476)
		// say why here too (docs/reliability.md, bug 481).
		opts.IdentityProviderUnavailable = func() bool {
			v := m.oidc.Load()
			return v != nil && v.KeysUnavailable()
		}
		opts.IdentityProviderMisconfigured = func() bool {
			v := m.oidc.Load()
			return v != nil && v.Misconfigured()
		}
	}
	s := metrics.NewServer(opts)
	ln, err := metrics.Listen(addr, s.Registry(), m.Logger)
	if err != nil {
		if m.Config.metricsOptional {
			m.Logger.Warn("the demo's metrics are off: their address is taken; give --metrics ADDR", "addr", addr, "err", err)
			return nil
		}
		if flagcheck.CannotListen(err) {
			return flagcheck.ListenFailed("metrics", addr, err)
		}
		return fmt.Errorf("--metrics: %w", err)
	}
	m.Metrics, m.metricsLn = s, ln
	return nil
}

// countOpenCommands counts the commands of every device that are not
// final, in the store (CountAllOpen reads no command). The metrics server
// holds a count for ten times as long as it took.
func (m *Main) countOpenCommands(ctx context.Context) (int, error) {
	return m.DB.CountAllOpen(ctx)
}

// MetricsAddr is the address GET /metrics is served on (useful with port
// 0); "" without --metrics.
func (m *Main) MetricsAddr() string {
	if m.metricsLn == nil {
		return ""
	}
	return m.metricsLn.Addr()
}

// brokerObserver is what the broker tells of its work: nil without
// --metrics (not a nil *metrics.Server, which is not a nil interface).
func (m *Main) brokerObserver() broker.Observer {
	if m.Metrics == nil {
		return nil
	}
	return m.Metrics
}

// requestObserver is what the API tells of its requests: nil without
// --metrics.
func (m *Main) requestObserver() api.RequestObserver {
	if m.Metrics == nil {
		return nil
	}
	return m.Metrics
}

// closeMetrics stops the metrics listener, just before the store closes.
func (m *Main) closeMetrics() error {
	if m.metricsLn == nil {
		return nil
	}
	return m.metricsLn.Close()
}
