package storetest

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newCmd is a command for the device as the broker would submit it.
func newCmd(dev string) companion.Command {
	return companion.Command{DeviceID: dev, UserID: "u1", Op: "push.text", Payload: raw(`{"text":"hi"}`), ExpiresAt: now().Add(time.Hour)}
}

// create stores a command or fails the test.
func create(t testing.TB, s companion.Store, c companion.Command) companion.Command {
	t.Helper()
	got, replay, err := s.CreateCommand(t.Context(), c, 0, nil)
	require.NoError(t, err, "CreateCommand(%s)", c.DeviceID)
	require.False(t, replay, "CreateCommand without idempotency replayed")
	return got
}

// setState moves a command to state or fails the test.
func setState(t testing.TB, s companion.Store, id, state string) companion.Command {
	t.Helper()
	c, err := s.UpdateCommand(t.Context(), id, func(c *companion.Command) error {
		c.State = state
		return nil
	})
	require.NoError(t, err, "UpdateCommand(%s → %s)", id, state)
	return c
}

func ids(cs []companion.Command) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.ID
	}
	return out
}

// countOpen returns CountOpen of the device or fails the test.
func countOpen(t testing.TB, s companion.Store, dev string) int {
	t.Helper()
	n, err := s.CountOpen(t.Context(), dev)
	require.NoError(t, err, "CountOpen(%s)", dev)
	return n
}

func testCommands(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"Create", testCreateCommand},
		{"IDsAreUUIDv7InCommitOrder", testCommandIDsInCommitOrder},
		{"QueueFull", testQueueFull},
		{"QueueFullConcurrent", testQueueFullConcurrent},
		{"IdempotencyReplayConflict", testCreateCommandIdempotency},
		{"Update", testUpdateCommand},
		{"UpdateStateRanks", testUpdateStateRanks},
		{"List", testListCommands},
		{"ListOfOneOwner", testListCommandsOfOneOwner},
		{"OpenCommands", testOpenCommands},
		{"QueuedCommandsWith", testQueuedCommandsWith},
		{"SentCommandsOnline", testSentCommandsOnline},
		{"ExpiredCommands", testExpiredCommands},
		{"CountOpen", testCountOpen},
		{"Purge", testPurgeCommands},
		{"PurgeMany", testPurgeMany},
	})
}

func testCreateCommand(t *testing.T, s companion.Store) {
	ctx := t.Context()
	in := newCmd("d1")
	in.ID, in.State = "ignored", companion.StateSucceeded
	in.Blob = shaHex([]byte("blob"))
	c, replay, err := s.CreateCommand(ctx, in, 10, nil)
	require.NoError(t, err)
	require.False(t, replay)
	u, err := uuid.Parse(c.ID)
	if err != nil || u.Version() != 7 || u.String() != c.ID {
		t.Errorf("id %q is not a canonical UUIDv7 (%v)", c.ID, err)
	}
	assert.Equal(t, companion.StateQueued, c.State, "CreateCommand().State")
	near(t, "CreateCommand().CreatedAt", c.CreatedAt)
	assert.True(t, c.UpdatedAt.Equal(c.CreatedAt), "CreateCommand(): UpdatedAt %v, CreatedAt %v; want the same", c.UpdatedAt, c.CreatedAt)
	assert.True(t, c.ExpiresAt.Equal(in.ExpiresAt), "CreateCommand().ExpiresAt = %v; want %v as given", c.ExpiresAt, in.ExpiresAt)
	assert.Equal(t, "d1", c.DeviceID)
	assert.Equal(t, "u1", c.UserID)
	assert.Equal(t, "push.text", c.Op)
	assert.Equal(t, in.Blob, c.Blob)
	assert.JSONEq(t, `{"text":"hi"}`, string(c.Payload))

	in.Payload[2] = 'X' // the caller's slice is not the store's
	got, err := s.Command(ctx, c.ID)
	require.NoError(t, err, "Command(%s)", c.ID)
	sameCommand(t, "Command() after CreateCommand", got, c)
	assert.JSONEq(t, `{"text":"hi"}`, string(got.Payload))

	_, err = s.Command(ctx, uuid.NewString())
	assert.ErrorIs(t, err, companion.ErrNotFound, "Command(unknown)")
	_, err = s.Command(ctx, "")
	assert.ErrorIs(t, err, companion.ErrNotFound, `Command("")`)
	_, _, err = s.CreateCommand(ctx, companion.Command{}, 0, nil)
	assert.ErrorIs(t, err, companion.ErrInvalid, "CreateCommand(no device)")
	_, _, err = s.CreateCommand(ctx, companion.Command{DeviceID: "d\x001"}, 0, nil)
	assert.ErrorIs(t, err, companion.ErrInvalid, "CreateCommand(NUL in device id)")
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), 0, &companion.Idempotency{UserID: "u1"})
	assert.ErrorIs(t, err, companion.ErrInvalid, "CreateCommand(idempotency without a key)")
	assert.Equal(t, 1, countOpen(t, s, "d1"), "CountOpen(d1): refused commands are not stored")
}

