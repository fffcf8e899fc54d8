package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// chunkSize is the size of the rows of blob_chunks that PutBlob writes.
// A blob records the chunk size it was written with.
const chunkSize = 256 << 10

// PutBlob stores the content of r as a blob and returns its record. The
// content is streamed (COPY) into blob_chunks under a content id of its
// own while it is hashed, and the blob's row is added with the digest
// computed, all in one transaction: a blob is whole or absent. Content
// over max bytes (max <= 0: no limit) is ErrTooLarge and leaves nothing
// behind. Storing content that is already stored is fine, concurrently
// too: the row keeps its content and first CreatedAt, the chunks just
// written are deleted in the same transaction, and the row's stored_at
// becomes now (by the database's clock, as created_at), so that
// PurgeBlobs spares content stored again for a command about to reference
// it, however old the blob. The row is written with one INSERT … ON
// CONFLICT DO UPDATE, which either adds it or updates the one in place,
// also when PurgeBlobs deletes that one at the same moment (the insert
// then goes ahead once the delete committed).
func (s *Store) PutBlob(ctx context.Context, r io.Reader, max int64) (companion.Blob, error) {
	var out companion.Blob
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		src := &chunkSource{r: r, max: max, content: uuid.New(), h: sha256.New(), buf: make([]byte, chunkSize)}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"blob_chunks"}, []string{"content_id", "n", "data"}, src); err != nil {
			if src.err != nil {
				return src.err
			}
			return fmt.Errorf("postgres: write blob: %w", err)
		}
		sha := hex.EncodeToString(src.h.Sum(nil))
		var content string
		// Stamped by the database's clock, which PurgeBlobs judges an age
		// by (purgeCut): stamped by a replica 2 h behind, a blob was 2 h
		// old as it was stored, and a purge in the moment before the
		// command it was uploaded for referenced it deleted it
		// (docs/reliability.md, bug 312).
		err := tx.QueryRow(ctx, `INSERT INTO blobs (sha256, content_id, size, chunk_size, created_at, stored_at)
			VALUES ($1, $2, $3, $4, statement_timestamp(), statement_timestamp())
			ON CONFLICT (sha256) DO UPDATE SET stored_at = greatest(blobs.stored_at, excluded.stored_at)
			RETURNING content_id::text, size, created_at`, sha, src.content.String(), src.size, chunkSize).
			Scan(&content, &out.Size, &out.CreatedAt)
		if err != nil {
			return err
		}
		out.SHA256, out.CreatedAt = sha, out.CreatedAt.UTC()
		if content == src.content.String() {
			return nil
		}
		// Stored already: ours are surplus.
		_, err = tx.Exec(ctx, `DELETE FROM blob_chunks WHERE content_id = $1`, src.content.String())
		return err
	})
	if err != nil {
		return companion.Blob{}, err
	}
	return out, nil
}

// blobPurgeBatch bounds the blobs one statement of PurgeBlobs deletes, with
// their chunks: a firmware has 256 of them, each stored out of line.
const blobPurgeBatch = 100

// PurgeBlobs deletes the blobs that nothing needs any more and that were
// last stored (PutBlob, the first time or again) before olderThan (by the
// database's clock, purgeCut), with
// their chunks, and returns how many went; at most blobPurgeBatch in each
// statement. A blob is needed while an unfinished command references it
// (as BlobNeeded reads them: a final command keeps the digest, not the
// blob) or a firmware or an app release does. Content is stored before
// the command or release that will reference it is written: callers pass
// a time well before now, so that such content, just stored, is kept.
//
// The outer WHERE checks stored_at again: a PutBlob that refreshed a row
// after the statement's snapshot makes the delete skip it (READ COMMITTED
// evaluates the target row's conditions again on its newest version).
func (s *Store) PurgeBlobs(ctx context.Context, olderThan time.Time) (int, error) {
	total := 0
	for {
		var n int
		err := s.pool.QueryRow(ctx, `WITH doomed AS (
				DELETE FROM blobs WHERE stored_at < `+purgeCut+` AND sha256 IN (
					SELECT b.sha256 FROM blobs b WHERE b.stored_at < `+purgeCut+`
					AND NOT EXISTS (SELECT 1 FROM commands c WHERE c.blob = b.sha256 AND c.state IN `+openStates+`)
					AND NOT EXISTS (SELECT 1 FROM firmware f WHERE f.sha256 = b.sha256)
					AND NOT EXISTS (SELECT 1 FROM app_releases a WHERE a.sha256 = b.sha256)
					LIMIT $2)
				RETURNING content_id),
			chunks AS (DELETE FROM blob_chunks WHERE content_id IN (SELECT content_id FROM doomed))
			SELECT count(*) FROM doomed`, olderThan, blobPurgeBatch, s.clock()).Scan(&n)
		if err != nil {
			return total, err
		}
		total += n
		if n < blobPurgeBatch {
			return total, nil
		}
	}
}

