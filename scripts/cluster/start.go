package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// start starts again the named pieces of the cluster up under cfg.dir, each
// as up started it (its command line, saved by spawn), and waits until it
// serves. A piece that runs is left as it is. What is left of a piece's
// process group is killed first: PostgreSQL's backends outlive a postmaster
// killed alone, and hold the shared memory that a new one needs.
func start(ctx context.Context, cfg config, names []string, out io.Writer) error {
	info, err := readInfo(cfg.dir)
	if err != nil {
		return fmt.Errorf("no cluster is up under %s (%v): make cluster starts one", cfg.dir, err)
	}
	known := make([]string, 0, len(info.PIDs))
	for name := range info.PIDs {
		known = append(known, name)
	}
	slices.Sort(known)
	for _, name := range names {
		if _, ok := info.PIDs[name]; !ok {
			return fmt.Errorf("%q is no piece of the cluster; its pieces are %s", name, strings.Join(known, ", "))
		}
	}
	c := &cluster{config: cfg}
	for _, name := range names {
		old := info.PIDs[name]
		if running(old, cfg.dir) {
			fmt.Fprintf(out, "  %-10s runs already (pid %d)\n", name, old)
			continue
		}
		if groupLive(old) {
			_ = syscall.Kill(-old, syscall.SIGKILL)
			if !waitGone(old, 5*time.Second) {
				return fmt.Errorf("%s: what is left of its process group %d does not die", name, old)
			}
		}
		cmd, cred, err := c.loadCommand(name)
		if err != nil {
			return fmt.Errorf("%s: how it was started: %w", name, err)
		}
		if name == "postgres" {
			// Nothing of the old one runs: its lock file is stale. PostgreSQL
			// would take it for a live server's while its dead postmaster is
			// a zombie not yet reaped (its parent, up, is gone), as where
			// nothing reaps orphans.
			if data := argAfter(cmd.Args, "-D"); data != "" {
				if err := os.Remove(filepath.Join(data, "postmaster.pid")); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return err
				}
			}
		}
		p, err := c.spawn(name, cred, cmd.Path, cmd.Args...)
		if err != nil {
			return err
		}
		check, what := c.serves(ctx, info, name, cmd.Args)
		if err := c.waitFor(ctx, p, what, check); err != nil {
			return err
		}
		info.PIDs[name] = p.pid
		if err := saveInfo(cfg.dir, info); err != nil {
			return err
		}
		fmt.Fprintf(out, "  %-10s started (pid %d): %s\n", name, p.pid, what)
	}
	return nil
}

// serves returns the check that a piece started with args serves, and what
// it checks.
func (c *cluster) serves(ctx context.Context, info Info, name string, args []string) (func() error, string) {
	switch {
	case strings.HasPrefix(name, "replica-"):
		return func() error { return getOK("http://" + argAfter(args, "--http") + "/readyz") }, "ready"
	case strings.HasPrefix(name, "nats-"):
		i, err := strconv.Atoi(strings.TrimPrefix(name, "nats-"))
		if err != nil || i < 1 || i > len(info.NATSMonitorURLs) {
			break
		}
		return func() error { return getOK(info.NATSMonitorURLs[i-1] + "/healthz") }, "healthy"
	case name == "postgres":
		// The replicas' store, as they connect to it: past its recovery.
		replica, _, err := c.loadCommand("replica-1")
		dsn := argAfter(replica.Args, "--store")
		if err == nil && dsn == "" {
			err = errors.New("replica-1 was started without --store")
		}
		return func() error {
			if err != nil {
				return err
			}
			return pgExec(ctx, dsn, "SELECT 1")
		}, "answering queries"
	case name == "bridge":
		return func() error { return mqttClientConnected(info.NATSMonitorURLs, "companion-bridge-"+bridgeID) }, "connected to NATS"
	}
	return func() error { return nil }, "started"
}

// argAfter is the argument that follows flag f in args, "" when none does.
func argAfter(args []string, f string) string {
	if i := slices.Index(args, f); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}
