// Command companion-bridge is the Device Companion bridge: it takes commands
// for its devices from MQTT, runs them, and publishes replies, status and
// settings back (see package agent).
//
//	companion-bridge --bridge-id ID --bridge-secret SECRET --sim-devices dev-1,dev-2 [flags]
//	companion-bridge --version
//
// Every flag can also be set in the environment as COMPANION_<FLAG>, with
// dashes as underscores: --bridge-secret is COMPANION_BRIDGE_SECRET. Flags
// win over the environment.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	// The IANA time zone database, for a host without one: the
	// container images are scratch, and a timezone setting other than
	// UTC failed invalid_payload there (docs/reliability.md, bug 577).
	_ "time/tzdata"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/gatt/bluez"
	"github.com/devicecompanion/companion/internal/buildinfo"
	"github.com/devicecompanion/companion/internal/envflag"
	"github.com/devicecompanion/companion/internal/flagcheck"
	"github.com/devicecompanion/companion/internal/gctune"
	"github.com/devicecompanion/companion/internal/metrics"
	"github.com/devicecompanion/companion/internal/pprofserver"
	"github.com/devicecompanion/companion/internal/signals"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// version is stamped at build time (make dist: -ldflags
// "-X main.version=$(git describe --always --dirty)"); when empty,
// --version prints the VCS revision Go recorded, or "devel".
var version string

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-version") {
		fmt.Println("companion-bridge", buildinfo.Version(version))
		return
	}
	// The collector's target, and its memory limit in a container or a
	// unit with one (docs/reliability.md, bug 474).
	if _, err := gctune.Set(); err != nil {
		fmt.Fprintln(os.Stderr, "companion-bridge: the cgroup's memory limit, left unset:", err)
	}
	// The first signal starts a graceful shutdown; a second one, during a
	// slow shutdown, kills the process.
	ctx, stop := signals.Context()
	defer stop()
	m := NewMain()
	if err := m.ParseFlags(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0) // -h: the flags are printed; as flag.ExitOnError does
		}
		fmt.Fprintln(os.Stderr, "companion-bridge:", err)
		os.Exit(2)
	}
	err := m.Run(ctx)
	if cerr := m.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "companion-bridge:", err)
		if errors.Is(err, flagcheck.ErrCannotListen) || errors.Is(err, bluez.ErrAccessDenied) {
			// Again at every start (an address another process holds,
			// a port the process may not bind, a bus policy refusing
			// the user): as a usage error, not restarted by the unit
			// (bugs 436, 438, 475).
			os.Exit(2)
		}
		if errors.Is(err, agent.ErrSpoolUnreadable) || errors.Is(err, agent.ErrSpoolNewer) {
			os.Exit(exitDamagedData)
		}
		os.Exit(1)
	}
}

// exitDamagedData is the exit status of a bridge that refuses its damaged
// spool (agent.ErrSpoolUnreadable), or a spool a newer bridge wrote
// (agent.ErrSpoolNewer, bug 433): 65, BSD's EX_DATAERR. Every start
// would refuse it again until a person restores or moves it, so the
// systemd unit does not restart on it (RestartPreventExitStatus), as it
// does on status 1 (bug 402).
const exitDamagedData = 65

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
	SimMTU       int           // ATT MTU of the simulated link
	SimKBPS      int           // rate of the simulated link, kbit/s each way
	SimDropEvery time.Duration // the simulated link drops this often; 0 never
	SimState     string        // directory where simulated devices keep their state and the commands they ran; "" none
	// SimNoReassembly makes the simulated devices take each ATT write as a
	// whole SMP packet (Zephyr without CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY).
	SimNoReassembly bool
	GATT            string
	Devices         []string // ids of the real devices, with --gatt bluez
	TopicPrefix     string
	LogLevel        slog.Level
	CA              string // PEM CA bundle to verify an mqtts:// broker and an https:// API with
	PProf           string // listen address of net/http/pprof; "" off
	Metrics         string // listen address of GET /metrics (Prometheus); "" off
	// CommandTimeout bounds one command on its device, an OTA's upload
	// included: a 64 MiB image over a real BLE link at tens of KB/s
	// takes longer than the default.
	CommandTimeout time.Duration
	// BlobCacheMB bounds the blob cache in MiB; 0: no bound but its age.
	BlobCacheMB int
	// BluezAdapter is the adapter --gatt bluez uses: name (hci1), path or
	// address; "" the first BlueZ lists.
	BluezAdapter string
}

