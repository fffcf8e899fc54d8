package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/topics"

	"github.com/gin-gonic/gin"
)

// checkJSONType refuses a request whose Content-Type is not JSON in UTF-8:
// each of its labels (contentTypes) must say so. A parameter other than
// charset says nothing of the bytes, and is let be: application/json
// defines none (RFC 8259 §11), and one of a client's own (an OData
// client's odata.metadata, a version) had a body that was JSON in UTF-8
// refused as not JSON in UTF-8 (docs/reliability.md, bug 557).
func checkJSONType(r *http.Request) error {
	labels, err := contentTypes(r)
	if err != nil {
		return err
	}
	if len(labels) == 0 {
		labels = []string{""}
	}
	for _, label := range labels {
		mt, params, err := mime.ParseMediaType(label)
		if err != nil || mt != "application/json" {
			return &Error{Code: CodeUnsupportedMedia}
		}
		if v, ok := params["charset"]; ok && !isUTF8Label(v) {
			return &Error{Code: CodeUnsupportedMedia, Detail: "this operation takes application/json in UTF-8"}
		}
	}
	return nil
}

// contentTypes returns the labels of a request's body: the values of its
// Content-Type headers, a value that lists several (as a proxy joins a
// header sent twice, "a, b") split. Labels of different media types are a
// 415: RFC 9110 §8.3 allows one, the server read the first, and a proxy,
// a WAF or a log may read another; a JSON body labelled text/plain too was
// taken, and an app package sent as a form (curl -F) behind an
// application/octet-stream label was published as the form's envelope
// (docs/reliability.md, bug 510). The same type twice is one type.
func contentTypes(r *http.Request) ([]string, error) {
	var labels []string
	for _, v := range r.Header.Values("Content-Type") {
		if !strings.Contains(v, ",") {
			labels = append(labels, v) // parsed once, by the caller
			continue
		}
		if _, _, err := mime.ParseMediaType(v); err != nil {
			labels = append(labels, strings.Split(v, ",")...)
		} else {
			labels = append(labels, v) // a comma in a quoted parameter
		}
	}
	for _, l := range labels[min(1, len(labels)):] {
		if a, b := mediaType(labels[0]), mediaType(l); a != b {
			return nil, &Error{Code: CodeUnsupportedMedia, Detail: fmt.Sprintf(
				"the request has two Content-Type labels of different types, %q and %q: send one", a, b)}
		}
	}
	return labels, nil
}

// mediaType is the media type of a Content-Type label ("type/subtype", in
// lower case), or the label itself, trimmed and in lower case, when it
// cannot be read.
func mediaType(label string) string {
	if mt, _, err := mime.ParseMediaType(label); err == nil {
		return mt
	}
	return strings.ToLower(strings.TrimSpace(label))
}

// checkCoding refuses (415, with Accept-Encoding: identity, RFC 9110
// §15.5.16) a request whose body has a content coding: the server decodes
// none, and ignored, a compressed JSON body was a 400 "not valid JSON", one
// labelled gzip but sent plain was taken, and an app package or firmware
// image uploaded compressed (HTTPie's --compress, an app's gzip
// interceptor) was published as the compressed bytes, for devices to
// install (docs/reliability.md, bug 371). "identity" is no coding.
func checkCoding(c *gin.Context) error {
	if c.Request.ContentLength == 0 {
		return nil // no body to decode, whatever its label
	}
	for _, v := range c.Request.Header.Values("Content-Encoding") {
		for _, coding := range strings.Split(v, ",") {
			coding = strings.TrimSpace(coding)
			if coding == "" || strings.EqualFold(coding, "identity") {
				continue
			}
			c.Header("Accept-Encoding", "identity")
			return &Error{Code: CodeUnsupportedMedia, Detail: fmt.Sprintf(
				"this server takes request bodies without a content coding (Content-Encoding: %s): send the body uncompressed", coding)}
		}
	}
	return nil
}

// isUTF8Label reports whether a charset names UTF-8: "utf-8" or one of
// the other labels the WHATWG Encoding Standard gives it (browsers and
// HTTP clients send "utf8"), in any case. JSON is UTF-8 (RFC 8259 §8.1)
// whatever the label; a charset that is not UTF-8 is refused. bug 322.
func isUTF8Label(v string) bool {
	switch strings.ToLower(v) {
	case "utf-8", "utf8", "unicode-1-1-utf-8", "unicode11utf8", "unicode20utf8", "x-unicode20utf8":
		return true
	}
	return false
}

// readBody reads the whole body, refusing one over limit bytes (see
// bodyTooLarge).
func readBody(c *gin.Context, limit int64) ([]byte, error) {
	r := c.Request
	if r.ContentLength > limit {
		return nil, bodyTooLarge(c, 0, limit)
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	n := limit + 1 // what may come of a body of unknown length
	if r.ContentLength >= 0 {
		n = r.ContentLength
	}
	budget, n, err := reserveBody(c, n)
	if err != nil {
		return nil, err
	}
	if budget != nil {
		defer budget.n.Add(-n)
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	switch {
	case err != nil:
		return nil, bodyReadError(err)
	case int64(len(b)) > limit:
		return nil, bodyTooLarge(c, int64(len(b)), limit)
	}
	return b, nil
}

// bodyReadError is the answer to a request whose body could not be read
// to its end: the body_timeout of one that stalled (bodyIdle), else a 400
// bad_request (the client cut it short, or its chunks are not chunked
// encoding). Either is the client's failure, never an internal error.
func bodyReadError(err error) error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Code: CodeBadRequest, Detail: "the body could not be read"}
}

// drainFactor bounds how much of a body over its limit the server reads:
// up to drainFactor times the limit in all (CONTRACT §8).
const drainFactor = 4

