package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/devicecompanion/companion"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/metrics"
)

// demoMetricsAddr is where --demo serves its metrics unless --metrics says
// otherwise (CONTRACT §12).
const demoMetricsAddr = "127.0.0.1:9464"

// demoMetrics gives --demo its metrics address when neither --metrics nor
// COMPANION_METRICS was given (--metrics= turns them off). Another process
// may hold that port: the demo then runs without metrics rather than fail.
func (c *Config) demoMetrics(fs *flag.FlagSet) {
	if !c.Demo || c.Metrics != "" {
		return
	}
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "metrics" })
	if _, ok := os.LookupEnv("COMPANION_METRICS"); ok || given {
		return
	}
	c.Metrics, c.metricsOptional = demoMetricsAddr, true
}

// startMetrics, with --metrics, serves GET /metrics on its own listener and
// sets the open commands gauge from the store; the broker and the API are
// then given m.Metrics as their observer. It runs before the broker starts,
// so that no command changes state between the count and the first
// change it follows.
func (m *Main) startMetrics(ctx context.Context) error {
	addr := m.Config.Metrics
	if addr == "" {
		return nil
	}
	s := metrics.NewServer()
	open, err := m.DB.OpenCommands(ctx, companion.StateQueued, companion.StateSent, companion.StateDelivered, companion.StateInProgress)
	if err != nil {
		return fmt.Errorf("--metrics: counting the open commands: %w", err)
	}
	s.SetOpenCommands(len(open))
	ln, err := metrics.Listen(addr, s.Registry(), m.Logger)
	if err != nil {
		if m.Config.metricsOptional {
			m.Logger.Warn("the demo's metrics are off: their address is taken; give --metrics ADDR", "addr", addr, "err", err)
			return nil
		}
		return fmt.Errorf("--metrics: %w", err)
	}
	m.Metrics, m.metricsLn = s, ln
	return nil
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

// closeMetrics stops the metrics listener, last of all.
func (m *Main) closeMetrics() error {
	if m.metricsLn == nil {
		return nil
	}
	return m.metricsLn.Close()
}
