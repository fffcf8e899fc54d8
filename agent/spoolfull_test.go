package agent_test

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// runChildBridge is the bridge of TestBridgeSpoolOnAFullDisk, in the child
// process: it serves three simulated devices until its stdin closes.
func runChildBridge(t *testing.T, mqttURL, dataDir string) {
	var devs []agent.Device
	for _, id := range []string{"dev-1", "dev-2", "dev-3"} {
		devs = append(devs, sim.New(sim.Options{ID: id}))
	}
	a, err := agent.New(agent.Options{
		MQTTURL:  mqttURL,
		Password: testSecret,
		BridgeID: "b1",
		DataDir:  dataDir,
		Devices:  devs,
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	if err := a.Run(ctx); err != nil {
		t.Error(err)
	}
	if err := a.Close(); err != nil {
		t.Error(err)
	}
}

// TestBridgeSpoolOnAFullDisk runs a bridge in a child process that cannot
// write a file past its spool's size (RLIMIT_FSIZE: its disk is full for
// the spool), sends it commands of 200 KiB until its spool is full, keeps
// it so a while, then gives it the space back. Every command ends, without
// a restart, once the server's repeats bring those it refused; and the
// bridge says once that its spool cannot be written and once that it is
// written again. Before, each path that writes the spool logged every
// failed try, an error a second each, and said nothing of what to do
// (docs/reliability.md, bug 165).
func TestBridgeSpoolOnAFullDisk(t *testing.T) {
	if url := os.Getenv("AGENT_CHILD_MQTT"); url != "" {
		runChildBridge(t, url, os.Getenv("AGENT_CHILD_DATA"))
		return
	}
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("prlimit (util-linux) is not installed")
	}
	// A new spool's size: bbolt grows its file 16 MiB at a time, so a
	// bridge limited to it fills it before it may grow it again.
	probe := t.TempDir()
	if err := agent.SpoolCommands(probe, nil); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(probe, "spool.db"))
	if err != nil {
		t.Fatal(err)
	}

	b := startBroker(t)
	w := newWatcher(t, b)
	var logs testenv.Buffer
	cmd := exec.Command(prlimit, "--fsize="+strconv.FormatInt(fi.Size(), 10)+":unlimited", "--",
		os.Args[0], "-test.run=^TestBridgeSpoolOnAFullDisk$")
	cmd.Env = append(os.Environ(), "AGENT_CHILD_MQTT="+b.url, "AGENT_CHILD_DATA="+t.TempDir())
	cmd.Stdout, cmd.Stderr = &logs, &logs
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		stdin.Close()
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("the bridge: %v\n%s", err, logs.String())
			}
		case <-time.After(waitLong):
			cmd.Process.Kill()
			<-exited
			t.Errorf("the bridge did not stop\n%s", logs.String())
		}
	}
	t.Cleanup(stop)
	b.waitBridgeState(t, "b1", topics.BridgeOnline, 1)

	// Each device's line waits for a command the bridge has not had yet
	// (topics.Command.After), so that the commands stay in the spool.
	devs := []string{"dev-1", "dev-2", "dev-3"}
	var firsts, cmds []topics.Command
	for _, d := range devs {
		firsts = append(firsts, command(t, d, topics.OpPushText, topics.PushText{Text: "first"}))
	}
	text := strings.Repeat("a text a full spool cannot take. ", 200<<10/33)
	for i := range 120 {
		c := command(t, devs[i%3], topics.OpPushText, topics.PushText{Text: text})
		if i < 3 {
			c.After = firsts[i].ID
		}
		cmds = append(cmds, c)
		w.send(c)
	}
	waitLog(t, &logs, "the spool cannot be written")
	// The disk stays full a while, as disks do.
	time.Sleep(3 * time.Second)
	if out, err := exec.Command(prlimit, "--pid", strconv.Itoa(cmd.Process.Pid), "--fsize=unlimited:unlimited").CombinedOutput(); err != nil {
		t.Fatalf("prlimit: %v\n%s", err, out)
	}
	// The server sends again what the bridge has not said it has, and
	// the commands the lines wait for.
	for _, c := range cmds {
		w.send(c)
	}
	for _, c := range firsts {
		w.send(c)
	}
	cmds = append(cmds, firsts...)
	for _, c := range cmds {
		w.waitFinal(c.DeviceID, c.ID)
	}
	waitLog(t, &logs, "the spool is written again")
	stop()

	var errs []string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "level=ERROR") {
			errs = append(errs, l)
		}
	}
	if len(errs) != 1 {
		t.Errorf("the bridge logged %d errors while its disk was full; want 1, that its spool cannot be written:\n%s", len(errs), strings.Join(errs, "\n"))
	}
}

