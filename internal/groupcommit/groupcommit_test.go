package groupcommit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/devicecompanion/companion/internal/testenv"
)

func openDB(tb testing.TB) *bolt.DB {
	tb.Helper()
	db, err := bolt.Open(filepath.Join(tb.TempDir(), "db"), 0o600, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	if err := db.Update(func(tx *bolt.Tx) error { _, err := tx.CreateBucket([]byte("b")); return err }); err != nil {
		tb.Fatal(err)
	}
	return db
}

func put(k string) func(tx *bolt.Tx) error {
	return func(tx *bolt.Tx) error { return tx.Bucket([]byte("b")).Put([]byte(k), []byte(k)) }
}

func get(tb testing.TB, db *bolt.DB, k string) bool {
	tb.Helper()
	var ok bool
	db.View(func(tx *bolt.Tx) error { ok = tx.Bucket([]byte("b")).Get([]byte(k)) != nil; return nil })
	return ok
}

// Many concurrent writers share commits, and each is on disk when Do
// returns.
func TestDoGroupsWriters(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{})
	defer c.Close()
	const n = 200
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := string(rune('a'+i%26)) + string(rune(i))
			if err := c.Do(put(k)); err != nil {
				t.Errorf("Do(%q) = %v", k, err)
				return
			}
			if !get(t, db, k) {
				t.Errorf("%q not there after Do returned", k)
			}
		}()
	}
	wg.Wait()
	st := c.Stats()
	if st.Ops != n {
		t.Errorf("Stats().Ops = %d; want %d", st.Ops, n)
	}
	if st.Commits < 1 || st.Commits > n {
		t.Errorf("Stats().Commits = %d; want 1..%d", st.Commits, n)
	}
	t.Logf("%d writes in %d commits", st.Ops, st.Commits)
}

// A write that fails is rolled back alone: the others of its group commit.
func TestFailingWriteIsRolledBackAlone(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{})
	defer c.Close()
	boom := errors.New("boom")
	// Hold the committer so that the three writes share one group.
	release := holdCommitter(c)
	results := make(chan error, 3)
	c.Go(put("before"), func(err error) { results <- err })
	c.Go(func(tx *bolt.Tx) error {
		if err := put("bad")(tx); err != nil {
			return err
		}
		return boom
	}, func(err error) { results <- err })
	c.Go(put("after"), func(err error) { results <- err })
	release()
	for i, want := range []error{nil, boom, nil} {
		if err := <-results; !errors.Is(err, want) {
			t.Errorf("write %d: %v; want %v", i, err, want)
		}
	}
	if !get(t, db, "before") || !get(t, db, "after") || get(t, db, "bad") {
		t.Errorf("before %v, after %v, bad %v; want true, true, false", get(t, db, "before"), get(t, db, "after"), get(t, db, "bad"))
	}
}

// holdCommitter has c's committer run a write that waits until release is
// called: the writes queued meanwhile wait, and then share one group.
func holdCommitter(c *Committer) (release func()) {
	hold := make(chan struct{})
	started := make(chan struct{})
	c.Go(func(tx *bolt.Tx) error { close(started); <-hold; return nil }, nil)
	<-started
	return func() { close(hold) }
}

// Done callbacks run in the order the writes were queued.
func TestDoneInOrder(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{})
	var (
		mu  sync.Mutex
		got []int
	)
	for i := range 500 {
		c.Go(put(string(rune(i))), func(error) {
			mu.Lock()
			got = append(got, i)
			mu.Unlock()
		})
	}
	c.Close() // runs what is queued and every callback
	if len(got) != 500 {
		t.Fatalf("%d callbacks; want 500", len(got))
	}
	for i, v := range got {
		if v != i {
			t.Fatalf("callback %d was for write %d", i, v)
		}
	}
	if err := c.Do(put("late")); !errors.Is(err, ErrClosed) {
		t.Errorf("Do after Close = %v; want ErrClosed", err)
	}
}

