package packaging

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"go/ast"
	"go/constant"
	"go/format"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
)

var commands = []string{"companion", "companion-bridge"}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func goTool(tb testing.TB) string {
	tb.Helper()
	g, err := testenv.GoTool()
	if err != nil {
		tb.Fatalf("the go command: %v", err)
	}
	return g
}

// run runs name with args in dir and returns its combined output, failing
// t when it fails.
func run(t *testing.T, timeout time.Duration, dir string, env []string, name string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return out
}

// Both binaries print the version stamped at build time.
func TestVersionFlag(t *testing.T) {
	root := repoRoot(t)
	dir := t.TempDir()
	const stamp = "v0.0.0-versiontest"
	for _, c := range commands {
		bin := filepath.Join(dir, c)
		run(t, 5*time.Minute, root, nil, goTool(t), "build", "-ldflags", "-X main.version="+stamp, "-o", bin, "./cmd/"+c)
		for _, flag := range []string{"--version", "-version"} {
			out := run(t, 30*time.Second, dir, nil, bin, flag)
			if got, want := string(out), c+" "+stamp+"\n"; got != want {
				t.Errorf("%s %s = %q; want %q", c, flag, got, want)
			}
		}
	}
}

// make dist builds both binaries for the three Linux platforms, static,
// stamped with git describe, with the systemd units and SHA256SUMS.
func TestMakeDist(t *testing.T) {
	if testing.Short() {
		t.Skip("cross-compiles six binaries")
	}
	make, err := exec.LookPath("make")
	if err != nil {
		t.Fatalf("make is needed: %v", err)
	}
	root := repoRoot(t)
	dist := t.TempDir()
	// The version make stamps, as the Makefile asks git for it.
	want := "devel"
	if out, err := exec.Command("git", "-C", root, "describe", "--always", "--dirty").Output(); err == nil {
		want = strings.TrimSpace(string(out))
	}
	out := run(t, 15*time.Minute, root, []string{"GO=" + goTool(t)}, make, "dist", "DIST="+dist)
	// Others may edit the tree meanwhile: take the version make printed,
	// which must be git's but for the -dirty mark.
	var got string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) == 4 && f[0] == "dist:" {
			got = f[3]
		}
	}
	if strings.TrimSuffix(got, "-dirty") != strings.TrimSuffix(want, "-dirty") {
		t.Fatalf("make dist stamped %q; git describe --always --dirty says %q\n%s", got, want, out)
	}

	for _, p := range []struct {
		name    string
		machine elf.Machine
		class   elf.Class
	}{
		{"linux-amd64", elf.EM_X86_64, elf.ELFCLASS64},
		{"linux-arm64", elf.EM_AARCH64, elf.ELFCLASS64},
		{"linux-armv7", elf.EM_ARM, elf.ELFCLASS32},
	} {
		for _, c := range commands {
			path := filepath.Join(dist, c+"-"+p.name)
			f, err := elf.Open(path)
			if err != nil {
				t.Errorf("%s: %v", path, err)
				continue
			}
			if f.Machine != p.machine || f.Class != p.class {
				t.Errorf("%s: ELF machine %v, class %v; want %v, %v", path, f.Machine, f.Class, p.machine, p.class)
			}
			for _, prog := range f.Progs {
				if prog.Type == elf.PT_INTERP || prog.Type == elf.PT_DYNAMIC {
					t.Errorf("%s: dynamically linked (%v): CGO_ENABLED=0 must make it static", path, prog.Type)
				}
			}
			f.Close()
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Contains(b, []byte(got)) {
				t.Errorf("%s does not hold its version %q", path, got)
			}
			if bytes.Contains(b, []byte(root)) {
				t.Errorf("%s holds the build's directory %s: -trimpath is missing", path, root)
			}
			if p.name == "linux-"+runtime.GOARCH || (runtime.GOARCH == "arm" && p.name == "linux-armv7") {
				if v := run(t, 30*time.Second, dist, nil, path, "--version"); string(v) != c+" "+got+"\n" {
					t.Errorf("%s --version = %q; want %q", path, v, c+" "+got+"\n")
				}
			}
		}
	}

	// SHA256SUMS covers every file and is right about each.
	sums, err := os.ReadFile(filepath.Join(dist, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(sums))
	for sc.Scan() {
		sum, name, ok := strings.Cut(sc.Text(), "  ")
		if !ok {
			t.Fatalf("SHA256SUMS line %q", sc.Text())
		}
		b, err := os.ReadFile(filepath.Join(dist, name))
		if err != nil {
			t.Fatal(err)
		}
		if h := sha256.Sum256(b); hex.EncodeToString(h[:]) != sum {
			t.Errorf("SHA256SUMS: %s is wrong for %s", sum, name)
		}
		listed[name] = true
	}
	for _, name := range []string{
		"companion-linux-amd64", "companion-bridge-linux-amd64",
		"companion-linux-arm64", "companion-bridge-linux-arm64",
		"companion-linux-armv7", "companion-bridge-linux-armv7",
		"systemd/companion.service", "systemd/companion-bridge.service",
		"systemd/companion.env", "systemd/companion-bridge.env",
	} {
		if !listed[name] {
			t.Errorf("SHA256SUMS does not list %s:\n%s", name, sums)
		}
	}
}

// systemdAnalyze runs systemd-analyze with args and returns its output and
// whether it succeeded. It works without systemd running as PID 1.
func systemdAnalyze(t *testing.T, args ...string) (string, bool) {
	t.Helper()
	bin, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze not installed: run make deps (it installs Debian's systemd): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("systemd-analyze: %v", err)
	}
	return string(out), err == nil
}

