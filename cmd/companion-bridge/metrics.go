package main

import (
	"log/slog"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/internal/metrics"
)

// startMetrics, with --metrics, serves GET /metrics on its own listener;
// the agent and the devices are then given the figures as their observer.
func (m *Main) startMetrics(log *slog.Logger) error {
	if m.Config.Metrics == "" {
		return nil
	}
	n := len(m.Config.SimDevices)
	if m.Config.GATT != "" {
		n = len(m.Config.Devices)
	}
	b := metrics.NewBridge(metrics.BridgeOptions{Devices: n, ConnectedDevices: m.connectedDevices})
	ln, err := metrics.Listen(m.Config.Metrics, b.Registry(), log)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.metrics, m.metricsLn = b, ln
	m.mu.Unlock()
	return nil
}

// connectedDevices counts the devices with a live Bluetooth link.
func (m *Main) connectedDevices() int {
	m.mu.Lock()
	devs := m.gatts
	m.mu.Unlock()
	n := 0
	for _, d := range devs {
		if d.Connected() {
			n++
		}
	}
	return n
}

// MetricsAddr is the address GET /metrics is served on (useful with port
// 0); "" without --metrics or before Run has started it.
func (m *Main) MetricsAddr() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.metricsLn == nil {
		return ""
	}
	return m.metricsLn.Addr()
}

// agentObserver is what the agent tells of its work: nil without --metrics
// (not a nil *metrics.Bridge, which is not a nil interface).
func (m *Main) agentObserver() agent.Observer {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.metrics == nil {
		return nil
	}
	return m.metrics
}

// gattObserver is what the devices tell of their links: nil without
// --metrics.
func (m *Main) gattObserver() gatt.Observer {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.metrics == nil {
		return nil
	}
	return m.metrics
}