// Command ids are UUIDv7 assigned at commit: one goroutine's commands get
// rising ids, and in the store id order is creation order.
func testCommandIDsInCommitOrder(t *testing.T, s companion.Store) {
	ctx := t.Context()
	const workers, each = 16, 10
	perWorker := make([][]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := fmt.Sprintf("d%d", w%4)
			for range each {
				c, _, err := s.CreateCommand(ctx, newCmd(dev), 0, nil)
				if err != nil {
					t.Errorf("CreateCommand(%s) = %v", dev, err)
					return
				}
				perWorker[w] = append(perWorker[w], c.ID)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}

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
	open, err := s.OpenCommands(ctx)
	require.NoError(t, err)
	require.Len(t, open, workers*each, "OpenCommands")
	for i := 1; i < len(open); i++ {
		if open[i].ID <= open[i-1].ID || open[i].CreatedAt.Before(open[i-1].CreatedAt) {
			t.Fatalf("OpenCommands[%d] = %s at %v after %s at %v; want ids and times rising", i, open[i].ID, open[i].CreatedAt, open[i-1].ID, open[i-1].CreatedAt)
		}
	}
	// A device's history, newest first, is the reverse of id order.
	for d := range 4 {
		dev := fmt.Sprintf("d%d", d)
		hist, more, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: dev})
		require.NoError(t, err)
		assert.False(t, more)
		assert.Len(t, hist, workers/4*each, "ListCommands(%s)", dev)
		assert.True(t, slices.IsSortedFunc(hist, func(a, b companion.Command) int { return strings.Compare(b.ID, a.ID) }), "ListCommands(%s) not newest first: %v", dev, ids(hist))
	}
}

func testQueueFull(t *testing.T, s companion.Store) {
	ctx := t.Context()
	const maxOpen = 3
	var made []companion.Command
	for i := range maxOpen {
		c, _, err := s.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
		require.NoError(t, err, "CreateCommand #%d", i)
		made = append(made, c)
	}
	_, _, err := s.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
	assert.ErrorIs(t, err, companion.ErrQueueFull, "CreateCommand over maxOpen")
	assert.Equal(t, maxOpen, countOpen(t, s, "d1"), "CountOpen(d1) after a refusal")
	// Another device has its own queue; no limit means none.
	_, _, err = s.CreateCommand(ctx, newCmd("d2"), maxOpen, nil)
	assert.NoError(t, err, "CreateCommand(d2)")
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), 0, nil)
	assert.NoError(t, err, "CreateCommand(no limit)")
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), -1, nil)
	assert.NoError(t, err, "CreateCommand(negative limit)")
	assert.Equal(t, maxOpen+2, countOpen(t, s, "d1"), "CountOpen(d1)")

	// Non-final progress keeps the count; a final state drops it.
	steps := []struct {
		state string
		want  int
	}{
		{companion.StateSent, 5}, {companion.StateDelivered, 5}, {companion.StateInProgress, 5}, {companion.StateSucceeded, 4},
	}
	for _, st := range steps {
		setState(t, s, made[0].ID, st.state)
		assert.Equal(t, st.want, countOpen(t, s, "d1"), "CountOpen after %s", st.state)
	}
	for i, final := range []string{companion.StateFailed, companion.StateCanceled} {
		setState(t, s, made[i+1].ID, final)
	}
	assert.Equal(t, 2, countOpen(t, s, "d1"))
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
	assert.NoError(t, err, "CreateCommand after commands finished")
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
	assert.ErrorIs(t, err, companion.ErrQueueFull, "CreateCommand at maxOpen again")
}

func testQueueFullConcurrent(t *testing.T, s companion.Store) {
	ctx := t.Context()
	const maxOpen, tries = 10, 40
	var ok, full atomic.Int32
	var wg sync.WaitGroup
	for range tries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := s.CreateCommand(ctx, newCmd("d1"), maxOpen, nil)
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, companion.ErrQueueFull):
				full.Add(1)
			default:
				t.Errorf("CreateCommand = %v", err)
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, int32(maxOpen), ok.Load(), "created")
	assert.Equal(t, int32(tries-maxOpen), full.Load(), "refused with ErrQueueFull")
	assert.Equal(t, maxOpen, countOpen(t, s, "d1"))
}

