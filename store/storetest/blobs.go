package storetest

import (
	"bytes"
	"context"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testBlobs(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"RoundTripWithSeek", testBlobRoundTrip},
		{"SameContentTwice", testBlobSameContent},
		{"Limits", testBlobLimits},
		{"ConcurrentSameContent", testBlobConcurrent},
		{"Lookups", testBlobLookups},
		{"Purge", testPurgeBlobs},
		{"PurgeRacesPutBlob", testPurgeBlobsRacesPutBlob},
	})
}

// sameBlob fails the test unless a and b are the same record.
func sameBlob(t *testing.T, what string, a, b companion.Blob) {
	t.Helper()
	if a.SHA256 != b.SHA256 || a.Size != b.Size || !a.CreatedAt.Equal(b.CreatedAt) {
		t.Errorf("%s = %+v; want %+v", what, a, b)
	}
}

// readBlob reads the whole blob through OpenBlob.
func readBlob(t *testing.T, s companion.Store, sha string) ([]byte, companion.Blob) {
	t.Helper()
	r, b, err := s.OpenBlob(t.Context(), sha)
	require.NoError(t, err, "OpenBlob(%s)", sha)
	defer r.Close()
	data, err := io.ReadAll(r)
	require.NoError(t, err, "reading blob %s", sha)
	return data, b
}

func testBlobRoundTrip(t *testing.T, s companion.Store) {
	ctx := t.Context()
	var buf bytes.Buffer
	for i := range 100000 {
		buf.WriteString("firmware ")
		buf.WriteByte(byte('0' + i%10)) // so that an offset shows
	}
	content := buf.Bytes()
	sha := shaHex(content)

	b, err := s.PutBlob(ctx, bytes.NewReader(content), int64(len(content)))
	require.NoError(t, err)
	assert.Equal(t, sha, b.SHA256, "PutBlob().SHA256")
	assert.Equal(t, int64(len(content)), b.Size, "PutBlob().Size")
	near(t, "PutBlob().CreatedAt", b.CreatedAt)

	rec, err := s.Blob(ctx, sha)
	require.NoError(t, err, "Blob(%s)", sha)
	sameBlob(t, "Blob()", rec, b)
	data, got := readBlob(t, s, sha)
	sameBlob(t, "OpenBlob()", got, b)
	assert.True(t, bytes.Equal(data, content), "OpenBlob gave %d bytes; want the %d stored", len(data), len(content))

	// Seek, as a ranged download resumes.
	r, _, err := s.OpenBlob(ctx, sha)
	require.NoError(t, err)
	defer r.Close()
	head := make([]byte, 10)
	_, err = io.ReadFull(r, head)
	require.NoError(t, err)
	assert.Equal(t, content[:10], head)
	for _, c := range []struct {
		offset int64
		whence int
		want   int64
	}{
		{123457, io.SeekStart, 123457},
		{-100, io.SeekCurrent, 123457 + 100 - 100},
		{-17, io.SeekEnd, int64(len(content)) - 17},
		{0, io.SeekStart, 0},
		{int64(len(content)) - 5, io.SeekStart, int64(len(content)) - 5},
	} {
		pos, err := r.Seek(c.offset, c.whence)
		require.NoError(t, err, "Seek(%d, %d)", c.offset, c.whence)
		require.Equal(t, c.want, pos, "Seek(%d, %d)", c.offset, c.whence)
		n := min(100, int64(len(content))-pos)
		part := make([]byte, n)
		_, err = io.ReadFull(r, part)
		require.NoError(t, err, "read after Seek(%d, %d)", c.offset, c.whence)
		assert.Equal(t, content[pos:pos+n], part, "bytes after Seek(%d, %d)", c.offset, c.whence)
		// The next Seek(SeekCurrent) starts after what was read.
		if c.whence == io.SeekStart && c.offset == 123457 {
			cur, err := r.Seek(0, io.SeekCurrent)
			require.NoError(t, err)
			assert.Equal(t, pos+n, cur, "Seek(0, SeekCurrent) after a read")
		}
	}
	end, err := r.Seek(0, io.SeekEnd)
	require.NoError(t, err)
	assert.Equal(t, int64(len(content)), end, "Seek(0, SeekEnd)")
	n, err := r.Read(make([]byte, 10))
	assert.Equal(t, 0, n, "Read at the end")
	assert.ErrorIs(t, err, io.EOF, "Read at the end")

	// Empty content is a blob too.
	empty, err := s.PutBlob(ctx, strings.NewReader(""), 10)
	require.NoError(t, err, "PutBlob(empty)")
	assert.Equal(t, shaHex(nil), empty.SHA256)
	assert.Zero(t, empty.Size)
	data, _ = readBlob(t, s, empty.SHA256)
	assert.Empty(t, data)
}