// After a commit of several writes the committer lingers for company:
// writes queued meanwhile share one commit, which Close does not wait out.
// A lone write never lingers.
func TestLinger(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{Linger: time.Hour})
	// Lone writes, one after another: each commits at once.
	for _, k := range []string{"lone1", "lone2", "lone3"} {
		done := make(chan error, 1)
		go func() { done <- c.Do(put(k)) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("a lone write (%s) lingered", k)
		}
	}
	// Two writes queued while a third holds the transaction commit together.
	release := make(chan struct{})
	held := make(chan struct{})
	first := make(chan error, 1)
	c.Go(func(tx *bolt.Tx) error { close(held); <-release; return put("a")(tx) }, func(err error) { first <- err })
	<-held
	var pair sync.WaitGroup
	for _, k := range []string{"b", "c"} {
		pair.Add(1)
		c.Go(put(k), func(err error) {
			defer pair.Done()
			if err != nil {
				t.Errorf("%s: %v", k, err)
			}
		})
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	pair.Wait()
	before := c.Stats()
	if before.Commits != 5 || before.Ops != 6 {
		t.Fatalf("Stats() = %+v; want 5 commits of 6 writes", before)
	}
	// Now it lingers: these wait for company rather than commit. (Without
	// the linger the first would commit within microseconds.)
	for _, k := range []string{"d", "e", "f"} {
		c.Go(put(k), nil)
		time.Sleep(50 * time.Millisecond)
	}
	if got := c.Stats(); got != before {
		t.Fatalf("Stats() = %+v while lingering; want %+v", got, before)
	}
	closed := make(chan struct{})
	go func() { c.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close waited out the linger")
	}
	if got := c.Stats(); got.Commits != 6 || got.Ops != 9 {
		t.Errorf("Stats() after Close = %+v; want the three lingering writes in one more commit", got)
	}
	for _, k := range []string{"d", "e", "f"} {
		if !get(t, db, k) {
			t.Errorf("%s not committed by Close", k)
		}
	}
}

// Once the queue has run dry the committer is quiet again: a write that
// comes later, alone, commits without lingering, however busy the last
// commit was.
func TestQuietAfterLoadDoesNotLinger(t *testing.T) {
	const linger = 300 * time.Millisecond
	db := openDB(t)
	c := New(db, Options{Linger: linger})
	defer c.Close()
	commitSeveral(c)
	// The linger ends on an empty queue (perhaps twice: the pair left a
	// wake-up behind).
	time.Sleep(4 * linger)
	before := c.Stats()
	// x comes alone and commits at once; y, a moment later, commits on
	// its own. Had x lingered, y would have joined its commit.
	var xy sync.WaitGroup
	xy.Add(2)
	c.Go(put("x"), func(error) { xy.Done() })
	time.Sleep(linger / 3)
	c.Go(put("y"), func(error) { xy.Done() })
	xy.Wait()
	if got := c.Stats(); got.Commits-before.Commits != 2 || got.Ops-before.Ops != 2 {
		t.Errorf("Stats() went from %+v to %+v; want two commits of one write each", before, got)
	}
}

// commitSeveral has c commit a group of three writes (a, b, c), after which
// it lingers.
func commitSeveral(c *Committer) {
	release, held := make(chan struct{}), make(chan struct{})
	c.Go(func(tx *bolt.Tx) error { close(held); <-release; return put("a")(tx) }, nil)
	<-held
	var pair sync.WaitGroup
	pair.Add(2)
	c.Go(put("b"), func(error) { pair.Done() })
	c.Go(put("c"), func(error) { pair.Done() })
	close(release)
	pair.Wait()
}

