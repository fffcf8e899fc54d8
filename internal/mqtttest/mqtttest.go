// Package mqtttest holds test helpers for every package that talks MQTT: a
// free TCP port, and a real Mosquitto started from the repository's own
// mosquitto.conf with accounts and ACLs of the test's choosing, kept in
// Mosquitto's dynamic-security plugin as that file has it (StartMosquitto),
// or in the password and ACL files of its static alternative
// (StartMosquittoStatic).
//
// It is for tests only; nothing outside _test.go files should import it.
package mqtttest

import (
	"bufio"
	"bytes"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha512"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/testenv"
	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// FreePort is testenv.FreePort, here for the tests that start Mosquitto.
func FreePort(tb testing.TB) int {
	tb.Helper()
	return testenv.FreePort(tb)
}

// MosquittoAccount is an account to create in a test Mosquitto.
type MosquittoAccount struct {
	Username, Password string
	// ACL holds acl_file lines for this user, such as
	// "topic readwrite companion/v1/#" or "topic read companion/v1/devices/+/commands/#";
	// they become the ACLs of a dynamic-security role of the account's own
	// ("read": subscribePattern and publishClientReceive, "write":
	// publishClientSend). Anything not granted is refused.
	ACL []string
	// Admin gives the account the role mosquitto_ctrl dynsec init gives
	// its admin, as docs/mosquitto.md makes the server's account: it may
	// publish to $CONTROL/dynamic-security/# and read the responses, as
	// the server's account must with --mqtt-dynsec, and read every topic,
	// $SYS/# included.
	Admin bool
}

// Mosquitto is a Mosquitto broker run for one test, from the repository's
// mosquitto.conf. Start it with StartMosquitto; it is stopped when the test
// ends.
type Mosquitto struct {
	// URL is where clients connect: tcp://127.0.0.1:PORT.
	URL string
	// Dir holds the configuration, the plugin's dynamic-security.json,
	// the persistence database and the log (mosquitto.log).
	Dir string
	// Port is the TCP port it listens on; it stays the same across Stop and
	// Start.
	Port int

	bin        string
	confPath   string
	logPath    string
	dynsecPath string
	adminPass  string // of AdminUsername, the helper's own plugin admin

	mu       sync.Mutex
	accounts []MosquittoAccount
	cmd      *exec.Cmd
	exited   chan struct{} // closed when cmd has been waited for
}

const (
	startTimeout = 10 * time.Second
	stopTimeout  = 10 * time.Second
)

// StartMosquitto starts Mosquitto with the given accounts on a free port of
// 127.0.0.1 and waits until it accepts connections. Without Mosquitto the
// test fails, naming make deps, which installs it. Mosquitto is stopped (SIGTERM, then waited for) when
// the test ends; if the test failed, its log is printed.
func StartMosquitto(tb testing.TB, accounts ...MosquittoAccount) *Mosquitto {
	tb.Helper()
	return startMosquitto(tb, nil, accounts)
}

// StartMosquittoStatic starts Mosquitto as StartMosquitto does, but as
// docs/mosquitto.md, section 3, has the operator run it for a server with
// --mqtt-dynsec=false: the repository's mosquitto.conf without its plugin
// lines and with its password_file and acl_file lines uncommented. Each
// account's password goes in the password file (mosquitto_passwd); its ACL
// lines are not used: acl is the ACL file, as written (such as
// docs/companion.acl.example). AddAccount and Dynsec are not for it.
func StartMosquittoStatic(tb testing.TB, acl []byte, accounts ...MosquittoAccount) *Mosquitto {
	tb.Helper()
	return startMosquitto(tb, acl, accounts)
}

// StartMosquittoInit starts Mosquitto as StartMosquitto does, but with
// the dynamic-security file that dynsecInit writes, given its path, before the
// first start, in place of the helper's admin and accounts: as
// docs/mosquitto.md, section 2, has the operator run mosquitto_ctrl
// dynsec init, then start Mosquitto. Dynsec and AddAccount are not for it
// (the helper has no admin of its own there).
func StartMosquittoInit(tb testing.TB, dynsecInit func(dynsecPath string) error) *Mosquitto {
	tb.Helper()
	return startMosquittoWith(tb, nil, nil, dynsecInit)
}

// startMosquitto starts Mosquitto with the dynamic-security plugin, or
// with a password and an ACL file when acl is not nil.
func startMosquitto(tb testing.TB, acl []byte, accounts []MosquittoAccount) *Mosquitto {
	tb.Helper()
	return startMosquittoWith(tb, acl, accounts, nil)
}

// startMosquittoWith is startMosquitto, with the dynamic-security file
// written by dynsecInit when it is not nil.
func startMosquittoWith(tb testing.TB, acl []byte, accounts []MosquittoAccount, dynsecInit func(dynsecPath string) error) *Mosquitto {
	tb.Helper()
	bin := findBinary("mosquitto")
	plugin := findPlugin()
	passwd := findBinary("mosquitto_passwd")
	if bin == "" || plugin == "" || acl != nil && passwd == "" {
		tb.Fatal("mqtttest: mosquitto, mosquitto_passwd or the dynamic-security plugin not installed: run make deps (it installs Debian's mosquitto)")
	}
	src, err := repoConf()
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	m := &Mosquitto{
		Dir:       tb.TempDir(),
		Port:      FreePort(tb),
		bin:       bin,
		adminPass: randomString(),
	}
	m.URL = "tcp://127.0.0.1:" + strconv.Itoa(m.Port)
	m.confPath = filepath.Join(m.Dir, "mosquitto.conf")
	m.logPath = filepath.Join(m.Dir, "mosquitto.log")
	m.dynsecPath = filepath.Join(m.Dir, "dynamic-security.json")

	var files *staticFiles
	if acl != nil {
		files = &staticFiles{passwd: filepath.Join(m.Dir, "companion.passwd"), acl: filepath.Join(m.Dir, "companion.acl")}
	}
	conf, err := rewriteConf(src, m.Port, m.Dir, m.logPath, plugin, m.dynsecPath, files)
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	if err := os.WriteFile(m.confPath, conf, 0o600); err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	m.accounts = accounts
	switch {
	case files != nil:
		err = writeStatic(passwd, files, acl, accounts)
	case dynsecInit != nil:
		err = dynsecInit(m.dynsecPath)
	default:
		err = m.writeDynsec()
	}
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	tb.Cleanup(func() {
		m.stop()
		if tb.Failed() {
			m.dumpLog(tb)
		}
	})
	m.Start(tb)
	return m
}

// staticFiles are where a static Mosquitto's password and ACL files go.
type staticFiles struct {
	passwd, acl string
}

// writeStatic writes the password file, with mosquitto_passwd as the
// operator does, and the ACL file.
func writeStatic(passwd string, files *staticFiles, acl []byte, accounts []MosquittoAccount) error {
	if err := os.WriteFile(files.passwd, nil, 0o600); err != nil {
		return err
	}
	for _, a := range accounts {
		if out, err := exec.Command(passwd, "-b", files.passwd, a.Username, a.Password).CombinedOutput(); err != nil {
			return fmt.Errorf("mosquitto_passwd %s: %v: %s", a.Username, err, out)
		}
	}
	return os.WriteFile(files.acl, acl, 0o600)
}

// findBinary looks in PATH and in /usr/sbin, where Debian installs the broker
// but which is often missing from a user's PATH.
func findBinary(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/usr/local/sbin", "/usr/bin"} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	return ""
}

// findPlugin finds the dynamic-security plugin where Debian and a source
// build install it.
func findPlugin() string {
	const name = "mosquitto_dynamic_security.so"
	paths, _ := filepath.Glob("/usr/lib/*/" + name)
	paths = append(paths, "/usr/lib/"+name, "/usr/local/lib/"+name, "/usr/lib/mosquitto/"+name)
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p
		}
	}
	return ""
}