// bodyTooLarge is the answer to a body over limit, of which the handler
// has read the first `read` bytes. Over HTTP/1 many clients (Python's
// urllib, mobile HTTP stacks) send the whole body before they read the
// answer; if the server answered and closed with the body still coming,
// the client would see a reset instead of the 413. So it reads and
// discards what follows (discardBody) and answers with Connection: close.
//
// Over HTTP/2 it answers at once: the answer ends the stream, not the
// connection, and net/http then resets the stream with NO_ERROR, which
// tells the client to stop sending the body and read the answer (RFC 9113
// §8.1). Read first, the rest of the body (up to 4× the limit) came over
// the phone's link for nothing before the 413, or the 413 waited
// BodyIdle for a body that paused (docs/reliability.md, bug 320).
func bodyTooLarge(c *gin.Context, read, limit int64) error {
	// The limit is the operation's as this server is configured (api.Limits,
	// the --max-* flags): the answer says it, so that the client knows what
	// would pass rather than guess from the documented defaults.
	tooLarge := &Error{Code: CodeBodyTooLarge, Detail: fmt.Sprintf("the body is over this operation's limit of %d bytes", limit)}
	if c.Request.ProtoMajor >= 2 {
		return tooLarge
	}
	c.Header("Connection", "close")
	// Whatever happens here, the answer is the same 413: a failed read
	// only means the connection is closed sooner.
	discardBody(c.Request, read, limit)
	return tooLarge
}

// discardBody reads and discards the rest of r's body, of which `read`
// bytes have been read, up to drainFactor×limit bytes in all, so that a
// client that sends its whole body before it reads the answer can read
// it; and reports whether it read the body to its end. Beyond that bound
// it stops: the server then closes the connection with the body unread,
// and such a client may see a reset. It reads nothing, and reports false,
// when the declared length is beyond the bound already, or when the client
// waits for 100 Continue before it sends the body (and none of it has been
// read): net/http then closes the connection after the answer, and the
// client never sends the body.
func discardBody(r *http.Request, read, limit int64) bool {
	if r.Body == nil || r.Body == http.NoBody {
		return true
	}
	most := limit
	if limit < math.MaxInt64/drainFactor {
		most = drainFactor * limit
	}
	waits := read == 0 && strings.EqualFold(r.Header.Get("Expect"), "100-continue")
	if waits || r.ContentLength > most || read >= most {
		return false
	}
	_, err := io.CopyN(io.Discard, r.Body, most-read)
	return err == io.EOF
}

// discardUnread reads and discards, before a problem answers an HTTP/1
// request, what the handler left unread of its body: all of it when the
// answer comes before the body is read (a 401, a 429 of the rate limit, a
// 404 of a device not the caller's, a 415, a 503 of the store away), up to
// drainFactor times the operation's body limit (bodyLimit) in all, as for
// a 413 (discardBody). net/http reads 256 KiB of such a body at most, then
// closes the connection with the rest unread: a client that sends its
// whole body before it reads (a phone pushing an image while rate limited)
// saw a reset instead of the answer (docs/reliability.md, bug 263). A body
// read to its end keeps the connection; one the bound stops short of is
// answered with Connection: close. A body that failed (408, 400) is left
// alone: net/http closes the connection after the answer.
//
// A request nobody is known to have sent (no valid token: a 401, or a 429
// of an address's allowance for bad tokens) is read at most as far as the
// largest body of a user's operation allows (an image push's), not the
// admin uploads': else anyone could have the server read 256 MiB (four
// firmware images) per request for nothing. An admin's tool that sends a
// firmware image with a wrong token and reads only then may see a reset;
// curl, which asks for 100 Continue before a large body, sees the 401.
func (s *Server) discardUnread(c *gin.Context) {
	b, ok := c.Request.Body.(*idleBody)
	if !ok || !b.http1 || b.err != nil {
		return // no body, HTTP/2, or a body read to its end or failed
	}
	limit := s.bodyLimit(c.FullPath())
	if c.GetString(ctxPrincipal) == "" {
		limit = min(limit, s.limits.imageBody())
	}
	if !discardBody(c.Request, b.got, limit) {
		c.Header("Connection", "close")
	}
}

// largeBodies are the routes whose body limit is not Limits.MaxJSONBody,
// by their full paths as gin names them (c.FullPath).
var largeBodies = map[string]func(Limits) int64{
	"/api/v1/devices/:id/push/text":          Limits.textBody,
	"/api/v1/devices/:id/push/image":         Limits.imageBody,
	"/api/v1/admin/firmware/:model/:version": func(l Limits) int64 { return l.MaxFirmwareBytes },
	"/api/v1/admin/apps/:app_id/:version":    func(l Limits) int64 { return l.MaxAppBytes },
}

// bodyLimit is the body limit of the operation at route (a full path as
// gin names it; "" for none).
func (s *Server) bodyLimit(route string) int64 {
	if f, ok := largeBodies[route]; ok {
		return f(s.limits)
	}
	return s.limits.MaxJSONBody
}

// utf8BOM is the byte order mark in UTF-8, U+FEFF.
var utf8BOM = []byte("\uFEFF")

// jsonBody is a request's JSON object: its bytes, the raw value of each
// top-level member, and what is wrong with its members as the body itself
// shows it (see bodyFields).
type jsonBody struct {
	raw     []byte
	members map[string]json.RawMessage
	named   *bodyFields
}

// bodyFields are the 422s of a body that readJSON finds as it decodes it
// (a member named twice, one named in another case, a number out of
// range), and the members they cover: those, and the field a misnamed
// member resembles. The operation's own checks run on after them, so that
// the answer names every bad field (CONTRACT §2); one of them on a
// member already named is left out of the answer (a misnamed "TEXT" is
// not also "text is required"). Before, readJSON answered with those
// alone, and a client fixed them to be told of its next bad field
// (docs/reliability.md, bug 374).
type bodyFields struct {
	errs    []FieldError
	covered map[string]bool
}

// ctxBodyFields is the gin context key of the request's *bodyFields.
const ctxBodyFields = "companion.body.fields"

// fieldErrors names what is wrong with the body's members as the body
// shows it: the errors readJSON found (bodyFields), and each top-level
// string member whose text is not valid UTF-8. encoding/json replaces
// such bytes (and lone surrogate escapes) with U+FFFD silently, so this
// looks at the raw text. Every operation with a JSON body starts its
// fields from it.
func (b *jsonBody) fieldErrors() []FieldError {
	var errs []FieldError
	if b.named != nil {
		errs = append(errs, b.named.errs...)
	}
	for _, name := range sortedKeys(b.members) {
		if b.named != nil && b.named.covered[name] {
			continue
		}
		if !validJSONString(b.members[name]) {
			errs = append(errs, FieldError{Field: name, Message: "must be valid UTF-8"})
		}
	}
	return errs
}

