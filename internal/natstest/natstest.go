// Package natstest starts, for one test, the broker cluster CONTRACT §11
// supports: three NATS Server nodes with JetStream and MQTT, routed to each
// other, with static users whose rights are given as MQTT topic filters,
// or (Options.Callout) with NATS's auth callout, where an authorization
// service (the companion server's broker/natsauth) decides who logs in
// and with which rights.
//
// The binary is the repository's bin/nats-server, which `make deps` builds
// from the Go module proxy. It is for tests only; nothing outside _test.go
// files should import it.
package natstest

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/broker/natsauth"
	"github.com/devicecompanion/companion/internal/natsconf"
	"github.com/devicecompanion/companion/internal/testenv"
)

// Nodes is how many nodes a Cluster has: the three of CONTRACT §11.
const Nodes = 3

const (
	startTimeout = 30 * time.Second
	stopTimeout  = 10 * time.Second
	// logTail is how much of each node's log a failed test prints.
	logTail = 64 << 10
)

// User is a static NATS user that MQTT clients log in as (MQTT username and
// password). Publish and Subscribe are MQTT topic names or filters
// ("companion/v1/devices/+/commands/#"); StartCluster turns them into the
// NATS subjects NATS's MQTT maps them to ("companion.v1.devices.*.commands.>"
// and, since an MQTT "#" also matches its parent level, "companion.v1.devices.*.commands").
// Whatever is not listed is refused. Every user may also subscribe to the
// internal "$MQTT.sub.>" subjects QoS 1 and 2 deliveries use (implicit from
// NATS 2.12.3, required before it).
type User struct {
	Username, Password string
	Publish, Subscribe []string
}

// Options are StartCluster's.
type Options struct {
	// Users are the static users of every node; SetUsers replaces them.
	Users []User
	// AckWait is NATS MQTT's ack_wait: how long a QoS 1 message sent to
	// a subscriber waits for its PUBACK before JetStream sends it again.
	// Zero keeps NATS's default (30s).
	AckWait time.Duration
	// Debug adds NATS's debug logging to the nodes' logs.
	Debug bool
	// Callout has every MQTT login that is not one of Users sent to an
	// authorization service (NATS's auth_callout): see Callout. Users
	// are then static users that bypass it, in the same account.
	Callout bool
	// MaxAckPending is NATS MQTT's max_ack_pending: how many QoS 1
	// messages a subscription may have awaiting their PUBACK. Zero means
	// natsconf.DefaultMaxAckPending (64: a session may then hold 1,023
	// QoS 1 subscriptions), a negative value NATS's default (1,024: 63).
	MaxAckPending int
}

// Callout is what the authorization service of a cluster started with
// Options.Callout needs, all made for the one cluster. The nodes'
// configuration is natsconf.Callout's, with the static users (Options.Users
// and the helper's own) in Account and among the callout's auth_users.
type Callout struct {
	// URL is the nodes' NATS client URLs, comma-separated.
	URL string
	// User and Password are the service's own login (an auth user, in
	// account AUTH, where NATS sends its requests).
	User, Password string
	// SystemUser and SystemPassword are a user of the system account.
	SystemUser, SystemPassword string
	// IssuerSeed is the seed of the account key pair whose public key,
	// Issuer, is the callout's issuer: the service signs with it.
	IssuerSeed []byte
	Issuer     string
	// Account is where the service places MQTT clients (the user JWT's
	// audience); it has JetStream.
	Account string
}

// Cluster is three nats-server processes run for one test. Node indexes
// are 0, 1 and 2 (server names nats-1, nats-2, nats-3); every slice is in
// that order. The nodes are stopped when the test ends.
type Cluster struct {
	// MQTTURLs are the nodes' MQTT listeners, tcp://127.0.0.1:PORT.
	MQTTURLs []string
	// MonitorURLs are the nodes' monitoring endpoints, http://127.0.0.1:PORT.
	MonitorURLs []string
	// ClientURLs are the nodes' NATS client listeners, nats://127.0.0.1:PORT.
	ClientURLs []string
	// Dir holds each node's nats-N.conf, nats-N.log and JetStream store
	// directory js-N.
	Dir string
	// Callout is set when the cluster was started with Options.Callout.
	Callout *Callout

	bin       string
	opts      Options
	probeUser User // the helper's own user, to check that a node serves MQTT

	mu    sync.Mutex
	users []User
	nodes [Nodes]*node
}