// repoConf reads the repository's mosquitto.conf, found beside go.mod by
// walking up from the working directory (a package's directory under go test).
func repoConf() ([]byte, error) {
	root, err := testenv.RepoRoot()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(root, "mosquitto.conf"))
	if err != nil {
		return nil, fmt.Errorf("read the repository's mosquitto.conf: %w", err)
	}
	return b, nil
}

// rewriteConf points a configuration at the test's port and directory. Each
// line is read as Mosquitto reads it (first word = option); the options that
// name a port, a path or the process's user are replaced, comments and
// everything else kept. A listener line with a port other than 1883 (the
// project's optional TLS listener) is dropped with the options that follow
// it up to the next listener, as they belong to it. Accounts live in the
// dynamic-security plugin: a password_file or acl_file line is an error.
// With files, accounts live in files instead, as docs/mosquitto.md,
// section 3, says: the plugin lines go, and the commented password_file and
// acl_file lines are uncommented, naming files.
func rewriteConf(src []byte, port int, dir, logPath, plugin, dynsecPath string, files *staticFiles) ([]byte, error) {
	var out bytes.Buffer
	sawListener, sawPersistLoc, sawPlugin, sawDynsec := false, false, false, false
	sawPasswd, sawACL := false, false
	inDropped := false
	sc := bufio.NewScanner(bytes.NewReader(src))
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if files != nil && len(fields) == 2 && !inDropped {
			switch fields[0] {
			case "#password_file":
				sawPasswd = true
				fmt.Fprintf(&out, "password_file %s\n", files.passwd)
				continue
			case "#acl_file":
				sawACL = true
				fmt.Fprintf(&out, "acl_file %s\n", files.acl)
				continue
			}
		}
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			out.WriteString(line + "\n")
			continue
		}
		opt := fields[0]
		if opt == "listener" {
			inDropped = sawListener || len(fields) < 2 || fields[1] != "1883"
			if inDropped {
				out.WriteString("# mqtttest dropped: " + line + "\n")
				continue
			}
			sawListener = true
			fmt.Fprintf(&out, "listener %d 127.0.0.1\n", port)
			continue
		}
		if inDropped {
			out.WriteString("# mqtttest dropped: " + line + "\n")
			continue
		}
		switch opt {
		case "persistence_location":
			sawPersistLoc = true
			fmt.Fprintf(&out, "persistence_location %s/\n", dir)
		case "plugin":
			if len(fields) < 2 || filepath.Base(fields[1]) != "mosquitto_dynamic_security.so" {
				return nil, fmt.Errorf("mosquitto.conf loads an unknown plugin: %q", line)
			}
			sawPlugin = true
			if files != nil {
				out.WriteString("# mqtttest dropped: " + line + "\n")
				continue
			}
			fmt.Fprintf(&out, "plugin %s\n", plugin)
		case "plugin_opt_config_file":
			sawDynsec = true
			if files != nil {
				out.WriteString("# mqtttest dropped: " + line + "\n")
				continue
			}
			fmt.Fprintf(&out, "plugin_opt_config_file %s\n", dynsecPath)
		case "password_file", "acl_file":
			return nil, fmt.Errorf("mosquitto.conf has %q: mqtttest keeps accounts in the dynamic-security plugin only", line)
		case "log_dest":
			// Every destination goes; one file replaces them below.
			out.WriteString("# mqtttest dropped: " + line + "\n")
		case "pid_file", "user":
			out.WriteString("# mqtttest dropped: " + line + "\n")
		default:
			out.WriteString(line + "\n")
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	switch {
	case !sawListener:
		return nil, errors.New("mosquitto.conf has no \"listener 1883\" line")
	case !sawPersistLoc:
		return nil, errors.New("mosquitto.conf has no persistence_location line")
	case !sawPlugin:
		return nil, errors.New("mosquitto.conf does not load the dynamic-security plugin")
	case !sawDynsec:
		return nil, errors.New("mosquitto.conf has no plugin_opt_config_file line")
	case files != nil && (!sawPasswd || !sawACL):
		return nil, errors.New("mosquitto.conf has no commented password_file and acl_file lines to uncomment")
	}
	fmt.Fprintf(&out, "log_dest file %s\n", logPath)
	// Run as whoever runs the test: as root, Mosquitto would otherwise switch
	// to the "mosquitto" user, who cannot write the test's directory.
	if os.Geteuid() == 0 {
		out.WriteString("user root\n")
	}
	return out.Bytes(), nil
}