// While the committer lingers, each write runs as it is queued, in the
// group's open transaction: a later write of the group sees an earlier
// one's, and one that fails is rolled back alone.
func TestWritesRunWhileLingering(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{Linger: time.Hour})
	commitSeveral(c)
	before := c.Stats()
	ran := make(chan struct{})
	errs := make(map[string]error)
	var mu sync.Mutex
	done := func(k string) func(error) {
		return func(err error) { mu.Lock(); errs[k] = err; mu.Unlock() }
	}
	boom := errors.New("boom")
	c.Go(put("d"), done("d"))
	c.Go(func(tx *bolt.Tx) error { put("e")(tx); return boom }, done("e"))
	c.Go(func(tx *bolt.Tx) error {
		defer close(ran)
		if tx.Bucket([]byte("b")).Get([]byte("d")) == nil {
			return errors.New("f does not see d")
		}
		return put("f")(tx)
	}, done("f"))
	select {
	case <-ran:
	case <-time.After(10 * time.Second):
		t.Fatal("a write queued while the committer lingers did not run until the linger ended")
	}
	if got := c.Stats(); got != before {
		t.Fatalf("Stats() = %+v while lingering; want %+v", got, before)
	}
	mu.Lock()
	early := len(errs)
	mu.Unlock()
	if early != 0 {
		t.Fatalf("%d writes reported done while lingering, before their commit", early)
	}
	c.Close()
	if got := c.Stats(); got.Commits != before.Commits+1 || got.Ops != before.Ops+2 {
		t.Errorf("Stats() after Close = %+v; want one more commit of d and f (before: %+v)", got, before)
	}
	mu.Lock()
	defer mu.Unlock()
	if errs["d"] != nil || errs["f"] != nil || !errors.Is(errs["e"], boom) {
		t.Errorf("outcomes d, e, f = %v, %v, %v; want nil, boom, nil", errs["d"], errs["e"], errs["f"])
	}
	for k, want := range map[string]bool{"d": true, "e": false, "f": true} {
		if get(t, db, k) != want {
			t.Errorf("%s on disk: %v, want %v", k, !want, want)
		}
	}
}

