package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"
	"github.com/google/uuid"

	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

type createUserRequest struct {
	Name string `json:"name"`
}

type userJSON struct {
	UserID string `json:"user_id"`
	Name   string `json:"name"`
	Token  string `json:"token,omitempty"`
}

func (s *Server) adminCreateUser(c *gin.Context) error {
	var req createUserRequest
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	rec, replayed, err := s.beginIdempotent(c, adminUserID, body.raw)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	if len(fields) == 0 {
		fields = checkName("name", req.Name)
	}
	if err := validationError(fields); err != nil {
		return err
	}
	// Refused, nothing stored, while the broker's accounts cannot be
	// written at all, as a bridge's creation is (bug 488). The token
	// would open the API, but its MQTT account waited on a retry kept in
	// this process's memory: a restart before the operator made the
	// server the plugin's admin lost it for good (the token is stored
	// hashed), and the user's app could never log in to MQTT, with
	// nothing to say so; only a new token mended it (docs/reliability.md,
	// bug 494).
	if err := s.accountsRefused(); err != nil {
		return err
	}
	token, hash, err := newSecret(userTokenPrefix)
	if err != nil {
		return err
	}
	u := companion.User{ID: uuid.NewString(), Name: req.Name, TokenHash: hash, CreatedAt: s.now()}
	// Not the request's context: a user on disk whose creation read as the
	// client's hang-up never got their broker account (bug 280).
	ctx := context.WithoutCancel(c.Request.Context())
	// A repeat gets the answer without the token: it is stored nowhere.
	actx, err := withAnswer(ctx, rec, http.StatusCreated, userJSON{UserID: u.ID, Name: u.Name}, "")
	if err != nil {
		return err
	}
	if err := s.store.CreateUser(actx, u); err != nil {
		return err
	}
	rec = settled(c)
	if s.accounts != nil {
		_ = s.accounts.UserCreated(ctx, u.ID, token) // logged and retried there
	}
	out := userJSON{UserID: u.ID, Name: u.Name, Token: token}
	return s.reply(c, http.StatusCreated, out, "", rec, nil)
}

// adminNewUserToken gives a user a new API token and answers it, as
// creation does: it exists only in this answer. From the store's commit on
// the old token opens nothing: the API refuses it, the broker (which is
// told) refuses it, the user's connections are closed, and their event
// streams end at their next heartbeat (streamAllowed). The user keeps
// their id, devices and commands. A user of an identity provider has no
// API token here (404).
func (s *Server) adminNewUserToken(c *gin.Context) error {
	rec, replayed, err := s.beginIdempotent(c, adminUserID, nil)
	if err != nil || replayed {
		return err
	}
	id := c.Param("user_id")
	if err := s.accountsRefused(); err != nil { // bug 488
		return err
	}
	token, hash, err := newSecret(userTokenPrefix)
	if err != nil {
		return err
	}
	// Not the request's context: a token on disk whose broker account was
	// not told kept the old one working there (bug 277's reason).
	ctx := context.WithoutCancel(c.Request.Context())
	// The user's name, for the answer, is read first: read after the
	// write, a failure answered 500 with the token replaced, shown to no
	// one, and the broker not told of it (bug 302).
	u, err := s.store.User(ctx, id)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return &Error{Code: CodeUserNotFound}
	case err != nil:
		return err
	}
	// A repeat gets the answer without the token: it is stored nowhere.
	actx, err := withAnswer(ctx, rec, http.StatusOK, userJSON{UserID: id, Name: u.Name}, "")
	if err != nil {
		return err
	}
	switch err := s.store.SetUserToken(actx, id, hash); {
	case errors.Is(err, companion.ErrNotFound):
		return &Error{Code: CodeUserNotFound}
	case err != nil:
		return err
	}
	rec = settled(c)
	if s.accounts != nil {
		_ = s.accounts.UserTokenChanged(ctx, id, token) // logged and retried there
	}
	return s.reply(c, http.StatusOK, userJSON{UserID: id, Name: u.Name, Token: token}, "", rec, nil)
}

type provisionRequest struct {
	DeviceID  string  `json:"device_id"`
	ClaimCode string  `json:"claim_code"`
	Model     string  `json:"model"`
	BridgeID  *string `json:"bridge_id"` // optional: the bridge that serves it
}