// Main is the bridge program: Run builds and runs it, Close stops it.
type Main struct {
	Config Config
	Stderr io.Writer // logs; default os.Stderr

	mu      sync.Mutex
	pprof   *pprofserver.Server
	agent   *agent.Agent
	sims    []*sim.Device
	network *sim.Network
	gatts   []*gatt.Device
	bluez   *bluez.Connector

	metrics   *metrics.Bridge // with --metrics
	metricsLn *metrics.Listener
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
			SimMTU:      sim.DefaultMTU,
			SimKBPS:     sim.DefaultKBPS,
			TopicPrefix: topics.DefaultPrefix,

			CommandTimeout: agent.DefaultCommandTimeout,
			BlobCacheMB:    agent.DefaultBlobCacheMax >> 20,
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
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "usage: companion-bridge --mqtt-url URL --bridge-id ID --bridge-secret SECRET [--data DIR]\n"+
			"         (--sim-devices ID,… | --gatt bluez --devices ID,…) ...\n\nflags:\n")
		fs.PrintDefaults()
	}
	var simDevices, devices string
	fs.StringVar(&c.MQTTURL, "mqtt-url", c.MQTTURL, "MQTT broker `URL` (tcp://, ssl://, ws://), or a comma-separated list of a cluster's nodes to fail over between")
	fs.StringVar(&c.APIURL, "api-url", c.APIURL, "server base `URL` for blob downloads; a comma-separated list of the replicas' fails over")
	fs.StringVar(&c.BridgeID, "bridge-id", c.BridgeID, "this bridge's `id` (companion bridge create ID)")
	fs.StringVar(&c.BridgeSecret, "bridge-secret", c.BridgeSecret, "this bridge's `secret`")
	fs.StringVar(&c.Data, "data", c.Data, "`directory` of the spool and the blob cache")
	fs.StringVar(&simDevices, "sim-devices", "", "comma-separated `ids` of simulated devices to run")
	fs.StringVar(&c.SimModel, "sim-model", c.SimModel, "`model` of the simulated devices")
	fs.StringVar(&c.SimFirmware, "sim-firmware", c.SimFirmware, "initial firmware `version` of the simulated devices")
	fs.IntVar(&c.SimMTU, "sim-mtu", c.SimMTU, "ATT `MTU` of the simulated Bluetooth link (23–517)")
	fs.IntVar(&c.SimKBPS, "sim-kbps", c.SimKBPS, "`rate` of the simulated Bluetooth link in kbit/s each way; 1400 models BLE 2M PHY with data length extension")
	fs.DurationVar(&c.SimDropEvery, "sim-drop-every", c.SimDropEvery, "drop the simulated Bluetooth link this `often` (0: never)")
	fs.BoolVar(&c.SimNoReassembly, "sim-no-reassembly", c.SimNoReassembly, "the simulated devices do not join SMP requests split across writes (Zephyr without CONFIG_MCUMGR_TRANSPORT_BT_REASSEMBLY)")
	fs.StringVar(&c.SimState, "sim-state", c.SimState, "`directory` where the simulated devices keep their state (firmware, apps, settings) and the command ids they ran, so that across bridge restarts they are as they were and drop repeats, as real devices do")
	fs.StringVar(&c.GATT, "gatt", c.GATT, "Bluetooth `backend` for real devices (bluez)")
	fs.StringVar(&devices, "devices", "", "comma-separated `ids` of the real devices to reach with --gatt (their DIS serial numbers)")
	fs.StringVar(&c.BluezAdapter, "bluez-adapter", c.BluezAdapter, "Bluetooth `adapter` for --gatt bluez: its name (hci1) or, to keep it when the kernel renumbers a USB adapter, its address (bluetoothctl list); default: the first BlueZ lists")
	fs.StringVar(&c.CA, "ca", c.CA, "PEM CA `file` to verify an mqtts:// broker and an https:// --api-url with (default: the system's)")
	fs.StringVar(&c.TopicPrefix, "topic-prefix", c.TopicPrefix, "MQTT topic `prefix`")
	// A string, not a TextVar, so that -h shows the default as serve does
	// ("info", not slog's "INFO").
	logLevel := strings.ToLower(c.LogLevel.String())
	fs.StringVar(&logLevel, "log-level", logLevel, "debug, info, warn or error")
	fs.StringVar(&c.PProf, "pprof", c.PProf, "serve net/http/pprof on this `address` (off when empty; keep it on loopback)")
	fs.StringVar(&c.Metrics, "metrics", c.Metrics, "serve GET /metrics (Prometheus) on this `address` (off when empty)")
	fs.IntVar(&c.BlobCacheMB, "blob-cache-mb", c.BlobCacheMB, "`MiB` of downloaded images, apps and firmware the blob cache keeps at most, the least recently used deleted first (0: no bound; each is deleted a day after its last use)")
	fs.DurationVar(&c.CommandTimeout, "command-timeout", c.CommandTimeout, "how `long` one command may take on its device, an OTA's upload included (a large image over a slow link needs more)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := envflag.Apply(fs, "COMPANION_"); err != nil {
		return err
	}
	if err := c.LogLevel.UnmarshalText([]byte(logLevel)); err != nil {
		return fmt.Errorf("--log-level %q: give debug, info, warn or error", logLevel)
	}
	if c.GATT == "bluez" {
		// The simulator's flags do nothing to real devices: say so
		// rather than take them (from the command line or the
		// environment, which envflag sets through fs.Set).
		var sim []string
		fs.Visit(func(f *flag.Flag) {
			if strings.HasPrefix(f.Name, "sim-") && f.Name != "sim-devices" {
				sim = append(sim, "--"+f.Name)
			}
		})
		if len(sim) > 0 {
			return fmt.Errorf("%s: for --sim-devices; real devices (--gatt bluez) have their own", strings.Join(sim, ", "))
		}
	}
	for _, id := range strings.Split(simDevices, ",") {
		if id = strings.TrimSpace(id); id != "" {
			c.SimDevices = append(c.SimDevices, id)
		}
	}
	for _, id := range strings.Split(devices, ",") {
		if id = strings.TrimSpace(id); id != "" {
			c.Devices = append(c.Devices, id)
		}
	}
	return m.validate()
}