type node struct {
	name                                    string
	confPath, logPath, storeDir             string
	clientPort, clusterPort, mqttPort, http int

	cmd    *exec.Cmd // nil while not running
	exited chan struct{}
	err    error // of cmd.Wait, once exited is closed
}

// StartCluster starts the three nodes on free ports of 127.0.0.1 and waits
// until each reports itself healthy (JetStream on, meta leader known) and
// serves MQTT. Without bin/nats-server the test fails, naming make deps. The
// nodes are stopped (SIGTERM, SIGKILL after a timeout) when the test ends;
// if it failed, the end of each node's log is printed.
func StartCluster(tb testing.TB, opts Options) *Cluster {
	tb.Helper()
	bin, err := findBinary()
	if err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	if err := checkUsers(opts.Users); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	c := &Cluster{
		Dir:       tb.TempDir(),
		bin:       bin,
		opts:      opts,
		probeUser: User{Username: "natstest-probe", Password: randomString(), Publish: []string{"natstest/probe"}, Subscribe: []string{"natstest/probe"}},
		users:     append([]User(nil), opts.Users...),
	}
	// testenv.FreePort: ports no outgoing connection can take meanwhile,
	// none handed out twice.
	ports := make([]int, 4*Nodes)
	for i := range ports {
		ports[i] = testenv.FreePort(tb)
	}
	for i := range c.nodes {
		n := &node{
			name:        fmt.Sprintf("nats-%d", i+1),
			clientPort:  ports[4*i],
			clusterPort: ports[4*i+1],
			mqttPort:    ports[4*i+2],
			http:        ports[4*i+3],
		}
		n.confPath = filepath.Join(c.Dir, n.name+".conf")
		n.logPath = filepath.Join(c.Dir, n.name+".log")
		n.storeDir = filepath.Join(c.Dir, fmt.Sprintf("js-%d", i+1))
		c.nodes[i] = n
		c.MQTTURLs = append(c.MQTTURLs, "tcp://127.0.0.1:"+strconv.Itoa(n.mqttPort))
		c.ClientURLs = append(c.ClientURLs, "nats://127.0.0.1:"+strconv.Itoa(n.clientPort))
		c.MonitorURLs = append(c.MonitorURLs, "http://127.0.0.1:"+strconv.Itoa(n.http))
	}
	if opts.Callout {
		if c.Callout, err = newCallout(strings.Join(c.ClientURLs, ",")); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
	}
	if err := c.writeConfigs(); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	tb.Cleanup(func() {
		for i := range c.nodes {
			if err := c.stop(i); err != nil {
				tb.Logf("natstest: %v", err)
			}
		}
		if tb.Failed() {
			c.dumpLogs(tb)
		}
	})
	for i := range c.nodes {
		if err := c.spawn(i); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
	}
	// All three must be up before any is healthy: JetStream elects its meta
	// leader, and MQTT makes its streams with three replicas, only then.
	for i := range c.nodes {
		if err := c.waitReady(i); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
	}
	return c
}

// MQTTURL is the nodes' MQTT URLs joined with commas, as --mqtt-url takes
// them.
func (c *Cluster) MQTTURL() string { return strings.Join(c.MQTTURLs, ",") }

// ConfigPath is the configuration file of node i.
func (c *Cluster) ConfigPath(i int) string { return c.nodes[i].confPath }

// LogPath is the log file of node i (appended to across restarts).
func (c *Cluster) LogPath(i int) string { return c.nodes[i].logPath }

