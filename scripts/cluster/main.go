// Command cluster runs the whole of CONTRACT §11 on one machine, for people
// to try it: three NATS Server nodes with MQTT and JetStream, PostgreSQL
// from an initdb directory of its own, `companion migrate`, three
// `companion serve` replicas on that store and those brokers, and a
// `companion-bridge` with simulated devices. Each runs as a detached process
// (a session of its own, output in DIR/NAME.log) on free ports of
// 127.0.0.1, so that they outlive this program.
//
//	cluster [-dir ./cluster] [-bin ./bin] up     # make cluster
//	cluster [-dir ./cluster] down                # make cluster-down
//	cluster [-dir ./cluster] start NAME…         # make cluster-start PIECE=NAME
//
// up writes DIR/cluster.json and prints how to use the cluster; when one is
// already up under DIR it says so and starts nothing. A directory left by a
// cluster that is no longer running is wiped and started afresh. down stops
// every process of the cluster (SIGTERM, then SIGKILL after a timeout) and
// keeps the logs and data to read until the next up. start starts again a
// piece of a cluster that is up (replica-2, nats-1, postgres, bridge: the
// names of cluster.json's pids) that was killed or stopped, as up started
// it, and waits until it serves: to try what the cluster does as a piece
// comes back.
//
// It is for trying the cluster out, not for running one in production: the
// three nodes, the database and the replicas share one machine. The
// replicas answer the nodes' authorization (auth callout: see door in
// nats.go).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const (
	// replicas is how many `companion serve` run, and nodes how many NATS
	// servers: the three of CONTRACT §11.
	replicas = 3
	nodes    = 3

	bridgeID = "bridge-1"

	// marker is written into a directory this program made, so that up
	// never wipes a directory of someone else's.
	marker = ".companion-cluster"
	// jsonName is the file up writes for people and tests to read.
	jsonName = "cluster.json"

	startTimeout = 60 * time.Second
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "cluster:", err)
		}
		os.Exit(1)
	}
}

// config is what the flags say.
type config struct {
	dir     string // absolute
	bin     string // absolute
	devices int
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cluster", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "./cluster", "`directory` of the cluster's data, logs, pids and cluster.json")
	bin := fs.String("bin", "./bin", "`directory` holding companion, companion-bridge and nats-server (make build, make deps)")
	devices := fs.Int("devices", 3, "how many simulated devices the bridge runs")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: cluster [flags] up|down|start NAME…")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() < 1 || (fs.Arg(0) != "start" && fs.NArg() != 1) || (fs.Arg(0) == "start" && fs.NArg() < 2) {
		fs.Usage()
		return errors.New("say up, down, or start and the pieces to start")
	}
	var c config
	var err error
	if c.dir, err = filepath.Abs(*dir); err != nil {
		return err
	}
	if c.bin, err = filepath.Abs(*bin); err != nil {
		return err
	}
	c.devices = *devices
	if c.devices < 1 || c.devices > 999 {
		return errors.New("-devices: 1 to 999")
	}

	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch fs.Arg(0) {
	case "up":
		return up(ctx, c, stdout)
	case "down":
		return down(c.dir, stdout)
	case "start":
		return start(ctx, c, fs.Args()[1:], stdout)
	default:
		fs.Usage()
		return fmt.Errorf("unknown command %q: say up, down or start", fs.Arg(0))
	}
}

// Info is cluster.json, CONTRACT §11's shape.
type Info struct {
	APIURLs         []string       `json:"api_urls"`
	AdminToken      string         `json:"admin_token"`
	MQTTURLs        []string       `json:"mqtt_urls"`
	NATSMonitorURLs []string       `json:"nats_monitor_urls"`
	Devices         []Device       `json:"devices"`
	PIDs            map[string]int `json:"pids"`
}

// Device is a simulated device of the bridge, provisioned but bound to no
// user: whoever has its claim code may register it.
type Device struct {
	DeviceID  string `json:"device_id"`
	ClaimCode string `json:"claim_code"`
}