// withBodyFields is e, a validation_failed answer of a request whose body
// readJSON found errors in, with those errors first and the operation's
// errors on the members they cover left out; any other e is as it is.
func withBodyFields(c *gin.Context, e *Error) *Error {
	v, ok := c.Get(ctxBodyFields)
	if !ok || e.Code != CodeValidationFailed {
		return e
	}
	named := v.(*bodyFields)
	fields := slices.Clone(named.errs)
	for _, f := range e.Fields {
		if !named.covered[f.Field] && !slices.Contains(fields, f) {
			fields = append(fields, f)
		}
	}
	out := *e
	out.Fields = fields
	return &out
}

// topMember is the top-level member a field path names ("a" of "a.b[1]").
func topMember(path string) string {
	if i := strings.IndexAny(path, ".["); i > 0 {
		return path[:i]
	}
	return path
}

// readJSON reads a JSON object body into dst. When optional, an empty
// body is fine and leaves dst as it is; a body that is there must still be
// application/json.
func readJSON(c *gin.Context, limit int64, optional bool, dst any) (*jsonBody, error) {
	if err := checkCoding(c); err != nil {
		return nil, err
	}
	if !optional {
		if err := checkJSONType(c.Request); err != nil {
			return nil, err
		}
	}
	raw, err := readBody(c, limit)
	if err != nil {
		return nil, err
	}
	trimmed := bytes.TrimSpace(raw)
	if len(trimmed) == 0 {
		if optional {
			return &jsonBody{raw: raw, members: map[string]json.RawMessage{}}, nil
		}
		return nil, &Error{Code: CodeMalformedJSON, Detail: "the body is empty; this operation takes a JSON object"}
	}
	if optional {
		if err := checkJSONType(c.Request); err != nil {
			return nil, err
		}
	}
	if trimmed[0] != '{' {
		if bytes.HasPrefix(trimmed, utf8BOM) {
			// Windows tools write one at the start of a file "in UTF-8"
			// (PowerShell 5's Out-File and Set-Content, older Notepad),
			// and curl -d @FILE sends it: the file is valid JSON in every
			// editor, and "not valid JSON" alone sent its user looking at
			// the JSON (docs/reliability.md, bug 372).
			return nil, &Error{Code: CodeMalformedJSON, Detail: "the body starts with a UTF-8 byte order mark (EF BB BF), which a JSON text has not: send the file without it"}
		}
		if !json.Valid(trimmed) {
			return nil, &Error{Code: CodeMalformedJSON, Detail: "the body is not valid JSON"}
		}
		return nil, &Error{Code: CodeMalformedJSON, Detail: "the body must be a JSON object"}
	}
	// One pass splits raw into its members, read as a valid JSON object:
	// decodeStrict below says when it is not, and it is then refused
	// whatever they read as (a second encoding/json decode cost a fifth of
	// readJSON).
	members, count := objectMembers(raw)
	body := &jsonBody{raw: raw, members: members}
	cased, meant := caseErrors(members, reflect.TypeOf(dst))
	decoded := raw
	if len(cased) > 0 && json.Valid(raw) {
		decoded = withoutMembers(raw, members, cased)
	}
	var outOfRange []FieldError
	if err := decodeStrict(decoded, dst); err != nil {
		var e *Error
		if !errors.As(err, &e) || e.Code != CodeValidationFailed {
			return nil, err
		}
		// Numbers out of range, decoded as 0: the body's own 422s, with
		// the others.
		outOfRange = e.Fields
	}
	fields := repeatedNames(raw, count, len(members))
	fields = append(fields, cased...)
	fields = append(fields, outOfRange...)
	if len(fields) > 0 {
		body.named = &bodyFields{errs: fields, covered: map[string]bool{}}
		for _, f := range fields {
			body.named.covered[f.Field] = true
			body.named.covered[topMember(f.Field)] = true
		}
		for _, name := range meant {
			body.named.covered[name] = true
		}
		c.Set(ctxBodyFields, body.named)
	}
	return body, nil
}

// withoutMembers is raw, a JSON object whose members are members, for
// decoding: without the members caseErrors named (cased), when there are
// any. encoding/json matches member names ignoring case, and read
// {"text":"a","Title":1} as a title of the wrong type: a 400 naming
// "title", a member the body has not, and of {"title":"t","TITLE":2} a
// title that is a string, where such a member is a 422 naming it and is
// never read as the member it resembles (docs/reliability.md, bug 562).
// A body without one, every body a client means, is raw itself.
func withoutMembers(raw []byte, members map[string]json.RawMessage, cased []FieldError) []byte {
	if len(cased) == 0 {
		return raw
	}
	kept := make(map[string]json.RawMessage, len(members))
	for name, v := range members {
		if !slices.ContainsFunc(cased, func(f FieldError) bool { return f.Field == name }) {
			kept[name] = v
		}
	}
	b, err := json.Marshal(kept)
	if err != nil {
		return raw
	}
	return b
}

// repeatedNames names each member that raw, a valid JSON object with
// count member names (objectMembers), `distinct` of them distinct, names
// more than once, in the order of their names. encoding/json takes the
// last of them silently, so {"text":"a","text":"b"} pushed "b" where a
// proxy, a log or a reviewer reading the first saw "a" (RFC 8259 §4: the
// names SHOULD be unique; I-JSON, RFC 7493 §2.3, MUST). Only the top level
// is looked at: the handlers read nothing deeper as a member of its own
// (docs/reliability.md, bug 369). A body without a repeat, every body a
// client means, costs nothing here.
func repeatedNames(raw []byte, count, distinct int) []FieldError {
	if count <= distinct {
		return nil
	}
	var names []string
	depth, key := 0, false
	for i := 0; i < len(raw); i++ {
		switch raw[i] {
		case '"':
			start := i
			i = stringEnd(raw, i)
			if depth != 1 || !key {
				continue
			}
			key = false
			var name string
			if json.Unmarshal(raw[start:i+1], &name) == nil {
				names = append(names, name)
			}
		case '{', '[':
			depth++
			key = depth == 1
		case '}', ']':
			depth--
		case ',':
			key = depth == 1
		}
	}
	slices.Sort(names)
	var errs []FieldError
	for i := 1; i < len(names); i++ {
		if names[i] == names[i-1] && (len(errs) == 0 || errs[len(errs)-1].Field != names[i]) {
			errs = append(errs, FieldError{Field: names[i], Message: "must be given once"})
		}
	}
	return errs
}

