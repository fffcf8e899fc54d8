package agent

import (
	"encoding/json"
	"path/filepath"
	"strings"
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
	if r := s.claimNow("d"); r != nil {
		t.Fatalf("claim before release = %+v; want nothing", r)
	}
	// Released out of order, they run in the order of their ids.
	s.release(res[1].rec)
	s.release(res[0].rec)
	r := s.claimNow("d")
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
	if r := s.claimNow("d"); r != nil {
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
// (TestSpoolMarksRunningAhead: which commands come back perhaps running.)
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
	finishSync(t, s, s.claimNow("d"), topics.Reply{CommandID: a.ID, State: companion.StateSucceeded, At: time.Now()})
	if err := s.close(); err != nil {
		t.Fatal(err)
	}

	s = reopenAndCancel(t, dir, b, c)
	defer s.close()
	if r := s.claimNow("d"); r == nil || r.Cmd.ID != b.ID {
		t.Fatalf("first claim after reopen = %+v; want b", r)
	}
	if r := s.claimNow("d"); r != nil {
		t.Fatalf("second claim after reopen = %+v; want nothing", r)
	}
}

// A command is on disk as running before it can reach its device: the
// first of a device's line as it is accepted, the next spoolLookahead in
// the transaction that finishes the one before, any other when it starts.
// After a restart exactly those may have run: they run whatever their TTL
// and a cancel leaves them alone; the others are queued as before.
func TestSpoolMarksRunningAhead(t *testing.T) {
	dir := t.TempDir()
	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	var cmds []topics.Command
	for _, text := range []string{"a", "b", "c", "d", "e"} {
		cmds = append(cmds, testCommand(t, "d", topics.OpPushText, topics.PushText{Text: text}))
	}
	a, b, c, d, e := cmds[0], cmds[1], cmds[2], cmds[3], cmds[4]
	wantStates := func(when string, want map[string]string) {
		t.Helper()
		for _, cmd := range cmds {
			if st, err := s.seen(cmd.ID); err != nil || st != want[cmd.ID] {
				t.Errorf("%s: %s is %q, %v; want %q", when, cmd.Payload, st, err, want[cmd.ID])
			}
		}
	}

	res, err := s.accept(cmds[:4], time.Now())
	if err != nil {
		t.Fatal(err)
	}
	wantStates("accepted", map[string]string{a.ID: spoolRunning, b.ID: spoolQueued, c.ID: spoolQueued, d.ID: spoolQueued})
	for _, r := range res {
		s.release(r.rec)
	}
	r := s.claimNow("d")
	if err := s.start(r); err != nil {
		t.Fatal(err)
	}
	finishSync(t, s, r, topics.Reply{CommandID: a.ID, State: companion.StateSucceeded, At: time.Now()})
	wantStates("a finished", map[string]string{a.ID: spoolDone, b.ID: spoolRunning, c.ID: spoolRunning, d.ID: spoolQueued})

	// b starts without a write of its own; e arrives behind d.
	commits := s.w.Stats().Commits
	if r = s.claimNow("d"); r == nil || r.Cmd.ID != b.ID {
		t.Fatalf("claim = %+v; want b", r)
	}
	if err := s.start(r); err != nil {
		t.Fatal(err)
	}
	if n := s.w.Stats().Commits - commits; n != 0 {
		t.Errorf("starting b, marked ahead, took %d commits; want 0", n)
	}
	res, err = s.accept(cmds[4:], time.Now())
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec)
	wantStates("b started", map[string]string{a.ID: spoolDone, b.ID: spoolRunning, c.ID: spoolRunning, d.ID: spoolQueued, e.ID: spoolQueued})
	if err := s.close(); err != nil { // and b's final reply never reached the file
		t.Fatal(err)
	}

	s = reopenAndCancel(t, dir, c, d)
	defer s.close()
	for _, want := range []struct {
		cmd     topics.Command
		resumed bool
	}{{b, true}, {c, true}, {e, false}} {
		r := s.claimNow("d")
		if r == nil || r.Cmd.ID != want.cmd.ID || r.resumed != want.resumed {
			t.Fatalf("claim after reopen = %+v; want %s resumed %v", r, want.cmd.Payload, want.resumed)
		}
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
		if r := s.claimNow("d1"); r == nil || r.Cmd.ID != want.ID {
			t.Fatalf("claim(d1) = %+v; want %s", r, want.Payload)
		}
	}
	if r := s.claimNow("d2"); r == nil || r.Cmd.ID != c.ID {
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

// reopenAndCancel opens the spool in dir again and sends it cancels of
// running and of queued, in one batch: the first must be left alone (it
// may have been running at the restart), the second taken off its queue.
func reopenAndCancel(t *testing.T, dir string, running, queued topics.Command) *spool {
	t.Helper()
	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	res, err := s.accept([]topics.Command{
		testCommand(t, running.DeviceID, topics.OpCancel, topics.Cancel{CommandID: running.ID}),
		testCommand(t, queued.DeviceID, topics.OpCancel, topics.Cancel{CommandID: queued.ID}),
	}, time.Now())
	if err != nil {
		s.close()
		t.Fatal(err)
	}
	if res[0].outcome != acceptCancelNoop || res[1].outcome != acceptCanceled {
		s.close()
		t.Fatalf("cancel outcomes after reopen %+v; want noop (perhaps running), canceled", res)
	}
	return s
}

// lowerPurgeChunk sets purgeChunk to n for the test.
func lowerPurgeChunk(tb testing.TB, n int) {
	tb.Helper()
	old := purgeChunk
	purgeChunk = n
	tb.Cleanup(func() { purgeChunk = old })
}

// putDone writes the record of a command of device d finished at doneAt,
// as finish does, its final reply in the outbox when owed; it returns
// the command's id and the outbox key (0 when not owed).
func putDone(tb testing.TB, s *spool, doneAt time.Time, owed bool) (id string, key uint64) {
	tb.Helper()
	c := testCommand(tb, "d", topics.OpPushText, topics.PushText{Text: "x"})
	err := s.db.Update(func(tx *bolt.Tx) error {
		final := &topics.Reply{CommandID: c.ID, State: companion.StateSucceeded, At: doneAt}
		r := &record{Cmd: topics.Command{ID: c.ID, DeviceID: c.DeviceID}, State: spoolDone, Final: final, DoneAt: doneAt}
		if err := putRecord(tx, r); err != nil {
			return err
		}
		if !owed {
			return nil
		}
		var err error
		key, err = putOutbox(tx, c.ID)
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	return c.ID, key
}

// purge reads and deletes in chunks, across more records than one chunk
// holds: it forgets exactly the commands done before the cutoff whose
// final reply is not owed, counts them, keeps the others (done later,
// queued, running, and done before the cutoff with the reply still in the
// outbox: the server sends those again), and forgets the outbox entries of
// records gone (left by earlier versions), but no other.
func TestSpoolPurgeInChunks(t *testing.T) {
	lowerPurgeChunk(t, 7)
	s := openTestSpool(t)
	cutoff := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	want := map[string]string{} // id → its state after the purge, "" when forgotten
	var oldIDs int
	keptKeys := map[uint64]bool{}
	for i := range 45 {
		switch i % 3 {
		case 0:
			id, key := putDone(t, s, cutoff.Add(-time.Hour), i%2 == 0)
			if key != 0 {
				want[id] = spoolDone // its reply is owed
				keptKeys[key] = true
				continue
			}
			want[id] = ""
			oldIDs++
		case 1:
			id, key := putDone(t, s, cutoff.Add(time.Hour), i%2 == 0)
			want[id] = spoolDone
			if key != 0 {
				keptKeys[key] = true
			}
		case 2:
			c := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "waits"})
			res, err := s.accept([]topics.Command{c}, cutoff.Add(-48*time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			want[c.ID] = res[0].rec.State // the first running, the rest queued
		}
	}
	// An outbox entry of an earlier version holds its reply: no orphan.
	// One whose record an earlier version purged is.
	var jsonKey uint64
	err := s.db.Update(func(tx *bolt.Tx) error {
		var err error
		if jsonKey, err = tx.Bucket(bucketOutbox).NextSequence(); err != nil {
			return err
		}
		if err := tx.Bucket(bucketOutbox).Put(u64(jsonKey), []byte(`{"device_id":"d","reply":{"command_id":"x","state":"succeeded"}}`)); err != nil {
			return err
		}
		_, err = putOutbox(tx, "0190a5c2-0000-7000-8000-000000000000")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	keptKeys[jsonKey] = true

	chunks := 1
	s.afterChunk = func() { chunks++ }
	n, err := s.purge(cutoff)
	if err != nil || n != oldIDs {
		t.Fatalf("purge = %d, %v; want %d", n, err, oldIDs)
	}
	if wantChunks := (len(want) + purgeChunk - 1) / purgeChunk; chunks != wantChunks {
		t.Errorf("purge read %d chunks of %d records; want %d", chunks, len(want), wantChunks)
	}
	for id, st := range want {
		if got, err := s.seen(id); err != nil || got != st {
			t.Errorf("after the purge %s is %q, %v; want %q", id, got, err, st)
		}
	}
	items, err := s.outbox()
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint64]bool{}
	for _, it := range items {
		got[it.key] = true
	}
	err = s.db.View(func(tx *bolt.Tx) error {
		if n := tx.Bucket(bucketOutbox).Stats().KeyN; n != len(keptKeys) {
			t.Errorf("outbox holds %d entries after the purge; want %d", n, len(keptKeys))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for k := range keptKeys {
		if !got[k] {
			t.Errorf("outbox entry %d forgotten; its record is kept", k)
		}
	}
	if n, err := s.purge(cutoff); err != nil || n != 0 {
		t.Errorf("second purge = %d, %v; want 0", n, err)
	}
}

// The spool's writes go on while a purge of many records runs: between two
// of its chunks a status is kept and a command accepted, and each commits
// before the purge reads on. (The purge in one write transaction held every
// write until it had read and deleted all the records.)
func TestSpoolWritesGoOnDuringPurge(t *testing.T) {
	lowerPurgeChunk(t, 10)
	s := openTestSpool(t)
	cutoff := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	const old = 100
	for range old {
		putDone(t, s, cutoff.Add(-time.Hour), false)
	}

	// A write the purge holds up never commits while the hook waits: the
	// bound only keeps the test from hanging on such a deadlock.
	const deadlock = 15 * time.Second
	var hooks, stuck int
	s.afterChunk = func() {
		hooks++
		if stuck > 0 {
			return // one write held up is enough to know
		}
		battery := hooks
		kept := make(chan error, 1)
		s.keepStatus("d", topics.Status{Online: true, Battery: &battery}, func(err error) { kept <- err })
		accepted := make(chan error, 1)
		c := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "during the purge"})
		go func() {
			_, err := s.accept([]topics.Command{c}, cutoff)
			accepted <- err
		}()
		for _, ch := range []chan error{kept, accepted} {
			select {
			case err := <-ch:
				if err != nil {
					t.Errorf("write during the purge: %v", err)
				}
			case <-time.After(deadlock):
				stuck++
				t.Errorf("a write between the purge's chunks did not commit before the purge went on")
				return
			}
		}
		if st, err := s.lastStatus("d"); err != nil || st == nil || st.Battery == nil || *st.Battery != battery {
			t.Errorf("status kept during the purge reads %+v, %v; want battery %d", st, err, battery)
		}
		if st, err := s.seen(c.ID); err != nil || st == "" {
			t.Errorf("command accepted during the purge is %q, %v; want it spooled", st, err)
		}
	}
	n, err := s.purge(cutoff)
	if err != nil || n != old {
		t.Fatalf("purge = %d, %v; want %d", n, err, old)
	}
	if hooks == 0 {
		t.Fatal("no write ran between the purge's chunks")
	}
}

// A second bridge on the same data directory is told that another process
// holds the spool, not a bare "timeout".
func TestSpoolHeldByAnotherProcess(t *testing.T) {
	old := spoolLockWait
	spoolLockWait = 100 * time.Millisecond
	t.Cleanup(func() { spoolLockWait = old })
	dir := t.TempDir()
	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	_, err = openSpool(dir)
	if err == nil || !strings.Contains(err.Error(), "another process holds it") {
		t.Fatalf("second openSpool = %v; want it to say another process holds the file", err)
	}
}

// A command that names one it runs after which the spool has not seen
// waits for it, and is not marked running meanwhile (a cancel still takes
// it off, and a restart does not take it for one that may have run); it
// waits again after a restart, and stops waiting once the other arrives
// or when the wait is over. One that names a command the spool had, or
// one of the same batch, does not wait.
func TestSpoolWaitsForTheCommandBefore(t *testing.T) {
	dir := t.TempDir()
	s, err := openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	first := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "first"})
	second := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "second"})
	second.After = first.ID
	third := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "third"})
	third.After = second.ID
	now := time.Now()
	res, err := s.accept([]topics.Command{second, third}, now)
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec, res[1].rec)
	if r, wait := s.claim("d", now); r != nil || wait != s.afterWait {
		t.Fatalf("claim = %+v, %v; want nothing, and a wait of %v", r, wait, s.afterWait)
	}
	if state, _ := s.seen(second.ID); state != spoolQueued {
		t.Fatalf("a waiting command is %q on disk; want %q", state, spoolQueued)
	}
	if err := s.close(); err != nil {
		t.Fatal(err)
	}

	s, err = openSpool(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	if r, wait := s.claim("d", now); r != nil || wait <= 0 {
		t.Fatalf("claim after a restart = %+v, %v; want nothing, and a wait", r, wait)
	}
	// It never started: not taken for one that may have run (which would
	// run past its TTL), and a cancel still takes it off.
	if r := s.queues["d"][0]; r.Cmd.ID != second.ID || r.resumed || s.running[second.ID] {
		t.Fatalf("after a restart the waiting command is %+v, running %v; want it not resumed", r, s.running[second.ID])
	}
	res, err = s.accept([]topics.Command{first}, now)
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec)
	for _, want := range []topics.Command{first, second, third} {
		r, _ := s.claim("d", now)
		if r == nil || r.Cmd.ID != want.ID || r.gaveUp {
			t.Fatalf("claim = %+v; want %s, not given up", r, want.ID)
		}
		finishSync(t, s, r, topics.Reply{CommandID: r.Cmd.ID, State: companion.StateSucceeded, At: now})
	}

	// Its predecessor finished long ago, or comes in the same batch: no wait.
	fourth := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "fourth"})
	fourth.After = third.ID
	sixth := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "sixth"})
	fifth := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "fifth"})
	sixth.ID, fifth.ID = fifth.ID, sixth.ID // fifth's id is the smaller
	sixth.After = fifth.ID
	res, err = s.accept([]topics.Command{fourth, sixth, fifth}, now)
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec, res[1].rec, res[2].rec)
	for _, want := range []topics.Command{fourth, fifth, sixth} {
		r, wait := s.claim("d", now)
		if r == nil || r.Cmd.ID != want.ID || r.gaveUp || wait != 0 {
			t.Fatalf("claim = %+v, %v; want %s at once", r, wait, want.ID)
		}
		finishSync(t, s, r, topics.Reply{CommandID: r.Cmd.ID, State: companion.StateSucceeded, At: now})
	}

	// Never coming: it runs once the wait is over, given up.
	missing := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "missing"})
	orphan := testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "orphan"})
	orphan.After = missing.ID
	res, err = s.accept([]topics.Command{orphan}, now)
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec)
	if r, _ := s.claim("d", now); r != nil {
		t.Fatalf("claim = %+v; want it to wait", r)
	}
	if r, _ := s.claim("d", now.Add(s.afterWait)); r == nil || r.Cmd.ID != orphan.ID || !r.gaveUp {
		t.Fatalf("claim once the wait is over = %+v; want the orphan, given up", r)
	}
}