func testCreateCommandIdempotency(t *testing.T, s companion.Store) {
	ctx := t.Context()
	idem := func(user, key, body string) *companion.Idempotency {
		return &companion.Idempotency{UserID: user, Key: key, RequestHash: hashOf(body), Status: 202, Location: "/loc/" + key}
	}

	first, replay, err := s.CreateCommand(ctx, newCmd("d1"), 0, idem("u1", "k1", "a"))
	require.NoError(t, err)
	require.False(t, replay)
	rec, err := s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err, "Idempotency(k1)")
	assert.Equal(t, first.ID, rec.CommandID, "Idempotency(k1).CommandID")
	assert.Equal(t, 202, rec.Status)
	assert.Equal(t, "/loc/k1", rec.Location)
	assert.Equal(t, hashOf("a"), rec.RequestHash)
	near(t, "Idempotency(k1).CreatedAt", rec.CreatedAt)

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
			c, replay, err := s.CreateCommand(ctx, newCmd("d1"), 0, idem(tt.user, tt.key, tt.body))
			wantErr(t, err, tt.want, "CreateCommand")
			if replay != tt.wantReplay || (c.ID == first.ID) != tt.wantSameID {
				t.Errorf("CreateCommand(%s/%s) = %s, replay %v; want replay %v, same id %v", tt.user, tt.key, c.ID, replay, tt.wantReplay, tt.wantSameID)
			}
			if tt.wantReplay {
				sameCommand(t, "the replayed command", c, first)
			}
		})
	}
	assert.Equal(t, 3, countOpen(t, s, "d1"), "CountOpen: replay and conflict create nothing")

	// A replay also works once the command has moved on, and a full queue
	// does not stop it: the answer is the stored one.
	setState(t, s, first.ID, companion.StateSucceeded)
	c, replay, err := s.CreateCommand(ctx, newCmd("d1"), 1, idem("u1", "k1", "a"))
	require.NoError(t, err, "replay after success")
	assert.True(t, replay, "replay after success")
	assert.Equal(t, first.ID, c.ID)
	assert.Equal(t, companion.StateSucceeded, c.State, "replay after success: the stored state")

	// A full queue refuses a new key and stores no record of it.
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), 1, idem("u1", "k9", "a"))
	assert.ErrorIs(t, err, companion.ErrQueueFull)
	_, err = s.Idempotency(ctx, "u1", "k9")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(k9) after a refused command")

	// A live record of an answer that was not a command conflicts.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k3", RequestHash: hashOf("a"), Status: 201, Body: []byte(`{}`)}))
	_, _, err = s.CreateCommand(ctx, newCmd("d1"), 0, idem("u1", "k3", "a"))
	assert.ErrorIs(t, err, companion.ErrIdemConflict, "CreateCommand(key of a non-command answer)")

	// After 24 hours the key is free again.
	old := now().Add(-idempotencyTTL - time.Minute)
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "k4", RequestHash: hashOf("a"), Status: 202, CommandID: first.ID, CreatedAt: old}))
	c, replay, err = s.CreateCommand(ctx, newCmd("d1"), 0, idem("u1", "k4", "b"))
	require.NoError(t, err, "CreateCommand over an expired key")
	assert.False(t, replay)
	assert.NotEqual(t, first.ID, c.ID, "CreateCommand over an expired key: want a new command")
	rec, err = s.Idempotency(ctx, "u1", "k4")
	require.NoError(t, err)
	assert.Equal(t, c.ID, rec.CommandID, "Idempotency(k4).CommandID")
	assert.Equal(t, hashOf("b"), rec.RequestHash)
	near(t, "Idempotency(k4).CreatedAt", rec.CreatedAt)
}

