package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// readmeCommands returns the shell lines of the README's sh blocks, with
// continuation lines joined.
func readmeCommands(tb testing.TB) []string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(tb, err)
	var (
		out    []string
		inSh   bool
		joined string
	)
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "```sh"):
			inSh = true
			continue
		case strings.HasPrefix(line, "```"):
			inSh = false
			continue
		}
		if !inSh {
			continue
		}
		if strings.HasSuffix(line, `\`) {
			joined += strings.TrimSuffix(line, `\`) + " "
			continue
		}
		joined += line
		out = append(out, strings.TrimSpace(joined))
		joined = ""
	}
	return out
}

var trailingComment = regexp.MustCompile(`\s+# .*$`)

// TestReadmeCurlLinesWork runs every curl line of the README, as printed,
// against a demo server, with the variables the README's setup block sets.
func TestReadmeCurlLinesWork(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Fatal("curl not installed: run make deps (it installs Debian's curl)")
	}
	m := startServer(t, Config{Demo: true})
	dir := t.TempDir()
	require.NoError(t, os.Symlink(m.Config.Data, filepath.Join(dir, "data")))
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "docs"), 0o755))
	png, err := os.ReadFile(filepath.Join("..", "..", "docs", "sample.png"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "docs", "sample.png"), png, 0o644))

	var setup []string
	var curls []string
	for _, l := range readmeCommands(t) {
		switch {
		case strings.HasPrefix(l, "API="):
			setup = append(setup, "API=http://"+m.HTTPAddr()+"/api/v1")
		case strings.HasPrefix(l, "TOKEN="), strings.HasPrefix(l, "CLAIM="), strings.HasPrefix(l, "DEV="),
			strings.HasPrefix(l, "IMG="), strings.HasPrefix(l, "USER_ID="):
			setup = append(setup, l)
		case strings.HasPrefix(l, "curl "):
			curls = append(curls, trailingComment.ReplaceAllString(l, ""))
		}
	}
	require.GreaterOrEqual(t, len(curls), 15, "the README shows a curl line for every operation")
	prelude := strings.Join(setup, "\n") + "\n"
	var lastCommand string
	for _, l := range curls {
		if strings.Contains(l, "COMMAND_ID") {
			if lastCommand == "" {
				continue
			}
			l = strings.ReplaceAll(l, "COMMAND_ID", lastCommand)
		}
		cmd := exec.Command("sh", "-c", prelude+l+" -w '\\n%{http_code}'")
		cmd.Dir = dir
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s: %s", l, b)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		code := lines[len(lines)-1]
		body := strings.Join(lines[:len(lines)-1], "\n")
		if strings.Contains(l, "-X DELETE $API/devices/$DEV/commands/") {
			// Canceling a finished command is refused, as documented.
			assert.Equal(t, "409", code, "%s\n%s", l, body)
			continue
		}
		assert.Contains(t, []string{"200", "201", "202"}, code, "%s\n%s", l, body)
		if strings.Contains(l, "Prefer: wait") {
			assert.Contains(t, body, `"state":"succeeded"`, "%s\n%s", l, body)
			if id := regexp.MustCompile(`"id":"([0-9a-f-]{36})"`).FindStringSubmatch(body); id != nil {
				lastCommand = id[1]
			}
		}
	}
}

