package main

// Faults of the server's PostgreSQL, injected under a steady load of the
// real server process with the bridge running the commands: the database
// stopped, its disk full, and the like. Every answer must be a 202 (a
// read's 200) or a 503 unavailable with Retry-After; every command
// accepted succeeds, run once; the server recovers without a restart.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/pgctl"
	"github.com/devicecompanion/companion/internal/pgtest"
	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store/postgres"
)

// pgLoad is a steady load on a procCluster's server: writers push texts
// to the devices in turn, readers read the devices' statuses, and each
// answer is classified (classify). Each client sends its next request
// loadPace after the answer to its last: a steady load of many clients at
// once, not one that takes every core while it waits for a fault to come
// and go (a 503 is answered in well under a millisecond, and make test
// runs on two cores).
type pgLoad struct {
	c    *procCluster
	stop chan struct{}
	wg   sync.WaitGroup
	next atomic.Int64

	okWrites atomic.Int64 // 202s
	refused  atomic.Int64 // 503 unavailable of the writes
	okReads  atomic.Int64 // 200s

	mu       sync.Mutex
	accepted map[string]string // command id → device, of every 202
	writes   map[string]int    // class → count, of the pushes
	reads    map[string]int    // class → count, of the reads
	bad      []string          // the first answers of another class
}

// loadPace is the pause of each client of a pgLoad between an answer and
// its next request.
const loadPace = 10 * time.Millisecond

// startPGLoad starts the load; finish stops it.
func startPGLoad(c *procCluster, writers, readers int) *pgLoad {
	l := &pgLoad{c: c, stop: make(chan struct{}), accepted: map[string]string{}, writes: map[string]int{}, reads: map[string]int{}}
	for range writers {
		l.wg.Go(func() {
			hc := loadClient(1)
			defer hc.CloseIdleConnections()
			for !l.stopped() {
				i := int(l.next.Add(1))
				dev := c.devices[i%len(c.devices)]
				body, _ := json.Marshal(map[string]any{"text": fmt.Sprintf("message %d", i)})
				class, b := l.do(hc, "POST", "/api/v1/devices/"+dev+"/push/text", body)
				l.mu.Lock()
				l.writes[class]++
				switch class {
				case "202":
					var cmd struct{ ID string }
					_ = json.Unmarshal(b, &cmd)
					l.accepted[cmd.ID] = dev
					l.okWrites.Add(1)
				case "503 unavailable":
					l.refused.Add(1)
				default:
					l.badLocked("push to "+dev, class, b)
				}
				l.mu.Unlock()
				l.pause()
			}
		})
	}
	for r := range readers {
		l.wg.Go(func() {
			hc := loadClient(1)
			defer hc.CloseIdleConnections()
			for i := r; !l.stopped(); i++ {
				dev := c.devices[i%len(c.devices)]
				class, b := l.do(hc, "GET", "/api/v1/devices/"+dev+"/status", nil)
				l.mu.Lock()
				l.reads[class]++
				switch class {
				case "200":
					l.okReads.Add(1)
				case "503 unavailable":
				default:
					l.badLocked("status of "+dev, class, b)
				}
				l.mu.Unlock()
				l.pause()
			}
		})
	}
	return l
}

// pause waits loadPace, or until the load stops.
func (l *pgLoad) pause() {
	select {
	case <-l.stop:
	case <-time.After(loadPace):
	}
}

func (l *pgLoad) badLocked(what, class string, body []byte) {
	if len(l.bad) < 5 {
		l.bad = append(l.bad, fmt.Sprintf("%s: %s %s", what, class, body))
	}
}

func (l *pgLoad) stopped() bool {
	select {
	case <-l.stop:
		return true
	default:
		return false
	}
}

// do makes one request as the user and classifies its answer.
func (l *pgLoad) do(hc *http.Client, method, path string, body []byte) (class string, respBody []byte) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, l.c.base()+path, rd)
	if err != nil {
		return "no request: " + err.Error(), nil
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Authorization", "Bearer "+l.c.user.token)
	resp, err := hc.Do(req)
	if err != nil {
		return "no answer: " + err.Error(), nil
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "a cut answer: " + err.Error(), nil
	}
	return classify(resp.StatusCode, resp.Header, b), b
}