func (m *Main) validate() error {
	c := m.Config
	_, urlErr := tlsclient.BrokerURLs(c.MQTTURL)
	switch {
	case c.BridgeID == "":
		return errors.New("--bridge-id is required (create one with: companion bridge create ID)")
	case !topics.ValidBridgeID(c.BridgeID):
		return fmt.Errorf("--bridge-id %q: use 1–64 of A–Z a–z 0–9 . _ : -", c.BridgeID)
	case c.BridgeSecret == "":
		return errors.New("--bridge-secret (or COMPANION_BRIDGE_SECRET) is required: the secret printed by companion bridge create")
	case c.Data == "":
		return errors.New("--data is empty: give the directory of the spool and the blob cache (default ./bridge-data)")
	case tlsclient.HasCredentials(c.MQTTURL):
		return errors.New("--mqtt-url: a broker URL holds credentials (user:password@), which would be logged and used in place of the bridge's: the bridge logs in with --bridge-id and --bridge-secret")
	case urlErr != nil: // one paho could never dial
		return fmt.Errorf("--mqtt-url: %w", urlErr)
	case c.GATT != "" && c.GATT != "bluez":
		return fmt.Errorf("--gatt %q: the only backend is bluez", c.GATT)
	case c.GATT == "bluez" && len(c.Devices) == 0:
		return errors.New("--gatt bluez needs --devices id1,id2,…: the ids (DIS serial numbers) of the devices to reach")
	case c.GATT == "bluez" && len(c.SimDevices) > 0:
		return errors.New("give either --sim-devices or --gatt bluez --devices, not both")
	case c.GATT == "" && len(c.Devices) > 0:
		return errors.New("--devices needs --gatt bluez")
	case c.GATT == "" && c.BluezAdapter != "":
		return errors.New("--bluez-adapter needs --gatt bluez")
	case c.GATT == "" && len(c.SimDevices) == 0:
		return errors.New("no devices: give --sim-devices id1,id2,… (or --gatt bluez --devices id1,id2,…)")
	}
	flagName, ids := "--sim-devices", c.SimDevices
	if c.GATT == "bluez" {
		flagName, ids = "--devices", c.Devices
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if !topics.ValidDeviceID(id) {
			return fmt.Errorf("%s: %q is not a device id (1–64 of A–Z a–z 0–9 . _ : -)", flagName, id)
		}
		if seen[id] {
			return fmt.Errorf("%s: %q given twice", flagName, id)
		}
		seen[id] = true
	}
	if c.SimMTU < gatt.DefaultMTU || c.SimMTU > 517 {
		return fmt.Errorf("--sim-mtu %d: use 23–517", c.SimMTU)
	}
	if c.SimKBPS <= 0 {
		return fmt.Errorf("--sim-kbps %d: must be positive", c.SimKBPS)
	}
	if c.CommandTimeout <= 0 {
		return fmt.Errorf("--command-timeout %s: must be positive", c.CommandTimeout)
	}
	if c.BlobCacheMB < 0 || c.BlobCacheMB > 1<<30 {
		return fmt.Errorf("--blob-cache-mb %d: give a size in MiB, 0 for no bound", c.BlobCacheMB)
	}
	if c.SimDropEvery < 0 {
		return fmt.Errorf("--sim-drop-every %s: must not be negative", c.SimDropEvery)
	}
	if _, err := mcuboot.ParseVersion(c.SimFirmware); err != nil || !topics.ValidVersion(c.SimFirmware) {
		return fmt.Errorf("--sim-firmware %q is not a version an MCUboot image holds (major.minor.revision, optional +build)", c.SimFirmware)
	}
	if _, err := topics.New(c.TopicPrefix); err != nil {
		return fmt.Errorf("--topic-prefix: %v", err)
	}
	// The blob downloads' base: agent.New refuses one without a scheme
	// only once the bridge runs (exit status 1, naming no flag), and one
	// of another scheme not at all, failing each download instead.
	// Its path is kept (a reverse proxy's prefix), so one ending in
	// /api/v1 (the README's $API) would double it in every blob's path.
	for s := range strings.SplitSeq(c.APIURL, ",") {
		u, err := url.Parse(strings.TrimSpace(s))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("--api-url %q: give the server's base URL, http://HOST:PORT or https://HOST:PORT, or a comma-separated list of the replicas'", s)
		}
		if strings.HasSuffix(strings.TrimRight(u.Path, "/"), "/api/v1") {
			return fmt.Errorf("--api-url %q: give the server's base URL, without /api/v1 (the bridge adds it)", s)
		}
	}
	// A CA file that cannot be read is a usage error (exit status 2),
	// which systemd does not restart, as a file the unit's dynamic user
	// cannot read fails at every start (bug 404); Run loads it again.
	if c.CA != "" {
		if _, err := tlsclient.Config(c.CA); err != nil {
			return fmt.Errorf("--ca: %w", err)
		}
	}
	// A directory the unit's sandbox leaves read-only (ProtectSystem=strict:
	// COMPANION_DATA or --sim-state outside the StateDirectory) fails at
	// every start: a usage error, exit status 2, not restarted (bug 435).
	dirs := []struct{ flag, dir string }{{"data", c.Data}, {"sim-state", c.SimState}}
	for _, d := range dirs {
		if d.dir == "" {
			continue
		}
		if err := flagcheck.WritableDir(d.flag, d.dir, "companion-bridge.service", "/var/lib/companion-bridge"); err != nil {
			return err
		}
	}
	listens := []flagcheck.Listen{{Flag: "metrics", Addr: c.Metrics}, {Flag: "pprof", Addr: c.PProf}}
	for _, l := range listens {
		if err := flagcheck.ListenAddr(l.Flag, l.Addr); err != nil {
			return err
		}
	}
	return flagcheck.Distinct(listens...)
}

