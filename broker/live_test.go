package broker

import (
	"context"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion/internal/testenv"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/topics"
)

// waitAnswer runs Wait for id with a ctx that has no deadline (it ends with
// the test) and returns its answer, failing t if none comes within 10 s:
// Wait must answer on its own, not because its time ran out.
func waitAnswer(t *testing.T, e *env, id string) companion.Command {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	type answer struct {
		cmd companion.Command
		err error
	}
	got := make(chan answer, 1)
	go func() {
		c, err := e.b.Wait(ctx, id)
		got <- answer{c, err}
	}()
	select {
	case a := <-got:
		require.NoError(t, a.err)
		return a.cmd
	case <-time.After(10 * time.Second):
		t.Fatalf("Wait(%s) did not answer", id)
		return companion.Command{}
	}
}

func liveCount(e *env) int {
	e.b.mu.Lock()
	defer e.b.mu.Unlock()
	return len(e.b.live)
}

// Commands accepted here that another replica finishes (it took the final
// reply, or the user canceled there) do not stay live here: live does not
// grow without bound, and a Wait for one reads the final state from the
// store instead of waiting for a notify that never comes (CONTRACT §11).
func TestCommandsFinishedByAnotherReplicaAreNotLive(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	var last companion.Command
	for range 50 {
		last = submit(t, e, "dev-1", "x", time.Hour)
		// The other replica's write, then its notification.
		_, err := e.db.UpdateCommand(ctx, last.ID, func(c *companion.Command) error {
			c.State = companion.StateSucceeded
			return nil
		})
		require.NoError(t, err)
		e.b.CommandChanged(ctx, last.ID)
	}
	assert.Zero(t, liveCount(e), "commands finished elsewhere still live here")
	assert.Equal(t, companion.StateSucceeded, waitAnswer(t, e, last.ID).State)
}

// A reply that reaches this replica after another one stored a later
// state takes the command out of live, even before the other replica's
// notification arrives: a final reply after a final state (ErrFinal here;
// its waiters here are answered), or one older than the stored state
// (errStale: this replica no longer follows it, and a Wait reads the
// store).
func TestAReplyAfterAnotherReplicasEndsItsLife(t *testing.T) {
	for _, tt := range []struct {
		name          string
		stored, reply string
	}{
		{"final after final", companion.StateSucceeded, companion.StateSucceeded},
		{"older than stored", companion.StateInProgress, companion.StateDelivered},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, true)
			fb := connectBridge(t, e)
			ctx := context.Background()
			c := submit(t, e, "dev-1", "x", time.Hour)
			require.Equal(t, c.ID, fb.next(t).ID)
			_, err := e.db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
				c.State = tt.stored
				return nil
			})
			require.NoError(t, err)
			fb.reply(t, "dev-1", topics.Reply{CommandID: c.ID, State: tt.reply, At: time.Now()})
			// Replies are taken in order: once the marker's is taken (its
			// waiter answered), so is c's.
			marker := submit(t, e, "dev-1", "marker", time.Hour)
			require.Equal(t, marker.ID, fb.next(t).ID)
			fb.reply(t, "dev-1", topics.Reply{CommandID: marker.ID, State: companion.StateSucceeded, At: time.Now()})
			require.Equal(t, companion.StateSucceeded, waitAnswer(t, e, marker.ID).State)

			assert.Zero(t, liveCount(e), "a command another replica moved on is still live here")
			assert.Equal(t, tt.stored, state(t, e, c.ID).State, "the late reply changed nothing")
			if companion.IsFinal(tt.stored) {
				assert.Equal(t, tt.stored, waitAnswer(t, e, c.ID).State)
			}
		})
	}
}

// Release answers the waits under way and those that come after it with
// the command's latest state, as when their time runs out: a server that
// shuts down lets its held Prefer: wait requests finish at once.
func TestReleaseAnswersWaiters(t *testing.T) {
	e := newEnv(t, false)
	c := submit(t, e, "dev-1", "x", time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan companion.Command, 1)
	go func() {
		cmd, _ := e.b.Wait(ctx, c.ID) // an error shows as an empty command
		got <- cmd
	}()
	testenv.Eventually(t, 10*time.Second, "a waiter", func() bool {
		e.b.mu.Lock()
		defer e.b.mu.Unlock()
		return len(e.b.waiters[c.ID]) == 1
	})
	e.b.Release()
	select {
	case cmd := <-got:
		assert.Equal(t, c.ID, cmd.ID)
		assert.Equal(t, companion.StateQueued, cmd.State, "its latest state")
	case <-time.After(10 * time.Second):
		t.Fatal("Release did not answer the waiter")
	}
	assert.Equal(t, companion.StateQueued, waitAnswer(t, e, c.ID).State, "a Wait after Release")
}

// heldCreates is the store with the callback of the command it creates
// held until release is closed: as on PostgreSQL, whose lanes call back
// after their own commit, when other writes (an unbinding) may have
// committed and returned already.
type heldCreates struct {
	*store.DB
	created chan companion.Command
	release chan struct{}
}

