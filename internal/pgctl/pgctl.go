// Package pgctl holds the steps of running a PostgreSQL server of one's
// own from Debian's packages: finding initdb and postgres, choosing whom
// they run as (PostgreSQL refuses root), making a data directory with
// initdb, and the environment and URL they take. internal/pgtest (a server
// for one test) and scripts/cluster (make cluster) both run theirs with
// it.
//
// It starts no server and keeps no state: starting, waiting and stopping
// belong to its callers, whose processes live differently (a test's
// child, a detached daemon).
package pgctl

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// ErrNotFound says that initdb and postgres are nowhere to be found.
var ErrNotFound = errors.New("PostgreSQL's initdb and postgres are not in /usr/lib/postgresql/*/bin or PATH: make deps installs Debian's postgresql")

// Bin returns the directory holding initdb and postgres: Debian's
// /usr/lib/postgresql/VERSION/bin, highest version first (Debian puts
// neither in PATH), then PATH.
func Bin() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	version := func(d string) float64 {
		v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(d)), 64)
		return v
	}
	slices.SortFunc(dirs, func(a, b string) int {
		switch va, vb := version(a), version(b); {
		case va > vb:
			return -1
		case va < vb:
			return 1
		}
		return 0
	})
	for _, d := range dirs {
		if executable(filepath.Join(d, "initdb")) && executable(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil && executable(filepath.Join(filepath.Dir(p), "postgres")) {
		return filepath.Dir(p), nil
	}
	return "", ErrNotFound
}

func executable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
}

// Credential says whom initdb and the server run as: nil (this process's
// own user) unless it runs as root, which PostgreSQL refuses; then the
// system user postgres (Debian's package makes it), or nobody.
func Credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	var errs []error
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			errs = append(errs, fmt.Errorf("user %s: uid %q, gid %q", name, u.Uid, u.Gid))
			continue
		}
		// No supplementary groups: root's must not follow.
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
	}
	return nil, fmt.Errorf("running as root, which PostgreSQL refuses, and no user to run it as: %w", errors.Join(errs...))
}

// CheckReachable checks that cred's user can get through every directory
// above dir to it: a temporary directory may be under a private one of
// root's.
func CheckReachable(dir string, cred *syscall.Credential) error {
	if cred == nil {
		return nil
	}
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("stat %s: no owner", d)
		}
		m := fi.Mode().Perm()
		can := m&0o001 != 0 ||
			(st.Gid == cred.Gid && m&0o010 != 0) ||
			(st.Uid == cred.Uid && m&0o100 != 0)
		if !can {
			return fmt.Errorf("PostgreSQL runs as uid %d, who cannot get through %s (mode %#o) to %s: choose a directory it can reach, such as one under /tmp", cred.Uid, d, m, dir)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// Env is environ for initdb and the server: without the PG variables that
// would point them (or a client) elsewhere, and with a C locale.
func Env(environ []string) []string {
	var env []string
	for _, kv := range environ {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C")
}

// InitDB makes a data directory, dir/data, with bin's initdb: UTF8, locale
// C, the superuser with password and scram-sha-256 authentication. dir
// must exist; it and the data directory are given to cred's user (nil:
// this process's), who must be able to reach dir.
func InitDB(ctx context.Context, bin, dir, superuser, password string, cred *syscall.Credential) error {
	pwfile := filepath.Join(dir, "pwfile")
	if err := os.WriteFile(pwfile, []byte(password+"\n"), 0o600); err != nil {
		return err
	}
	defer os.Remove(pwfile)
	if cred != nil {
		for _, p := range []string{dir, pwfile} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				return err
			}
		}
		if err := CheckReachable(dir, cred); err != nil {
			return err
		}
	}
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"--pgdata="+filepath.Join(dir, "data"),
		"--username="+superuser,
		"--pwfile="+pwfile,
		"--auth=scram-sha-256",
		"--encoding=UTF8",
		"--locale=C",
	)
	cmd.Dir = dir
	cmd.Env = Env(os.Environ())
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %v\n%s", err, out)
	}
	return nil
}

// URL is the URL of database on 127.0.0.1:port, logging in as user with
// password, without TLS.
func URL(port int, user, password, database string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.UserPassword(user, password),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		Path:     "/" + database,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}
