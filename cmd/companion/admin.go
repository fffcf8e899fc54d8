package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

// apiClient is a thin client of the API of a running server, with the
// token it was given: the admin token for the admin CLI, a user's for
// command wait.
type apiClient struct {
	apiURL string
	token  string
	http   *http.Client
	// stall, when not zero, bounds how long do waits on the server
	// without progress (adminStall).
	stall time.Duration
}

// adminStall is how long the admin CLI waits on the server without
// progress: for it to take more of a body, or to answer once it has sent
// all of it. It bounds pauses, not the exchange: 5 minutes in all
// (http.Client.Timeout) cut off a firmware upload over a slow link that
// went steadily, which the server takes however long it runs.
var adminStall = 5 * time.Minute

// errStalled ends a request whose server made no progress for the
// client's stall.
var errStalled = errors.New("the server made no progress")

func runAdmin(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd, done, err := subCommand(args, stdout, stderr)
	if done {
		return err
	}
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs)
	apiURL := fs.String("api-url", "http://127.0.0.1:8080", "base URL of the running server")
	token := fs.String("admin-token", "", "admin token (default: read from DATA/admin.token)")
	data := fs.String("data", "./data", "the server's data directory, to find admin.token")
	ca := caFlag(fs)
	var claimCode, model, version, appID, bridge string
	var noBridge bool
	switch cmd {
	case "device provision":
		fs.StringVar(&claimCode, "claim-code", "", "the device's claim code (required)")
		fs.StringVar(&model, "model", "", "the device's model (required)")
		fs.StringVar(&bridge, "bridge", "", "the bridge that serves it (its commands wait until one does)")
	case "device assign":
		fs.StringVar(&bridge, "bridge", "", "the bridge that serves it from now on")
		fs.BoolVar(&noBridge, "none", false, "no bridge serves it from now on (its commands wait)")
	case "firmware publish":
		fs.StringVar(&model, "model", "", "the model the firmware is for (required)")
		fs.StringVar(&version, "version", "", "semantic version, e.g. 1.2.0 (required)")
	case "app publish":
		fs.StringVar(&appID, "app-id", "", "the app's id (required)")
		fs.StringVar(&version, "version", "", "semantic version (required)")
	}
	pos, err := parseInterspersed(fs, args[2:])
	if err != nil {
		return err
	}
	if err := applyEnv(fs); err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError{fmt.Sprintf("%s takes exactly one argument, got %d", cmd, len(pos))}
	}
	hc, err := apiHTTPClient(*apiURL, *ca)
	if err != nil {
		return err
	}
	arg := pos[0]
	tok, tokenFile := *token, ""
	if tok == "" {
		tokenFile = filepath.Join(*data, "admin.token")
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			// Where the packages keep it (bug 410): ./data is only
			// where a server started from the repository keeps it.
			return usageError{fmt.Sprintf("no --admin-token and none readable in %s: %v: give the server's data directory "+
				"with --data (COMPANION_DATA): --data /var/lib/companion on the host of companion.service (as root), "+
				"/data in the server's container (docker exec), or the token with --admin-token", *data, err)}
		}
		tok = strings.TrimSpace(string(b))
	}
	c := apiClient{apiURL: strings.TrimRight(*apiURL, "/"), token: tok, http: hc, stall: adminStall}

	var body []byte
	switch cmd {
	case "user create":
		body, err = c.postJSON(ctx, "/api/v1/admin/users", map[string]string{"name": arg})
	case "bridge create":
		body, err = c.postJSON(ctx, "/api/v1/admin/bridges", map[string]string{"bridge_id": arg})
	case "user token":
		body, err = c.do(ctx, http.MethodPost, "/api/v1/admin/users/"+url.PathEscape(arg)+"/token", "", http.NoBody, 0)
	case "bridge secret":
		body, err = c.do(ctx, http.MethodPost, "/api/v1/admin/bridges/"+url.PathEscape(arg)+"/secret", "", http.NoBody, 0)
	case "device provision":
		if claimCode == "" || model == "" {
			return usageError{"device provision needs --claim-code and --model"}
		}
		req := map[string]string{"device_id": arg, "claim_code": claimCode, "model": model}
		if bridge != "" {
			req["bridge_id"] = bridge
		}
		body, err = c.postJSON(ctx, "/api/v1/admin/devices", req)
	case "device assign":
		switch {
		case bridge != "" && noBridge:
			return usageError{"device assign takes --bridge ID or --none, not both"}
		case bridge == "" && !noBridge:
			return usageError{"device assign needs --bridge ID, or --none"}
		}
		req := map[string]any{"bridge_id": nil}
		if bridge != "" {
			req["bridge_id"] = bridge
		}
		body, err = c.sendJSON(ctx, http.MethodPut, "/api/v1/admin/devices/"+url.PathEscape(arg)+"/bridge", req)
	case "firmware publish":
		if model == "" || version == "" {
			return usageError{"firmware publish needs --model and --version"}
		}
		if err := checkRelease("--model", model, topics.ValidDeviceID(model), "1–64 of A–Z a–z 0–9 . _ : -", version); err != nil {
			return err
		}
		if err := checkFirmware(arg, version); err != nil {
			return err
		}
		body, err = c.putFile(ctx, "/api/v1/admin/firmware/"+url.PathEscape(model)+"/"+url.PathEscape(version), arg, stderr)
	case "app publish":
		if appID == "" || version == "" {
			return usageError{"app publish needs --app-id and --version"}
		}
		if err := checkRelease("--app-id", appID, topics.ValidAppID(appID), "1–128 of a–z 0–9 . _ -", version); err != nil {
			return err
		}
		body, err = c.putFile(ctx, "/api/v1/admin/apps/"+url.PathEscape(appID)+"/"+url.PathEscape(version), arg, stderr)
	}
	if err != nil {
		return staleTokenHint(err, tokenFile)
	}
	var pretty bytes.Buffer
	if json.Indent(&pretty, body, "", "  ") == nil {
		body = pretty.Bytes()
	}
	fmt.Fprintln(stdout, string(body))
	return nil
}

