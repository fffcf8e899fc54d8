package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
)

// newCmd is a command for the device as the broker would submit it.
func newCmd(dev string) companion.Command {
	return companion.Command{DeviceID: dev, UserID: "u1", Op: "push.text", Payload: raw(`{"text":"hi"}`)}
}

// create stores a command or fails the test.
func create(tb testing.TB, db *DB, c companion.Command) companion.Command {
	tb.Helper()
	got, _, err := db.CreateCommand(context.Background(), c, 0, nil)
	if err != nil {
		tb.Fatalf("CreateCommand = %v", err)
	}
	return got
}

// setState moves a command to state or fails the test.
func setState(tb testing.TB, db *DB, id, state string) companion.Command {
	tb.Helper()
	c, err := db.UpdateCommand(context.Background(), id, func(c *companion.Command) error {
		c.State = state
		return nil
	})
	if err != nil {
		tb.Fatalf("UpdateCommand(%s → %s) = %v", id, state, err)
	}
	return c
}

func ids(cs []companion.Command) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.ID
	}
	return out
}

func TestCreateCommand(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	in := newCmd("d1")
	in.ID, in.State = "ignored", "succeeded"
	in.ExpiresAt = clock.Now().Add(time.Hour)
	c, replay, err := db.CreateCommand(ctx, in, 10, nil)
	if err != nil || replay {
		t.Fatalf("CreateCommand = %v, %v", replay, err)
	}
	u, err := uuid.Parse(c.ID)
	if err != nil || u.Version() != 7 || u.String() != c.ID {
		t.Errorf("id %q is not a canonical UUIDv7 (%v)", c.ID, err)
	}
	if c.State != companion.StateQueued || !c.CreatedAt.Equal(clock.Now()) || !c.UpdatedAt.Equal(clock.Now()) || !c.ExpiresAt.Equal(in.ExpiresAt) {
		t.Errorf("CreateCommand = %+v", c)
	}
	in.Payload[2] = 'X' // the caller's slice is not the store's
	got, err := db.Command(ctx, c.ID)
	if err != nil || string(got.Payload) != `{"text":"hi"}` || got.Op != "push.text" || got.UserID != "u1" {
		t.Errorf("Command(%s) = %+v, %v", c.ID, got, err)
	}
	_, err = db.Command(ctx, uuid.NewString())
	wantErr(t, "Command(unknown)", err, companion.ErrNotFound)
	_, _, err = db.CreateCommand(ctx, companion.Command{}, 0, nil)
	wantErr(t, "CreateCommand(no device)", err, companion.ErrInvalid)
}

func TestCreateCommandConcurrentIDsIncrease(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	const workers, each = 32, 15
	perWorker := make([][]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := fmt.Sprintf("d%d", w%4)
			for range each {
				c, _, err := db.CreateCommand(ctx, newCmd(dev), 0, nil)
				if err != nil {
					t.Error(err)
					return
				}
				perWorker[w] = append(perWorker[w], c.ID)
			}
		}()
	}
	wg.Wait()

	// One goroutine's calls commit one after the other, so their ids rise.
	all := map[string]bool{}
	for w, got := range perWorker {
		if !slices.IsSorted(got) || len(got) != each {
			t.Errorf("worker %d ids %v; want %d rising", w, got, each)
		}
		for _, id := range got {
			if all[id] {
				t.Errorf("id %s given twice", id)
			}
			all[id] = true
		}
	}
	// In the store, id order is creation order (CreatedAt never goes back).
	open, err := db.OpenCommands(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(open) != workers*each {
		t.Fatalf("OpenCommands = %d; want %d", len(open), workers*each)
	}
	for i := 1; i < len(open); i++ {
		if open[i].ID <= open[i-1].ID || open[i].CreatedAt.Before(open[i-1].CreatedAt) {
			t.Fatalf("OpenCommands[%d] = %s at %v after %s at %v", i, open[i].ID, open[i].CreatedAt, open[i-1].ID, open[i-1].CreatedAt)
		}
	}
}