// unitCopy writes unit into dir with its ExecStart binary replaced by an
// executable stub (systemd-analyze verify refuses a unit whose binary is
// missing, and the test does not install one), and edit applied.
func unitCopy(t *testing.T, dir, unit string, edit func(string) string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "packaging", "systemd", unit))
	if err != nil {
		t.Fatal(err)
	}
	stub := filepath.Join(dir, "stub")
	if err := os.WriteFile(stub, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	text := strings.ReplaceAll(string(b), "ExecStart=/usr/local/bin/", "ExecStart="+dir+"/bin/")
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range commands {
		if err := os.Symlink(stub, filepath.Join(dir, "bin", c)); err != nil && !os.IsExist(err) {
			t.Fatal(err)
		}
	}
	if edit != nil {
		text = edit(text)
	}
	path := filepath.Join(dir, unit)
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// The units pass systemd-analyze verify without a word, keep their
// hardening, and score as well exposed as systemd-analyze security rates
// "OK"; a broken unit fails the same check.
func TestSystemdUnits(t *testing.T) {
	hardening := []string{
		"DynamicUser=yes", "StateDirectory=", "NoNewPrivileges=yes", "ProtectSystem=strict",
		"ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes",
		"RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "CapabilityBoundingSet=\n",
		"SystemCallFilter=@system-service", "MemoryDenyWriteExecute=yes", "LockPersonality=yes",
		"RestrictNamespaces=yes", "Restart=on-failure", "EnvironmentFile=",
	}
	for _, unit := range []string{"companion.service", "companion-bridge.service"} {
		t.Run(unit, func(t *testing.T) {
			dir := t.TempDir()
			path := unitCopy(t, dir, unit, nil)
			if out, ok := systemdAnalyze(t, "verify", path); !ok || out != "" {
				t.Errorf("systemd-analyze verify %s (ok %v):\n%s", unit, ok, out)
			}
			text, _ := os.ReadFile(path)
			for _, h := range hardening {
				if !strings.Contains(string(text), "\n"+h) {
					t.Errorf("%s lacks %q", unit, strings.TrimSpace(h))
				}
			}
			// 2.0 and below is what systemd-analyze calls OK.
			if out, ok := systemdAnalyze(t, "security", "--offline=yes", "--threshold=20", path); !ok {
				t.Errorf("systemd-analyze security %s: exposure over 2.0:\n%s", unit, out)
			}

			broken := t.TempDir()
			for _, edit := range []func(string) string{
				func(s string) string { return strings.Replace(s, "ProtectSystem=strict", "ProtectSystem=stricter", 1) },
				func(s string) string { return strings.Replace(s, "[Service]\n", "[Service]\nExecStart=/bin/true\n", 1) },
				func(s string) string { return strings.Replace(s, "Restart=on-failure", "Restart=sometimes", 1) },
			} {
				path := unitCopy(t, broken, unit, edit)
				if out, ok := systemdAnalyze(t, "verify", path); ok && out == "" {
					t.Errorf("systemd-analyze verify passes a broken %s:\n%s", unit, readFile(t, path))
				}
			}
		})
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The images' Dockerfiles build a static binary into an image that holds
// nothing else but CA certificates, and run it as an unprivileged user.
func TestDockerfiles(t *testing.T) {
	for _, tc := range []struct {
		command string
		expose  string
	}{
		{"companion", "EXPOSE 8080 1883 9464"},
		{"companion-bridge", ""},
	} {
		text := readFile(t, filepath.Join(repoRoot(t), "packaging", "docker", tc.command+".Dockerfile"))
		stages := strings.Split(text, "\nFROM ")
		final := stages[len(stages)-1]
		for _, want := range []string{
			"CGO_ENABLED=0", "-trimpath", "-X main.version=$VERSION", "./cmd/" + tc.command,
		} {
			if !strings.Contains(text, want) {
				t.Errorf("%s.Dockerfile builds without %q", tc.command, want)
			}
		}
		for _, want := range []string{
			"scratch\n", "/etc/ssl/certs/ca-certificates.crt", "\nUSER 65532:65532\n",
			`ENTRYPOINT ["/usr/local/bin/` + tc.command + `"]`, "\nVOLUME /data\n",
		} {
			if !strings.Contains(final, want) {
				t.Errorf("the image of %s.Dockerfile lacks %q", tc.command, strings.TrimSpace(want))
			}
		}
		if tc.expose != "" && !strings.Contains(final, "\n"+tc.expose+"\n") {
			t.Errorf("the image of %s.Dockerfile lacks %q", tc.command, tc.expose)
		}
		if tc.expose == "" && strings.Contains(final, "\nEXPOSE") {
			t.Errorf("the image of %s.Dockerfile exposes a port; it listens on none", tc.command)
		}
	}
}

// imageBuilder returns the command line that builds an image with the
// first builder that works here (a Docker daemon, Podman, Buildah), or ""
// and why none does.
func imageBuilder(t *testing.T) (func(dockerfile, tag, context string) []string, string) {
	t.Helper()
	works := func(name string, args ...string) bool {
		if _, err := exec.LookPath(name); err != nil {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		return exec.CommandContext(ctx, name, args...).Run() == nil
	}
	switch {
	case works("docker", "info"):
		return func(f, tag, c string) []string {
			return []string{"docker", "build", "-f", f, "-t", tag, "--build-arg", "VERSION=v0.0.0-imagetest", c}
		}, ""
	case works("podman", "info"):
		return func(f, tag, c string) []string {
			return []string{"podman", "build", "-f", f, "-t", tag, "--build-arg", "VERSION=v0.0.0-imagetest", c}
		}, ""
	case works("buildah", "--storage-driver", "vfs", "images"):
		return func(f, tag, c string) []string {
			return []string{"buildah", "--storage-driver", "vfs", "build", "--isolation", "chroot", "-f", f, "-t", tag, "--build-arg", "VERSION=v0.0.0-imagetest", c}
		}, ""
	}
	return nil, "no image builder works here: no Docker daemon, and neither podman nor buildah runs"
}

// The images build, where a builder works and can pull the Go base image.
func TestDockerImagesBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds images")
	}
	build, why := imageBuilder(t)
	if build == nil {
		t.Skip(why)
	}
	root := repoRoot(t)
	for _, c := range commands {
		args := build(filepath.Join(root, "packaging", "docker", c+".Dockerfile"), "companion-test/"+c+":test", root)
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		cancel()
		if err != nil {
			for _, pull := range []string{"pinging container registry", "no such host", "failed to resolve", "pull access denied", "error pulling image", "initializing source"} {
				if strings.Contains(string(out), pull) {
					t.Skipf("%s works, but the base image cannot be pulled here (no container registry is reachable):\n%s", args[0], lastLines(out, 3))
				}
			}
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// panicEnv, set, makes the test binary panic as it starts (TestMain): what
// a Go program's crash looks like to systemd under a unit's environment.
const panicEnv = "COMPANION_PACKAGING_TEST_PANIC"

func TestMain(m *testing.M) {
	if os.Getenv(panicEnv) != "" {
		panic("a crash, as systemd sees it")
	}
	code := m.Run()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// builtStamp is the version the binaries of builtCommands are stamped
// with.
const builtStamp = "v0.0.0-packagingtest"

// built holds both binaries, built once for the tests that run them.
var built struct {
	once sync.Once
	dir  string
	err  error
}

// builtCommands returns the directory that holds both binaries (commands),
// built once with -X main.version=builtStamp, as make dist stamps them.
func builtCommands(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		root, err := testenv.RepoRoot()
		if err != nil {
			built.err = err
			return
		}
		g, err := testenv.GoTool()
		if err != nil {
			built.err = err
			return
		}
		if built.dir, built.err = os.MkdirTemp("", "packaging-bin-"); built.err != nil {
			return
		}
		for _, c := range commands {
			cmd := exec.Command(g, "build", "-ldflags", "-X main.version="+builtStamp, "-o", filepath.Join(built.dir, c), "./cmd/"+c)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				built.err = fmt.Errorf("go build ./cmd/%s: %v\n%s", c, err, out)
				return
			}
		}
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.dir
}

// serviceSettings returns the values of each setting of the unit's
// [Service] section, in their order.
func serviceSettings(t *testing.T, unit string) map[string][]string {
	t.Helper()
	settings := map[string][]string{}
	section := ""
	for _, line := range strings.Split(readFile(t, filepath.Join(repoRoot(t), "packaging", "systemd", unit)), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = line
		case section == "[Service]":
			k, v, _ := strings.Cut(line, "=")
			settings[k] = append(settings[k], v)
		}
	}
	return settings
}

// runAsUnit runs bin with args as the unit of settings runs it, for a
// minute at most: in this process's environment with the unit's
// Environment= over it, less its COMPANION_DATA (the tests give a --data
// of their own), and env last. It returns the command, once ended, and
// what it printed.
func runAsUnit(t *testing.T, settings map[string][]string, bin string, args []string, env ...string) (*exec.Cmd, []byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = os.Environ()
	for _, e := range settings["Environment"] {
		cmd.Env = append(cmd.Env, strings.Fields(e)...)
	}
	cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, "COMPANION_DATA=") })
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	return cmd, out, err
}

// restarts says whether systemd restarts a unit of settings whose process
// ended as state did: Restart=on-failure, less RestartPreventExitStatus
// (systemd.service(5)).
func restarts(t *testing.T, settings map[string][]string, state *os.ProcessState) bool {
	t.Helper()
	if got := settings["Restart"]; !slices.Equal(got, []string{"on-failure"}) {
		t.Fatalf("Restart=%v; the test knows on-failure", got)
	}
	prevented := map[string]bool{}
	for _, v := range settings["RestartPreventExitStatus"] {
		if v == "" {
			clear(prevented)
		}
		for _, s := range strings.Fields(v) {
			prevented[s] = true
		}
	}
	ws := state.Sys().(syscall.WaitStatus)
	switch {
	case ws.Exited():
		return ws.ExitStatus() != 0 && !prevented[strconv.Itoa(ws.ExitStatus())]
	case ws.Signaled():
		switch sig := ws.Signal(); sig {
		case syscall.SIGHUP, syscall.SIGINT, syscall.SIGTERM, syscall.SIGPIPE:
			return false // a clean stop
		default:
			return !prevented[unix.SignalName(sig)]
		}
	}
	t.Fatalf("process state %v", state)
	return false
}

// A usage error (exit status 2: a flag in the env file wrong, a secret
// missing) is not restarted: it would fail again every RestartSec for
// good, as the start limit (5 in 10 s) never catches a unit restarted
// every 2 s. A crash is: a Go panic, whose exit status is 2 as well, dies
// of SIGABRT under the unit's environment (GOTRACEBACK=crash). An error
// at run time (exit status 1: a database not there yet) is restarted.
// Bug 235.
func TestSystemdRestartsCrashesNotUsageErrors(t *testing.T) {
	for _, unit := range []string{"companion.service", "companion-bridge.service"} {
		t.Run(unit, func(t *testing.T) {
			settings := serviceSettings(t, unit)
			exit := func(code int) *os.ProcessState {
				cmd := exec.Command("sh", "-c", "exit "+strconv.Itoa(code))
				cmd.Run()
				return cmd.ProcessState
			}
			if restarts(t, settings, exit(2)) {
				t.Errorf("%s restarts after exit status 2, a usage error, every RestartSec for good", unit)
			}
			if !restarts(t, settings, exit(1)) {
				t.Errorf("%s does not restart after exit status 1", unit)
			}

			// The test binary panicking, in the unit's environment.
			cmd, out, err := runAsUnit(t, settings, os.Args[0], []string{"-test.run=^$"}, panicEnv+"=1")
			if err == nil || !strings.Contains(string(out), "a crash, as systemd sees it") {
				t.Fatalf("the panicking test binary: %v\n%s", err, out)
			}
			if !restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s does not restart after a panic (%v): with its environment a Go panic exits 2", unit, cmd.ProcessState)
			}
		})
	}
}