// Log returns node i's log so far.
func (c *Cluster) Log(i int) string {
	b, err := os.ReadFile(c.nodes[i].logPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return string(b)
}

// Running reports whether node i's process is running.
func (c *Cluster) Running(i int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i].cmd != nil
}

// PID is node i's process id, or 0 when it is not running.
func (c *Cluster) PID(i int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.nodes[i].cmd == nil {
		return 0
	}
	return c.nodes[i].cmd.Process.Pid
}

// Kill stops node i with SIGKILL, as a crash would, and waits for the
// process to be gone. Restart brings it back.
func (c *Cluster) Kill(tb testing.TB, i int) {
	tb.Helper()
	c.checkIndex(tb, i)
	c.mu.Lock()
	n := c.nodes[i]
	cmd, exited := n.cmd, n.exited
	n.cmd, n.exited = nil, nil
	c.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

// Stop stops node i with SIGTERM (SIGKILL after a timeout) and waits for it.
func (c *Cluster) Stop(tb testing.TB, i int) {
	tb.Helper()
	c.checkIndex(tb, i)
	if err := c.stop(i); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
}

// Restart starts node i again, with the same configuration (and the users
// last given), ports and JetStream store directory, and waits until it is
// healthy and serves MQTT. The node must have been stopped or killed.
func (c *Cluster) Restart(tb testing.TB, i int) {
	tb.Helper()
	c.checkIndex(tb, i)
	if err := c.spawn(i); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	if err := c.waitReady(i); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
}

// WaitHealthy waits until every running node answers /healthz with 200,
// its /jsz names running nodes as the leaders of JetStream's meta group
// and of every stream and consumer it holds, and it serves MQTT end to
// end (a QoS 1 subscription is granted, a QoS 1 message published there
// comes back). After a Kill the survivors take some seconds to elect new
// leaders (a Raft election each); until then what needs the JetStream API
// fails after NATS's 5s timeout: an MQTT client's connect with a
// persistent session ("loading session record: timeout"), a new
// subscription (SUBACK 0x80), the retained messages of a subscription.
func (c *Cluster) WaitHealthy(tb testing.TB) {
	tb.Helper()
	for i := range c.nodes {
		if !c.Running(i) {
			continue
		}
		if err := c.waitHealthz(i); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
		if err := c.waitLeaders(i); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
		if err := c.waitRoundTrip(i); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
	}
}

// waitLeaders waits until node i's /jsz names, as leaders of the
// JetStream meta group and of every stream and consumer it holds a replica
// of (the MQTT sessions, messages, retained messages, QoS 2 state and the
// subscriptions' durable consumers), running nodes only.
func (c *Cluster) waitLeaders(i int) error {
	deadline := time.Now().Add(startTimeout)
	hc := &http.Client{Timeout: 2 * time.Second}
	for {
		missing, err := c.leaderless(hc, i)
		if err == nil && len(missing) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no running leader after %v for %v (%v)", c.nodes[i].name, startTimeout, missing, err)
		}
		time.Sleep(100 * time.Millisecond) // polling an endpoint; there is nothing to wait on
	}
}