// staleTokenHint adds to a 401 answer, when the admin token was read from
// tokenFile, that the file may be stale: a server started with
// --admin-token accepts only that one, and leaves the token an earlier
// start generated into DATA/admin.token in place.
func staleTokenHint(err error, tokenFile string) error {
	var ae *apiError
	if tokenFile == "" || !errors.As(err, &ae) || ae.status != http.StatusUnauthorized {
		return err
	}
	return fmt.Errorf("%w\nthe admin token was read from %s, which may be stale: a server started with --admin-token "+
		"accepts only that token (it warns of the file at start); give it with --admin-token or COMPANION_ADMIN_TOKEN", err, tokenFile)
}

// checkRelease refuses, before the upload, the id and version of a
// release the API would refuse after it: an id it cannot hold in its path
// is answered 404 not_found ("no such resource"), which says nothing of
// the flag, and only once the whole file (up to 64 MiB) is sent.
func checkRelease(flagName, id string, idOK bool, idRule, version string) error {
	if !idOK {
		return usageError{fmt.Sprintf("%s %q: use %s", flagName, id, idRule)}
	}
	if !topics.ValidVersion(version) {
		return usageError{fmt.Sprintf("--version %q: give a semantic version such as 1.2.0 (no leading v)", version)}
	}
	return nil
}

// checkAPIURL refuses an --api-url the CLI could never reach the server
// at: without a scheme (127.0.0.1:8080, as --http is given) net/url failed
// with "first path segment in URL cannot contain colon", and with another
// scheme net/http with "unsupported protocol scheme", naming no flag. One
// that ends in /api/v1 (the README's $API) had every path doubled, and was
// answered "404 not_found: no such resource" under the path undoubled.
func checkAPIURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return usageError{fmt.Sprintf("--api-url %q: give the server's base URL, http://HOST:PORT or https://HOST:PORT", s)}
	}
	if strings.HasSuffix(strings.TrimRight(u.Path, "/"), "/api/v1") {
		return usageError{fmt.Sprintf("--api-url %q: give the server's base URL, without /api/v1 (the CLI adds it)", s)}
	}
	return nil
}

// caFlag defines the --ca of the CLI's commands that call the API.
func caFlag(fs *flag.FlagSet) *string {
	return fs.String("ca", "", "PEM CA `file` to verify an https:// --api-url with (default: the system's)")
}

// apiHTTPClient checks apiURL (checkAPIURL) and returns the client of a
// CLI command calling it: one verifying an https:// server with the
// certificates of caFile when it is set. Before --ca, the CLI verified
// a server with a private CA only given SSL_CERT_FILE (bug 246). A --ca
// with an http:// --api-url would do nothing, and is refused.
func apiHTTPClient(apiURL, caFile string) (*http.Client, error) {
	if err := checkAPIURL(apiURL); err != nil {
		return nil, err
	}
	if caFile == "" {
		return &http.Client{}, nil
	}
	if u, _ := url.Parse(apiURL); u.Scheme != "https" {
		return nil, usageError{fmt.Sprintf("--ca %q: only an https:// --api-url is verified with it; --api-url is %q", caFile, apiURL)}
	}
	conf, err := tlsclient.Config(caFile)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--ca: %v", err)}
	}
	return tlsclient.HTTPClient(conf), nil
}