// cluster is one up in progress.
type cluster struct {
	config
	procs []*proc // started, in order

	pg    pgServer
	nats  [nodes]natsNode
	door  *door
	apis  []string // the replicas' base URLs, http://127.0.0.1:PORT
	admin string   // the admin token, shared by the replicas
	info  Info
}

// up starts the cluster, or says that it is up already.
func up(ctx context.Context, cfg config, out io.Writer) error {
	if running := alive(cfg.dir); len(running) > 0 {
		info, err := readInfo(cfg.dir)
		if err != nil {
			return fmt.Errorf("a cluster is partly up under %s (%s) and has no %s: stop it with make cluster-down (cluster down)", cfg.dir, strings.Join(running, ", "), jsonName)
		}
		fmt.Fprintf(out, "The cluster under %s is already up (%d processes); make cluster-down stops it.\n\n", cfg.dir, len(running))
		fmt.Fprint(out, usage(cfg.dir, info))
		return nil
	}
	for _, b := range []string{"companion", "companion-bridge", "nats-server"} {
		if fi, err := os.Stat(filepath.Join(cfg.bin, b)); err != nil || fi.IsDir() {
			return fmt.Errorf("%s is missing: make build and make deps put it there", filepath.Join(cfg.bin, b))
		}
	}
	if err := freshDir(cfg.dir); err != nil {
		return err
	}
	c := &cluster{config: cfg, admin: randomString(24)}
	if err := c.start(ctx); err != nil {
		// Nothing of a failed start stays running.
		return errors.Join(err, stopAll(cfg.dir, io.Discard))
	}
	fmt.Fprint(out, usage(cfg.dir, c.info))
	return nil
}

// freshDir makes dir empty, marked as this program's: it refuses to wipe a
// directory without the marker.
func freshDir(dir string) error {
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return err
	case len(entries) > 0:
		if _, err := os.Stat(filepath.Join(dir, marker)); err != nil {
			return fmt.Errorf("%s exists and is not a cluster's directory (no %s): choose another -dir", dir, marker)
		}
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
	}
	// 0755: PostgreSQL runs as another user when this runs as root, and
	// must get through to its own directory inside.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, marker), []byte("made by scripts/cluster; cluster up wipes it\n"), 0o644)
}

func (c *cluster) start(ctx context.Context) error {
	ports, err := freePorts(1 + 4*nodes + replicas)
	if err != nil {
		return err
	}
	c.pg.port, ports = ports[0], ports[1:]
	for i := range c.nats {
		c.nats[i] = natsNode{name: fmt.Sprintf("nats-%d", i+1), client: ports[0], route: ports[1], mqtt: ports[2], monitor: ports[3]}
		ports = ports[4:]
	}
	for _, p := range ports {
		c.apis = append(c.apis, "http://127.0.0.1:"+strconv.Itoa(p))
	}

	if err := c.startPostgres(ctx); err != nil {
		return err
	}
	var clientURLs []string
	for _, n := range c.nats {
		clientURLs = append(clientURLs, "nats://127.0.0.1:"+strconv.Itoa(n.client))
	}
	if c.door, err = newDoor(c.dir, clientURLs); err != nil {
		return err
	}
	if err := c.startNATS(ctx); err != nil {
		return err
	}
	if err := c.migrate(ctx); err != nil {
		return err
	}
	if err := c.startReplicas(ctx); err != nil {
		return err
	}
	if err := c.startBridge(ctx); err != nil {
		return err
	}
	return c.writeInfo()
}

// migrate runs `companion migrate` once, before any replica starts.
func (c *cluster) migrate(ctx context.Context) error {
	p, err := c.spawn("migrate", nil, filepath.Join(c.bin, "companion"), "migrate", "--store", c.pg.dsn)
	if err != nil {
		return err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(startTimeout):
		return fmt.Errorf("companion migrate did not finish within %v:\n%s", startTimeout, c.logTail("migrate"))
	}
	if p.err != nil {
		return fmt.Errorf("companion migrate: %v:\n%s", p.err, c.logTail("migrate"))
	}
	return errors.Join(os.Remove(c.pidPath("migrate")), os.Remove(c.cmdPath("migrate")))
}

