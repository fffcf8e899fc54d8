package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/devicecompanion/companion/internal/idleread"
	"github.com/devicecompanion/companion/internal/retry"
	"github.com/devicecompanion/companion/topics"
)

// BlobCacheAge is how long a downloaded blob (or a partial one) is kept.
const BlobCacheAge = 24 * time.Hour

// blobAttempts is how many times a transient download failure is retried.
const blobAttempts = 5

// The pauses between download attempts: from blobRetryMin, doubling up to
// blobRetryMax, each randomised by ±50% (retry.Backoff) so that bridges that
// lost one server together do not come back to it in lockstep.
const (
	blobRetryMin = 200 * time.Millisecond
	blobRetryMax = 5 * time.Second
)

// blobIdleTimeout is how long a download may go without a byte before it
// is given up and resumed: a server or link that stalls mid-body would
// otherwise hold the device's worker until the command's timeout (10
// minutes), since the bridge's HTTP client has no timeout of its own (a
// firmware image may take minutes to come, and that is fine).
const blobIdleTimeout = 30 * time.Second

// errStalled is why a download was cut: no byte for blobs.idle.
var errStalled = errors.New("blob download stalled")

// blobs fetches binary content by SHA-256 into a cache directory, resuming
// broken downloads with HTTP Range requests.
type blobs struct {
	dir string
	// bases are the servers' base URLs (replicas of one service), which
	// relative blob URLs resolve against: first the one that last
	// answered (cur), the next after a failure that another may not have.
	bases  []*url.URL
	cur    atomic.Int64
	secret string
	client *http.Client
	now    func() time.Time
	log    *slog.Logger
	idle   time.Duration // blobIdleTimeout; shorter in tests
	max    int64         // bytes the cache keeps at most (trim); <= 0: no bound

	mu    sync.Mutex
	locks map[string]*blobLock // one download per sha at a time
}

// blobLock keeps the downloads of one blob apart. It is in blobs.locks
// only while someone holds it or waits for it: kept for good, the locks
// grew the bridge's memory with every blob it fetched.
type blobLock struct {
	sync.Mutex
	users int // holders and waiters, guarded by blobs.mu
}

// newBlobs makes the cache in dir; apiURLs is a comma-separated list of
// the servers' base URLs (replicas of one service), or "".
func newBlobs(dir, apiURLs, secret string, client *http.Client, now func() time.Time, log *slog.Logger) (*blobs, error) {
	var bases []*url.URL
	if apiURLs != "" {
		for s := range strings.SplitSeq(apiURLs, ",") {
			base, err := url.Parse(strings.TrimSpace(s))
			if err != nil || base.Scheme == "" || base.Host == "" {
				return nil, fmt.Errorf("agent: invalid API URL %q", s)
			}
			bases = append(bases, base)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: blob cache: %w", err)
	}
	return &blobs{dir: dir, bases: bases, secret: secret, client: client, now: now, log: log, idle: blobIdleTimeout, locks: map[string]*blobLock{}}, nil
}

// lock takes the lock of a blob's downloads and returns its unlock.
func (b *blobs) lock(sha string) func() {
	b.mu.Lock()
	l := b.locks[sha]
	if l == nil {
		l = &blobLock{}
		b.locks[sha] = l
	}
	l.users++
	b.mu.Unlock()
	l.Lock()
	return b.release(sha, l)
}

// release is the unlock of l, the lock of sha: it drops l from b.locks
// once nobody holds or waits for it.
func (b *blobs) release(sha string, l *blobLock) func() {
	return func() {
		l.Unlock()
		b.mu.Lock()
		if l.users--; l.users == 0 {
			delete(b.locks, sha)
		}
		b.mu.Unlock()
	}
}

func validSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil && strings.ToLower(s) == s
}