func TestCreateCommandQueueFull(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	const maxOpen = 3
	var made []companion.Command
	for i := range maxOpen {
		c, _, err := db.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
		if err != nil {
			t.Fatalf("CreateCommand #%d = %v", i, err)
		}
		made = append(made, c)
	}
	_, _, err := db.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
	wantErr(t, "CreateCommand over maxOpen", err, companion.ErrQueueFull)
	// Another device has its own queue; no limit means none.
	if _, _, err := db.CreateCommand(ctx, newCmd("d2"), maxOpen, nil); err != nil {
		t.Errorf("CreateCommand(d2) = %v", err)
	}
	if _, _, err := db.CreateCommand(ctx, newCmd("d1"), 0, nil); err != nil {
		t.Errorf("CreateCommand(no limit) = %v", err)
	}
	if n, _ := db.CountOpen(ctx, "d1"); n != maxOpen+1 {
		t.Errorf("CountOpen(d1) = %d; want %d", n, maxOpen+1)
	}

	// Non-final progress keeps the count; a final state drops it.
	steps := []struct {
		state string
		want  int
	}{
		{companion.StateSent, 4}, {companion.StateDelivered, 4}, {companion.StateInProgress, 4}, {companion.StateSucceeded, 3},
	}
	for _, st := range steps {
		setState(t, db, made[0].ID, st.state)
		if n, err := db.CountOpen(ctx, "d1"); err != nil || n != st.want {
			t.Errorf("CountOpen after %s = %d, %v; want %d", st.state, n, err, st.want)
		}
	}
	for i, final := range []string{companion.StateFailed, companion.StateCanceled} {
		setState(t, db, made[i+1].ID, final)
	}
	if n, _ := db.CountOpen(ctx, "d1"); n != 1 {
		t.Errorf("CountOpen = %d; want 1", n)
	}
	if _, _, err := db.CreateCommand(ctx, newCmd("d1"), maxOpen, nil); err != nil {
		t.Errorf("CreateCommand after commands finished = %v", err)
	}
}

func TestCreateCommandQueueFullConcurrent(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	const maxOpen, tries = 10, 40
	var ok, full atomic.Int32
	var wg sync.WaitGroup
	for range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := db.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, companion.ErrQueueFull):
				full.Add(1)
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if ok.Load() != maxOpen || full.Load() != tries-maxOpen {
		t.Errorf("created %d, refused %d; want %d and %d", ok.Load(), full.Load(), maxOpen, tries-maxOpen)
	}
}

func TestCreateCommandIdempotency(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	idem := func(key, body string) *companion.Idempotency {
		return &companion.Idempotency{UserID: "u1", Key: key, RequestHash: hashOf(body), Status: 202}
	}

	first, replay, err := db.CreateCommand(ctx, newCmd("d1"), 0, idem("k1", "a"))
	if err != nil || replay {
		t.Fatalf("CreateCommand = %v, %v", replay, err)
	}
	rec, err := db.Idempotency(ctx, "u1", "k1")
	if err != nil || rec.CommandID != first.ID || !rec.CreatedAt.Equal(clock.Now()) || rec.Status != 202 {
		t.Errorf("Idempotency(k1) = %+v, %v; want command %s", rec, err, first.ID)
	}

	clock.Advance(23 * time.Hour)
	tests := []struct {
		name       string
		user, key  string
		body       string
		wantReplay bool
		wantSameID bool
		want       error
	}{
		{"same key and body", "u1", "k1", "a", true, true, nil},
		{"same key, other body", "u1", "k1", "b", false, false, companion.ErrIdemConflict},
		{"other key", "u1", "k2", "a", false, false, nil},
		{"other user, same key", "u2", "k1", "b", false, false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := idem(tt.key, tt.body)
			rec.UserID = tt.user
			c, replay, err := db.CreateCommand(ctx, newCmd("d1"), 0, rec)
			wantErr(t, "CreateCommand", err, tt.want)
			if replay != tt.wantReplay || (c.ID == first.ID) != tt.wantSameID {
				t.Errorf("CreateCommand(%s/%s) = %s, replay %v; want replay %v, same id %v", tt.user, tt.key, c.ID, replay, tt.wantReplay, tt.wantSameID)
			}
		})
	}
	if n, _ := db.CountOpen(ctx, "d1"); n != 3 {
		t.Errorf("CountOpen = %d; want 3 (replay and conflict create nothing)", n)
	}

	// A replay also works once the command has moved on, and a full queue
	// does not stop it: the answer is the stored one.
	setState(t, db, first.ID, companion.StateSucceeded)
	c, replay, err := db.CreateCommand(ctx, newCmd("d1"), 1, idem("k1", "a"))
	if err != nil || !replay || c.State != companion.StateSucceeded {
		t.Errorf("replay after success = %+v, %v, %v", c, replay, err)
	}

	// After 24 hours the key is free again.
	clock.Advance(time.Hour)
	c, replay, err = db.CreateCommand(ctx, newCmd("d1"), 0, idem("k1", "b"))
	if err != nil || replay || c.ID == first.ID {
		t.Errorf("CreateCommand after 24h = %s, %v, %v; want a new command", c.ID, replay, err)
	}
	if rec, _ := db.Idempotency(ctx, "u1", "k1"); rec.CommandID != c.ID {
		t.Errorf("Idempotency(k1).CommandID = %s; want %s", rec.CommandID, c.ID)
	}
}