// checkFirmware refuses, before the upload, a firmware version the API
// refuses before it reads the body (one an MCUboot header cannot hold,
// or not written as a device reports it), and a file whose MCUboot
// header is missing or holds another version, which the API refuses only
// once the whole image (up to 64 MiB) is sent (docs/reliability.md, bug
// 210). A file that is not a regular one, or cannot be read, is left to
// the upload to report.
func checkFirmware(file, version string) error {
	want, err := mcuboot.ParseVersion(version)
	if err != nil {
		return usageError{fmt.Sprintf("--version %q: an MCUboot image header holds major.minor.revision (at most 255.255.65535) and an optional +build number", version)}
	}
	if canon := want.String(); canon != version {
		return usageError{fmt.Sprintf("--version %q: write it %s, the form a device reports the version in", version, canon)}
	}
	f, err := os.Open(file)
	if err != nil {
		return nil
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil
	}
	head := make([]byte, mcuboot.HeaderSize)
	n, _ := io.ReadFull(f, head)
	h, err := mcuboot.ParseHeader(head[:n])
	switch {
	case err != nil:
		return usageError{fmt.Sprintf("%s is not an MCUboot image (imgtool sign's format): %v", file, err)}
	case h.Version != want:
		return usageError{fmt.Sprintf("--version %s: the MCUboot header of %s says %s", version, file, h.Version)}
	}
	return nil
}

// parseInterspersed parses flags that may come before or after positional
// arguments, and returns the positional ones.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, flagError(err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func (c apiClient) postJSON(ctx context.Context, path string, v any) ([]byte, error) {
	return c.sendJSON(ctx, http.MethodPost, path, v)
}

func (c apiClient) sendJSON(ctx context.Context, method, path string, v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return c.do(ctx, method, path, "application/json", bytes.NewReader(b), int64(len(b)))
}

// putFile uploads file, telling on progressTo how it goes.
func (c apiClient) putFile(ctx context.Context, path, file string, progressTo io.Writer) ([]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		// A directory would fail in the middle of the request, with
		// "readfrom tcp …: read FILE: is a directory".
		return nil, usageError{fmt.Sprintf("%s is not a regular file (a directory?): give the file to upload", file)}
	}
	p := newProgress(progressTo, fi.Size())
	defer p.finish()
	return c.do(ctx, http.MethodPut, path, "application/octet-stream", &countingReader{r: f, p: p}, fi.Size())
}

func (c apiClient) do(ctx context.Context, method, path, ctype string, body io.Reader, size int64) ([]byte, error) {
	if c.stall > 0 {
		// Each read of the body (the transport reads it as the server
		// takes it) puts off the end; once all is sent, the answer must
		// come within the stall.
		var cancel context.CancelCauseFunc
		ctx, cancel = context.WithCancelCause(ctx)
		defer cancel(nil)
		t := time.AfterFunc(c.stall, func() { cancel(errStalled) })
		defer t.Stop()
		body = &stallReader{r: body, t: t, d: c.stall}
	}
	b, err := c.exchange(ctx, method, path, ctype, body, size)
	if err != nil && errors.Is(context.Cause(ctx), errStalled) {
		return nil, fmt.Errorf("%s %s: %w for %v (it took no more of the body, or did not answer)", method, path, errStalled, c.stall)
	}
	return b, err
}

func (c apiClient) exchange(ctx context.Context, method, path, ctype string, body io.Reader, size int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.apiURL+path, body)
	if err != nil {
		return nil, err
	}
	req.ContentLength = size
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return nil, responseError(method, path, resp)
	}
	return io.ReadAll(io.LimitReader(resp.Body, 1<<20))
}

// stallReader puts off t by d at each read of r.
type stallReader struct {
	r io.Reader
	t *time.Timer
	d time.Duration
}

func (s *stallReader) Read(b []byte) (int, error) {
	s.t.Reset(s.d)
	return s.r.Read(b)
}

// apiError is an answer of the API other than a 2xx, told as the
// problem's code, detail and fields when it has them.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

// responseError reads resp, an answer other than a 2xx, into an *apiError.
func responseError(method, path string, resp *http.Response) error {
	out, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var p struct {
		Title, Detail, Code string
		Errors              []struct{ Field, Message string }
	}
	// A 5xx says only "internal error": its cause is in the server's log,
	// on the line that names the request's id (bug 384).
	var seeLog string
	if id := resp.Header.Get("X-Request-Id"); id != "" && resp.StatusCode >= 500 {
		seeLog = fmt.Sprintf(" (request id %s; the server's log says why on its line of request_id=%s)", id, id)
	}
	if json.Unmarshal(out, &p) == nil && p.Code != "" {
		msg := fmt.Sprintf("%s %s: %d %s: %s%s", method, path, resp.StatusCode, p.Code, p.Detail, seeLog)
		for _, e := range p.Errors {
			msg += fmt.Sprintf("\n  %s: %s", e.Field, e.Message)
		}
		return &apiError{status: resp.StatusCode, msg: msg}
	}
	return &apiError{status: resp.StatusCode, msg: fmt.Sprintf("%s %s: %s%s", method, path, resp.Status, seeLog)}
}
