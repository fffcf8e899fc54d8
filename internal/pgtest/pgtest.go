// Package pgtest holds a test helper for every package that talks to
// PostgreSQL: a real PostgreSQL server, made by its own initdb in a
// temporary directory and listening on a free port of 127.0.0.1, for one
// test.
//
// Start makes and starts a server; it is stopped, and its directory
// removed, when the test ends. NewDatabase gives a test a fresh, empty
// database on a server. There is deliberately no helper that shares one
// server across a whole test binary: a server started for the first test
// would be stopped by that test's Cleanup, and a binary-wide server would
// need a TestMain in every user. To share a server between tests, start it
// in a parent test and call NewDatabase in its subtests (parallel subtests
// included); the parent's Cleanup runs after all of them.
//
// PostgreSQL refuses to run as root. When the test runs as root, initdb and
// the server run as the system user "postgres" (or "nobody" if there is
// none), and the server's directory belongs to that user.
//
// The server keeps PostgreSQL's durability settings (fsync and
// synchronous_commit on, as the project's promise that a 202 means
// committed needs): tests that restart or kill it see what production would.
//
// It is for tests only; nothing outside _test.go files should import it.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion/internal/pgctl"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/jackc/pgx/v5"
)

// Superuser is the name of the superuser initdb makes; DSN and the DSNs of
// NewDatabase log in as it.
const Superuser = "companion"

const (
	// startTimeout bounds the wait for a started server to accept
	// connections, crash recovery after Kill included.
	startTimeout = 30 * time.Second
	// stopTimeout bounds a fast shutdown, which ends with a checkpoint;
	// after it the server's processes are killed.
	stopTimeout = 30 * time.Second
	// dialTimeout bounds one connection attempt.
	dialTimeout = 2 * time.Second
)

// Server is a PostgreSQL server run for one test. Start it with Start; it is
// stopped when the test ends.
type Server struct {
	// DSN is the superuser's URL for the database "postgres":
	// postgres://companion:PASSWORD@127.0.0.1:PORT/postgres?sslmode=disable.
	DSN string
	// Port is the TCP port it listens on, on 127.0.0.1 only; it stays the
	// same across Restart.
	Port int
	// Dir holds the data directory (data), the directory of the unix
	// socket (sock) and the server's log (postgres.log). It is removed when
	// the test ends.
	Dir string

	postgres string // the postgres binary
	dataDir  string
	sockDir  string
	logPath  string
	password string
	cred     *syscall.Credential // nil: run as the test's own user

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has been waited for

	dbSeq atomic.Int64 // numbers the databases of NewDatabase
}

// Start makes a PostgreSQL cluster with initdb (UTF8, locale C, the
// superuser Superuser with a random password and scram-sha-256
// authentication), starts the server on a free port of 127.0.0.1 and waits
// until it accepts connections. Without PostgreSQL the test fails, naming
// make deps, which installs it. The server is stopped (fast shutdown, then
// waited for) and its directory removed when the test ends; if the test
// failed, its log is printed first.
func Start(tb testing.TB) *Server {
	tb.Helper()
	bin, err := pgctl.Bin()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	cred, err := pgctl.Credential()
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	// Not tb.TempDir: its directories are 0700 and belong to the test's
	// user, whom a server run as another user cannot get through, and its
	// path can be too long for a unix socket (107 bytes).
	dir, err := os.MkdirTemp("", "pgtest")
	if err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	s := &Server{
		Dir:      dir,
		postgres: filepath.Join(bin, "postgres"),
		dataDir:  filepath.Join(dir, "data"),
		sockDir:  filepath.Join(dir, "sock"),
		logPath:  filepath.Join(dir, "postgres.log"),
		password: randomString(),
		cred:     cred,
	}
	tb.Cleanup(func() {
		// An immediate shutdown: the data directory goes next, so there is
		// nothing for a fast shutdown's checkpoint to keep, and on a machine
		// whose disk other tests keep busy that checkpoint took over 30 s
		// and failed a test whose every check had passed.
		s.mu.Lock()
		err := s.immediateLocked()
		s.mu.Unlock()
		if err != nil {
			tb.Errorf("pgtest: %v", err)
		}
		if tb.Failed() {
			s.dumpLog(tb)
		}
		if err := os.RemoveAll(s.Dir); err != nil {
			tb.Errorf("pgtest: %v", err)
		}
	})
	if err := s.prepare(bin); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	// The free port may be taken before the server binds it; then try
	// another.
	for attempt := 1; ; attempt++ {
		s.setPort(testenv.FreePort(tb)) // PostgreSQL cannot listen on port 0: Start retries on another when it is taken
		err := s.start()
		if err == nil {
			return s
		}
		if !errors.Is(err, errBind) || attempt == 3 {
			tb.Fatalf("pgtest: %v\n%s", err, s.readLog())
		}
	}
}

