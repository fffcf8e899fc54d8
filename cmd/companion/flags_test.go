package main

import (
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker/embedded"
	"github.com/devicecompanion/companion/internal/mqtttest"
	"github.com/devicecompanion/companion/internal/testenv"
)

// procExit runs bin with args (and env added to procEnv's) until it
// exits, and returns its exit status and what it wrote. A process that
// starts instead (it writes started) took args: it is killed, and the
// status is -1.
func procExit(tb testing.TB, started string, env []string, bin string, args ...string) (int, string) {
	tb.Helper()
	var out testenv.Buffer
	up := newLogSignal(started)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(procEnv(), env...)
	cmd.Stdout = io.MultiWriter(&out, up)
	cmd.Stderr = cmd.Stdout
	require.NoError(tb, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode(), out.String()
		}
		require.NoError(tb, err)
		return 0, out.String()
	case <-up.seen:
		_ = cmd.Process.Kill()
		<-exited
		return -1, out.String()
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		tb.Fatalf("%s %q neither exited nor started within 60 s:\n%s", bin, args, out.String())
		return 0, ""
	}
}

// A flag the command line gets wrong, or a value the server cannot run
// with, ends `companion` with a message naming the flag and exit status 2,
// before anything starts: never a start with a default in the value's
// place, nor exit status 1.
func TestBadFlagsAreUsageErrors(t *testing.T) {
	companion, bridge := procBinaries(t)
	const serverUp, bridgeUp = "companion: HTTP API on", "companion-bridge starting"
	port := fmt.Sprint(testenv.FreePort(t))
	for _, tc := range []struct {
		name string
		args []string // after serve --http 127.0.0.1:0 --data DIR (--mqtt-listen 127.0.0.1:0 without --mqtt-url)
		want string   // in the output
	}{
		{"unknown flag", []string{"--bogus"}, "-bogus"},
		{"value not a duration", []string{"--retention", "a month"}, "-retention"},
		{"value not a number", []string{"--max-text-bytes", "lots"}, "-max-text-bytes"},
		{"retention under a day", []string{"--retention", "1h"}, "--retention"},
		{"retention zero", []string{"--retention", "0s"}, "--retention"},
		{"expiry grace zero", []string{"--expiry-grace", "0s"}, "--expiry-grace"},
		{"expiry grace negative", []string{"--expiry-grace", "-1m"}, "--expiry-grace"},
		{"text limit zero", []string{"--max-text-bytes", "0"}, "--max-text-bytes"},
		{"image limit negative", []string{"--max-image-bytes", "-1"}, "--max-image-bytes"},
		// Before, a limit near int64's end wrapped the body limit worked
		// out from it: texts past 64 KiB, or every image, were refused.
		{"text limit past 1 TiB", []string{"--max-text-bytes", "9223372036854775807"}, "--max-text-bytes 9223372036854775807: must be at most"},
		{"image limit past 1 TiB", []string{"--max-image-bytes", "1099511627777"}, "--max-image-bytes"},
		// Before, "bad --log-level", naming none of the levels it takes.
		{"log level unknown", []string{"--log-level", "loud"}, `--log-level "loud": give debug, info, warn or error`},
		{"open commands zero", []string{"--max-open-commands", "0"}, "--max-open-commands"},
		{"burst zero", []string{"--rate-burst", "0"}, "--rate-burst"},
		{"rate negative", []string{"--rate-per-token", "-3"}, "--rate-per-token"},
		{"register rate negative", []string{"--register-per-minute", "-5"}, "--register-per-minute"},
		{"unauthenticated rate negative", []string{"--unauth-per-minute", "-1"}, "--unauth-per-minute"},
		{"report rate negative", []string{"--report-rate", "-1"}, "--report-rate"},
		{"streams per user negative", []string{"--max-streams-per-user", "-1"}, "--max-streams-per-user"},
		{"waits per user negative", []string{"--max-waits-per-user", "-2"}, "--max-waits-per-user"},
		{"report burst zero", []string{"--report-burst", "0"}, "--report-burst"},
		{"clock skew zero", []string{"--oidc-clock-skew", "0s"}, "--oidc-clock-skew"},
		{"issuer without audience", []string{"--oidc-issuer", "https://id.example.com"}, "--oidc-audience"},
		{"embedded and external broker", []string{"--mqtt-listen", "127.0.0.1:0", "--mqtt-url", "tcp://127.0.0.1:1"}, "--mqtt-listen"},
		// Flags of the other kind of broker did nothing, silently.
		{"broker account with the embedded broker", []string{"--mqtt-username", "srv", "--mqtt-password", "pw"}, "--mqtt-username"},
		{"broker CA with the embedded broker", []string{"--mqtt-ca", "ca.pem"}, "--mqtt-ca"},
		{"dynsec with the embedded broker", []string{"--mqtt-dynsec=false"}, "--mqtt-dynsec"},
		{"pinned client ids with the embedded broker", []string{"--mqtt-pin-client-ids"}, "--mqtt-pin-client-ids"},
		{"embedded broker's certificate with another broker", []string{"--mqtt-url", "tcp://127.0.0.1:1", "--mqtt-dynsec=false", "--mqtt-tls-cert", "c.pem", "--mqtt-tls-key", "k.pem"}, "--mqtt-tls-cert"},
		// Pinned client ids without the driver that pins them: before, the
		// server started, and any client id was taken.
		{"pinned client ids without dynsec", []string{"--mqtt-url", "tcp://127.0.0.1:1", "--mqtt-dynsec=false", "--mqtt-pin-client-ids"}, "--mqtt-pin-client-ids"},
		{"pinned client ids with the NATS callout", []string{"--mqtt-url", "tcp://127.0.0.1:1", "--nats-callout", "nats://127.0.0.1:1", "--mqtt-pin-client-ids"}, "--mqtt-pin-client-ids"},
		// The callout's flags without --nats-callout: before, the server
		// started, and answered no authorization.
		{"NATS callout account without the callout", []string{"--mqtt-url", "tcp://127.0.0.1:1", "--mqtt-dynsec=false", "--nats-callout-user", "auth", "--nats-callout-password", "pw"}, "--nats-callout-user"},
		{"NATS issuer seed without the callout", []string{"--mqtt-url", "tcp://127.0.0.1:1", "--mqtt-dynsec=false", "--nats-issuer-seed", "seed.nk"}, "--nats-issuer-seed"},
		{"credentials in the broker URL", []string{"--mqtt-url", "tcp://srv:s3cret-pw@127.0.0.1:1", "--mqtt-dynsec=false"}, "--mqtt-username"},
		{"credentials in a broker URL of a list", []string{"--mqtt-url", "tcp://127.0.0.1:1,srv:s3cret-pw@127.0.0.1:2", "--mqtt-dynsec=false"}, "--mqtt-username"},
		{"broker URL without a port", []string{"--mqtt-url", "tcp://127.0.0.1", "--mqtt-dynsec=false"}, "needs a host and a port"},
		{"broker URL of another scheme", []string{"--mqtt-url", "http://127.0.0.1:1", "--mqtt-dynsec=false"}, "scheme \"http\""},
		// A listen address net.Listen could never take: before, a listen
		// error of exit status 1 ("HTTP listen: … missing port in
		// address", naming no flag).
		{"HTTP address without a port", []string{"--http", "127.0.0.1"}, "--http"},
		// Before, an empty one served the API on every interface, on a
		// port net.Listen picked.
		{"HTTP address empty", []string{"--http", ""}, "--http is empty"},
		// Before, "mkdir : no such file or directory", exit status 1.
		{"data directory empty", []string{"--data", ""}, "--data is empty"},
		{"embedded broker port out of range", []string{"--mqtt-listen", "127.0.0.1:99999"}, "--mqtt-listen"},
		{"metrics address without a port", []string{"--metrics", "localhost"}, "--metrics"},
		// Two listeners on one port: before, the later one failed "address
		// already in use", exit status 1, as if another process held it.
		{"metrics and pprof on one port", []string{"--metrics", "127.0.0.1:" + port, "--pprof", "127.0.0.1:" + port}, `--metrics "127.0.0.1:` + port + `" and --pprof`},
		{"HTTP and metrics on one port", []string{"--http", "127.0.0.1:" + port, "--metrics", ":" + port}, "--http"},
		// Before, "give an https:// URL", though an http:// one is taken.
		{"issuer not a URL", []string{"--oidc-issuer", "id.example.com", "--oidc-audience", "companion"}, `--oidc-issuer "id.example.com": give an https:// (or http://) URL`},
		{"JWKS URL not a URL", []string{"--oidc-issuer", "https://id.example.com", "--oidc-audience", "companion", "--oidc-jwks-url", "keys.json"}, "--oidc-jwks-url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"serve", "--http", "127.0.0.1:0", "--data", t.TempDir(), "--log-level", "info"}
			if !slices.Contains(tc.args, "--mqtt-url") {
				args = append(args, "--mqtt-listen", "127.0.0.1:0")
			}
			code, out := procExit(t, serverUp, nil, companion, append(args, tc.args...)...)
			assert.Equal(t, 2, code, "companion %q: exit status (-1: it started)\n%s", tc.args, out)
			assert.Contains(t, out, tc.want)
			assert.NotContains(t, out, "s3cret-pw", "the password of the broker URL")
			assert.NotContains(t, out, "goroutine ")
		})
	}
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"admin: unknown flag", []string{"user", "create", "alice", "--bogus"}},
		{"wait: value not a duration", []string{"command", "wait", "dev-1", "0190a000-0000-7000-8000-000000000000", "--token", "t", "--timeout", "soon"}},
		{"wait: timeout negative", []string{"command", "wait", "dev-1", "0190a000-0000-7000-8000-000000000000", "--token", "t", "--timeout", "-5s"}},
		{"migrate: unknown flag", []string{"migrate", "--bogus"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out := procExit(t, serverUp, nil, companion, tc.args...)
			assert.Equal(t, 2, code, "companion %q: exit status\n%s", tc.args, out)
		})
	}
	t.Run("bridge: credentials in the broker URL", func(t *testing.T) {
		code, out := procExit(t, bridgeUp, nil, bridge, "--mqtt-url", "tcp://b1:s3cret-pw@127.0.0.1:1",
			"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1", "--data", t.TempDir())
		assert.Equal(t, 2, code, "exit status (-1: it started)\n%s", out)
		assert.Contains(t, out, "--bridge-secret")
		assert.NotContains(t, out, "s3cret-pw", "the password of the broker URL")
	})
	// Before, an --api-url without a scheme ended the bridge once it ran,
	// exit status 1, with "agent: invalid API URL"; one of another scheme
	// was taken, to fail each blob download.
	for _, apiURL := range []string{"127.0.0.1:8080", "ftp://127.0.0.1:8080"} {
		t.Run("bridge: API URL "+apiURL, func(t *testing.T) {
			code, out := procExit(t, bridgeUp, []string{"COMPANION_API_URL=" + apiURL}, bridge, "--mqtt-url", "tcp://127.0.0.1:1",
				"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1", "--data", t.TempDir())
			assert.Equal(t, 2, code, "exit status (-1: it started)\n%s", out)
			assert.Contains(t, out, "--api-url")
		})
	}
}

