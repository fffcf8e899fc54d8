package api

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"image"
	_ "image/jpeg" // DecodeConfig reads JPEG headers
	_ "image/png"  // and PNG headers
	"maps"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/gin-gonic/gin"

	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/topics"
)

func commandLocation(deviceID, commandID string) string {
	return "/api/v1/devices/" + deviceID + "/commands/" + commandID
}

func blobRef(sha string, size int64) topics.Blob {
	return topics.Blob{SHA256: sha, Size: size, URL: "/api/v1/blobs/" + sha}
}

// beginCommand handles the Idempotency-Key of a request that creates a
// command. A repeat of the first request is answered with that request's
// command as it is now (replayed = true); otherwise it returns the record
// for Submit (nil without a key).
func (s *Server) beginCommand(c *gin.Context, body []byte) (rec *companion.Idempotency, replayed bool, err error) {
	key, err := idempotencyKey(c)
	if err != nil || key == "" {
		return nil, false, err
	}
	user := currentUser(c)
	hash := requestHash(c, body)
	ctx := c.Request.Context()
	old, err := s.store.Idempotency(ctx, user.ID, key)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return &companion.Idempotency{UserID: user.ID, Key: key, RequestHash: hash, Status: http.StatusAccepted}, false, nil
	case err != nil:
		return nil, false, err
	case !sameRequest(old.RequestHash, hash, c, body) || old.CommandID == "":
		return nil, false, errIdemReused
	}
	cmd, err := s.store.Command(ctx, old.CommandID)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return nil, false, errIdemGone
	case err != nil:
		return nil, false, fmt.Errorf("command %s of an idempotency record: %w", old.CommandID, err)
	}
	return nil, true, s.answerCommand(c, asAccepted(cmd), http.StatusAccepted, true)
}

// asAccepted is the command as the answer that accepted it showed it:
// queued, as stored. A repeat of the request (Idempotency-Key) returns
// that first answer (CONTRACT §2), not the command as it is now: its
// Location, or a Prefer: wait on the repeat, tells how it went since.
func asAccepted(c companion.Command) companion.Command {
	c.State, c.Progress, c.Error, c.Result, c.UpdatedAt = companion.StateQueued, nil, nil, nil, c.CreatedAt
	return c
}

// commandBody reads the JSON body of a request that creates a command into
// req, and answers a repeat of an Idempotency-Key request (replayed). fields
// holds the body's encoding errors, for the caller's checks to extend.
func (s *Server) commandBody(c *gin.Context, limit int64, optional bool, req any) (idem *companion.Idempotency, body *jsonBody, replayed bool, err error) {
	body, err = readJSON(c, limit, optional, req)
	if err != nil {
		return nil, nil, false, err
	}
	idem, replayed, err = s.beginCommand(c, body.raw)
	if err != nil || replayed {
		return nil, nil, replayed, err
	}
	return idem, body, false, nil
}

// send hands a new command to the broker. desired, for a settings.update,
// is what the store records as the device's desired settings in the write
// that stores the command (companion.Command.Desired).
func (s *Server) send(c *gin.Context, deviceID, op string, payload any, desired map[string]json.RawMessage, ttl time.Duration, idem *companion.Idempotency) (companion.Command, error) {
	p, err := fastjson.Marshal(payload)
	if err != nil {
		return companion.Command{}, err
	}
	cmd := companion.Command{
		DeviceID:  deviceID,
		UserID:    currentUser(c).ID,
		Op:        op,
		Payload:   p,
		ExpiresAt: s.now().Add(ttl),
		Blob:      blobOf(payload),
		Desired:   desired,
	}
	got, replayed, err := s.cmds.Submit(c.Request.Context(), cmd, idem)
	if err == nil && replayed {
		got = asAccepted(got) // the first request's, which overlapped this one
	}
	switch {
	case errors.Is(err, companion.ErrQueueFull):
		return companion.Command{}, &Error{Code: CodeQueueFull, RetryAfter: ceilSeconds(s.limits.QueueFullRetryAfter)}
	case errors.Is(err, companion.ErrIdemConflict):
		return companion.Command{}, errIdemReused
	case idem != nil && errors.Is(err, companion.ErrNotFound):
		// The store found the key's record as it checked it in the
		// command's write (a repeat that overlapped the first request,
		// beginCommand saw no record), and its command purged.
		return companion.Command{}, errIdemGone
	case errors.Is(err, companion.ErrNotOwned):
		// Unbound (or bound anew) since boundDevice looked: the store
		// checks again as it stores the command.
		return companion.Command{}, errDeviceNotFound
	case err != nil:
		return companion.Command{}, err
	}
	return got, nil
}

