package sse

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
)

// readAll reads every event and comment of stream, each as a line of
// text: "TYPE ID DATA" (data quoted) or "#COMMENT".
func readAll(t *testing.T, stream string) ([]string, *Reader) {
	t.Helper()
	var out []string
	r := NewReader(strings.NewReader(stream))
	r.OnComment = func(c string) { out = append(out, "#"+c) }
	for {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out, r
		}
		if err != nil {
			t.Fatalf("Next: %v", err)
		}
		out = append(out, fmt.Sprintf("%s %s %q", ev.Type, ev.ID, ev.Data))
	}
}

func TestReader(t *testing.T) {
	tests := []struct {
		name, stream string
		want         []string
	}{
		{"one event", "id: 1\nevent: command\ndata: {\"a\":1}\n\n", []string{`command 1 "{\"a\":1}"`}},
		{"multi-line data", "data: one\ndata:two\ndata\ndata:  four\n\n", []string{"message  \"one\\ntwo\\n\\n four\""}},
		{"CRLF and CR line ends", "id: 1\r\ndata: a\r\n\r\nid: 2\rdata: b\r\r", []string{`message 1 "a"`, `message 2 "b"`}},
		{"a byte order mark first", "\uFEFFdata: x\n\n", []string{`message  "x"`}},
		{"comments", ": ping\n:raw\ndata: x\n\n", []string{"#ping", "#raw", `message  "x"`}},
		{"the id is kept for the next event", "id: 7\ndata: a\n\ndata: b\n\n", []string{`message 7 "a"`, `message 7 "b"`}},
		{"an empty id clears it", "id: 7\ndata: a\n\nid\ndata: b\n\n", []string{`message 7 "a"`, `message  "b"`}},
		{"an id with NUL is ignored", "id: 7\ndata: a\n\nid: 8\x009\ndata: b\n\n", []string{`message 7 "a"`, `message 7 "b"`}},
		{"no data: nothing dispatched, the type is reset", "event: x\n\ndata: y\n\n", []string{`message  "y"`}},
		{"an empty data line is an event", "data\n\n", []string{`message  ""`}},
		{"unknown fields are ignored", "foo: bar\ndata: y\nEvent: z\n\n", []string{`message  "y"`}},
		{"an unfinished event is discarded", "data: a\n\ndata: b\n", []string{`message  "a"`}},
		{"an unfinished line is discarded", "data: a\n\ndata: b", []string{`message  "a"`}},
		{"retry alone is no event", "retry: 2000\n\n", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _ := readAll(t, tt.stream)
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("events of %q = %q; want %q", tt.stream, got, tt.want)
			}
		})
	}
}

func TestReaderRetryAndLastEventID(t *testing.T) {
	tests := []struct {
		stream string
		retry  time.Duration
		lastID string
	}{
		{"retry: 2000\n\n", 2 * time.Second, ""},
		{"retry: 2000\nretry: 1.5\nretry: -1\nretry: 20x\nretry:\n\n", 2 * time.Second, ""},
		{"retry: 99999999999999999999\n\n", 0, ""},
		{"id: 5\n\n", 0, "5"}, // an id without data sets the last id all the same
		{"id: 5\ndata: a\n\nid: 6\ndata: b\n", 0, "6"},
	}
	for _, tt := range tests {
		_, r := readAll(t, tt.stream)
		if r.Retry() != tt.retry || r.LastEventID() != tt.lastID {
			t.Errorf("stream %q: Retry() = %v, LastEventID() = %q; want %v, %q", tt.stream, r.Retry(), r.LastEventID(), tt.retry, tt.lastID)
		}
	}
}

// A live stream's event that ends with CR is dispatched without waiting
// for the next byte, and a LF after it is not an empty line.
func TestReaderLiveCR(t *testing.T) {
	pr, pw := io.Pipe()
	r := NewReader(pr)
	got := make(chan Event)
	errc := make(chan error, 1)
	go func() {
		for {
			ev, err := r.Next()
			if err != nil {
				errc <- err
				return
			}
			got <- ev
		}
	}()
	write := func(s string) {
		t.Helper()
		if _, err := io.WriteString(pw, s); err != nil {
			t.Fatal(err)
		}
	}
	write("data: a\r\r")
	select {
	case ev := <-got:
		if ev.Data != "a" {
			t.Errorf("Data = %q; want %q", ev.Data, "a")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("an event ended by CR waited for more bytes")
	}
	write("\ndata: b\r\n\r\n")
	select {
	case ev := <-got:
		if ev.Data != "b" {
			t.Errorf("Data = %q; want %q", ev.Data, "b")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no second event")
	}
	pw.Close()
	if err := <-errc; !errors.Is(err, io.EOF) {
		t.Errorf("Next at the end = %v; want io.EOF", err)
	}
}

func TestReaderLineTooLong(t *testing.T) {
	r := NewReader(strings.NewReader("data: " + strings.Repeat("x", MaxLine) + "\n\n"))
	if _, err := r.Next(); err == nil || errors.Is(err, io.EOF) {
		t.Errorf("Next of a line over MaxLine = %v; want an error", err)
	}
}

func ExampleReader() {
	stream := "retry: 2000\n\n" +
		"id: 0000000000000001\nevent: command\ndata: {\"state\":\"queued\"}\n\n" +
		": ping\n\n" +
		"id: 0000000000000002\nevent: command\ndata: {\"state\":\"succeeded\"}\n\n"
	r := NewReader(strings.NewReader(stream))
	for {
		ev, err := r.Next()
		if err != nil {
			break
		}
		fmt.Println(ev.ID, ev.Type, ev.Data)
	}
	fmt.Println("reconnect after", r.Retry(), "with Last-Event-ID", r.LastEventID())
	// Output:
	// 0000000000000001 command {"state":"queued"}
	// 0000000000000002 command {"state":"succeeded"}
	// reconnect after 2s with Last-Event-ID 0000000000000002
}