func (c *cluster) startReplicas(ctx context.Context) error {
	var ps []*proc
	for i, api := range c.apis {
		name := fmt.Sprintf("replica-%d", i+1)
		data := filepath.Join(c.dir, name)
		if err := os.Mkdir(data, 0o700); err != nil {
			return err
		}
		args := append([]string{"serve",
			"--http", strings.TrimPrefix(api, "http://"),
			"--data", data,
			"--store", c.pg.dsn,
			"--replica-id", name,
			"--admin-token", c.admin,
			"--mqtt-url", strings.Join(c.mqttURLs(), ","),
		}, c.door.serverFlags()...)
		p, err := c.spawn(name, nil, filepath.Join(c.bin, "companion"), args...)
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	for i, p := range ps {
		err := c.waitFor(ctx, p, p.name+" ready", func() error { return getOK(c.apis[i] + "/readyz") })
		if err != nil {
			return err
		}
	}
	return nil
}

// startBridge creates the bridge and its devices through the admin API of
// replica-1, starts it and waits until it is connected: the replicas let
// it through the NATS nodes' door with its devices' rights (door).
func (c *cluster) startBridge(ctx context.Context) error {
	var created struct {
		Secret string `json:"secret"`
	}
	if err := c.adminPost(ctx, "/api/v1/admin/bridges", map[string]any{"bridge_id": bridgeID}, &created); err != nil {
		return err
	}
	var ids []string
	for i := range c.devices {
		d := Device{DeviceID: fmt.Sprintf("sim-%03d", i+1), ClaimCode: randomString(12)}
		body := map[string]any{"device_id": d.DeviceID, "claim_code": d.ClaimCode, "model": "sim-1", "bridge_id": bridgeID}
		if err := c.adminPost(ctx, "/api/v1/admin/devices", body, nil); err != nil {
			return err
		}
		c.info.Devices = append(c.info.Devices, d)
		ids = append(ids, d.DeviceID)
	}
	data := filepath.Join(c.dir, "bridge")
	sim := filepath.Join(data, "sim")
	if err := os.MkdirAll(sim, 0o700); err != nil {
		return err
	}
	p, err := c.spawn("bridge", nil, filepath.Join(c.bin, "companion-bridge"),
		"--mqtt-url", strings.Join(c.mqttURLs(), ","),
		"--api-url", strings.Join(c.apis, ","), // blob downloads fail over, as MQTT does
		"--bridge-id", bridgeID,
		"--bridge-secret", created.Secret,
		"--data", data,
		"--sim-state", sim,
		"--sim-devices", strings.Join(ids, ","),
	)
	if err != nil {
		return err
	}
	return c.waitFor(ctx, p, "the bridge connected to NATS", func() error {
		return c.natsClientConnected("companion-bridge-" + bridgeID)
	})
}

// adminPost posts body to a replica's admin API and expects 201.
func (c *cluster) adminPost(ctx context.Context, path string, body, answer any) error {
	b, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, "POST", c.apis[0]+path, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.admin)
	req.Header.Set("Content-Type", "application/json")
	resp, err := httpClient.Do(req)
	if err != nil {
		return fmt.Errorf("POST %s: %w", path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("POST %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("POST %s: %s: %s", path, resp.Status, got)
	}
	if answer == nil {
		return nil
	}
	return json.Unmarshal(got, answer)
}

func (c *cluster) mqttURLs() []string {
	var u []string
	for _, n := range c.nats {
		u = append(u, "tcp://127.0.0.1:"+strconv.Itoa(n.mqtt))
	}
	return u
}

func (c *cluster) monitorURLs() []string {
	var u []string
	for _, n := range c.nats {
		u = append(u, "http://127.0.0.1:"+strconv.Itoa(n.monitor))
	}
	return u
}

// writeInfo writes cluster.json, by rename so that a reader never sees half
// of it; its presence says the cluster is up.
func (c *cluster) writeInfo() error {
	c.info.APIURLs = c.apis
	c.info.AdminToken = c.admin
	c.info.MQTTURLs = c.mqttURLs()
	c.info.NATSMonitorURLs = c.monitorURLs()
	c.info.PIDs = map[string]int{}
	for _, p := range c.procs {
		if p.name != "migrate" {
			c.info.PIDs[p.name] = p.pid
		}
	}
	return saveInfo(c.dir, c.info)
}

// saveInfo writes cluster.json by rename.
func saveInfo(dir string, info Info) error {
	b, err := json.MarshalIndent(info, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, jsonName+".tmp")
	// 0600: it holds the admin token.
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, jsonName))
}