// A CA bundle that cannot be read is named by its flag: before, the
// server ended with "companion: open FILE: no such file or directory"
// and the bridge with the same, neither saying which flag gave the file.
// It is a usage error, exit status 2, which systemd does not restart
// (bug 404; it was 1).
func TestMissingCAFileNamesItsFlag(t *testing.T) {
	companion, bridge := procBinaries(t)
	missing := filepath.Join(t.TempDir(), "missing-ca.pem")
	code, out := procExit(t, "companion: HTTP API on", nil, companion, "serve", "--http", "127.0.0.1:0", "--data", t.TempDir(),
		"--mqtt-url", "mqtts://127.0.0.1:1", "--mqtt-dynsec=false", "--mqtt-ca", missing)
	assert.Equal(t, 2, code, "exit status (-1: it started)\n%s", out)
	assert.Contains(t, out, "--mqtt-ca: open "+missing)
	code, out = procExit(t, "connecting", nil, bridge, "--mqtt-url", "mqtts://127.0.0.1:1", "--ca", missing,
		"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1", "--data", t.TempDir())
	assert.Equal(t, 2, code, "exit status (-1: it started)\n%s", out)
	assert.Contains(t, out, "--ca: open "+missing)
}

// -h (or --help) after a command prints that command's flags and exits 0,
// as the flag package's own ExitOnError does: asking for help is not a
// mistake, and a script that runs "companion serve -h" to read the flags
// should not see a failure.
func TestHelpExitsZero(t *testing.T) {
	companion, bridge := procBinaries(t)
	for _, tc := range []struct {
		bin  string
		args []string
		want string // a flag the help names
	}{
		{companion, []string{"serve", "-h"}, "-mqtt-listen"},
		{companion, []string{"serve", "--help"}, "-mqtt-listen"},
		{companion, []string{"user", "create", "-h"}, "-api-url"},
		{companion, []string{"user", "--help"}, "companion user create NAME"},
		{companion, []string{"device", "-h"}, "companion device assign ID"},
		{companion, []string{"command", "wait", "-h"}, "-timeout"},
		{companion, []string{"migrate", "-h"}, "-store"},
		{companion, []string{"-h"}, "companion serve"},
		{bridge, []string{"-h"}, "-bridge-id"},
	} {
		t.Run(filepath.Base(tc.bin)+" "+strings.Join(tc.args, " "), func(t *testing.T) {
			code, out := procExit(t, "starting", nil, tc.bin, tc.args...)
			assert.Equal(t, 0, code, "exit status\n%s", out)
			assert.Contains(t, out, tc.want)
		})
	}
}

