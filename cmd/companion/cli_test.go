package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/mcuboot"
)

// The admin CLI is a client of the admin API of a running server.
func TestAdminCLI(t *testing.T) {
	m := startServer(t, Config{})
	api := "http://" + m.HTTPAddr()
	cli := func(args ...string) map[string]any {
		t.Helper()
		var out, errOut bytes.Buffer
		err := run(context.Background(), append(args, "--api-url", api, "--admin-token", m.AdminToken()), &out, &errOut)
		require.NoError(t, err, "companion %v: %s", args, errOut.String())
		var v map[string]any
		require.NoError(t, json.Unmarshal(out.Bytes(), &v), "%s", out.String())
		return v
	}
	u := cli("user", "create", "bob")
	assert.Equal(t, "bob", u["name"])
	assert.NotEmpty(t, u["token"])
	u2 := cli("user", "token", u["user_id"].(string))
	assert.Equal(t, u["user_id"], u2["user_id"])
	assert.NotEmpty(t, u2["token"])
	assert.NotEqual(t, u["token"], u2["token"])
	u = u2
	cli("device", "provision", "watch-42", "--claim-code", "ABCD-EFGH-IJKL-MNOP", "--model", "sim-1")
	br := cli("bridge", "create", "kitchen")
	assert.NotEmpty(t, br["secret"])
	again := cli("bridge", "secret", "kitchen")
	assert.Equal(t, "kitchen", again["bridge_id"])
	assert.NotEmpty(t, again["secret"])
	assert.NotEqual(t, br["secret"], again["secret"])

	fw := filepath.Join(t.TempDir(), "fw.bin")
	img := firmwareImage(t, "1.2.0", 1000)
	require.NoError(t, os.WriteFile(fw, img, 0o600))
	got := cli("firmware", "publish", "--model", "sim-1", "--version", "1.2.0", fw)
	assert.EqualValues(t, len(img), got["size"])
	got = cli("app", "publish", "--app-id", "weather", "--version", "1.0.0", fw)
	assert.Len(t, got["sha256"], 64)

	// The user can now register the device.
	c := newClient(t, m, u["token"].(string))
	r := c.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "watch-42", "claim_code": "ABCD-EFGH-IJKL-MNOP"})
	assert.Equal(t, 201, r.Status, "%s", r.Body)

	// Mistakes are usage errors, and API errors are reported with their code.
	err := run(context.Background(), []string{"device", "provision", "x", "--api-url", api, "--admin-token", m.AdminToken()}, &bytes.Buffer{}, &bytes.Buffer{})
	var ue usageError
	assert.ErrorAs(t, err, &ue)
	err = run(context.Background(), []string{"device", "assign", "watch-42", "--bridge", "kitchen", "--none", "--api-url", api, "--admin-token", m.AdminToken()}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorAs(t, err, &ue)
	assert.ErrorContains(t, err, "--bridge ID or --none, not both")
	err = run(context.Background(), []string{"user", "create", "eve", "--api-url", api, "--admin-token", "wrong"}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorContains(t, err, "401")

	// Firmware that is not an MCUboot image of the version it is published
	// as is refused, and the CLI says which part is wrong: from its header
	// before the upload, and from the API's answer for the rest.
	raw := filepath.Join(t.TempDir(), "raw.bin")
	require.NoError(t, os.WriteFile(raw, bytes.Repeat([]byte{1}, 1000), 0o600))
	err = run(context.Background(), []string{"firmware", "publish", "--model", "sim-1", "--version", "1.3.0", raw, "--api-url", api, "--admin-token", m.AdminToken()}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorAs(t, err, &ue)
	assert.ErrorContains(t, err, "magic: 0x01010101 is not MCUboot's 0x96f3b83d")
	err = run(context.Background(), []string{"firmware", "publish", "--model", "sim-1", "--version", "1.3.0", fw, "--api-url", api, "--admin-token", m.AdminToken()}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorAs(t, err, &ue)
	assert.ErrorContains(t, err, "says 1.2.0")
	bad := filepath.Join(t.TempDir(), "bad.bin")
	require.NoError(t, os.WriteFile(bad, append(bytes.Clone(img[:len(img)-1]), img[len(img)-1]^1), 0o600))
	err = run(context.Background(), []string{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0", bad, "--api-url", api, "--admin-token", m.AdminToken()}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorContains(t, err, "422 validation_failed")
	assert.ErrorContains(t, err, "image.sha256: the SHA-256 of header, image and protected TLVs is")
}

// An id or version of a release that the API cannot take, and a FILE that
// is a directory, are usage errors naming what to fix, before anything is
// uploaded. Before, an --app-id or --model the API's path cannot hold
// (an upper-case app id, a space) was answered "404 not_found: no such
// resource" once the whole file was sent, and a directory failed in the
// middle of the request with "readfrom tcp …: read DIR: is a directory".
func TestAdminCLIPublishMistakes(t *testing.T) {
	m := startServer(t, Config{})
	api := "http://" + m.HTTPAddr()
	pkg := filepath.Join(t.TempDir(), "weather.pkg")
	require.NoError(t, os.WriteFile(pkg, bytes.Repeat([]byte("pkg"), 1000), 0o600))
	fw := filepath.Join(t.TempDir(), "zephyr.signed.bin")
	require.NoError(t, os.WriteFile(fw, mcuboot.MustBuild(bytes.Repeat([]byte("fw"), 100_000), mcuboot.Options{Version: mcuboot.Version{Major: 1, Minor: 2}}), 0o600))
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"app", "publish", "--app-id", "Weather", "--version", "1.3.0", pkg}, "--app-id \"Weather\""},
		{[]string{"app", "publish", "--app-id", "my app", "--version", "1.3.0", pkg}, "--app-id \"my app\""},
		{[]string{"app", "publish", "--app-id", "weather", "--version", "v1.3.0", pkg}, "--version \"v1.3.0\""},
		{[]string{"firmware", "publish", "--model", "sim 1", "--version", "1.2.0", pkg}, "--model \"sim 1\""},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.2", pkg}, "--version \"1.2\""},
		// Semantic versions an MCUboot header cannot hold, or that a device
		// never reports, and a file that is not an image of --version.
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0-rc.1", fw}, "--version \"1.2.0-rc.1\""},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "256.0.0", fw}, "--version \"256.0.0\""},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0+0", fw}, "write it 1.2.0"},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.3.0", fw}, "header of " + fw + " says 1.2.0"},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0", pkg}, "not an MCUboot image"},
		{[]string{"app", "publish", "--app-id", "weather", "--version", "1.3.0", t.TempDir()}, "not a regular file"},
		{[]string{"firmware", "publish", "--model", "sim-1", "--version", "1.2.0", t.TempDir()}, "not a regular file"},
	} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), append(tc.args, "--api-url", api, "--admin-token", m.AdminToken()), &out, &errOut)
		var ue usageError
		if assert.ErrorAs(t, err, &ue, "companion %q: %v", tc.args, err) {
			assert.Contains(t, ue.Error(), tc.want, "companion %q", tc.args)
		}
		assert.Empty(t, errOut.String(), "companion %q: nothing is uploaded", tc.args)
		assert.Empty(t, out.String())
	}
}