func (s *Server) adminProvisionDevice(c *gin.Context) error {
	var req provisionRequest
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	rec, replayed, err := s.beginIdempotent(c, adminUserID, body.raw)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	if !topics.ValidDeviceID(req.DeviceID) {
		fields = append(fields, FieldError{Field: "device_id", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -"})
	}
	switch {
	case req.ClaimCode == "" || len(req.ClaimCode) > maxClaimCodeBytes:
		fields = append(fields, FieldError{Field: "claim_code", Message: "must be 1 to 256 bytes"})
	case !slices.ContainsFunc(fields, func(f FieldError) bool { return f.Field == "claim_code" }):
		// A person types it from a label, a screen or a QR code's text:
		// one with a control character (a line break read in with it)
		// could never be registered.
		fields = append(fields, checkText("claim_code", req.ClaimCode, "", " (it is typed from the device's label)")...)
		if strings.TrimSpace(req.ClaimCode) == "" {
			fields = append(fields, FieldError{Field: "claim_code", Message: "must not be only spaces"})
		}
	}
	if !topics.ValidDeviceID(req.Model) {
		fields = append(fields, FieldError{Field: "model", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -"})
	}
	bridge := ""
	if req.BridgeID != nil {
		bridge = *req.BridgeID
		if !topics.ValidBridgeID(bridge) {
			fields = append(fields, FieldError{Field: "bridge_id", Message: "must be 1 to 64 of A-Z a-z 0-9 . _ : -"})
		}
	}
	if err := validationError(fields); err != nil {
		return err
	}
	d := companion.RegistryDevice{ID: req.DeviceID, Model: req.Model, ClaimHash: companion.HashSecret(provisionedClaim(req.ClaimCode)), CreatedAt: s.now(), BridgeID: bridge}
	ctx := c.Request.Context()
	out := provisionJSON{DeviceID: d.ID, Model: d.Model, BridgeID: stringOrNull(bridge)}
	actx, err := withAnswer(ctx, rec, http.StatusCreated, out, "")
	if err != nil {
		return err
	}
	err = s.store.ProvisionDevice(actx, d)
	switch {
	case errors.Is(err, companion.ErrExists):
		return &Error{Code: CodeDeviceExists}
	case errors.Is(err, companion.ErrNotFound):
		return errAdminNoOperatorBridge
	case err != nil:
		return err
	}
	rec = settled(c)
	if bridge != "" {
		s.moved(ctx, d.ID, "", bridge)
	}
	return s.reply(c, http.StatusCreated, out, "", rec, nil)
}

type provisionJSON struct {
	DeviceID string  `json:"device_id"`
	Model    string  `json:"model"`
	BridgeID *string `json:"bridge_id"`
}

// upload streams a raw body of at most limit bytes into a blob; one over
// it leaves nothing behind and is answered as readBody answers it. check,
// when not nil, wraps the body: an error it returns instead of the body's
// end leaves nothing behind either, and comes back as it is. Its
// Idempotency-Key covers method, path and the content's SHA-256.
func (s *Server) upload(c *gin.Context, limit int64, check func(io.Reader) io.Reader) (blob companion.Blob, rec *companion.Idempotency, replayed bool, err error) {
	if _, err := idempotencyKey(c); err != nil {
		return blob, nil, false, err
	}
	r := c.Request
	if err := checkCoding(c); err != nil {
		return blob, nil, false, err
	}
	if err := checkUploadType(r); err != nil {
		return blob, nil, false, err
	}
	if r.ContentLength > limit {
		return blob, nil, false, bodyTooLarge(c, 0, limit)
	}
	if r.ContentLength == 0 || r.Body == nil || r.Body == http.NoBody {
		return blob, nil, false, invalid("body", "must not be empty")
	}
	body := &countingReader{r: r.Body}
	var src io.Reader = body
	if check != nil {
		src = check(body)
	}
	blob, err = s.store.PutBlob(r.Context(), src, limit)
	switch {
	case errors.Is(err, companion.ErrTooLarge):
		return blob, nil, false, bodyTooLarge(c, body.n, limit)
	case err != nil && body.err != nil:
		// The body failed the store, not the store the body.
		return blob, nil, false, bodyReadError(body.err)
	case err != nil:
		return blob, nil, false, err
	case blob.Size == 0:
		return blob, nil, false, invalid("body", "must not be empty")
	}
	rec, replayed, err = s.beginIdempotent(c, adminUserID, []byte("sha256:"+blob.SHA256))
	return blob, rec, replayed, err
}

// checkUploadType refuses (415) an upload whose Content-Type says its body
// is not the file's bytes as they are: a form (curl -F sends the file in a
// multipart/form-data envelope, curl -d @FILE as
// application/x-www-form-urlencoded, with its line breaks removed), which
// would otherwise be published as the package. Any other type, or none
// (curl -T sends none), is taken: the bytes are the bytes, whatever their
// label, and an app package may well be JSON. Two labels of different
// types are refused (contentTypes): one may be a form's.
func checkUploadType(r *http.Request) error {
	labels, err := contentTypes(r)
	if err != nil {
		return err
	}
	for _, ct := range labels {
		if strings.TrimSpace(ct) == "" {
			continue
		}
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil {
			continue // a label we cannot read says nothing of the bytes
		}
		switch mt {
		case "multipart/form-data", "application/x-www-form-urlencoded":
			return &Error{Code: CodeUnsupportedMedia, Detail: "an upload is the file's bytes as they are, not a form (" + mt +
				"): send them with curl -T FILE or --data-binary @FILE, as application/octet-stream or with no Content-Type"}
		}
	}
	return nil
}

// releaseJSON is the answer to a firmware or app upload.
type releaseJSON struct {
	Model   string `json:"model,omitempty"`
	AppID   string `json:"app_id,omitempty"`
	Version string `json:"version"`
	SHA256  string `json:"sha256"`
	Size    int64  `json:"size"`
}

func (s *Server) adminPutFirmware(c *gin.Context) error {
	model, version := c.Param("model"), c.Param("version")
	if !topics.ValidDeviceID(model) {
		return errNoModelID
	}
	if !topics.ValidVersion(version) {
		return invalid("version", "must be a semantic version such as 1.2.3")
	}
	want, err := mcuboot.ParseVersion(version)
	if err != nil {
		return invalid("version", "an MCUboot image header cannot hold it: it takes major.minor.revision (at most 255.255.65535) and an optional +build number")
	}
	if canon := want.String(); canon != version {
		// "1.2.3+0" or "1.2.3+07" names the header 1.2.3 or 1.2.3+7 holds;
		// published so, no device would ever report it (an OTA would fail
		// comparing the two).
		return invalid("version", "write it "+canon+": the form a device reports an image header's version in")
	}
	blob, rec, replayed, err := s.upload(c, s.limits.MaxFirmwareBytes, func(r io.Reader) io.Reader {
		return &imageReader{r: r, v: mcuboot.NewVerifier(), want: want}
	})
	var fe *mcuboot.FormatError
	if errors.As(err, &fe) {
		detail := "the body is not an MCUboot image (imgtool's format): " + fe.Field + ": " + fe.Msg
		if fe.Field == "version" {
			detail = fe.Msg
		}
		return &Error{Code: CodeValidationFailed, Detail: detail, Fields: []FieldError{{Field: "image." + fe.Field, Message: fe.Msg}}}
	}
	if err != nil || replayed {
		return err
	}
	ctx := c.Request.Context()
	fw := companion.Firmware{Model: model, Version: version, SHA256: blob.SHA256, Size: blob.Size, CreatedAt: s.now()}
	status, err := publishRelease(fw.SHA256,
		func() (string, error) {
			old, err := s.store.Firmware(ctx, model, version)
			return old.SHA256, err
		},
		func() error { return s.store.PutFirmware(ctx, fw) },
		&Error{Code: CodeFirmwareExists, Detail: "firmware " + model + " " + version + " is already published with other content"})
	if err != nil {
		return err
	}
	return s.reply(c, status, releaseJSON{Model: model, Version: version, SHA256: fw.SHA256, Size: fw.Size}, "", rec, nil)
}

// imageReader passes a firmware body through while it checks it as an
// MCUboot image: at the body's end it returns the image's *FormatError
// instead of io.EOF when it is not one, or when its header's version is
// not want (Field "version"), so that nothing of it is stored.
type imageReader struct {
	r    io.Reader
	v    *mcuboot.Verifier
	want mcuboot.Version
}

func (ir *imageReader) Read(p []byte) (int, error) {
	n, err := ir.r.Read(p)
	ir.v.Write(p[:n])
	if err != io.EOF {
		return n, err
	}
	img, verr := ir.v.Close()
	switch {
	case verr != nil:
		return n, verr
	case img.Header.Version != ir.want:
		return n, &mcuboot.FormatError{Field: "version", Msg: "the image header's version is " + img.Header.Version.String() + ", not the " + ir.want.String() + " it is published as"}
	}
	return n, io.EOF
}

func (s *Server) adminPutApp(c *gin.Context) error {
	appID, version := c.Param("app_id"), c.Param("version")
	if !topics.ValidAppID(appID) {
		return errNoReleaseApp
	}
	if !topics.ValidVersion(version) {
		return invalid("version", "must be a semantic version such as 1.2.3")
	}
	blob, rec, replayed, err := s.upload(c, s.limits.MaxAppBytes, nil)
	if err != nil || replayed {
		return err
	}
	ctx := c.Request.Context()
	rel := companion.AppRelease{AppID: appID, Version: version, SHA256: blob.SHA256, Size: blob.Size, CreatedAt: s.now()}
	status, err := publishRelease(rel.SHA256,
		func() (string, error) {
			old, err := s.store.AppRelease(ctx, appID, version)
			return old.SHA256, err
		},
		func() error { return s.store.PutAppRelease(ctx, rel) },
		&Error{Code: CodeAppReleaseExists, Detail: "app " + appID + " " + version + " is already published with other content"})
	if err != nil {
		return err
	}
	return s.reply(c, status, releaseJSON{AppID: appID, Version: version, SHA256: rel.SHA256, Size: rel.Size}, "", rec, nil)
}

// publishRelease stores a release of content sha (put) unless one is
// there (read returns its content's SHA-256): the same content again is
// 200 and writes nothing, other content is exists (409), a new release
// 201. Both stores take the same content again as a no-op without saying
// so, so the release is read first to tell a repeat apart.
func publishRelease(sha string, read func() (string, error), put func() error, exists *Error) (int, error) {
	old, err := read()
	switch {
	case err == nil && old != sha:
		return 0, exists
	case err == nil:
		return http.StatusOK, nil
	case !errors.Is(err, companion.ErrNotFound):
		return 0, err
	}
	if err := put(); errors.Is(err, companion.ErrExists) {
		return 0, exists // published meanwhile, with other content
	} else if err != nil {
		return 0, err
	}
	return http.StatusCreated, nil
}

// catalogJSON is one app of the catalog: its latest release and every
// version published.
type catalogJSON struct {
	AppID     string   `json:"app_id"`
	Version   string   `json:"version"`
	SHA256    string   `json:"sha256"`
	Size      int64    `json:"size"`
	CreatedAt apiTime  `json:"created_at"`
	Versions  []string `json:"versions"`
}

// appCatalog answers a page of the app catalog, in app id order, each app
// read with its versions in the same read.
func (s *Server) appCatalog(c *gin.Context) error {
	limit, after, err := page(c, topics.ValidAppID, nil)
	if err != nil {
		return err
	}
	catalog, more, err := s.store.AppCatalog(c.Request.Context(), after, limit)
	if err != nil {
		return err
	}
	apps := make([]catalogJSON, 0, len(catalog))
	for _, a := range catalog {
		l := a.Latest
		apps = append(apps, catalogJSON{AppID: l.AppID, Version: l.Version, SHA256: l.SHA256, Size: l.Size, CreatedAt: timeOrNull(l.CreatedAt), Versions: a.Versions})
	}
	var next *string
	if more && len(apps) > 0 {
		next = cursorOf(apps[len(apps)-1].AppID)
	}
	return s.reply(c, http.StatusOK, gin.H{"apps": apps, "next_cursor": next}, "", nil, nil)
}

func validSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !(s[i] >= '0' && s[i] <= '9' || s[i] >= 'a' && s[i] <= 'f') {
			return false
		}
	}
	return true
}

// getBlob serves content by SHA-256, with Range support so that a broken
// download resumes.
func (s *Server) getBlob(c *gin.Context) error {
	sha := c.Param("sha256")
	if !validSHA256(sha) {
		return errNoBlobName
	}
	ctx := c.Request.Context()
	if bridge := currentBridge(c); bridge != "" {
		// A bridge gets only what an unfinished command of one of its
		// devices references (CONTRACT §9): anything else reads as absent.
		needed, err := s.store.BlobNeeded(ctx, sha, bridge)
		if err != nil {
			return err
		}
		if !needed {
			return &Error{Code: CodeBlobNotFound}
		}
	}
	f, blob, err := s.store.OpenBlob(ctx, sha)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return &Error{Code: CodeBlobNotFound}
	case err != nil:
		return err
	}
	defer f.Close()
	h := c.Writer.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("ETag", `"`+blob.SHA256+`"`)
	h.Set("Cache-Control", "private, max-age=31536000, immutable")
	w := &blobWriter{ResponseWriter: c.Writer, rc: http.NewResponseController(c.Writer), idle: s.limits.BodyIdle}
	// The deadline stays on the connection, which may serve another
	// request once this one ends.
	defer func() { _ = w.rc.SetWriteDeadline(time.Time{}) }()
	r := c.Request
	if rng := r.Header.Get("Range"); rng != "" {
		if kept := blobRange(rng, blob.Size); kept != rng {
			r = r.Clone(ctx)
			r.Header.Del("Range")
			if kept != "" {
				r.Header.Set("Range", kept)
			}
		}
	}
	http.ServeContent(w, r, "", blob.CreatedAt, f)
	if w.failed == 0 {
		// What net/http holds back goes within the deadline too.
		_ = w.rc.Flush()
		return nil
	}
	// ServeContent has set its plain-text error's headers, and left those
	// of a success on some errors: a problem is not the content, and must
	// not be cached as it is.
	for _, k := range []string{"Content-Type", "X-Content-Type-Options", "Content-Range", "ETag", "Cache-Control", "Last-Modified"} {
		h.Del(k)
	}
	switch w.failed {
	case http.StatusRequestedRangeNotSatisfiable:
		// RFC 9110 §15.5.17: the answer names the content's length, also
		// when the Range was not even well-formed.
		h.Set("Content-Range", fmt.Sprintf("bytes */%d", blob.Size))
		return &Error{Code: CodeRangeNotSatisfiable}
	case http.StatusPreconditionFailed:
		// The client's If-Match or If-Unmodified-Since is false.
		return &Error{Code: CodePreconditionFailed}
	}
	return fmt.Errorf("serving blob %s: http.ServeContent answered %d", sha, w.failed)
}

// blobRange reads a Range header as RFC 9110 §14.1 and §14.2 have it, for
// content of size bytes, and returns the header to give http.ServeContent:
//   - "" when the header is to be ignored, and the whole content served
//     (a 200): a unit other than bytes (which §14.2 says to ignore), or a
//     ranges-specifier that is invalid (§14.1.1: no range, a range that
//     is not digits, or an int-range whose last-pos is before its
//     first-pos), which §14.2 lets a server ignore, as 416 is for valid
//     ranges none of which is satisfiable (§15.5.17);
//   - the satisfiable ranges, written as ServeContent reads them: the
//     unit in lower case (units are case-insensitive), a last-pos or a
//     suffix-length past the content (however many digits) cut to it;
//   - when none is satisfiable (each starts past the end, or is a suffix
//     of length 0, `bytes=-0`, which ServeContent would serve as an empty
//     part), the range just past the end, which ServeContent answers 416
//     after the preconditions and If-Range, as the RFC orders them.
//
// A header of more than maxBlobRanges ranges is ignored too, as Apache
// httpd's MaxRanges has it: ServeContent serves any number of them, each
// a part of its own, as long as they add up to no more than the content,
// so that a header of 250,000 ranges of one byte (`0-0,0-0,…`, a megabyte
// of header, which net/http takes) was answered 250,000 parts, each a seek
// and a read of the blob (on PostgreSQL, of its chunk of 256 KiB when the
// ranges go back and forth).
//
// ServeContent alone answers 416 to every header it cannot parse, to a
// last-pos it cannot hold in an int64, and to `Bytes=`.
func blobRange(h string, size int64) string {
	unit, set, ok := strings.Cut(h, "=")
	if !ok || !strings.EqualFold(unit, "bytes") {
		return ""
	}
	end := strconv.FormatInt(size, 10) // as digits, to compare with others
	var kept []string
	specs := 0
	for spec := range strings.SplitSeq(set, ",") {
		spec = strings.Trim(spec, " \t")
		if spec == "" {
			continue // an empty list element (RFC 9110 §5.6.1)
		}
		if specs++; specs > maxBlobRanges {
			return ""
		}
		first, last, ok := strings.Cut(spec, "-")
		switch {
		case !ok || first != "" && !isDigits(first) || last != "" && !isDigits(last):
			return ""
		case first == "" && last == "":
			return ""
		case first == "": // a suffix-range: the last `last` bytes
			if cmpDigits(last, "0") == 0 {
				continue // unsatisfiable
			}
			if cmpDigits(last, end) > 0 {
				last = end
			}
			kept = append(kept, "-"+trimZeros(last))
		case last != "" && cmpDigits(last, first) < 0:
			return ""
		case cmpDigits(first, end) >= 0:
			continue // starts past the end: unsatisfiable
		default:
			if last != "" && cmpDigits(last, end) >= 0 {
				last = "" // to the end
			}
			kept = append(kept, trimZeros(first)+"-"+trimZeros(last))
		}
	}
	switch {
	case specs == 0:
		return ""
	case len(kept) == 0:
		return "bytes=" + end + "-"
	}
	return "bytes=" + strings.Join(kept, ",")
}

// maxBlobRanges is the most ranges a blob's Range may ask for and be
// served; one of more is served whole (a 200). Apache httpd's MaxRanges
// defaults to 200 (lighttpd keeps 128, nginx's max_ranges none but the
// content's size, as ServeContent); a bridge resuming a download asks for
// one.
const maxBlobRanges = 200

// isDigits reports whether s is one or more ASCII digits.
func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// trimZeros drops the leading zeros of a number's digits, leaving one
// digit at least; "" stays "".
func trimZeros(s string) string {
	for len(s) > 1 && s[0] == '0' {
		s = s[1:]
	}
	return s
}

// cmpDigits compares two numbers written in digits, of any length.
func cmpDigits(a, b string) int {
	a, b = trimZeros(a), trimZeros(b)
	if c := len(a) - len(b); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}

// blobWriter stands between http.ServeContent and the client. ServeContent
// answers its own errors (an unsatisfiable range, a failed seek) as plain
// text, which CONTRACT §2 does not allow: blobWriter keeps such an answer
// back and records its status, for getBlob to answer as a problem.
//
// Each write may wait idle (Limits.BodyIdle) for the client to take it, as
// each read of a request body may wait for the client to send: a client
// that asked for a blob and then took nothing of it (its process stuck,
// its receive window shut) held the handler, the blob's file and the
// connection for as long as its kernel answered, for ever
// (docs/reliability.md, bug 318). ServeContent writes 32 KiB at a time,
// so a download goes on at any rate above 32 KiB a BodyIdle.
type blobWriter struct {
	http.ResponseWriter
	failed int // the status of the error ServeContent answered, if any
	rc     *http.ResponseController
	idle   time.Duration // <= 0: no deadline
}

func (w *blobWriter) WriteHeader(code int) {
	switch {
	case w.failed != 0:
	case code >= 400:
		w.failed = code
	default:
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *blobWriter) Write(p []byte) (int, error) {
	if w.failed != 0 {
		return len(p), nil // the error's text, never sent
	}
	return writeWithin(w.ResponseWriter, w.rc, w.idle, p)
}

// writeWithin writes p to w, which the client must take within idle (no
// deadline when idle <= 0): the deadline is set on rc, w's controller.
func writeWithin(w io.Writer, rc *http.ResponseController, idle time.Duration, p []byte) (int, error) {
	if idle > 0 {
		if err := rc.SetWriteDeadline(time.Now().Add(idle)); err != nil && !errors.Is(err, http.ErrNotSupported) {
			return 0, err
		}
	}
	return w.Write(p)
}