// Storing the same content again is fine and changes nothing: the record
// keeps its first CreatedAt.
func testBlobSameContent(t *testing.T, s companion.Store) {
	ctx := t.Context()
	content := bytes.Repeat([]byte("same "), 1000)
	b, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
	require.NoError(t, err)
	again, err := s.PutBlob(ctx, bytes.NewReader(content), int64(len(content)))
	require.NoError(t, err, "PutBlob(same content)")
	sameBlob(t, "PutBlob(same content)", again, b)
	rec, err := s.Blob(ctx, b.SHA256)
	require.NoError(t, err)
	sameBlob(t, "Blob() after the second PutBlob", rec, b)
	data, _ := readBlob(t, s, b.SHA256)
	assert.True(t, bytes.Equal(data, content), "content after the second PutBlob")
	// Other content is another blob.
	other, err := s.PutBlob(ctx, bytes.NewReader(append(content, '!')), 0)
	require.NoError(t, err)
	assert.NotEqual(t, b.SHA256, other.SHA256)
	assert.Equal(t, int64(len(content)+1), other.Size)
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

func testBlobLimits(t *testing.T, s companion.Store) {
	ctx := t.Context()
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	tests := []struct {
		name    string
		ctx     context.Context
		content string
		max     int64
		want    error
	}{
		{"at the limit", ctx, "12345", 5, nil},
		{"one over", ctx, "123456", 5, companion.ErrTooLarge},
		{"far over", ctx, strings.Repeat("x", 1<<20), 1000, companion.ErrTooLarge},
		{"no limit", ctx, strings.Repeat("y", 1<<20), 0, nil},
		{"negative limit", ctx, strings.Repeat("z", 1000), -1, nil},
		{"canceled", canceled, "abc", 0, context.Canceled},
		{"reader fails", ctx, "part", 0, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r io.Reader = strings.NewReader(tt.content)
			if tt.want == io.ErrUnexpectedEOF {
				r = io.MultiReader(strings.NewReader(tt.content), failingReader{})
			}
			b, err := s.PutBlob(tt.ctx, r, tt.max)
			wantErr(t, err, tt.want, "PutBlob")
			sha := shaHex([]byte(tt.content))
			_, lookup := s.Blob(ctx, sha)
			if tt.want == nil {
				assert.NoError(t, lookup, "Blob(%.8s…) of stored content", sha)
				assert.Equal(t, sha, b.SHA256)
				assert.Equal(t, int64(len(tt.content)), b.Size)
				return
			}
			assert.ErrorIs(t, lookup, companion.ErrNotFound, "Blob(refused content)")
			_, _, err = s.OpenBlob(ctx, sha)
			assert.ErrorIs(t, err, companion.ErrNotFound, "OpenBlob(refused content)")
		})
	}
}

func testBlobConcurrent(t *testing.T, s companion.Store) {
	ctx := t.Context()
	content := bytes.Repeat([]byte("image"), 50000)
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		got []companion.Blob
	)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := s.PutBlob(ctx, bytes.NewReader(content), 0)
			if err != nil {
				t.Errorf("PutBlob = %v", err)
				return
			}
			mu.Lock()
			got = append(got, b)
			mu.Unlock()
		}()
	}
	wg.Wait()
	data, b := readBlob(t, s, shaHex(content))
	assert.True(t, bytes.Equal(data, content), "blob after concurrent puts: %d bytes", len(data))
	assert.Equal(t, int64(len(content)), b.Size)
	for _, g := range got {
		sameBlob(t, "PutBlob (one of 16 at once)", g, b)
	}
}

func testBlobLookups(t *testing.T, s companion.Store) {
	ctx := t.Context()
	b, err := s.PutBlob(ctx, strings.NewReader("x"), 0)
	require.NoError(t, err)
	tests := []struct {
		name string
		sha  string
		want error
	}{
		{"stored", b.SHA256, nil},
		{"absent", shaHex([]byte("y")), companion.ErrNotFound},
		{"upper case", strings.ToUpper(b.SHA256), companion.ErrNotFound},
		{"short", b.SHA256[:63], companion.ErrNotFound},
		{"long", b.SHA256 + "0", companion.ErrNotFound},
		{"path", "../" + b.SHA256[3:], companion.ErrNotFound},
		{"empty", "", companion.ErrNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.Blob(ctx, tt.sha)
			wantErr(t, err, tt.want, "Blob")
			r, _, err := s.OpenBlob(ctx, tt.sha)
			wantErr(t, err, tt.want, "OpenBlob")
			if r != nil {
				_ = r.Close()
			}
		})
	}
}
