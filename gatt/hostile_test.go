package gatt

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// uploadLink is a device whose every answer to an upload request is the
// offset off gives it (from the request's own offset), and whose every
// other answer is an empty map.
type uploadLink struct {
	cannedLink
	requests atomic.Int64
	off      func(req UploadRequest) uint64
	match    func(req UploadRequest) *bool // when set, the answer's match
	order    sync.Mutex
	last     chan struct{} // closed once the last answer is out
}

func (l *uploadLink) Write(_ context.Context, _ string, data []byte, _ bool) error {
	h, err := ParseHeader(data)
	if err != nil {
		return err
	}
	var body []byte
	if h.ID == CmdPushUpload && h.Group == GroupPush {
		l.requests.Add(1)
		var req UploadRequest
		if err := DecodeBody(data[HeaderSize:], &req); err != nil {
			return err
		}
		rsp := UploadResponse{Off: l.off(req)}
		if l.match != nil {
			rsp.Match = l.match(req)
		}
		body, _ = EncodeBody(rsp)
	} else {
		body, _ = EncodeBody(struct{}{})
	}
	h.Op++
	h.Len = uint16(len(body))
	// In order, as a device answers: one goroutine per answer would not be.
	l.order.Lock()
	prev := l.last
	next := make(chan struct{})
	l.last = next
	l.order.Unlock()
	l.mu.Lock()
	notify := l.notify
	l.mu.Unlock()
	msg := append(AppendHeader(nil, h), body...)
	go func() {
		if prev != nil {
			<-prev
		}
		notify(msg)
		close(next)
	}()
	return nil
}

// A device that answers every chunk of an upload with an offset that never
// moves forward (stuck at 0, or going back) fails the upload with an
// error that says so, at once: it is not sent the same chunks again until
// the command's timeout, ten minutes of the link and the device's worker.
func TestUploadThatNeverAdvancesFails(t *testing.T) {
	for _, tt := range []struct {
		name string
		off  func(req UploadRequest) uint64
	}{
		{"stuck at 0", func(UploadRequest) uint64 { return 0 }},
		{"stuck at 100", func(UploadRequest) uint64 { return 100 }},
		{"going back", func(req UploadRequest) uint64 {
			if req.Len > 0 {
				return 1000 // the request that opens the upload
			}
			return 500
		}},
		{"back and forth", func(req UploadRequest) uint64 {
			if req.Off == 0 {
				return 0
			}
			return 1000 // the end of every chunk from 0, and of none after
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			link := &uploadLink{cannedLink: cannedLink{done: make(chan struct{})}, off: tt.off}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 2 * time.Second})
			tr := NewTransfer(Upload{Group: GroupPush, ID: CmdPushUpload, First: UploadRequest{CmdID: "c1"}, Data: make([]byte, 50_000)})
			start := time.Now()
			err := tr.Run(ctx, c, 3)
			var e *Error
			if !errors.As(err, &e) || !strings.Contains(e.Reason, "does not advance") {
				t.Fatalf("Run against a device whose offset never advances = %v after %v, %d requests; want an *Error saying so",
					err, time.Since(start), link.requests.Load())
			}
			if n := link.requests.Load(); n > 100 {
				t.Errorf("%d requests sent before giving up", n)
			}
		})
	}
}

// A device that answers an upload with an offset past its end, or that
// completes it with match false, answered rc 0: the upload fails with the
// code of what went wrong (the device's fault, or the bytes), and its
// message does not say the device answered an rc it did not. Before, the
// offset past the end failed the command invalid_payload, as if its
// payload were wrong, "device answered rc 3 (invalid)".
func TestUploadAnswersOfRCZeroThatFail(t *testing.T) {
	no := false
	for _, tt := range []struct {
		name  string
		off   func(req UploadRequest) uint64
		match func(req UploadRequest) *bool
		code  string
	}{
		{"offset past the end", func(UploadRequest) uint64 { return 60_000 }, nil, CodeDeviceError},
		{"match false", func(req UploadRequest) uint64 { return req.Off + uint64(len(req.Data)) },
			func(UploadRequest) *bool { return &no }, CodeChecksumMismatch},
	} {
		t.Run(tt.name, func(t *testing.T) {
			link := &uploadLink{cannedLink: cannedLink{done: make(chan struct{})}, off: tt.off, match: tt.match}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 2 * time.Second})
			tr := NewTransfer(Upload{Group: GroupPush, ID: CmdPushUpload, First: UploadRequest{CmdID: "c1"}, Data: make([]byte, 50_000)})
			err := tr.Run(ctx, c, 3)
			var e *Error
			if !errors.As(err, &e) || e.ErrorCode() != tt.code || strings.Contains(err.Error(), "answered rc") {
				t.Fatalf("Run = %v (code %q); want %s, without an rc the device did not answer", err, codeOf(e), tt.code)
			}
		})
	}
}

