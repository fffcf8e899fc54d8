package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/devicecompanion/companion/topics"
)

func blobRef(data []byte) topics.Blob {
	sum := sha256.Sum256(data)
	sha := hex.EncodeToString(sum[:])
	return topics.Blob{SHA256: sha, Size: int64(len(data)), URL: "/api/v1/blobs/" + sha}
}

func newTestBlobs(tb testing.TB, url string) *blobs {
	tb.Helper()
	b, err := newBlobs(filepath.Join(tb.TempDir(), "blobs"), url, "secret", http.DefaultClient, time.Now, slog.New(slog.DiscardHandler))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

func TestBlobFetch(t *testing.T) {
	data := bytes.Repeat([]byte("blob"), 10000)
	var requests, failures atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if failures.Load() > 0 {
			failures.Add(-1)
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		// This server ignores Range: the bridge must start again from zero.
		w.Write(data)
	}))
	defer srv.Close()
	b := newTestBlobs(t, srv.URL)
	ref := blobRef(data)

	// A partial file left by an earlier attempt, of which the server knows nothing.
	os.WriteFile(filepath.Join(b.dir, ref.SHA256+".part"), data[:100], 0o600)
	failures.Store(2) // transient errors are retried
	got, err := b.fetch(context.Background(), ref, func(int) {})
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("fetch = %d bytes, %v; want the blob", len(got), err)
	}
	if n := requests.Load(); n != 3 {
		t.Errorf("%d requests; want 3 (two failures, one success)", n)
	}
	if _, err := b.fetch(context.Background(), ref, func(int) {}); err != nil || requests.Load() != 3 {
		t.Errorf("second fetch made a request or failed (%v); want the cached blob", err)
	}

	// Old blobs leave the cache.
	old := time.Now().Add(-2 * BlobCacheAge)
	os.Chtimes(filepath.Join(b.dir, ref.SHA256), old, old)
	if n := b.purge(time.Now().Add(-BlobCacheAge)); n != 1 {
		t.Errorf("purge removed %d files; want 1", n)
	}
}

// A download given up says why in words for the command's user, without
// the server's internal URL or addresses (the bridge's log has them). A
// server that cannot be reached is waited for until the command's time is
// up (bug 234): a short one here.
func TestBlobDownloadFailedSaysWhyWithoutTheURL(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	b := newTestBlobs(t, dead.URL)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := b.fetch(ctx, blobRef([]byte("unreachable")), func(int) {})
	var ce *commandError
	if !errors.As(err, &ce) || ce.Code != codeDownloadFailed {
		t.Fatalf("fetch from a server that is down = %v; want download_failed", err)
	}
	if ce.Message != "blob download: the server could not be reached" {
		t.Errorf("message %q", ce.Message)
	}
}

func TestBlobFetchErrors(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	b := newTestBlobs(t, srv.URL)
	tests := []struct {
		name string
		ref  topics.Blob
		code string
	}{
		{"bad sha", topics.Blob{SHA256: "xyz", Size: 1, URL: "/x"}, codeInvalidPayload},
		{"not found", blobRef([]byte("nothing")), codeDownloadFailed},
	}
	for _, tt := range tests {
		_, err := b.fetch(context.Background(), tt.ref, func(int) {})
		var ce *commandError
		if !errors.As(err, &ce) || ce.Code != tt.code {
			t.Errorf("fetch(%s) = %v; want code %s", tt.name, err, tt.code)
		}
	}
}

// The bridge's secret goes to the API's origin only: a blob named by an
// absolute URL elsewhere is fetched without it.
func TestBlobSecretStaysWithTheAPI(t *testing.T) {
	data := []byte("elsewhere")
	var auth atomic.Value
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth.Store(r.Header.Get("Authorization"))
		w.Write(data)
	}))
	defer elsewhere.Close()
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth.Store(r.Header.Get("Authorization"))
		w.Write(data)
	}))
	defer api.Close()
	b := newTestBlobs(t, api.URL)
	ref := blobRef(data)
	ref.URL = elsewhere.URL + ref.URL
	if _, err := b.fetch(context.Background(), ref, func(int) {}); err != nil {
		t.Fatal(err)
	}
	if got := auth.Load(); got != "" {
		t.Errorf("another origin got Authorization %q; want none", got)
	}
	ref.URL = api.URL + "/api/v1/blobs/" + ref.SHA256
	os.Remove(filepath.Join(b.dir, ref.SHA256)) // fetch it again
	if _, err := b.fetch(context.Background(), ref, func(int) {}); err != nil {
		t.Fatal(err)
	}
	if got := auth.Load(); got != "Bearer secret" {
		t.Errorf("the API got Authorization %q; want the bridge's secret", got)
	}
}