// --mqtt-listen on the command line wins over COMPANION_MQTT_URL in the
// environment (a flag wins over the environment, also over the variable
// of the other flag of the pair): the server runs its embedded broker
// there. From the environment both, --mqtt-url wins, as the packaging's
// files have it (COMPANION_MQTT_LISTEN always, COMPANION_MQTT_URL for an
// external broker).
func TestMQTTListenOnTheCommandLineWinsOverTheEnvironment(t *testing.T) {
	companion, _ := procBinaries(t)
	listen := "127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(t))
	elsewhere := "tcp://127.0.0.1:" + strconv.Itoa(mqtttest.FreePort(t))
	code, out := procExit(t, "companion: HTTP API on", []string{"COMPANION_MQTT_URL=" + elsewhere}, companion,
		"serve", "--http", "127.0.0.1:0", "--data", t.TempDir(), "--mqtt-listen", listen)
	require.Equal(t, -1, code, "companion did not start:\n%s", out)
	assert.Contains(t, out, "MQTT on tcp://"+listen+",", "the start-up line")

	code, out = procExit(t, "companion: HTTP API on", []string{"COMPANION_MQTT_URL=" + elsewhere, "COMPANION_MQTT_LISTEN=" + listen}, companion,
		"serve", "--http", "127.0.0.1:0", "--data", t.TempDir())
	require.Equal(t, -1, code, "companion did not start:\n%s", out)
	assert.True(t, strings.Contains(out, "MQTT on "+elsewhere+","), "the start-up line: want the external broker\n%s", out)
}

