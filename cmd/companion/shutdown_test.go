package main

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
)

// A shutdown answers the requests held by Prefer: wait at once, with a
// 202 and the command as when their time runs out, and ends cleanly:
// Close does not wait out the HTTP server's shutdown limit for them and
// fail with its deadline (the process would exit with status 1).
func TestShutdownAnswersHeldWaits(t *testing.T) {
	m := startServer(t, Config{})
	f := setupFleet(t, m, "dev-1") // no bridge: the command stays unfinished
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)

	type answer struct {
		status int
		body   []byte
		err    error
	}
	held := make(chan answer, 1)
	go func() {
		req, err := http.NewRequest("POST", m.APIURL()+"/api/v1/devices/dev-1/push/text", bytes.NewReader([]byte(`{"text":"hi"}`)))
		if err != nil {
			held <- answer{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+f.user.token)
		req.Header.Set("Prefer", "wait=60")
		resp, err := (&http.Client{Timeout: 90 * time.Second}).Do(req)
		if err != nil {
			held <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		held <- answer{resp.StatusCode, body, err}
	}()
	// Once the command is stored, its request is in the handler, which
	// holds it (or is about to: a Wait that starts after the shutdown
	// began answers at once too).
	testenv.Eventually(t, 10*time.Second, "the command stored", func() bool {
		r := f.user.do("GET", "/api/v1/devices/dev-1/commands", nil)
		return r.Status == 200 && len(r.JSON(t)["commands"].([]any)) == 1
	})

	require.NoError(t, m.Close(), "Close with a request held by Prefer: wait")
	select {
	case a := <-held:
		require.NoError(t, a.err)
		require.Equal(t, http.StatusAccepted, a.status, "%s", a.body)
		var cmd struct {
			ID    string `json:"id"`
			State string `json:"state"`
		}
		require.NoError(t, json.Unmarshal(a.body, &cmd))
		assert.NotEmpty(t, cmd.ID)
		assert.False(t, companion.IsFinal(cmd.State), "state %q", cmd.State)
	case <-time.After(60 * time.Second):
		t.Fatal("the held request got no answer")
	}
}

// The start-up line names the API's URL with its scheme: https with
// --tls-cert.
func TestServeStartupLineNamesTheScheme(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"plain", Config{}, "http://"},
		{"tls", Config{TLSCert: certFile, TLSKey: keyFile}, "https://"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := startServer(t, tc.cfg)
			line := m.startupLine()
			want := "HTTP API on " + tc.want + m.HTTPAddr() + ","
			assert.True(t, strings.Contains(line, want), "startupLine() = %q; want it to contain %q", line, want)
		})
	}
}

// A second SIGTERM while `companion serve` shuts down kills it at once,
// as Go's default does, instead of being swallowed while the shutdown
// waits for a request that does not end (here the download of a blob
// whose client reads no more: a stalled upload, which it was, is ended
// at once since bug 325).
func TestShutdownSecondSignalKills(t *testing.T) {
	c := newProcCluster(t, 0)
	c.serverArgs = []string{"--log-level", "info"} // for "shutting down"
	c.startServer()
	app := make([]byte, 12<<20) // more than the socket buffers hold
	rand.Read(app)
	admin := &client{tb: t, base: c.base(), token: c.adminToken}
	r := admin.do("PUT", "/api/v1/admin/apps/big/1.0.0", app)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	sum := sha256.Sum256(app)

	d := testenv.SmallWindow(4096)
	conn, err := d.Dial("tcp", c.httpAddr)
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprintf(conn, "GET /api/v1/blobs/%x HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n\r\n", sum, c.httpAddr, c.adminToken)
	require.NoError(t, err)
	// The answer begins: the handler writes the blob, which the client
	// does not read.
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(20*time.Second)))
	line, err := bufio.NewReader(conn).ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "HTTP/1.1 200"), "answer %q", line)

	require.NoError(t, c.server.cmd.Process.Signal(syscall.SIGTERM))
	testenv.Eventually(t, 20*time.Second, "shutting down", func() bool {
		b, _ := os.ReadFile(c.server.logPath)
		return strings.Contains(string(b), "shutting down")
	})
	require.NoError(t, c.server.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-c.server.exited:
	case <-time.After(60 * time.Second):
		t.Fatal("companion did not exit")
	}
	var ee *exec.ExitError
	require.ErrorAs(t, c.server.waitErr, &ee)
	ws, ok := ee.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	assert.True(t, ws.Signaled() && ws.Signal() == syscall.SIGTERM, "exit after the second SIGTERM: %v, want killed by it", c.server.waitErr)
}