func (h *heldCreates) CreateCommandAsync(c companion.Command, maxOpen int, idem *companion.Idempotency, done func(companion.Command, bool, error)) {
	h.DB.CreateCommandAsync(c, maxOpen, idem, func(cmd companion.Command, replayed bool, err error) {
		h.created <- cmd
		go func() {
			<-h.release
			done(cmd, replayed, err)
		}()
	})
}

// submitHeld submits a text for dev-1 of u1 on a broker whose store holds
// the callback of its creation (heldCreates): it returns once the command
// is created, with the broker, the command, and what Submit returns once
// release is closed.
func submitHeld(t *testing.T) (*env, *heldCreates, companion.Command, <-chan error) {
	t.Helper()
	e, hold := newEnvOn(t, func(db *store.DB) *heldCreates {
		return &heldCreates{DB: db, created: make(chan companion.Command, 1), release: make(chan struct{})}
	})
	accepted := make(chan error, 1)
	go func() {
		_, _, err := e.b.Submit(context.Background(), companion.Command{DeviceID: "dev-1", UserID: "u1", Op: topics.OpPushText,
			Payload: []byte(`{"text":"the previous owner's"}`), ExpiresAt: e.clock.Now().Add(time.Hour)}, nil)
		accepted <- err
	}()
	return e, hold, <-hold.created, accepted
}

// A command ended (its device unbound) before the store called back its
// acceptance is final: a Prefer: wait on it is answered at once, as on any
// ended command, and it is neither live here nor handed to the outbox.
func TestACommandEndedBeforeItsAcceptanceCalledBackIsFinal(t *testing.T) {
	e, hold, cmd, accepted := submitHeld(t)
	unbound, err := e.db.Unbind(context.Background(), "dev-1", "u1")
	require.NoError(t, err)
	require.Len(t, unbound.Ended, 1)
	e.b.Ended(unbound.Ended)
	close(hold.release)
	require.NoError(t, <-accepted)

	assert.Zero(t, liveCount(e), "the ended command is live")
	assert.Equal(t, companion.StateCanceled, waitAnswer(t, e, cmd.ID).State)
}

// The same, when another replica took the unbinding (bug 232): this one
// hears of it only through the store's notifications (CommandChanged), of
// its own creation and then of the unbinding, both before the store calls
// back the acceptance. A Prefer: wait on the command is answered at once.
func TestACommandEndedByAnotherReplicaBeforeItsAcceptanceCalledBackIsFinal(t *testing.T) {
	e, hold, cmd, accepted := submitHeld(t)
	ctx := context.Background()
	e.b.CommandChanged(ctx, cmd.ID) // its creation's notification
	unbound, err := e.db.Unbind(ctx, "dev-1", "u1")
	require.NoError(t, err)
	require.Len(t, unbound.Ended, 1)
	e.b.CommandChanged(ctx, cmd.ID) // the other replica's unbinding
	close(hold.release)
	require.NoError(t, <-accepted)

	assert.Zero(t, liveCount(e), "the command ended by another replica is live")
	assert.Equal(t, companion.StateCanceled, waitAnswer(t, e, cmd.ID).State)
}

// Commands accepted here that another replica ended while this replica's
// notifications were lost (its listener reconnecting, or not LISTENing
// yet as it started) are not live here once the listener says so
// (CommandChanged("")): a later Wait for one reads the store rather than
// wait out its time (bug 253). So too one whose acceptance the store calls
// back only after that (bug 232's case, its notifications lost).
func TestCommandsEndedWhileNotificationsWereLostAreNotLive(t *testing.T) {
	t.Run("accepted", func(t *testing.T) {
		e := newEnv(t, false)
		ctx := context.Background()
		c := submit(t, e, "dev-1", "x", time.Hour)
		_, err := e.db.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
			c.State = companion.StateSucceeded
			return nil
		})
		require.NoError(t, err)
		e.b.CommandChanged(ctx, "") // its notification lost
		assert.Zero(t, liveCount(e), "a command ended elsewhere while notifications were lost is live")
		assert.Equal(t, companion.StateSucceeded, waitAnswer(t, e, c.ID).State)
	})
	t.Run("called back after", func(t *testing.T) {
		e, hold, cmd, accepted := submitHeld(t)
		ctx := context.Background()
		unbound, err := e.db.Unbind(ctx, "dev-1", "u1") // another replica's
		require.NoError(t, err)
		require.Len(t, unbound.Ended, 1)
		e.b.CommandChanged(ctx, "") // both notifications lost
		close(hold.release)
		require.NoError(t, <-accepted)
		assert.Zero(t, liveCount(e), "a command ended elsewhere while notifications were lost is live")
		assert.Equal(t, companion.StateCanceled, waitAnswer(t, e, cmd.ID).State)
	})
}
