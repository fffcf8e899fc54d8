// Command companion-bridge is the Device Companion bridge: it takes commands
// for its devices from MQTT, runs them, and publishes replies, status and
// settings back (see package agent).
//
//	companion-bridge --bridge-id ID --bridge-secret SECRET --sim-devices dev-1,dev-2 [flags]
//
// Every flag can also be set in the environment as COMPANION_<FLAG>, with
// dashes as underscores: --bridge-secret is COMPANION_BRIDGE_SECRET. Flags
// win over the environment.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	m := NewMain()
	if err := m.ParseFlags(os.Args[1:]); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "companion-bridge:", err)
		}
		os.Exit(2)
	}
	err := m.Run(ctx)
	if cerr := m.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "companion-bridge:", err)
		os.Exit(1)
	}
}

// Config is the bridge's configuration, from flags and the environment.
type Config struct {
	MQTTURL      string
	APIURL       string
	BridgeID     string
	BridgeSecret string
	Data         string
	SimDevices   []string
	SimModel     string
	SimFirmware  string
	GATT         string
	TopicPrefix  string
	LogLevel     slog.Level
}

// Main is the bridge program: Run builds and runs it, Close stops it.
type Main struct {
	Config Config
	Stderr io.Writer // logs; default os.Stderr

	mu    sync.Mutex
	agent *agent.Agent
	sims  []*sim.Device
}

// Sims returns the simulated devices once Run has built them.
func (m *Main) Sims() []*sim.Device {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sims
}

// NewMain returns a Main with the default configuration.
func NewMain() *Main {
	return &Main{
		Config: Config{
			MQTTURL:     "tcp://127.0.0.1:1883",
			APIURL:      "http://127.0.0.1:8080",
			Data:        "./bridge-data",
			SimModel:    sim.DefaultModel,
			SimFirmware: sim.DefaultFirmware,
			TopicPrefix: topics.DefaultPrefix,
		},
		Stderr: os.Stderr,
	}
}

// ParseFlags reads the command line, then the environment for every flag
// not given, and checks the result. Every error it returns is a usage error.
func (m *Main) ParseFlags(args []string) error {
	c := &m.Config
	fs := flag.NewFlagSet("companion-bridge", flag.ContinueOnError)
	fs.SetOutput(m.Stderr)
	var simDevices string
	fs.StringVar(&c.MQTTURL, "mqtt-url", c.MQTTURL, "MQTT broker `URL` (tcp://, ssl://, ws://)")
	fs.StringVar(&c.APIURL, "api-url", c.APIURL, "server base `URL` for blob downloads")
	fs.StringVar(&c.BridgeID, "bridge-id", c.BridgeID, "this bridge's `id` (companion bridge create ID)")
	fs.StringVar(&c.BridgeSecret, "bridge-secret", c.BridgeSecret, "this bridge's `secret`")
	fs.StringVar(&c.Data, "data", c.Data, "`directory` of the spool and the blob cache")
	fs.StringVar(&simDevices, "sim-devices", "", "comma-separated `ids` of simulated devices to run")
	fs.StringVar(&c.SimModel, "sim-model", c.SimModel, "`model` of the simulated devices")
	fs.StringVar(&c.SimFirmware, "sim-firmware", c.SimFirmware, "initial firmware `version` of the simulated devices")
	fs.StringVar(&c.GATT, "gatt", c.GATT, "Bluetooth `backend` for real devices (bluez)")
	fs.StringVar(&c.TopicPrefix, "topic-prefix", c.TopicPrefix, "MQTT topic `prefix`")
	fs.TextVar(&c.LogLevel, "log-level", c.LogLevel, "log `level`: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := applyEnv(fs); err != nil {
		return err
	}
	for _, id := range strings.Split(simDevices, ",") {
		if id = strings.TrimSpace(id); id != "" {
			c.SimDevices = append(c.SimDevices, id)
		}
	}
	return m.validate()
}

// applyEnv fills every flag not given on the command line from
// COMPANION_<FLAG> in the environment.
func applyEnv(fs *flag.FlagSet) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		name := "COMPANION_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(name); ok {
			if e := f.Value.Set(v); e != nil {
				err = fmt.Errorf("%s: %v", name, e)
			}
		}
	})
	return err
}

func (m *Main) validate() error {
	c := m.Config
	switch {
	case c.BridgeID == "":
		return errors.New("--bridge-id is required (create one with: companion bridge create ID)")
	case !topics.ValidBridgeID(c.BridgeID):
		return fmt.Errorf("--bridge-id %q: use 1–64 of A–Z a–z 0–9 . _ : -", c.BridgeID)
	case c.BridgeSecret == "":
		return errors.New("--bridge-secret (or COMPANION_BRIDGE_SECRET) is required: the secret printed by companion bridge create")
	case c.GATT != "" && c.GATT != "bluez":
		return fmt.Errorf("--gatt %q: the only backend is bluez", c.GATT)
	case c.GATT == "bluez":
		return errors.New("--gatt bluez: real Bluetooth devices arrive in a later release; use --sim-devices for now")
	case len(c.SimDevices) == 0:
		return errors.New("no devices: give --sim-devices id1,id2,…")
	}
	seen := map[string]bool{}
	for _, id := range c.SimDevices {
		if !topics.ValidDeviceID(id) {
			return fmt.Errorf("--sim-devices: %q is not a device id (1–64 of A–Z a–z 0–9 . _ : -)", id)
		}
		if seen[id] {
			return fmt.Errorf("--sim-devices: %q given twice", id)
		}
		seen[id] = true
	}
	if !topics.ValidVersion(c.SimFirmware) {
		return fmt.Errorf("--sim-firmware %q is not a semantic version", c.SimFirmware)
	}
	if _, err := topics.New(c.TopicPrefix); err != nil {
		return fmt.Errorf("--topic-prefix: %v", err)
	}
	return nil
}

// Run builds the devices and the agent and runs them until ctx is done.
func (m *Main) Run(ctx context.Context) error {
	c := m.Config
	log := slog.New(slog.NewTextHandler(m.Stderr, &slog.HandlerOptions{Level: c.LogLevel}))
	tree, err := topics.New(c.TopicPrefix)
	if err != nil {
		return err
	}
	var (
		sims    []*sim.Device
		devices []agent.Device
	)
	for _, id := range c.SimDevices {
		d := sim.New(sim.Options{ID: id, Model: c.SimModel, Firmware: c.SimFirmware, Logger: log})
		sims = append(sims, d)
		devices = append(devices, d)
	}
	a, err := agent.New(agent.Options{
		MQTTURL:  c.MQTTURL,
		Username: c.BridgeID,
		Password: c.BridgeSecret,
		BridgeID: c.BridgeID,
		APIURL:   c.APIURL,
		DataDir:  c.Data,
		Devices:  devices,
		Topics:   tree,
		Logger:   log,
	})
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.agent, m.sims = a, sims
	m.mu.Unlock()
	log.Info("companion-bridge starting", "bridge", c.BridgeID, "mqtt", c.MQTTURL, "devices", c.SimDevices)
	return a.Run(ctx)
}

// Close stops the agent, if Run built one, waits for it and closes its spool.
func (m *Main) Close() error {
	m.mu.Lock()
	a := m.agent
	m.mu.Unlock()
	if a == nil {
		return nil
	}
	return a.Close()
}