func readInfo(dir string) (Info, error) {
	var info Info
	b, err := os.ReadFile(filepath.Join(dir, jsonName))
	if err != nil {
		return info, err
	}
	return info, json.Unmarshal(b, &info)
}

// usage is what up prints: where things are, and shell lines that work as
// printed: a user made through replica-1's admin API registers a device
// there and sends it a text through replica-2, waiting for the device.
func usage(dir string, info Info) string {
	var b strings.Builder
	fmt.Fprintf(&b, "The cluster is up: %s (logs: %s/*.log). Stop it with make cluster-down.\n\n", filepath.Join(dir, jsonName), dir)
	for i, u := range info.APIURLs {
		fmt.Fprintf(&b, "  replica-%d   %s\n", i+1, u)
	}
	for i := range info.MQTTURLs {
		fmt.Fprintf(&b, "  nats-%d      %s (monitoring %s)\n", i+1, info.MQTTURLs[i], info.NATSMonitorURLs[i])
	}
	for _, d := range info.Devices {
		fmt.Fprintf(&b, "  device      %s, claim code %s (bridge %s)\n", d.DeviceID, d.ClaimCode, bridgeID)
	}
	if len(info.APIURLs) < 2 || len(info.Devices) == 0 {
		return b.String()
	}
	d := info.Devices[0]
	fmt.Fprintf(&b, `
Try it: a user registers %[1]s through replica-1 and sends it a text through
replica-2, whose answer waits until the device has shown it:

API1=%[2]s/api/v1
API2=%[3]s/api/v1
ADMIN=%[4]s
TOKEN=$(curl -s -X POST $API1/admin/users -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' -d '{"name":"you"}' | sed -n 's/.*"token": *"\([^"]*\)".*/\1/p')
curl -s -w '\n' -X POST $API1/devices/register -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' -d '{"device_id":"%[1]s","claim_code":"%[5]s"}'
curl -s -w '\n' -X POST $API2/devices/%[1]s/push/text -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' -H 'Prefer: wait=10' -d '{"text":"hello through replica-2"}'
`, d.DeviceID, info.APIURLs[0], info.APIURLs[1], info.AdminToken, d.ClaimCode)
	return b.String()
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

// getOK gets url and wants 200.
func getOK(url string) error {
	resp, err := httpClient.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s %s", url, resp.Status, bytes.TrimSpace(b))
	}
	return nil
}

// waitFor polls check until it succeeds, p exits, ctx ends or startTimeout
// passes. The processes are not ours to be told of readiness: polling is
// all there is.
func (c *cluster) waitFor(ctx context.Context, p *proc, what string, check func() error) error {
	deadline := time.Now().Add(startTimeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("waiting for %s: %s exited (%v):\n%s", what, p.name, p.err, c.logTail(p.name))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waiting for %s: not within %v (%v):\n%s", what, startTimeout, err, c.logTail(p.name))
		}
	}
}

// freePorts returns n distinct TCP ports of 127.0.0.1 that were free a
// moment ago, all held at once so that none comes twice. Another process
// may take one before its server binds it: up then fails, and is run again.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("find a free port: %w", err)
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
