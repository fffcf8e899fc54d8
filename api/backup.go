package api

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/devicecompanion/companion"
)

// Backuper is what GET /api/v1/admin/backup needs of the store: a copy of
// it as it stands at one instant. The bbolt store (*store.DB) has it;
// PostgreSQL is backed up with its own tools. With w nil, Backup only
// calls size with the file's length (HEAD).
type Backuper interface {
	Backup(ctx context.Context, w io.Writer, size func(int64)) (int64, error)
}

// adminBackup answers a consistent copy of the server's bbolt file, taken
// while the server runs and takes commands (bug 396): what companion
// backup FILE saves. Copying the live file with cp could catch a commit
// half written.
func (s *Server) adminBackup(c *gin.Context) error {
	b, ok := s.store.(Backuper)
	if !ok {
		return &Error{Code: CodeBackupUnsupported}
	}
	h := c.Writer.Header()
	w := &blobWriter{ResponseWriter: c.Writer, rc: http.NewResponseController(c.Writer), idle: s.limits.BodyIdle}
	defer func() { _ = w.rc.SetWriteDeadline(time.Time{}) }()
	// HEAD says the file's length without a copy.
	ctx := c.Request.Context()
	head := c.Request.Method == http.MethodHead
	var to io.Writer = w
	if head {
		to = nil
	}
	started := false
	n, err := b.Backup(ctx, to, func(size int64) {
		started = true
		h.Set("Content-Type", "application/octet-stream")
		h.Set("Content-Length", strconv.FormatInt(size, 10))
		h.Set("Content-Disposition", `attachment; filename="companion.db"`)
		h.Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusOK)
	})
	if err == nil {
		_ = w.rc.Flush()
		return nil
	}
	if !started {
		if errors.Is(err, companion.ErrNoRoom) {
			// What to do, for the admin CLI to show (bug 430); no path.
			_, detail, _ := strings.Cut(err.Error(), companion.ErrNoRoom.Error()+": ")
			return &Error{Code: CodeBackupNoRoom, Detail: detail}
		}
		return err
	}
	if head {
		return nil
	}
	// The status and the length are sent: the client sees the copy cut
	// short (net/http closes the connection), and the log says why.
	s.log.WarnContext(c.Request.Context(), "backup: the copy was not sent whole", "sent", n, "err", err)
	return nil
}