// blobOf is the SHA-256 of the blob a command's payload references: the
// bridge may download it while the command is unfinished.
func blobOf(payload any) string {
	switch p := payload.(type) {
	case topics.PushImage:
		return p.Blob.SHA256
	case topics.AppInstall:
		return p.Blob.SHA256
	case topics.OTAUpdate:
		return p.Blob.SHA256
	}
	return ""
}

// submit hands a new command to the broker and answers it.
func (s *Server) submit(c *gin.Context, deviceID, op string, payload any, ttl time.Duration, idem *companion.Idempotency) error {
	cmd, err := s.send(c, deviceID, op, payload, nil, ttl, idem)
	if err != nil {
		return err
	}
	return s.answerCommand(c, cmd, http.StatusAccepted, true)
}

// answerCommand answers with the command, after holding the answer until
// it is final when the request says Prefer: wait=N. A final command is a
// 200 with Preference-Applied.
func (s *Server) answerCommand(c *gin.Context, cmd companion.Command, status int, withLocation bool) error {
	n, wants := s.preferWait(c.Request)
	if wants && n > 0 && !companion.IsFinal(cmd.State) {
		ctx, cancel := context.WithTimeout(c.Request.Context(), time.Duration(n)*time.Second)
		got, err := s.cmds.Wait(ctx, cmd.ID)
		timedOut := ctx.Err() != nil
		cancel()
		switch {
		case err == nil:
			cmd = got
		case !timedOut || c.Request.Context().Err() != nil:
			return err
		}
	}
	if wants && companion.IsFinal(cmd.State) {
		status = http.StatusOK
		c.Header("Preference-Applied", "wait="+strconv.Itoa(n))
	}
	loc := ""
	if withLocation {
		loc = commandLocation(cmd.DeviceID, cmd.ID)
	}
	return s.reply(c, status, toCommand(cmd), loc, nil, nil)
}

// ttl checks an optional ttl_seconds, v as decoded and lit as the body
// writes it. The number is judged by its digits (topics.ExactWhole), not by the
// float64 nearest them: 59.99999999999999999 and 604800.00000000000001
// read as 60 and 604800, and were taken (docs/reliability.md, bug 511).
func (s *Server) ttl(v *float64, lit json.RawMessage) (time.Duration, []FieldError) {
	if v == nil {
		return s.limits.DefaultTTL, nil
	}
	lo, hi := int64(s.limits.MinTTL.Seconds()), int64(s.limits.MaxTTL.Seconds())
	n, whole, fits := topics.ExactWhole(lit)
	switch {
	case !whole:
		return 0, []FieldError{{Field: "ttl_seconds", Message: "must be a whole number of seconds"}}
	case !fits || n < lo || n > hi:
		return 0, []FieldError{{Field: "ttl_seconds", Message: fmt.Sprintf("must be between %d and %d", lo, hi)}}
	}
	return time.Duration(n) * time.Second, nil
}

type pushTextRequest struct {
	Text  string   `json:"text"`
	Title string   `json:"title"`
	TTL   *float64 `json:"ttl_seconds"`
}

func (s *Server) pushText(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	var req pushTextRequest
	idem, body, replayed, err := s.commandBody(c, s.limits.textBody(), false, &req)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	notUTF8 := map[string]bool{} // named so already
	for _, f := range fields {
		notUTF8[f.Field] = true
	}
	switch {
	case req.Text == "":
		fields = append(fields, FieldError{Field: "text", Message: "is required"})
	case len(req.Text) > s.limits.MaxTextBytes:
		fields = append(fields, FieldError{Field: "text", Message: fmt.Sprintf("must be at most %d bytes", s.limits.MaxTextBytes)})
	case !notUTF8["text"]:
		// Lines and tabs are a text's own; a title is one line.
		fields = append(fields, checkText("text", req.Text, topics.TextControls, " other than tab and line breaks")...)
	}
	switch {
	case len(req.Title) > s.limits.MaxTitleBytes:
		fields = append(fields, FieldError{Field: "title", Message: fmt.Sprintf("must be at most %d bytes", s.limits.MaxTitleBytes)})
	case !notUTF8["title"]:
		fields = append(fields, checkText("title", req.Title, "", " (a title is one line)")...)
	}
	ttl, bad := s.ttl(req.TTL, body.members["ttl_seconds"])
	fields = append(fields, bad...)
	if err := validationError(fields); err != nil {
		return err
	}
	return s.submit(c, b.DeviceID, topics.OpPushText, topics.PushText{Text: req.Text, Title: req.Title}, ttl, idem)
}

