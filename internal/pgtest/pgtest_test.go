package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

const wait = 10 * time.Second

func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err, "connect to %s", dsn)
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), wait)
	t.Cleanup(cancel)
	return c
}

// serverProcs lists the processes of a server: those in the postmaster's
// process group, and any whose command line names its directory.
func serverProcs(t *testing.T, s *Server, pgid int) []string {
	t.Helper()
	var out []string
	dirs, err := filepath.Glob("/proc/[0-9]*")
	require.NoError(t, err)
	for _, d := range dirs {
		stat, err := os.ReadFile(filepath.Join(d, "stat"))
		if err != nil {
			continue // gone meanwhile
		}
		cmdline, _ := os.ReadFile(filepath.Join(d, "cmdline"))
		cl := strings.ReplaceAll(string(cmdline), "\x00", " ")
		i := strings.LastIndexByte(string(stat), ')')
		f := strings.Fields(string(stat[i+1:]))
		inGroup := len(f) >= 3 && f[2] == strconv.Itoa(pgid) && f[0] != "Z"
		if inGroup || strings.Contains(cl, s.Dir) {
			out = append(out, fmt.Sprintf("%s (%s): %s", filepath.Base(d), f[0], cl))
		}
	}
	return out
}

func uidOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "Uid:" {
			return f[1]
		}
	}
	t.Fatalf("no Uid in /proc/%d/status", pid)
	return ""
}

func refused(port int) error {
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), time.Second)
	if err != nil {
		return nil
	}
	c.Close()
	return fmt.Errorf("port %d still accepts connections", port)
}

func TestStartNewDatabaseStop(t *testing.T) {
	s := Start(t)
	require.True(t, strings.HasPrefix(s.DSN, "postgres://"+Superuser+":"), s.DSN)
	require.Contains(t, s.DSN, "@127.0.0.1:"+strconv.Itoa(s.Port)+"/postgres?sslmode=disable")
	require.Less(t, len(filepath.Join(s.sockDir, ".s.PGSQL.65535")), 108)

	c := connect(t, s.DSN)
	_, err := c.Exec(ctx(t), `CREATE TABLE things (id int PRIMARY KEY, name text NOT NULL)`)
	require.NoError(t, err)
	_, err = c.Exec(ctx(t), `INSERT INTO things VALUES ($1, $2)`, 1, "grüße")
	require.NoError(t, err)
	var name string
	require.NoError(t, c.QueryRow(ctx(t), `SELECT name FROM things WHERE id = 1`).Scan(&name))
	require.Equal(t, "grüße", name)

	var fsync, commit, listen, enc string
	require.NoError(t, c.QueryRow(ctx(t),
		`SELECT current_setting('fsync'), current_setting('synchronous_commit'),
		        current_setting('listen_addresses'), current_setting('server_encoding')`).
		Scan(&fsync, &commit, &listen, &enc))
	require.Equal(t, []string{"on", "on", "127.0.0.1", "UTF8"}, []string{fsync, commit, listen, enc})

	// Passwords are checked.
	bad := strings.Replace(s.DSN, s.password, "wrong", 1)
	_, err = pgx.Connect(ctx(t), bad)
	require.Error(t, err, "a wrong password is refused")

	dsn := s.NewDatabase(t)
	c2 := connect(t, dsn)
	var db string
	require.NoError(t, c2.QueryRow(ctx(t), `SELECT current_database()`).Scan(&db))
	require.True(t, strings.HasPrefix(db, "t"), db)
	require.Contains(t, dsn, "/"+db+"?")
	var n int
	require.NoError(t, c2.QueryRow(ctx(t),
		`SELECT count(*) FROM pg_tables WHERE tablename = 'things'`).Scan(&n))
	require.Zero(t, n, "a new database is empty")
	require.NotEqual(t, dsn, s.NewDatabase(t), "each call makes a database of its own")

	s.mu.Lock()
	pid := s.cmd.Process.Pid
	s.mu.Unlock()
	if os.Geteuid() == 0 {
		require.NotEqual(t, "0", uidOf(t, pid), "postgres runs as root")
	}
	require.NotEmpty(t, serverProcs(t, s, pid))

	require.NoError(t, s.Stop())
	require.NoError(t, s.Stop(), "Stop is idempotent")
	require.NoError(t, refused(s.Port))
	require.Empty(t, serverProcs(t, s, pid), "processes of the stopped server")
	_, err = os.Stat(filepath.Join(s.dataDir, "postmaster.pid"))
	require.ErrorIs(t, err, os.ErrNotExist, "a clean shutdown removes postmaster.pid")
}

func TestRestartKeepsData(t *testing.T) {
	s := Start(t)
	dsn := s.NewDatabase(t)
	c := connect(t, dsn)
	_, err := c.Exec(ctx(t), `CREATE TABLE kv (k text PRIMARY KEY, v text)`)
	require.NoError(t, err)
	_, err = c.Exec(ctx(t), `INSERT INTO kv VALUES ('before-restart', 'a')`)
	require.NoError(t, err)
	port := s.Port

	// An open connection must not hold the restart up.
	s.Restart(t)
	require.Equal(t, port, s.Port)
	require.Error(t, c.Ping(ctx(t)), "the old connection was closed by the restart")

	c = connect(t, dsn)
	var v string
	require.NoError(t, c.QueryRow(ctx(t), `SELECT v FROM kv WHERE k = 'before-restart'`).Scan(&v))
	require.Equal(t, "a", v)

	// A crash keeps every committed transaction.
	_, err = c.Exec(ctx(t), `INSERT INTO kv VALUES ('before-kill', 'b')`)
	require.NoError(t, err)
	s.mu.Lock()
	pid := s.cmd.Process.Pid
	s.mu.Unlock()
	s.Kill(t)
	require.NoError(t, refused(s.Port))
	require.Empty(t, serverProcs(t, s, pid), "processes of the killed server")
	s.Kill(t) // does nothing

	s.Restart(t)
	c = connect(t, dsn)
	require.NoError(t, c.QueryRow(ctx(t), `SELECT v FROM kv WHERE k = 'before-kill'`).Scan(&v))
	require.Equal(t, "b", v)
}

// TestSharedServer shows the way to share one server: a parent test starts
// it, parallel subtests take a database each.
func TestSharedServer(t *testing.T) {
	s := Start(t)
	for i := range 4 {
		t.Run(strconv.Itoa(i), func(t *testing.T) {
			t.Parallel()
			c := connect(t, s.NewDatabase(t))
			_, err := c.Exec(ctx(t), `CREATE TABLE only_mine (x int)`)
			require.NoError(t, err, "each subtest has a database of its own")
		})
	}
}

func TestSanitize(t *testing.T) {
	require.Equal(t, "testfoo_bar_1_x", sanitize("TestFoo/bar#1 x"))
}