// TestReadmeCLILinesWork runs the README's lines of the companion CLI
// (command wait and the admin commands), as printed, with the binary for
// `go run ./cmd/companion`, against a demo server in a directory whose
// ./data is the server's, and the files they name made there. The server
// is not on the README's 127.0.0.1:8080: the admin lines find it through
// COMPANION_API_URL, and the --api-url of command wait is replaced.
func TestReadmeCLILinesWork(t *testing.T) {
	companion, _ := procBinaries(t)
	// No --admin-token: the admin lines read the one generated into
	// data/admin.token.
	m := NewMain(Config{HTTP: "127.0.0.1:0", MQTTListen: "127.0.0.1:0", Data: t.TempDir(), TopicPrefix: "companion/v1", Demo: true}, testLogger(t))
	t.Cleanup(func() { m.Close() })
	require.NoError(t, m.Run(context.Background()))
	dir := t.TempDir()
	require.NoError(t, os.Symlink(m.Config.Data, filepath.Join(dir, "data")))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "zephyr.signed.bin"), firmwareImage(t, "1.2.0", 32<<10), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "weather.pkg"), bytes.Repeat([]byte("pkg"), 1000), 0o600))

	user := newClient(t, m, m.Demo.File.Token)
	r := user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "sim-001", "claim_code": m.Demo.File.Devices[0].ClaimCode})
	require.Contains(t, []int{200, 201}, r.Status, "%s", r.Body)
	r = user.do("POST", "/api/v1/devices/sim-001/push/text", map[string]any{"text": "hi"}, "Prefer", "wait=20")
	require.Equal(t, 200, r.Status, "%s", r.Body)
	commandID := r.JSON(t)["id"].(string)

	// openssl, for a claim code, is not among what make deps installs.
	setup := []string{`openssl() { echo 0123456789abcdef01234567; }`}
	var lines []string
	for _, l := range readmeCommands(t) {
		switch {
		case strings.HasPrefix(l, "TOKEN="), strings.HasPrefix(l, "DEV="), strings.HasPrefix(l, "CODE="):
			setup = append(setup, trailingComment.ReplaceAllString(l, ""))
		case strings.HasPrefix(l, "go run ./cmd/companion ") && !strings.HasPrefix(l, "go run ./cmd/companion serve"):
			l = strings.Replace(trailingComment.ReplaceAllString(l, ""), "go run ./cmd/companion", companion, 1)
			l = strings.ReplaceAll(l, "http://127.0.0.1:8080", m.APIURL())
			l = strings.ReplaceAll(l, "USER_ID", m.Demo.File.UserID)
			lines = append(lines, strings.ReplaceAll(l, "COMMAND_ID", commandID))
		}
	}
	require.GreaterOrEqual(t, len(lines), 9, "command wait and the eight admin commands")
	require.Contains(t, setup, "CODE=$(openssl rand -hex 12)", "the claim code is made into a variable, printed, and provisioned")
	prelude := strings.Join(setup, "\n") + "\n"
	for _, l := range lines {
		cmd := exec.Command("sh", "-c", prelude+l)
		cmd.Dir = dir
		cmd.Env = append(procEnv(), "COMPANION_API_URL="+m.APIURL())
		out, err := cmd.CombinedOutput()
		assert.NoError(t, err, "%s:\n%s", l, out)
	}
}

// readmeParagraph returns the README's paragraph that starts with start.
func readmeParagraph(tb testing.TB, start string) string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(tb, err)
	s := string(b)
	i := strings.Index(s, "\n"+start)
	require.GreaterOrEqual(tb, i, 0, "the README has no paragraph starting %q", start)
	s = s[i+1:]
	if j := strings.Index(s, "\n\n"); j >= 0 {
		s = s[:j]
	}
	return s
}

// The README's Configuration section names every flag of companion serve.
func TestReadmeListsEveryServeFlag(t *testing.T) {
	para := readmeParagraph(t, "`companion serve`: ")
	newServeFlags(&Config{}).VisitAll(func(f *flag.Flag) {
		if !regexp.MustCompile("(^|[^a-z0-9-])--" + regexp.QuoteMeta(f.Name) + "([^a-z0-9-]|$)").MatchString(para) {
			t.Errorf("the README's companion serve flags lack --%s", f.Name)
		}
	})
}