func (c *Cluster) leaderless(hc *http.Client, i int) ([]string, error) {
	resp, err := hc.Get(c.MonitorURLs[i] + "/jsz?accounts=true&streams=true&consumers=true")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	type clusterInfo struct {
		Leader string `json:"leader"`
	}
	var jsz struct {
		Meta     *clusterInfo `json:"meta_cluster"`
		Accounts []struct {
			Streams []struct {
				Name      string       `json:"name"`
				Cluster   *clusterInfo `json:"cluster"`
				Consumers []struct {
					Name    string       `json:"name"`
					Cluster *clusterInfo `json:"cluster"`
				} `json:"consumer_detail"`
			} `json:"stream_detail"`
		} `json:"account_details"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&jsz); err != nil {
		return nil, err
	}
	running := map[string]bool{}
	for j, n := range c.nodes {
		if c.Running(j) {
			running[n.name] = true
		}
	}
	var missing []string
	if jsz.Meta == nil || !running[jsz.Meta.Leader] {
		missing = append(missing, "meta")
	}
	for _, a := range jsz.Accounts {
		for _, st := range a.Streams {
			if st.Cluster == nil || !running[st.Cluster.Leader] {
				missing = append(missing, st.Name)
			}
			for _, co := range st.Consumers {
				if co.Cluster == nil || !running[co.Cluster.Leader] {
					missing = append(missing, st.Name+">"+co.Name)
				}
			}
		}
	}
	return missing, nil
}

// NodeOf returns the index of the running node that MQTT client clientID
// is connected to, from the nodes' /connz, or -1 when it is connected to
// none.
func (c *Cluster) NodeOf(tb testing.TB, clientID string) int {
	tb.Helper()
	hc := &http.Client{Timeout: 5 * time.Second}
	for i := range c.nodes {
		if !c.Running(i) {
			continue
		}
		resp, err := hc.Get(c.MonitorURLs[i] + "/connz?mqtt_client=" + url.QueryEscape(clientID))
		if err != nil {
			tb.Fatalf("natstest: %s /connz: %v", c.nodes[i].name, err)
		}
		var cz struct {
			Conns []struct {
				MQTTClient string `json:"mqtt_client"`
			} `json:"connections"`
		}
		err = json.NewDecoder(resp.Body).Decode(&cz)
		resp.Body.Close()
		if err != nil {
			tb.Fatalf("natstest: %s /connz: %v", c.nodes[i].name, err)
		}
		for _, cn := range cz.Conns {
			if cn.MQTTClient == clientID {
				return i
			}
		}
	}
	return -1
}

// newCallout makes the accounts' credentials and the issuer key of one
// cluster.
func newCallout(url string) (*Callout, error) {
	seed, pub, err := natsconf.NewIssuer()
	if err != nil {
		return nil, err
	}
	return &Callout{
		URL:  url,
		User: "natstest-auth", Password: randomString(),
		SystemUser: "natstest-sys", SystemPassword: randomString(),
		IssuerSeed: seed, Issuer: pub,
		Account: natsauth.DefaultAccount,
	}, nil
}

// Users returns the users the nodes were last configured with.
func (c *Cluster) Users() []User {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]User(nil), c.users...)
}

// SetUsers replaces the static users of every node: it rewrites the three
// configuration files, has each running node reload its configuration
// (SIGHUP), and returns once every running node has reloaded (/varz) and
// every given user can connect to every running node. A stopped node takes the new users when restarted.
//
// NATS drops, on reload, the retained messages whose publisher no longer
// exists or may no longer publish on their topic: keep the users who
// published retained messages that must stay. With Options.Callout, the
// users the callout let in are not static users: a reload drops every
// retained message they published.
func (c *Cluster) SetUsers(tb testing.TB, users []User) {
	tb.Helper()
	if err := checkUsers(users); err != nil {
		tb.Fatalf("natstest: %v", err)
	}
	loaded := map[int]time.Time{}
	for i := range c.nodes {
		if c.Running(i) {
			t, err := c.configLoadTime(i)
			if err != nil {
				tb.Fatalf("natstest: %v", err)
			}
			loaded[i] = t
		}
	}
	c.mu.Lock()
	c.users = append([]User(nil), users...)
	err := c.writeConfigsLocked()
	var running []int
	for i, n := range c.nodes {
		if n.cmd != nil {
			if err == nil {
				err = n.cmd.Process.Signal(syscall.SIGHUP)
			}
			running = append(running, i)
		}
	}
	c.mu.Unlock()
	if err != nil {
		tb.Fatalf("natstest: reload the users: %v", err)
	}
	for _, i := range running {
		if err := c.waitReloaded(i, loaded[i]); err != nil {
			tb.Fatalf("natstest: %v", err)
		}
		for _, u := range users {
			if err := c.waitConnect(i, u); err != nil {
				tb.Fatalf("natstest: after reload: %v", err)
			}
		}
	}
}

// configLoadTime is when node i last loaded its configuration (/varz).
func (c *Cluster) configLoadTime(i int) (time.Time, error) {
	hc := &http.Client{Timeout: 2 * time.Second}
	resp, err := hc.Get(c.MonitorURLs[i] + "/varz")
	if err != nil {
		return time.Time{}, err
	}
	defer resp.Body.Close()
	var v struct {
		ConfigLoadTime time.Time `json:"config_load_time"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return time.Time{}, fmt.Errorf("%s /varz: %w", c.nodes[i].name, err)
	}
	return v.ConfigLoadTime, nil
}

