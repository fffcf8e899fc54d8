package postgres

import (
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// IsUnavailable reports whether err says the database cannot take the
// request now rather than that the request was wrong: it could not
// connect, the connection broke, or the server is shutting down or
// starting up (SQLSTATE classes 08 and 57P); it lacks the resources
// (class 53: its disk full, out of memory, too many connections); it
// cannot write (IsUnwritable); or a statement waited LockTimeout for a
// lock another session holds (55P03 lock_not_available). The API answers
// those 503 with Retry-After: the client tries again, and nothing was
// accepted.
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
	case IsUnwritable(err):
		return true
	case errors.As(err, &pe):
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "57P") || strings.HasPrefix(pe.Code, "53") ||
			pe.Code == "55P03"
	}
	return pgconn.SafeToRetry(err)
}

// IsUnwritable reports whether err is PostgreSQL's refusal to write
// anything now rather than this write: 53100 disk_full ("could not extend
// file …: No space left on device", a full disk or quota under a
// tablespace), 58030 io_error, or 25006 read_only_sql_transaction (a
// standby, or a server read-only by its settings). The transaction was
// rolled back; the same write succeeds once the database's server can
// write again, without a restart.
func IsUnwritable(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	return pe.Code == "53100" || pe.Code == "58030" || pe.Code == "25006"
}