// An --api-url the CLI could never reach a server at is a usage error
// naming the flag. Before, one without a scheme (127.0.0.1:8080, as
// --http takes it) ended with "parse …: first path segment in URL cannot
// contain colon", and one of another scheme with "unsupported protocol
// scheme", exit status 1, neither naming the flag.
func TestCLIBadAPIURL(t *testing.T) {
	t.Parallel()
	const cmdID = "0190a000-0000-7000-8000-000000000000"
	// One that ends in /api/v1, as the README's $API does, had each path
	// doubled: "404 not_found: no such resource", under the path undoubled.
	for _, apiURL := range []string{"127.0.0.1:8080", "ftp://127.0.0.1:8080", "http:///api", "http://127.0.0.1:8080/api/v1", "http://127.0.0.1:8080/api/v1/"} {
		for _, args := range [][]string{
			{"user", "create", "alice", "--admin-token", "t"},
			{"command", "wait", "dev-1", cmdID, "--token", "t"},
		} {
			err := run(context.Background(), append(args, "--api-url", apiURL), &bytes.Buffer{}, &bytes.Buffer{})
			var ue usageError
			if assert.ErrorAs(t, err, &ue, "companion %q --api-url %q: %v", args, apiURL, err) {
				assert.Contains(t, ue.Error(), "--api-url", "companion %q --api-url %q", args, apiURL)
			}
		}
	}
}

func TestFlagsFromEnvironment(t *testing.T) {
	t.Setenv("COMPANION_MQTT_URL", "tcp://broker:1883")
	t.Setenv("COMPANION_DEMO", "true")
	t.Setenv("COMPANION_HTTP", "0.0.0.0:9")
	var cfg Config
	fs := newServeFlags(&cfg)
	require.NoError(t, parseFlags(fs, []string{"--http", "127.0.0.1:1"}))
	assert.Equal(t, "tcp://broker:1883", cfg.MQTTURL)
	assert.True(t, cfg.Demo)
	assert.Equal(t, "127.0.0.1:1", cfg.HTTP, "a flag wins over the environment")

	t.Setenv("COMPANION_DEMO", "maybe")
	fs = newServeFlags(&cfg)
	assert.ErrorContains(t, parseFlags(fs, nil), `COMPANION_DEMO: invalid value "maybe" for --demo: want true or false`)
}