func testUpdateCommand(t *testing.T, s companion.Store) {
	ctx := t.Context()
	c := create(t, s, newCmd("d1"))

	got, err := s.UpdateCommand(ctx, c.ID, func(cmd *companion.Command) error {
		if cmd.ID != c.ID || cmd.State != companion.StateQueued || cmd.DeviceID != "d1" {
			t.Errorf("UpdateCommand gave fn %+v; want the stored command", cmd)
		}
		cmd.State = companion.StateInProgress
		cmd.Progress = intp(40)
		cmd.ID, cmd.DeviceID, cmd.CreatedAt = "changed", "d2", time.Time{} // not allowed to stick
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, c.ID, got.ID)
	assert.Equal(t, "d1", got.DeviceID)
	assert.Equal(t, companion.StateInProgress, got.State)
	if assert.NotNil(t, got.Progress) {
		assert.Equal(t, 40, *got.Progress)
	}
	assert.True(t, got.CreatedAt.Equal(c.CreatedAt), "UpdateCommand().CreatedAt = %v; want kept %v", got.CreatedAt, c.CreatedAt)
	near(t, "UpdateCommand().UpdatedAt", got.UpdatedAt)
	assert.False(t, got.UpdatedAt.Before(c.UpdatedAt), "UpdatedAt went back")
	stored, err := s.Command(ctx, c.ID)
	require.NoError(t, err)
	sameCommand(t, "Command() after UpdateCommand", stored, got)
	_, err = s.Command(ctx, "changed")
	assert.ErrorIs(t, err, companion.ErrNotFound)
	assert.Equal(t, 0, countOpen(t, s, "d2"), "CountOpen(d2): fn's DeviceID did not stick")

	// An error from fn writes nothing.
	boom := errors.New("boom")
	_, err = s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State = companion.StateFailed
		return boom
	})
	assert.ErrorIs(t, err, boom, "UpdateCommand(fn fails)")
	stored, err = s.Command(ctx, c.ID)
	require.NoError(t, err)
	sameCommand(t, "Command() after a failed fn", stored, got)
	assert.Equal(t, 1, countOpen(t, s, "d1"))

	_, err = s.UpdateCommand(ctx, uuid.NewString(), func(*companion.Command) error { return nil })
	assert.ErrorIs(t, err, companion.ErrNotFound, "UpdateCommand(unknown)")
	_, err = s.UpdateCommand(ctx, "", func(*companion.Command) error { return nil })
	assert.ErrorIs(t, err, companion.ErrNotFound, `UpdateCommand("")`)

	final, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State = companion.StateFailed
		c.Error = &companion.CommandError{Code: "device_error", Message: "no"}
		c.Result = raw(`{"x":1}`)
		return nil
	})
	require.NoError(t, err)
	called := false
	again, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		called = true
		c.State = companion.StateSucceeded
		return nil
	})
	assert.ErrorIs(t, err, companion.ErrFinal, "UpdateCommand(final)")
	assert.False(t, called, "UpdateCommand called fn on a final command")
	sameCommand(t, "UpdateCommand(final): the stored command", again, final)
	if again.Error == nil || again.Error.Code != "device_error" || again.Error.Message != "no" {
		t.Errorf("UpdateCommand(final).Error = %+v; want the stored error", again.Error)
	}
	assert.JSONEq(t, `{"x":1}`, string(again.Result), "UpdateCommand(final).Result")
	open, err := s.OpenCommands(ctx)
	require.NoError(t, err)
	assert.Empty(t, ids(open), "OpenCommands")
	assert.Equal(t, 0, countOpen(t, s, "d1"))
}

// The store passes fn the stored command, so a change fn that refuses to
// move a command to a lower rank (as the broker's does for late replies)
// keeps it where it is; a command walks up the ranks, each non-final
// state counting as open, and no final state ever changes.
func testUpdateStateRanks(t *testing.T, s companion.Store) {
	ctx := t.Context()
	stale := errors.New("stale")
	toward := func(state string) func(*companion.Command) error {
		return func(c *companion.Command) error {
			if companion.Rank(state) < companion.Rank(c.State) {
				return stale
			}
			c.State = state
			return nil
		}
	}
	for _, final := range []string{companion.StateSucceeded, companion.StateFailed, companion.StateExpired, companion.StateCanceled} {
		c := create(t, s, newCmd("d1"))
		prev := c
		for _, state := range []string{companion.StateSent, companion.StateDelivered, companion.StateInProgress} {
			got, err := s.UpdateCommand(ctx, c.ID, toward(state))
			require.NoError(t, err, "UpdateCommand(→ %s)", state)
			assert.Equal(t, state, got.State)
			assert.False(t, got.UpdatedAt.Before(prev.UpdatedAt), "UpdatedAt went back at %s", state)
			assert.Equal(t, 1, countOpen(t, s, "d1"), "CountOpen in %s", state)
			for _, lower := range companion.States[:companion.Rank(state)] {
				_, err := s.UpdateCommand(ctx, c.ID, toward(lower))
				assert.ErrorIs(t, err, stale, "UpdateCommand(%s → %s)", state, lower)
			}
			stored, err := s.Command(ctx, c.ID)
			require.NoError(t, err)
			assert.Equal(t, state, stored.State, "state after refused moves back")
			prev = got
		}
		got, err := s.UpdateCommand(ctx, c.ID, toward(final))
		require.NoError(t, err, "UpdateCommand(→ %s)", final)
		assert.Equal(t, final, got.State)
		assert.Equal(t, 0, countOpen(t, s, "d1"), "CountOpen in %s", final)
		for _, state := range companion.States {
			_, err := s.UpdateCommand(ctx, c.ID, toward(state))
			assert.ErrorIs(t, err, companion.ErrFinal, "UpdateCommand(%s → %s)", final, state)
		}
		stored, err := s.Command(ctx, c.ID)
		require.NoError(t, err)
		sameCommand(t, "a final command", stored, got)
	}
	// A command may also end straight from queued.
	c := create(t, s, newCmd("d1"))
	got := setState(t, s, c.ID, companion.StateCanceled)
	assert.Equal(t, companion.StateCanceled, got.State)
	assert.Equal(t, 0, countOpen(t, s, "d1"))
}

func testListCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	var made []string // oldest first
	for i := range 12 {
		made = append(made, create(t, s, newCmd("dev-1")).ID)
		if i%3 == 0 {
			create(t, s, newCmd("dev-10")) // shares a prefix with dev-1
			create(t, s, newCmd("dev-0"))
		}
	}
	for i, id := range made {
		switch i % 3 {
		case 1:
			setState(t, s, id, companion.StateSent)
		case 2:
			setState(t, s, id, companion.StateSucceeded)
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
		user          string
		state, before string
		limit         int
		want          []string
		more          bool
	}{
		{"all", "u1", "", "", 0, newest, false},
		{"all users", "", "", "", 0, newest, false},
		{"first page", "u1", "", "", 5, newest[:5], true},
		{"second page", "u1", "", newest[4], 5, newest[5:10], true},
		{"last page", "u1", "", newest[9], 5, newest[10:], false},
		{"last page, exactly full", "u1", "", newest[7], 4, newest[8:], false},
		{"before oldest", "u1", "", made[0], 5, nil, false},
		{"before another device's command", "u1", "", made[0], 0, nil, false},
		{"queued", "u1", companion.StateQueued, "", 0, pick(func(i int) bool { return i%3 == 0 }), false},
		{"sent, paged", "u1", companion.StateSent, made[10], 2, []string{made[7], made[4]}, true},
		{"sent, last page exactly full", "u1", companion.StateSent, made[7], 2, []string{made[4], made[1]}, false},
		{"succeeded", "u1", companion.StateSucceeded, "", 100, pick(func(i int) bool { return i%3 == 2 }), false},
		{"no such state", "u1", "nope", "", 0, nil, false},
		{"another user's", "u2", "", "", 5, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q := companion.CommandQuery{DeviceID: "dev-1", UserID: tt.user, State: tt.state, Before: tt.before, Limit: tt.limit}
			got, more, err := s.ListCommands(ctx, q)
			require.NoError(t, err)
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
	for pages := 0; ; pages++ {
		require.Less(t, pages, len(made), "the walk does not end")
		page, more, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", Before: before, Limit: 4})
		require.NoError(t, err)
		walked = append(walked, ids(page)...)
		if !more {
			break
		}
		require.Len(t, page, 4, "a page with more to come")
		before = page[len(page)-1].ID
	}
	assert.Equal(t, newest, walked, "walk")

	for _, bad := range []string{"x", "{" + made[0] + "}", "urn:uuid:" + made[0], "a\x00b"} {
		_, _, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", Before: bad, Limit: 5})
		assert.ErrorIs(t, err, companion.ErrInvalidCursor, "ListCommands(before %q)", bad)
	}
	got, more, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-9", Limit: 5})
	require.NoError(t, err)
	assert.False(t, more)
	assert.Empty(t, got, "ListCommands(dev-9)")
	// A well-formed cursor that names no command is not an error.
	got, more, err = s.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", Before: uuid.Must(uuid.NewV7()).String(), Limit: 3})
	require.NoError(t, err, "ListCommands(before a fresh UUIDv7)")
	assert.Equal(t, newest[:3], ids(got), "ListCommands(before a fresh UUIDv7)")
	assert.True(t, more)
}

// A device that changed hands keeps the commands of both owners; each
// owner's pages are full and end where that owner's commands end, however
// the two are interleaved.
func testListCommandsOfOneOwner(t *testing.T, s companion.Store) {
	ctx := t.Context()
	mine := map[string][]string{} // newest first, by user
	send := func(user string) {
		c := newCmd("dev-1")
		c.UserID = user
		mine[user] = append([]string{create(t, s, c).ID}, mine[user]...)
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
				page, more, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "dev-1", UserID: user, Before: before, Limit: limit})
				require.NoError(t, err)
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
				require.LessOrEqual(t, len(pages), len(mine[user]), "%s's pages (limit %d) do not end: %v", user, limit, pages)
				before = page[len(page)-1].ID
			}
			assert.Equal(t, mine[user], slices.Concat(pages...), "%s's pages (limit %d)", user, limit)
			if n := len(mine[user]); len(pages) != max(1, (n+limit-1)/limit) {
				t.Errorf("%s's %d commands came in %d pages of %d; want %d (no empty last page)", user, n, len(pages), limit, (n+limit-1)/limit)
			}
		}
	}
}

func testOpenCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	a := create(t, s, newCmd("d1"))
	b := create(t, s, newCmd("d2"))
	c := create(t, s, newCmd("d1"))
	d := create(t, s, newCmd("d3"))
	e := create(t, s, newCmd("d2"))
	setState(t, s, b.ID, companion.StateSent)
	setState(t, s, c.ID, companion.StateDelivered)
	setState(t, s, d.ID, companion.StateExpired)
	setState(t, s, e.ID, companion.StateInProgress)

	tests := []struct {
		states []string
		want   []string
	}{
		{nil, []string{a.ID, b.ID, c.ID, e.ID}},
		{[]string{companion.StateQueued}, []string{a.ID}},
		{[]string{companion.StateQueued, companion.StateSent}, []string{a.ID, b.ID}},
		{[]string{companion.StateInProgress, companion.StateDelivered}, []string{c.ID, e.ID}},
		{[]string{companion.StateExpired}, nil},
		{[]string{companion.StateSucceeded, companion.StateExpired}, nil},
	}
	for _, tt := range tests {
		got, err := s.OpenCommands(ctx, tt.states...)
		require.NoError(t, err)
		if !slices.Equal(ids(got), tt.want) {
			t.Errorf("OpenCommands(%v) = %v; want %v (oldest first)", tt.states, ids(got), tt.want)
		}
	}
	// The queued ones, oldest first, follow their states.
	f := create(t, s, newCmd("d3"))
	g := create(t, s, newCmd("d1"))
	got, err := s.OpenCommands(ctx, companion.StateQueued)
	require.NoError(t, err)
	assert.Equal(t, []string{a.ID, f.ID, g.ID}, ids(got), "OpenCommands(queued)")
	setState(t, s, a.ID, companion.StateSent)
	setState(t, s, g.ID, companion.StateCanceled)
	got, err = s.OpenCommands(ctx, companion.StateQueued)
	require.NoError(t, err)
	assert.Equal(t, []string{f.ID}, ids(got), "OpenCommands(queued) after a sent, g canceled")
	got, err = s.OpenCommands(ctx)
	require.NoError(t, err)
	for _, c := range got {
		if companion.IsFinal(c.State) {
			t.Errorf("OpenCommands() gave %s in %s", c.ID, c.State)
		}
	}
	assert.Equal(t, []string{a.ID, b.ID, c.ID, e.ID, f.ID}, ids(got), "OpenCommands()")
}

// QueuedCommandsWith returns every queued command but those of the devices
// skipped, and the other open commands of the devices asked for (asked for
// and skipped: all their open ones), oldest first, never a final one nor
// another device's that is not queued.
func testQueuedCommandsWith(t *testing.T, s companion.Store) {
	ctx := t.Context()
	a := create(t, s, newCmd("d1"))
	b := create(t, s, newCmd("d2"))
	c := create(t, s, newCmd("d1"))
	d := create(t, s, newCmd("d3"))
	e := create(t, s, newCmd("d2"))
	f := create(t, s, newCmd("d3"))
	g := create(t, s, newCmd("d1"))
	h := create(t, s, newCmd("d2"))
	setState(t, s, b.ID, companion.StateSent)
	setState(t, s, c.ID, companion.StateDelivered)
	setState(t, s, d.ID, companion.StateSent)
	setState(t, s, e.ID, companion.StateInProgress)
	setState(t, s, g.ID, companion.StateSucceeded)
	setState(t, s, h.ID, companion.StateCanceled)

	tests := []struct {
		devices, skip []string
		want          []string
	}{
		{nil, nil, []string{a.ID, f.ID}},
		{[]string{"d1"}, nil, []string{a.ID, c.ID, f.ID}},
		{[]string{"d2"}, nil, []string{a.ID, b.ID, e.ID, f.ID}},
		{[]string{"d3", "d1"}, nil, []string{a.ID, c.ID, d.ID, f.ID}},
		{[]string{"d1", "d2", "d3"}, nil, []string{a.ID, b.ID, c.ID, d.ID, e.ID, f.ID}},
		{[]string{"d9"}, nil, []string{a.ID, f.ID}},
		{nil, []string{"d1"}, []string{f.ID}},
		{nil, []string{"d3", "d1"}, []string{}},
		{nil, []string{"d9"}, []string{a.ID, f.ID}},
		{[]string{"d2"}, []string{"d3"}, []string{a.ID, b.ID, e.ID}},
		{[]string{"d3"}, []string{"d1"}, []string{d.ID, f.ID}},
		{[]string{"d1"}, []string{"d1"}, []string{a.ID, c.ID, f.ID}},
	}
	for _, tt := range tests {
		got, err := s.QueuedCommandsWith(ctx, tt.devices, tt.skip)
		require.NoError(t, err)
		if !slices.Equal(ids(got), tt.want) {
			t.Errorf("QueuedCommandsWith(%v, skip %v) = %v; want %v (oldest first)", tt.devices, tt.skip, ids(got), tt.want)
		}
		for _, c := range got {
			if c.DeviceID == "" || c.Op == "" || c.ExpiresAt.IsZero() {
				t.Errorf("QueuedCommandsWith(%v, skip %v) gave %s without its fields: %+v", tt.devices, tt.skip, c.ID, c)
			}
		}
	}
	// Each in the state it is in now.
	setState(t, s, a.ID, companion.StateSent)
	setState(t, s, b.ID, companion.StateQueued)
	got, err := s.QueuedCommandsWith(ctx, []string{"d3"}, nil)
	require.NoError(t, err)
	assert.Equal(t, []string{b.ID, d.ID, f.ID}, ids(got), "QueuedCommandsWith(d3) after a sent, b queued again")
	for _, c := range got {
		want := map[string]string{b.ID: companion.StateQueued, d.ID: companion.StateSent, f.ID: companion.StateQueued}[c.ID]
		assert.Equal(t, want, c.State, "state of %s", c.ID)
	}
}

