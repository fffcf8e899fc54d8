package ssetest

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func TestStream(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Accept") != "text/event-stream" {
			http.Error(w, "not acceptable", http.StatusNotAcceptable)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte(": ping\n\nid: 1\nevent: command\ndata: {}\n\n"))
		w.(http.Flusher).Flush()
		<-release
		_, _ = w.Write([]byte("id: 2\ndata: two\n\n"))
	}))
	defer srv.Close()
	req, err := http.NewRequest("GET", srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := Open(t, srv.Client(), req)

	ev, err := s.Next(10 * time.Second)
	if err != nil || ev.ID != "1" || ev.Type != "command" || ev.Data != "{}" {
		t.Fatalf("Next() = %+v, %v; want event 1, the comment passed over", ev, err)
	}
	if ev, err := s.Next(50 * time.Millisecond); !errors.Is(err, ErrTimeout) {
		t.Fatalf("Next() = %+v, %v; want %v", ev, err, ErrTimeout)
	}
	close(release)
	ev, err = s.Next(10 * time.Second)
	if err != nil || ev.ID != "2" || ev.Type != "message" || ev.Data != "two" {
		t.Fatalf("Next() = %+v, %v; want message 2", ev, err)
	}
	if ev, err := s.Next(10 * time.Second); !errors.Is(err, ErrEnded) {
		t.Fatalf("Next() = %+v, %v; want %v", ev, err, ErrEnded)
	}
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed after the end")
	}
}

// A stream nobody reads does not keep Close waiting.
func TestStreamCloseUnread(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for {
			if _, err := w.Write([]byte(": ping\n\n")); err != nil {
				return
			}
		}
	}))
	defer srv.Close()
	req, err := http.NewRequest("GET", srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := Open(t, srv.Client(), req)
	for len(s.ch) < Buffer {
		time.Sleep(time.Millisecond) // until the reader is stuck on a full buffer
	}
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
}
