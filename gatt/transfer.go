package gatt

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion/mcuboot"
)

// Upload describes one chunked upload: which group and command carry it,
// and the bytes.
type Upload struct {
	Group uint16
	ID    uint8
	// Stock makes it img_mgmt's upload (the image group): no command id,
	// the request that opens the upload carries the first chunk (the image
	// header in it, which the device checks), and the answer that completes
	// it may say whether the device's SHA-256 matched (match).
	Stock bool
	// First holds, for a project group's upload, the command id and the
	// group's fields; Off, Len, SHA and Data are set by the transfer.
	First UploadRequest
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
	high               atomic.Uint64 // the highest offset the device acknowledged, over every run
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

// acked is the highest offset the device has acknowledged, over every
// run: how far the transfer got.
func (t *Transfer) acked() uint64 { return t.high.Load() }

// request is the request for data at off; open is the request at off 0
// that opens (or resumes) the upload, with len and sha.
func (t *Transfer) request(off uint64, data []byte, open bool) any {
	if t.u.Stock {
		r := ImageUploadRequest{Off: off, Data: data}
		if open {
			r.Len, r.SHA = t.total, t.sha
		}
		return r
	}
	r := UploadRequest{CmdID: t.u.First.CmdID, Off: off, Data: data}
	if open {
		r = t.u.First
		r.Off, r.Data, r.Len, r.SHA = 0, data, t.total, t.sha
	}
	return r
}

// ChunkSize is the data bytes of one upload request (of the request that
// opens the upload when open): the most that keep the whole message,
// header and CBOR included, within maxReq bytes. When a message may take
// several writes of frag bytes it is rounded down to whole writes, so that
// no write goes out part-empty.
func (t *Transfer) ChunkSize(frag, maxReq int, open bool) (int, error) {
	overhead, err := t.overhead(open)
	if err != nil {
		return 0, err
	}
	n := chunkLimit(frag, maxReq) - overhead
	if n < 1 {
		return 0, tooLong(t.u.Group, t.u.ID, frag, maxReq,
			fmt.Sprintf("not sent: an upload request takes %d bytes besides its data, and the device takes %d at most (%s)",
				overhead, chunkLimit(frag, maxReq), requestLimit(frag, maxReq)))
	}
	return n, nil
}

// overhead is the bytes of an upload request (of the one that opens the
// upload when open) besides its data: SMP header, the other fields, and
// the data's head.
func (t *Transfer) overhead(open bool) (int, error) {
	body, err := EncodeBody(t.request(t.total, nil, open))
	if err != nil {
		return 0, err
	}
	// An empty byte string's head is one byte; up to 65535 bytes it is three.
	return HeaderSize + len(body) + 2, nil
}

// chunkLimit is the longest upload request: maxReq, rounded down to whole
// writes of frag bytes when a request may take several.
func chunkLimit(frag, maxReq int) int {
	if maxReq > frag {
		return maxReq / frag * frag
	}
	return maxReq
}

// eraseTime is how long, beyond the request timeout, the bridge gives a
// device to erase each sector of eraseSector bytes of its slot before it
// answers the request that opens an image upload. Zephyr's img_mgmt
// erases the whole len there, unless the firmware sets
// CONFIG_IMG_ERASE_PROGRESSIVELY (off by default): img_mgmt_upload calls
// img_mgmt_erase_image_data before it writes the first chunk. A 4 KiB
// sector of the NOR flash that holds image slots takes up to about 240 ms
// to erase, a page of nRF52 flash 85 ms, and more beside a busy radio.
const (
	eraseTime   = 250 * time.Millisecond
	eraseSector = 4096
)

type inflight struct {
	call *Call
	end  uint64
}

// maxStalls is how many times in a row a device may answer an upload's
// chunks with an offset other than the one they end at without the
// offset it holds getting past the highest it acknowledged before: a
// device that dropped a chunk (no buffer for it) holds a lower offset
// once, and the chunks sent again from there take it further. One whose
// offset never gets there (stuck, or going back each time) would be sent
// the same chunks again and again, as fast as it answers, until the
// command's timeout.
const maxStalls = 8

// errRestart: the device no longer holds the upload (it answered off 0
// to a later chunk: it rebooted, or another upload took its place).
var errRestart = errors.New("gatt: the device lost the upload")

// Run carries the upload over c as far as it can: it returns nil when the
// device has acknowledged every byte (and so checked the SHA-256), an
// *Error when the device refuses (a match of false among them), and
// ErrDisconnected (or the context's error) when it must be run again.
// window is the most chunks in flight.
func (t *Transfer) Run(ctx context.Context, c *Client, window int) error {
	t.attempts.Add(1)
	for restarts := 0; ; restarts++ {
		err := t.run(ctx, c, max(window, 1), restarts > 0)
		if !errors.Is(err, errRestart) || restarts == 3 {
			return err
		}
	}
}

func (t *Transfer) run(ctx context.Context, c *Client, window int, restarted bool) error {
	chunk, err := t.ChunkSize(c.Frag(), c.MaxRequest(), false)
	if err != nil {
		return err
	}
	// The request that opens the upload. A project group's has no data: the
	// device answers the offset it holds for this sha and command, 0 for a
	// new upload, where it stopped for one it has seen, len for one done.
	// img_mgmt's carries the first chunk, header included; the device
	// answers the offset it holds when it has an upload of this sha, and
	// starts anew (keeping the chunk) otherwise.
	data := []byte{}
	if t.u.Stock {
		n, err := t.ChunkSize(c.Frag(), c.MaxRequest(), true)
		if err != nil {
			return err
		}
		if n < mcuboot.HeaderSize && t.total >= mcuboot.HeaderSize {
			return tooLong(t.u.Group, t.u.ID, c.Frag(), c.MaxRequest(),
				fmt.Sprintf("not sent: the request at off 0 takes %d bytes besides its data, and its data must hold the %d-byte image header; the device takes %d at most (%s)",
					chunkLimit(c.Frag(), c.MaxRequest())-n, mcuboot.HeaderSize, chunkLimit(c.Frag(), c.MaxRequest()), requestLimit(c.Frag(), c.MaxRequest())))
		}
		if t.attempts.Load() > 1 || restarted {
			// Resuming, most likely: the device keeps what it holds and
			// discards this request's data, so send only the header it
			// checks.
			n = mcuboot.HeaderSize
		}
		data = t.u.Data[:min(uint64(n), t.total)]
		t.dataSent.Add(int64(len(data)))
	}
	var rsp UploadResponse
	t.requests.Add(1)
	call, err := c.Start(ctx, OpWrite, t.u.Group, t.u.ID, t.request(0, data, true))
	if err != nil {
		return err
	}
	if t.u.Stock {
		// img_mgmt erases the slot for len before it answers: the
		// request timeout alone failed every update whose erase took
		// longer (docs/reliability.md, bug 259).
		call.extend(time.Duration((t.total+eraseSector-1)/eraseSector) * eraseTime)
	}
	if err := call.Wait(ctx, &rsp); err != nil {
		return err
	}
	if err := t.check(rsp); err != nil {
		return err
	}
	acked := rsp.Off
	t.progress(acked)

	next := acked
	best, stalls := acked, 0 // the highest offset acknowledged; answers since that did not pass it
	var queue []inflight
	abandon := func() {
		for _, f := range queue {
			f.call.Abandon()
		}
	}
	for acked < t.total {
		for len(queue) < window && next < t.total {
			n := min(uint64(chunk), t.total-next)
			call, err := c.Start(ctx, OpWrite, t.u.Group, t.u.ID, t.request(next, t.u.Data[next:next+n], false))
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
		if err := t.check(rsp); err != nil {
			abandon()
			return err
		}
		if rsp.Off != f.end {
			// The device holds another offset than this chunk's end: it
			// dropped a chunk it could not place. Let the rest of the window
			// drain (the device answers each with the offset it holds) and
			// go on from the last answer.
			for len(queue) > 0 {
				g := queue[0]
				queue = queue[1:]
				var r UploadResponse
				err := g.call.Wait(ctx, &r)
				if err == nil {
					err = t.check(r)
				}
				if err != nil {
					abandon()
					return err
				}
				rsp = r
			}
			queue = nil
			if t.u.Stock && rsp.Off == 0 {
				return errRestart
			}
			if stalls++; rsp.Off <= best && stalls >= maxStalls {
				return &Error{Group: t.u.Group, ID: t.u.ID, Code: CodeDeviceError,
					Reason: fmt.Sprintf("the device does not advance the upload: it answered %d times in a row with an offset other than its chunk's end, now %d, never past the %d of %d it had acknowledged",
						stalls, rsp.Off, best, t.total)}
			}
			next = rsp.Off
		}
		acked = rsp.Off
		if acked > best {
			best, stalls = acked, 0
		}
		t.progress(acked)
	}
	abandon()
	return nil
}

// check refuses an answer whose offset is past the end (the device's
// fault, not the payload's), and the answer that completes an upload with
// match false. Both answered rc 0: the error names its code, not an rc the
// device did not answer (docs/reliability.md, bug 209).
func (t *Transfer) check(rsp UploadResponse) error {
	if rsp.Off > t.total {
		return &Error{Group: t.u.Group, ID: t.u.ID, Code: CodeDeviceError,
			Reason: fmt.Sprintf("the device answered that it holds offset %d of an upload of %d bytes", rsp.Off, t.total)}
	}
	if rsp.Match != nil && !*rsp.Match {
		return &Error{Group: t.u.Group, ID: t.u.ID, Code: CodeChecksumMismatch,
			Reason: "the SHA-256 of what the device wrote does not match the upload's (match: false)"}
	}
	return nil
}

func (t *Transfer) progress(acked uint64) {
	for {
		cur := t.high.Load()
		if acked <= cur || t.high.CompareAndSwap(cur, acked) {
			break
		}
	}
	if t.u.Progress != nil {
		t.u.Progress(int(acked), int(t.total))
	}
}

// IsDisconnect reports whether err means the link went down, so the work is
// worth repeating over a new link.
func IsDisconnect(err error) bool { return errors.Is(err, ErrDisconnected) }