// fetch returns the blob's content, from the cache or downloaded. progress
// is called with 0–100 as bytes arrive.
func (b *blobs) fetch(ctx context.Context, ref topics.Blob, progress func(pct int)) ([]byte, error) {
	if !validSHA256(ref.SHA256) || ref.Size < 0 || ref.URL == "" {
		return nil, cmdErr(codeInvalidPayload, "blob reference needs sha256 (64 lowercase hex), size and url")
	}
	unlock := b.lock(ref.SHA256)
	defer unlock()

	final := filepath.Join(b.dir, ref.SHA256)
	if data, err := os.ReadFile(final); err == nil {
		if int64(len(data)) == ref.Size && sumHex(data) == ref.SHA256 {
			now := b.now()
			_ = os.Chtimes(final, now, now) // keep it in the cache while in use
			progress(100)
			return data, nil
		}
		os.Remove(final) // damaged: fetch it again
	}

	ru, err := b.parse(ref.URL)
	if err != nil {
		return nil, cmdErr(codeInvalidPayload, err.Error())
	}
	part := final + ".part"
	var lastErr error
	restarted := false
	madeRoom := false // the cache's idle blobs were deleted for this download
	bo := retry.Backoff(blobRetryMin, blobRetryMax)
	pause := false   // a try failed: wait before the next
	waiting := false // for servers found away (unreachable): said once in the log
	for attempt := 0; attempt < blobAttempts; attempt++ {
		if pause {
			t := time.NewTimer(bo.NextBackOff())
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, ended(ctx, lastErr)
			case <-t.C:
			}
		}
		pause = true
		i := int(b.cur.Load())
		err := b.download(ctx, b.at(ru, i), part, ref.Size, progress)
		if err == nil {
			data, rerr := os.ReadFile(part)
			if rerr != nil {
				return nil, cmdErr(codeDownloadFailed, rerr.Error())
			}
			if int64(len(data)) != ref.Size || sumHex(data) != ref.SHA256 {
				os.Remove(part)
				err = cmdErr(codeChecksumMismatch, fmt.Sprintf("blob %s: got %d bytes with a different SHA-256", ref.SHA256, len(data)))
				if !restarted { // a resumed download may have joined bad halves: try once from zero
					restarted = true
					lastErr = err
					continue
				}
				return nil, err
			}
			if err := os.Rename(part, final); err != nil {
				return nil, cmdErr(codeDownloadFailed, err.Error())
			}
			if n := b.trim(ref.SHA256); n > 0 {
				b.log.Info("deleted cached blobs over the cache's size", "count", n)
			}
			return data, nil
		}
		if ctx.Err() != nil {
			return nil, ended(ctx, lastErr)
		}
		var se *storeError
		if errors.As(err, &se) {
			// The bridge's disk, not the download: another attempt
			// meets the same disk, and what was written of the blob
			// takes space that the spool needs (and a resumed
			// download would build on it).
			if rerr := os.Remove(part); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				b.log.Warn("removing a partial download failed", "sha256", ref.SHA256, "err", rerr)
			}
			if noSpace(se.err) && !madeRoom {
				// The cache may be what fills the disk: its idle blobs
				// go, as they do for the spool (makeRoom), and the
				// download starts once more from zero; not again, and
				// not counted as one of the network's attempts
				// (docs/reliability.md, bug 175).
				madeRoom = true
				if n, freed := b.trimTo(ref.SHA256, 0); n > 0 {
					b.log.Warn("deleted cached blobs to give a download room; downloading it again", "sha256", ref.SHA256, "count", n, "bytes", freed, "dir", b.dir)
					attempt--
					pause = false
					continue
				}
			}
			b.log.Error("blob download failed: the bridge cannot write it to its disk", "sha256", ref.SHA256, "dir", b.dir, "err", se.err)
			return nil, cmdErr(codeDownloadFailed, se.reason())
		}
		lastErr = err
		var ce *commandError
		if errors.As(err, &ce) && ce.Code != codeDownloadFailed || !transient(err) {
			b.log.Warn("blob download failed", "sha256", ref.SHA256, "err", err)
			return nil, downloadFailed(err)
		}
		if unreachable(err) {
			// No server can be reached, or it says it cannot serve now:
			// restarted, upgraded, its database away. Nothing goes on
			// without it, and had the command not been here yet it
			// would wait in the broker for it: the download waits too,
			// without counting it as an attempt, until the servers are
			// back or the command's time is up (ctx; then ended fails
			// it download_failed). Five attempts took some 3 s, and a
			// restart of the server failed the commands downloading
			// then (bug 234).
			attempt--
			if !waiting {
				waiting = true
				b.log.Warn("blob download: the server cannot be reached; waiting for it", "sha256", ref.SHA256, "err", err)
			}
			b.failOver(ru, i)
			continue
		}
		if b.failOver(ru, i) {
			b.log.Warn("blob download failed; retrying from the next server", "sha256", ref.SHA256, "attempt", attempt+1, "err", err)
			continue
		}
		b.log.Warn("blob download failed; retrying", "sha256", ref.SHA256, "attempt", attempt+1, "err", err)
	}
	b.log.Warn("blob download given up", "sha256", ref.SHA256, "attempts", blobAttempts, "err", lastErr)
	return nil, downloadFailed(lastErr)
}