// AdminUsername is the helper's own admin of the dynamic-security plugin,
// which AddAccount and Dynsec use.
const AdminUsername = "mqtttest-admin"

// adminRole and adminACLs are the role `mosquitto_ctrl dynsec init` gives
// its admin user (docs/mosquitto.md, section 2, makes the server's account
// so), and initDefaultACLAccess the plugin's default access it writes:
// every client may receive what it subscribed to, until the server, as it
// connects, refuses that by default (setDefaultACLAccess). The tests run
// against what users run (TestAdminIsWhatDynsecInitMakes, bug 449).
const adminRole = "admin"

var (
	adminACLs = []dynsecACL{
		{Type: "publishClientSend", Topic: "$CONTROL/dynamic-security/#", Allow: true},
		{Type: "publishClientReceive", Topic: "$CONTROL/dynamic-security/#", Allow: true},
		{Type: "subscribePattern", Topic: "$CONTROL/dynamic-security/#", Allow: true},
		{Type: "publishClientReceive", Topic: "$SYS/#", Allow: true},
		{Type: "subscribePattern", Topic: "$SYS/#", Allow: true},
		{Type: "publishClientReceive", Topic: "#", Allow: true},
		{Type: "subscribePattern", Topic: "#", Allow: true},
		{Type: "unsubscribePattern", Topic: "#", Allow: true},
	}
	initDefaultACLAccess = map[string]bool{
		"publishClientSend": false, "publishClientReceive": true,
		"subscribe": false, "unsubscribe": true,
	}
)