// waitLog waits until the child's log says what.
func waitLog(t *testing.T, logs *testenv.Buffer, what string) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for !strings.Contains(logs.String(), what) {
		if time.Now().After(deadline) {
			t.Fatalf("the bridge never logged %q:\n%s", what, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestStatusKeptOnceTheDiskIsBack lets the spool keep a device's status,
// fails every write of the process (a file size limit of 0: a full disk)
// while the device's battery drops, and lifts the limit: the spool then
// keeps the new status, at the report's next pass. Before, the report took
// the status for kept as it asked for the write, so the one whose write
// failed was never written until the status changed again: after a
// restart the bridge reported the device with what it was before the disk
// filled (docs/reliability.md, bug 174).
func TestStatusKeptOnceTheDiskIsBack(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	b := startBroker(t)
	w := newWatcher(t, b)
	born := time.Now()
	var clock atomic.Int64 // the device's time since born
	dev := sim.New(sim.Options{ID: "dev-1", Now: func() time.Time { return born.Add(time.Duration(clock.Load())) }})
	var logs testenv.Buffer
	br := startBridge(t, b, nil, w, bridgeConfig{
		devices:  []*sim.Device{dev},
		interval: 50 * time.Millisecond,
		logger:   slog.New(slog.NewTextHandler(&logs, nil)),
	})
	battery := func(want int) func() bool {
		return func() bool {
			st, err := br.KeptStatus("dev-1")
			if err != nil {
				t.Fatal(err)
			}
			return st != nil && st.Battery != nil && *st.Battery == want
		}
	}
	testenv.Eventually(t, waitLong, "the spool to keep the status of battery 100", battery(100))

	lift := testenv.LimitFileSize(t, 0)
	clock.Store(int64(sim.DrainEvery))
	w.waitStatus("dev-1", "battery 99", func(st topics.Status) bool { return st.Battery != nil && *st.Battery == 99 })
	waitLog(t, &logs, `write="keeping a device's status"`)
	lift()
	testenv.Eventually(t, waitLong, "the spool to keep the status of battery 99", battery(99))
}

// TestRepeatsHeldOnceWhileTheSpoolFails sends a command, twenty repeats of
// it (as the server sends a command again while the bridge has not said
// it has it) and another command to a bridge whose spool cannot be written
// (a file size limit of 0: a full disk). The bridge acknowledges the
// repeats and keeps one message of each command, so that the broker holds
// two unacknowledged; once the limit is lifted both commands run, once
// each. Before, the bridge held every message it was sent until the spool
// took them, its memory growing by every repeat for as long as the disk
// stayed full (up to 65,535 messages on the embedded broker), and the
// broker's in-flight window with it (docs/reliability.md, bug 177).
func TestRepeatsHeldOnceWhileTheSpoolFails(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	b := startBroker(t)
	w := newWatcher(t, b)
	dev := newSim("dev-1")
	startBridge(t, b, nil, w, bridgeConfig{devices: []*sim.Device{dev}})
	cl, ok := b.srv.Clients.Get("companion-bridge-b1")
	if !ok {
		t.Fatal("the broker has no bridge client")
	}

	lift := testenv.LimitFileSize(t, 0)
	c := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "sent again and again"})
	d := command(t, "dev-1", topics.OpPushText, topics.PushText{Text: "sent once"})
	for range 21 {
		w.send(c)
	}
	w.send(d)
	testenv.Eventually(t, waitLong, "the broker to hold two messages the bridge has not acknowledged", func() bool {
		return cl.State.Inflight.Len() == 2
	})
	lift()
	for _, c := range []topics.Command{c, d} {
		if r := w.waitFinal("dev-1", c.ID); r.State != companion.StateSucceeded {
			t.Errorf("%s ended %s; want succeeded", c.ID, r.State)
		}
		if n := dev.Executions(c.ID); n != 1 {
			t.Errorf("Executions(%s) = %d; want 1", c.ID, n)
		}
	}
}