// Run builds the devices and the agent and runs them until ctx is done.
func (m *Main) Run(ctx context.Context) error {
	c := m.Config
	log := slog.New(slog.NewTextHandler(m.Stderr, &slog.HandlerOptions{Level: c.LogLevel}))
	tree, err := topics.New(c.TopicPrefix)
	if err != nil {
		return err
	}
	if c.PProf != "" {
		ps, err := pprofserver.Start(c.PProf, log)
		if err != nil {
			if flagcheck.CannotListen(err) {
				return flagcheck.ListenFailed("pprof", c.PProf, err)
			}
			return fmt.Errorf("--pprof: %w", err)
		}
		m.mu.Lock()
		m.pprof = ps
		m.mu.Unlock()
	}
	if err := m.startMetrics(log); err != nil {
		if flagcheck.CannotListen(err) {
			return flagcheck.ListenFailed("metrics", c.Metrics, err)
		}
		return fmt.Errorf("--metrics: %w", err)
	}
	conn, ids, err := m.connector(log)
	if err != nil {
		return err
	}
	var devices []agent.Device
	for _, id := range ids {
		d, err := gatt.NewDevice(gatt.DeviceOptions{ID: id, Connector: conn, Logger: log, Observer: m.gattObserver()})
		if err != nil {
			return err
		}
		m.mu.Lock()
		m.gatts = append(m.gatts, d)
		m.mu.Unlock()
		devices = append(devices, d)
	}
	tlsConf, httpClient, err := tlsClients(c.MQTTURL, c.CA)
	if err != nil {
		return err
	}
	a, err := agent.New(agent.Options{
		TLSConfig:  tlsConf,
		HTTPClient: httpClient,
		MQTTURL:    c.MQTTURL,
		Username:   c.BridgeID,
		Password:   c.BridgeSecret,
		BridgeID:   c.BridgeID,
		APIURL:     c.APIURL,
		DataDir:    c.Data,
		Devices:    devices,
		Topics:     tree,
		Logger:     log,
		Observer:   m.agentObserver(),

		CommandTimeout: c.CommandTimeout,
		BlobCacheMax:   blobCacheMax(c.BlobCacheMB),
	})
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.agent = a
	m.mu.Unlock()
	if c.PProf != "" {
		pprofserver.Publish("spool", func() any { return a.SpoolStats() })
	}
	// The build's version: after an upgrade the binary on disk
	// (--version) is not always the build that runs (bug 407).
	log.Info("companion-bridge starting", "version", buildinfo.Version(version), "bridge_id", c.BridgeID, "mqtt", c.MQTTURL, "devices", ids)
	m.mu.Lock()
	bz := m.bluez
	m.mu.Unlock()
	if bz == nil {
		return a.Run(ctx)
	}
	// A system bus that restarted or died leaves the BlueZ connector
	// nothing to reach BlueZ with: the bridge exits with an error, and
	// systemd (Restart=on-failure) starts it on a new connection. Before,
	// it ran on with every device offline until someone restarted it
	// (docs/reliability.md, bug 391).
	rctx, cancel := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel(nil) // before the Wait
	wg.Go(func() {
		select {
		case <-bz.BusLost():
			cancel(bluez.ErrBusLost)
		case <-rctx.Done():
		}
	})
	err = a.Run(rctx)
	if cause := context.Cause(rctx); errors.Is(cause, bluez.ErrBusLost) && ctx.Err() == nil {
		return cause
	}
	return err
}

