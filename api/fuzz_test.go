package api

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"image"
	"image/color"
	"image/png"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"unicode/utf8"
)

// fuzzRoutes are the routes that take a body, with the fuzzed body sent
// to each. The device dev-1 is the caller's; weather 1.0.0 is in the
// catalog.
var fuzzRoutes = []struct {
	method, path string
	admin        bool
}{
	{"POST", "/api/v1/devices/register", false},
	{"POST", "/api/v1/devices/dev-1/push/text", false},
	{"POST", "/api/v1/devices/dev-1/push/image", false},
	{"POST", "/api/v1/devices/dev-1/apps/install", false},
	{"PUT", "/api/v1/devices/dev-1/apps/weather/update", false},
	{"PUT", "/api/v1/devices/dev-1/settings", false},
	{"POST", "/api/v1/devices/dev-1/ota/update", false},
	{"POST", "/api/v1/admin/users", true},
	{"POST", "/api/v1/admin/devices", true},
	{"POST", "/api/v1/admin/bridges", true},
}

func tinyPNG() []byte {
	img := image.NewRGBA(image.Rect(0, 0, 2, 2))
	img.Set(0, 0, color.White)
	var b bytes.Buffer
	png.Encode(&b, img)
	return b.Bytes()
}

// FuzzRequests sends arbitrary bodies to every JSON route: whatever comes
// in, the answer is never a 5xx, always JSON, and a problem always has the
// contract's shape.
func FuzzRequests(f *testing.F) {
	img := base64.StdEncoding.EncodeToString(tinyPNG())
	seeds := []string{
		`{"device_id":"dev-2","claim_code":"code-dev-2"}`,
		`{"text":"hello","title":"t","ttl_seconds":60}`,
		`{"image":"` + img + `","content_type":"image/png"}`,
		`{"app_id":"weather","version":"1.0.0"}`,
		`{"version":"1.0.0"}`,
		`{"brightness":80,"language":"de"}`,
		`{}`,
		`{"name":"n"}`,
		`{"device_id":"d9","claim_code":"c","model":"sim-1"}`,
		`{"bridge_id":"b9"}`,
		`{"text":"\ud800"}`,
		`{"text":1}`,
		`[]`,
		`null`,
		`{"ttl_seconds":1e400}`,
		`{"image":"iVBORw0KGgo="}`,
		"\xff\xfe",
	}
	for i := range fuzzRoutes {
		for _, s := range seeds {
			f.Add(uint8(i), []byte(s))
		}
	}
	e := newEnv(f)
	tok := e.bound("dev-1")
	e.provision("dev-2", "code-dev-2", "sim-1")
	e.report("dev-1", "1.0.0")
	e.reportSettings("dev-1")
	r := e.do("PUT", "/api/v1/admin/apps/weather/1.0.0", testAdminToken, []byte("pkg"))
	if r.status != http.StatusCreated {
		f.Fatalf("publish app: %d %s", r.status, r.body)
	}
	h := e.api.Handler()

	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		rt := fuzzRoutes[int(route)%len(fuzzRoutes)]
		req := httptest.NewRequest(rt.method, rt.path, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if rt.admin {
			req.Header.Set("Authorization", "Bearer "+testAdminToken)
		} else {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code >= 500 {
			t.Fatalf("%s %s %q → %d %s", rt.method, rt.path, body, w.Code, w.Body)
		}
		if !json.Valid(w.Body.Bytes()) && w.Code != http.StatusNoContent {
			t.Fatalf("%s %s %q → not JSON: %s", rt.method, rt.path, body, w.Body)
		}
		if w.Code >= 400 {
			var p struct {
				Type, Title, Code string
				Status            int
				Errors            []FieldError
			}
			if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Code == "" || p.Status != w.Code || p.Errors == nil {
				t.Fatalf("%s %s %q → problem without the contract's shape: %s", rt.method, rt.path, body, w.Body)
			}
			if !strings.HasPrefix(w.Header().Get("Content-Type"), "application/problem+json") {
				t.Fatalf("problem served as %q", w.Header().Get("Content-Type"))
			}
			if !utf8.Valid(w.Body.Bytes()) {
				t.Fatalf("problem is not UTF-8: %q", w.Body)
			}
		}
	})
}

// fuzzReads are the routes that take a query, or ids in their path: %s is
// a path segment the fuzzer writes.
var fuzzReads = []string{
	"/api/v1/devices",
	"/api/v1/devices/dev-1/commands",
	"/api/v1/devices/%s/commands",
	"/api/v1/devices/dev-1/commands/%s",
	"/api/v1/devices/%s/status",
	"/api/v1/devices/%s/settings",
	"/api/v1/devices/%s/apps",
	"/api/v1/devices/%s/ota/check",
	"/api/v1/apps",
	"/api/v1/bridges",
}