// SentCommandsOnline returns the sent commands of the devices whose status
// reads online, oldest first: not those of a device offline or never
// reported, nor a queued, delivered or final one.
func testSentCommandsOnline(t *testing.T, s companion.Store) {
	ctx := t.Context()
	serve(t, s, "b1", "d1", "d2", "d3")
	bind(t, s, "u1", "d1", "d2", "d3")
	status := func(dev string, online bool, seq uint64) {
		t.Helper()
		ok, err := s.PutStatus(ctx, companion.Status{DeviceID: dev, Online: online, BridgeID: "b1", Seq: seq, LastSeen: time.Now()})
		require.NoError(t, err)
		require.True(t, ok, "status %d of %s", seq, dev)
	}
	status("d1", true, 1)
	status("d2", false, 1)
	long := newCmd("d1")
	long.ExpiresAt = time.Now().Add(48 * time.Hour) // expires after the later ones: ids, not expiry, order the answer
	a := create(t, s, long)
	b := create(t, s, newCmd("d2"))
	c := create(t, s, newCmd("d1"))
	d := create(t, s, newCmd("d3")) // never reported
	e := create(t, s, newCmd("d1"))
	f := create(t, s, newCmd("d1"))
	g := create(t, s, newCmd("d1"))
	for _, id := range []string{a.ID, b.ID, c.ID, d.ID, e.ID, f.ID} {
		setState(t, s, id, companion.StateSent)
	}
	setState(t, s, e.ID, companion.StateDelivered)
	setState(t, s, f.ID, companion.StateSucceeded)
	_ = g // queued

	got, err := s.SentCommandsOnline(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{a.ID, c.ID}, ids(got), "SentCommandsOnline (oldest first)")
	for _, cmd := range got {
		assert.Equal(t, companion.StateSent, cmd.State, "state of %s", cmd.ID)
		assert.Equal(t, "d1", cmd.DeviceID, "device of %s", cmd.ID)
	}

	status("d1", false, 2)
	status("d2", true, 2)
	status("d3", true, 1)
	got, err = s.SentCommandsOnline(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{b.ID, d.ID}, ids(got), "SentCommandsOnline after d1 went offline, d2 and d3 online")
}

// ExpiredCommands returns the commands the bridge does not have yet
// (queued or sent) whose ExpiresAt is before the time given, soonest
// first.
func testExpiredCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	base := now()
	mk := func(ttl time.Duration) companion.Command {
		t.Helper()
		c := newCmd("d")
		c.ExpiresAt = base.Add(ttl)
		return create(t, s, c)
	}
	c, a, b := mk(time.Hour), mk(time.Minute), mk(2*time.Minute)
	expired := func(at time.Duration) []string {
		t.Helper()
		got, err := s.ExpiredCommands(ctx, base.Add(at))
		require.NoError(t, err, "ExpiredCommands(+%v)", at)
		return ids(got)
	}

	assert.Empty(t, expired(0), "expired at +0")
	assert.Empty(t, expired(time.Minute), "expired at +1m: ExpiresAt is not before it")
	assert.Equal(t, []string{a.ID}, expired(time.Minute+time.Second), "expired at +1m1s")
	setState(t, s, a.ID, companion.StateSent)
	setState(t, s, b.ID, companion.StateDelivered)
	assert.Equal(t, []string{a.ID}, expired(90*time.Second), "expired at +90s: a is sent, so it still expires")
	assert.Equal(t, []string{a.ID, c.ID}, expired(2*time.Hour), "expired at +2h: a, c soonest first (b is delivered: the bridge has it)")

	// An UpdateCommand that changes ExpiresAt moves it.
	_, err := s.UpdateCommand(ctx, c.ID, func(cmd *companion.Command) error {
		cmd.ExpiresAt = base.Add(30 * time.Second)
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{c.ID}, expired(time.Minute), "expired at +1m after c's ExpiresAt moved to +30s")
	assert.Equal(t, []string{c.ID, a.ID}, expired(2*time.Hour), "expired at +2h after c's ExpiresAt moved")

	setState(t, s, a.ID, companion.StateExpired)
	setState(t, s, c.ID, companion.StateCanceled)
	assert.Empty(t, expired(2*time.Hour), "expired after a and c went final")
}