// --max-text-bytes above what the JSON body limit (64 KiB) holds takes
// texts up to it, escaped as JSON at its longest too (six bytes for each
// of "<"): the body of a text push has room for the text and title the
// limits allow. (api/openapi.json has the default limits, and this client
// does not check against it; the server serves the document with its own,
// docs/reliability.md, bug 262.)
func TestTextLimitAboveTheJSONBodyLimit(t *testing.T) {
	m := startServer(t, Config{Limits: api.Limits{MaxTextBytes: 100_000, MaxTitleBytes: 1000}})
	f := setupFleet(t, m, "dev-1")
	user := &client{tb: t, base: m.APIURL(), token: f.user.token}
	r := user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	for _, text := range []string{strings.Repeat("a", 100_000), strings.Repeat("<", 100_000)} {
		r = user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": text, "title": strings.Repeat("<", 1000)})
		assert.Equal(t, 202, r.Status, "a text of %d bytes: %.300s", len(text), r.Body)
	}
	r = user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": strings.Repeat("a", 100_001)})
	assert.Equal(t, 422, r.Status, "over --max-text-bytes: %.300s", r.Body)
}

// Each limit of CONTRACT §6 has its flag, also read from the environment,
// and a value given reaches the api.Limits the server runs with: none is
// left at its default. Without any, the limits are api.DefaultLimits; the
// rate limits' 0 is "no limit" (api.Limits' negative).
func TestLimitFlagsReachTheLimits(t *testing.T) {
	var cfg Config
	require.NoError(t, parseFlags(newServeFlags(&cfg), nil))
	cfg.fromFlags()
	d := api.DefaultLimits
	assert.Equal(t, api.Limits{
		MaxTextBytes: d.MaxTextBytes, MaxTitleBytes: d.MaxTitleBytes, MaxImageBytes: d.MaxImageBytes, MaxImageSide: d.MaxImageSide,
		MaxAppBytes: d.MaxAppBytes, MaxFirmwareBytes: d.MaxFirmwareBytes, MaxOpenCommands: d.MaxOpenCommands,
		RequestsPerSecond: d.RequestsPerSecond, RequestBurst: d.RequestBurst, RegisterPerMinute: d.RegisterPerMinute,
		UnauthPerMinute: d.UnauthPerMinute, MaxStreamsPerUser: d.MaxStreamsPerUser, MaxWaitsPerUser: d.MaxWaitsPerUser,
		MaxBridgesPerUser: d.MaxBridgesPerUser, MaxBodyBytesPerUser: d.MaxBodyBytesPerUser,
	}, cfg.Limits, "the defaults")
	assert.Equal(t, embedded.DefaultMaxSessions, cfg.MQTTSessionsPerAccount, "the embedded broker's sessions per account")

	t.Setenv("COMPANION_MAX_FIRMWARE_BYTES", "7000")
	t.Setenv("COMPANION_RATE_BURST", "9")
	cfg = Config{}
	require.NoError(t, parseFlags(newServeFlags(&cfg), []string{
		"--max-text-bytes", "1001", "--max-title-bytes", "1002", "--max-image-bytes", "1003", "--max-image-side", "1004",
		"--max-app-bytes", "1005", "--max-open-commands", "1006", "--rate-per-token", "2.5",
		"--register-per-minute", "0", "--max-bridges-per-user", "7", "--max-body-bytes-per-user", "0",
		"--mqtt-sessions-per-account", "5",
	}))
	require.NoError(t, cfg.checkFlags(nil))
	cfg.fromFlags()
	assert.Equal(t, api.Limits{
		MaxTextBytes: 1001, MaxTitleBytes: 1002, MaxImageBytes: 1003, MaxImageSide: 1004,
		MaxAppBytes: 1005, MaxFirmwareBytes: 7000, MaxOpenCommands: 1006,
		RequestsPerSecond: 2.5, RequestBurst: 9, RegisterPerMinute: -1,
		UnauthPerMinute: d.UnauthPerMinute, MaxStreamsPerUser: d.MaxStreamsPerUser, MaxWaitsPerUser: d.MaxWaitsPerUser,
		MaxBridgesPerUser: 7, MaxBodyBytesPerUser: -1,
	}, cfg.Limits, "as given")
	assert.Equal(t, 5, cfg.MQTTSessionsPerAccount)
}