// chainedPair returns two commands of device "d", the second naming the
// first as the one it runs after.
func chainedPair(t *testing.T) (first, second topics.Command) {
	t.Helper()
	first = testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "first"})
	second = testCommand(t, "d", topics.OpPushText, topics.PushText{Text: "second"})
	second.After = first.ID
	return first, second
}

// A command whose predecessor came after it runs as soon as that one
// finishes, even when the predecessor's finish lands on disk between
// claim's read of the file and its look at memory (bug 103): the file
// then read running, memory no longer held it, and the command waited
// afterWait as if the predecessor had never come.
func TestSpoolRunsACommandWhosePredecessorFinishesDuringTheClaim(t *testing.T) {
	s := openTestSpool(t)
	first, second := chainedPair(t)
	now := time.Now()
	for _, c := range []topics.Command{second, first} { // the predecessor late
		res, err := s.accept([]topics.Command{c}, now)
		if err != nil {
			t.Fatal(err)
		}
		s.release(res[0].rec)
	}
	r, _ := s.claim("d", now)
	if r == nil || r.Cmd.ID != first.ID {
		t.Fatalf("claim = %+v; want the first", r)
	}
	s.afterClaimRead = func() {
		s.afterClaimRead = nil
		finishSync(t, s, r, topics.Reply{CommandID: first.ID, State: companion.StateSucceeded, At: now})
	}
	got, wait := s.claim("d", now)
	if got == nil || got.Cmd.ID != second.ID || got.gaveUp {
		t.Fatalf("claim as the first finishes = %+v, wait %v; want the second, at once", got, wait)
	}
}