// The server's env file, uncommented for Mosquitto, logs in with the
// account docs/mosquitto.md has the operator make (and mosquitto.conf
// names): the server's own, the dynamic-security plugin's admin.
func TestEnvFileMQTTAccountIsTheDocs(t *testing.T) {
	root := repoRoot(t)
	doc := readFile(t, filepath.Join(root, "docs", "mosquitto.md"))
	const initLine = "mosquitto_ctrl dynsec init /var/lib/mosquitto/dynamic-security.json "
	i := strings.Index(doc, initLine)
	if i < 0 {
		t.Fatalf("docs/mosquitto.md has no %q line", initLine)
	}
	account := strings.Fields(doc[i+len(initLine):])[0]
	if !strings.Contains(readFile(t, filepath.Join(root, "mosquitto.conf")), "--mqtt-username "+account+" ") {
		t.Errorf("mosquitto.conf does not start the server with --mqtt-username %s", account)
	}
	env := readFile(t, filepath.Join(root, "packaging", "systemd", "companion.env"))
	var found bool
	for _, line := range strings.Split(env, "\n") {
		name, value, ok := strings.Cut(strings.TrimPrefix(line, "#"), "=")
		if !ok || name != "COMPANION_MQTT_USERNAME" {
			continue
		}
		found = true
		if value != account {
			t.Errorf("companion.env: COMPANION_MQTT_USERNAME=%s; docs/mosquitto.md makes the server's account %s", value, account)
		}
	}
	if !found {
		t.Error("companion.env has no COMPANION_MQTT_USERNAME line")
	}
}

// goDuration evaluates the initial value of the package-level variable or
// constant name in the Go file rel (a time.Duration expression such as
// time.Minute or 15 * time.Second).
func goDuration(t *testing.T, rel, name string) time.Duration {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, filepath.Join(repoRoot(t), rel), nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok {
			continue
		}
		for _, s := range g.Specs {
			v, ok := s.(*ast.ValueSpec)
			if !ok {
				continue
			}
			for i, n := range v.Names {
				if n.Name != name || i >= len(v.Values) {
					continue
				}
				var src strings.Builder
				if err := format.Node(&src, fset, v.Values[i]); err != nil {
					t.Fatal(err)
				}
				pkg := types.NewPackage("p", "p")
				timePkg, err := importer.Default().Import("time")
				if err != nil {
					t.Fatal(err)
				}
				pkg.Scope().Insert(types.NewPkgName(token.NoPos, pkg, "time", timePkg))
				tv, err := types.Eval(token.NewFileSet(), pkg, token.NoPos, src.String())
				if err != nil || tv.Value == nil {
					t.Fatalf("%s: %s = %s is not a constant: %v", rel, name, src.String(), err)
				}
				ns, ok := constant.Int64Val(tv.Value)
				if !ok {
					t.Fatalf("%s: %s = %s", rel, name, tv.Value)
				}
				return time.Duration(ns)
			}
		}
	}
	t.Fatalf("%s declares no %s", rel, name)
	return 0
}

// The server bounds its own shutdown on a SIGTERM (shutdownWithin, bug
// 343): past it, it logs what it waits for (a disk that does not answer)
// and exits 1. systemd's TimeoutStopSec must leave it that time, or the
// SIGKILL comes first and the journal says only that the stop timed out.
// Bug 400.
func TestSystemdStopTimeoutOutlastsShutdown(t *testing.T) {
	bound := goDuration(t, "cmd/companion/serve.go", "shutdownWithin")
	settings := serviceSettings(t, "companion.service")
	var stop string
	for _, k := range []string{"TimeoutSec", "TimeoutStopSec"} {
		if v := settings[k]; len(v) > 0 {
			stop = v[len(v)-1]
		}
	}
	if stop == "" {
		stop = "90s" // systemd's DefaultTimeoutStopSec
	}
	d, err := time.ParseDuration(strings.ReplaceAll(stop, "min", "m"))
	if err != nil {
		t.Fatalf("TimeoutStopSec=%s: %v", stop, err)
	}
	// The server logs and exits at once past its bound: 10 s leaves
	// room for that on a loaded machine.
	if d < bound+10*time.Second {
		t.Errorf("companion.service: TimeoutStopSec=%s; the server's shutdown may take %v (shutdownWithin) before it says what holds it and exits: systemd kills it first, without that line", stop, bound)
	}
}

