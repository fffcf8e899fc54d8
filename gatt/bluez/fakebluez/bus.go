// Package fakebluez is a fake BlueZ for tests: it starts a private
// dbus-daemon, points DBUS_SYSTEM_BUS_ADDRESS at it and exports org.bluez on
// it (ObjectManager, Adapter1, Device1, GattService1, GattCharacteristic1),
// with each device's GATT server played by a gatt.Peripheral. Code that talks
// to BlueZ over D-Bus, such as package bluez, then runs unchanged against
// it.
//
// It answers the calls those clients make, the way BlueZ 5.6x answers them;
// it is not a Bluetooth stack: there is no pairing, no advertising data but
// the service UUIDs, and no ATT timing.
package fakebluez

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/devicecompanion/companion/internal/testenv"
)

// DaemonPath is where Debian's dbus package installs the bus daemon.
const DaemonPath = "/usr/bin/dbus-daemon"

// busConfig is a system-bus-like configuration that lets every local user
// own any name and send anything: the test owns org.bluez itself.
const busConfig = `<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="signal"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>%s
  </policy>
</busconfig>
`

// StartBus starts a private dbus-daemon listening on a socket in a
// temporary directory, sets DBUS_SYSTEM_BUS_ADDRESS to it for the rest of
// the test, and returns the address. The daemon is killed in tb.Cleanup.
//
// Without dbus-daemon the test fails, naming make deps, which installs it.
func StartBus(tb testing.TB) string {
	tb.Helper()
	addr, _ := startBus(tb)
	return addr
}

// startBus is StartBus, with a function that kills the daemon and waits
// for it to exit.
func startBus(tb testing.TB) (string, func()) {
	tb.Helper()
	return startBusWith(tb, "")
}

// startBusWith is startBus with policy rules added to the default
// context, after those that allow everything.
func startBusWith(tb testing.TB, policy string) (string, func()) {
	tb.Helper()
	daemon := DaemonPath
	if _, err := os.Stat(daemon); err != nil {
		p, lerr := exec.LookPath("dbus-daemon")
		if lerr != nil {
			tb.Fatalf("fakebluez: no dbus-daemon: run make deps (it installs Debian's dbus): %v", err)
		}
		daemon = p
	}
	// Unix socket paths are limited to 108 bytes; t.TempDir can be long.
	dir, err := os.MkdirTemp("", "fakebluez")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "system_bus_socket")
	conf := filepath.Join(dir, "system.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(busConfig, sock, policy)), 0o600); err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(daemon, "--config-file="+conf, "--nofork", "--nopidfile", "--nosyslog", "--print-address=1")
	testenv.EndsWithTestBinary(cmd)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatalf("fakebluez: start dbus-daemon: %v", err)
	}
	ready := make(chan string, 1)
	exited := make(chan struct{})
	go func() {
		// The daemon prints its address once it listens; then drain.
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			ready <- strings.TrimSpace(sc.Text())
		}
		for sc.Scan() {
		}
		cmd.Wait()
		close(exited)
	}()
	addr := "unix:path=" + sock
	tb.Setenv("DBUS_SYSTEM_BUS_ADDRESS", addr)
	kill := func() {
		cmd.Process.Kill()
		<-exited
	}
	tb.Cleanup(kill)
	select {
	case <-ready:
	case <-exited:
		tb.Fatal("fakebluez: dbus-daemon exited before listening")
	case <-time.After(10 * time.Second):
		tb.Fatal("fakebluez: dbus-daemon did not start listening")
	}
	return addr, kill
}

// macPath is the object path BlueZ gives a device of adapter.
func macPath(adapter dbus.ObjectPath, addr string) dbus.ObjectPath {
	return dbus.ObjectPath(string(adapter) + "/dev_" + strings.ReplaceAll(strings.ToUpper(addr), ":", "_"))
}
