package api

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"runtime/debug"
	"strconv"

	"github.com/gin-gonic/gin"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/topics"
)

// FieldError names one bad field of a request and what is wrong with it.
type FieldError = topics.FieldError

// Error is the API's one application error. Its Code is a stable word
// clients test; the table codes maps it to an HTTP status and title. Any
// other error reaching a client is logged and answered as "internal error".
type Error struct {
	Code       string
	Detail     string       // for humans; the code's default when empty
	Fields     []FieldError // every bad field, for validation_failed
	RetryAfter int          // seconds, for 429 answers
}

func (e *Error) Error() string {
	if e.Detail != "" {
		return e.Code + ": " + e.Detail
	}
	return e.Code
}

// Problem codes (CONTRACT §2).
const (
	CodeBadRequest           = "bad_request"
	CodeMalformedJSON        = "malformed_json"
	CodeUnauthorized         = "unauthorized"
	CodeNotFound             = "not_found"
	CodeDeviceNotFound       = "device_not_found"
	CodeCommandNotFound      = "command_not_found"
	CodeAppNotFound          = "app_not_found"
	CodeFirmwareNotFound     = "firmware_not_found"
	CodeBlobNotFound         = "blob_not_found"
	CodeBridgeNotFound       = "bridge_not_found"
	CodeUserNotFound         = "user_not_found"
	CodeMethodNotAllowed     = "method_not_allowed"
	CodeDeviceAlreadyBound   = "device_already_bound"
	CodeNoUpdate             = "no_update"
	CodeNotCancelable        = "not_cancelable"
	CodeDeviceExists         = "device_exists"
	CodeBridgeExists         = "bridge_exists"
	CodeFirmwareExists       = "firmware_exists"
	CodeAppReleaseExists     = "app_release_exists"
	CodeBodyTooLarge         = "body_too_large"
	CodeBodyTimeout          = "body_timeout"
	CodeUnsupportedMedia     = "unsupported_media_type"
	CodeValidationFailed     = "validation_failed"
	CodeInvalidClaim         = "invalid_claim"
	CodeIdempotencyKeyReused = "idempotency_key_reused"
	CodeIdempotencyKeyInUse  = "idempotency_key_in_use"
	CodeInvalidCursor        = "invalid_cursor"
	CodeRangeNotSatisfiable  = "range_not_satisfiable"
	CodePreconditionFailed   = "precondition_failed"
	CodeQueueFull            = "queue_full"
	CodeRateLimited          = "rate_limited"
	CodeTooManyStreams       = "too_many_streams"
	CodeTooManyWaits         = "too_many_waits"
	CodeInternal             = "internal"
	CodeCommandUnreadable    = "command_unreadable"
	CodeNotReady             = "not_ready"
	CodeUnavailable          = "unavailable"
	CodeBackupUnsupported    = "backup_unsupported"
	CodeBackupNoRoom         = "backup_no_room"
)

type codeInfo struct {
	status int
	title  string
	detail string // the default detail
}

