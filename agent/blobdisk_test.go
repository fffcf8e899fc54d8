package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestBlobDownloadOnAFullDisk downloads a blob of 300 KiB in a child
// process that cannot write a file past 64 KiB (RLIMIT_FSIZE: the write
// fails as on a full disk). The download fails at once, download_failed
// saying that the bridge's disk could not take it, and leaves no partial
// file; with the space back, the same cache downloads it whole. Before,
// the write's error was taken for the network's: five attempts, each
// resuming onto the same disk, a command failed "the connection failed",
// and the partial file kept its space (docs/reliability.md, bug 164).
func TestBlobDownloadOnAFullDisk(t *testing.T) {
	if dir := os.Getenv("AGENT_BLOB_DISK_DIR"); dir != "" {
		var ref struct{ URL, SHA256 string }
		if err := json.Unmarshal([]byte(os.Getenv("AGENT_BLOB_DISK_REF")), &ref); err != nil {
			t.Fatal(err)
		}
		b, err := newBlobs(dir, ref.URL, "secret", http.DefaultClient, time.Now, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		r := blobRef(blobDiskData)
		_, err = b.fetch(context.Background(), r, func(int) {})
		var ce *commandError
		if !errors.As(err, &ce) {
			t.Fatalf("fetch = %v; want a command's error", err)
		}
		out, _ := json.Marshal(map[string]string{"code": ce.Code, "message": ce.Message})
		os.Stdout.Write(append([]byte("RESULT "), append(out, '\n')...))
		return
	}
	prlimit, err := exec.LookPath("prlimit")
	if err != nil {
		t.Skip("prlimit (util-linux) is not installed")
	}
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(blobDiskData))
	}))
	defer srv.Close()
	dir := filepath.Join(t.TempDir(), "blobs")
	ref := blobRef(blobDiskData)
	arg, _ := json.Marshal(map[string]string{"URL": srv.URL, "SHA256": ref.SHA256})
	cmd := exec.Command(prlimit, "--fsize=65536", "--", os.Args[0], "-test.run=^TestBlobDownloadOnAFullDisk$")
	cmd.Env = append(os.Environ(), "AGENT_BLOB_DISK_DIR="+dir, "AGENT_BLOB_DISK_REF="+string(arg))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the child: %v\n%s", err, out)
	}
	_, line, ok := strings.Cut(string(out), "RESULT ")
	if !ok {
		t.Fatalf("the child said no result:\n%s", out)
	}
	var got struct{ Code, Message string }
	if err := json.Unmarshal([]byte(strings.SplitN(line, "\n", 2)[0]), &got); err != nil {
		t.Fatal(err)
	}
	if got.Code != codeDownloadFailed || !strings.Contains(got.Message, "disk") {
		t.Errorf("a download onto a full disk failed %s %q; want %s saying the bridge's disk could not take it", got.Code, got.Message, codeDownloadFailed)
	}
	if n := requests.Load(); n != 1 {
		t.Errorf("a download onto a full disk was tried %d times; want once", n)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "*")); len(left) != 0 {
		t.Errorf("a download onto a full disk left %q", left)
	}

	b, err := newBlobs(dir, srv.URL, "secret", http.DefaultClient, time.Now, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	data, err := b.fetch(context.Background(), ref, func(int) {})
	if err != nil || !bytes.Equal(data, blobDiskData) {
		t.Fatalf("fetch with the space back = %d bytes, %v; want the blob", len(data), err)
	}
}

var blobDiskData = bytes.Repeat([]byte("a blob a full disk cannot take. "), 300<<10/32)