// classify names an answer: "202", "200", "503 unavailable" (a problem
// with that code and a Retry-After), or its status and code.
func classify(status int, hdr http.Header, body []byte) string {
	var p struct{ Code string }
	_ = json.Unmarshal(body, &p)
	switch {
	case status == 202 || status == 200:
		return fmt.Sprint(status)
	case status == 503 && p.Code == "unavailable" && hdr.Get("Retry-After") != "":
		return "503 unavailable"
	}
	return fmt.Sprintf("%d %s", status, p.Code)
}

// finish stops the load and waits for its requests.
func (l *pgLoad) finish() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// waitFor waits until cond holds, and fails the test once an answer of
// another class came, or after a bound that tells a hang from a wait.
func (l *pgLoad) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		l.mu.Lock()
		bad := len(l.bad) > 0
		l.mu.Unlock()
		if bad || time.Now().After(deadline) {
			l.finish()
			t.Fatalf("while waiting for %s: pushes %v, reads %v; first answers of another class: %q", what, l.writes, l.reads, l.bad)
		}
		time.Sleep(20 * time.Millisecond) // polling the load's counters
	}
}

// check stops the load and checks that every answer was a 202, a 200 or a
// 503 unavailable, and that the server runs.
func (l *pgLoad) check(t *testing.T) {
	t.Helper()
	l.finish()
	t.Logf("pushes %v, reads %v", l.writes, l.reads)
	require.Empty(t, l.bad, "answers neither a 202, a 200 nor a 503 unavailable with Retry-After")
	require.True(t, l.c.server.running(), "the server exited")
}

// more returns a condition that holds once counter has risen by n from
// what it is now.
func more(counter *atomic.Int64, n int64) func() bool {
	from := counter.Load()
	return func() bool { return counter.Load() >= from+n }
}

// readyz returns the status of the server's /readyz and its problem's
// detail.
func (c *procCluster) readyz(t *testing.T) (int, string) {
	t.Helper()
	resp, err := http.Get(c.base() + "/readyz")
	require.NoError(t, err)
	defer resp.Body.Close()
	var p struct{ Detail string }
	_ = json.NewDecoder(resp.Body).Decode(&p)
	return resp.StatusCode, p.Detail
}