// codes is the one table from problem codes to HTTP statuses.
var codes = map[string]codeInfo{
	CodeBadRequest:           {http.StatusBadRequest, "Bad request", "the request could not be read"},
	CodeMalformedJSON:        {http.StatusBadRequest, "Malformed JSON", "the body is not the JSON this operation takes"},
	CodeUnauthorized:         {http.StatusUnauthorized, "Unauthorized", "a valid bearer token is required"},
	CodeNotFound:             {http.StatusNotFound, "Not found", "no such resource"},
	CodeDeviceNotFound:       {http.StatusNotFound, "Device not found", "no such device among yours"},
	CodeCommandNotFound:      {http.StatusNotFound, "Command not found", "no such command for this device"},
	CodeAppNotFound:          {http.StatusNotFound, "App not found", "no such app or version in the catalog"},
	CodeFirmwareNotFound:     {http.StatusNotFound, "Firmware not found", "no such firmware for this device's model"},
	CodeBlobNotFound:         {http.StatusNotFound, "Blob not found", "no such content"},
	CodeMethodNotAllowed:     {http.StatusMethodNotAllowed, "Method not allowed", "this resource does not take that method"},
	CodeDeviceAlreadyBound:   {http.StatusConflict, "Device already bound", "the device is bound to another account"},
	CodeNoUpdate:             {http.StatusConflict, "No update", "the device already runs that version"},
	CodeNotCancelable:        {http.StatusConflict, "Not cancelable", "the command was already delivered or is final"},
	CodeDeviceExists:         {http.StatusConflict, "Device exists", "a device with that id is already provisioned"},
	CodeBridgeNotFound:       {http.StatusNotFound, "Bridge not found", "no such bridge among yours"},
	CodeUserNotFound:         {http.StatusNotFound, "User not found", "no user with that id has an API token"},
	CodeBridgeExists:         {http.StatusConflict, "Bridge exists", "a bridge with that id already exists"},
	CodeFirmwareExists:       {http.StatusConflict, "Firmware exists", "that model and version is already published"},
	CodeAppReleaseExists:     {http.StatusConflict, "App release exists", "that app and version is already published"},
	CodeBodyTooLarge:         {http.StatusRequestEntityTooLarge, "Body too large", "the body is over its limit"},
	CodeBodyTimeout:          {http.StatusRequestTimeout, "Body timeout", "the body stopped coming"},
	CodeUnsupportedMedia:     {http.StatusUnsupportedMediaType, "Unsupported media type", "this operation takes application/json"},
	CodeValidationFailed:     {http.StatusUnprocessableEntity, "Validation failed", "some fields are invalid"},
	CodeInvalidClaim:         {http.StatusUnprocessableEntity, "Invalid claim", "unknown device or wrong claim code"},
	CodeIdempotencyKeyReused: {http.StatusUnprocessableEntity, "Idempotency key reused", "the Idempotency-Key was used with another request"},
	CodeIdempotencyKeyInUse:  {http.StatusConflict, "Idempotency key in use", "a request with this Idempotency-Key is still being answered; repeat it later for its answer"},
	CodeInvalidCursor:        {http.StatusUnprocessableEntity, "Invalid cursor", "the cursor is not one this list returned"},
	CodeRangeNotSatisfiable:  {http.StatusRequestedRangeNotSatisfiable, "Range not satisfiable", "the range lies outside the content"},
	CodePreconditionFailed:   {http.StatusPreconditionFailed, "Precondition failed", "the content does not meet the request's If-Match or If-Unmodified-Since"},
	CodeQueueFull:            {http.StatusTooManyRequests, "Queue full", "the device has too many unfinished commands"},
	CodeRateLimited:          {http.StatusTooManyRequests, "Rate limited", "too many requests"},
	CodeTooManyStreams:       {http.StatusTooManyRequests, "Too many streams", "this account has as many event streams open as it may"},
	CodeTooManyWaits:         {http.StatusTooManyRequests, "Too many waits", "this account has as many requests held by Prefer: wait as it may"},
	CodeInternal:             {http.StatusInternalServerError, "Internal error", "internal error"},
	CodeCommandUnreadable: {http.StatusInternalServerError, "Command unreadable", "the server's record of this command is damaged and cannot be read: " +
		"its state is not known, and it is no longer sent, expired or counted among the device's unfinished commands; " +
		"the server's operator can restore it from a backup"},
	CodeNotReady:    {http.StatusServiceUnavailable, "Not ready", "the service is not ready"},
	CodeUnavailable: {http.StatusServiceUnavailable, "Unavailable", "the store cannot be reached now; try again"},
	CodeBackupUnsupported: {http.StatusConflict, "Backup unsupported", "this server keeps its data in PostgreSQL, which it does not copy: " +
		"back the database up with pg_dump"},
	CodeBackupNoRoom: {http.StatusInsufficientStorage, "No room for the backup", "the server's data directory has no room for the copy a backup makes there while it is sent"},
}

// Errors used as they are.
var (
	errNotFound       = &Error{Code: CodeNotFound}
	errDeviceNotFound = &Error{Code: CodeDeviceNotFound}
	errCommandNotFnd  = &Error{Code: CodeCommandNotFound}
	errCmdUnreadable  = &Error{Code: CodeCommandUnreadable}
	errAppNotFound    = &Error{Code: CodeAppNotFound}
	errFirmwareNotFnd = &Error{Code: CodeFirmwareNotFound}
	errInvalidClaim   = &Error{Code: CodeInvalidClaim}
	errIdemReused     = &Error{Code: CodeIdempotencyKeyReused}
	// A path segment that is no id of its kind names nothing (CONTRACT
	// §2: a 404), and says why: to the one who named it, "no such
	// resource" read as a missing app or model, not a misspelt one.
	errNoAppID      = &Error{Code: CodeAppNotFound, Detail: noAppID}
	errNoReleaseApp = &Error{Code: CodeNotFound, Detail: noAppID}
	errNoModelID    = &Error{Code: CodeNotFound, Detail: "the path names no model: a model is 1 to 64 of A-Z a-z 0-9 . _ : -"}
	errNoBlobName   = &Error{Code: CodeBlobNotFound, Detail: "the path names no content: a blob is named by its SHA-256, 64 hex digits in lower case"}
	errIdemInUse    = &Error{Code: CodeIdempotencyKeyInUse}
	// The admin's 404s say what is missing from the service: the codes'
	// default details ("no such device among yours") are a user's, and
	// sent an operator looking among devices and bridges they do not have.
	errAdminDeviceNotFnd = &Error{Code: CodeDeviceNotFound, Detail: "no device with that id is provisioned"}
	errAdminBridgeNotFnd = &Error{Code: CodeBridgeNotFound, Detail: "no bridge with that id exists"}
	// A device is provisioned onto one of the operator's bridges: a user's
	// serves only devices bound to that user, and a new one is bound to
	// nobody. The store answers a user's bridge as it answers none.
	errAdminNoOperatorBridge = &Error{Code: CodeBridgeNotFound, Detail: "no bridge of the operator's has that id " +
		"(a user's bridge serves only the devices bound to that user: assign the device to it once it is bound)"}
	// The operator keeps a user's bridge to that user's devices.
	errAdminUsersBridge = &Error{Code: CodeBridgeNotFound, Detail: "that bridge is a user's, and serves only the devices " +
		"bound to that user: this device is not"}
	// errIdemGone answers a repeat whose Idempotency-Key record names a
	// command the retention pass has purged: a record answers for 24 h
	// and a final command is kept at least that long after it ended
	// (--retention), so the two part only at the end of the key's day,
	// by a clock a little ahead of the one that reads the record.
	errIdemGone = &Error{Code: CodeCommandNotFound, Detail: "the command this Idempotency-Key's first request created is no longer kept " +
		"(it ended more than a day ago): nothing was done; send the request with a new key to do it again"}
)

