package openapitest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// recordingTB keeps the errors reported to it instead of failing.
type recordingTB struct {
	testing.TB
	mu     sync.Mutex
	errors []string
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recordingTB) Helper() {}

func (r *recordingTB) reported() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.errors, "\n")
}

func TestLoad(t *testing.T) {
	c := Load(t)
	if c.Doc.OpenAPI != "3.1.0" {
		t.Errorf("openapi = %q; want 3.1.0", c.Doc.OpenAPI)
	}
	if n, ok := c.CodeStatus("device_not_found"); !ok || n != http.StatusNotFound {
		t.Errorf("CodeStatus(%q) = %d, %v; want 404, true", "device_not_found", n, ok)
	}
	if _, err := Parse([]byte(`{"openapi": "3.0.3", "info": {"title": "x", "version": "1"}, "paths": {}}`)); err == nil {
		t.Error("Parse took an OpenAPI 3.0 document")
	}
}

// TestCheckCatchesDrift shows the check failing on answers and requests
// that disagree with the document.
func TestCheckCatchesDrift(t *testing.T) {
	c := Load(t)
	get := func(path, token string) *http.Request {
		r := httptest.NewRequest("GET", "http://127.0.0.1"+path, nil)
		if token != "" {
			r.Header.Set("Authorization", "Bearer "+token)
		}
		return r
	}
	head := func(path string) *http.Request {
		r := get(path, "t")
		r.Method = http.MethodHead
		return r
	}
	jsonAnswer := func(status int, body string) Answer {
		return Answer{Status: status, Header: http.Header{"Content-Type": {"application/json; charset=utf-8"}}, Body: []byte(body)}
	}
	problem := func(status int, code string) Answer {
		return Answer{Status: status, Header: http.Header{"Content-Type": {"application/problem+json"}},
			Body: fmt.Appendf(nil, `{"type":"urn:companion:problem:%s","title":"x","status":%d,"detail":"x","code":%q,"errors":[]}`, code, status, code)}
	}
	for _, tc := range []struct {
		name   string
		req    *http.Request
		answer Answer
		want   string // in the error reported
	}{
		{"undocumented member", get("/api/v1/devices/d-1/apps", "t"), jsonAnswer(200, `{"apps": [], "extra": 1}`), "extra"},
		{"missing member", get("/api/v1/devices/d-1/ota/check", "t"), jsonAnswer(200, `{"current_version": null}`), "latest_version"},
		{"undocumented status", get("/api/v1/devices", "t"), jsonAnswer(418, `{}`), "status is not supported"},
		{"code of another status", get("/api/v1/devices/d-1", "t"), problem(404, "app_not_found"), "app_not_found"},
		{"code of another status, in any answer", get("/api/v1/devices/d-1", "t"), problem(500, "device_not_found"), "device_not_found"},
		{"refused request taken", get("/api/v1/devices?limit=0", "t"), jsonAnswer(200, `{"devices": [], "next_cursor": null}`), "refuses this request"},
		{"no token taken", get("/api/v1/devices", ""), jsonAnswer(200, `{"devices": [], "next_cursor": null}`), "should be 401"},
		{"unknown path answered", get("/api/v1/nowhere", "t"), jsonAnswer(200, `{}`), "no such operation"},
		{"unknown path, other code", get("/api/v1/nowhere", "t"), problem(404, "device_not_found"), `want "not_found"`},
		{"HEAD without the blob's headers", head("/api/v1/blobs/" + strings.Repeat("a", 64)), Answer{Status: 200, Header: http.Header{}}, `header "Accept-Ranges" missing`},
		{"blob of other content", get("/api/v1/blobs/"+strings.Repeat("a", 64), "t"), Answer{Status: 200,
			Header: http.Header{"Content-Type": {"application/octet-stream"}, "Etag": {`"` + strings.Repeat("a", 64) + `"`}, "Accept-Ranges": {"bytes"}},
			Body:   []byte("not what was asked for")}, "does not hash"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &recordingTB{TB: t}
			c.Check(rec, tc.req, nil, tc.answer)
			if got := rec.reported(); !strings.Contains(got, tc.want) {
				t.Errorf("Check reported %q; want it to mention %q", got, tc.want)
			}
		})
	}

	t.Run("agreeing", func(t *testing.T) {
		rec := &recordingTB{TB: t}
		c.Check(rec, get("/api/v1/devices?limit=2", "t"), nil, jsonAnswer(200, `{"devices": [], "next_cursor": null}`))
		c.Check(rec, get("/api/v1/nowhere", "t"), nil, problem(404, "not_found"))
		if got := rec.reported(); got != "" {
			t.Errorf("Check reported %q on agreeing traffic", got)
		}
	})
}