// A download that stalls mid-body is cut after the idle time and resumed
// from where it stopped, rather than holding the device's worker until
// the command's timeout.
func TestBlobStallIsResumed(t *testing.T) {
	data := bytes.Repeat([]byte("stall"), 20000)
	var requests atomic.Int32
	var ranges []string
	var mu sync.Mutex
	release := make(chan struct{})
	defer close(release)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		ranges = append(ranges, r.Header.Get("Range"))
		mu.Unlock()
		if requests.Add(1) == 1 {
			w.Header().Set("Content-Length", strconv.Itoa(len(data)))
			w.Write(data[:len(data)/2])
			w.(http.Flusher).Flush()
			select { // then nothing more
			case <-r.Context().Done():
			case <-release:
			}
			return
		}
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	defer srv.Close()
	b := newTestBlobs(t, srv.URL)
	b.idle = 200 * time.Millisecond
	// Without the cut the first request never ends: the command's own
	// timeout, standing in here, would end the fetch with an error.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got, err := b.fetch(ctx, blobRef(data), func(int) {})
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("fetch = %d bytes, %v; want the blob", len(got), err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The stalled download resumed where it stalled, never from the start.
	// A resumed request that is itself slower than the idle cut, on a
	// loaded machine under -race, is cut and resumed again: from where it
	// got to.
	resumed := len(ranges) >= 2 && ranges[0] == ""
	for _, r := range ranges[min(1, len(ranges)):] {
		from, ok := strings.CutPrefix(r, "bytes=")
		n, err := strconv.Atoi(strings.TrimSuffix(from, "-"))
		resumed = resumed && ok && err == nil && n >= len(data)/2 && n < len(data)
	}
	if !resumed {
		t.Errorf("requests' Range headers = %q; want \"\" and then \"bytes=%d-\" (the stalled download resumed)", ranges, len(data)/2)
	}
}

// The lock that keeps two downloads of one blob apart goes once nobody
// holds it or waits for it: one was kept for every blob ever fetched (and
// every cached file purged), a bridge's memory growing with each image
// pushed for as long as it ran.
func TestBlobLocksDoNotPileUp(t *testing.T) {
	served := map[string][]byte{}
	var refs []topics.Blob
	for i := range 3 {
		data := []byte("image " + strconv.Itoa(i))
		ref := blobRef(data)
		served[ref.SHA256] = data
		refs = append(refs, ref)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(served[filepath.Base(r.URL.Path)])
	}))
	defer srv.Close()
	b := newTestBlobs(t, srv.URL)
	var wg sync.WaitGroup
	for _, ref := range append(refs, refs...) { // two at a time for each
		wg.Go(func() {
			if _, err := b.fetch(context.Background(), ref, func(int) {}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n := b.purge(time.Now().Add(time.Hour)); n != len(refs) {
		t.Errorf("purge removed %d files; want %d", n, len(refs))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if n := len(b.locks); n != 0 {
		t.Errorf("%d blob locks left after the fetches and the purge; want none", n)
	}
}

// A download that fails every attempt with an error worth retrying (the
// server answering 500, the server gone, the body stalling) fails its
// command download_failed: the device was never asked for anything. The
// error of the last attempt, reported as it was, read device_error.
func TestBlobDownloadGivenUpIsDownloadFailed(t *testing.T) {
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close()
	tests := []struct {
		name  string
		serve http.HandlerFunc // nil: nothing listens
	}{
		{"server error", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "database down", http.StatusInternalServerError)
		}},
		{"server gone", nil},
		{"stalled", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "100")
			w.Write([]byte("a few"))
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			url := gone.URL
			if tt.serve != nil {
				srv := httptest.NewServer(tt.serve)
				defer srv.Close()
				url = srv.URL
			}
			b := newTestBlobs(t, url)
			b.idle = 50 * time.Millisecond
			// The command's time, which ends the wait for a server
			// gone (bug 234); the others give up before it.
			limit := time.Minute
			if tt.serve == nil {
				limit = time.Second
			}
			ctx, cancel := context.WithTimeout(context.Background(), limit)
			defer cancel()
			_, err := b.fetch(ctx, blobRef(bytes.Repeat([]byte("x"), 100)), func(int) {})
			if code := failure(err, false, time.Minute).Code; code != codeDownloadFailed {
				t.Errorf("fetch from a %s = %v, failing the command %s; want %s", tt.name, err, code, codeDownloadFailed)
			}
		})
	}
}

