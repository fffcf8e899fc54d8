package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// testCA is a certificate authority a test makes for itself.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(tb testing.TB) *testCA {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(tb, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "companion test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		KeyUsage:              x509.KeyUsageCertSign,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(tb, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(tb, err)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate for 127.0.0.1 and localhost and its key into
// dir, returning their paths.
func (ca *testCA) issue(tb testing.TB, dir string) (certFile, keyFile string) {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(tb, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	require.NoError(tb, err)
	kder, err := x509.MarshalECPrivateKey(key)
	require.NoError(tb, err)
	certFile, keyFile = filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	chain := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), ca.pem...)
	require.NoError(tb, os.WriteFile(certFile, chain, 0o600))
	require.NoError(tb, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600))
	return certFile, keyFile
}

func (ca *testCA) client() *http.Client {
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.TLSClientConfig = &tls.Config{RootCAs: pool}
	return &http.Client{Transport: t, Timeout: 40 * time.Second}
}

// The HTTP API over TLS, with the demo bridge fetching blobs over HTTPS.
func TestHTTPSWithDemo(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	m := startServer(t, Config{Demo: true, TLSCert: certFile, TLSKey: keyFile})
	require.True(t, strings.HasPrefix(m.APIURL(), "https://"))
	hc := ca.client()

	f := m.Demo.File
	dev := f.Devices[0]
	do := func(method, path, body string, headers ...string) (int, map[string]any) {
		t.Helper()
		req, err := http.NewRequest(method, m.APIURL()+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+f.Token)
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		resp, err := hc.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var v map[string]any
		json.NewDecoder(resp.Body).Decode(&v)
		return resp.StatusCode, v
	}
	code, _ := do("POST", "/api/v1/devices/register", `{"device_id":"`+dev.DeviceID+`","claim_code":"`+dev.ClaimCode+`"}`)
	require.Equal(t, 201, code)
	img := base64.StdEncoding.EncodeToString(pngImage(t, 16, 16))
	code, cmd := do("POST", "/api/v1/devices/"+dev.DeviceID+"/push/image", `{"image":"`+img+`"}`, "Prefer", "wait=30")
	require.Equal(t, 200, code, "%v", cmd)
	assert.Equal(t, "succeeded", cmd["state"], "the bridge fetched the image over HTTPS: %v", cmd)

	// Plain HTTP to the TLS port gets nothing useful.
	resp, err := http.Get("http://" + m.HTTPAddr() + "/healthz")
	if err == nil {
		assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
		resp.Body.Close()
	}
	// A client that does not trust the CA is refused.
	_, err = http.Get(m.APIURL() + "/healthz")
	assert.Error(t, err)
}

func TestTLSFlagsGoTogether(t *testing.T) {
	m := NewMain(Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: t.TempDir(), AdminToken: "x", TLSCert: "a.crt", TopicPrefix: "companion/v1"}, testLogger(t))
	err := m.Run(t.Context())
	m.Close()
	var ue usageError
	assert.ErrorAs(t, err, &ue)
}

// Every operation with both hops encrypted: the API over HTTPS and MQTT
// over mqtts:// (the embedded broker with --mqtt-tls-cert), the bridge
// verifying both with the test's CA, as companion-bridge --ca does.
func TestEveryOperationOverTLS(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	m := startServer(t, Config{TLSCert: certFile, TLSKey: keyFile, MQTTTLSCert: certFile, MQTTTLSKey: keyFile})
	require.True(t, strings.HasPrefix(m.MQTTURL(), "mqtts://"), m.MQTTURL())
	pool := x509.NewCertPool()
	pool.AddCert(ca.cert)
	tlsClients.Store(m, &testTLS{http: ca.client(), mqtt: &tls.Config{RootCAs: pool}})
	t.Cleanup(func() { tlsClients.Delete(m) })

	f := setupFleet(t, m, "dev-1")
	b := startBridge(t, m, m.MQTTURL(), f, "", "dev-1")
	exerciseEveryOperation(t, f, b, "dev-1")

	// Plain MQTT to the TLS port gets nowhere.
	o := mqtt.NewClientOptions().AddBroker("tcp://" + m.MQTT.Addr()).SetClientID("plain").
		SetUsername(f.bridgeID).SetPassword(f.bridgeSecret).SetConnectTimeout(2 * time.Second)
	c := mqtt.NewClient(o)
	assert.Error(t, mqtt.WaitTokenTimeout(c.Connect(), 5*time.Second))
	c.Disconnect(0)
}