// Begin runs at the start of every transaction, before its writes.
func TestBeginRunsFirstInEveryTransaction(t *testing.T) {
	db := openDB(t)
	var begun atomic.Int64
	c := New(db, Options{Begin: func(tx *bolt.Tx) {
		begun.Add(1)
		tx.Bucket([]byte("b")).FillPercent = 0.9
	}})
	defer c.Close()
	for _, k := range []string{"p", "q", "r"} {
		err := c.Do(func(tx *bolt.Tx) error {
			if fp := tx.Bucket([]byte("b")).FillPercent; fp != 0.9 {
				t.Errorf("FillPercent = %v in a write; want Begin's 0.9", fp)
			}
			return put(k)(tx)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if n, commits := begun.Load(), c.Stats().Commits; n != commits {
		t.Errorf("Begin ran %d times for %d transactions", n, commits)
	}
}

// With Preallocate the file past bbolt's last page is written, not a
// hole, and stays so as bbolt grows, also when one transaction outgrows
// the zeros; the file reads back whole.
func TestPreallocateWritesAhead(t *testing.T) {
	const ahead = 2 << 20
	db := openDB(t)
	path := db.Path()
	c := New(db, Options{Preallocate: ahead})
	value := make([]byte, 4000)
	write := func(prefix string, n int) {
		t.Helper()
		err := c.Do(func(tx *bolt.Tx) error {
			for i := range n {
				if err := tx.Bucket([]byte("b")).Put(fmt.Appendf(nil, "%s-%06d", prefix, i), value); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// The written part past the pages in use: up to the first hole.
	written := func() (used, past int64) {
		t.Helper()
		if err := db.View(func(tx *bolt.Tx) error { used = tx.Size(); return nil }); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		hole, err := f.Seek(used, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		return used, hole - used
	}
	for i := range 4 { // a few commits: the fill goes a chunk at a time
		write(fmt.Sprintf("small%d", i), 10)
	}
	if used, past := written(); past < zeroFillChunk {
		t.Fatalf("%d bytes written past the %d in use; want at least %d", past, used, zeroFillChunk)
	}
	write("large", 2000) // about 8 MB in one transaction: past the zeros
	for i := range 4 {
		write(fmt.Sprintf("after%d", i), 10)
	}
	if used, past := written(); past < zeroFillChunk {
		t.Fatalf("after bbolt outgrew the zeros: %d bytes written past the %d in use; want at least %d", past, used, zeroFillChunk)
	}
	c.Close()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	err = db.View(func(tx *bolt.Tx) error {
		for err := range tx.Check() {
			return err
		}
		if n := tx.Bucket([]byte("b")).Stats().KeyN; n != 2080 {
			return fmt.Errorf("%d keys read back; want 2080", n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The zeros go a whole chunk at a time: commits that add a few pages each
// allocate no blocks until a chunk of the zeros is used up.
func TestZeroFillGoesByChunks(t *testing.T) {
	const ahead = 4 * zeroFillChunk
	path := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	z := newZeroFill(path, ahead)
	defer z.close()
	size := func() int64 {
		t.Helper()
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	for range 4 { // one chunk a transaction, up to ahead
		z.fill(0)
	}
	if got := size(); got != ahead {
		t.Fatalf("after four fills the file has %d bytes; want %d", got, ahead)
	}
	for used := int64(4096); used < zeroFillChunk; used += 4096 {
		z.fill(used)
		if got := size(); got != ahead {
			t.Fatalf("with %d bytes in use the file has %d; want still %d (no zeros until a chunk is used up)", used, got, ahead)
		}
	}
	z.fill(zeroFillChunk)
	if got := size(); got != ahead+zeroFillChunk {
		t.Fatalf("with a chunk in use the file has %d bytes; want %d", got, ahead+zeroFillChunk)
	}
}

// BenchmarkGrowingCommits measures commits that each append 16 values of
// 450 bytes to a growing file (as a group of accepted commands does), one
// after another, with and without zeros written ahead.
func BenchmarkGrowingCommits(b *testing.B) {
	for _, pre := range []int64{0, 4 << 20} {
		b.Run(fmt.Sprintf("preallocate=%d", pre), func(b *testing.B) {
			db := openDB(b)
			c := New(db, Options{Preallocate: pre})
			defer c.Close()
			value := make([]byte, 450)
			var seq uint64
			b.ResetTimer()
			for range b.N {
				err := c.Do(func(tx *bolt.Tx) error {
					bk := tx.Bucket([]byte("b"))
					bk.FillPercent = 0.9
					for range 16 {
						seq++
						if err := bk.Put(binary.BigEndian.AppendUint64(nil, seq), value); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A write whose fn panics fails alone, as one that returns an error does:
// the others of its group commit and hear so, the committer goes on, and
// Do panics in its caller (as bolt's Update does), not on the committer's
// goroutine, where the panic ended the process with every write waiting.
func TestPanickingWriteFailsAlone(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{})
	defer c.Close()
	release := holdCommitter(c)
	results := make(chan error, 3)
	c.Go(put("before"), func(err error) { results <- err })
	c.Go(func(tx *bolt.Tx) error {
		if err := put("bad")(tx); err != nil {
			return err
		}
		panic("boom")
	}, func(err error) { results <- err })
	c.Go(put("after"), func(err error) { results <- err })
	release()
	var pe *PanicError
	for i, check := range []func(error) bool{
		func(err error) bool { return err == nil },
		func(err error) bool { return errors.As(err, &pe) && pe.Value == "boom" },
		func(err error) bool { return err == nil },
	} {
		select {
		case err := <-results:
			if !check(err) {
				t.Errorf("write %d: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no outcome for write %d", i)
		}
	}
	if !get(t, db, "before") || !get(t, db, "after") || get(t, db, "bad") {
		t.Errorf("before %v, after %v, bad %v; want true, true, false", get(t, db, "before"), get(t, db, "after"), get(t, db, "bad"))
	}

	func() {
		defer func() {
			if p, ok := recover().(*PanicError); !ok || p.Value != "again" {
				t.Errorf("Do of a panicking write panicked with %v; want its *PanicError", p)
			}
		}()
		err := c.Do(func(tx *bolt.Tx) error { panic("again") })
		t.Errorf("Do of a panicking write returned %v; want a panic", err)
	}()
	if err := c.Do(put("later")); err != nil || !get(t, db, "later") {
		t.Errorf("Do after a panic = %v, on disk %v; want nil, true", err, get(t, db, "later"))
	}
}

// Close returns once what was queued before it has run and been answered,
// also for a Close called while another is under way: the caller closes
// the bbolt file next, which would fail the writes still waiting.
func TestEveryCloseWaitsForTheQueue(t *testing.T) {
	db := openDB(t)
	c := New(db, Options{})
	release := holdCommitter(c)
	var answered atomic.Bool
	c.Go(put("queued"), func(err error) {
		if err != nil {
			t.Errorf("queued write: %v", err)
		}
		answered.Store(true)
	})
	first := make(chan struct{})
	go func() { c.Close(); close(first) }()
	testenv.Eventually(t, 10*time.Second, "the first Close under way", func() bool {
		var closed atomic.Bool // answered at once only after Close
		c.Go(put("probe"), func(err error) { closed.Store(errors.Is(err, ErrClosed)) })
		return closed.Load()
	})
	second := make(chan bool)
	go func() { c.Close(); second <- answered.Load() }()
	var ok bool
	select {
	case ok = <-second:
		release()
	case <-time.After(200 * time.Millisecond): // it waits, as it should: let the writes go
		release()
		ok = <-second
	}
	<-first
	if !ok {
		t.Error("a second Close returned before the write queued before it was answered")
	}
}

// A commit the disk refuses (a file size limit of 0, as a full disk) fails
// every write of its group with a *CommitError, keeps none of them, and
// Err says so; once the disk takes writes the next group commits, and Err
// is nil again.
func TestFailedCommitFailsItsGroup(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openDB(t)
	c := New(db, Options{})
	defer c.Close()
	if err := c.Do(put("before")); err != nil {
		t.Fatal(err)
	}

	lift := testenv.LimitFileSize(t, 0)
	release := holdCommitter(c) // so that the three queue up and commit together
	errs := make(chan error, 3)
	for _, k := range []string{"a", "b", "c"} {
		c.Go(put(k), func(err error) { errs <- err })
	}
	release()
	for range 3 {
		var ce *CommitError
		if err := <-errs; !errors.As(err, &ce) {
			t.Errorf("a write of a refused commit = %v; want a *CommitError", err)
		}
	}
	if err := c.Err(); err == nil {
		t.Error("Err() = nil after a failed commit")
	}

	lift()
	if err := c.Do(put("after")); err != nil {
		t.Fatalf("Do once the disk takes writes = %v", err)
	}
	if err := c.Err(); err != nil {
		t.Errorf("Err() = %v after a commit succeeded", err)
	}
	for k, want := range map[string]bool{"before": true, "a": false, "b": false, "c": false, "after": true} {
		if got := get(t, db, k); got != want {
			t.Errorf("%s stored: %v; want %v", k, got, want)
		}
	}
}

// The zeros ahead resume once the disk takes writes again after a write
// of them failed (a file size limit of 0, as a full disk).
func TestZeroFillResumesAfterAFullDisk(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openDB(t)
	c := New(db, Options{Preallocate: 2 << 20})
	defer c.Close()
	lift := testenv.LimitFileSize(t, 0)
	var ce *CommitError
	if err := c.Do(put("full")); !errors.As(err, &ce) {
		t.Fatalf("Do(disk full) = %v; want a *CommitError", err)
	}
	lift()
	for i := range 4 {
		if err := c.Do(put(fmt.Sprint("after", i))); err != nil {
			t.Fatal(err)
		}
	}
	var used int64
	if err := db.View(func(tx *bolt.Tx) error { used = tx.Size(); return nil }); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	hole, err := f.Seek(used, unix.SEEK_HOLE)
	if err != nil {
		t.Fatal(err)
	}
	if past := hole - used; past < zeroFillChunk {
		t.Errorf("%d bytes written past the %d in use once the disk took writes again; want at least %d", past, used, zeroFillChunk)
	}
}

// After a commit failed for a lasting reason (Options.Lasting), the writes
// queued within RetryAfter fail with its *CommitError without running or
// a commit tried; the first after it is tried, and commits once the disk
// takes writes (bug 342).
func TestALastingFailureIsNotTriedAgainAtOnce(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openDB(t)
	c := New(db, Options{Lasting: func(error) bool { return true }, RetryAfter: time.Hour})
	defer c.Close()

	lift := testenv.LimitFileSize(t, 0)
	var ce *CommitError
	if err := c.Do(put("tried")); !errors.As(err, &ce) {
		t.Fatalf("Do(disk full) = %v; want a *CommitError", err)
	}
	ran := 0
	for range 50 {
		err := c.Do(func(tx *bolt.Tx) error { ran++; return tx.Bucket([]byte("b")).Put([]byte("k"), []byte("v")) })
		if !errors.As(err, &ce) {
			t.Fatalf("Do(within RetryAfter) = %v; want a *CommitError", err)
		}
	}
	if s := c.Stats(); s.Failed != 1 || ran != 0 {
		t.Errorf("%d commits tried and %d writes run for 51 writes on a full disk; want 1 and 0", s.Failed, ran)
	}
	lift()
}

// The first write after RetryAfter is tried, and commits once the disk
// takes writes again.
func TestALastingFailureIsTriedAgainAfterRetryAfter(t *testing.T) {
	if !testenv.InChild(t) { // a file size limit: bug 448
		return
	}
	db := openDB(t)
	c := New(db, Options{Lasting: func(error) bool { return true }, RetryAfter: 50 * time.Millisecond})
	defer c.Close()
	lift := testenv.LimitFileSize(t, 0)
	var ce *CommitError
	if err := c.Do(put("tried")); !errors.As(err, &ce) {
		t.Fatalf("Do(disk full) = %v; want a *CommitError", err)
	}
	lift()
	testenv.Eventually(t, time.Minute, "a write to commit once the disk takes writes", func() bool {
		return c.Do(put("after")) == nil
	})
	if !get(t, db, "after") || get(t, db, "tried") {
		t.Error("after the retry: want only the write that committed stored")
	}
}

// Busy is the time on the committer's clock, monotonic, since its group
// began: it is read from the wall clock no more, which a step during a
// commit moved by the step. It counts from a group's first write, not
// from a later one of the group, and is 0 between groups, a group begun
// at the clock's 0 too. docs/reliability.md, bug 358.
func TestBusyCountsOnTheCommittersClock(t *testing.T) {
	var now time.Duration
	c := &Committer{clock: func() time.Duration { return now }}
	c.working(true)
	if b := c.Busy(); b != 0 {
		t.Errorf("Busy as the group begins = %v; want 0", b)
	}
	now = 3 * time.Second
	c.working(true) // a later write of the same group
	now = 5 * time.Second
	if b := c.Busy(); b != 5*time.Second {
		t.Errorf("Busy 5s into the group = %v; want 5s", b)
	}
	c.working(false)
	if b := c.Busy(); b != 0 {
		t.Errorf("Busy between groups = %v; want 0", b)
	}
	c.working(true)
	now = 7 * time.Second
	if b := c.Busy(); b != 2*time.Second {
		t.Errorf("Busy 2s into the next group = %v; want 2s", b)
	}
	if c := New(openDB(t), Options{}); c.clock == nil {
		t.Error("New's committer has no clock")
	} else {
		c.Close()
	}
}