// objectMembers splits raw, a valid JSON object, into its members, each
// value its bytes as raw has them (as a json.RawMessage takes them), the
// last of a repeated name winning as with encoding/json, and counts the
// names raw gives, repeats included. A name is decoded as encoding/json
// decodes it (escapes, and invalid UTF-8 read as U+FFFD) unless it is
// plain ASCII.
func objectMembers(raw []byte) (members map[string]json.RawMessage, count int) {
	members = make(map[string]json.RawMessage)
	depth, value := 0, -1 // value: where the current member's value starts
	var name string
	end := func(i int) {
		members[name] = bytes.TrimRight(raw[value:i], " \t\r\n")
		value = -1
	}
	for i := 0; i < len(raw); i++ {
		switch raw[i] {
		case '"':
			start := i
			i = stringEnd(raw, i)
			if depth != 1 || value >= 0 {
				continue
			}
			count++
			if lit := raw[start+1 : i]; plainASCII(lit) {
				name = string(lit)
			} else if json.Unmarshal(raw[start:i+1], &name) != nil {
				name = string(lit) // not reached: raw is valid
			}
		case ':':
			if depth == 1 {
				value = i + 1
				for value < len(raw) && isJSONSpace(raw[value]) {
					value++
				}
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 1 && value >= 0 {
				end(i)
			}
			depth--
		case ',':
			if depth == 1 {
				end(i)
			}
		}
	}
	return members, count
}

// stringEnd returns the index of the quote that ends the JSON string whose
// opening quote is at raw[i].
func stringEnd(raw []byte, i int) int {
	for i++; i < len(raw) && raw[i] != '"'; i++ {
		if raw[i] == '\\' {
			i++
		}
	}
	return i
}

// plainASCII reports whether lit, a JSON string's contents, reads as its
// bytes: no escape, and no byte encoding/json would check as UTF-8.
func plainASCII(lit []byte) bool {
	for _, c := range lit {
		if c == '\\' || c >= utf8.RuneSelf || c < ' ' {
			return false
		}
	}
	return true
}

// isJSONSpace reports whether c is white space between JSON tokens.
func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

// caseErrors names each member whose name is the JSON name of one of t's
// fields only when case is ignored (t a struct, or a pointer to one).
// encoding/json matches names that way, so {"TEXT": "hi"} would fill the
// required text without naming it, and {"bridge_id": null, "BRIDGE_ID":
// "b"} would assign b after a check of bridge_id had seen null. Members
// that match no field at all are ignored, as encoding/json ignores them.
// It also returns the names of the fields those members resemble.
func caseErrors(members map[string]json.RawMessage, t reflect.Type) (errs []FieldError, meant []string) {
	names := fieldNames(t)
	for _, m := range sortedKeys(members) {
		if slices.Contains(names, m) {
			continue
		}
		for _, name := range names {
			if strings.EqualFold(m, name) {
				errs = append(errs, FieldError{Field: m, Message: fmt.Sprintf("must be written %q: member names are case-sensitive", name)})
				meant = append(meant, name)
				break
			}
		}
	}
	return errs, meant
}

// fieldNamesOf caches jsonNames by type: the types are the handlers' few
// request structs, and a request would otherwise walk its type's fields.
var fieldNamesOf sync.Map // reflect.Type → []string

// fieldNames is jsonNames(t, nil), computed once per type.
func fieldNames(t reflect.Type) []string {
	if t == nil {
		return nil
	}
	if names, ok := fieldNamesOf.Load(t); ok {
		return names.([]string)
	}
	names, _ := fieldNamesOf.LoadOrStore(t, jsonNames(t, nil))
	return names.([]string)
}

// jsonNames appends to names the JSON names encoding/json decodes into
// t's fields (those of embedded structs included).
func jsonNames(t reflect.Type, names []string) []string {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Kind() != reflect.Struct {
		return names
	}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		switch {
		case f.Anonymous && name == "":
			names = jsonNames(f.Type, names)
		case !f.IsExported():
		case name == "":
			names = append(names, f.Name)
		default:
			names = append(names, name)
		}
	}
	return names
}

// decodeStrict decodes exactly one JSON value into dst and refuses
// anything after it. A number too large for a float64 (1e400) is
// well-formed JSON, which has no range limit, that encoding/json cannot
// hold: each such number is a 422 naming its path, unless the body has a
// fault of another kind, a 400, which comes first.
func decodeStrict(raw []byte, dst any) error {
	err := decodeOne(raw, dst)
	if err == nil {
		return nil
	}
	if rangeError(err) {
		// encoding/json reports only its first error: decode again with
		// the numbers out of range cleared, to find any other.
		if fields, cleared := outOfRange(raw); len(fields) > 0 {
			if err := decodeOne(cleared, dst); err != nil {
				return wrongTypes(cleared, dst, err)
			}
			return validationError(fields)
		}
	}
	return wrongTypes(raw, dst, err)
}

// wrongTypes is jsonError for err, the error of decoding raw into dst,
// but a wrong JSON type names every member of dst's that has one:
// encoding/json reports only the first it meets.
func wrongTypes(raw []byte, dst any, err error) error {
	var typ *json.UnmarshalTypeError
	if !errors.As(err, &typ) || typ.Field == "" {
		return jsonError(err)
	}
	if fields := typeErrors(raw, dst); len(fields) > 1 {
		return &Error{Code: CodeMalformedJSON, Detail: fmt.Sprintf("%d fields have the wrong JSON type", len(fields)), Fields: fields}
	}
	return jsonError(err)
}

// typeErrors names each member of raw, a JSON object, whose value has the
// wrong JSON type for its field of dst (a pointer to a struct), in the
// order of their names: each member named as a field is decoded alone,
// into a new value of dst's type. A number out of range is not named
// here (it is a 422 of its own).
func typeErrors(raw []byte, dst any) []FieldError {
	t := reflect.TypeOf(dst)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var members map[string]json.RawMessage
	if t == nil || t.Kind() != reflect.Struct || json.Unmarshal(raw, &members) != nil {
		return nil
	}
	names := fieldNames(reflect.TypeOf(dst))
	var fields []FieldError
	for _, name := range sortedKeys(members) {
		if !slices.Contains(names, name) {
			continue
		}
		one, err := json.Marshal(map[string]json.RawMessage{name: members[name]})
		if err != nil {
			continue
		}
		var typ *json.UnmarshalTypeError
		if err := json.Unmarshal(one, reflect.New(t).Interface()); errors.As(err, &typ) && typ.Field != "" && !rangeError(err) {
			fields = append(fields, FieldError{Field: typ.Field, Message: typeMessage(typ)})
		}
	}
	return fields
}