// The cache keeps at most its bound of bytes: fetching past it deletes the
// least recently used blobs (a cache hit counts as a use), never the one
// just fetched, a partial download, or a blob another fetch holds.
func TestBlobCacheKeepsToItsSize(t *testing.T) {
	blobsByPath := map[string][]byte{}
	var refs []topics.Blob
	for i := range 5 {
		data := bytes.Repeat([]byte{byte('a' + i)}, 1000)
		ref := blobRef(data)
		blobsByPath[ref.URL] = data
		refs = append(refs, ref)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(blobsByPath[r.URL.Path])
	}))
	defer srv.Close()
	b := newTestBlobs(t, srv.URL)
	b.max = 3500 // three blobs and a half
	clock := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	b.now = func() time.Time { clock = clock.Add(time.Minute); return clock }
	fetch := func(ref topics.Blob) {
		t.Helper()
		if _, err := b.fetch(t.Context(), ref, func(int) {}); err != nil {
			t.Fatal(err)
		}
		// The file's time is the use's: a download's is the file system's.
		now := b.now()
		os.Chtimes(filepath.Join(b.dir, ref.SHA256), now, now)
	}
	cached := func() map[string]bool {
		t.Helper()
		entries, err := os.ReadDir(b.dir)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]bool{}
		for _, e := range entries {
			got[e.Name()] = true
		}
		return got
	}

	fetch(refs[0])
	fetch(refs[1])
	fetch(refs[2])
	fetch(refs[0]) // a hit: 0 is now the most recently used
	// A partial download of another, and a blob another fetch holds.
	os.WriteFile(filepath.Join(b.dir, refs[4].SHA256+".part"), make([]byte, 200), 0o600)
	unlock := b.lock(refs[1].SHA256)
	fetch(refs[3]) // 4,200 bytes: 2 goes (1 is held), then the cache is under its bound
	unlock()
	got := cached()
	for i, want := range map[int]bool{0: true, 1: true, 2: false, 3: true} {
		if got[refs[i].SHA256] != want {
			t.Errorf("blob %d cached %v; want %v (cache: %v)", i, got[refs[i].SHA256], want, got)
		}
	}
	if !got[refs[4].SHA256+".part"] {
		t.Error("a partial download was deleted")
	}

	// With no blob held, the least recently used goes first: 1, then 0.
	os.Remove(filepath.Join(b.dir, refs[4].SHA256+".part"))
	b.max = 2000
	fetch(refs[2])
	got = cached()
	for i, want := range map[int]bool{0: false, 1: false, 2: true, 3: true} {
		if got[refs[i].SHA256] != want {
			t.Errorf("after a smaller bound, blob %d cached %v; want %v (cache: %v)", i, got[refs[i].SHA256], want, got)
		}
	}
}

// With the bases of several server replicas (--api-url a,b,c), a download
// that fails from one (down, or answering 5xx) goes on from the next, with the bridge's
// secret, and the next download asks that one first (CONTRACT §11: one
// replica killed loses nothing).
func TestBlobFetchFailsOverToAnotherReplica(t *testing.T) {
	first, second := bytes.Repeat([]byte("replica"), 1000), bytes.Repeat([]byte("other"), 1000)
	blobs := map[string][]byte{blobRef(first).URL: first, blobRef(second).URL: second}
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close() // a replica killed: connection refused
	var failing atomic.Int32
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		failing.Add(1)
		http.Error(w, "a replica losing its database", http.StatusServiceUnavailable)
	}))
	defer down.Close()
	var requests atomic.Int32
	var auth atomic.Value
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		auth.Store(r.Header.Get("Authorization"))
		w.Write(blobs[r.URL.Path])
	}))
	defer up.Close()
	b := newTestBlobs(t, dead.URL+","+down.URL+","+up.URL)
	got, err := b.fetch(context.Background(), blobRef(first), func(int) {})
	if err != nil || !bytes.Equal(got, first) {
		t.Fatalf("fetch with the first replica down = %d bytes, %v; want the blob from the second", len(got), err)
	}
	if a, _ := auth.Load().(string); a != "Bearer secret" {
		t.Errorf("Authorization to the second replica %q; want the bridge's secret", a)
	}
	if got, err := b.fetch(context.Background(), blobRef(second), func(int) {}); err != nil || !bytes.Equal(got, second) {
		t.Fatalf("second fetch: %d bytes, %v", len(got), err)
	}
	if n, f := requests.Load(), failing.Load(); n != 2 || f != 1 {
		t.Errorf("%d requests to the replica that is up, %d to the failing one; want 2 and 1: the second fetch asks the one that answered first", n, f)
	}
}

