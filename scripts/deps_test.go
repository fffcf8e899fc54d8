// Package scripts holds the tests of the project's shell scripts.
package scripts

import (
	"context"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// make deps, run by a user who cannot install packages on a machine that
// has none of them, stops at once with the command to run, and installs
// nothing.
func TestDepsNamesTheCommandWhenItCannotInstall(t *testing.T) {
	empty := t.TempDir() // a machine without the packages
	if err := os.Chmod(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	script, err := filepath.Abs("deps")
	if err != nil {
		t.Fatal(err)
	}
	var cmd *exec.Cmd
	if os.Geteuid() == 0 {
		// As root, run it as nobody, who may not install.
		runuser, err := exec.LookPath("runuser")
		if err != nil {
			t.Fatalf("runuser (Debian's util-linux) is needed to run the script as another user: %v", err)
		}
		if _, err := user.Lookup("nobody"); err != nil {
			t.Fatalf("no user nobody to run the script as: %v", err)
		}
		cmd = exec.CommandContext(ctx, runuser, "-u", "nobody", "--", "bash", script)
	} else {
		cmd = exec.CommandContext(ctx, "bash", script)
		if _, err := exec.LookPath("sudo"); err == nil && exec.Command("sudo", "-n", "true").Run() == nil {
			t.Fatal("this user may install packages (sudo without a password); run the test as root or as a user who may not")
		}
	}
	cmd.Env = append(cmd.Environ(), "DEPS_ROOT="+empty)
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("deps succeeded without the packages:\n%s", out)
	}
	for _, want := range []string{
		"cannot install packages",
		"sudo sh -c 'apt-get update && apt-get install -y --no-install-recommends mosquitto mosquitto-clients dbus postgresql curl systemd'",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "nats-server") {
		t.Errorf("it went on to NATS Server instead of stopping:\n%s", out)
	}
}