// connector builds the Bluetooth side from the configuration: the
// Connector the devices are reached through and their ids. With
// --sim-devices it is the simulated link to simulated devices; --gatt bluez
// is where the BlueZ connector plugs in.
func (m *Main) connector(log *slog.Logger) (gatt.Connector, []string, error) {
	c := m.Config
	if c.GATT == "bluez" {
		// Real devices through BlueZ: gatt.Device reconnects with backoff.
		// The devices' addresses outlive a restart: a device whose bond
		// was lost is then told apart at once (docs/reliability.md, bug 495).
		bz, err := bluez.New(bluez.Options{Adapter: c.BluezAdapter, Logger: log,
			StateFile: filepath.Join(c.Data, "bluez-addresses.json")})
		if err != nil {
			return nil, nil, err
		}
		m.mu.Lock()
		m.bluez = bz
		m.mu.Unlock()
		return bz, c.Devices, nil
	}
	network, sims, err := SimNetwork(c, log)
	if err != nil {
		return nil, nil, err
	}
	m.mu.Lock()
	m.network, m.sims = network, sims
	m.mu.Unlock()
	return network, c.SimDevices, nil
}

// SimNetwork builds the simulated devices of c and the simulated link that
// reaches them. With c.SimState the devices read back the command ids they
// ran in an earlier process.
func SimNetwork(c Config, log *slog.Logger) (*sim.Network, []*sim.Device, error) {
	var sims []*sim.Device
	for _, id := range c.SimDevices {
		d, err := sim.Open(sim.Options{ID: id, Model: c.SimModel, Firmware: c.SimFirmware, Logger: log, StateDir: c.SimState})
		if err != nil {
			for _, s := range sims {
				s.Close()
			}
			return nil, nil, err
		}
		sims = append(sims, d)
	}
	network := sim.NewNetwork(sim.LinkOptions{MTU: c.SimMTU, KBPS: c.SimKBPS, DropEvery: c.SimDropEvery})
	for _, d := range sims {
		network.Add(d.ID(), sim.NewPeripheral(d, sim.PeripheralOptions{NoReassembly: c.SimNoReassembly, Logger: log}))
	}
	return network, sims, nil
}