// ended is what fetch returns when ctx ends before the blob came: the
// command's time ran out (its deadline) while the server was away
// (lastErr unreachable), download_failed with why, as a download given up;
// otherwise ctx's error (the bridge stopping: the command runs again
// after the restart).
func ended(ctx context.Context, lastErr error) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) && lastErr != nil && unreachable(lastErr) {
		return downloadFailed(lastErr)
	}
	return ctx.Err()
}

// unreachable reports whether err says the server is away rather than
// wrong: no connection could be made to it (refused, no route, its name
// not found), or it (or a proxy in front of it) answered 502, 503 or 504.
// A download waits for such a server (bug 234).
func unreachable(err error) bool {
	var (
		se *httpStatusError
		oe *net.OpError
	)
	switch {
	case errors.As(err, &se):
		return se.status == http.StatusBadGateway || se.status == http.StatusServiceUnavailable || se.status == http.StatusGatewayTimeout
	case errors.As(err, &oe):
		return oe.Op == "dial"
	}
	return false
}

// downloadFailed is the command's failure once a download is given up:
// err as download_failed, unless it names its own code. A network error,
// a stall or an HTTP 5xx left as it is would fail the command
// device_error (failure), sending the operator to a device that was
// never asked for anything.
func downloadFailed(err error) error {
	var ce *commandError
	if errors.As(err, &ce) {
		return err
	}
	return &commandError{Code: codeDownloadFailed, Message: downloadReason(err)}
}

// downloadReason says why a download failed, for the command's error,
// which its user reads: not Go's error text, which names the server's
// internal URL and addresses (the bridge's log has it).
func downloadReason(err error) string {
	var (
		se *httpStatusError
		oe *net.OpError
		ne net.Error
	)
	switch {
	case errors.As(err, &se):
		return se.Error()
	case errors.Is(err, errStalled):
		return "blob download: no data came for a while"
	case errors.As(err, &oe) && oe.Op == "dial":
		return "blob download: the server could not be reached"
	case errors.As(err, &ne) && ne.Timeout():
		return "blob download: timed out"
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "blob download: the connection closed before the whole blob came"
	}
	return "blob download: the connection failed"
}

// parse reads a blob URL: absolute, or relative to the servers' bases.
func (b *blobs) parse(ref string) (*url.URL, error) {
	u, err := url.Parse(ref)
	if err != nil {
		return nil, fmt.Errorf("blob url %q: %v", ref, err)
	}
	if !u.IsAbs() && len(b.bases) == 0 {
		return nil, fmt.Errorf("blob url %q is relative and no API URL is set", ref)
	}
	return u, nil
}

// at is the blob URL u (parse's), a relative one against the i-th server.
// The server names a blob by its path from the API's root
// (/api/v1/blobs/SHA), and that root is the base's path: behind a reverse
// proxy's prefix (https://gw.example/companion) it is under /companion, as
// the CLI asks it. (ResolveReference put an absolute path at the host's
// root, and every download behind such a proxy failed.)
func (b *blobs) at(u *url.URL, i int) *url.URL {
	if u.IsAbs() {
		return u
	}
	base, ref := *b.bases[i%len(b.bases)], *u
	base.Path = strings.TrimRight(base.Path, "/") + "/"
	if ref.Host == "" {
		ref.Path = strings.TrimPrefix(ref.Path, "/")
	}
	return base.ResolveReference(&ref)
}

// failOver makes the server after the i-th the first asked, when the
// download of u failed from the i-th and another may have it: the servers
// are replicas of one service (CONTRACT §11), and one of them down must
// not fail every command that needs a blob. It reports whether there is
// another.
func (b *blobs) failOver(u *url.URL, i int) bool {
	if len(b.bases) < 2 || u.IsAbs() {
		return false
	}
	b.cur.CompareAndSwap(int64(i), int64((i+1)%len(b.bases)))
	return true
}