// prepare makes the socket's directory and runs initdb (pgctl.InitDB),
// giving both to the server's user.
func (s *Server) prepare(bin string) error {
	if err := os.Mkdir(s.sockDir, 0o700); err != nil {
		return err
	}
	if s.cred != nil {
		if err := os.Chown(s.sockDir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return err
		}
	}
	return pgctl.InitDB(context.Background(), bin, s.Dir, Superuser, s.password, s.cred)
}

func (s *Server) setPort(port int) {
	s.Port = port
	s.DSN = s.dsn("postgres")
}

// dsn is the superuser's URL for a database.
func (s *Server) dsn(database string) string {
	return pgctl.URL(s.Port, Superuser, s.password, database)
}

// errBind marks a server that exited at start because its port was taken.
var errBind = errors.New("port taken")

// start starts the server on s.Port and waits until it accepts
// connections.
func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return errors.New("postgres is already running")
	}
	logf, err := os.OpenFile(s.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	// The child gets its own copy of the descriptor; so do its children,
	// which is why the log is a file and not a pipe that Wait would drain.
	defer logf.Close()
	fmt.Fprintf(logf, "pgtest: starting postgres on 127.0.0.1:%d at %s\n", s.Port, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(s.postgres,
		"-D", s.dataDir,
		"-p", strconv.Itoa(s.Port),
		"-k", s.sockDir,
		"-c", "listen_addresses=127.0.0.1",
		"-c", "logging_collector=off",
		"-c", "fsync=on",
		"-c", "synchronous_commit=on",
		"-c", "full_page_writes=on",
	)
	cmd.Dir = s.Dir
	cmd.Env = pgctl.Env(os.Environ())
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: s.cred,
		// Its own process group, so that Kill and a stop that times out
		// reach the backends too.
		Setpgid: true,
	}
	testenv.EndsWithTestBinary(cmd)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	s.cmd, s.exited = cmd, exited

	deadline := time.Now().Add(startTimeout)
	for {
		err := ping(s.DSN)
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			s.cmd, s.exited = nil, nil
			err := fmt.Errorf("postgres exited at start: %v", waitErr)
			if log := s.readLog(); strings.Contains(log, "could not bind") && strings.Contains(log, strconv.Itoa(s.Port)) {
				err = fmt.Errorf("%w: %w", errBind, err)
			}
			return err
		default:
		}
		if time.Now().After(deadline) {
			s.killLocked()
			return fmt.Errorf("postgres does not accept connections on 127.0.0.1:%d within %v: %v", s.Port, startTimeout, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a port; there is nothing to wait on
	}
}

// ping connects to dsn, runs a query and disconnects.
func ping(dsn string) error {
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return c.Ping(ctx)
}

// Stop stops the server with a fast shutdown (SIGINT, as pg_ctl stop -m
// fast: clients are disconnected, a checkpoint is written) and waits for it
// to exit; if it has not within 30 seconds, its processes are killed and
// Stop says so. Stopping a stopped server does nothing. Restart brings it
// back. The test's Cleanup calls Stop.
func (s *Server) Stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return nil
	}
	cmd, exited := s.cmd, s.exited
	// SIGTERM would be a smart shutdown, which waits for every client,
	// a connection pool's included, to go away first.
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-exited:
		s.cmd, s.exited = nil, nil
		return nil
	case <-time.After(stopTimeout):
		s.killLocked()
		return fmt.Errorf("postgres did not stop within %v of a fast shutdown; killed", stopTimeout)
	}
}

