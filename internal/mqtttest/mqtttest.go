// Package mqtttest holds test helpers for every package that talks MQTT: a
// free TCP port, and a real Mosquitto started from the repository's own
// mosquitto.conf with accounts and ACLs of the test's choosing.
//
// It is for tests only; nothing outside _test.go files should import it.
package mqtttest

import (
	"bufio"
	"bytes"
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

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. Some
// other process may take it before the caller binds it; for servers that can
// listen on port 0 and report their address, prefer that.
func FreePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("mqtttest: find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// MosquittoAccount is an account to create in a test Mosquitto.
type MosquittoAccount struct {
	Username, Password string
	// ACL holds acl_file lines for this user, such as
	// "topic readwrite companion/v1/#" or "topic read companion/v1/devices/+/commands/#".
	ACL []string
}

// Mosquitto is a Mosquitto broker run for one test, from the repository's
// mosquitto.conf. Start it with StartMosquitto; it is stopped when the test
// ends.
type Mosquitto struct {
	// URL is where clients connect: tcp://127.0.0.1:PORT.
	URL string
	// Dir holds the configuration, password and ACL files, the persistence
	// database and the log (mosquitto.log).
	Dir string
	// Port is the TCP port it listens on; it stays the same across Stop and
	// Start.
	Port int

	bin      string
	passwd   string
	confPath string
	logPath  string

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
// 127.0.0.1 and waits until it accepts connections. The test is skipped when
// Mosquitto is not installed, unless the CI environment variable is set: in
// CI it fails instead. Mosquitto is stopped (SIGTERM, then waited for) when
// the test ends; if the test failed, its log is printed.
func StartMosquitto(tb testing.TB, accounts ...MosquittoAccount) *Mosquitto {
	tb.Helper()
	bin := findBinary("mosquitto")
	passwd := findBinary("mosquitto_passwd")
	if bin == "" || passwd == "" {
		if os.Getenv("CI") == "" {
			tb.Skip("mqtttest: mosquitto or mosquitto_passwd not installed")
		}
		tb.Fatal("mqtttest: mosquitto or mosquitto_passwd not installed (required in CI)")
	}
	src, err := repoConf()
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	m := &Mosquitto{
		Dir:    tb.TempDir(),
		Port:   FreePort(tb),
		bin:    bin,
		passwd: passwd,
	}
	m.URL = "tcp://127.0.0.1:" + strconv.Itoa(m.Port)
	m.confPath = filepath.Join(m.Dir, "mosquitto.conf")
	m.logPath = filepath.Join(m.Dir, "mosquitto.log")

	conf, err := rewriteConf(src, m.Port, m.Dir, m.logPath)
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	if err := os.WriteFile(m.confPath, conf, 0o600); err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	m.accounts = accounts
	if err := m.writeAccounts(); err != nil {
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

// repoConf reads the repository's mosquitto.conf, found beside go.mod by
// walking up from the working directory (a package's directory under go test).
func repoConf() ([]byte, error) {
	dir, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			b, err := os.ReadFile(filepath.Join(dir, "mosquitto.conf"))
			if err != nil {
				return nil, fmt.Errorf("read the repository's mosquitto.conf: %w", err)
			}
			return b, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return nil, errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// rewriteConf points a configuration at the test's port and directory. Each
// line is read as Mosquitto reads it (first word = option); the options that
// name a port, a path or the process's user are replaced, comments and
// everything else kept. A listener line with a port other than 1883 (the
// project's optional TLS listener) is dropped with the options that follow
// it up to the next listener, as they belong to it.
func rewriteConf(src []byte, port int, dir, logPath string) ([]byte, error) {
	var out bytes.Buffer
	sawListener, sawPersistLoc, sawPasswd, sawACL := false, false, false, false
	inDropped := false
	sc := bufio.NewScanner(bytes.NewReader(src))
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
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
		case "password_file":
			sawPasswd = true
			fmt.Fprintf(&out, "password_file %s\n", filepath.Join(dir, "passwd"))
		case "acl_file":
			sawACL = true
			fmt.Fprintf(&out, "acl_file %s\n", filepath.Join(dir, "acl"))
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
	case !sawPasswd:
		return nil, errors.New("mosquitto.conf has no password_file line")
	case !sawACL:
		return nil, errors.New("mosquitto.conf has no acl_file line")
	}
	fmt.Fprintf(&out, "log_dest file %s\n", logPath)
	// Run as whoever runs the test: as root, Mosquitto would otherwise switch
	// to the "mosquitto" user, who cannot write the test's directory.
	if os.Geteuid() == 0 {
		out.WriteString("user root\n")
	}
	return out.Bytes(), nil
}

// writeAccounts writes the password file (with mosquitto_passwd, which
// hashes) and the ACL file from m.accounts.
func (m *Mosquitto) writeAccounts() error {
	pw := filepath.Join(m.Dir, "passwd")
	if err := os.WriteFile(pw, nil, 0o600); err != nil {
		return err
	}
	var acl bytes.Buffer
	for _, a := range m.accounts {
		if a.Username == "" || strings.ContainsAny(a.Username, ": \t\n") {
			return fmt.Errorf("bad username %q", a.Username)
		}
		out, err := exec.Command(m.passwd, "-b", pw, a.Username, a.Password).CombinedOutput()
		if err != nil {
			return fmt.Errorf("mosquitto_passwd %s: %v: %s", a.Username, err, out)
		}
		fmt.Fprintf(&acl, "user %s\n", a.Username)
		for _, l := range a.ACL {
			acl.WriteString(l + "\n")
		}
		acl.WriteString("\n")
	}
	return os.WriteFile(filepath.Join(m.Dir, "acl"), acl.Bytes(), 0o600)
}

// AddAccount adds an account to the running broker: it rewrites the password
// and ACL files, sends SIGHUP so Mosquitto reloads them, and returns once the
// new account can connect.
func (m *Mosquitto) AddAccount(tb testing.TB, a MosquittoAccount) {
	tb.Helper()
	m.mu.Lock()
	m.accounts = append(m.accounts, a)
	err := m.writeAccounts()
	cmd := m.cmd
	m.mu.Unlock()
	if err != nil {
		tb.Fatalf("mqtttest: %v", err)
	}
	if cmd == nil {
		return // not running: Start reads the files
	}
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		tb.Fatalf("mqtttest: SIGHUP mosquitto: %v", err)
	}
	deadline := time.Now().Add(startTimeout)
	for {
		err := m.tryConnect(a.Username, a.Password)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("mqtttest: account %q cannot connect after SIGHUP: %v", a.Username, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a reload; there is nothing to wait on
	}
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