func codeOf(e *Error) string {
	if e == nil {
		return ""
	}
	return e.ErrorCode()
}

// FuzzTransferAnswers has a device answer an upload's requests with the
// offsets the fuzzer picks, over and over: whatever it answers, the upload
// ends on its own (an error, or done) well before its context, and it is
// done only when the device's last answer acknowledged every byte.
func FuzzTransferAnswers(f *testing.F) {
	const total = 3000
	f.Add([]byte{0, 0})
	f.Add([]byte{0x0b, 0xb8})             // 3000: done at once
	f.Add([]byte{0x01, 0x00, 0x00, 0x10}) // 256, then 16
	f.Add([]byte{0xff, 0xff})             // past the end
	f.Fuzz(func(t *testing.T, script []byte) {
		if len(script) < 2 {
			return
		}
		var (
			n    atomic.Int64
			last atomic.Uint64
		)
		link := &uploadLink{cannedLink: cannedLink{done: make(chan struct{})}, off: func(req UploadRequest) uint64 {
			i := int(n.Add(1)-1) % (len(script) / 2)
			off := uint64(script[2*i])<<8 | uint64(script[2*i+1])
			last.Store(off)
			return off
		}}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 2 * time.Second})
		tr := NewTransfer(Upload{Group: GroupPush, ID: CmdPushUpload, First: UploadRequest{CmdID: "c1"}, Data: make([]byte, total)})
		err := tr.Run(ctx, c, 3)
		switch {
		case ctx.Err() != nil:
			t.Fatalf("the upload ran until its context ended: %v, %d requests", err, n.Load())
		case err == nil && last.Load() != total:
			t.Fatalf("the upload is done, and the device's last answer was %d of %d", last.Load(), total)
		}
	})
}

// A device's answers built to hurt: a body nested 10,000 deep, a byte
// string claiming 1 GiB, a header whose length is shorter or longer than
// its body, 1,000 image slots and 2,000. Each is an error at once, not a
// wait for the request's timeout, and never a partial decode taken for an
// answer; the 1,000 slots, within the limits, decode.
func TestHostileAnswers(t *testing.T) {
	nested := append(bytes.Repeat([]byte{0x81}, 10_000), 0x00)
	huge := []byte{0xa1, 0x64, 'h', 'a', 's', 'h', 0x5a, 0x40, 0x00, 0x00, 0x00} // {"hash": h'…' of 1 GiB}
	slots := func(n int) []byte {
		b := []byte{0xa1, 0x66, 'i', 'm', 'a', 'g', 'e', 's', 0x99, byte(n >> 8), byte(n)}
		return append(b, bytes.Repeat([]byte{0xa0}, n)...)
	}
	for _, tt := range []struct {
		name   string
		answer func(h Header) [][]byte
		ok     bool
	}{
		{"nested 10,000 deep", func(h Header) [][]byte { return answer(h, nested, len(nested)) }, false},
		{"1 GiB byte string", func(h Header) [][]byte { return answer(h, huge, len(huge)) }, false},
		{"length shorter than the body", func(h Header) [][]byte { return answer(h, []byte{0xa1, 0x62, 'r', 'c', 0x00}, 2) }, false},
		{"length longer than the body", func(h Header) [][]byte { return answer(h, []byte{0xa0}, 100) }, false},
		{"1,000 slots", func(h Header) [][]byte { return answer(h, slots(1000), len(slots(1000))) }, true},
		{"2,000 slots", func(h Header) [][]byte { return answer(h, slots(2000), len(slots(2000))) }, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			link := &rawLink{cannedLink: cannedLink{done: make(chan struct{})}, raw: tt.answer}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c := cannedClient(t, ctx, link, ClientOptions{RequestTimeout: 5 * time.Second, FragmentTimeout: 200 * time.Millisecond})
			start := time.Now()
			var st ImageStateResponse
			err := c.Do(ctx, OpRead, GroupImage, CmdImageState, nil, &st)
			switch {
			case tt.ok && (err != nil || len(st.Images) != 1000):
				t.Errorf("image state = %d slots, %v; want 1000", len(st.Images), err)
			case !tt.ok && err == nil:
				t.Errorf("image state = %d slots, nil; want an error", len(st.Images))
			case !tt.ok && errors.Is(err, ErrTimeout):
				t.Errorf("image state = %v after %v; want the answer refused, not waited out", err, time.Since(start))
			}
		})
	}
}

// answer is the notifications of an answer to h with body, its header
// saying length n, in writes of 244 bytes.
func answer(h Header, body []byte, n int) [][]byte {
	h.Op++
	h.Len = uint16(n)
	msg := append(AppendHeader(nil, h), body...)
	var out [][]byte
	for off := 0; off < len(msg); off += 244 {
		out = append(out, msg[off:min(off+244, len(msg))])
	}
	return out
}