// Served on every address (--http 0.0.0.0:PORT, --mqtt-listen 0.0.0.0:PORT),
// the start-up line, demo.json's api_url and the quick start's lines name
// the loopback address, 127.0.0.1, as its mosquitto_sub line does: a
// user pastes them, and http://[::]:PORT is no address to send a request
// to (docs/reliability.md, bug 306).
func TestServeOnEveryAddressPrintsLoopback(t *testing.T) {
	m := startServer(t, Config{HTTP: "0.0.0.0:0", MQTTListen: "0.0.0.0:0", Demo: true})
	_, httpPort, err := net.SplitHostPort(m.HTTPAddr())
	require.NoError(t, err)
	_, mqttPort, err := net.SplitHostPort(m.MQTT.Addr())
	require.NoError(t, err)
	api := "http://127.0.0.1:" + httpPort

	line := m.startupLine()
	assert.Contains(t, line, "HTTP API on "+api+",", "the start-up line")
	assert.Contains(t, line, "MQTT on tcp://127.0.0.1:"+mqttPort+",", "the start-up line")

	b, err := os.ReadFile(filepath.Join(m.Config.Data, "demo.json"))
	require.NoError(t, err)
	var f DemoFile
	require.NoError(t, json.Unmarshal(b, &f))
	assert.Equal(t, api, f.APIURL, "demo.json's api_url")

	var out bytes.Buffer
	m.Demo.PrintQuickStart(&out)
	text := out.String()
	assert.NotContains(t, text, "[::]", "the quick start")
	assert.NotContains(t, text, "0.0.0.0", "the quick start")
	assert.Contains(t, text, "curl -s "+api+"/api/v1/devices ", "the quick start")
	assert.Contains(t, text, "mosquitto_sub -h 127.0.0.1 -p "+mqttPort+" ", "the quick start")
}

// A request still answering when the HTTP server's shutdown runs out of
// grace (the download of a blob its client does not read) has its
// connection closed, and its handler returns before the brokers and the
// store are closed; Close does not fail for it. Close returned the
// shutdown's deadline and went on to close the store, and the handler
// went on writing the blob, its connection open, after Close returned.
// docs/reliability.md, bug 356.
func TestShutdownClosesWhatOutlivesItsGrace(t *testing.T) {
	m := startServer(t, Config{})
	m.shutdownGrace = 500 * time.Millisecond
	app := make([]byte, 12<<20) // more than the socket buffers hold
	rand.Read(app)
	admin := newClient(t, m, m.AdminToken())
	r := admin.do("PUT", "/api/v1/admin/apps/big/1.0.0", app)
	require.Equal(t, 201, r.Status, "%s", r.Body)
	sum := sha256.Sum256(app)

	d := testenv.SmallWindow(4096)
	conn, err := d.Dial("tcp", m.HTTPAddr())
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprintf(conn, "GET /api/v1/blobs/%x HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n\r\n", sum, m.HTTPAddr(), m.AdminToken())
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(20*time.Second)))
	rd := bufio.NewReader(conn)
	line, err := rd.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "HTTP/1.1 200"), "answer %q", line)

	assert.NoError(t, m.Close(), "Close with a download its client does not read")
	// What comes now is what the sockets' buffers held as the connection
	// was closed, not the rest of the blob.
	n, err := io.Copy(io.Discard, rd)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "the download's connection is still open after Close: %v", err)
	assert.Less(t, n, int64(len(app)), "bytes of the blob sent after Close returned, the store closed")
}