// waitReloaded waits until node i has loaded its configuration after
// before.
func (c *Cluster) waitReloaded(i int, before time.Time) error {
	deadline := time.Now().Add(startTimeout)
	for {
		t, err := c.configLoadTime(i)
		if err == nil && t.After(before) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not reload its configuration within %v (%v):\n%s", c.nodes[i].name, startTimeout, err, tail(c.Log(i), logTail))
		}
		time.Sleep(50 * time.Millisecond) // polling an endpoint; there is nothing to wait on
	}
}

// AddUser adds (or replaces, by username) one user on every node; see
// SetUsers.
func (c *Cluster) AddUser(tb testing.TB, u User) {
	tb.Helper()
	users := c.Users()
	replaced := false
	for i := range users {
		if users[i].Username == u.Username {
			users[i], replaced = u, true
		}
	}
	if !replaced {
		users = append(users, u)
	}
	c.SetUsers(tb, users)
}

func (c *Cluster) checkIndex(tb testing.TB, i int) {
	tb.Helper()
	if i < 0 || i >= Nodes {
		tb.Fatalf("natstest: no node %d (nodes are 0..%d)", i, Nodes-1)
	}
}

// findBinary finds bin/nats-server beside go.mod, walking up from the
// working directory (a package's directory under go test).
func findBinary() (string, error) {
	root, err := testenv.RepoRoot()
	if err != nil {
		return "", fmt.Errorf("%w, so no bin/nats-server (make deps builds it)", err)
	}
	p := filepath.Join(root, "bin", "nats-server")
	fi, err := os.Stat(p)
	if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%s is missing: run make deps (it builds NATS Server from the Go module proxy into bin/)", p)
	}
	return p, nil
}

func randomString() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func checkUsers(users []User) error {
	seen := map[string]bool{}
	for _, u := range users {
		if u.Username == "" || u.Password == "" {
			return fmt.Errorf("user %q: a username and a password are needed", u.Username)
		}
		if strings.HasPrefix(u.Username, "natstest-") {
			return fmt.Errorf("%s: natstest-* are the helper's own users", u.Username)
		}
		if seen[u.Username] {
			return fmt.Errorf("user %q given twice", u.Username)
		}
		seen[u.Username] = true
		for _, s := range []string{u.Username, u.Password} {
			if err := natsconf.CheckString(s); err != nil {
				return fmt.Errorf("user %q: %w", u.Username, err)
			}
		}
		for _, f := range append(append([]string(nil), u.Publish...), u.Subscribe...) {
			if _, err := Subjects(f); err != nil {
				return fmt.Errorf("user %q: %w", u.Username, err)
			}
		}
	}
	return nil
}

// Subjects returns the NATS subjects an MQTT topic name or filter is
// checked against by NATS's MQTT: levels become tokens, "+" "*", "#" ">",
// a "." inside a level "//"; a filter ending in "#" gives its parent too,
// which NATS subscribes to as well (MQTT's "a/#" matches "a"). Empty levels
// (which NATS maps in ways a test should not rely on) and "$MQTT" topics
// (NATS's own, which MQTT clients may not use) are refused. It is
// natsauth.Subjects, which the authorization service uses.
func Subjects(filter string) ([]string, error) { return natsauth.Subjects(filter) }