// pgConn connects to the database of dsn, closed when the test ends.
func pgConn(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// smallTablespace mounts a file system of size bytes (tmpfs), makes it a
// tablespace of pg and creates a database in it, whose DSN it returns
// with the directory: the database's tables and indexes are written
// there, its WAL in pg's data directory. The file system is unmounted when
// the test ends. Mounting needs root; without it the test is skipped.
func smallTablespace(t *testing.T, pg *pgtest.Server, size int) (dsn, dir string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a small file system for a tablespace needs root")
	}
	dir, err := os.MkdirTemp("", "companion-tablespace")
	require.NoError(t, err)
	require.NoError(t, syscall.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", size)))
	t.Cleanup(func() {
		// Before pg's own cleanup (cleanups run last first): stopped,
		// it holds nothing of the file system.
		if err := pg.Stop(); err != nil {
			t.Errorf("stop postgres: %v", err)
		}
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
		os.Remove(dir)
	})
	cred, err := pgctl.Credential()
	require.NoError(t, err)
	if cred != nil {
		require.NoError(t, os.Chown(dir, int(cred.Uid), int(cred.Gid)))
	}
	su := pgConn(t, pg.DSN)
	_, err = su.Exec(t.Context(), "CREATE TABLESPACE small LOCATION '"+dir+"'")
	require.NoError(t, err)
	_, err = su.Exec(t.Context(), "CREATE DATABASE onsmall TABLESPACE small")
	require.NoError(t, err)
	u, err := url.Parse(pg.DSN)
	require.NoError(t, err)
	u.Path = "/onsmall"
	return u.String(), dir
}

// fillDisk writes a file in dir until its file system is full, and
// returns a func that removes it.
func fillDisk(t *testing.T, dir string) (free func()) {
	t.Helper()
	name := filepath.Join(dir, "fill")
	f, err := os.Create(name)
	require.NoError(t, err)
	// A page at a time, so that not even a page is left.
	buf := make([]byte, os.Getpagesize())
	for {
		if _, err = f.Write(buf); err != nil {
			break
		}
	}
	require.True(t, errors.Is(err, syscall.ENOSPC), "filling %s: %v", dir, err)
	require.NoError(t, f.Close())
	return func() { require.NoError(t, os.Remove(name)) }
}

// PostgreSQL's disk fills under a steady load, the bridge running the
// commands, and space comes back. The database's tablespace is a small
// file system, filled by a file; its WAL is elsewhere, so PostgreSQL runs
// on and refuses what needs a new page ("could not extend file …: No
// space left on device"). Every answer is a 202, a 200 or a 503
// unavailable with Retry-After; the server stays up and takes commands
// again once space is back, without a restart; /readyz says not ready
// while the disk is full, and ready after; every command it accepted
// succeeds, run once, and none it refused runs.
func TestProcessPostgresDiskFillsUnderLoad(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	pg := pgtest.Start(t)
	dsn, dir := smallTablespace(t, pg, 64<<20)
	c := newPostgresProcClusterOn(t, dsn)
	c.startBridge()

	l := startPGLoad(c, 8, 2)
	l.waitFor(t, "the first 202s", more(&l.okWrites, 100))
	free := fillDisk(t, dir)
	l.waitFor(t, "the 503s of a full disk", more(&l.refused, 300))
	status, detail := c.readyz(t)
	require.Equal(t, 503, status, "/readyz while the disk is full")
	require.Contains(t, detail, "cannot write")
	free()
	l.waitFor(t, "the 202s once space is back", more(&l.okWrites, 100))
	status, detail = c.readyz(t)
	require.Equal(t, 200, status, "/readyz once space is back: %s", detail)
	l.check(t)
	c.checkExactlyOnce(l.accepted)
	checkStoreSaysIt(t, c, 5)
}

// /readyz says not ready once PostgreSQL refused a write for its full
// disk, and ready again once the disk takes writes, with no other request
// to show it (the PostgreSQL store answers a ping throughout).
func TestReadyzWhilePostgreSQLCannotWrite(t *testing.T) {
	pg := pgtest.Start(t)
	dsn, dir := smallTablespace(t, pg, 32<<20)
	require.NoError(t, postgres.Migrate(t.Context(), dsn))
	m := startServer(t, Config{Store: dsn})
	testenv.Eventually(t, 10*time.Second, "the server connected to its broker", m.Broker.Ready)
	f := setupFleet(t, m, "dev-1")
	r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": "dev-1", "claim_code": f.claims["dev-1"]})
	require.Equal(t, 201, r.Status, "%s", r.Body)
	probe := newClient(t, m, "")
	require.Equal(t, 200, probe.do("GET", "/readyz", nil).Status)

	free := fillDisk(t, dir)
	// Until a new page is needed, rows fit in the pages there are.
	for i := 0; ; i++ {
		r = f.user.do("POST", "/api/v1/devices/dev-1/push/text", map[string]any{"text": fmt.Sprintf("while full %d", i)})
		if r.Status == 503 {
			break
		}
		require.Equal(t, 202, r.Status, "%s", r.Body)
		require.Less(t, i, 10000, "commands accepted on a full disk")
	}
	r = f.admin.do("PUT", "/api/v1/admin/apps/clock/1.0.0", bytes.Repeat([]byte("app"), 100000))
	require.Equal(t, 503, r.Status, "an app upload while PostgreSQL's disk is full: %s", r.Body)
	require.Equal(t, "unavailable", r.JSON(t)["code"])
	require.NotEmpty(t, r.Header.Get("Retry-After"))
	readyzCannotWrite(t, probe, "cannot write")

	free()
	r = probe.do("GET", "/readyz", nil)
	require.Equal(t, 200, r.Status, "/readyz once the disk takes writes: %s", r.Body)
	f.user.pushText("dev-1", "space back")
	r = f.admin.do("PUT", "/api/v1/admin/apps/clock/1.0.0", bytes.Repeat([]byte("app"), 100000))
	require.Equal(t, 201, r.Status, "an app upload once the disk takes writes: %s", r.Body)
}

// Another session holds a lock the server's writes wait for, for longer
// than a client waits, under a steady load with the bridge running the
// commands: first the row of one device's queue (SELECT … FOR UPDATE, as
// a transaction left open in psql), then the whole table (LOCK TABLE, as
// a migration or a VACUUM FULL waiting its turn). The writes that wait
// for it are answered 503 unavailable with Retry-After within the
// client's patience, not held until it gives up; the other devices'
// commands are accepted meanwhile, and reads are answered throughout
// (the waits do not take the pool). Once the lock is released every
// request is taken again, and every command accepted succeeds, run once.
func TestProcessPostgresLockHeldUnderLoad(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	c, _, dsn := newPostgresProcCluster(t)
	c.startBridge()
	other := pgConn(t, dsn)
	ctx := t.Context()

	l := startPGLoad(c, 8, 2)
	l.waitFor(t, "the first 202s", more(&l.okWrites, 100))
	tx, err := other.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT * FROM device_queues WHERE device_id = $1 FOR UPDATE`, c.devices[0])
	require.NoError(t, err)
	accepted, refused := more(&l.okWrites, 30), more(&l.refused, 8)
	l.waitFor(t, "other devices' 202s and the locked device's 503s", func() bool { return accepted() && refused() })
	require.NoError(t, tx.Rollback(ctx))
	l.waitFor(t, "the 202s once the row is free", more(&l.okWrites, 50))

	tx, err = other.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE device_queues IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	refused, read := more(&l.refused, 8), more(&l.okReads, 100)
	l.waitFor(t, "503s and reads while the table is locked", func() bool { return refused() && read() })
	require.NoError(t, tx.Rollback(ctx))
	l.waitFor(t, "the 202s once the table is free", more(&l.okWrites, 50))
	l.check(t)
	c.checkExactlyOnce(l.accepted)
	checkStoreSaysIt(t, c, 5)
}

// logLines returns the lines of the log at path at level WARN or ERROR.
func logLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") {
			out = append(out, line)
		}
	}
	return out
}

// PostgreSQL goes away under a steady load, the bridge running the
// commands, in each way it does, and comes back: stopped with a fast
// shutdown and started again; stopped with an immediate one (its
// processes quit at once, crash recovery at the start); the server's
// connections ended by pg_terminate_backend, five times; and
// max_connections taken by other sessions, the server's ended one by one
// until it has none. The server, a role of its own (not a superuser,
// which may take the connections PostgreSQL keeps for superusers), runs
// on throughout. Every answer is a 202, a 200 or a 503 unavailable with
// Retry-After; /readyz is 503 while the database cannot be used and 200
// once it can; commands are taken again each time, without a restart of
// the server; every command accepted succeeds, run once (a command whose
// commit the fault cut off unanswered may run too, once). And the log says
// once that the database cannot be reached, and once that it answers
// again, not a line for every request and every retry.
func TestProcessPostgresGoesAwayUnderLoad(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	pg := pgtest.Start(t)
	su := pgConn(t, pg.DSN)
	ctx := t.Context()
	for _, q := range []string{
		`ALTER SYSTEM SET max_connections = 30`,
		`CREATE ROLE app LOGIN PASSWORD 'app-password'`,
		`CREATE DATABASE app OWNER app`,
	} {
		_, err := su.Exec(ctx, q)
		require.NoError(t, err, "%s", q)
	}
	su.Close(ctx)
	pg.Restart(t) // for max_connections
	c := newPostgresProcClusterOn(t, pgctl.URL(pg.Port, "app", "app-password", "app"), "--log-level", "info")
	c.startBridge()

	l := startPGLoad(c, 8, 2)
	l.waitFor(t, "the first 202s", more(&l.okWrites, 100))
	away := func(what string) {
		t.Helper()
		l.waitFor(t, "the 503s of "+what, more(&l.refused, 300))
		status, detail := c.readyz(t)
		require.Equal(t, 503, status, "/readyz with %s", what)
		require.Contains(t, detail, "PostgreSQL store cannot be reached")
	}
	back := func(what string) {
		t.Helper()
		l.waitFor(t, "the 202s after "+what, more(&l.okWrites, 100))
		status, detail := c.readyz(t)
		require.Equal(t, 200, status, "/readyz after %s: %s", what, detail)
	}

	require.NoError(t, pg.Stop())
	away("a fast shutdown")
	pg.Restart(t)
	back("a fast shutdown")

	pg.StopImmediate(t)
	away("an immediate shutdown")
	pg.Restart(t)
	back("an immediate shutdown")

	su = pgConn(t, pg.DSN)
	for range 5 {
		_, err := su.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'`)
		require.NoError(t, err)
		l.waitFor(t, "the 202s after the connections ended", more(&l.okWrites, 20))
	}

	// Superusers may take the last connections (superuser_reserved_connections,
	// 3): each the test ends of the server's is taken before the server can.
	var fillers []*pgx.Conn
	defer func() {
		for _, f := range fillers {
			f.Close(context.Background())
		}
	}()
	fill := func() {
		for {
			f, err := pgx.Connect(ctx, pg.DSN)
			if err != nil {
				require.ErrorContains(t, err, "SQLSTATE 53300")
				return
			}
			fillers = append(fillers, f)
		}
	}
	fill()
	for {
		var pid int
		err := su.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE usename = 'app' LIMIT 1`).Scan(&pid)
		if errors.Is(err, pgx.ErrNoRows) {
			break
		}
		require.NoError(t, err)
		_, err = su.Exec(ctx, `SELECT pg_terminate_backend($1, 10000)`, pid)
		require.NoError(t, err)
		fill()
	}
	away("max_connections taken")
	for _, f := range fillers {
		f.Close(ctx)
	}
	fillers = nil
	back("max_connections taken")

	l.check(t)
	c.checkRunOnce(l.accepted, true)
	checkStoreSaysIt(t, c, 20)
	log, err := os.ReadFile(c.server.logPath)
	require.NoError(t, err)
	require.Contains(t, string(log), `msg="postgres: the database answers again"`)
}

// checkStoreSaysIt checks that the warnings and errors of the server's
// log are the store's own lines of its faults (PostgreSQL's, or the bbolt
// file's disk), at most max of them: not one for every request and every
// retry that met them.
func checkStoreSaysIt(t *testing.T, c *procCluster, max int) {
	t.Helper()
	lines := logLines(t, c.server.logPath)
	t.Logf("the server's log, warnings and errors:\n%s", strings.Join(lines, "\n"))
	if len(lines) > max {
		t.Fatalf("%d warnings and errors in the server's log, more than %d; the first: %q", len(lines), max, lines[:max])
	}
	for _, line := range lines {
		if !strings.Contains(line, `msg="postgres: `) && !strings.Contains(line, `msg="store: `) {
			t.Fatalf("a warning or error not of the store's: %s", line)
		}
	}
}

// /readyz while every connection of the store's pool waits for a lock
// another session holds: the database answers, and /readyz says that the
// store's connections are taken by statements waiting for a lock, not
// that the database cannot be reached; and 200 once the lock is released.
func TestReadyzWhileLocksTakeThePool(t *testing.T) {
	t.Parallel() // it mostly waits, on processes and a PostgreSQL of its own
	c, _, dsn := newPostgresProcCluster(t)
	other := pgConn(t, dsn)
	ctx := t.Context()

	l := startPGLoad(c, 8, 24)
	l.waitFor(t, "the first 202s", more(&l.okWrites, 50))
	tx, err := other.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `LOCK TABLE bindings IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	var status int
	var detail string
	l.waitFor(t, "/readyz not ready while the pool waits for the lock", func() bool {
		status, detail = c.readyz(t)
		return status != 200
	})
	t.Logf("/readyz: %d %s", status, detail)
	require.Equal(t, 503, status)
	require.NotContains(t, detail, "cannot be reached")
	require.Contains(t, detail, "of the server's sessions wait for a lock another session holds")
	require.Contains(t, detail, "the database answers")
	require.NoError(t, tx.Rollback(ctx))
	l.waitFor(t, "the 202s once the table is free", more(&l.okWrites, 50))
	status, detail = c.readyz(t)
	require.Equal(t, 200, status, "/readyz once the lock is released: %s", detail)
	l.check(t)
}