// A command whose predecessor is on disk but not yet in its queue (accept
// commits a batch, then releases it into the queues) waits for it: taken
// for seen, it ran first, and its predecessor after it (bug 102).
func TestSpoolWaitsForACommandOnDiskNotYetQueued(t *testing.T) {
	s := openTestSpool(t)
	first, second := chainedPair(t)
	now := time.Now()
	res, err := s.accept([]topics.Command{second}, now)
	if err != nil {
		t.Fatal(err)
	}
	s.release(res[0].rec)
	if r, _ := s.claim("d", now); r != nil {
		t.Fatalf("claim = %+v; want it to wait for the first", r)
	}
	res, err = s.accept([]topics.Command{first}, now) // committed, not yet released
	if err != nil {
		t.Fatal(err)
	}
	if r, wait := s.claim("d", now); r != nil || wait <= 0 {
		t.Fatalf("claim with the first on disk, not yet queued = %+v, %v; want nothing, and a wait", r, wait)
	}
	s.release(res[0].rec)
	for _, want := range []topics.Command{first, second} {
		r, _ := s.claim("d", now)
		if r == nil || r.Cmd.ID != want.ID || r.gaveUp {
			t.Fatalf("claim = %+v; want %s, not given up", r, want.ID)
		}
		finishSync(t, s, r, topics.Reply{CommandID: r.Cmd.ID, State: companion.StateSucceeded, At: now})
	}
}