// A server behind a reverse proxy's prefix is reached under it: the
// bridge's --api-url https://gw.example/companion fetches
// /companion/api/v1/blobs/SHA, as the CLI asks /companion/api/v1/….
func TestBlobFetchKeepsTheAPIURLsPath(t *testing.T) {
	data := bytes.Repeat([]byte("proxied"), 1000)
	ref := blobRef(data)
	var paths sync.Map
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths.Store(r.URL.Path, true)
		if r.URL.Path != "/companion"+ref.URL {
			http.NotFound(w, r)
			return
		}
		w.Write(data)
	}))
	defer srv.Close()
	for _, base := range []string{srv.URL + "/companion", srv.URL + "/companion/"} {
		b := newTestBlobs(t, base)
		got, err := b.fetch(context.Background(), ref, func(int) {})
		if err != nil || !bytes.Equal(got, data) {
			var asked []any
			paths.Range(func(k, _ any) bool { asked = append(asked, k); return true })
			t.Errorf("fetch with API URL %q = %d bytes, %v (paths asked: %v); want the blob from /companion%s", base, len(got), err, asked, ref.URL)
		}
	}
}

// A server that cannot be reached for longer than the retries of a
// download that failed take (restarted, upgraded: its listener closed, or
// a proxy in front of it answering 503) holds the download until it is
// back, within the command's time, rather than failing it
// download_failed: nothing can go on without the server, and the
// command would have waited for it in the broker (CONTRACT §7: an outage
// loses nothing). Bug 234.
func TestBlobDownloadWaitsForTheServerToComeBack(t *testing.T) {
	data := bytes.Repeat([]byte("restart"), 1000)
	away := blobAttempts // failures in a row: as many as the retries allow
	for _, tc := range []struct {
		name string
		// client fails the first away requests as the server's restart does
		client func(srv *httptest.Server, failed *atomic.Int32) *http.Client
		// handler answers the others, and the first away when client lets them through
		handler func(failed *atomic.Int32) http.HandlerFunc
	}{
		{"connection refused", func(srv *httptest.Server, failed *atomic.Int32) *http.Client {
			dialer := &net.Dialer{}
			return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				if failed.Add(1) <= int32(away) {
					return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
				}
				return dialer.DialContext(ctx, network, addr)
			}}}
		}, func(*atomic.Int32) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) { w.Write(data) }
		}},
		{"503 from a proxy", func(srv *httptest.Server, _ *atomic.Int32) *http.Client {
			return srv.Client()
		}, func(failed *atomic.Int32) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				if failed.Add(1) <= int32(away) {
					http.Error(w, "no upstream", http.StatusServiceUnavailable)
					return
				}
				w.Write(data)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var failed atomic.Int32
			srv := httptest.NewServer(tc.handler(&failed))
			defer srv.Close()
			b, err := newBlobs(filepath.Join(t.TempDir(), "blobs"), srv.URL, "secret", tc.client(srv, &failed), time.Now, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			// The command's timeout, as the worker gives it.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			got, err := b.fetch(ctx, blobRef(data), func(int) {})
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("fetch from a server away for %d tries = %d bytes, %v; want the blob once it is back", away, len(got), err)
			}
		})
	}
}

// A blob touched while the bridge's clock read a year ahead (a board
// restored to a wrong date, set right by NTP) leaves the cache a day
// after the step, as one touched since: its time lay a year ahead, and
// the purge kept it, taking the flash it held, until the clock caught up
// (bug 355).
func TestBlobTouchedBeforeTheClockSteppedBackLeavesTheCache(t *testing.T) {
	b := newTestBlobs(t, "http://127.0.0.1:1")
	now := time.Now()
	b.now = func() time.Time { return now }
	data := []byte("touched a year ahead")
	ref := blobRef(data)
	path := filepath.Join(b.dir, ref.SHA256)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	ahead := now.Add(365 * 24 * time.Hour)
	if err := os.Chtimes(path, ahead, ahead); err != nil {
		t.Fatal(err)
	}
	if n := b.purge(now.Add(-BlobCacheAge)); n != 0 {
		t.Errorf("purge at the step removed %d files; want 0, the blob maybe used a moment ago", n)
	}
	now = now.Add(BlobCacheAge + time.Hour)
	if n := b.purge(now.Add(-BlobCacheAge)); n != 1 {
		t.Errorf("purge a day after the step removed %d files; want 1, the blob touched before it", n)
	}
}