// decodeOne decodes exactly one JSON value into dst, with encoding/json's
// error, and refuses anything after it.
func decodeOne(raw []byte, dst any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(dst); err != nil {
		return err
	}
	var extra json.RawMessage
	if err := dec.Decode(&extra); err != io.EOF {
		return &Error{Code: CodeMalformedJSON, Detail: "the body has data after its JSON value"}
	}
	return nil
}

// rangeError reports whether err is encoding/json's account of a number
// too large for the Go value it goes into.
func rangeError(err error) bool {
	var typ *json.UnmarshalTypeError
	if errors.As(err, &typ) {
		if lit, ok := strings.CutPrefix(typ.Value, "number "); ok && numberOutOfRange(lit) {
			return true
		}
	}
	return errors.Is(err, strconv.ErrRange)
}

// numberOutOfRange reports whether the JSON number lit is beyond what a
// float64 holds. (One too small for it reads as 0, as JSON allows.)
func numberOutOfRange(lit string) bool {
	_, err := strconv.ParseFloat(lit, 64)
	return errors.Is(err, strconv.ErrRange)
}

// outOfRange names the path of each number in raw, a valid JSON text,
// that is beyond what a float64 holds ("ttl_seconds", "a.b[2]"), once
// however many such numbers it holds, and returns raw with each of them
// replaced by 0. A member named twice (a 422 of its own, repeatedNames)
// has one path for both: named for each, the same error was in the
// answer twice (docs/reliability.md, bug 556).
func outOfRange(raw []byte) (fields []FieldError, cleared []byte) {
	type level struct {
		array bool
		key   string // of an object: the member being read
		atKey bool   // of an object: a member name comes next
		index int    // of an array: the element being read
	}
	var (
		stack []level
		out   bytes.Buffer
		from  int // raw[from:] is not yet in out
	)
	path := func() string {
		var b strings.Builder
		for _, l := range stack {
			switch {
			case l.array:
				fmt.Fprintf(&b, "[%d]", l.index)
			case b.Len() > 0:
				b.WriteString("." + l.key)
			default:
				b.WriteString(l.key)
			}
		}
		return b.String()
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	for {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		if n := len(stack); n > 0 && stack[n-1].atKey {
			if key, ok := tok.(string); ok {
				stack[n-1].key, stack[n-1].atKey = key, false
				continue
			}
		}
		switch t := tok.(type) {
		case json.Delim:
			switch t {
			case '{':
				stack = append(stack, level{atKey: true})
				continue
			case '[':
				stack = append(stack, level{array: true})
				continue
			}
			stack = stack[:len(stack)-1]
		case json.Number:
			end := int(dec.InputOffset())
			start := end - len(t)
			if numberOutOfRange(string(t)) && start >= from && string(raw[start:end]) == string(t) {
				if f := (FieldError{Field: path(), Message: "is a number out of range"}); !slices.Contains(fields, f) {
					fields = append(fields, f)
				}
				out.Write(raw[from:start])
				out.WriteString("0")
				from = end
			}
		}
		// A value ended: the enclosing one moves on to its next.
		if len(stack) == 0 {
			break
		}
		if top := &stack[len(stack)-1]; top.array {
			top.index++
		} else {
			top.atKey = true
		}
	}
	out.Write(raw[from:])
	return fields, out.Bytes()
}

func jsonError(err error) error {
	var (
		e   *Error
		syn *json.SyntaxError
		typ *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &e):
		return e
	case errors.As(err, &typ):
		field := typ.Field
		if field == "" {
			return &Error{Code: CodeMalformedJSON, Detail: "the body must be a JSON object"}
		}
		return &Error{Code: CodeMalformedJSON, Detail: fmt.Sprintf("field %q has the wrong JSON type", field),
			Fields: []FieldError{{Field: field, Message: typeMessage(typ)}}}
	case errors.As(err, &syn):
		return &Error{Code: CodeMalformedJSON, Detail: fmt.Sprintf("the body is not valid JSON (at byte %d)", syn.Offset)}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return &Error{Code: CodeMalformedJSON, Detail: "the body ends in the middle of its JSON value"}
	}
	return &Error{Code: CodeMalformedJSON}
}

// typeMessage says what the field of a wrong JSON type takes.
func typeMessage(typ *json.UnmarshalTypeError) string {
	if typ.Value == "number" || strings.HasPrefix(typ.Value, "number ") {
		if k := typ.Type.Kind(); k != reflect.String && k != reflect.Bool && k != reflect.Slice && k != reflect.Map && k != reflect.Struct {
			return "is not a number this field can hold"
		}
	}
	return "must be " + jsonTypeName(typ.Type)
}

func jsonTypeName(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	}
	return "another JSON type"
}

// validJSONString reports whether raw, when it is a JSON string literal,
// holds valid UTF-8 with no unpaired surrogate escapes. Other values are
// fine.
func validJSONString(raw json.RawMessage) bool {
	if len(raw) == 0 || raw[0] != '"' {
		return true
	}
	if !utf8.Valid(raw) {
		return false
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		i++
		if i >= len(raw) || raw[i] != 'u' {
			continue
		}
		r, ok := hex4(raw[i+1:])
		if !ok {
			return false
		}
		i += 4
		switch {
		case r >= 0xDC00 && r < 0xE000:
			return false // a low surrogate on its own
		case r >= 0xD800 && r < 0xDC00:
			if i+2 >= len(raw) || raw[i+1] != '\\' || raw[i+2] != 'u' {
				return false
			}
			lo, ok := hex4(raw[i+3:])
			if !ok || lo < 0xDC00 || lo >= 0xE000 {
				return false
			}
			i += 6
		}
	}
	return true
}

func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[:4]), 16, 32)
	return rune(v), err == nil
}