// ownOrigin reports whether u is on one of the API's schemes and hosts:
// only there does the bridge's secret go. The server names its blobs by a
// path of its own; an absolute URL elsewhere (a store in front of it, say)
// must carry its own authority, not the bridge's credentials.
func (b *blobs) ownOrigin(u *url.URL) bool {
	for _, base := range b.bases {
		if strings.EqualFold(u.Scheme, base.Scheme) && strings.EqualFold(u.Host, base.Host) {
			return true
		}
	}
	return false
}

// httpStatusError is a download answered with an unexpected status.
type httpStatusError struct{ status int }

func (e *httpStatusError) Error() string { return "blob download: HTTP " + strconv.Itoa(e.status) }

func transient(err error) bool {
	var se *httpStatusError
	if errors.As(err, &se) {
		return se.status >= 500 || se.status == http.StatusTooManyRequests || se.status == http.StatusRequestTimeout
	}
	var ce *commandError
	if errors.As(err, &ce) {
		return ce.Code == codeDownloadFailed && ce.transient
	}
	return true // network errors, short bodies
}

// download appends to the partial file what the server has beyond it.
func (b *blobs) download(ctx context.Context, u *url.URL, part string, size int64, progress func(pct int)) error {
	f, err := os.OpenFile(part, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return &storeError{err}
	}
	defer f.Close()
	have, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return &storeError{err}
	}
	if have > size {
		if err := f.Truncate(0); err != nil {
			return &storeError{err}
		}
		have, _ = f.Seek(0, io.SeekStart)
	}
	if have == size && size > 0 {
		return nil // complete; the caller checks it
	}

	// The request is cut when no byte came for b.idle (the answer's
	// headers included), and the next attempt resumes it.
	ctx, cut := context.WithCancelCause(ctx)
	defer cut(nil)
	stall := time.AfterFunc(b.idle, func() { cut(errStalled) })
	defer stall.Stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return cmdErr(codeInvalidPayload, err.Error())
	}
	if b.secret != "" && b.ownOrigin(u) {
		req.Header.Set("Authorization", "Bearer "+b.secret)
	}
	if have > 0 {
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-", have))
	}
	resp, err := b.client.Do(req)
	if err != nil {
		return stalled(ctx, err)
	}
	defer resp.Body.Close()

	switch {
	case resp.StatusCode == http.StatusPartialContent && have > 0:
		start, ok := rangeStart(resp.Header.Get("Content-Range"))
		if !ok || start != have {
			if err := f.Truncate(0); err != nil {
				return &storeError{err}
			}
			return &commandError{Code: codeDownloadFailed, Message: "blob download: unexpected Content-Range", transient: true}
		}
		b.log.Debug("blob download resumed", "url", u.Redacted(), "offset", have)
	case resp.StatusCode == http.StatusOK:
		if have > 0 { // the server ignored the Range: start again
			if err := f.Truncate(0); err != nil {
				return &storeError{err}
			}
			if _, err := f.Seek(0, io.SeekStart); err != nil {
				return &storeError{err}
			}
			have = 0
		}
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable:
		if err := f.Truncate(0); err != nil {
			return &storeError{err}
		}
		return &commandError{Code: codeDownloadFailed, Message: "blob download: range not satisfiable", transient: true}
	default:
		err := &httpStatusError{status: resp.StatusCode}
		if transient(err) {
			return err
		}
		return cmdErr(codeDownloadFailed, err.Error())
	}

	w := &progressWriter{w: f, done: have, size: size, progress: progress}
	body := &idleread.Reader{R: resp.Body, Timer: stall, Idle: b.idle}
	// Read at most one byte beyond the expected size: enough to tell that
	// the server sent something else.
	if _, err := io.Copy(w, io.LimitReader(body, size-have+1)); err != nil {
		if w.err != nil {
			return &storeError{w.err}
		}
		f.Sync()
		return stalled(ctx, err)
	}
	if err := f.Sync(); err != nil {
		return &storeError{err}
	}
	return nil
}

// storeError is a download that failed for the bridge's disk: the partial
// file could not be opened, written or synced. Taken for a network error,
// it was tried again five times, each attempt resuming onto the same full
// disk, and the command failed "the connection failed", with the partial
// file left taking the space (docs/reliability.md, bug 164).
type storeError struct{ err error }

func (e *storeError) Error() string { return "blob download: storing it: " + e.err.Error() }
func (e *storeError) Unwrap() error { return e.err }