// TestBlobDownloadMakesRoom downloads blobs in a child process whose cache
// is a file system of its own, a tmpfs of 512 KiB in a private mount
// namespace (unshare), filled by two idle cached blobs of 160 KiB and one
// of 64 KiB that a command is using: the first write past the free space
// fails ENOSPC, as on a full disk. A blob of 300 KiB is then downloaded
// after the idle two are deleted, on a second request; one of 600 KiB,
// more than the disk, fails download_failed after the same second
// request, not a third. Neither leaves its partial file, and the blob in
// use stays. Before, the download failed at the first ENOSPC and the
// cache kept its idle blobs (docs/reliability.md, bug 175).
func TestBlobDownloadMakesRoom(t *testing.T) {
	if dir := os.Getenv("AGENT_BLOB_ROOM_DIR"); dir != "" {
		blobRoomChild(t, dir, os.Getenv("AGENT_BLOB_ROOM_URL"))
		return
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("unshare (util-linux) is not installed")
	}
	for _, tc := range []struct {
		size int
		ok   bool
	}{
		{300 << 10, true},
		{600 << 10, false},
	} {
		data := bytes.Repeat([]byte("a blob the cache makes room for. "), tc.size/32)
		var requests atomic.Int32
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			requests.Add(1)
			http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
		}))
		mnt := t.TempDir()
		cmd := exec.Command(unshare, "--map-root-user", "--mount", "sh", "-c",
			`mount -t tmpfs -o size=512k tmpfs "$1" || { echo NOMOUNT; exit 0; }; shift; exec "$@"`,
			"sh", mnt, os.Args[0], "-test.run=^TestBlobDownloadMakesRoom$")
		cmd.Env = append(os.Environ(), "AGENT_BLOB_ROOM_DIR="+mnt, "AGENT_BLOB_ROOM_URL="+srv.URL+"/"+strconv.Itoa(tc.size))
		out, err := cmd.CombinedOutput()
		srv.Close()
		if bytes.HasPrefix(out, []byte("unshare:")) || bytes.Contains(out, []byte("NOMOUNT")) {
			t.Skipf("no tmpfs in a private mount namespace here:\n%s", out)
		}
		if err != nil {
			t.Fatalf("the child: %v\n%s", err, out)
		}
		_, line, ok := strings.Cut(string(out), "RESULT ")
		if !ok {
			t.Fatalf("the child said no result:\n%s", out)
		}
		var got struct {
			Code, Message string
			Left          []string
		}
		if err := json.Unmarshal([]byte(strings.SplitN(line, "\n", 2)[0]), &got); err != nil {
			t.Fatal(err)
		}
		sha := blobRef(data).SHA256
		want := []string{"inuse"}
		if tc.ok {
			want = []string{sha, "inuse"}
			slices.Sort(want)
			if got.Code != "" {
				t.Errorf("a blob of %d KiB the cache's idle blobs make room for failed %s %q; want it downloaded", tc.size>>10, got.Code, got.Message)
			}
		} else if got.Code != codeDownloadFailed || !strings.Contains(got.Message, "no space") {
			t.Errorf("a blob of %d KiB, more than the disk, failed %s %q; want %s saying no space", tc.size>>10, got.Code, got.Message, codeDownloadFailed)
		}
		if n := requests.Load(); n != 2 {
			t.Errorf("a blob of %d KiB onto a full disk was requested %d times; want twice (once more after the cache made room)", tc.size>>10, n)
		}
		if !slices.Equal(got.Left, want) {
			t.Errorf("after a blob of %d KiB the cache holds %q; want %q", tc.size>>10, got.Left, want)
		}
	}
}

// blobRoomChild is TestBlobDownloadMakesRoom's child: dir is its tmpfs,
// url the blob's (its path's last element the blob's size).
func blobRoomChild(t *testing.T, dir, url string) {
	size, err := strconv.Atoi(url[strings.LastIndexByte(url, '/')+1:])
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("a blob the cache makes room for. "), size/32)
	for name, n := range map[string]int{"idle1": 160 << 10, "idle2": 160 << 10, "inuse": 64 << 10} {
		if err := os.WriteFile(filepath.Join(dir, name), make([]byte, n), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b, err := newBlobs(dir, url, "secret", http.DefaultClient, time.Now, slog.New(slog.NewTextHandler(os.Stderr, nil)))
	if err != nil {
		t.Fatal(err)
	}
	unlock := b.lock("inuse") // a command is transferring it
	defer unlock()
	ref := blobRef(data)
	ref.URL = url
	var res struct {
		Code, Message string
		Left          []string
	}
	got, err := b.fetch(context.Background(), ref, func(int) {})
	var ce *commandError
	switch {
	case errors.As(err, &ce):
		res.Code, res.Message = ce.Code, ce.Message
	case err != nil:
		t.Fatal(err)
	case !bytes.Equal(got, data):
		t.Fatal("fetch returned other bytes than the blob's")
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		res.Left = append(res.Left, e.Name())
	}
	out, _ := json.Marshal(res)
	os.Stdout.Write(append([]byte("RESULT "), append(out, '\n')...))
}