// With --tls-cert and --mqtt-tls-cert the demo's quick start works as
// printed too: its curl lines and its mosquitto_sub line trust the
// server's certificates, which no system trusts (a private CA's, or
// self-signed ones); and its mosquitto_sub line watches the topics of
// --topic-prefix.
func TestDemoQuickStartWorksOverTLS(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("mosquitto_sub"); err != nil {
		t.Fatal("mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
	}
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	m := startServer(t, Config{Demo: true, TLSCert: certFile, TLSKey: keyFile, MQTTTLSCert: certFile, MQTTTLSKey: keyFile, TopicPrefix: "acme/v1"})
	demoQuickStartWorks(t, m, 10) // the first binds sim-001 to the demo user

	var out bytes.Buffer
	m.Demo.PrintQuickStart(&out)
	var sub string
	for _, l := range strings.Split(out.String(), "\n") {
		if l = strings.TrimSpace(l); strings.HasPrefix(l, "mosquitto_sub ") {
			sub = l
		}
	}
	require.NotEmpty(t, sub, "%s", out.String())
	// The device's retained status and settings are there at once.
	b, err := exec.Command("sh", "-c", sub+" -C 1 -W 20").CombinedOutput()
	require.NoError(t, err, "%s: %s", sub, b)
	assert.True(t, strings.HasPrefix(string(b), "acme/v1/devices/sim-001/"), "%s: %s", sub, b)
}

// The CLI's commands that call the API verify a server whose certificate
// a private CA issued with --ca. Before, only SSL_CERT_FILE did, for the
// whole process (bug 246). A --ca that would do nothing, or that holds no
// certificate, is a usage error.
func TestCLIVerifiesTheServerWithCA(t *testing.T) {
	ca := newTestCA(t)
	dir := t.TempDir()
	certFile, keyFile := ca.issue(t, dir)
	caFile := filepath.Join(dir, "ca.pem")
	require.NoError(t, os.WriteFile(caFile, ca.pem, 0o600))
	m := startServer(t, Config{TLSCert: certFile, TLSKey: keyFile})
	api := m.APIURL()
	require.True(t, strings.HasPrefix(api, "https://"), api)
	cli := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := run(context.Background(), args, &out, io.Discard)
		return out.String(), err
	}

	out, err := cli("user", "create", "bob", "--api-url", api, "--admin-token", m.AdminToken(), "--ca", caFile)
	require.NoError(t, err)
	var u map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &u), out)
	_, err = cli("user", "create", "eve", "--api-url", api, "--admin-token", m.AdminToken())
	assert.ErrorContains(t, err, "certificate", "without --ca, the system's roots")

	// command wait reaches the server, which knows no such command.
	_, err = cli("command", "wait", "dev-1", uuid.NewString(), "--api-url", api, "--token", u["token"].(string), "--ca", caFile)
	assert.ErrorContains(t, err, "404")

	var ue usageError
	_, err = cli("user", "create", "carol", "--api-url", "http://"+m.HTTPAddr(), "--admin-token", m.AdminToken(), "--ca", caFile)
	require.ErrorAs(t, err, &ue, "--ca with http://")
	assert.ErrorContains(t, err, "--ca")
	_, err = cli("command", "wait", "dev-1", uuid.NewString(), "--api-url", api, "--token", "x", "--ca", keyFile)
	require.ErrorAs(t, err, &ue, "--ca of no certificate")
	assert.ErrorContains(t, err, "no PEM certificates")
}

// A TLS handshake that a client gives up (a phone whose link dropped, a
// load balancer's TCP health check: connect and close) is logged at
// debug, not as a warning: each was a WARN "http: TLS handshake error
// from …: EOF", and an operator's log filled with them. The server's
// other errors are still warnings. docs/reliability.md, bug 323.
func TestTLSHandshakeDroppedIsNotAWarning(t *testing.T) {
	ca := newTestCA(t)
	certFile, keyFile := ca.issue(t, t.TempDir())
	logs := &logCapture{}
	m := startServerWithLog(t, Config{TLSCert: certFile, TLSKey: keyFile}, logs)

	conn, err := net.Dial("tcp", m.HTTPAddr())
	require.NoError(t, err)
	require.NoError(t, conn.Close())
	handshake := func() (capturedRecord, bool) {
		l := logs.logs()
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, r := range l.records {
			if strings.Contains(r.msg, "TLS handshake error") {
				return r, true
			}
		}
		return capturedRecord{}, false
	}
	require.Eventually(t, func() bool { _, ok := handshake(); return ok }, 10*time.Second, 10*time.Millisecond, "no log of the handshake")
	r, _ := handshake()
	assert.Equal(t, slog.LevelDebug, r.level, "%q", r.msg)

	// The server still answers over TLS.
	resp, err := ca.client().Get(m.APIURL() + "/healthz")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)

	// Its other errors are warnings.
	m.srv.ErrorLog.Printf("http: Accept error: %v; retrying in %v", "too many open files", time.Second)
	assert.True(t, logs.has(slog.LevelWarn, "http: Accept error: too many open files; retrying in 1s", "", ""))
}