// FuzzReads sends arbitrary queries and path segments to the routes that
// read them: as FuzzRequests, never a 5xx, always JSON, a problem in the
// contract's shape; a list's next_cursor, when there is one, is taken back.
func FuzzReads(f *testing.F) {
	for i := range fuzzReads {
		for _, q := range []string{"", "limit=1", "limit=0&cursor=x", "cursor=%zz", "state=queued;x", "limit=1e400", "cursor=ZGV2LTE", "state=sent&state=queued"} {
			f.Add(uint8(i), "dev-1", q)
		}
	}
	f.Add(uint8(3), "0190a000-0000-7000-8000-00000000000A", "")
	f.Add(uint8(2), "dev-1%2F..", "")
	e := newEnv(f)
	tok := e.bound("dev-1")
	e.report("dev-1", "1.0.0")
	for range 3 {
		if r := e.do("POST", "/api/v1/devices/dev-1/push/text", tok, map[string]any{"text": "hi"}); r.status != http.StatusAccepted {
			f.Fatalf("push text: %d %s", r.status, r.body)
		}
	}
	h := e.api.Handler()

	f.Fuzz(func(t *testing.T, route uint8, segment, query string) {
		path := fuzzReads[int(route)%len(fuzzReads)]
		path = strings.Replace(path, "%s", segment, 1)
		req, err := http.NewRequest("GET", "http://api"+path+"?"+query, nil)
		if err != nil {
			return // no request a client could send
		}
		req.Header.Set("Authorization", "Bearer "+tok)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code >= 500 {
			t.Fatalf("GET %s?%s → %d %s", path, query, w.Code, w.Body)
		}
		if !json.Valid(w.Body.Bytes()) {
			t.Fatalf("GET %s?%s → not JSON: %s", path, query, w.Body)
		}
		if w.Code >= 400 {
			var p struct {
				Code   string
				Status int
				Errors []FieldError
			}
			if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Code == "" || p.Status != w.Code || p.Errors == nil {
				t.Fatalf("GET %s?%s → problem without the contract's shape: %s", path, query, w.Body)
			}
			return
		}
		var list struct {
			NextCursor *string `json:"next_cursor"`
		}
		if json.Unmarshal(w.Body.Bytes(), &list) == nil && list.NextCursor != nil {
			req, _ := http.NewRequest("GET", "http://api"+req.URL.Path+"?cursor="+url.QueryEscape(*list.NextCursor), nil)
			req.Header.Set("Authorization", "Bearer "+tok)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, req)
			if w.Code != http.StatusOK {
				t.Fatalf("GET %s with the next_cursor it gave, %q → %d %s", req.URL.Path, *list.NextCursor, w.Code, w.Body)
			}
		}
	})
}

// FuzzImageHeader feeds arbitrary bytes to the image check: it never
// panics, never accepts what is not a PNG or JPEG within the limits, nor
// one that is not whole, and never decodes pixels.
func FuzzImageHeader(f *testing.F) {
	f.Add(tinyPNG())
	f.Add(jpegOf(f, 16, 16))
	f.Add([]byte("\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x01\x86\xa0\x00\x01\x86\xa0\x08\x06\x00\x00\x00"))
	f.Add([]byte("\xff\xd8\xff\xe0\x00\x10JFIF\x00"))
	f.Add([]byte("GIF89a"))
	f.Add([]byte{})
	s, err := New(Options{Store: nil, Commands: nil})
	if err == nil {
		f.Fatal("New accepted no store")
	}
	e := newEnv(f)
	s = e.api
	f.Fuzz(func(t *testing.T, data []byte) {
		_, cfg, ctype, fields := s.checkImage(base64.StdEncoding.EncodeToString(data), nil)
		if len(fields) > 0 {
			return
		}
		if ctype != "image/png" && ctype != "image/jpeg" {
			t.Fatalf("accepted content type %q", ctype)
		}
		if cfg.Width < 1 || cfg.Height < 1 || cfg.Width > s.limits.MaxImageSide || cfg.Height > s.limits.MaxImageSide {
			t.Fatalf("accepted %d×%d", cfg.Width, cfg.Height)
		}
		if !wholeImage(strings.TrimPrefix(ctype, "image/"), data) {
			t.Fatalf("accepted an image that is not whole")
		}
	})
}