// Close stops the agent, if Run built one, waits for it and closes its
// spool, then disconnects the devices. The devices and the BlueZ connector
// close together: a bluetoothd that answers nothing costs its CallTimeout
// once, not once a device (docs/reliability.md, bug 194).
func (m *Main) Close() error {
	m.mu.Lock()
	a, gatts, network, bz, sims, ps := m.agent, m.gatts, m.network, m.bluez, m.sims, m.pprof
	ml := m.metricsLn
	m.mu.Unlock()
	var err error
	if a != nil {
		err = a.Close()
	}
	if ps != nil {
		ps.Close()
	}
	var wg sync.WaitGroup
	for _, d := range gatts {
		wg.Go(func() { d.Close() })
	}
	if bz != nil {
		wg.Go(func() { bz.Close() })
	}
	wg.Wait()
	if network != nil {
		network.Close()
	}
	for _, d := range sims {
		if cerr := d.Close(); err == nil {
			err = cerr
		}
	}
	if ml != nil {
		ml.Close()
	}
	return err
}

// tlsClients returns the TLS settings of the MQTT connection (nil for a
// plain tcp:// broker) and the HTTP client for blob downloads, both
// verifying servers with the CA bundle in caFile (system roots when "").
func tlsClients(mqttURL, caFile string) (*tls.Config, *http.Client, error) {
	conf, err := tlsclient.Config(caFile)
	if err != nil {
		return nil, nil, fmt.Errorf("--ca: %w", err)
	}
	if !tlsclient.IsTLSURL(mqttURL) {
		return nil, tlsclient.HTTPClient(conf), nil
	}
	return conf, tlsclient.HTTPClient(conf), nil
}

// blobCacheMax is --blob-cache-mb as agent.Options.BlobCacheMax: bytes,
// negative for no bound.
func blobCacheMax(mb int) int64 {
	if mb == 0 {
		return -1
	}
	return int64(mb) << 20
}
