package openapitest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"mime"
	"net/http"
	"sync"
	"testing"
)

// Transport wraps base (http.DefaultTransport when nil) so that every
// request sent through it and every answer it gets are checked against the
// repository's api/openapi.json as [Contract.Check] does; a disagreement
// fails tb with Errorf, and the request and answer go on unchanged.
func Transport(tb testing.TB, base http.RoundTripper) http.RoundTripper {
	tb.Helper()
	return Load(tb).Transport(tb, base)
}

// Client returns a copy of hc (http.DefaultClient when nil) whose transport
// is wrapped by [Transport].
func Client(tb testing.TB, hc *http.Client) *http.Client {
	tb.Helper()
	if hc == nil {
		hc = http.DefaultClient
	}
	checked := *hc
	checked.Transport = Transport(tb, hc.Transport)
	return &checked
}

// Transport wraps base (http.DefaultTransport when nil) so that traffic
// through it is checked against c. Request bodies are read whole before
// they are sent. Answers are read whole and checked before RoundTrip
// returns, except two kinds, whose status and headers are checked at once
// and whose bodies go through as the caller reads them: event streams
// (text/event-stream), which may never end, and blobs
// (application/octet-stream), which may be large and whose content is
// hashed as it is read and checked against its name when the caller reads
// it to the end. Answers cut short (an error while reading) are not checked.
func (c *Contract) Transport(tb testing.TB, base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return &transport{c: c, tb: tb, base: base}
}

type transport struct {
	c    *Contract
	tb   testing.TB
	base http.RoundTripper
}

func (t *transport) RoundTrip(r *http.Request) (*http.Response, error) {
	var body []byte
	if r.Body != nil && r.Body != http.NoBody {
		var err error
		body, err = io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			return nil, err
		}
		sent := r.Clone(r.Context())
		sent.Body = io.NopCloser(bytes.NewReader(body))
		sent.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		sent.ContentLength = int64(len(body))
		r = sent
	}
	res, err := t.base.RoundTrip(r)
	if err != nil {
		return res, err
	}

	a := Answer{Status: res.StatusCode, Header: res.Header}
	mt, _, _ := mime.ParseMediaType(res.Header.Get("Content-Type"))
	if r.Method != http.MethodHead && (mt == "text/event-stream" || mt == "application/octet-stream") {
		if sha := t.c.check(t.tb, r, body, a, false); sha != "" {
			res.Body = &hashingBody{ReadCloser: res.Body, h: sha256.New(), want: sha, tb: t.tb, where: where(r, a.Status)}
		}
		return res, nil
	}

	b, readErr := io.ReadAll(res.Body)
	res.Body.Close()
	if readErr != nil {
		// Give the caller what came and then the same failure.
		res.Body = io.NopCloser(io.MultiReader(bytes.NewReader(b), failingReader{readErr}))
		return res, nil
	}
	res.Body = io.NopCloser(bytes.NewReader(b))
	a.Body = b
	t.c.Check(t.tb, r, body, a)
	return res, nil
}

type failingReader struct{ err error }

func (f failingReader) Read([]byte) (int, error) { return 0, f.err }

// hashingBody hashes a blob as it is read and, at its end, checks the hash
// against the blob's name.
type hashingBody struct {
	io.ReadCloser
	tb    testing.TB
	where string
	want  string

	mu   sync.Mutex
	h    hash.Hash
	done bool
}

func (b *hashingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return n, err
	}
	b.h.Write(p[:n])
	switch {
	case err == io.EOF:
		b.done = true
		if hex.EncodeToString(b.h.Sum(nil)) != b.want {
			b.tb.Errorf("openapi: %s: the blob's content does not hash to its name", b.where)
		}
	case err != nil:
		b.done = true // cut short: nothing to check
	}
	return n, err
}