// procMountOptions are the options of the /proc systemd mounts for a unit
// of settings (ProtectProc=, ProcSubset=; systemd.exec(5)).
func procMountOptions(settings map[string][]string) string {
	last := func(k string) string {
		if v := settings[k]; len(v) > 0 {
			return v[len(v)-1]
		}
		return ""
	}
	var opts []string
	switch p := last("ProtectProc"); p {
	case "invisible", "noaccess", "ptraceable":
		opts = append(opts, "hidepid="+p)
	}
	if last("ProcSubset") == "pid" {
		opts = append(opts, "subset=pid")
	}
	if len(opts) == 0 {
		return "defaults"
	}
	return strings.Join(opts, ",")
}

// Under its unit's /proc (ProtectProc=, ProcSubset=), each binary's
// --metrics still serves process_start_time_seconds, which
// docs/operations.md's CompanionRestarting alert counts restarts with.
// ProcSubset=pid hid /proc/stat, the boot time the start time is reckoned
// from, and the process collector left the series out without a word: a
// unit restarted in a loop raised no alert. Bug 401.
func TestMetricsUnderTheUnitsProc(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounts a /proc of the unit's options in a mount namespace: needs root")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skipf("unshare (util-linux) is needed: %v", err)
	}
	bins := builtCommands(t)
	for _, tc := range []struct {
		unit, command string
		args          []string
	}{
		{"companion.service", "companion", []string{"serve",
			"--http", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--mqtt-listen", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))}},
		{"companion-bridge.service", "companion-bridge", []string{
			"--mqtt-url", "tcp://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001"}},
	} {
		t.Run(tc.unit, func(t *testing.T) {
			bin := filepath.Join(bins, tc.command)
			opts := procMountOptions(serviceSettings(t, tc.unit))
			metricsAddr := "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))
			args := append([]string{"-m", "--propagation", "private", "sh", "-c",
				`mount -t proc -o "$0" proc /proc && exec "$@"`, opts, bin},
				append(tc.args, "--data", t.TempDir(), "--metrics", metricsAddr)...)
			var log testenv.Buffer
			cmd := exec.Command(unshare, args...)
			cmd.Stdout, cmd.Stderr = &log, &log
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			t.Cleanup(func() {
				cmd.Process.Signal(syscall.SIGTERM)
				<-exited
			})
			var body string
			testenv.Eventually(t, time.Minute, tc.command+"'s /metrics", func() bool {
				select {
				case err := <-exited:
					exited <- err
					t.Fatalf("%s under /proc of %s ended: %v\n%s", tc.command, opts, err, log.String())
				default:
				}
				resp, err := http.Get("http://" + metricsAddr + "/metrics")
				if err != nil {
					return false
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				body = string(b)
				return resp.StatusCode == http.StatusOK
			})
			for _, name := range []string{"process_start_time_seconds", "process_open_fds", "process_max_fds"} {
				if !strings.Contains(body, "\n"+name+" ") {
					t.Errorf("%s under %s's /proc (%s): /metrics has no %s", tc.command, tc.unit, opts, name)
				}
			}
		})
	}
}

// A server on a damaged store, and a bridge on a damaged spool, stop with
// an exit status their unit does not restart: each start would read the
// file through and refuse it again, every RestartSec for good (the start
// limit, 5 starts in 10 s, never catches a unit restarted every 2 s),
// with the unit "activating (auto-restart)" rather than failed. Bug 402.
func TestSystemdDoesNotRestartOnDamagedData(t *testing.T) {
	bins := builtCommands(t)
	for _, tc := range []struct {
		unit, command, file string
		args                []string
	}{
		{"companion.service", "companion", "companion.db", []string{"serve",
			"--http", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--mqtt-listen", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))}},
		{"companion-bridge.service", "companion-bridge", "spool.db", []string{
			"--mqtt-url", "tcp://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001"}},
	} {
		t.Run(tc.unit, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			bin := filepath.Join(bins, tc.command)
			data := t.TempDir()
			// Not a bbolt file: neither of its meta pages is valid.
			b := make([]byte, 3*4096)
			copy(b, "not the bbolt file it was")
			if err := os.WriteFile(filepath.Join(data, tc.file), b, 0o600); err != nil {
				t.Fatal(err)
			}
			cmd, out, err := runAsUnit(t, settings, bin, append(tc.args, "--data", data), "COMPANION_DATA="+data)
			if err == nil || !strings.Contains(string(out), tc.file) {
				t.Fatalf("%s on a damaged %s: %v\n%s", tc.command, tc.file, err, out)
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after it refused a damaged %s (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.file, cmd.ProcessState, out)
			}
		})
	}
}

// dockerInstructions returns the Dockerfile's instructions, continuation
// lines joined and comments left out, each as its keyword (upper case) and
// the rest.
func dockerInstructions(text string) [][2]string {
	var out [][2]string
	var cur strings.Builder
	for _, line := range strings.Split(text, "\n") {
		t := strings.TrimSpace(line)
		if cur.Len() == 0 && (t == "" || strings.HasPrefix(t, "#")) {
			continue
		}
		if strings.HasSuffix(t, "\\") {
			cur.WriteString(strings.TrimSuffix(t, "\\") + " ")
			continue
		}
		cur.WriteString(t)
		kw, rest, _ := strings.Cut(cur.String(), " ")
		out = append(out, [2]string{strings.ToUpper(kw), strings.TrimSpace(rest)})
		cur.Reset()
	}
	return out
}

// BuildKit's automatic platform arguments (docs.docker.com, "Automatic
// platform ARGs in the global scope").
var platformArgs = []string{"TARGETPLATFORM", "TARGETOS", "TARGETARCH", "TARGETVARIANT", "BUILDPLATFORM", "BUILDOS", "BUILDARCH", "BUILDVARIANT"}

// The images build for the platform asked for (docker buildx build
// --platform linux/arm64): the build stage's go build runs with the
// GOOS/GOARCH/GOARM of the target. The stage's ARGs are resolved as
// BuildKit's dockerfile2llb does (dispatchArg): a --build-arg wins, then
// the ARG's own default, and only an ARG without one takes BuildKit's
// automatic value. "ARG TARGETARCH=amd64" kept amd64 for every platform:
// arm64 and arm/v7 images held an amd64 binary ("exec format error" on
// the gateway). The RUN line is run by sh with a stub go that records
// what it was asked to build for. Bug 403.
func TestDockerfilesBuildForTheTargetPlatform(t *testing.T) {
	root := repoRoot(t)
	for _, c := range commands {
		t.Run(c, func(t *testing.T) {
			ins := dockerInstructions(readFile(t, filepath.Join(root, "packaging", "docker", c+".Dockerfile")))
			// The build stage: from the FROM … AS build to the next FROM.
			var stage [][2]string
			in := false
			for _, i := range ins {
				if i[0] == "FROM" {
					in = strings.HasSuffix(strings.ToLower(i[1]), " as build")
					continue
				}
				if in {
					stage = append(stage, i)
				}
			}
			var build string
			for _, i := range stage {
				if i[0] == "RUN" && strings.Contains(i[1], "go build") {
					build = i[1]
				}
			}
			if build == "" {
				t.Fatalf("%s.Dockerfile: no build stage (FROM … AS build) with a RUN of go build", c)
			}
			for _, p := range []struct{ platform, want string }{
				{"linux/amd64", "linux amd64"},
				{"linux/arm64", "linux arm64"},
				{"linux/arm/v7", "linux arm 7"},
			} {
				parts := strings.Split(p.platform, "/")
				auto := map[string]string{
					"TARGETPLATFORM": p.platform, "TARGETOS": parts[0], "TARGETARCH": parts[1], "TARGETVARIANT": "",
					"BUILDPLATFORM": "linux/" + runtime.GOARCH, "BUILDOS": "linux", "BUILDARCH": runtime.GOARCH, "BUILDVARIANT": "",
				}
				if len(parts) == 3 {
					auto["TARGETVARIANT"] = parts[2]
				}
				buildArgs := map[string]string{"VERSION": "v0.0.0-platformtest"}
				dir := t.TempDir()
				stub := filepath.Join(dir, "stub")
				if err := os.MkdirAll(stub, 0o755); err != nil {
					t.Fatal(err)
				}
				record := filepath.Join(dir, "built-for")
				script := "#!/bin/sh\n[ \"$1\" = build ] && echo \"$GOOS $GOARCH${GOARM:+ $GOARM}\" > " + record + "\nexit 0\n"
				if err := os.WriteFile(filepath.Join(stub, "go"), []byte(script), 0o755); err != nil {
					t.Fatal(err)
				}
				env := []string{"PATH=" + stub + ":/usr/bin:/bin"}
				for _, i := range stage {
					if i[0] != "ARG" {
						continue
					}
					for _, a := range strings.Fields(i[1]) {
						k, def, hasDefault := strings.Cut(a, "=")
						if v, ok := buildArgs[k]; ok {
							env = append(env, k+"="+v)
						} else if hasDefault {
							env = append(env, k+"="+def)
						} else if v, ok := auto[k]; ok && slices.Contains(platformArgs, k) {
							env = append(env, k+"="+v)
						}
					}
				}
				cmd := exec.Command("sh", "-c", strings.ReplaceAll(build, "/out", filepath.Join(dir, "out")))
				cmd.Dir, cmd.Env = dir, env
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("RUN %s: %v\n%s", build, err, out)
				}
				got, err := os.ReadFile(record)
				if err != nil {
					t.Fatalf("RUN %s ran no go build: %v", build, err)
				}
				if strings.TrimSpace(string(got)) != p.want {
					t.Errorf("%s.Dockerfile, --platform %s: go build for GOOS GOARCH GOARM %q; want %q (the image's platform)", c, p.platform, strings.TrimSpace(string(got)), p.want)
				}
			}
		})
	}
}

// A file a flag names that the binary cannot load (a TLS key only root may
// read, which the unit's dynamic user cannot; a path mistyped in the env
// file) is a mistake of the configuration, as a flag's wrong value is:
// exit status 2, not restarted, with the flag named. With exit status 1
// the unit restarted it every 2 s for good. Bug 404.
func TestSystemdDoesNotRestartOnUnreadableFlagFiles(t *testing.T) {
	bins := builtCommands(t)
	missing := filepath.Join(t.TempDir(), "missing.pem")
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	for _, tc := range []struct {
		name, unit, command, flag string
		args                      []string
	}{
		{"HTTPS key", "companion.service", "companion", "--tls-key", []string{"serve", "--http", free(), "--mqtt-listen", free(),
			"--tls-cert", missing, "--tls-key", missing}},
		{"embedded broker's key", "companion.service", "companion", "--mqtt-tls-key", []string{"serve", "--http", free(), "--mqtt-listen", free(),
			"--mqtt-tls-cert", missing, "--mqtt-tls-key", missing}},
		{"broker's CA", "companion.service", "companion", "--mqtt-ca", []string{"serve", "--http", free(),
			"--mqtt-url", "mqtts://" + free(), "--mqtt-dynsec=false", "--mqtt-ca", missing}},
		{"bridge's CA", "companion-bridge.service", "companion-bridge", "--ca", []string{"--mqtt-url", "mqtts://" + free(),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001", "--ca", missing}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			cmd, out, err := runAsUnit(t, settings, filepath.Join(bins, tc.command), append(tc.args, "--data", t.TempDir()))
			if err == nil {
				t.Fatalf("%s started with %s naming a missing file:\n%s", tc.command, tc.flag, out)
			}
			if !strings.Contains(string(out), tc.flag) || !strings.Contains(string(out), missing) {
				t.Errorf("%s: the message does not name %s and its file %s:\n%s", tc.command, tc.flag, missing, out)
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after %s named a file it cannot read (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.flag, cmd.ProcessState, out)
			}
		})
	}
}

// What the repository's .gitignore keeps out of git (local state: a
// server's data/, a bridge's default ./bridge-data spool and blob cache,
// make cluster's cluster/ with PostgreSQL's and NATS's data and
// cluster.json's admin token and secrets) is kept out of the images'
// build context too: COPY . . put it into the build stage, its layer and
// its cache (docker buildx --cache-to mode=max exports it), and sent it
// with every build. Bug 405.
func TestDockerignoreKeepsOutWhatGitIgnores(t *testing.T) {
	root := repoRoot(t)
	norm := func(p string) string { return strings.Trim(strings.TrimSpace(p), "/") }
	var ignored []string
	for _, l := range strings.Split(readFile(t, filepath.Join(root, ".gitignore")), "\n") {
		if l = norm(l); l != "" && !strings.HasPrefix(l, "#") && !strings.HasPrefix(l, "!") {
			ignored = append(ignored, l)
		}
	}
	for _, c := range commands {
		name := c + ".Dockerfile.dockerignore"
		kept := map[string]bool{}
		for _, l := range strings.Split(readFile(t, filepath.Join(root, "packaging", "docker", name)), "\n") {
			kept[norm(l)] = true
		}
		for _, g := range ignored {
			if !kept[g] {
				t.Errorf("%s does not keep out %s, which .gitignore ignores", name, g)
			}
		}
	}
}

// An env file that holds, or has a line for, a secret (a password, a
// token, a bridge's secret) says to install it readable by root alone,
// as companion-bridge.env does: companion.env has lines for the broker's
// password and the TLS key's path, and said nothing, so it was installed
// as copied, 0644, readable by every local user. Bug 406.
func TestEnvFilesWithSecretsSayMode0600(t *testing.T) {
	root := repoRoot(t)
	for _, name := range []string{"companion.env", "companion-bridge.env"} {
		text := readFile(t, filepath.Join(root, "packaging", "systemd", name))
		var secrets []string
		for _, line := range strings.Split(text, "\n") {
			k, _, ok := strings.Cut(strings.TrimPrefix(line, "#"), "=")
			if !ok || !strings.HasPrefix(k, "COMPANION_") {
				continue
			}
			for _, w := range []string{"PASSWORD", "SECRET", "TOKEN"} {
				if strings.Contains(k, w) {
					secrets = append(secrets, k)
				}
			}
		}
		if len(secrets) > 0 && !strings.Contains(text, "mode 0600") {
			t.Errorf("%s has lines for %v but does not say to install it with mode 0600", name, secrets)
		}
	}
}

// Each binary says its version as it starts, in the journal: --version
// tells the file on disk, which after an upgrade is not the build a unit
// still runs until it is restarted, nor, for a bridge on a gateway, one
// the operator can ask. Before, neither start-up line named it. Bug 407.
func TestStartupSaysTheVersion(t *testing.T) {
	dir := builtCommands(t)
	const stamp = builtStamp
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	for _, tc := range []struct {
		command, started string
		args             []string
	}{
		{"companion", "companion: HTTP API on", []string{"serve", "--http", free(), "--mqtt-listen", free()}},
		{"companion-bridge", "companion-bridge starting", []string{"--mqtt-url", "tcp://" + free(),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001"}},
	} {
		t.Run(tc.command, func(t *testing.T) {
			bin := filepath.Join(dir, tc.command)
			cmd := exec.Command(bin, append(tc.args, "--data", t.TempDir())...)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = cmd.Stdout
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				cmd.Process.Signal(syscall.SIGTERM)
				io.Copy(io.Discard, out)
				cmd.Wait()
			}()
			sc := bufio.NewScanner(out)
			var seen []string
			for sc.Scan() {
				seen = append(seen, sc.Text())
				if strings.Contains(sc.Text(), tc.started) {
					if !strings.Contains(sc.Text(), stamp) {
						t.Errorf("%s's start-up line does not say its version %s:\n%s", tc.command, stamp, sc.Text())
					}
					return
				}
			}
			t.Fatalf("%s ended without %q:\n%s", tc.command, tc.started, strings.Join(seen, "\n"))
		})
	}
}

// The server's image is run, as the README and the Dockerfile show it,
// with a stop timeout longer than the server's own shutdown bound
// (shutdownWithin): docker stop's default is 10 s, and a Kubernetes pod's
// 30 s, after which the SIGKILL cuts the requests still answering and the
// line saying what holds a stop (bug 343). Bug 408.
func TestDockerRunStopTimeoutOutlastsShutdown(t *testing.T) {
	root := repoRoot(t)
	bound := goDuration(t, "cmd/companion/serve.go", "shutdownWithin")
	for _, rel := range []string{"README.md", "packaging/docker/companion.Dockerfile"} {
		var found bool
		for _, line := range strings.Split(readFile(t, filepath.Join(root, rel)), "\n") {
			if !strings.Contains(line, "docker run") || !strings.Contains(line, "companion-data:/data") {
				continue
			}
			found = true
			f := strings.Fields(line)
			i := slices.Index(f, "--stop-timeout")
			if i < 0 || i+1 == len(f) {
				t.Errorf("%s: %q gives no --stop-timeout: docker stop kills the server after 10 s; its shutdown may take %v", rel, strings.TrimSpace(line), bound)
				continue
			}
			s, err := strconv.Atoi(f[i+1])
			if err != nil || time.Duration(s)*time.Second < bound+10*time.Second {
				t.Errorf("%s: --stop-timeout %s; the server's shutdown may take %v", rel, f[i+1], bound)
			}
		}
		if !found {
			t.Errorf("%s has no docker run line of the server's image", rel)
		}
	}
}

// The bridge's image says how to watch it with something an operator can
// read: it told them to watch the bridge's retained
// companion/v1/bridges/ID/state topic, to which no user may subscribe
// (README, "Watching the MQTT traffic": SUBACK 0x80 on every broker). It
// names a metric of --metrics that the bridge has. Bug 409.
func TestBridgeImageSaysHowToWatchIt(t *testing.T) {
	root := repoRoot(t)
	var header []string
	for _, l := range strings.Split(readFile(t, filepath.Join(root, "packaging", "docker", "companion-bridge.Dockerfile")), "\n") {
		if !strings.HasPrefix(l, "#") {
			break
		}
		header = append(header, strings.TrimSpace(strings.TrimPrefix(l, "#")))
	}
	text := strings.Join(header, " ")
	if strings.Contains(text, "/state topic") && strings.Contains(text, "watch the bridge's retained") {
		t.Errorf("companion-bridge.Dockerfile tells to watch the bridge's state topic, which no user may subscribe to:\n%s", strings.Join(header, "\n"))
	}
	var metricsSrc strings.Builder
	files, _ := filepath.Glob(filepath.Join(root, "internal", "metrics", "*.go"))
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") {
			metricsSrc.WriteString(readFile(t, f))
		}
	}
	var named int
	for _, w := range strings.FieldsFunc(text, func(r rune) bool { return r != '_' && !('a' <= r && r <= 'z') }) {
		if strings.HasPrefix(w, "companion_") {
			named++
			if !strings.Contains(metricsSrc.String(), `"`+w+`"`) {
				t.Errorf("companion-bridge.Dockerfile names %s, which no collector registers", w)
			}
		}
	}
	if named == 0 || !strings.Contains(text, "COMPANION_METRICS") {
		t.Errorf("companion-bridge.Dockerfile does not say how to watch the bridge (--metrics, COMPANION_METRICS, and a metric):\n%s", strings.Join(header, "\n"))
	}
}

// On the host of a server installed with companion.service, the admin
// CLI run as docs/provisioning.md and README show it (no --data) finds no
// admin.token in ./data: it says where the unit keeps it (its
// StateDirectory under /var/lib) and how to point it there. Before, it
// said only "none readable in ./data". Bug 410.
func TestAdminCLISaysWhereTheUnitKeepsTheToken(t *testing.T) {
	dirs := serviceSettings(t, "companion.service")["StateDirectory"]
	if len(dirs) == 0 {
		t.Fatal("companion.service has no StateDirectory")
	}
	state := "/var/lib/" + dirs[len(dirs)-1]
	bin := filepath.Join(builtCommands(t), "companion")
	cmd := exec.Command(bin, "user", "create", "alice", "--api-url", "http://127.0.0.1:"+strconv.Itoa(testenv.FreePort(t)))
	cmd.Dir = t.TempDir()
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "COMPANION_") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("user create without a token succeeded:\n%s", out)
	}
	for _, want := range []string{"--data " + state, "COMPANION_DATA"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the CLI without an admin token does not say %q (companion.service keeps it in %s):\n%s", want, state, out)
		}
	}
}

