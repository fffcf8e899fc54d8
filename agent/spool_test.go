package agent

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/devicecompanion/companion/topics"
)

func testCommand(tb testing.TB, deviceID, op string, payload any) topics.Command {
	tb.Helper()
	b, err := json.Marshal(payload)
	if err != nil {
		tb.Fatal(err)
	}
	return topics.Command{ID: uuid.Must(uuid.NewV7()).String(), Op: op, DeviceID: deviceID, Payload: b}
}

func openTestSpool(tb testing.TB) *spool {
	tb.Helper()
	s, err := openSpool(tb.TempDir())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.close() })
	return s
}

func TestSpoolLifecycle(t *testing.T) {
	s := openTestSpool(t)
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	a := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "a"})
	b := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "b"})

	res, err := s.accept([]topics.Command{a, b, a}, now)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptQueued || res[1].outcome != acceptQueued || res[2].outcome != acceptKnown {
		t.Fatalf("accept outcomes %+v; want queued, queued, known", res)
	}
	// Nothing is claimed beyond what was released.
	if r, err := s.claim("d", 0); err != nil || r != nil {
		t.Fatalf("claim(upTo 0) = %v, %v; want nothing", r, err)
	}
	r, err := s.claim("d", res[1].seq)
	if err != nil || r == nil || r.Cmd.ID != a.ID || r.State != spoolRunning {
		t.Fatalf("claim = %+v, %v; want a, running", r, err)
	}
	// A cancel of a running command does nothing; of a queued one takes it off.
	cancelA := testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: a.ID})
	cancelB := testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: b.ID})
	res, err = s.accept([]topics.Command{cancelA, cancelB}, now)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptCancelNoop || res[1].outcome != acceptCanceled {
		t.Fatalf("cancel outcomes %+v; want noop, canceled", res)
	}

	final := topics.Reply{CommandID: a.ID, State: topics.StateSucceeded, At: now}
	if err := s.finish(r, final); err != nil {
		t.Fatal(err)
	}
	if r, err := s.claim("d", 100); err != nil || r != nil {
		t.Fatalf("claim after finish = %+v, %v; want an empty queue", r, err)
	}
	res, err = s.accept([]topics.Command{a, b}, now)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptDone || res[0].final.State != topics.StateSucceeded || res[1].outcome != acceptDone || res[1].final.State != topics.StateCanceled {
		t.Fatalf("repeat outcomes %+v; want done succeeded, done canceled", res)
	}

	items, err := s.outbox()
	if err != nil || len(items) != 1 || items[0].Reply.CommandID != a.ID {
		t.Fatalf("outbox = %+v, %v; want a's final reply", items, err)
	}
	if err := s.deleteOutbox(items[0].key); err != nil {
		t.Fatal(err)
	}
	if items, _ := s.outbox(); len(items) != 0 {
		t.Fatalf("outbox after delete has %d items", len(items))
	}

	// Done ids are kept for DoneRetention, then forgotten.
	if n, err := s.purge(now.Add(-DoneRetention)); err != nil || n != 0 {
		t.Fatalf("early purge = %d, %v; want 0", n, err)
	}
	if n, err := s.purge(now.Add(time.Second)); err != nil || n != 2 {
		t.Fatalf("purge = %d, %v; want 2", n, err)
	}
	if st, _ := s.seen(a.ID); st != "" {
		t.Errorf("a still known as %q after purge", st)
	}
}

func TestSpoolCancelBeforeCommand(t *testing.T) {
	s := openTestSpool(t)
	c := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "late"})
	cancel := testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: c.ID})
	res, err := s.accept([]topics.Command{cancel, c}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if res[1].outcome != acceptDone || res[1].final.State != topics.StateCanceled {
		t.Fatalf("command after its cancel: %+v; want dropped as canceled", res[1])
	}
}