// preferWait reads RFC 7240 "Prefer: wait=N": the seconds to wait, capped
// at MaxWait, and whether the preference was there at all. Malformed
// preferences are ignored, as RFC 7240 asks.
func (s *Server) preferWait(r *http.Request) (int, bool) {
	maxWait := int(s.limits.MaxWait.Seconds())
	for _, h := range r.Header.Values("Prefer") {
		for _, pref := range strings.Split(h, ",") {
			pref, _, _ = strings.Cut(pref, ";")
			name, val, ok := strings.Cut(strings.TrimSpace(pref), "=")
			if !ok || !strings.EqualFold(strings.TrimSpace(name), "wait") {
				continue
			}
			val = strings.Trim(strings.TrimSpace(val), `"`)
			if val == "" || strings.Trim(val, "0123456789") != "" {
				continue
			}
			n, err := strconv.Atoi(val)
			if err != nil || n > maxWait { // err: all digits, so out of range
				n = maxWait
			}
			return n, true
		}
	}
	return 0, false
}

// idempotencyKey returns the request's Idempotency-Key ("" when there is
// none, and always on methods it does not apply to).
func idempotencyKey(c *gin.Context) (string, error) {
	switch c.Request.Method {
	case http.MethodPost, http.MethodPut, http.MethodDelete:
	default:
		return "", nil
	}
	vals := c.Request.Header.Values("Idempotency-Key")
	if len(vals) == 0 {
		return "", nil
	}
	k := vals[0]
	if len(vals) > 1 || k == "" || len(k) > 255 {
		return "", invalid("Idempotency-Key", "must be one key of 1 to 255 printable ASCII characters")
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x20 || k[i] > 0x7e {
			return "", invalid("Idempotency-Key", "must be one key of 1 to 255 printable ASCII characters")
		}
	}
	return k, nil
}

// requestHash identifies a request for its Idempotency-Key: method,
// path (see canonicalPath) and body (see canonicalBody).
func requestHash(c *gin.Context, body []byte) []byte {
	return hashRequest(c, canonicalBody(body))
}

func hashRequest(c *gin.Context, body []byte) []byte {
	h := sha256.New()
	io.WriteString(h, c.Request.Method)
	h.Write([]byte{0})
	io.WriteString(h, canonicalPath(c))
	h.Write([]byte{0})
	h.Write(body)
	return h.Sum(nil)
}

// sameRequest reports whether stored, the RequestHash of a key's record,
// is this request's: hash (its requestHash), or the hash of its body's
// bytes as it was made before bodies were made canonical, so that a repeat
// of a request accepted by the last version is still one. (Records live
// IdempotencyTTL: the second comparison can go a day after every replica
// runs this version.)
func sameRequest(stored, hash []byte, c *gin.Context, body []byte) bool {
	return bytes.Equal(stored, hash) || bytes.Equal(stored, hashRequest(c, body))
}

// canonicalBody is a JSON body written one way: without the whitespace
// between its tokens, its objects' members in the order of their names (the
// last of a repeated name, as the handlers read it), numbers as they were
// written. Two bodies that differ only in those ways ask the same, and a
// client that retries with its JSON serialized anew (a library's key
// order, a pretty-printer) repeats its request rather than reusing its key
// for another (CONTRACT §2). A body that is not JSON stays as it is.
func canonicalBody(body []byte) []byte {
	d := json.NewDecoder(bytes.NewReader(body))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || d.More() {
		return body
	}
	out, err := json.Marshal(v) // sorts the members of objects by name
	if err != nil {
		return body
	}
	return out
}

// canonicalPath is the request's path with the parts that name the same
// thing in several spellings written one way: a command id, whose hex
// digits are case-insensitive (deviceCommand), in lower case. Two requests
// that differ only there are the same request for their Idempotency-Key.
func canonicalPath(c *gin.Context) string {
	path := c.Request.URL.Path
	id := c.Param("command_id")
	if id == "" || !topics.ValidCommandID(id) || !strings.HasSuffix(path, "/"+id) {
		return path
	}
	return strings.TrimSuffix(path, id) + strings.ToLower(id)
}

// idempotencyWait bounds how long a request waits for the answer of an
// earlier request with its Idempotency-Key that is still being worked on,
// before it answers 409 idempotency_key_in_use. A variable for the tests.
var idempotencyWait = 5 * time.Second

// idempotencyPoll is how often a waiting request reads the key's record:
// the record may be answered on another replica, so it is read, not told.
const idempotencyPoll = 20 * time.Millisecond

// settleTimeout bounds the store write that answers or gives up a claim.
// The write does not end with the request: a client gone after the work
// must still leave its answer for the repeat it will send.
const settleTimeout = 10 * time.Second

// claimContextKey is the gin context key of the request's claim (a
// *companion.Idempotency) while it holds one.
const claimContextKey = "companion.idempotency.claim"

// beginIdempotent handles the Idempotency-Key of a request that does not
// create a command. When the key answered the same request before, it
// replays that answer and returns replayed = true. Otherwise it claims the
// key for this request, before the work, and returns the claim (nil when
// the request has no key): reply stores the answer over it after a 2xx, and
// an answer that is not a 2xx (fail included) gives it up, for a repeat to
// do the work again. A repeat that finds the key claimed by a request
// still at work waits for that answer, up to idempotencyWait, and then
// answers 409 idempotency_key_in_use. Claiming first is what makes two
// overlapping requests with one key do the work once: the store refuses
// the second claim atomically (companion.ErrExists).
func (s *Server) beginIdempotent(c *gin.Context, userID string, body []byte) (rec *companion.Idempotency, replayed bool, err error) {
	key, err := idempotencyKey(c)
	if err != nil || key == "" {
		return nil, false, err
	}
	// The claim's Body is its token: giving it up frees the key only
	// while it is this claim that holds it, not a repeat's claim made
	// after this one ran out (docs/reliability.md, bug 311).
	claim := &companion.Idempotency{UserID: userID, Key: key, RequestHash: requestHash(c, body), Body: []byte(rand.Text())}
	ctx := c.Request.Context()
	deadline := time.NewTimer(idempotencyWait)
	defer deadline.Stop()
	tick := time.NewTicker(idempotencyPoll)
	defer tick.Stop()
	for {
		old, err := s.store.Idempotency(ctx, userID, key)
		switch {
		case errors.Is(err, companion.ErrNotFound):
			err = s.putClaim(c, *claim)
			if err == nil {
				c.Set(claimContextKey, claim)
				// The work and its answer's record go on without the
				// client: one that hangs up as the store commits a write
				// (PostgreSQL then answers the context's error, though the
				// write is on disk) would otherwise give the key up with
				// the work done, and its repeat do it again
				// (docs/reliability.md, bug 285).
				c.Request = c.Request.WithContext(context.WithoutCancel(c.Request.Context()))
				return claim, false, nil
			}
			if !errors.Is(err, companion.ErrExists) {
				return nil, false, err
			}
			continue // claimed first by another request: read its record
		case err != nil:
			return nil, false, err
		case !sameRequest(old.RequestHash, claim.RequestHash, c, body):
			return nil, false, errIdemReused
		case old.CommandID != "": // cannot happen: the path is in the hash
			return nil, false, errIdemReused
		case old.Status != 0:
			replayAnswer(c, old)
			return nil, true, nil
		}
		// Claimed by the same request, still at work: wait for its answer.
		select {
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-deadline.C:
			return nil, false, errIdemInUse
		case <-tick.C:
		}
	}
}

