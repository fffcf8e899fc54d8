package gatt

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync/atomic"
)

// DefaultWindow is how many chunks a transfer keeps in flight when the
// device does not say how many buffers it has.
const DefaultWindow = 4

// Upload describes one chunked upload: which group and command carry it,
// the fields its first request carries besides off, len, sha and data
// (the command id, and version, app id or content type as the group wants),
// and the bytes.
type Upload struct {
	Group uint16
	ID    uint8
	First UploadRequest // CmdID and the group's fields; Off, Len, SHA and Data are set by the transfer
	Data  []byte
	// Progress, when set, is called with the offset the device has
	// acknowledged as it advances.
	Progress func(acked, total int)
}

// TransferStats count what a transfer cost, over all its attempts.
type TransferStats struct {
	Attempts      int   // connections the transfer ran over
	Requests      int   // upload requests sent, probes included
	DataBytesSent int64 // bytes of data sent, repeats included
}

// Transfer is one upload that survives disconnects: Run it over a client,
// and when the link drops Run it again over the next; every run starts by
// asking the device which offset it holds, so a resumed upload repeats at
// most the chunks that were in flight when the link went down.
type Transfer struct {
	u     Upload
	sha   []byte
	total uint64

	attempts, requests atomic.Int64
	dataSent           atomic.Int64
}

// NewTransfer prepares an upload; it hashes the data once.
func NewTransfer(u Upload) *Transfer {
	sum := sha256.Sum256(u.Data)
	return &Transfer{u: u, sha: sum[:], total: uint64(len(u.Data))}
}

// SHA256 is the hash of the whole transfer, as the first request carries it.
func (t *Transfer) SHA256() []byte { return t.sha }

// Stats reports the transfer's costs so far.
func (t *Transfer) Stats() TransferStats {
	return TransferStats{Attempts: int(t.attempts.Load()), Requests: int(t.requests.Load()), DataBytesSent: t.dataSent.Load()}
}

// ChunkSize is the data bytes of one upload request: the largest that keeps
// the whole message, header and CBOR included, within the device's buffer,
// with the message rounded down to whole writes of MTU-3 bytes so that no
// write goes out part-empty.
func (t *Transfer) ChunkSize(mtu, bufSize int) (int, error) {
	probe := t.u.First
	probe.Off, probe.Data, probe.Len, probe.SHA = t.total, nil, 0, nil
	body, err := EncodeBody(probe)
	if err != nil {
		return 0, err
	}
	// An empty byte string's head is one byte; up to 65535 bytes it is three.
	overhead := HeaderSize + len(body) + 2
	frag := mtu - 3
	limit := bufSize
	if limit > frag {
		limit = limit / frag * frag
	}
	n := limit - overhead
	if n < 1 {
		return 0, fmt.Errorf("gatt: the device's SMP buffer of %d bytes cannot carry an upload chunk", bufSize)
	}
	return n, nil
}

type inflight struct {
	call *Call
	end  uint64
}

// Run carries the upload over c as far as it can: it returns nil when the
// device has acknowledged every byte (and so checked the SHA-256), an
// *Error when the device refuses, and ErrDisconnected (or the context's
// error) when it must be run again. window is the most chunks in flight.
func (t *Transfer) Run(ctx context.Context, c *Client, bufSize, window int) error {
	t.attempts.Add(1)
	window = max(window, 1)
	chunk, err := t.ChunkSize(c.MTU(), bufSize)
	if err != nil {
		return err
	}
	// The first request: len, sha and the group's fields, no data. The
	// device answers the offset it holds for this sha and command: 0 for a
	// new upload, where it stopped for one it has seen, len for one done.
	first := t.u.First
	first.Off, first.Len, first.SHA, first.Data = 0, t.total, t.sha, []byte{}
	var rsp UploadResponse
	t.requests.Add(1)
	if err := c.Do(ctx, OpWrite, t.u.Group, t.u.ID, first, &rsp); err != nil {
		return err
	}
	if rsp.Off > t.total {
		return &Error{Group: t.u.Group, ID: t.u.ID, RC: RCInvalid, Reason: fmt.Sprintf("device holds offset %d of %d", rsp.Off, t.total)}
	}
	acked := rsp.Off
	t.progress(acked)

	next := acked
	var queue []inflight
	abandon := func() {
		for _, f := range queue {
			f.call.Abandon()
		}
	}
	for acked < t.total {
		for len(queue) < window && next < t.total {
			n := min(uint64(chunk), t.total-next)
			req := UploadRequest{CmdID: t.u.First.CmdID, Off: next, Data: t.u.Data[next : next+n]}
			call, err := c.Start(ctx, OpWrite, t.u.Group, t.u.ID, req)
			if err != nil {
				abandon()
				return err
			}
			t.requests.Add(1)
			t.dataSent.Add(int64(n))
			queue = append(queue, inflight{call: call, end: next + n})
			next += n
		}
		f := queue[0]
		queue = queue[1:]
		var rsp UploadResponse
		if err := f.call.Wait(ctx, &rsp); err != nil {
			abandon()
			return err
		}
		if rsp.Off > t.total {
			abandon()
			return &Error{Group: t.u.Group, ID: t.u.ID, RC: RCInvalid, Reason: fmt.Sprintf("device holds offset %d of %d", rsp.Off, t.total)}
		}
		if rsp.Off != f.end {
			// The device holds another offset than this chunk's end: it
			// dropped a chunk it could not place. Let the rest of the window
			// drain (the device answers each with the offset it holds) and
			// go on from the last answer.
			for _, g := range queue {
				var r UploadResponse
				if err := g.call.Wait(ctx, &r); err != nil {
					queue = nil
					abandon()
					return err
				}
				rsp = r
			}
			queue = nil
			if rsp.Off > t.total {
				return &Error{Group: t.u.Group, ID: t.u.ID, RC: RCInvalid, Reason: fmt.Sprintf("device holds offset %d of %d", rsp.Off, t.total)}
			}
			next = rsp.Off
		}
		acked = rsp.Off
		t.progress(acked)
	}
	abandon()
	return nil
}

func (t *Transfer) progress(acked uint64) {
	if t.u.Progress != nil {
		t.u.Progress(int(acked), int(t.total))
	}
}

// IsDisconnect reports whether err means the link went down, so the work is
// worth repeating over a new link.
func IsDisconnect(err error) bool { return errors.Is(err, ErrDisconnected) }