type pushImageRequest struct {
	Image       string   `json:"image"`
	ContentType *string  `json:"content_type"`
	TTL         *float64 `json:"ttl_seconds"`
}

// imageFormats are the content types of the image formats a device takes,
// by the name image.DecodeConfig gives them.
var imageFormats = map[string]string{"png": "image/png", "jpeg": "image/jpeg"}

// checkImage decodes and checks a pushed image: its size and format, its
// pixel size from its header, and then that the rest of it is all there
// (wholeImage). Its pixels are never decoded here: at 4096×4096 that
// would take up to 128 MiB and a second of CPU for each request.
func (s *Server) checkImage(b64 string, contentType *string) (data []byte, cfg image.Config, ctype string, fields []FieldError) {
	// Spelled as api/openapi.json lists them: the member is one of two
	// values, not a media type with parameters or in another case.
	if contentType != nil && *contentType != "image/png" && *contentType != "image/jpeg" {
		fields = append(fields, FieldError{Field: "content_type", Message: "must be image/png or image/jpeg"})
		contentType = nil
	}
	if b64 == "" {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: "is required"})
	}
	if int64(base64.StdEncoding.DecodedLen(len(b64))) > s.limits.MaxImageBytes+3 {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: fmt.Sprintf("must be at most %d bytes decoded", s.limits.MaxImageBytes)})
	}
	// encoding/base64 skips line breaks, which standard base64 does not
	// have (RFC 4648 §3.1) and api/openapi.json refuses.
	if strings.ContainsAny(b64, "\r\n") {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: "must be standard base64 on one line: it has a line break" +
			" (Android's Base64.DEFAULT and Java's MIME encoder write them: use NO_WRAP, or Base64.getEncoder())"})
	}
	data, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		data, err = base64.RawStdEncoding.DecodeString(b64)
	}
	if err != nil {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: base64Problem(b64)})
	}
	if int64(len(data)) > s.limits.MaxImageBytes {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: fmt.Sprintf("must be at most %d bytes decoded", s.limits.MaxImageBytes)})
	}
	cfg, format, err := image.DecodeConfig(bytes.NewReader(data))
	ctype = imageFormats[format]
	if err != nil || ctype == "" {
		return nil, cfg, "", append(fields, FieldError{Field: "image", Message: "must be a PNG or JPEG image"})
	}
	side := s.limits.MaxImageSide
	switch {
	case cfg.Width < 1 || cfg.Height < 1 || cfg.Width > side || cfg.Height > side:
		fields = append(fields, FieldError{Field: "image", Message: fmt.Sprintf("must be at most %d×%d pixels (it is %d×%d)", side, side, cfg.Width, cfg.Height)})
	case !wholeImage(format, data):
		fields = append(fields, FieldError{Field: "image", Message: "must be a whole " + strings.ToUpper(format) + " image: it is cut short or damaged"})
	}
	if contentType != nil && *contentType != ctype {
		fields = append(fields, FieldError{Field: "content_type", Message: "does not match the image, which is " + ctype})
	}
	return data, cfg, ctype, fields
}