// Each command's -h names its arguments; a command group asked for help
// lists its sub-commands and exits 0, and one given none or an unknown one
// lists them before the usage error.
func TestCLIUsage(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		help     bool   // -h of a command: flag.ErrHelp, flags on stderr
		usageErr string // a usage error containing this; "" none
		stdout   string // contained in stdout
		stderr   string // contained in stderr
	}{
		{args: []string{"user", "create", "-h"}, help: true, stderr: "usage: companion user create NAME\n\nflags:\n  -admin-token"},
		{args: []string{"device", "provision", "--help"}, help: true, stderr: "usage: companion device provision ID --claim-code CODE --model MODEL [--bridge BRIDGE]\n"},
		{args: []string{"command", "wait", "-h"}, help: true, stderr: "usage: companion command wait DEVICE ID --token TOKEN"},
		{args: []string{"serve", "-h"}, help: true, stderr: "usage: companion serve [--http ADDR]"},
		{args: []string{"user", "--help"}, stdout: "usage:\n  companion user create NAME\n  companion user token ID\n"},
		{args: []string{"device", "-h"}, stdout: "usage:\n  companion device provision ID --claim-code CODE --model MODEL [--bridge BRIDGE]\n  companion device assign ID --bridge BRIDGE | --none\n"},
		{args: []string{"command", "--help"}, stdout: "  companion command wait DEVICE ID"},
		{args: []string{"user"}, usageErr: "user: missing sub-command (create or token)", stderr: "  companion user create NAME"},
		{args: []string{"device"}, usageErr: "device: missing sub-command (provision or assign)", stderr: "  companion device assign ID"},
		{args: []string{"command"}, usageErr: "command: missing sub-command (wait)", stderr: "  companion command wait DEVICE ID"},
		{args: []string{"firmware", "upload"}, usageErr: `unknown command "firmware upload": firmware takes publish`, stderr: "  companion firmware publish --model MODEL"},
	} {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), tc.args, &stdout, &stderr)
		switch {
		case tc.help:
			assert.ErrorIs(t, err, flag.ErrHelp, "companion %q", tc.args)
		case tc.usageErr != "":
			var ue usageError
			if assert.ErrorAs(t, err, &ue, "companion %q", tc.args) {
				assert.Contains(t, ue.Error(), tc.usageErr, "companion %q", tc.args)
			}
		default:
			assert.NoError(t, err, "companion %q", tc.args)
		}
		assert.Contains(t, stdout.String(), tc.stdout, "companion %q: stdout", tc.args)
		assert.Contains(t, stderr.String(), tc.stderr, "companion %q: stderr", tc.args)
		assert.NotContains(t, stderr.String(), "Usage of", "companion %q: the flag package's own usage line", tc.args)
	}
}