// docsCommandLines returns the command lines of the README and docs/*.md
// that run the program prog (companion or companion-bridge, as installed
// or through go run ./cmd/PROG): those of their code blocks, continuation
// lines joined, and their inline code spans. Each is returned from its
// first argument on, with the file it is in.
func docsCommandLines(tb testing.TB, root, prog string) (lines, files []string) {
	tb.Helper()
	paths, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(tb, err)
	start := regexp.MustCompile(`^(?:go run \./cmd/)?` + regexp.QuoteMeta(prog) + ` (.+)$`)
	span := regexp.MustCompile("`([^`\n]+)`")
	for _, path := range append([]string{filepath.Join(root, "README.md")}, paths...) {
		b, err := os.ReadFile(path)
		require.NoError(tb, err)
		var cands []string
		inBlock, joined := false, ""
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "```") {
				inBlock = !inBlock
				continue
			}
			if !inBlock {
				for _, m := range span.FindAllStringSubmatch(line, -1) {
					cands = append(cands, m[1])
				}
				continue
			}
			if strings.HasSuffix(line, `\`) {
				joined += strings.TrimSuffix(line, `\`) + " "
				continue
			}
			cands = append(cands, joined+line)
			joined = ""
		}
		for _, c := range cands {
			if m := start.FindStringSubmatch(strings.TrimSpace(c)); m != nil {
				lines = append(lines, m[1])
				files = append(files, filepath.Base(path))
			}
		}
	}
	return lines, files
}

var docFlag = regexp.MustCompile(`(?:^|\s)--([a-z][a-z0-9-]*)`)

// Every flag a command line of the README or of docs/*.md gives companion
// is a flag of that command (docs/provisioning.md's lines, and those of
// docs/mosquitto.md but its section 2's, TestMosquittoDocAccountsWork, are
// not run by any test; a renamed flag left them failing).
func TestDocsCommandLinesNameRealFlags(t *testing.T) {
	var subs []string
	for _, c := range commands {
		subs = append(subs, c.name)
	}
	flags := map[string]map[string]bool{}
	for _, sub := range subs {
		var out, errOut bytes.Buffer
		if err := run(context.Background(), append(strings.Fields(sub), "-h"), &out, &errOut); err != nil && !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("companion %s -h: %v", sub, err)
		}
		names := map[string]bool{}
		for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(out.String()+errOut.String(), -1) {
			names[m[1]] = true
		}
		require.NotEmpty(t, names, "companion %s -h:\n%s%s", sub, out.String(), errOut.String())
		flags[sub] = names
	}
	lines, files := docsCommandLines(t, filepath.Join("..", ".."), "companion")
	require.GreaterOrEqual(t, len(lines), 15, "the docs' companion lines")
	for i, l := range lines {
		sub := ""
		for _, s := range subs {
			if l == s || strings.HasPrefix(l, s+" ") {
				sub = s
			}
		}
		if sub == "" {
			if !strings.HasPrefix(l, "--version") && !strings.HasPrefix(l, "COMMAND") {
				t.Errorf("%s: `companion %s`: no such command", files[i], l)
			}
			continue
		}
		for _, m := range docFlag.FindAllStringSubmatch(l, -1) {
			if !flags[sub][m[1]] {
				t.Errorf("%s: `companion %s`: companion %s has no --%s", files[i], l, sub, m[1])
			}
		}
	}
}

// Every test, benchmark and fuzz target the README and docs/*.md name as
// proof of what they say is one of the repository's: docs/reliability.md's
// proof of CONTRACT §7.4 was a test that did not exist (bug 418).
func TestDocsNameRealTests(t *testing.T) {
	root := filepath.Join("..", "..")
	defined := map[string]bool{}
	def := regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz|Example)\w*)\(`)
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "cluster" || d.Name() == "dist" || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range def.FindAllSubmatch(b, -1) {
			defined[string(m[1])] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.True(t, defined["TestDocsNameRealTests"], "the walk found no tests")
	paths, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	named := regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z]\w*`)
	seen := 0
	for _, path := range append([]string{filepath.Join(root, "README.md")}, paths...) {
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		// docs/reliability.md quotes this test's failures.
		text := regexp.MustCompile(`"[^"]*which no _test.go file\s+defines"`).ReplaceAllString(string(b), "")
		for _, name := range named.FindAllString(text, -1) {
			seen++
			if !defined[name] {
				t.Errorf("%s names %s, which no _test.go file defines", filepath.Base(path), name)
			}
		}
	}
	require.Greater(t, seen, 100, "the docs' test names")
}