func TestUpdateCommand(t *testing.T) {
	ctx := context.Background()
	clock := newFakeClock()
	db := openTestDBWith(t, t.TempDir()+"/c.db", Options{Now: clock.Now})
	c := create(t, db, newCmd("d1"))

	clock.Advance(time.Second)
	got, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State = companion.StateInProgress
		c.Progress = intp(40)
		c.ID, c.DeviceID = "changed", "d2" // not allowed to stick
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != c.ID || got.DeviceID != "d1" || got.State != companion.StateInProgress || *got.Progress != 40 ||
		!got.UpdatedAt.Equal(clock.Now()) || !got.CreatedAt.Equal(c.CreatedAt) {
		t.Errorf("UpdateCommand = %+v", got)
	}

	// An error from fn writes nothing.
	boom := errors.New("boom")
	_, err = db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State = companion.StateFailed
		return boom
	})
	wantErr(t, "UpdateCommand(fn fails)", err, boom)
	if got, _ := db.Command(ctx, c.ID); got.State != companion.StateInProgress {
		t.Errorf("state after failed fn = %s; want in_progress", got.State)
	}

	_, err = db.UpdateCommand(ctx, uuid.NewString(), func(*companion.Command) error { return nil })
	wantErr(t, "UpdateCommand(unknown)", err, companion.ErrNotFound)

	clock.Advance(time.Second)
	final, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State = companion.StateFailed
		c.Error = &companion.CommandError{Code: "device_error", Message: "no"}
		c.Result = raw(`{"x":1}`)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	called := false
	again, err := db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		called = true
		c.State = companion.StateSucceeded
		return nil
	})
	wantErr(t, "UpdateCommand(final)", err, companion.ErrFinal)
	if called {
		t.Error("UpdateCommand called fn on a final command")
	}
	if again.State != companion.StateFailed || again.Error == nil || again.Error.Code != "device_error" ||
		string(again.Result) != `{"x":1}` || !again.UpdatedAt.Equal(final.UpdatedAt) {
		t.Errorf("UpdateCommand(final) = %+v; want the stored command", again)
	}
	if open, _ := db.OpenCommands(ctx); len(open) != 0 {
		t.Errorf("OpenCommands = %v; want none", ids(open))
	}
}

func TestListCommands(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	var made []string // oldest first
	for i := range 12 {
		made = append(made, create(t, db, newCmd("dev-1")).ID)
		if i%3 == 0 {
			create(t, db, newCmd("dev-10")) // shares a prefix of bytes with dev-1
			create(t, db, newCmd("dev-0"))
		}
	}
	for i, id := range made {
		switch i % 3 {
		case 1:
			setState(t, db, id, companion.StateSent)
		case 2:
			setState(t, db, id, companion.StateSucceeded)
		}
	}
	newest := slices.Clone(made)
	slices.Reverse(newest)
	pick := func(keep func(i int) bool) []string {
		var out []string
		for i := len(made) - 1; i >= 0; i-- {
			if keep(i) {
				out = append(out, made[i])
			}
		}
		return out
	}

	tests := []struct {
		name          string
		state, before string
		limit         int
		want          []string
		more          bool
	}{
		{"all", "", "", 0, newest, false},
		{"first page", "", "", 5, newest[:5], true},
		{"second page", "", newest[4], 5, newest[5:10], true},
		{"last page", "", newest[9], 5, newest[10:], false},
		{"last page, exactly full", "", newest[7], 4, newest[8:], false},
		{"before oldest", "", made[0], 5, nil, false},
		{"queued", companion.StateQueued, "", 0, pick(func(i int) bool { return i%3 == 0 }), false},
		{"sent, paged", companion.StateSent, made[10], 2, []string{made[7], made[4]}, true},
		{"sent, last page exactly full", companion.StateSent, made[7], 2, []string{made[4], made[1]}, false},
		{"succeeded", companion.StateSucceeded, "", 100, pick(func(i int) bool { return i%3 == 2 }), false},
		{"no such state", "nope", "", 0, nil, false},
		{"another user's", "", "", 5, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q := companion.CommandQuery{DeviceID: "dev-1", UserID: "u1", State: tt.state, Before: tt.before, Limit: tt.limit}
			if tt.name == "another user's" {
				q.UserID = "u2"
			}
			got, more, err := db.ListCommands(ctx, q)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range got {
				if c.DeviceID != "dev-1" {
					t.Errorf("listed %s of %s", c.ID, c.DeviceID)
				}
			}
			if !slices.Equal(ids(got), tt.want) || more != tt.more {
				t.Errorf("ListCommands(%+v) = %v, more %v; want %v, more %v", q, ids(got), more, tt.want, tt.more)
			}
		})
	}

	// Walking pages by cursor visits every command once.
	var walked []string
	before := ""
	for {
		page, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", Before: before, Limit: 4})
		if err != nil {
			t.Fatal(err)
		}
		walked = append(walked, ids(page)...)
		if !more {
			break
		}
		before = page[len(page)-1].ID
	}
	if !slices.Equal(walked, newest) {
		t.Errorf("walk = %v; want %v", walked, newest)
	}

	for _, bad := range []string{"x", "{" + made[0] + "}", "urn:uuid:" + made[0]} {
		_, _, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", Before: bad, Limit: 5})
		wantErr(t, fmt.Sprintf("ListCommands(before %q)", bad), err, companion.ErrInvalidCursor)
	}
	if got, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-9", Limit: 5}); err != nil || len(got) != 0 || more {
		t.Errorf("ListCommands(dev-9) = %v, %v, %v; want none", got, more, err)
	}
}