// reason says why, for the command's error, which its user reads: not the
// file's path on the bridge (the bridge's log has it).
func (e *storeError) reason() string {
	switch diskRefusal(e.err) {
	case syscall.ENOSPC, syscall.EDQUOT:
		return "blob download: no space left on the bridge's disk"
	case syscall.EFBIG:
		return "blob download: the blob is larger than the bridge may write to its disk (file size limit)"
	}
	return "blob download: the bridge could not write the blob to its disk"
}

// stalled says so when err comes of the download's cut for a stall (a
// transient error: the next attempt resumes where it stopped).
func stalled(ctx context.Context, err error) error {
	if errors.Is(context.Cause(ctx), errStalled) {
		return fmt.Errorf("%w: no data for a while: %v", errStalled, err)
	}
	return err
}

func rangeStart(cr string) (int64, bool) {
	rest, ok := strings.CutPrefix(cr, "bytes ")
	if !ok {
		return 0, false
	}
	startStr, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(startStr, 10, 64)
	return n, err == nil
}

type progressWriter struct {
	w        io.Writer
	done     int64
	size     int64
	progress func(pct int)
	err      error // the write that failed: the disk's, not the download's
}

func (p *progressWriter) Write(b []byte) (int, error) {
	n, err := p.w.Write(b)
	if err != nil {
		p.err = err
	}
	p.done += int64(n)
	if p.size > 0 {
		p.progress(int(min(p.done*100/p.size, 100)))
	}
	return n, err
}

func sumHex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// trim deletes the least recently used cached blobs until the cache
// holds no more than b.max bytes, partial downloads counted. It passes
// over keep (the blob just fetched, whose lock the caller holds), partial
// downloads, and blobs another fetch holds: it never waits. Without it
// the cache grew by every image pushed for a day (BlobCacheAge), gigabytes
// an hour on a busy gateway's flash.
func (b *blobs) trim(keep string) int {
	if b.max <= 0 {
		return 0
	}
	n, _ := b.trimTo(keep, b.max)
	return n
}

// trimTo deletes the least recently used cached blobs, as trim does,
// until the cache holds no more than max bytes, and returns how many it
// deleted and their bytes.
func (b *blobs) trimTo(keep string, max int64) (n int, freed int64) {
	entries, err := os.ReadDir(b.dir)
	if err != nil {
		return 0, 0
	}
	type cached struct {
		name string
		size int64
		mod  time.Time
	}
	var files []cached
	var total int64
	for _, e := range entries {
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() {
			continue
		}
		total += info.Size()
		if e.Name() != keep && !strings.HasSuffix(e.Name(), ".part") {
			files = append(files, cached{e.Name(), info.Size(), info.ModTime()})
		}
	}
	slices.SortFunc(files, func(x, y cached) int { return x.mod.Compare(y.mod) })
	for _, f := range files {
		if total <= max {
			break
		}
		unlock, ok := b.tryLock(f.name)
		if !ok {
			continue // in use
		}
		if os.Remove(filepath.Join(b.dir, f.name)) == nil {
			total -= f.size
			freed += f.size
			n++
		}
		unlock()
	}
	return n, freed
}

// tryLock is lock without waiting: ok false when someone holds or waits
// for the blob's lock.
func (b *blobs) tryLock(sha string) (unlock func(), ok bool) {
	b.mu.Lock()
	if b.locks[sha] != nil {
		b.mu.Unlock()
		return nil, false
	}
	l := &blobLock{users: 1}
	l.Lock()
	b.locks[sha] = l
	b.mu.Unlock()
	return b.release(sha, l), true
}

// purge deletes cached and partial blobs not touched since cutoff. One
// touched more than a minute ahead of the clock was touched before the
// clock stepped back (NTP setting right a board that ran a year ahead):
// it is taken as touched now, and goes BlobCacheAge on. It was kept, with
// the flash it held, until the clock caught up with it
// (docs/reliability.md, bug 355).
func (b *blobs) purge(cutoff time.Time) int {
	entries, err := os.ReadDir(b.dir)
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range entries {
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() {
			continue
		}
		if now := b.now(); info.ModTime().After(now.Add(time.Minute)) {
			_ = os.Chtimes(filepath.Join(b.dir, e.Name()), now, now)
			continue
		}
		if !info.ModTime().Before(cutoff) {
			continue
		}
		name := strings.TrimSuffix(e.Name(), ".part")
		unlock := b.lock(name)
		if os.Remove(filepath.Join(b.dir, e.Name())) == nil {
			n++
		}
		unlock()
	}
	return n
}