func testCountOpen(t *testing.T, s companion.Store) {
	assert.Equal(t, 0, countOpen(t, s, "nobody"), "CountOpen(a device without commands)")
	assert.Equal(t, 0, countOpen(t, s, ""), `CountOpen("")`)
	a := create(t, s, newCmd("d1"))
	create(t, s, newCmd("d1"))
	create(t, s, newCmd("d10"))
	assert.Equal(t, 2, countOpen(t, s, "d1"))
	assert.Equal(t, 1, countOpen(t, s, "d10"))
	setState(t, s, a.ID, companion.StateExpired)
	assert.Equal(t, 1, countOpen(t, s, "d1"))
	// A refused move to a final state leaves the count.
	_, err := s.UpdateCommand(t.Context(), a.ID, func(c *companion.Command) error { c.State = companion.StateFailed; return nil })
	assert.ErrorIs(t, err, companion.ErrFinal)
	assert.Equal(t, 1, countOpen(t, s, "d1"))
	all, err := s.CountAllOpen(t.Context())
	require.NoError(t, err)
	assert.Equal(t, 2, all, "CountAllOpen: d1's one and d10's")
}

// PurgeCommands deletes final commands that last changed before the time
// given, with their place in the device's history; open ones never.
func testPurgeCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	finish := func(id string) companion.Command {
		t.Helper()
		return setState(t, s, id, companion.StateSucceeded)
	}
	oldDone := finish(create(t, s, newCmd("d1")).ID)
	oldOpen := create(t, s, newCmd("d1")) // never finishes: must survive
	// The store's clock must move between the two finishes; sleeping is
	// the only way to move a clock the suite cannot set.
	time.Sleep(20 * time.Millisecond)
	newC := create(t, s, newCmd("d1"))
	newDone := finish(newC.ID)
	require.True(t, newC.CreatedAt.After(oldDone.UpdatedAt), "the store's clock did not move in 20ms: %v, %v", oldDone.UpdatedAt, newC.CreatedAt)
	cut := oldDone.UpdatedAt.Add(newC.CreatedAt.Sub(oldDone.UpdatedAt) / 2)

	n, err := s.PurgeCommands(ctx, oldDone.CreatedAt.Add(-time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "PurgeCommands(before everything)")
	n, err = s.PurgeCommands(ctx, cut)
	require.NoError(t, err)
	assert.Equal(t, 1, n, "PurgeCommands(between the two finishes)")
	_, err = s.Command(ctx, oldDone.ID)
	assert.ErrorIs(t, err, companion.ErrNotFound, "Command(purged)")
	for _, id := range []string{oldOpen.ID, newDone.ID} {
		_, err := s.Command(ctx, id)
		assert.NoError(t, err, "Command(%s): want kept", id)
	}
	hist, _, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1"})
	require.NoError(t, err)
	assert.Equal(t, []string{newDone.ID, oldOpen.ID}, ids(hist), "history after purge")
	page, more, err := s.ListCommands(ctx, companion.CommandQuery{DeviceID: "d1", Limit: 2})
	require.NoError(t, err)
	assert.Len(t, page, 2)
	assert.False(t, more, "more after purge: the purged command does not follow")

	n, err = s.PurgeCommands(ctx, newDone.UpdatedAt.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 1, n, "PurgeCommands(after everything): only the final one")
	_, err = s.Command(ctx, oldOpen.ID)
	assert.NoError(t, err, "Command(open) after purging everything final")
	assert.Equal(t, 1, countOpen(t, s, "d1"))
	n, err = s.PurgeCommands(ctx, newDone.UpdatedAt.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 0, n, "PurgeCommands again")
}

// PurgeCommands returns the total however the engine splits the work.
func testPurgeMany(t *testing.T, s companion.Store) {
	const total = 27
	var last companion.Command
	for range total {
		c := create(t, s, newCmd("d"))
		last = setState(t, s, c.ID, companion.StateFailed)
	}
	create(t, s, newCmd("d"))
	n, err := s.PurgeCommands(t.Context(), last.UpdatedAt.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, total, n, "PurgeCommands")
	hist, _, err := s.ListCommands(t.Context(), companion.CommandQuery{DeviceID: "d"})
	require.NoError(t, err)
	assert.Len(t, hist, 1, "history after purge")
}

// sameCommand fails the test unless a and b are the same command, times
// compared as instants.
func sameCommand(t *testing.T, what string, a, b companion.Command) {
	t.Helper()
	norm := func(c companion.Command) companion.Command {
		c.CreatedAt, c.UpdatedAt, c.ExpiresAt = c.CreatedAt.UTC(), c.UpdatedAt.UTC(), c.ExpiresAt.UTC()
		c.Payload, c.Result = canonicalJSON(t, c.Payload), canonicalJSON(t, c.Result)
		return c
	}
	assert.Equal(t, norm(b), norm(a), what)
}

// canonicalJSON rewrites a JSON value with sorted keys and no spaces, so
// that an engine may keep JSON in any equivalent form; nil when empty.
func canonicalJSON(t *testing.T, v json.RawMessage) json.RawMessage {
	t.Helper()
	if len(v) == 0 {
		return nil
	}
	var x any
	if err := json.Unmarshal(v, &x); err != nil {
		t.Errorf("stored JSON %q: %v", v, err)
		return v
	}
	out, err := json.Marshal(x)
	if err != nil {
		t.Errorf("JSON %q: %v", v, err)
		return v
	}
	return out
}
