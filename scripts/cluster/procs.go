package main

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/devicecompanion/companion/internal/pgctl"
)

// The processes of a cluster, in the order down stops them: the bridge
// first, then the replicas (which leave PostgreSQL and NATS without
// clients), then PostgreSQL, then the NATS nodes.
var stopOrder = [][]string{
	{"bridge"},
	{"replica-1", "replica-2", "replica-3"},
	{"postgres"},
	{"nats-1", "nats-2", "nats-3"},
}

const (
	// stopTimeout is how long down waits after SIGTERM before SIGKILL.
	stopTimeout = 15 * time.Second
	logTail     = 4 << 10
)

// proc is a process up started. Only up's own goroutine waits for it, to
// learn of an early exit; once up returns, nobody does and the process
// lives on.
type proc struct {
	name   string
	pid    int
	exited chan struct{}
	err    error // of Wait, once exited is closed
}

// spawn starts a process detached from this one: a session of its own (no
// signal of the terminal or of make reaches it), stdin from /dev/null,
// stdout and stderr appended to DIR/NAME.log, and its pid written to
// DIR/NAME.pid at once, so that down finds it even when up fails halfway.
// cred, when not nil, is the user it runs as.
func (c *cluster) spawn(name string, cred *syscall.Credential, path string, args ...string) (*proc, error) {
	logf, err := os.OpenFile(c.logPath(name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600) // 0600: command lines hold secrets
	if err != nil {
		return nil, err
	}
	// The child has its own descriptor.
	defer logf.Close()
	fmt.Fprintf(logf, "=== cluster: starting %s at %s: %s %s\n", name, time.Now().Format(time.RFC3339), path, strings.Join(args, " "))
	if err := c.saveCommand(name, cred, path, args); err != nil {
		return nil, err
	}
	cmd := exec.Command(path, args...)
	cmd.Dir = c.dir
	cmd.Env = childEnv()
	cmd.Stdout, cmd.Stderr = logf, logf
	// Setsid also makes the process the leader of a group whose id is
	// its pid: down's SIGKILL reaches PostgreSQL's backends through it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: cred}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, pid: cmd.Process.Pid, exited: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	c.procs = append(c.procs, p)
	if err := os.WriteFile(c.pidPath(name), []byte(strconv.Itoa(p.pid)+"\n"), 0o644); err != nil {
		return nil, err
	}
	return p, nil
}

// command is how a process was started, written to DIR/NAME.cmd as spawn
// starts it, for start to start it again.
type command struct {
	Path string   `json:"path"`
	Args []string `json:"args"`
	UID  *uint32  `json:"uid,omitempty"` // the user it runs as, when not this one's
	GID  *uint32  `json:"gid,omitempty"`
}

func (c *cluster) cmdPath(name string) string { return filepath.Join(c.dir, name+".cmd") }

// saveCommand writes how a process was started; 0600: command lines hold
// secrets.
func (c *cluster) saveCommand(name string, cred *syscall.Credential, path string, args []string) error {
	cmd := command{Path: path, Args: args}
	if cred != nil {
		cmd.UID, cmd.GID = &cred.Uid, &cred.Gid
	}
	b, err := json.Marshal(cmd)
	if err != nil {
		return err
	}
	return os.WriteFile(c.cmdPath(name), b, 0o600)
}

// loadCommand reads what saveCommand wrote.
func (c *cluster) loadCommand(name string) (command, *syscall.Credential, error) {
	var cmd command
	b, err := os.ReadFile(c.cmdPath(name))
	if err != nil {
		return cmd, nil, err
	}
	if err := json.Unmarshal(b, &cmd); err != nil {
		return cmd, nil, fmt.Errorf("%s: %w", c.cmdPath(name), err)
	}
	var cred *syscall.Credential
	if cmd.UID != nil && cmd.GID != nil {
		cred = &syscall.Credential{Uid: *cmd.UID, Gid: *cmd.GID}
	}
	return cmd, cred, nil
}

// childEnv is the environment of every process up starts: this one's,
// without the COMPANION_* variables that would configure the servers and
// the bridge behind their flags' backs, without the PG* ones that would
// point PostgreSQL's programs elsewhere, and with a C locale.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "COMPANION_") {
			env = append(env, kv)
		}
	}
	return pgctl.Env(env)
}

func (c *cluster) logPath(name string) string { return filepath.Join(c.dir, name+".log") }
func (c *cluster) pidPath(name string) string { return filepath.Join(c.dir, name+".pid") }

// logTail returns the end of a process's log, for an error message.
func (c *cluster) logTail(name string) string {
	b, err := os.ReadFile(c.logPath(name))
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	if len(b) > logTail {
		b = b[len(b)-logTail:]
	}
	return string(b)
}