// putClaim stores the request's claim on its key, whether or not the
// client stays: a claim on disk whose write the request read as failed
// (the client hung up during the COMMIT) was never given up, and held its
// key, answering every repeat 409 idempotency_key_in_use, for the minute a
// claim lasts (docs/reliability.md, bug 285).
func (s *Server) putClaim(c *gin.Context, claim companion.Idempotency) error {
	ctx, cancel := settleContext(c)
	defer cancel()
	return s.store.PutIdempotency(ctx, claim)
}

// replayAnswer answers as rec records.
func replayAnswer(c *gin.Context, rec companion.Idempotency) {
	if rec.Location != "" {
		c.Header("Location", rec.Location)
	}
	if len(rec.Body) == 0 {
		c.Status(rec.Status)
		c.Writer.WriteHeaderNow()
		return
	}
	c.Data(rec.Status, "application/json; charset=utf-8", rec.Body)
}

// withAnswer returns ctx carrying the answer the request's claim rec
// records (status, stored as JSON, location) for the one store write that
// does the request's work: the store keeps it in that write's
// transaction (companion.WithAnswer), so that the work and its answer
// commit or fail together. Stored after the work, an answer the store
// failed to keep left the key claimed: every repeat waited and was
// answered 409, and once the claim ran out a repeat did the work again (a
// second user, a second new secret; docs/reliability.md, bug 308). Once
// the write succeeds, the handler answers with a nil claim (settled).
// Without a claim it is ctx.
func withAnswer(ctx context.Context, rec *companion.Idempotency, status int, stored any, location string) (context.Context, error) {
	if rec == nil {
		return ctx, nil
	}
	r := *rec
	r.Status, r.Body, r.Location = status, nil, location // nil: not the claim's token
	if stored != nil {
		b, err := fastjson.Marshal(stored)
		if err != nil {
			return nil, err
		}
		r.Body = b
	}
	return companion.WithAnswer(ctx, r), nil
}

// settled forgets the request's claim, whose answer the write that did
// its work stored (withAnswer), and returns nil, the claim left for reply.
func settled(c *gin.Context) *companion.Idempotency {
	heldClaim(c)
	return nil
}

// heldClaim returns the claim the request holds, or nil, and forgets it:
// it is settled once.
func heldClaim(c *gin.Context) *companion.Idempotency {
	v, ok := c.Get(claimContextKey)
	if !ok {
		return nil
	}
	claim, _ := v.(*companion.Idempotency)
	if claim != nil {
		c.Set(claimContextKey, (*companion.Idempotency)(nil))
	}
	return claim
}

// settleContext is the context of a write that settles the request's
// claim: not canceled with the request, bounded by settleTimeout.
func settleContext(c *gin.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(c.Request.Context()), settleTimeout)
}

// releaseIdempotent gives up the request's claim on its Idempotency-Key,
// if it holds one: the request answers without recording its answer, and
// a repeat may do the work again. The claim is put again as made long ago,
// which the store reads as the key free (see PutIdempotency).
func (s *Server) releaseIdempotent(c *gin.Context) {
	claim := heldClaim(c)
	if claim == nil {
		return
	}
	ctx, cancel := settleContext(c)
	defer cancel()
	gone := *claim
	gone.CreatedAt = longAgo
	err := s.store.PutIdempotency(ctx, gone)
	switch {
	case errors.Is(err, companion.ErrExists):
		// The claim ran out, and another request holds the key now.
	case err != nil:
		// The claim then frees the key when it runs out, a minute on.
		s.log.ErrorContext(ctx, "giving up an idempotency claim", requestIDAttr(c), "err", err)
	}
}

// longAgo is the time of a claim given up: older than any record lives.
var longAgo = time.Unix(0, 0).UTC()

// reply answers status with v as JSON (nothing when v is nil). With rec,
// the request's claim on its Idempotency-Key, it first stores the answer
// over the claim after a 2xx, and gives the claim up otherwise. stored,
// when not nil, is what the record keeps instead of v: answers carrying a
// secret keep it out of the store.
func (s *Server) reply(c *gin.Context, status int, v any, location string, rec *companion.Idempotency, stored any) error {
	var b []byte
	if v != nil {
		var err error
		if b, err = fastjson.Marshal(v); err != nil {
			return err
		}
	}
	if rec != nil && status/100 == 2 {
		r := *rec
		// CreatedAt stays zero: the store stamps it with its clock, the
		// one it judges records by (PostgreSQL's, shared by every
		// replica: bug 309).
		r.Status, r.Body, r.Location = status, b, location
		if stored != nil {
			sb, err := fastjson.Marshal(stored)
			if err != nil {
				return err
			}
			r.Body = sb
		}
		heldClaim(c) // settled here, whatever the store says
		ctx, cancel := settleContext(c)
		err := s.store.PutIdempotency(ctx, r)
		cancel()
		if err != nil {
			// The work is done; losing the record only means a repeat
			// waits while the claim holds and then does the work again.
			// ErrExists: the claim ran out and another request answered.
			s.log.ErrorContext(c.Request.Context(), "storing an idempotency record", requestIDAttr(c), "err", err)
		}
	} else if rec != nil {
		s.releaseIdempotent(c)
	}
	if location != "" {
		c.Header("Location", location)
	}
	if b == nil {
		c.Status(status)
		c.Writer.WriteHeaderNow()
		return nil
	}
	s.data(c, status, "application/json; charset=utf-8", b)
	return nil
}

// largeAnswer is the size past which an answer may not fit in the
// sockets' buffers, and its writes wait for the client to take it: a
// smaller one is handed to the kernel whole, whatever the client does.
const largeAnswer = 16 << 10