// subjectsOf turns MQTT filters into NATS subjects, without repeats.
func subjectsOf(filters []string) []string {
	var out []string
	seen := map[string]bool{}
	for _, f := range filters {
		ss, err := Subjects(f)
		if err != nil {
			panic(err) // checked by checkUsers
		}
		for _, s := range ss {
			if !seen[s] {
				seen[s] = true
				out = append(out, s)
			}
		}
	}
	return out
}

// config is the cluster's configuration, the same for every node but its
// own block (natsconf, which scripts/cluster writes with too).
func (c *Cluster) config() natsconf.Config {
	cfg := natsconf.Config{
		Comment:       "Written by internal/natstest for one test.",
		ClusterName:   "natstest",
		AckWait:       c.opts.AckWait,
		MaxAckPending: c.opts.MaxAckPending,
		Debug:         c.opts.Debug,
	}
	for _, n := range c.nodes {
		cfg.Nodes = append(cfg.Nodes, natsconf.Node{
			Name:   n.name,
			Client: n.clientPort, Route: n.clusterPort, MQTT: n.mqttPort, Monitor: n.http,
			StoreDir: n.storeDir,
		})
	}
	for _, u := range append([]User{c.probeUser}, c.users...) {
		cfg.Users = append(cfg.Users, natsconf.User{
			Name: u.Username, Password: u.Password,
			Publish: subjectsOf(u.Publish), Subscribe: subjectsOf(u.Subscribe),
		})
	}
	if co := c.Callout; co != nil {
		cfg.Callout = &natsconf.Callout{
			User: co.User, Password: co.Password,
			SystemUser: co.SystemUser, SystemPassword: co.SystemPassword,
			Issuer:  co.Issuer,
			Account: co.Account,
		}
	}
	return cfg
}

func (c *Cluster) writeConfigs() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writeConfigsLocked()
}

func (c *Cluster) writeConfigsLocked() error {
	cfg := c.config()
	for i, n := range c.nodes {
		conf, err := cfg.Node(i)
		if err != nil {
			return err
		}
		// Write and rename, so that a reload never reads half a file.
		tmp := n.confPath + ".tmp"
		if err := os.WriteFile(tmp, []byte(conf), 0o600); err != nil {
			return err
		}
		if err := os.Rename(tmp, n.confPath); err != nil {
			return err
		}
	}
	return nil
}

// spawn starts node i's process.
func (c *Cluster) spawn(i int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.nodes[i]
	if n.cmd != nil {
		return fmt.Errorf("%s is already running", n.name)
	}
	logf, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(logf, "=== natstest: starting %s at %s\n", n.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(c.bin, "-c", n.confPath)
	cmd.Dir = c.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	testenv.EndsWithTestBinary(cmd)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", n.name, err)
	}
	exited := make(chan struct{})
	go func() {
		err := cmd.Wait()
		logf.Close()
		c.mu.Lock()
		n.err = err
		c.mu.Unlock()
		close(exited)
	}()
	n.cmd, n.exited = cmd, exited
	return nil
}

func (c *Cluster) stop(i int) error {
	c.mu.Lock()
	n := c.nodes[i]
	cmd, exited := n.cmd, n.exited
	n.cmd, n.exited = nil, nil
	c.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(stopTimeout):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("%s did not stop on SIGTERM within %v; killed", n.name, stopTimeout)
	}
}

// waitReady waits until node i answers /healthz with 200 (JetStream
// enabled, meta leader known, its streams current) and a QoS 1 message
// makes the round trip through its MQTT listener.
func (c *Cluster) waitReady(i int) error {
	if err := c.waitHealthz(i); err != nil {
		return err
	}
	return c.waitRoundTrip(i)
}