// The demo prints curl lines that work as printed.
func TestDemoQuickStartWorksAsPrinted(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl not installed: run make deps (it installs Debian's curl)")
	}
	m := startServer(t, Config{Demo: true})
	var out bytes.Buffer
	m.Demo.PrintQuickStart(&out)
	var lines []string
	for _, l := range strings.Split(out.String(), "\n") {
		l = strings.TrimSpace(l)
		if strings.HasPrefix(l, "curl ") {
			lines = append(lines, l)
		}
	}
	require.GreaterOrEqual(t, len(lines), 10, "%s", out.String())
	for _, l := range lines {
		cmd := exec.Command("sh", "-c", l+" -w '\\n%{http_code}'")
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s: %s", l, b)
		outLines := strings.Split(strings.TrimSpace(string(b)), "\n")
		code := outLines[len(outLines)-1]
		assert.Contains(t, []string{"200", "201", "202"}, code, "%s\n%s", l, b)
		if strings.Contains(l, "Prefer: wait") {
			assert.Contains(t, string(b), `"state":"succeeded"`, "%s\n%s", l, b)
		}
	}
	// demo.json holds what the quick start uses.
	b, err := os.ReadFile(filepath.Join(m.Config.Data, "demo.json"))
	require.NoError(t, err)
	var f DemoFile
	require.NoError(t, json.Unmarshal(b, &f))
	assert.Len(t, f.Devices, 3)
	fi, err := os.Stat(filepath.Join(m.Config.Data, "demo.json"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
}

// A server started with --admin-token on a data directory that holds a
// DATA/admin.token of an earlier start warns that the file's token is not
// in force, and the admin CLI, which reads the file when given no token,
// says so when it is refused. A short --admin-token is warned of too.
func TestStaleAdminTokenFile(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "admin.token"), []byte("cat_generated-before\n"), 0o600))
	var logs testenv.Buffer
	m := startServerLogging(t, Config{Data: dir, AdminToken: "from-the-flag"}, slog.New(slog.NewTextHandler(&logs, nil)))
	file := filepath.Join(dir, "admin.token")
	assert.Contains(t, logs.String(), "level=WARN msg=\"the admin token in "+file+" is not in force: --admin-token is;")
	assert.NotContains(t, logs.String(), "cat_generated-before")
	assert.NotContains(t, logs.String(), "from-the-flag")
	assert.Contains(t, logs.String(), "level=WARN msg=\"--admin-token has 13 characters: whoever guesses it administers every user and device;")

	api := "http://" + m.HTTPAddr()
	err := run(context.Background(), []string{"user", "create", "zz", "--api-url", api, "--data", dir}, &bytes.Buffer{}, &bytes.Buffer{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "401")
	assert.Contains(t, err.Error(), "the admin token was read from "+file+", which may be stale")
	assert.Contains(t, err.Error(), "--admin-token or COMPANION_ADMIN_TOKEN")

	// Given the token, the CLI gets in; a wrong token given on the command
	// line is a plain 401, the file not named.
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), []string{"user", "create", "zz", "--api-url", api, "--admin-token", "from-the-flag"}, &out, &bytes.Buffer{}))
	err = run(context.Background(), []string{"user", "create", "yy", "--api-url", api, "--admin-token", "wrong", "--data", dir}, &bytes.Buffer{}, &bytes.Buffer{})
	require.ErrorContains(t, err, "401")
	assert.NotContains(t, err.Error(), "admin.token")

	// A token of 16 characters or more is not warned of.
	var quiet testenv.Buffer
	startServerLogging(t, Config{Data: t.TempDir(), AdminToken: "0123456789abcdef"}, slog.New(slog.NewTextHandler(&quiet, nil)))
	assert.NotContains(t, quiet.String(), "--admin-token has")

	// No warning when the file holds the token in force, or without the flag.
	for _, cfg := range []Config{{AdminToken: "same"}, {}} {
		d := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(d, "admin.token"), []byte("same\n"), 0o600))
		path, stale := staleAdminTokenFile(Config{Data: d, AdminToken: cfg.AdminToken})
		assert.False(t, stale, "%+v: %s", cfg, path)
	}
}

// An upload over a slow link takes as long as it goes on steadily: the
// admin CLI gave up after 5 minutes in all (http.Client.Timeout). A
// server that takes no more of it, or does not answer, is still given up
// on, after adminStall without progress. (The test shortens adminStall to
// 1 s; the upload goes on for about 2.)
func TestAdminCLIUploadTakesItsTime(t *testing.T) {
	defer func(d time.Duration) { adminStall = d }(adminStall)
	adminStall = time.Second
	hung := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/stalled/") {
			<-hung // takes nothing, answers nothing
			return
		}
		// 512 KiB every 30 ms (about 16 MiB/s): far more than the
		// sockets' buffers hold goes on arriving for about 2 s.
		var n int64
		for {
			k, err := io.CopyN(io.Discard, r.Body, 512<<10)
			n += k
			if err != nil {
				break
			}
			time.Sleep(30 * time.Millisecond)
		}
		fmt.Fprintf(w, `{"app_id": "slow", "version": "1.0.0", "size": %d}`, n)
	}))
	defer srv.Close()
	defer close(hung)
	file := filepath.Join(t.TempDir(), "app.bin")
	const size = 32 << 20
	require.NoError(t, os.WriteFile(file, bytes.Repeat([]byte{7}, size), 0o600))
	publish := func(appID string) (string, error) {
		var out bytes.Buffer
		err := run(context.Background(), []string{"app", "publish", "--app-id", appID, "--version", "1.0.0", file,
			"--api-url", srv.URL, "--admin-token", "t"}, &out, io.Discard)
		return out.String(), err
	}
	start := time.Now()
	out, err := publish("slow")
	require.NoError(t, err, "a steady upload of %v", time.Since(start))
	assert.Contains(t, out, fmt.Sprintf(`"size": %d`, size))

	_, err = publish("stalled")
	assert.ErrorContains(t, err, "the server made no progress for 1s")
}