type dynsecACL struct {
	Type  string `json:"acltype"`
	Topic string `json:"topic"`
	Allow bool   `json:"allow"`
}

type dynsecRole struct {
	Name string      `json:"rolename"`
	ACLs []dynsecACL `json:"acls"`
}

type dynsecRoleRef struct {
	Name string `json:"rolename"`
}

type dynsecClient struct {
	Username   string          `json:"username"`
	Password   string          `json:"password"` // PBKDF2-SHA512, base64
	Salt       string          `json:"salt"`     // base64
	Iterations int             `json:"iterations"`
	Roles      []dynsecRoleRef `json:"roles"`
}

// pbkdf2Iterations is what Mosquitto 2.0's plugin uses itself (101).
const pbkdf2Iterations = 101

// hashPassword hashes as Mosquitto 2.0's dynamic-security plugin does:
// PBKDF2 with HMAC-SHA512, 12 random bytes of salt, 64 bytes of key.
func hashPassword(password string) (hash, salt string, err error) {
	s := make([]byte, 12)
	if _, err := rand.Read(s); err != nil {
		return "", "", err
	}
	k, err := pbkdf2.Key(sha512.New, password, s, pbkdf2Iterations, 64)
	if err != nil {
		return "", "", err
	}
	return base64.StdEncoding.EncodeToString(k), base64.StdEncoding.EncodeToString(s), nil
}

// aclOf turns acl_file lines into dynamic-security ACLs.
func aclOf(lines []string) ([]dynsecACL, error) {
	var out []dynsecACL
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) < 2 || f[0] != "topic" {
			return nil, fmt.Errorf("ACL line %q: only \"topic [read|write|readwrite] TOPIC\" is supported", l)
		}
		access, topic := "readwrite", f[1]
		if len(f) == 3 {
			access, topic = f[1], f[2]
		}
		if access == "read" || access == "readwrite" {
			out = append(out,
				dynsecACL{Type: "subscribePattern", Topic: topic, Allow: true},
				dynsecACL{Type: "publishClientReceive", Topic: topic, Allow: true})
		}
		if access == "write" || access == "readwrite" {
			out = append(out, dynsecACL{Type: "publishClientSend", Topic: topic, Allow: true})
		}
		if access != "read" && access != "write" && access != "readwrite" {
			return nil, fmt.Errorf("ACL line %q: unknown access %q", l, access)
		}
	}
	return out, nil
}

// roleOf is the role the helper makes for an account's ACL lines.
func roleOf(username string) string { return "mqtttest-" + username }

// writeDynsec writes the plugin's configuration before the first start:
// the helper's admin, as mosquitto_ctrl dynsec init makes it, and the
// accounts.
func (m *Mosquitto) writeDynsec() error {
	cfg := struct {
		Clients          []dynsecClient  `json:"clients"`
		Roles            []dynsecRole    `json:"roles"`
		DefaultACLAccess map[string]bool `json:"defaultACLAccess"`
	}{
		Roles:            []dynsecRole{{Name: adminRole, ACLs: adminACLs}},
		DefaultACLAccess: initDefaultACLAccess,
	}
	add := func(user, pass string, roles ...string) error {
		h, salt, err := hashPassword(pass)
		if err != nil {
			return err
		}
		c := dynsecClient{Username: user, Password: h, Salt: salt, Iterations: pbkdf2Iterations}
		for _, r := range roles {
			c.Roles = append(c.Roles, dynsecRoleRef{Name: r})
		}
		cfg.Clients = append(cfg.Clients, c)
		return nil
	}
	if err := add(AdminUsername, m.adminPass, adminRole); err != nil {
		return err
	}
	for _, a := range m.accounts {
		if a.Username == "" || a.Username == AdminUsername {
			return fmt.Errorf("bad username %q", a.Username)
		}
		acls, err := aclOf(a.ACL)
		if err != nil {
			return err
		}
		cfg.Roles = append(cfg.Roles, dynsecRole{Name: roleOf(a.Username), ACLs: acls})
		roles := []string{roleOf(a.Username)}
		if a.Admin {
			roles = append(roles, adminRole)
		}
		if err := add(a.Username, a.Password, roles...); err != nil {
			return err
		}
	}
	b, err := json.MarshalIndent(cfg, "", "\t")
	if err != nil {
		return err
	}
	return os.WriteFile(m.dynsecPath, b, 0o600)
}