func (c *Cluster) waitHealthz(i int) error {
	c.mu.Lock()
	n := c.nodes[i]
	exited := n.exited
	c.mu.Unlock()
	if exited == nil {
		return fmt.Errorf("%s is not running", n.name)
	}
	deadline := time.Now().Add(startTimeout)
	hc := &http.Client{Timeout: 2 * time.Second}
	healthz := c.MonitorURLs[i] + "/healthz"
	var last string
	for {
		select {
		case <-exited:
			c.mu.Lock()
			err := n.err
			c.mu.Unlock()
			return fmt.Errorf("%s exited at start (%v):\n%s", n.name, err, tail(c.Log(i), logTail))
		default:
		}
		resp, err := hc.Get(healthz)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, bytes.TrimSpace(body))
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not healthy after %v (last /healthz: %s):\n%s", n.name, startTimeout, last, tail(c.Log(i), logTail))
		}
		time.Sleep(50 * time.Millisecond) // polling an endpoint; there is nothing to wait on
	}
	return nil
}

// waitConnect waits until u can open an MQTT connection to node i.
func (c *Cluster) waitConnect(i int, u User) error {
	deadline := time.Now().Add(startTimeout)
	for {
		err := c.tryConnect(i, u)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("user %q cannot connect to %s (%s): %v\n%s", u.Username, c.nodes[i].name, c.MQTTURLs[i], err, tail(c.Log(i), logTail))
		}
		time.Sleep(100 * time.Millisecond) // polling a port; there is nothing to wait on
	}
}

// waitRoundTrip waits until the probe user, on node i, is granted a QoS 1
// subscription and receives its own QoS 1 message through it.
func (c *Cluster) waitRoundTrip(i int) error {
	deadline := time.Now().Add(startTimeout)
	for {
		err := c.roundTrip(i)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no QoS 1 round trip through %s after %v: %v\n%s", c.nodes[i].name, startTimeout, err, tail(c.Log(i), logTail))
		}
		time.Sleep(200 * time.Millisecond) // retrying a refused subscription; there is nothing to wait on
	}
}

func (c *Cluster) roundTrip(i int) error {
	const topic = "natstest/probe"
	got := make(chan string, 10)
	cl := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(c.MQTTURLs[i]).
		SetClientID("natstest-probe-" + randomString()).
		SetUsername(c.probeUser.Username).
		SetPassword(c.probeUser.Password).
		SetCleanSession(true).
		// 3.1.1 only: paho would retry a refused login as MQTT 3.1,
		// which NATS refuses too, with one more error in its log.
		SetProtocolVersion(4).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(5 * time.Second).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
			select {
			case got <- string(m.Payload()):
			default:
			}
		}))
	if err := mqtt.WaitTokenTimeout(cl.Connect(), 6*time.Second); err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer cl.Disconnect(50)
	tok := cl.Subscribe(topic, 1, nil)
	if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
		return fmt.Errorf("subscribe: %w", err)
	}
	if code := tok.(*mqtt.SubscribeToken).Result()[topic]; code != 1 {
		return fmt.Errorf("subscribe: SUBACK %#x", code)
	}
	payload := randomString()
	if err := mqtt.WaitTokenTimeout(cl.Publish(topic, 1, false, payload), 10*time.Second); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	timeout := time.After(10 * time.Second)
	for {
		select {
		case p := <-got:
			if p == payload {
				return nil
			}
		case <-timeout:
			return errors.New("own QoS 1 message not received")
		}
	}
}

func (c *Cluster) tryConnect(i int, u User) error {
	cl := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(c.MQTTURLs[i]).
		SetClientID("natstest-probe-" + randomString()).
		SetUsername(u.Username).
		SetPassword(u.Password).
		SetCleanSession(true).
		// 3.1.1 only: paho would retry a refused login as MQTT 3.1,
		// which NATS refuses too, with one more error in its log.
		SetProtocolVersion(4).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(5 * time.Second))
	if err := mqtt.WaitTokenTimeout(cl.Connect(), 6*time.Second); err != nil {
		return err
	}
	cl.Disconnect(50)
	return nil
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "[… " + strconv.Itoa(len(s)-n) + " bytes cut]\n" + s[len(s)-n:]
}

func (c *Cluster) dumpLogs(tb testing.TB) {
	for i, n := range c.nodes {
		tb.Logf("natstest: %s log (%s, config %s):\n%s", n.name, n.logPath, n.confPath, tail(c.Log(i), logTail))
	}
}