// TestTransport sends traffic through the wrapper to a server that answers
// as a test picks: it passes requests and answers on unchanged, reports
// disagreements, and does not hold back an event stream or a blob.
func TestTransport(t *testing.T) {
	content := []byte(strings.Repeat("blob ", 1000))
	sum := sha256.Sum256(content)
	sha := hex.EncodeToString(sum[:])
	stream := make(chan string)
	var gotBody string
	mux := http.NewServeMux()
	mux.HandleFunc("POST /api/v1/admin/users", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		gotBody = string(b)
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"user_id": "u-1", "name": "alice", "token": "ctk_`+strings.Repeat("x", 43)+`"}`)
	})
	mux.HandleFunc("GET /api/v1/devices", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		io.WriteString(w, `{"devices": [], "next_cursor": null, "extra": true}`)
	})
	mux.HandleFunc("GET /api/v1/events", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-store, no-transform")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		for {
			select {
			case s := <-stream:
				io.WriteString(w, s)
				w.(http.Flusher).Flush()
			case <-r.Context().Done():
				return
			}
		}
	})
	mux.HandleFunc("GET /api/v1/blobs/{sha256}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("ETag", `"`+r.PathValue("sha256")+`"`)
		w.Header().Set("Accept-Ranges", "bytes")
		w.Write(content)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	rec := &recordingTB{TB: t}
	hc := &http.Client{Transport: Load(t).Transport(rec, nil), Timeout: 10 * time.Second}
	send := func(method, path, body string) *http.Response {
		t.Helper()
		var rd io.Reader
		if body != "" {
			rd = strings.NewReader(body)
		}
		r, err := http.NewRequest(method, srv.URL+path, rd)
		if err != nil {
			t.Fatal(err)
		}
		r.Header.Set("Authorization", "Bearer t")
		if body != "" {
			r.Header.Set("Content-Type", "application/json")
		}
		res, err := hc.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	readAll := func(res *http.Response) string {
		t.Helper()
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}

	t.Run("agreeing, bodies passed on", func(t *testing.T) {
		res := send("POST", "/api/v1/admin/users", `{"name": "alice"}`)
		if got := readAll(res); !strings.Contains(got, `"token": "ctk_xxx`) {
			t.Errorf("answer body = %q", got)
		}
		if gotBody != `{"name": "alice"}` {
			t.Errorf("server got body %q", gotBody)
		}
		if got := rec.reported(); got != "" {
			t.Errorf("reported %q on agreeing traffic", got)
		}
	})

	t.Run("undocumented member", func(t *testing.T) {
		readAll(send("GET", "/api/v1/devices", ""))
		if got := rec.reported(); !strings.Contains(got, "extra") {
			t.Errorf("reported %q; want the undocumented member named", got)
		}
		rec.errors = nil
	})

	t.Run("event stream not held back", func(t *testing.T) {
		res := send("GET", "/api/v1/events", "")
		defer res.Body.Close()
		go func() { stream <- "retry: 2000\n\n" }()
		buf := make([]byte, 64)
		n, err := res.Body.Read(buf)
		if err != nil || string(buf[:n]) != "retry: 2000\n\n" {
			t.Errorf("stream read %q, %v", buf[:n], err)
		}
		if got := rec.reported(); got != "" {
			t.Errorf("reported %q on a documented stream", got)
		}
	})

	t.Run("blob hashed as read", func(t *testing.T) {
		if got := readAll(send("GET", "/api/v1/blobs/"+sha, "")); got != string(content) {
			t.Errorf("blob came back as %d bytes; want %d", len(got), len(content))
		}
		if got := rec.reported(); got != "" {
			t.Errorf("reported %q on a whole blob of its name", got)
		}
		readAll(send("GET", "/api/v1/blobs/"+strings.Repeat("0", 64), ""))
		if got := rec.reported(); !strings.Contains(got, "does not hash") {
			t.Errorf("reported %q; want the blob's hash found wrong", got)
		}
	})
}