// answerChunk is how much of a large answer one write hands over, each
// within its own deadline (as http.ServeContent writes a blob).
const answerChunk = 32 << 10

// data answers status with the body b of type ctype. A large answer is
// written a chunk at a time, each of which the client must take within
// Limits.BodyIdle, as a blob download's (blobWriter): a client that asked
// for the OpenAPI document, which anyone may, or a page of a list, and
// then read nothing held the handler and the connection for ever
// (docs/reliability.md, bug 319). The answers of the command path are
// small and go as they did.
func (s *Server) data(c *gin.Context, status int, ctype string, b []byte) {
	idle := s.limits.BodyIdle
	if len(b) <= largeAnswer || idle <= 0 {
		c.Data(status, ctype, b)
		return
	}
	c.Header("Content-Type", ctype)
	c.Header("Content-Length", strconv.Itoa(len(b)))
	c.Status(status)
	c.Writer.WriteHeaderNow()
	// The head goes first, with no deadline of its own: net/http reads
	// what the client sent of a body the handler left unread as it
	// writes the head, within the body's own deadline (bodyIdle).
	rc := http.NewResponseController(c.Writer)
	if err := rc.Flush(); err != nil {
		return
	}
	for len(b) > 0 {
		n := min(len(b), answerChunk)
		if _, err := writeWithin(c.Writer, rc, idle, b[:n]); err != nil {
			return // the client took nothing for idle: the connection is closed
		}
		b = b[n:]
	}
	// The deadline stays on the connection, which may serve another
	// request: taken off once all is handed over.
	if rc.Flush() == nil {
		_ = rc.SetWriteDeadline(time.Time{})
	}
}

// Pagination.

const (
	defaultPageSize = 50
	maxPageSize     = 200
)

// queryOnce reads the query parameter name: its value, whether it is
// there (empty or not), and whether it is there twice with different
// values, which no parameter of ours takes. A value net/url cannot read
// (`limit=%zz`, `state=queued;x`) is there, as written, and no valid
// value of any parameter: net/url drops it, as if it were not there,
// which would read a malformed filter as none.
func queryOnce(c *gin.Context, name string) (value string, given, twice bool) {
	vs, _ := c.GetQueryArray(name)
	vs = append(vs, unreadableQuery(c.Request.URL.RawQuery, name)...)
	if len(vs) == 0 {
		return "", false, false
	}
	for _, v := range vs[1:] {
		if v != vs[0] {
			twice = true
		}
	}
	return vs[0], true, twice
}

// unreadableQuery returns the raw values of the query parameter name in
// the pairs of query that url.ParseQuery drops: those with a malformed
// escape or a semicolon.
func unreadableQuery(query, name string) []string {
	var vs []string
	for query != "" {
		var pair string
		pair, query, _ = strings.Cut(query, "&")
		if _, err := url.ParseQuery(pair); err == nil {
			continue
		}
		k, v, _ := strings.Cut(pair, "=")
		if key, err := url.QueryUnescape(k); k == name || err == nil && key == name {
			vs = append(vs, v)
		}
	}
	return vs
}

// queryCaseErrors names each query parameter whose name is one of names
// only when case is ignored (`State` for `state`, `LIMIT` for `limit`), as
// caseErrors names such body members: net/url matches names exactly, so
// `?State=failed` was no filter at all, and a list of every state answered
// it without a word. Parameters that resemble none are ignored, as unknown
// body members are (a cache-buster, a tracking parameter a proxy adds).
func queryCaseErrors(c *gin.Context, names ...string) []FieldError {
	var keys []string
	for query := c.Request.URL.RawQuery; query != ""; {
		var pair string
		pair, query, _ = strings.Cut(query, "&")
		k, _, _ := strings.Cut(pair, "=")
		if key, err := url.QueryUnescape(k); err == nil {
			k = key
		}
		if !slices.Contains(names, k) && !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var errs []FieldError
	for _, k := range keys {
		for _, name := range names {
			if strings.EqualFold(k, name) {
				errs = append(errs, FieldError{Field: k, Message: fmt.Sprintf("must be written %q: parameter names are case-sensitive", name)})
				break
			}
		}
	}
	return errs
}

// page reads limit and cursor, and refuses those parameters, and the
// list's filters, named in another case (queryCaseErrors). The cursor is
// the base64url of the last id of the previous page; valid says what such
// an id looks like. An empty limit is no number, and refused; an empty
// cursor is the first page's, as there is no page before it.
func page(c *gin.Context, valid func(string) bool, more []FieldError, filters ...string) (limit int, after string, err error) {
	limit = defaultPageSize
	fields := append(queryCaseErrors(c, append([]string{"limit", "cursor"}, filters...)...), more...)
	if v, ok, twice := queryOnce(c, "limit"); ok {
		n, err := strconv.Atoi(v)
		switch {
		case twice:
			fields = append(fields, FieldError{Field: "limit", Message: "must be given once"})
		case err != nil || n < 1 || n > maxPageSize:
			fields = append(fields, FieldError{Field: "limit", Message: fmt.Sprintf("must be an integer from 1 to %d", maxPageSize)})
		}
		limit = n
	}
	badCursor := false
	if v, ok, twice := queryOnce(c, "cursor"); twice {
		fields = append(fields, FieldError{Field: "cursor", Message: "must be given once"})
	} else if ok && v != "" {
		id, err := base64.RawURLEncoding.DecodeString(v)
		if err != nil || !valid(string(id)) {
			badCursor = true
		}
		after = string(id)
	}
	switch {
	case badCursor && len(fields) == 0:
		return 0, "", &Error{Code: CodeInvalidCursor, Fields: []FieldError{{Field: "cursor", Message: "is not a cursor this list returned"}}}
	case badCursor:
		fields = append(fields, FieldError{Field: "cursor", Message: "is not a cursor this list returned"})
	}
	if err := validationError(fields); err != nil {
		return 0, "", err
	}
	return limit, after, nil
}

func cursorOf(id string) *string {
	s := base64.RawURLEncoding.EncodeToString([]byte(id))
	return &s
}

// countingReader counts the bytes read through it, and keeps the error
// that ended them other than io.EOF: what went wrong was then the body's.
type countingReader struct {
	r   io.Reader
	n   int64
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && err != io.EOF {
		c.err = err
	}
	return n, err
}