// base64Problem says why b64 is not standard base64, where a client's
// usual mistake shows: "must be standard base64" alone was the answer to a
// data: URL (FileReader.readAsDataURL) and to the URL-safe alphabet
// (Android's Base64.URL_SAFE, Java's getUrlEncoder), each of which its
// user knows as base64 (docs/reliability.md, bug 376).
func base64Problem(b64 string) string {
	switch {
	case strings.HasPrefix(b64, "data:"):
		return "must be standard base64 alone, not a data: URL: send what follows its \"base64,\""
	case strings.ContainsAny(b64, "-_") && strings.Trim(b64, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=") == "":
		return "must be standard base64, with + and /: it is in the URL-safe alphabet, with - and _"
	}
	return "must be standard base64"
}

// wholeImage reports whether an image whose header image.DecodeConfig
// took is all there, as a device that decodes it needs it: a PNG's chunks
// each whole with its CRC, an IDAT among them and an IEND after them; a
// JPEG's segments and scans running on to its EOI. What follows the end
// is let be, as decoders do. It reads the image's structure, not its
// compressed pixels.
func wholeImage(format string, data []byte) bool {
	switch format {
	case "png":
		return wholePNG(data)
	case "jpeg":
		return wholeJPEG(data)
	}
	return false
}

func wholePNG(b []byte) bool {
	const signature = 8
	idat := false
	for i := signature; ; {
		if len(b)-i < 12 {
			return false
		}
		n := int64(binary.BigEndian.Uint32(b[i:]))
		if n > int64(len(b)-i-12) {
			return false
		}
		end := i + 8 + int(n)
		if crc32.ChecksumIEEE(b[i+4:end]) != binary.BigEndian.Uint32(b[end:]) {
			return false
		}
		switch string(b[i+4 : i+8]) {
		case "IDAT":
			idat = true
		case "IEND":
			return idat
		}
		i = end + 4
	}
}

func wholeJPEG(b []byte) bool {
	const (
		eoi = 0xd9
		sos = 0xda
	)
	// standalone markers carry no length: TEM, RST0–RST7 (and SOI).
	standalone := func(m byte) bool { return m == 0x01 || m >= 0xd0 && m <= 0xd8 }
	for i := 2; ; { // after SOI
		if i >= len(b) || b[i] != 0xff {
			return false
		}
		for i < len(b) && b[i] == 0xff { // fill bytes
			i++
		}
		if i >= len(b) {
			return false
		}
		m := b[i]
		i++
		switch {
		case m == eoi:
			return true
		case standalone(m):
			continue
		}
		if len(b)-i < 2 {
			return false
		}
		n := int(b[i])<<8 | int(b[i+1])
		if n < 2 || n > len(b)-i {
			return false
		}
		i += n
		if m != sos {
			continue
		}
		// Entropy-coded data: a 0xff in it is followed by a stuffed 0
		// or a restart marker; anything else is the next marker.
		for ; ; i++ {
			if len(b)-i < 2 {
				return false
			}
			if b[i] == 0xff && b[i+1] != 0 && b[i+1] != 0xff && !standalone(b[i+1]) {
				break
			}
		}
	}
}

func (s *Server) pushImage(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	var req pushImageRequest
	idem, body, replayed, err := s.commandBody(c, s.limits.imageBody(), false, &req)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	data, cfg, ctype, bad := s.checkImage(req.Image, req.ContentType)
	fields = append(fields, bad...)
	ttl, bad := s.ttl(req.TTL, body.members["ttl_seconds"])
	fields = append(fields, bad...)
	if err := validationError(fields); err != nil {
		return err
	}
	blob, err := s.store.PutBlob(c.Request.Context(), bytes.NewReader(data), int64(len(data)))
	if err != nil {
		return err
	}
	payload := topics.PushImage{ContentType: ctype, Width: cfg.Width, Height: cfg.Height, Blob: blobRef(blob.SHA256, blob.Size)}
	return s.submit(c, b.DeviceID, topics.OpPushImage, payload, ttl, idem)
}

// release finds an app release in the catalog: the version asked for, or
// the latest when version is "".
func (s *Server) release(ctx context.Context, appID, version string) (companion.AppRelease, error) {
	if version != "" {
		r, err := s.store.AppRelease(ctx, appID, version)
		if errors.Is(err, companion.ErrNotFound) {
			return companion.AppRelease{}, errAppNotFound
		}
		return r, err
	}
	rs, err := s.store.AppReleases(ctx, appID)
	if err != nil {
		if errors.Is(err, companion.ErrNotFound) {
			return companion.AppRelease{}, errAppNotFound
		}
		return companion.AppRelease{}, err
	}
	if len(rs) == 0 {
		return companion.AppRelease{}, errAppNotFound
	}
	// The catalog's latest (companion.CatalogApp): releases that differ
	// only in build metadata are equal semantic versions, and the first of
	// them, picked before, was another than GET /apps lists as the latest
	// (docs/reliability.md, bug 213).
	return slices.MaxFunc(rs, func(a, b companion.AppRelease) int { return companion.ByVersion(a.Version, b.Version) }), nil
}

func checkVersion(field string, v *string) []FieldError {
	if v != nil && !topics.ValidVersion(*v) {
		return []FieldError{{Field: field, Message: "must be a semantic version such as 1.2.3"}}
	}
	return nil
}

type installRequest struct {
	AppID   string  `json:"app_id"`
	Version *string `json:"version"`
}

func (s *Server) installApp(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	var req installRequest
	idem, body, replayed, err := s.commandBody(c, s.limits.MaxJSONBody, false, &req)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	switch {
	case req.AppID == "":
		fields = append(fields, FieldError{Field: "app_id", Message: "is required"})
	case !topics.ValidAppID(req.AppID):
		fields = append(fields, FieldError{Field: "app_id", Message: "must be 1 to 128 of a-z 0-9 . _ -"})
	}
	fields = append(fields, checkVersion("version", req.Version)...)
	if err := validationError(fields); err != nil {
		return err
	}
	rel, err := s.release(c.Request.Context(), req.AppID, deref(req.Version))
	if err != nil {
		return err
	}
	payload := topics.AppInstall{AppID: rel.AppID, Version: rel.Version, Blob: blobRef(rel.SHA256, rel.Size)}
	return s.submit(c, b.DeviceID, topics.OpAppInstall, payload, s.limits.DefaultTTL, idem)
}

func (s *Server) uninstallApp(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	appID := c.Param("app_id")
	if !topics.ValidAppID(appID) {
		return errNoAppID
	}
	idem, replayed, err := s.beginCommand(c, nil)
	if err != nil || replayed {
		return err
	}
	return s.submit(c, b.DeviceID, topics.OpAppUninstall, topics.AppUninstall{AppID: appID}, s.limits.DefaultTTL, idem)
}

type versionRequest struct {
	Version *string `json:"version"`
}

func (s *Server) updateApp(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	appID := c.Param("app_id")
	if !topics.ValidAppID(appID) {
		return errNoAppID
	}
	var req versionRequest
	idem, body, replayed, err := s.commandBody(c, s.limits.MaxJSONBody, true, &req)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	fields = append(fields, checkVersion("version", req.Version)...)
	if err := validationError(fields); err != nil {
		return err
	}
	ctx := c.Request.Context()
	rel, err := s.release(ctx, appID, deref(req.Version))
	if err != nil {
		return err
	}
	st, err := s.store.Status(ctx, b.DeviceID)
	if err != nil {
		return err
	}
	for _, a := range st.Apps {
		if a.AppID != appID || !topics.ValidVersion(a.Version) {
			continue
		}
		// With a version, only the very release the device runs is
		// refused, its build metadata too: semantic versions that differ
		// only there compare as equal, but 1.0.0+2 is another package
		// than the 1.0.0+1 the device has, published as such, and was
		// refused "the device already runs weather 1.0.0+1"
		// (docs/reliability.md, bug 502; bug 107 for an OTA).
		if req.Version != nil && rel.Version != a.Version {
			continue
		}
		if cmp := topics.CompareVersions(rel.Version, a.Version); cmp <= 0 {
			return &Error{Code: CodeNoUpdate, Detail: "the device already runs " + appID + " " + a.Version}
		}
	}
	payload := topics.AppInstall{AppID: rel.AppID, Version: rel.Version, Blob: blobRef(rel.SHA256, rel.Size)}
	return s.submit(c, b.DeviceID, topics.OpAppUpdate, payload, s.limits.DefaultTTL, idem)
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// Settings.

type settingsJSON struct {
	Reported  map[string]json.RawMessage `json:"reported"`
	Desired   map[string]json.RawMessage `json:"desired"`
	Pending   []string                   `json:"pending"`
	Schema    json.RawMessage            `json:"schema"`
	UpdatedAt apiTime                    `json:"updated_at"`
}

func (s *Server) getSettings(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	st, err := s.store.Settings(c.Request.Context(), b.DeviceID)
	if err != nil {
		return err
	}
	out := settingsJSON{
		Reported:  nonNil(st.Reported),
		Desired:   nonNil(st.Desired),
		Pending:   []string{},
		Schema:    json.RawMessage("{}"),
		UpdatedAt: timeOrNull(st.UpdatedAt),
	}
	switch {
	case schemaReported(st):
		out.Schema = st.Schema
	case b.Model == topics.SimModel:
		// Not reported yet: the model's, which a change is checked
		// against (putSettings), for a client to build its form from.
		if out.Schema, err = json.Marshal(topics.SimSchema()); err != nil {
			return err
		}
	}
	for _, k := range sortedKeys(out.Desired) {
		if !jsonEqual(out.Desired[k], out.Reported[k]) {
			out.Pending = append(out.Pending, k)
		}
	}
	return s.reply(c, http.StatusOK, out, "", nil, nil)
}

// schemaReported reports whether the device has reported its settings'
// schema, maybe an empty one: a device (or its bridge) that declares no
// setting it can read. Until it has, a sim-1's is its model's.
func schemaReported(st companion.Settings) bool {
	return len(st.Schema) > 0 && json.Valid(st.Schema) && string(st.Schema) != "null"
}

func nonNil(m map[string]json.RawMessage) map[string]json.RawMessage {
	if m == nil {
		return map[string]json.RawMessage{}
	}
	return m
}

// jsonEqual compares two JSON values by meaning, not spelling.
func jsonEqual(a, b json.RawMessage) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	va, erra := topics.DecodeValue(a)
	vb, errb := topics.DecodeValue(b)
	if erra != nil || errb != nil {
		return bytes.Equal(a, b)
	}
	return reflect.DeepEqual(va, vb)
}

func (s *Server) putSettings(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	var req map[string]any
	body, err := readJSON(c, s.limits.MaxJSONBody, false, &req)
	if err != nil {
		return err
	}
	idem, replayed, err := s.beginCommand(c, body.raw)
	if err != nil || replayed {
		return err
	}
	ctx := c.Request.Context()
	st, err := s.store.Settings(ctx, b.DeviceID)
	if err != nil {
		return err
	}
	// The schema GET …/settings shows: the one the device reported, even
	// empty (it declares nothing the bridge could read, and the bridge
	// would refuse every setting invalid_payload), or before it reported,
	// a sim-1's model's.
	var schema topics.Schema
	reported := schemaReported(st)
	if reported {
		if err := json.Unmarshal(st.Schema, &schema); err != nil {
			return fmt.Errorf("stored settings schema of %s: %w", b.DeviceID, err)
		}
	} else if b.Model == topics.SimModel {
		schema = topics.SimSchema()
	}
	if len(req) == 0 {
		return invalid("settings", "must name at least one setting")
	}
	for k, raw := range body.members {
		// An int past 2^53 as written, not the float64 nearest it
		// (docs/reliability.md, bug 151).
		if v, err := topics.DecodeValue(raw); err == nil {
			req[k] = v
		}
		// A number is what its digits say: 7.0 and 7e0 are the int 7
		// exactly (9007199254740993.0 too), and one with a fraction is
		// no int even where the float64 nearest it is one
		// (100.00000000000000000000001 read as 100, within a max of
		// 100; docs/reliability.md, bug 511). Such a number stays as
		// written: an int setting refuses it, and a device whose schema
		// is not known yet is sent its digits.
		if f, ok := req[k].(float64); ok {
			switch n, whole, fits := topics.ExactWhole(raw); {
			case whole && fits:
				req[k] = n
			case !whole && f == math.Trunc(f):
				req[k] = json.Number(raw)
			}
		}
	}
	fields := body.fieldErrors()
	bad := map[string]bool{}
	for _, f := range fields {
		bad[f.Field] = true
	}
	check := schema.Validate
	if len(schema) == 0 && !reported {
		// Not reported yet, and of a model the server does not know: the
		// command waits for the device as any does, and its bridge checks
		// the values against the device's schema before it writes one.
		check = settingValues
	}
	for _, f := range check(req) {
		if !bad[f.Field] {
			fields = append(fields, f)
		}
	}
	if err := validationError(fields); err != nil {
		return err
	}
	// The store records the values as desired in the write that stores
	// the command, and only if it stores one: desired settings follow the
	// order of the commands, and a repeat that the store answers with the
	// first request's command (the two overlapped, so beginCommand did not
	// see the first) records nothing over a change accepted since.
	// Desired holds each value as the device is sent it, req encoded
	// again, not as the body spells it: the store drops a desired value
	// once the device reports the same text, and 7.0 or 7e0 for 7 would
	// otherwise stay desired for good, and pending once the device
	// changes the setting itself.
	desired := make(map[string]json.RawMessage, len(req))
	for k, v := range req {
		if f, ok := v.(float64); ok && f == 0 {
			// -0 is 0, as the device is sent it and reports it: "-0"
			// would stay desired for good.
			v = float64(0)
			req[k] = v
		}
		if desired[k], err = fastjson.Marshal(v); err != nil {
			return err
		}
	}
	cmd, err := s.send(c, b.DeviceID, topics.OpSettingsUpdate, topics.SettingsUpdate{Settings: req}, desired, s.limits.DefaultTTL, idem)
	if err != nil {
		return err
	}
	return s.answerCommand(c, cmd, http.StatusAccepted, true)
}

// settingValues checks a change of settings whose schema is not known:
// each name must be one a setting can have, each value one a setting can
// hold. No device names a setting "" or with a control character: Zephyr's
// settings names are C strings, "y\x00" read as "y". Taken, such a name
// stood desired and pending until the bridge refused the command
// (docs/reliability.md, bug 503). A blank name is none either: the server
// leaves it out of a device's report (topics.ValidSettingName, bug 567).
func settingValues(req map[string]any) []FieldError {
	var errs []FieldError
	for _, k := range slices.Sorted(maps.Keys(req)) {
		if !topics.ValidSettingName(k) {
			errs = append(errs, FieldError{Field: k, Message: "is no setting's name: empty, blank, or with a control character"})
			continue
		}
		switch v := req[k].(type) {
		case string:
			if strings.IndexByte(v, 0) >= 0 { // no setting of any type holds one (bug 578)
				errs = append(errs, FieldError{Field: k, Message: topics.NoNUL})
			}
		case float64, int64, json.Number, bool:
		default:
			errs = append(errs, FieldError{Field: k, Message: "must be a number, true or false, or a string"})
		}
	}
	return errs
}

// OTA.

type otaCheckJSON struct {
	CurrentVersion  *string `json:"current_version"`
	LatestVersion   *string `json:"latest_version"`
	UpdateAvailable bool    `json:"update_available"`
	Size            *int64  `json:"size"`
	SHA256          *string `json:"sha256"`
}

func (s *Server) otaCheck(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	ctx := c.Request.Context()
	st, err := s.store.Status(ctx, b.DeviceID)
	if err != nil {
		return err
	}
	fws, err := s.store.Firmwares(ctx, b.Model)
	if err != nil && !errors.Is(err, companion.ErrNotFound) {
		return err
	}
	out := otaCheckJSON{CurrentVersion: stringOrNull(st.FirmwareVersion)}
	if len(fws) > 0 {
		latest := latestFirmware(fws)
		out.LatestVersion, out.Size, out.SHA256 = &latest.Version, &latest.Size, &latest.SHA256
		out.UpdateAvailable = newer(latest.Version, st.FirmwareVersion)
	}
	return s.reply(c, http.StatusOK, out, "", nil, nil)
}

// latestFirmware is the firmware of the highest version, its build number
// compared as the number an MCUboot header holds: of 1.1.0+1, +2 and +10,
// one semantic version, the +10 (docs/reliability.md, bug 214). A version
// no header holds (none is published so) orders as a semantic version.
func latestFirmware(fws []companion.Firmware) companion.Firmware {
	return slices.MaxFunc(fws, func(a, b companion.Firmware) int {
		va, erra := mcuboot.ParseVersion(a.Version)
		vb, errb := mcuboot.ParseVersion(b.Version)
		if erra == nil && errb == nil {
			return va.Compare(vb)
		}
		return companion.ByVersion(a.Version, b.Version)
	})
}

// newer reports whether version v is an update for a device running cur;
// any version is, for a device that never reported a valid one.
func newer(v, cur string) bool {
	return !topics.ValidVersion(cur) || topics.CompareVersions(v, cur) > 0
}

func (s *Server) otaUpdate(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	var req versionRequest
	idem, body, replayed, err := s.commandBody(c, s.limits.MaxJSONBody, true, &req)
	if err != nil || replayed {
		return err
	}
	fields := body.fieldErrors()
	fields = append(fields, checkVersion("version", req.Version)...)
	if err := validationError(fields); err != nil {
		return err
	}
	ctx := c.Request.Context()
	st, err := s.store.Status(ctx, b.DeviceID)
	if err != nil {
		return err
	}
	var fw companion.Firmware
	if req.Version != nil {
		fw, err = s.store.Firmware(ctx, b.Model, *req.Version)
		switch {
		case errors.Is(err, companion.ErrNotFound):
			return errFirmwareNotFnd
		case err != nil:
			return err
		}
		// The very version, build number too: semantic versions that
		// differ only there order as equal, but another build of the
		// version the device runs is an image to install all the same.
		if fw.Version == st.FirmwareVersion {
			return &Error{Code: CodeNoUpdate, Detail: "the device already runs " + fw.Version}
		}
	} else {
		fws, err := s.store.Firmwares(ctx, b.Model)
		if err != nil && !errors.Is(err, companion.ErrNotFound) {
			return err
		}
		if len(fws) == 0 {
			return errFirmwareNotFnd
		}
		fw = latestFirmware(fws)
		if !newer(fw.Version, st.FirmwareVersion) {
			detail := "the device already runs " + st.FirmwareVersion + ", the latest for its model"
			switch {
			case topics.CompareVersions(st.FirmwareVersion, fw.Version) > 0:
				// Not the latest published: a newer one than any
				// (docs/reliability.md, bug 211).
				detail = "the device runs " + st.FirmwareVersion + ", newer than " + fw.Version + ", the latest published for its model"
			case st.FirmwareVersion != fw.Version:
				detail = "the device runs " + st.FirmwareVersion + ", another build of " + fw.Version + ", the latest for its model: " +
					"an update without a version takes only a newer semantic version; ask for " + fw.Version + " to install it"
			}
			return &Error{Code: CodeNoUpdate, Detail: detail}
		}
	}
	payload := topics.OTAUpdate{Version: fw.Version, Blob: blobRef(fw.SHA256, fw.Size)}
	return s.submit(c, b.DeviceID, topics.OpOTAUpdate, payload, s.limits.DefaultTTL, idem)
}

// The command resource.

// deviceCommand is the command of the path when it belongs to the device
// of the path and to the caller.
func (s *Server) deviceCommand(c *gin.Context, b companion.Binding) (companion.Command, error) {
	id := c.Param("command_id")
	if !topics.ValidCommandID(id) {
		return companion.Command{}, errCommandNotFnd
	}
	// A UUID's hex digits are case-insensitive on input (RFC 9562 §4), and
	// clients write them in upper case (Swift's UUID.uuidString); the
	// stores know each id only as written, in lower case.
	id = strings.ToLower(id)
	cmd, err := s.store.Command(c.Request.Context(), id)
	switch {
	case errors.Is(err, companion.ErrNotFound):
		return companion.Command{}, errCommandNotFnd
	case errors.Is(err, companion.ErrUnreadable) && cmd.DeviceID != "" && cmd.DeviceID != b.DeviceID:
		return companion.Command{}, errCommandNotFnd
	case err != nil:
		return companion.Command{}, err
	case cmd.DeviceID != b.DeviceID || cmd.UserID != b.UserID:
		return companion.Command{}, errCommandNotFnd
	}
	return cmd, nil
}

func (s *Server) getCommand(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	cmd, err := s.deviceCommand(c, b)
	if err != nil {
		return err
	}
	return s.answerCommand(c, cmd, http.StatusOK, false)
}

func (s *Server) listCommands(c *gin.Context) error {
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	// A state given empty, or twice with different values, names no
	// state: it is refused, never read as no filter at all.
	var fields []FieldError
	state, given, twice := queryOnce(c, "state")
	switch {
	case twice:
		fields = append(fields, FieldError{Field: "state", Message: "must be given once"})
	case given && !companion.ValidState(state):
		fields = append(fields, FieldError{Field: "state", Message: fmt.Sprintf("must be one of %v", companion.States)})
	}
	limit, before, err := page(c, topics.ValidCommandID, fields, "state")
	if err != nil {
		return err
	}
	// A device keeps its history across owners; each sees their own.
	q := companion.CommandQuery{DeviceID: b.DeviceID, UserID: b.UserID, State: state, Before: before, Limit: limit}
	cmds, more, err := s.store.ListCommands(c.Request.Context(), q)
	if errors.Is(err, companion.ErrInvalidCursor) {
		return &Error{Code: CodeInvalidCursor, Fields: []FieldError{{Field: "cursor", Message: "is not a cursor this list returned"}}}
	}
	if err != nil {
		return err
	}
	var next *string
	if more && len(cmds) > 0 {
		next = cursorOf(cmds[len(cmds)-1].ID)
	}
	out := make([]commandJSON, 0, len(cmds))
	for _, cmd := range cmds {
		out = append(out, toCommand(cmd))
	}
	return s.reply(c, http.StatusOK, gin.H{"commands": out, "next_cursor": next}, "", nil, nil)
}

func (s *Server) cancelCommand(c *gin.Context) error {
	user := currentUser(c)
	if n, wants := s.preferWait(c.Request); wants {
		// A cancel answers with the command final (canceled), as any
		// command request with Prefer: wait does once its command is, and
		// says the preference was met (CONTRACT §2); it never waits. Set
		// first so that a repeat of an Idempotency-Key, answered from its
		// record, says it too; a problem drops it (writeProblem).
		c.Header("Preference-Applied", "wait="+strconv.Itoa(n))
	}
	rec, replayed, err := s.beginIdempotent(c, user.ID, nil)
	if err != nil || replayed {
		return err
	}
	b, err := s.boundDevice(c)
	if err != nil {
		return err
	}
	cmd, err := s.deviceCommand(c, b)
	if err != nil {
		return err
	}
	got, err := s.cmds.Cancel(c.Request.Context(), cmd.ID)
	switch {
	case errors.Is(err, broker.ErrNotCancelable), errors.Is(err, companion.ErrFinal):
		if got.State == "" {
			got.State = cmd.State
		}
		return &Error{Code: CodeNotCancelable, Detail: "the command is " + got.State + " and can no longer be canceled"}
	case errors.Is(err, companion.ErrNotFound):
		return errCommandNotFnd
	case err != nil:
		return err
	}
	return s.reply(c, http.StatusOK, toCommand(got), "", rec, nil)
}