// A server on a store, and a bridge on a spool, that a newer build wrote
// (the binary taken back to an older one) refuse it with an exit status
// their unit does not restart, and say what to do: each start refuses it
// again until a person installs the newer build again or moves the file
// aside, so a restart every RestartSec only hid it, the unit "activating
// (auto-restart)" rather than failed. Bug 433.
func TestSystemdDoesNotRestartOnNewerData(t *testing.T) {
	bins := builtCommands(t)
	for _, tc := range []struct {
		unit, command, file, bucket, key, version, hint string
		args                                            []string
	}{
		{"companion.service", "companion", "companion.db", "meta", "schema_version", "9999", "newer", []string{"serve",
			"--http", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--mqtt-listen", "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t))}},
		{"companion-bridge.service", "companion-bridge", "spool.db", "meta", "version", "99", "newer", []string{
			"--mqtt-url", "tcp://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001"}},
	} {
		t.Run(tc.unit, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			data := t.TempDir()
			db, err := bolt.Open(filepath.Join(data, tc.file), 0o600, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = db.Update(func(tx *bolt.Tx) error {
				b, err := tx.CreateBucketIfNotExists([]byte(tc.bucket))
				if err != nil {
					return err
				}
				return b.Put([]byte(tc.key), []byte(tc.version))
			})
			if cerr := db.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
			cmd, out, err := runAsUnit(t, settings, filepath.Join(bins, tc.command), append(tc.args, "--data", data), "COMPANION_DATA="+data)
			if err == nil || !strings.Contains(string(out), tc.file) || !strings.Contains(string(out), tc.hint) {
				t.Fatalf("%s on a %s of a newer build: %v; want a refusal naming the file and saying it is %s:\n%s",
					tc.command, tc.file, err, tc.hint, out)
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after it refused a %s of a newer build (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.file, cmd.ProcessState, out)
			}
		})
	}
}

