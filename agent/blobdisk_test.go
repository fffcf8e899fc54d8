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