// StopImmediate stops the server with an immediate shutdown (SIGQUIT, as
// pg_ctl stop -m immediate: every process quits at once, without a
// checkpoint) and waits for it to exit; Restart brings it back through
// crash recovery. Stopping a stopped server does nothing.
func (s *Server) StopImmediate(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.immediateLocked(); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
}

// immediateLocked is StopImmediate's shutdown; s.mu is held.
func (s *Server) immediateLocked() error {
	if s.cmd == nil {
		return nil
	}
	pid := s.cmd.Process.Pid
	_ = s.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-s.exited:
	case <-time.After(stopTimeout):
		s.killLocked()
		return fmt.Errorf("postgres did not stop within %v of an immediate shutdown; killed", stopTimeout)
	}
	// The backends quit on their own; wait until they have, so that
	// Restart finds their shared memory gone.
	deadline := time.Now().Add(stopTimeout)
	for groupAlive(pid) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // waiting on processes that are not ours
	}
	s.cmd, s.exited = nil, nil
	return nil
}

// Kill kills the server and all its processes with SIGKILL, as a crash
// would; Restart brings it back through crash recovery, with every
// committed transaction. Killing a stopped server does nothing.
func (s *Server) Kill(tb testing.TB) {
	tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

// killLocked SIGKILLs the server's process group and waits for the
// postmaster. s.mu is held.
func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	pid := s.cmd.Process.Pid
	_ = syscall.Kill(-pid, syscall.SIGKILL)
	<-s.exited
	// The backends are no children of ours: wait until the kernel has
	// taken them too, so that nothing of this server outlives the call.
	deadline := time.Now().Add(stopTimeout)
	for groupAlive(pid) && time.Now().Before(deadline) {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		time.Sleep(10 * time.Millisecond)
	}
	s.cmd, s.exited = nil, nil
}

// groupAlive says whether any process is left in process group pgid.
// Zombies count as gone.
func groupAlive(pgid int) bool {
	if err := syscall.Kill(-pgid, 0); err != nil {
		return false
	}
	// kill(-pgid, 0) also succeeds for zombies, which only their parent
	// (init, for orphans) can reap; look at their state.
	procs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...; comm may hold spaces.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) >= 3 && f[2] == strconv.Itoa(pgid) && f[0] != "Z" && f[0] != "X" {
			return true
		}
	}
	return false
}

// Restart stops the server with a fast shutdown, if it runs, and starts it
// again on the same port with the same data directory, then waits until it
// accepts connections. After Kill, it is the start that follows a crash.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	if err := s.Stop(); err != nil {
		tb.Fatalf("pgtest: %v", err)
	}
	// After Kill, the old server's backends may still hold its shared
	// memory for a moment (they end when they notice the postmaster is
	// gone): PostgreSQL then refuses to start. Try again for a while.
	for attempt := 1; ; attempt++ {
		err := s.start()
		if err == nil {
			return
		}
		if attempt == 50 || !strings.Contains(s.readLog(), "pre-existing shared memory block") {
			tb.Fatalf("pgtest: restart: %v\n%s", err, s.readLog())
		}
		time.Sleep(100 * time.Millisecond) // waiting on processes that are not ours
	}
}

// NewDatabase creates an empty database on the server, named after the
// test, and returns the superuser's DSN for it. The database is not
// dropped: it goes with the server. It is safe to call from parallel tests.
func (s *Server) NewDatabase(tb testing.TB) string {
	tb.Helper()
	name := fmt.Sprintf("t%d_%s", s.dbSeq.Add(1), sanitize(tb.Name()))
	if len(name) > 63 { // NAMEDATALEN-1
		name = name[:63]
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	c, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		tb.Fatalf("pgtest: NewDatabase: connect: %v", err)
	}
	defer c.Close(context.Background())
	if _, err := c.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("pgtest: NewDatabase: create database %q: %v", name, err)
	}
	return s.dsn(name)
}

// sanitize makes a test's name fit for a database name: lower-case
// letters, digits and underscores.
func sanitize(name string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(name) {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return b.String()
}

func randomString() string {
	b := make([]byte, 18)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func (s *Server) readLog() string {
	b, err := os.ReadFile(s.logPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return string(b)
}

func (s *Server) dumpLog(tb testing.TB) {
	tb.Logf("postgres log (%s):\n%s", s.logPath, s.readLog())
}
