package agent

import (
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"

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
	// Nothing is claimed before it is released.
	if r := s.claim("d"); r != nil {
		t.Fatalf("claim before release = %+v; want nothing", r)
	}
	// Released out of order, they run in the order of their ids.
	s.release(res[1].rec)
	s.release(res[0].rec)
	r := s.claim("d")
	if r == nil || r.Cmd.ID != a.ID {
		t.Fatalf("claim = %+v; want a", r)
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
	if r := s.claim("d"); r != nil {
		t.Fatalf("claim after the cancel = %+v; want nothing", r)
	}

	final := topics.Reply{CommandID: a.ID, State: companion.StateSucceeded, At: now}
	key := finishSync(t, s, r, final)
	res, err = s.accept([]topics.Command{a, b}, now)
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptDone || res[0].final.State != companion.StateSucceeded || res[1].outcome != acceptDone || res[1].final.State != companion.StateCanceled {
		t.Fatalf("repeat outcomes %+v; want done succeeded, done canceled", res)
	}

	items, err := s.outbox()
	if err != nil || len(items) != 1 || items[0].Reply.CommandID != a.ID || items[0].key != key {
		t.Fatalf("outbox = %+v, %v; want a's final reply under key %d", items, err, key)
	}
	deleted := make(chan error, 1)
	s.deleteOutbox(items[0].key, func(err error) { deleted <- err })
	if err := <-deleted; err != nil {
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

// finishSync finishes r and waits until it is on disk.
func finishSync(tb testing.TB, s *spool, r *record, final topics.Reply) uint64 {
	tb.Helper()
	type result struct {
		key uint64
		err error
	}
	ch := make(chan result, 1)
	s.finish(r, final, func(key uint64, err error) { ch <- result{key, err} })
	res := <-ch
	if res.err != nil {
		tb.Fatal(res.err)
	}
	return res.key
}

// After a restart the queues come back from the file, the first command of
// each perhaps running: a cancel leaves it alone, and it runs first.
func TestSpoolReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	a := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "a"})
	b := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "b"})
	c := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "c"})
	res, err := s.accept([]topics.Command{a, b, c}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec)
	finishSync(t, s, s.claim("d"), topics.Reply{CommandID: a.ID, State: companion.StateSucceeded, At: time.Now()})
	if err := s.close(); err != nil {
		t.Fatal(err)
	}

	s, err = openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	res, err = s.accept([]topics.Command{
		testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: b.ID}),
		testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: c.ID}),
	}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptCancelNoop || res[1].outcome != acceptCanceled {
		t.Fatalf("cancel outcomes after reopen %+v; want noop (perhaps running), canceled", res)
	}
	if r := s.claim("d"); r == nil || r.Cmd.ID != b.ID {
		t.Fatalf("first claim after reopen = %+v; want b", r)
	}
	if r := s.claim("d"); r != nil {
		t.Fatalf("second claim after reopen = %+v; want nothing", r)
	}
}

// A cancel in the batch that brought its command takes it off before it
// is ever released.
func TestSpoolCancelInSameBatch(t *testing.T) {
	s := openTestSpool(t)
	c := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "never"})
	cancel := testCommand(t, "d", topics.OpCancel, topics.Cancel{CommandID: c.ID})
	res, err := s.accept([]topics.Command{c, cancel}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if res[0].outcome != acceptKnown || res[0].rec != nil || res[1].outcome != acceptCanceled {
		t.Fatalf("outcomes %+v; want the command dropped and the cancel done", res)
	}
	if st, _ := s.seen(c.ID); st != spoolDone {
		t.Fatalf("command is %q; want done", st)
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
	if res[1].outcome != acceptDone || res[1].final.State != companion.StateCanceled {
		t.Fatalf("command after its cancel: %+v; want dropped as canceled", res[1])
	}
}

// A spool of an earlier version, with a queue bucket per device, opens
// with the same commands queued in the same order.
func TestSpoolMigratesPerDeviceQueues(t *testing.T) {
	dir := t.TempDir()
	a := testCommand(t, "d1", topics.OpPushText, topics.PushText{Text: "a"})
	b := testCommand(t, "d1", topics.OpPushText, topics.PushText{Text: "b"})
	c := testCommand(t, "d2", topics.OpPushText, topics.PushText{Text: "c"})
	db, err := bolt.Open(filepath.Join(dir, "spool.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		cmds, err := tx.CreateBucket(bucketCommands)
		if err != nil {
			return err
		}
		queues, err := tx.CreateBucket(bucketOldQueues)
		if err != nil {
			return err
		}
		for _, cmd := range []topics.Command{a, b, c} {
			q, err := queues.CreateBucketIfNotExists([]byte(cmd.DeviceID))
			if err != nil {
				return err
			}
			seq, _ := q.NextSequence()
			if err := q.Put(queueKey(cmd.ID, seq), []byte(cmd.ID)); err != nil {
				return err
			}
			v, _ := json.Marshal(record{Cmd: cmd, Seq: seq, State: spoolQueued})
			if err := cmds.Put([]byte(cmd.ID), v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	db.Close()

	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	for _, want := range []topics.Command{a, b} {
		if r := s.claim("d1"); r == nil || r.Cmd.ID != want.ID {
			t.Fatalf("claim(d1) = %+v; want %s", r, want.Payload)
		}
	}
	if r := s.claim("d2"); r == nil || r.Cmd.ID != c.ID {
		t.Fatalf("claim(d2) = %+v; want c", r)
	}
	s.db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketOldQueues) != nil {
			t.Errorf("the old queues bucket is still there")
		}
		if n := tx.Bucket(bucketQueue).Stats().KeyN; n != 3 {
			t.Errorf("queue holds %d commands; want 3", n)
		}
		return nil
	})
}