// A device that changed hands keeps the commands of both owners; each
// owner's pages are full and end where that owner's commands end, however
// the two are interleaved.
func TestListCommandsOfOneOwner(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	mine := map[string][]string{} // newest first, by user
	send := func(user string) {
		c := newCmd("dev-1")
		c.UserID = user
		mine[user] = append([]string{create(t, db, c).ID}, mine[user]...)
	}
	// u1's run of commands, then u2's interleaved with a few of u1's
	// (as when u1's spool drains late), then u2's alone.
	for range 5 {
		send("u1")
	}
	for i := range 7 {
		send("u2")
		if i%2 == 0 {
			send("u1")
		}
	}
	for range 3 {
		send("u2")
	}
	for _, user := range []string{"u1", "u2"} {
		for _, limit := range []int{1, 2, 3, 5, len(mine[user]), 100} {
			var pages [][]string
			before := ""
			for {
				page, more, err := db.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", UserID: user, Before: before, Limit: limit})
				if err != nil {
					t.Fatal(err)
				}
				pages = append(pages, ids(page))
				for _, c := range page {
					if c.UserID != user {
						t.Errorf("%s's list (limit %d) has %s of %s", user, limit, c.ID, c.UserID)
					}
				}
				if !more {
					break
				}
				if len(page) != limit {
					t.Errorf("%s's page %d (limit %d) = %v with more to come; want it full", user, len(pages), limit, ids(page))
				}
				if len(pages) > len(mine[user]) {
					t.Fatalf("%s's pages (limit %d) do not end: %v", user, limit, pages)
				}
				before = page[len(page)-1].ID
			}
			if got := slices.Concat(pages...); !slices.Equal(got, mine[user]) {
				t.Errorf("%s's pages (limit %d) = %v; want %v", user, limit, pages, mine[user])
			}
			if n := len(mine[user]); len(pages) != max(1, (n+limit-1)/limit) {
				t.Errorf("%s's %d commands came in %d pages of %d; want %d (no empty last page)", user, n, len(pages), limit, (n+limit-1)/limit)
			}
		}
	}
}

func TestOpenCommands(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	a := create(t, db, newCmd("d1"))
	b := create(t, db, newCmd("d2"))
	c := create(t, db, newCmd("d1"))
	d := create(t, db, newCmd("d3"))
	setState(t, db, b.ID, companion.StateSent)
	setState(t, db, c.ID, companion.StateDelivered)
	setState(t, db, d.ID, companion.StateExpired)

	tests := []struct {
		states []string
		want   []string
	}{
		{nil, []string{a.ID, b.ID, c.ID}},
		{[]string{companion.StateQueued}, []string{a.ID}},
		{[]string{companion.StateQueued, companion.StateSent}, []string{a.ID, b.ID}},
		{[]string{companion.StateExpired}, nil},
	}
	for _, tt := range tests {
		got, err := db.OpenCommands(ctx, tt.states...)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ids(got), tt.want) {
			t.Errorf("OpenCommands(%v) = %v; want %v", tt.states, ids(got), tt.want)
		}
	}
}

func TestIsFinal(t *testing.T) {
	for state, want := range map[string]bool{
		companion.StateQueued: false, companion.StateSent: false, companion.StateDelivered: false, companion.StateInProgress: false,
		companion.StateSucceeded: true, companion.StateFailed: true, companion.StateExpired: true, companion.StateCanceled: true,
	} {
		if got := companion.IsFinal(state); got != want {
			t.Errorf("IsFinal(%q) = %v; want %v", state, got, want)
		}
	}
}

// BenchmarkCreateCommand measures accepted commands per second with many
// concurrent writers, which bbolt's Batch groups into one fsync.
func BenchmarkCreateCommand(b *testing.B) {
	ctx := context.Background()
	db := openTestDB(b)
	var n atomic.Int64
	b.SetParallelism(64) // 64 × GOMAXPROCS writers, like many API requests at once
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		dev := fmt.Sprintf("d%d", n.Add(1))
		for pb.Next() {
			if _, _, err := db.CreateCommand(ctx, newCmd(dev), 1000000, nil); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "cmds/s")
}
