package api

import (
	_ "embed" // the OpenAPI document
	"fmt"
	"net/http"
	"strings"

	"github.com/gin-gonic/gin"
)

// openapiJSON is the OpenAPI 3.1 document of every route (CONTRACT §12).
// It is written by hand: the handlers' request types carry none of the
// rules (identifier patterns, ranges, which problem codes each answer can
// hold) that make the document worth reading, and the package's tests
// check every request and answer they exchange against it, so it cannot
// drift from the code unnoticed. It is written with the default limits;
// a server serves it with its own (openapiFor).
//
//go:embed openapi.json
var openapiJSON []byte

// openapi serves the document. It needs no token: it says nothing about
// anyone's devices.
func (s *Server) openapi(c *gin.Context) {
	s.data(c, http.StatusOK, "application/json; charset=utf-8", s.openapiDoc)
}

// openapiFor is openapiJSON with the limits of l in place of the defaults
// it is written with: the maxLength of a text, a title and an image's
// base64, and the limits its descriptions state (among them the requests
// held by Prefer: wait, the event streams and the unfinished commands of a
// device: bug 264). A client generated from
// the document served then takes what this server takes; with the
// defaults, a server configured past them took requests its own document
// refused (docs/reliability.md, bug 262). Each replacement must meet its
// text exactly once: an error means the document changed under it.
func openapiFor(l Limits) ([]byte, error) {
	d := DefaultLimits
	register := func(n int) string {
		if n < 0 {
			return "Attempts are not limited."
		}
		return fmt.Sprintf("%d attempts a minute per user.", n)
	}
	waits := func(n int) string {
		if n < 0 {
			return "The requests a caller may have held so at once are not limited on this server (`--max-waits-per-user` 0)."
		}
		return fmt.Sprintf("A caller may have %d requests held so at once (`--max-waits-per-user`); past them one with `wait=N` (N > 0) is a `429 too_many_waits` with `Retry-After`, before it does anything.", n)
	}
	streams := func(n int) string {
		if n < 0 {
			return "The streams a caller may have open at once are not limited on this server (`--max-streams-per-user` 0)."
		}
		return fmt.Sprintf("A caller may have %d streams open at once on a server (`--max-streams-per-user`); past them a stream is a `429 too_many_streams` with `Retry-After`.", n)
	}
	bridges := func(n int) string {
		if n < 0 {
			return "The bridges a caller may have are not limited on this server."
		}
		return fmt.Sprintf("A caller may have %d bridges of their own; past them a creation is a `422 validation_failed` naming `bridge_id`.", n)
	}
	doc := string(openapiJSON)
	for _, r := range []struct{ old, new string }{
		{fmt.Sprintf(`"maxLength": %d, "pattern": "^[^\\x00-\\x08`, d.MaxTextBytes), fmt.Sprintf(`"maxLength": %d, "pattern": "^[^\\x00-\\x08`, l.MaxTextBytes)},
		{fmt.Sprintf(`At most %d bytes of UTF-8, with`, d.MaxTextBytes), fmt.Sprintf(`At most %d bytes of UTF-8, with`, l.MaxTextBytes)},
		{fmt.Sprintf(`"title": {"type": ["string", "null"], "maxLength": %d,`, d.MaxTitleBytes), fmt.Sprintf(`"title": {"type": ["string", "null"], "maxLength": %d,`, l.MaxTitleBytes)},
		{fmt.Sprintf(`At most %d bytes of UTF-8, one line`, d.MaxTitleBytes), fmt.Sprintf(`At most %d bytes of UTF-8, one line`, l.MaxTitleBytes)},
		{fmt.Sprintf(`"maxLength": %d, "pattern": "^[A-Za-z0-9+/]*={0,2}$"`, base64Len(d.MaxImageBytes)), fmt.Sprintf(`"maxLength": %d, "pattern": "^[A-Za-z0-9+/]*={0,2}$"`, base64Len(l.MaxImageBytes))},
		{fmt.Sprintf(`at most %d×%d pixels, at most %s decoded`, d.MaxImageSide, d.MaxImageSide, sizeWords(d.MaxImageBytes)), fmt.Sprintf(`at most %d×%d pixels, at most %s decoded`, l.MaxImageSide, l.MaxImageSide, sizeWords(l.MaxImageBytes))},
		{fmt.Sprintf(`at most %s decoded and %d×%d pixels`, sizeWords(d.MaxImageBytes), d.MaxImageSide, d.MaxImageSide), fmt.Sprintf(`at most %s decoded and %d×%d pixels`, sizeWords(l.MaxImageBytes), l.MaxImageSide, l.MaxImageSide)},
		{fmt.Sprintf("naming `image.<part>`. The same content again is a `200` no-op; other content for a published version a `409`. At most %s.", sizeWords(d.MaxFirmwareBytes)),
			fmt.Sprintf("naming `image.<part>`. The same content again is a `200` no-op; other content for a published version a `409`. At most %s.", sizeWords(l.MaxFirmwareBytes))},
		{fmt.Sprintf("(raw bytes)\",\n        \"description\": \"The same content again is a `200` no-op; other content for a published version a `409`. At most %s.", sizeWords(d.MaxAppBytes)),
			fmt.Sprintf("(raw bytes)\",\n        \"description\": \"The same content again is a `200` no-op; other content for a published version a `409`. At most %s.", sizeWords(l.MaxAppBytes))},
		{"`422 invalid_claim`. " + register(d.RegisterPerMinute), "`422 invalid_claim`. " + register(l.RegisterPerMinute)},
		{waits(d.MaxWaitsPerUser), waits(l.MaxWaitsPerUser)},
		{streams(d.MaxStreamsPerUser), streams(l.MaxStreamsPerUser)},
		{bridges(d.MaxBridgesPerUser), bridges(l.MaxBridgesPerUser)},
		{fmt.Sprintf("too many unfinished commands (%d)", d.MaxOpenCommands), fmt.Sprintf("too many unfinished commands (%d)", l.MaxOpenCommands)},
	} {
		if n := strings.Count(doc, r.old); n != 1 {
			return nil, fmt.Errorf("api: openapi.json has %q %d times, not once", r.old, n)
		}
		doc = strings.Replace(doc, r.old, r.new, 1)
	}
	return []byte(doc), nil
}

// base64Len is the length of the padded base64 of n bytes.
func base64Len(n int64) int64 { return (n + 2) / 3 * 4 }

// sizeWords writes n bytes as the document does: in MiB or KiB when it is
// a whole number of them.
func sizeWords(n int64) string {
	switch {
	case n > 0 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n > 0 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