// A directory a flag names that the unit's sandbox leaves read-only
// (COMPANION_DATA or --sim-state outside the unit's StateDirectory, under
// ProtectSystem=strict) fails at every start: the binary says which flag,
// which directory and what to add to the unit (ReadWritePaths=), and exits
// with a status the unit does not restart. Before, "mkdir …: read-only
// file system", exit status 1, restarted every 2 s for good. Bug 435. The
// read-only directory is a read-only bind mount in a user and mount
// namespace of its own (unshare -rm), as systemd makes it.
func TestSystemdDoesNotRestartOnReadOnlyDirectories(t *testing.T) {
	bins := builtCommands(t)
	unshare := unshareRM(t, "to make a read-only directory with")
	ro := t.TempDir()
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	bridge := []string{"--mqtt-url", "tcp://" + free(), "--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001"}
	for _, tc := range []struct {
		name, unit, command, flag, dir string
		args                           []string
	}{
		{"server's --data", "companion.service", "companion", "--data", filepath.Join(ro, "data"),
			[]string{"serve", "--http", free(), "--mqtt-listen", free(), "--data", filepath.Join(ro, "data")}},
		{"server's --data there", "companion.service", "companion", "--data", ro,
			[]string{"serve", "--http", free(), "--mqtt-listen", free(), "--data", ro}},
		{"bridge's --data", "companion-bridge.service", "companion-bridge", "--data", filepath.Join(ro, "spool"),
			append(slices.Clone(bridge), "--data", filepath.Join(ro, "spool"))},
		{"bridge's --sim-state", "companion-bridge.service", "companion-bridge", "--sim-state", filepath.Join(ro, "sim"),
			append(slices.Clone(bridge), "--data", t.TempDir(), "--sim-state", filepath.Join(ro, "sim"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			args := append([]string{"-rm", "sh", "-c", `mount -o bind,ro "$0" "$0" && exec "$@"`, ro, filepath.Join(bins, tc.command)}, tc.args...)
			cmd, out, err := runAsUnit(t, settings, unshare, args)
			if err == nil {
				t.Fatalf("%s started with %s read-only:\n%s", tc.command, tc.flag, out)
			}
			for _, want := range []string{tc.flag + " " + tc.dir, "read-only", "ReadWritePaths=" + tc.dir} {
				if !strings.Contains(string(out), want) {
					t.Errorf("%s: the message does not say %q:\n%s", tc.command, want, out)
				}
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after %s named a read-only directory (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.flag, cmd.ProcessState, out)
			}
		})
	}
}

// A port below 1024 (--http :443 with no proxy in front) cannot be bound
// by a process without CAP_NET_BIND_SERVICE in the host's user namespace:
// not by the server of companion.service, whose PrivateUsers=yes gives it
// a user namespace of its own, even with AmbientCapabilities= granting it.
// The binary said "bind: permission denied", naming no flag and nothing to
// do, and exited with status 1, restarted every 2 s for good. It now names
// the flag, the capability and the unit's settings, and exits with a
// status the unit does not restart (bug 475). The process runs in a user
// namespace of its own (unshare -r), as PrivateUsers=yes runs it.
func TestSystemdDoesNotRestartOnAPrivilegedPort(t *testing.T) {
	bins := builtCommands(t)
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatalf("no unshare(1) (Debian's util-linux) to run the binary in a user namespace of its own: %v", err)
	}
	privileged := privilegedPort(t)
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	for _, tc := range []struct {
		unit, command, flag string
		args                []string
	}{
		{"companion.service", "companion", "--http", []string{"serve", "--http", privileged, "--mqtt-listen", free()}},
		{"companion.service", "companion", "--mqtt-listen", []string{"serve", "--http", free(), "--mqtt-listen", privileged}},
		{"companion-bridge.service", "companion-bridge", "--metrics", []string{"--mqtt-url", "tcp://" + free(),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001", "--metrics", privileged}},
	} {
		t.Run(tc.command+" "+tc.flag, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			args := append([]string{"-r", filepath.Join(bins, tc.command)}, append(tc.args, "--data", t.TempDir())...)
			cmd, out, err := runAsUnit(t, settings, unshare, args)
			if err == nil {
				t.Fatalf("%s started with %s on a port below 1024 in a user namespace of its own:\n%s", tc.command, tc.flag, out)
			}
			for _, want := range []string{tc.flag + " " + privileged, "CAP_NET_BIND_SERVICE", "PrivateUsers=no", "1024 or above"} {
				if !strings.Contains(string(out), want) {
					t.Errorf("%s: the message does not say %q:\n%s", tc.command, want, out)
				}
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after %s named a port it may not bind (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.flag, cmd.ProcessState, out)
			}
		})
	}
}

// privilegedPort returns a loopback address of a port below the first
// one the kernel lets any process bind (net.ipv4.ip_unprivileged_port_start,
// 1024 by default) that is free: this process, root, may bind it, and
// does so only to find it free.
func privilegedPort(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_unprivileged_port_start")
	if err != nil {
		t.Fatal(err)
	}
	start, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || start < 2 {
		t.Fatalf("net.ipv4.ip_unprivileged_port_start is %q: no port is privileged here", b)
	}
	for p := min(start, 1024) - 1; p > 0; p-- {
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err == nil {
			ln.Close()
			return ln.Addr().String()
		}
	}
	t.Fatal("no privileged port is free (run the tests as root)")
	return ""
}

// A listen address another process holds (the embedded broker's 1883 with
// Debian's Mosquitto installed, a second server on the same --http) fails
// at every start until a person frees it or gives another: the binary
// names the flag and the address, and exits with a status the unit does
// not restart. Before, "bind: address already in use", exit status 1,
// restarted every 2 s for good. Bug 436.
func TestSystemdDoesNotRestartOnAddressInUse(t *testing.T) {
	bins := builtCommands(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	busy := taken.Addr().String()
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	for _, tc := range []struct {
		unit, command, flag string
		args                []string
	}{
		{"companion.service", "companion", "--http", []string{"serve", "--http", busy, "--mqtt-listen", free()}},
		{"companion.service", "companion", "--mqtt-listen", []string{"serve", "--http", free(), "--mqtt-listen", busy}},
		{"companion.service", "companion", "--metrics", []string{"serve", "--http", free(), "--mqtt-listen", free(), "--metrics", busy}},
		{"companion-bridge.service", "companion-bridge", "--metrics", []string{"--mqtt-url", "tcp://" + free(),
			"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--sim-devices", "sim-001", "--metrics", busy}},
	} {
		t.Run(tc.command+" "+tc.flag, func(t *testing.T) {
			settings := serviceSettings(t, tc.unit)
			cmd, out, err := runAsUnit(t, settings, filepath.Join(bins, tc.command), append(tc.args, "--data", t.TempDir()))
			if err == nil {
				t.Fatalf("%s started with %s on an address in use:\n%s", tc.command, tc.flag, out)
			}
			if !strings.Contains(string(out), tc.flag+" "+busy) || !strings.Contains(string(out), "another process") {
				t.Errorf("%s: the message does not name %s %s and say another process holds it:\n%s", tc.command, tc.flag, busy, out)
			}
			if restarts(t, settings, cmd.ProcessState) {
				t.Errorf("%s restarts %s after %s named an address in use (%v), every RestartSec for good:\n%s",
					tc.unit, tc.command, tc.flag, cmd.ProcessState, out)
			}
		})
	}
}

// A --store PostgreSQL refuses (a wrong password, a database or role that
// does not exist) refuses it again at every start until a person mends
// the env file or the database: the server names --store and what to
// mend, and exits with a status the unit does not restart. A PostgreSQL
// not up yet (connection refused, at boot) is restarted, as before: it
// passes by itself. Before, both were exit status 1, and the first was
// restarted every 2 s for good. Bug 437.
func TestSystemdDoesNotRestartOnPostgresRefusal(t *testing.T) {
	bins := builtCommands(t)
	pg := pgtest.Start(t)
	db := pg.NewDatabase(t)
	u, err := url.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	with := func(edit func(u *url.URL)) string {
		c := *u
		edit(&c)
		return c.String()
	}
	free := func() string { return "127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)) }
	for _, tc := range []struct {
		name, store, want string
		restart           bool
	}{
		{"wrong password", with(func(u *url.URL) { u.User = url.UserPassword(u.User.Username(), "wrong") }), "password", false},
		{"no such database", with(func(u *url.URL) { u.Path = "/no_such_database" }), "no_such_database", false},
		{"no such role", with(func(u *url.URL) { u.User = url.UserPassword("no_such_role", "x") }), "no_such_role", false},
		{"not up yet", with(func(u *url.URL) { u.Host = free() }), "connect", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			settings := serviceSettings(t, "companion.service")
			cmd, out, err := runAsUnit(t, settings, filepath.Join(bins, "companion"), []string{"serve", "--http", free(), "--mqtt-listen", free(),
				"--store", tc.store, "--data", t.TempDir()})
			if err == nil {
				t.Fatalf("companion started on --store with %s:\n%s", tc.name, out)
			}
			if !strings.Contains(string(out), "--store") || !strings.Contains(string(out), tc.want) {
				t.Errorf("the message does not name --store and %q:\n%s", tc.want, out)
			}
			if got := restarts(t, settings, cmd.ProcessState); got != tc.restart {
				t.Errorf("companion.service restarts companion after --store with %s (%v): %v; want %v:\n%s",
					tc.name, cmd.ProcessState, got, tc.restart, out)
			}
		})
	}
}

// A bridge whose user the system bus's policy for org.bluez refuses (a
// distribution that lets only the "bluetooth" group call BlueZ, the unit
// without SupplementaryGroups=bluetooth) is refused again at every start:
// it says what to add and exits with a status the unit does not restart.
// Before, exit status 1, restarted every 2 s for good. Bug 438.
func TestSystemdDoesNotRestartWhenBlueZRefusesTheUser(t *testing.T) {
	bins := builtCommands(t)
	fakebluez.NewRefusing(t) // sets DBUS_SYSTEM_BUS_ADDRESS for the bridge
	settings := serviceSettings(t, "companion-bridge.service")
	cmd, out, err := runAsUnit(t, settings, filepath.Join(bins, "companion-bridge"), []string{"--mqtt-url", "tcp://127.0.0.1:" + strconv.Itoa(testenv.FreePort(t)),
		"--bridge-id", "bridge-1", "--bridge-secret", "secret", "--gatt", "bluez", "--devices", "dev-1", "--data", t.TempDir()})
	if err == nil || !strings.Contains(string(out), "SupplementaryGroups=bluetooth") {
		t.Fatalf("companion-bridge with BlueZ refusing its user: %v; want a refusal saying SupplementaryGroups=bluetooth:\n%s", err, out)
	}
	if restarts(t, settings, cmd.ProcessState) {
		t.Errorf("companion-bridge.service restarts companion-bridge after BlueZ refused its user (%v), every RestartSec for good:\n%s",
			cmd.ProcessState, out)
	}
}

// The units start after what they talk to when it runs on the same host
// (PostgreSQL, Mosquitto, NATS; BlueZ for the bridge) and, as systemd
// stops in the reverse order, stop before it: at boot the server's first
// start did not find PostgreSQL up, failed ("--store: postgres: failed to
// connect … connection refused") and was restarted, and at shutdown the
// server's last requests and commits raced PostgreSQL's and Mosquitto's
// own stop. After= only orders: a unit not installed is no dependency,
// and none of them is pulled in (no Wants=/Requires=), since each may run
// on another host. Bug 441.
func TestSystemdUnitsOrderAfterLocalServices(t *testing.T) {
	for unit, want := range map[string][]string{
		"companion.service":        {"network-online.target", "postgresql.service", "mosquitto.service", "nats-server.service"},
		"companion-bridge.service": {"network-online.target", "bluetooth.service", "mosquitto.service"},
	} {
		t.Run(unit, func(t *testing.T) {
			section, after, pulls := "", []string{}, []string{}
			for _, line := range strings.Split(readFile(t, filepath.Join(repoRoot(t), "packaging", "systemd", unit)), "\n") {
				line = strings.TrimSpace(line)
				switch {
				case strings.HasPrefix(line, "["):
					section = line
				case section != "[Unit]" || strings.HasPrefix(line, "#"):
				case strings.HasPrefix(line, "After="):
					after = append(after, strings.Fields(strings.TrimPrefix(line, "After="))...)
				case strings.HasPrefix(line, "Wants="), strings.HasPrefix(line, "Requires="), strings.HasPrefix(line, "BindsTo="):
					_, v, _ := strings.Cut(line, "=")
					pulls = append(pulls, strings.Fields(v)...)
				}
			}
			for _, w := range want {
				if !slices.Contains(after, w) {
					t.Errorf("%s: After=%s lacks %s", unit, strings.Join(after, " "), w)
				}
			}
			for _, p := range pulls {
				if p != "network-online.target" {
					t.Errorf("%s pulls in %s, which may run on another host", unit, p)
				}
			}
		})
	}
}

// unshareRM returns the path of unshare(1), once it has made a user and
// mount namespace of its own (unshare -rm), or skips the test, which needs
// one for what why says.
func unshareRM(t *testing.T, why string) string {
	t.Helper()
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("no unshare(1) " + why)
	}
	if out, err := exec.Command(unshare, "-rm", "true").CombinedOutput(); err != nil {
		t.Skipf("unshare -rm: %v %s", err, out)
	}
	return unshare
}