// AddAccount adds an account to the running broker through the
// dynamic-security plugin's control API, and returns once the new account
// can connect.
func (m *Mosquitto) AddAccount(tb testing.TB, a MosquittoAccount) {
	tb.Helper()
	acls, err := aclOf(a.ACL)
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	roles := []map[string]any{{"rolename": roleOf(a.Username)}}
	if a.Admin {
		roles = append(roles, map[string]any{"rolename": adminRole})
	}
	for _, r := range m.Dynsec(tb,
		map[string]any{"command": "createRole", "rolename": roleOf(a.Username), "acls": acls},
		map[string]any{"command": "createClient", "username": a.Username, "password": a.Password, "roles": roles},
	) {
		if r.Error != "" {
			tb.Fatalf("mqtttest: AddAccount %q: %s: %s", a.Username, r.Command, r.Error)
		}
	}
	m.mu.Lock()
	m.accounts = append(m.accounts, a)
	m.mu.Unlock()
	if err := m.tryConnect(a.Username, a.Password); err != nil {
		tb.Fatalf("mqtttest: account %q cannot connect: %v", a.Username, err)
	}
}

// DynsecResponse is the plugin's answer to one command.
type DynsecResponse struct {
	Command string          `json:"command"`
	Error   string          `json:"error"`
	Data    json.RawMessage `json:"data"`
}

// Dynsec sends commands to the running broker's dynamic-security plugin as
// the helper's admin, in one message, and returns the plugin's answers in
// order. A refused command is an answer with Error set, not a failure.
func (m *Mosquitto) Dynsec(tb testing.TB, cmds ...map[string]any) []DynsecResponse {
	tb.Helper()
	const topic = "$CONTROL/dynamic-security/v1"
	got := make(chan []DynsecResponse, 1)
	id := "mqtttest-" + randomString()
	c := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(m.URL).
		SetClientID(id).
		SetUsername(AdminUsername).
		SetPassword(m.adminPass).
		SetAutoReconnect(false).
		SetConnectTimeout(startTimeout))
	if err := mqtt.WaitTokenTimeout(c.Connect(), startTimeout); err != nil {
		tb.Fatalf("mqtttest: connect as %s: %v", AdminUsername, err)
	}
	defer c.Disconnect(50)
	tok := c.Subscribe(topic+"/response", 1, func(_ mqtt.Client, msg mqtt.Message) {
		var r struct {
			Responses []struct {
				DynsecResponse
				CorrelationData string `json:"correlationData"`
			} `json:"responses"`
		}
		if json.Unmarshal(msg.Payload(), &r) != nil || len(r.Responses) == 0 || r.Responses[0].CorrelationData != id {
			return
		}
		out := make([]DynsecResponse, len(r.Responses))
		for i, x := range r.Responses {
			out[i] = x.DynsecResponse
		}
		select {
		case got <- out:
		default:
		}
	})
	if err := mqtt.WaitTokenTimeout(tok, startTimeout); err != nil {
		tb.Fatalf("mqtttest: subscribe to the plugin's responses: %v", err)
	}
	list := make([]map[string]any, len(cmds))
	for i, cmd := range cmds {
		cc := map[string]any{"correlationData": id}
		for k, v := range cmd {
			cc[k] = v
		}
		list[i] = cc
	}
	payload, err := json.Marshal(map[string]any{"commands": list})
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	if err := mqtt.WaitTokenTimeout(c.Publish(topic, 1, false, payload), startTimeout); err != nil {
		tb.Fatalf("mqtttest: publish to the plugin: %v", err)
	}
	select {
	case rs := <-got:
		if len(rs) != len(cmds) {
			tb.Fatalf("mqtttest: %d answers to %d commands", len(rs), len(cmds))
		}
		return rs
	case <-time.After(startTimeout):
		tb.Fatalf("mqtttest: the dynamic-security plugin did not answer")
		return nil
	}
}

