package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/devicecompanion/companion/internal/boltcheck"
	"github.com/devicecompanion/companion/store"
)

// runBackup is companion backup FILE: it saves a copy of a running
// server's bbolt store, as it stands at one instant, to FILE (bug 396);
// with --offline, of a stopped server's DATA/companion.db, marked as a
// backup as the server marks its copies (bug 429).
// The server writes the copy (GET /api/v1/admin/backup); the CLI writes
// it beside FILE, syncs it, reads it through as the server does before it
// opens a file (boltcheck), and only then renames it to FILE, so that
// FILE is a whole backup or what it was before.
func runBackup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("backup", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs)
	apiURL := fs.String("api-url", "http://127.0.0.1:8080", "base URL of the running server")
	token := fs.String("admin-token", "", "admin token (default: read from DATA/admin.token)")
	data := fs.String("data", "./data", "the server's data directory, to find admin.token (with --offline, the store)")
	offline := fs.Bool("offline", false, "back up DATA/companion.db of a stopped server, with no server to ask")
	ca := caFlag(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if err := applyEnv(fs); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError{fmt.Sprintf("backup takes exactly one argument, the file to write, got %d", len(pos))}
	}
	file := pos[0]
	if fi, err := os.Stat(file); err == nil && !fi.Mode().IsRegular() {
		return usageError{fmt.Sprintf("%s is not a regular file (a directory?): give the file to write the backup to", file)}
	}
	if *offline {
		src := filepath.Join(*data, "companion.db")
		if a, err := os.Stat(src); err == nil {
			if b, err := os.Stat(file); err == nil && os.SameFile(a, b) {
				return usageError{fmt.Sprintf("%s is the store to back up: give another file", file)}
			}
		}
		n, err := placeBackup(file, func(tmp *os.File) (int64, error) {
			return store.BackupStopped(ctx, src, tmp)
		})
		if err != nil {
			return err
		}
		out, _ := json.Marshal(map[string]any{"file": file, "size": n})
		fmt.Fprintln(stdout, string(out))
		return nil
	}
	hc, err := apiHTTPClient(*apiURL, *ca)
	if err != nil {
		return err
	}
	tok, tokenFile := *token, ""
	if tok == "" {
		tokenFile = filepath.Join(*data, "admin.token")
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return usageError{fmt.Sprintf("no --admin-token and none readable in %s: %v", *data, err)}
		}
		tok = strings.TrimSpace(string(b))
	}
	c := apiClient{apiURL: strings.TrimRight(*apiURL, "/"), token: tok, http: hc, stall: adminStall}
	n, err := c.backup(ctx, file)
	if err != nil {
		return staleTokenHint(err, tokenFile)
	}
	out, _ := json.Marshal(map[string]any{"file": file, "size": n})
	fmt.Fprintln(stdout, string(out))
	return nil
}

// backup saves the server's backup to file, as runBackup says.
func (c apiClient) backup(ctx context.Context, file string) (int64, error) {
	const path = "/api/v1/admin/backup"
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	t := time.AfterFunc(c.stall, func() { cancel(errStalled) })
	defer t.Stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.apiURL+path, nil)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, c.stalled(ctx, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, responseError(http.MethodGet, path, resp)
	}
	want, err := strconv.ParseInt(resp.Header.Get("Content-Length"), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("GET %s: the answer has no length", path)
	}
	return placeBackup(file, func(tmp *os.File) (int64, error) {
		n, err := io.Copy(tmp, &stallReader{r: resp.Body, t: t, d: c.stall})
		if err != nil {
			return n, fmt.Errorf("GET %s: %w", path, c.stalled(ctx, err))
		}
		if n != want {
			return n, fmt.Errorf("GET %s: the copy was cut short: %d of its %d bytes came (the server's log says why)", path, n, want)
		}
		return n, nil
	})
}

// placeBackup has fill write a backup to a file beside file, syncs it,
// reads it through as the server does before it opens a file (boltcheck),
// and only then renames it to file, so that file is a whole backup or
// what it was before.
func placeBackup(file string, fill func(tmp *os.File) (int64, error)) (int64, error) {
	if err := notInUse(file); err != nil {
		return 0, err
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".partial-*")
	if err != nil {
		return 0, err
	}
	placed := false
	defer func() {
		if !placed {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	n, err := fill(tmp)
	if err != nil {
		return n, err
	}
	if err := tmp.Sync(); err != nil {
		return n, err
	}
	if err := tmp.Close(); err != nil {
		return n, err
	}
	if err := boltcheck.Check(tmp.Name()); err != nil {
		return n, fmt.Errorf("the copy does not read as a whole store: %w", err)
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return n, err
	}
	placed = true
	if d, err := os.Open(filepath.Dir(file)); err == nil {
		err = d.Sync()
		_ = d.Close()
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// notInUse refuses a file that a running process holds locked as bbolt
// locks its file (bug 432): the store of a running server, given as the
// file to write. A backup renamed over it leaves the server writing to a
// file no longer in its directory, and its next start opens the backup,
// without every change made since.
func notInUse(file string) error {
	f, err := os.Open(file)
	if err != nil {
		return nil // none, or one the rename will say more of
	}
	defer f.Close()
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return usageError{fmt.Sprintf("%s is held open by a running process (the store of a running companion server?): a backup written over it would be lost to the server and undo every change since at its next start; give another file", file)}
	}
	if err == nil {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	}
	return nil
}

// stalled names a stall as the cause of err when it was.
func (c apiClient) stalled(ctx context.Context, err error) error {
	if errors.Is(context.Cause(ctx), errStalled) {
		return fmt.Errorf("%w for %v (it sent no more of the copy)", errStalled, c.stall)
	}
	return err
}