// chunkSource is the pgx.CopyFromSource of PutBlob: the chunks of r, as
// they are read.
type chunkSource struct {
	r       io.Reader
	max     int64
	content uuid.UUID
	h       hash.Hash
	buf     []byte
	n       int32 // chunks given
	size    int64
	row     []any
	err     error
	eof     bool
}

func (c *chunkSource) Next() bool {
	if c.eof || c.err != nil {
		return false
	}
	// Not io.ReadFull: it would take a reader's own io.ErrUnexpectedEOF
	// for the end of the content.
	n := 0
	for n < len(c.buf) {
		m, err := c.r.Read(c.buf[n:])
		n += m
		if err == io.EOF {
			c.eof = true
			break
		}
		if err != nil {
			c.err = fmt.Errorf("postgres: read blob: %w", err)
			return false
		}
	}
	if n == 0 {
		// An empty blob has no chunk; more than nothing has no empty one.
		return false
	}
	c.size += int64(n)
	if c.max > 0 && c.size > c.max {
		c.err = companion.ErrTooLarge
		return false
	}
	c.h.Write(c.buf[:n])
	// COPY encodes the row before Next is called again: the buffer may be
	// reused.
	c.row = []any{c.content.String(), c.n, c.buf[:n]}
	c.n++
	return true
}

func (c *chunkSource) Values() ([]any, error) { return c.row, nil }

func (c *chunkSource) Err() error { return c.err }

// validSHA256 reports whether s is 64 lower-case hex digits.
func validSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// Blob returns the record of the blob with the SHA-256 (64 lower-case hex
// digits), or ErrNotFound; a malformed digest is ErrNotFound too.
func (s *Store) Blob(ctx context.Context, sha string) (companion.Blob, error) {
	b, _, _, err := s.blob(ctx, sha)
	return b, err
}

func (s *Store) blob(ctx context.Context, sha string) (b companion.Blob, content string, chunk int64, err error) {
	if !validSHA256(sha) {
		return companion.Blob{}, "", 0, companion.ErrNotFound
	}
	err = s.pool.QueryRow(ctx, `SELECT sha256, size, created_at, content_id::text, chunk_size FROM blobs WHERE sha256 = $1`, sha).
		Scan(&b.SHA256, &b.Size, &b.CreatedAt, &content, &chunk)
	if err != nil {
		return companion.Blob{}, "", 0, notFound(err)
	}
	b.CreatedAt = b.CreatedAt.UTC()
	return b, content, chunk, nil
}

// OpenBlob opens a blob for reading; the caller closes it. It returns
// ErrNotFound as Blob does. The reader fetches one chunk at a time, each
// with a query of its own (the content never changes once stored), in a
// context that ctx's cancellation does not reach: the reader may outlive
// the call.
func (s *Store) OpenBlob(ctx context.Context, sha string) (io.ReadSeekCloser, companion.Blob, error) {
	b, content, chunk, err := s.blob(ctx, sha)
	if err != nil {
		return nil, companion.Blob{}, err
	}
	if chunk <= 0 {
		return nil, companion.Blob{}, fmt.Errorf("postgres: blob %s: chunk size %d", sha, chunk)
	}
	return &blobReader{s: s, ctx: context.WithoutCancel(ctx), content: content, size: b.Size, chunkSize: chunk, cached: -1}, b, nil
}

// blobReader reads a blob chunk by chunk.
type blobReader struct {
	s         *Store
	ctx       context.Context
	content   string
	size      int64
	chunkSize int64
	off       int64
	cached    int64 // the index of data's chunk; -1 none
	data      []byte
	closed    bool
}

func (r *blobReader) Read(p []byte) (int, error) {
	if r.closed {
		return 0, errors.New("postgres: read of a closed blob")
	}
	if r.off >= r.size {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	idx := r.off / r.chunkSize
	if idx != r.cached {
		r.data = r.data[:0]
		err := r.s.pool.QueryRow(r.ctx, `SELECT data FROM blob_chunks WHERE content_id = $1 AND n = $2`, r.content, idx).Scan(&r.data)
		if err != nil {
			r.cached = -1
			return 0, fmt.Errorf("postgres: read blob chunk %d: %w", idx, err)
		}
		r.cached = idx
	}
	start := r.off - idx*r.chunkSize
	if start >= int64(len(r.data)) {
		return 0, fmt.Errorf("postgres: blob chunk %d is short: %w", idx, io.ErrUnexpectedEOF)
	}
	n := copy(p, r.data[start:])
	r.off += int64(n)
	return n, nil
}

func (r *blobReader) Seek(offset int64, whence int) (int64, error) {
	var abs int64
	switch whence {
	case io.SeekStart:
		abs = offset
	case io.SeekCurrent:
		abs = r.off + offset
	case io.SeekEnd:
		abs = r.size + offset
	default:
		return 0, errors.New("postgres: blob seek: invalid whence")
	}
	if abs < 0 {
		return 0, errors.New("postgres: blob seek: negative position")
	}
	r.off = abs
	return abs, nil
}

func (r *blobReader) Close() error {
	r.closed = true
	r.data = nil
	return nil
}