func randomString() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func (m *Mosquitto) tryConnect(user, pass string) error {
	c := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(m.URL).
		SetClientID(fmt.Sprintf("mqtttest-probe-%d", time.Now().UnixNano())).
		SetUsername(user).
		SetPassword(pass).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetConnectTimeout(2 * time.Second))
	if err := mqtt.WaitTokenTimeout(c.Connect(), 3*time.Second); err != nil {
		return err
	}
	c.Disconnect(50)
	return nil
}

// Start starts Mosquitto again after Stop, on the same port and with the
// same directory (and so the same persistence database), and waits until it
// accepts connections. StartMosquitto calls it the first time.
func (m *Mosquitto) Start(tb testing.TB) {
	tb.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil {
		tb.Fatal("mqtttest: mosquitto is already running")
	}
	cmd := exec.Command(m.bin, "-c", m.confPath)
	cmd.Dir = m.Dir
	testenv.EndsWithTestBinary(cmd)
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		tb.Fatalf("mqtttest: start mosquitto: %v", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	m.cmd, m.exited = cmd, exited

	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(m.Port))
	deadline := time.Now().Add(startTimeout)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-exited:
			m.cmd = nil
			tb.Fatalf("mqtttest: mosquitto exited at start (%v): %s\n%s", waitErr, stderr.String(), m.readLog())
		default:
		}
		if time.Now().After(deadline) {
			tb.Fatalf("mqtttest: mosquitto does not accept connections on %s: %v\n%s", addr, err, m.readLog())
		}
		time.Sleep(10 * time.Millisecond) // polling a port; there is nothing to wait on
	}
}

// Stop stops Mosquitto with SIGTERM and waits for it to exit; Mosquitto
// saves its persistence database on the way out. Start brings it back.
func (m *Mosquitto) Stop(tb testing.TB) {
	tb.Helper()
	if err := m.stop(); err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
}

func (m *Mosquitto) stop() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil {
		return nil
	}
	cmd, exited := m.cmd, m.exited
	m.cmd, m.exited = nil, nil
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(stopTimeout):
		_ = cmd.Process.Kill()
		<-exited
		return errors.New("mosquitto did not stop on SIGTERM; killed")
	}
}

// SetACL replaces the ACL file of a Mosquitto started by
// StartMosquittoStatic and has Mosquitto reread it, as
// `systemctl reload mosquitto` does (SIGHUP); it returns once Mosquitto
// has reread it: any packet sent after that meets the new file.
func (m *Mosquitto) SetACL(tb testing.TB, acl []byte) {
	tb.Helper()
	path := filepath.Join(m.Dir, "companion.acl")
	if _, err := os.Stat(path); err != nil {
		tb.Fatalf("mqtttest: SetACL on a Mosquitto not started by StartMosquittoStatic: %v", err)
	}
	if err := os.WriteFile(path, acl, 0o600); err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	const reloaded = "Reloading config."
	before := strings.Count(m.readLog(), reloaded)
	m.mu.Lock()
	cmd := m.cmd
	m.mu.Unlock()
	if cmd == nil {
		tb.Fatal("mqtttest: mosquitto is not running")
	}
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	// Mosquitto logs the line as it starts the reload, in its one loop:
	// a packet read after the line is handled after the reload.
	deadline := time.Now().Add(startTimeout)
	for strings.Count(m.readLog(), reloaded) == before {
		if time.Now().After(deadline) {
			tb.Fatalf("mqtttest: mosquitto did not reload its configuration on SIGHUP\n%s", m.readLog())
		}
		time.Sleep(10 * time.Millisecond) // polling a log file; there is nothing to wait on
	}
}

// Kill stops Mosquitto with SIGKILL, as a crash would: it saves nothing on
// the way out, so Start brings it back with its last autosave (or nothing).
func (m *Mosquitto) Kill(tb testing.TB) {
	tb.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil {
		return
	}
	cmd, exited := m.cmd, m.exited
	m.cmd, m.exited = nil, nil
	_ = cmd.Process.Kill()
	<-exited
}

func (m *Mosquitto) readLog() string {
	b, err := os.ReadFile(m.logPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return string(b)
}

func (m *Mosquitto) dumpLog(tb testing.TB) {
	tb.Logf("mosquitto log (%s):\n%s", m.logPath, m.readLog())
}
