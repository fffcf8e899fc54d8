package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// A blob server that answers a resumed download wrongly (206 with another
// Content-Range than asked, 206 to a request without Range, the body of
// another offset, more than the blob) never leaves the bridge with bytes
// joined wrongly: the download starts again from zero or fails with a code
// that says so, and the cache holds the blob whole or not at all.
func TestBlobServerAnsweringWronglyLosesNothing(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 4096)
	for _, tt := range []struct {
		name string
		// answer serves request n (from 1) asking for the bytes from
		// start (0: no Range); it reports whether it served it.
		answer func(w http.ResponseWriter, n int32, start int64) bool
		code   string // "": the blob comes whole
	}{
		{"206 at another offset, then 200", func(w http.ResponseWriter, n int32, start int64) bool {
			if start > 0 {
				w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start+7, len(data)-1, len(data)))
				w.WriteHeader(http.StatusPartialContent)
				w.Write(data[start+7:])
				return true
			}
			return false
		}, ""},
		{"206 with no Content-Range", func(w http.ResponseWriter, n int32, start int64) bool {
			if start > 0 {
				w.WriteHeader(http.StatusPartialContent)
				w.Write(data[start:])
				return true
			}
			return false
		}, ""},
		{"206 with the right range and the wrong bytes", func(w http.ResponseWriter, n int32, start int64) bool {
			if start > 0 {
				w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, len(data)-1, len(data)))
				w.WriteHeader(http.StatusPartialContent)
				w.Write(data[:int64(len(data))-start])
				return true
			}
			return false
		}, ""},
		{"206 without a Range asked", func(w http.ResponseWriter, n int32, start int64) bool {
			w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-%d/%d", len(data)-1, len(data)))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(data)
			return true
		}, codeDownloadFailed},
		{"more than the blob", func(w http.ResponseWriter, n int32, start int64) bool {
			w.Write(data)
			w.Write(data)
			return true
		}, codeChecksumMismatch},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var requests atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := requests.Add(1)
				var start int64
				if rg := r.Header.Get("Range"); rg != "" {
					fmt.Sscanf(rg, "bytes=%d-", &start)
				}
				if !tt.answer(w, n, start) {
					w.Write(data)
				}
			}))
			defer srv.Close()
			b := newTestBlobs(t, srv.URL)
			b.idle = 2 * time.Second
			ref := blobRef(data)
			part := filepath.Join(b.dir, ref.SHA256+".part")
			os.WriteFile(part, data[:1000], 0o600) // an earlier attempt's
			got, err := b.fetch(context.Background(), ref, func(int) {})
			if tt.code == "" {
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("fetch = %d bytes, %v after %d requests; want the blob", len(got), err, requests.Load())
				}
				return
			}
			var ce *commandError
			if !errors.As(err, &ce) || ce.Code != tt.code || got != nil {
				t.Fatalf("fetch = %d bytes, %v after %d requests; want code %s", len(got), err, requests.Load(), tt.code)
			}
			if strings.Contains(ce.Message, srv.URL) {
				t.Errorf("the command's error names the server: %s", ce.Message)
			}
			if _, err := os.Stat(filepath.Join(b.dir, ref.SHA256)); err == nil {
				t.Error("a blob that did not check is in the cache")
			}
		})
	}
}