const noAppID = "the path names no app: an app id is 1 to 128 of a-z 0-9 . _ - (lower case)"

// problem is an RFC 9457 problem details object with our extensions.
type problem struct {
	Type   string       `json:"type"`
	Title  string       `json:"title"`
	Status int          `json:"status"`
	Detail string       `json:"detail"`
	Code   string       `json:"code"`
	Errors []FieldError `json:"errors"`
}

// fail answers err as a problem. Errors that are not *Error are logged
// and shown only as "internal error". A request that fails gives up the
// claim on its Idempotency-Key (see beginIdempotent), as it records no
// answer: a repeat does the work again.
func (s *Server) fail(c *gin.Context, err error) {
	var e *Error
	if errors.Is(err, companion.ErrIdemConflict) {
		// The write that was to store the request's answer with its work
		// found the key held by another request (withAnswer): this one's
		// claim ran out, and is not its to give up.
		heldClaim(c)
		e = errIdemInUse
	}
	s.releaseIdempotent(c)
	if errors.Is(err, companion.ErrUnreadable) {
		// Logged by the store, once.
		e = errCmdUnreadable
	}
	if e == nil && !errors.As(err, &e) {
		ctx := c.Request.Context()
		level := s.log.ErrorContext
		if errors.Is(err, context.Canceled) && ctx.Err() != nil {
			level = s.log.DebugContext // the client went away
			// Counted as such, not as the server's fault (observeRequest;
			// docs/reliability.md, bug 359).
			c.Set(ctxClientGone, true)
		}
		level(ctx, "request failed", requestIDAttr(c), "method", c.Request.Method, "path", c.Request.URL.Path, "err", err)
		e = &Error{Code: CodeInternal}
		if s.unavailable(err) {
			e = &Error{Code: CodeUnavailable}
		}
	}
	s.writeProblem(c, e)
}

func (s *Server) writeProblem(c *gin.Context, e *Error) {
	e = withBodyFields(c, e)
	info, ok := codes[e.Code]
	if !ok {
		s.log.Error("problem code missing from the table", "code", e.Code)
		e, info = &Error{Code: CodeInternal}, codes[CodeInternal]
	}
	p := problem{
		Type:   "urn:companion:problem:" + e.Code,
		Title:  info.title,
		Status: info.status,
		Detail: e.Detail,
		Code:   e.Code,
		Errors: e.Fields,
	}
	if p.Detail == "" || e.Code == CodeInternal {
		p.Detail = info.detail
	}
	if p.Errors == nil {
		p.Errors = []FieldError{}
	}
	// A problem is no command, final or not: no Prefer: wait was met.
	c.Writer.Header().Del("Preference-Applied")
	switch {
	case info.status == http.StatusUnauthorized:
		if c.GetHeader("Authorization") == "" {
			c.Header("WWW-Authenticate", `Bearer realm="companion"`)
		} else {
			c.Header("WWW-Authenticate", `Bearer realm="companion", error="invalid_token"`)
		}
	case info.status == http.StatusTooManyRequests, e.Code == CodeUnavailable:
		ra := max(e.RetryAfter, 1)
		c.Header("Retry-After", strconv.Itoa(ra))
	}
	if e.Code != CodeBodyTooLarge { // bodyTooLarge read what it could
		s.discardUnread(c)
	}
	b, err := json.Marshal(p)
	if err != nil { // cannot happen: every field is a plain value
		b = []byte(`{"type":"urn:companion:problem:internal","title":"Internal error","status":500,"detail":"internal error","code":"internal","errors":[]}`)
	}
	c.Abort()
	c.Data(info.status, "application/problem+json", b)
}

// validationError returns the validation_failed error of fields, or nil
// when there are none.
func validationError(fields []FieldError) error {
	if len(fields) == 0 {
		return nil
	}
	return &Error{Code: CodeValidationFailed, Fields: fields}
}

// invalid is a validation_failed error of one field.
func invalid(field, msg string) error {
	return &Error{Code: CodeValidationFailed, Fields: []FieldError{{Field: field, Message: msg}}}
}

func stack() []byte { return debug.Stack() }
