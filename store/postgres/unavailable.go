package postgres

import (
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// IsUnavailable reports whether err says the database cannot be reached
// now rather than that the request was wrong: it could not connect, the
// connection broke, or the server is shutting down or starting up
// (SQLSTATE classes 08 and 57P). The API answers those 503 with
// Retry-After: the client tries again, and nothing was accepted.
func IsUnavailable(err error) bool {
	var ce *pgconn.ConnectError
	var pe *pgconn.PgError
	var ne net.Error
	switch {
	case err == nil:
		return false
	case errors.As(err, &ce), errors.As(err, &ne),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return true
	case errors.As(err, &pe):
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "57P")
	}
	return pgconn.SafeToRetry(err)
}