// TestReadmeWatchLineWorks runs the README's mosquitto_sub line of
// "Watching the MQTT traffic", as printed, with the variables the README's
// lines set from data/demo.json, against a demo server whose device is
// registered: it receives the device's retained status. Only the broker's
// address is the test's.
func TestReadmeWatchLineWorks(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("mosquitto_sub"); err != nil {
		t.Fatal("mosquitto_sub not installed: run make deps (it installs Debian's mosquitto-clients)")
	}
	m := startServer(t, Config{Demo: true})
	dir := t.TempDir()
	require.NoError(t, os.Symlink(m.Config.Data, filepath.Join(dir, "data")))
	user := newClient(t, m, m.Demo.File.Token)
	r := user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "sim-001", "claim_code": m.Demo.File.Devices[0].ClaimCode})
	require.Contains(t, []int{200, 201}, r.Status, "%s", r.Body)
	u, err := url.Parse(m.MQTTURL())
	require.NoError(t, err)

	var setup []string
	var watch string
	for _, l := range readmeCommands(t) {
		switch {
		case strings.HasPrefix(l, "TOKEN="), strings.HasPrefix(l, "DEV="), strings.HasPrefix(l, "USER_ID="):
			setup = append(setup, l)
		case strings.HasPrefix(l, "mosquitto_sub "):
			require.Empty(t, watch, "one mosquitto_sub line in the README")
			watch = l
		}
	}
	require.Contains(t, watch, "-h 127.0.0.1 -p 1883 ", "the README's line watches the embedded broker's default address")
	watch = strings.Replace(watch, "-h 127.0.0.1 -p 1883 ", "-h "+u.Hostname()+" -p "+u.Port()+" ", 1)
	// Stop after the retained status and settings, or after 20 s.
	script := strings.Join(setup, "\n") + "\n" + watch + " -C 2 -W 20"
	cmd := exec.Command("sh", "-c", script)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s:\n%s", watch, out)
	assert.Contains(t, string(out), "companion/v1/devices/sim-001/status {", "%s", out)
}

// foreignFlags are the flags the README and docs/*.md give other programs
// (git, curl, imgtool, docker, unshare, prlimit, nats-server, pg_restore), each with
// the program it belongs to.
var foreignFlags = map[string]string{
	"always": "git describe", "dirty": "git describe", "build-arg": "docker build",
	"cacert": "curl", "data-binary": "curl", "path-as-is": "curl",
	"cafile": "mosquitto_sub", "capath": "mosquitto_sub",
	"confirm": "imgtool sign", "pad": "imgtool sign", "key": "imgtool sign", "max-align": "imgtool sign", "sha": "imgtool sign", "rom-fixed": "imgtool sign",
	"map-root-user": "unshare", "mount": "unshare", "pid": "unshare", "fsize": "prlimit",
	"stop-timeout": "docker run", "memory": "docker run", "platform": "docker build", "cache-to": "docker buildx build",
	"compress": "HTTPie", "failed": "systemctl",
	"no-owner": "pg_restore", "dbname": "pg_restore",
	"signal": "nats-server", "help": "every program", "test": "imgtool", "nats-": "the --nats-* flags", "sim-": "the --sim-* flags",
}

// Every `--flag` the README and docs/*.md name in their prose, not only on
// command lines (TestDocsCommandLinesNameRealFlags), is a flag of
// companion serve, of a command of the CLI, or of companion-bridge, or
// one of foreignFlags: a flag renamed in the code and not in a sentence
// that tells an operator to set it fails here.
func TestDocsProseNamesRealFlags(t *testing.T) {
	_, bridge := procBinaries(t)
	var help bytes.Buffer
	for _, c := range commands {
		var out, errOut bytes.Buffer
		if err := run(context.Background(), append(strings.Fields(c.name), "-h"), &out, &errOut); err != nil && !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("companion %s -h: %v", c.name, err)
		}
		help.Write(out.Bytes())
		help.Write(errOut.Bytes())
	}
	out, _ := exec.Command(bridge, "-h").CombinedOutput()
	help.Write(out)
	known := map[string]bool{"version": true}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(help.String(), -1) {
		known[m[1]] = true
	}
	require.True(t, known["sim-devices"] && known["mqtt-dynsec"] && known["api-url"], "the flags of both binaries and the CLI")
	root := filepath.Join("..", "..")
	paths, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	mention := regexp.MustCompile("(?:^|[\\s`(])--([a-z][a-z0-9-]*)")
	for _, path := range append([]string{filepath.Join(root, "README.md")}, paths...) {
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		for _, m := range mention.FindAllStringSubmatch(string(b), -1) {
			if !known[m[1]] && foreignFlags[m[1]] == "" {
				t.Errorf("%s names --%s, a flag of neither binary", filepath.Base(path), m[1])
			}
		}
	}
}