// pids returns the cluster's processes under dir, name → pid, from
// cluster.json and from the pid files up writes as it starts each one.
func pids(dir string) map[string]int {
	out := map[string]int{}
	if info, err := readInfo(dir); err == nil {
		for name, pid := range info.PIDs {
			out[name] = pid
		}
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.pid"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 {
			out[strings.TrimSuffix(filepath.Base(f), ".pid")] = pid
		}
	}
	return out
}

// alive returns the names of the cluster's processes under dir that run.
func alive(dir string) []string {
	var names []string
	for name, pid := range pids(dir) {
		if running(pid, dir) {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}

// running reports whether pid is a live (not zombie) process of the
// cluster under dir: its command line names dir, as every process up
// starts has it in its arguments. A pid the system has since given to
// another process is not ours.
func running(pid int, dir string) bool {
	if !live(pid) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && strings.Contains(string(b), dir)
}

// live reports whether pid is a process that has not exited. A zombie has
// exited: its parent (init, for a detached process) has yet to reap it.
func live(pid int) bool {
	st, ok := procStat(pid)
	return ok && st.state != "Z" && st.state != "X"
}

type stat struct {
	state string
	pgrp  int
}

func procStat(pid int) (stat, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, false
	}
	// pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return stat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 3 {
		return stat{}, false
	}
	pgrp, _ := strconv.Atoi(f[2])
	return stat{state: f[0], pgrp: pgrp}, true
}

// groupLive reports whether a live process is left in process group pgid.
func groupLive(pgid int) bool {
	if syscall.Kill(-pgid, 0) != nil {
		return false
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		pid, err := strconv.Atoi(filepath.Base(p))
		if err != nil {
			continue
		}
		if st, ok := procStat(pid); ok && st.pgrp == pgid && st.state != "Z" && st.state != "X" {
			return true
		}
	}
	return false
}

// down stops the cluster under dir.
func down(dir string, out io.Writer) error {
	if len(pids(dir)) == 0 {
		fmt.Fprintf(out, "No cluster under %s.\n", dir)
		return nil
	}
	if err := stopAll(dir, out); err != nil {
		return err
	}
	fmt.Fprintf(out, "The cluster under %s is down; its logs and data stay there until the next make cluster.\n", dir)
	return nil
}

// stopAll stops every process of the cluster under dir, stage by stage
// (stopOrder), the processes of a stage at once, and removes cluster.json
// and the pid files once nothing of it runs.
func stopAll(dir string, out io.Writer) error {
	all := pids(dir)
	var (
		mu     sync.Mutex
		failed []string
	)
	for _, stage := range stopOrder {
		var wg sync.WaitGroup
		for _, name := range stage {
			pid, ok := all[name]
			if !ok {
				continue
			}
			delete(all, name)
			wg.Go(func() {
				msg, err := stop(name, pid, dir)
				mu.Lock()
				defer mu.Unlock()
				fmt.Fprintf(out, "  %-10s %s\n", name, msg)
				if err != nil {
					failed = append(failed, fmt.Sprintf("%s (pid %d): %v", name, pid, err))
				}
			})
		}
		wg.Wait()
	}
	for name, pid := range all { // a name this version does not know
		msg, err := stop(name, pid, dir)
		fmt.Fprintf(out, "  %-10s %s\n", name, msg)
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s (pid %d): %v", name, pid, err))
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("still running: %s", strings.Join(failed, "; "))
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.pid"))
	cmds, _ := filepath.Glob(filepath.Join(dir, "*.cmd"))
	for _, f := range append(append(files, cmds...), filepath.Join(dir, jsonName)) {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			return err
		}
	}
	return nil
}

// stop stops one process: SIGTERM (PostgreSQL: SIGINT, its fast shutdown,
// which does not wait for clients to leave as SIGTERM's smart shutdown
// does), then SIGKILL to its whole process group after stopTimeout. It
// returns once nothing of the group is left.
func stop(name string, pid int, dir string) (string, error) {
	if !running(pid, dir) {
		return "not running", nil
	}
	sig := syscall.SIGTERM
	if name == "postgres" {
		sig = syscall.SIGINT
	}
	start := time.Now()
	if err := syscall.Kill(pid, sig); err != nil {
		return "", err
	}
	if waitGone(pid, stopTimeout) {
		return fmt.Sprintf("stopped (%v)", time.Since(start).Round(time.Millisecond)), nil
	}
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	_ = syscall.Kill(pid, syscall.SIGKILL)
	if waitGone(pid, 5*time.Second) {
		return fmt.Sprintf("killed: it did not stop within %v of %v", stopTimeout, sig), nil
	}
	return "", fmt.Errorf("alive after SIGKILL")
}

// waitGone waits until neither pid nor any process of its group (it leads
// one: see spawn) is live. Polling: the processes are not our children.
func waitGone(pid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for live(pid) || groupLive(pid) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

func randomString(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}
