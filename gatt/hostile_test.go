package gatt

import (
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
		body, _ = EncodeBody(UploadResponse{Off: l.off(req)})
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
			c, err := NewClient(ctx, link, ClientOptions{RequestTimeout: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			tr := NewTransfer(Upload{Group: GroupPush, ID: CmdPushUpload, First: UploadRequest{CmdID: "c1"}, Data: make([]byte, 50_000)})
			start := time.Now()
			err = tr.Run(ctx, c, 3)
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
