package storetest

import (
	"encoding/json"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

// settingsCmd is a settings.update command of the user ("" none) for the
// device, as the API submits one: it records desired (name → JSON value)
// as the device's desired settings when it is created.
func settingsCmd(dev, user string, desired map[string]string) companion.Command {
	d := make(map[string]json.RawMessage, len(desired))
	for k, v := range desired {
		d[k] = raw(v)
	}
	payload, err := json.Marshal(map[string]any{"settings": d})
	if err != nil {
		payload = raw(`{"settings":{}}`) // a test's value that is not JSON
	}
	return companion.Command{DeviceID: dev, UserID: user, Op: "settings.update", Payload: payload, Desired: d, ExpiresAt: now().Add(time.Hour)}
}

// desire stores a settings command recording desired, or fails the test.
func desire(t testing.TB, s companion.Store, dev, user string, desired map[string]string) companion.Command {
	t.Helper()
	c := create(t, s, settingsCmd(dev, user, desired))
	assert.Nil(t, c.Desired, "CreateCommand returned Desired")
	return c
}

// desired returns the device's desired settings or fails the test.
func desired(t testing.TB, s companion.Store, dev string) map[string]json.RawMessage {
	t.Helper()
	st, err := s.Settings(t.Context(), dev)
	require.NoError(t, err, "Settings(%s)", dev)
	return st.Desired
}

// Desired settings change with the settings commands that carry them,
// in the order of the commands: of two commands for one key, the one
// with the higher id (run later by the device, and reported last) wins,
// however their writes overlap (PUT …/settings, CONTRACT §2 and §8).
func testDesiredFollowsTheCommands(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")

	a := desire(t, s, "d1", "u1", map[string]string{"volume": "3", "brightness": "10"})
	b := desire(t, s, "d1", "u1", map[string]string{"volume": "7"})
	require.Less(t, a.ID, b.ID)
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "7", "brightness": "10"}),
		"Desired after A then B = %s; want B's volume over A's, A's brightness kept", got)
	stored, err := s.Command(ctx, b.ID)
	require.NoError(t, err)
	assert.Nil(t, stored.Desired, "Command read back has Desired")

	// Many at once, as a slider sends them, or several replicas.
	const n = 20
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		vols = map[string]int{} // command id → its volume
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vol := 20 + i
			c, replay, err := s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": strconv.Itoa(vol)}), 0, nil)
			if !assert.NoError(t, err, "CreateCommand(volume %d)", vol) || !assert.False(t, replay) {
				return
			}
			mu.Lock()
			vols[c.ID] = vol
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, vols, n)
	last := ""
	for id := range vols {
		last = max(last, id)
	}
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": strconv.Itoa(vols[last]), "brightness": "10"}),
		"Desired after %d concurrent commands = %s; want volume %d, of the highest id %s", n, got, vols[last], last)
}

// A create that does not store a command records no desired settings:
// a replay of an Idempotency-Key (its request overlapped the first, so
// that it reached the store), a conflict, a full queue, a value that is
// not JSON.
func testDesiredOnlyWithTheCommand(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")
	idem := func(hash string) *companion.Idempotency {
		return &companion.Idempotency{UserID: "u1", Key: "k-A", RequestHash: hashOf(hash), Status: 202}
	}

	first, replay, err := s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": "3"}), 0, idem("A"))
	require.NoError(t, err)
	require.False(t, replay, "first CreateCommand with k-A replayed")
	desire(t, s, "d1", "u1", map[string]string{"volume": "7"})
	before, err := s.Settings(ctx, "d1")
	require.NoError(t, err)

	again, replay, err := s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": "3"}), 0, idem("A"))
	require.NoError(t, err, "repeat of k-A")
	assert.True(t, replay, "repeat of k-A replayed")
	assert.Equal(t, first.ID, again.ID, "repeat of k-A answers the first command")
	assert.Nil(t, again.Desired, "a replay returned Desired")
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "7"}), "Desired after a replay = %s; want the later command's volume 7", got)

	_, _, err = s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": "4"}), 0, idem("other"))
	assert.ErrorIs(t, err, companion.ErrIdemConflict, "k-A with another request")
	_, _, err = s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": "5"}), 2, nil)
	assert.ErrorIs(t, err, companion.ErrQueueFull, "a third open command with maxOpen 2")
	_, _, err = s.CreateCommand(ctx, settingsCmd("d1", "u1", map[string]string{"volume": "6", "x": "{"}), 0, nil)
	assert.ErrorIs(t, err, companion.ErrInvalid, "a desired value that is not JSON")
	_, _, err = s.CreateCommand(ctx, settingsCmd("", "u1", map[string]string{"volume": "6"}), 0, nil)
	assert.ErrorIs(t, err, companion.ErrInvalid, "no device")

	after, err := s.Settings(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, equalRaw(after.Desired, map[string]string{"volume": "7"}), "Desired after refused creates = %s", after.Desired)
	assert.True(t, after.UpdatedAt.Equal(before.UpdatedAt), "Settings.UpdatedAt moved from %v to %v without a command", before.UpdatedAt, after.UpdatedAt)
	assert.Equal(t, 2, countOpen(t, s, "d1"), "open commands: the two created")
}

// A settings change that ends without succeeding (canceled, failed,
// expired) is no longer desired: nothing will apply it. Its settings
// leave the desired ones in the write that ends it, but those a later
// command asked for, which are that command's (bug 236: GET …/settings
// listed a canceled change as desired and pending for good).
func testDesiredWithdrawnWhenTheChangeEnds(t *testing.T, s companion.Store) {
	provision(t, s, "sim-1", "d1", "d2")
	bind(t, s, "u1", "d1", "d2")

	a := desire(t, s, "d1", "u1", map[string]string{"volume": "3", "brightness": "10"})
	b := desire(t, s, "d1", "u1", map[string]string{"volume": "7"})
	other := desire(t, s, "d2", "u1", map[string]string{"brightness": "10"})
	setState(t, s, a.ID, companion.StateCanceled)
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "7"}),
		"Desired after A canceled = %s; want A's brightness gone, B's volume kept", got)
	assert.True(t, equalRaw(desired(t, s, "d2"), map[string]string{"brightness": "10"}), "another device's desired settings changed")

	setState(t, s, b.ID, companion.StateInProgress)
	setState(t, s, b.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.Empty(t, got, "Desired after B failed = %s; want none", got)

	c := desire(t, s, "d1", "u1", map[string]string{"language": `"de"`})
	create(t, s, newCmd("d1")) // a later command that is no settings change
	setState(t, s, c.ID, companion.StateExpired)
	got = desired(t, s, "d1")
	assert.Empty(t, got, "Desired after C expired = %s; want none", got)

	d := desire(t, s, "d1", "u1", map[string]string{"volume": "9"})
	setState(t, s, d.ID, companion.StateSucceeded)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "9"}),
		"Desired after D succeeded = %s; want it until the device reports it", got)

	failed := setState(t, s, create(t, s, newCmd("d2")).ID, companion.StateFailed)
	require.Equal(t, companion.StateFailed, failed.State)
	assert.True(t, equalRaw(desired(t, s, "d2"), map[string]string{"brightness": "10"}), "a failed text push changed the desired settings")
	setState(t, s, other.ID, companion.StateSucceeded)
}

// A settings change that ends without succeeding gives each setting it
// asked for back to the latest earlier change still open that asked for
// it: that one is still to be sent or applied, and desired values follow
// the commands in id order; unless a change between them succeeded. A
// setting a later change still open asked for is that change's, whatever
// an earlier one asked; one a later change asked for that ended without
// succeeding too is not (bug 251: the setting left desired, and pending,
// until the earlier change ended).
func testDesiredBackToAnEarlierChange(t *testing.T, s companion.Store) {
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")

	a := desire(t, s, "d1", "u1", map[string]string{"volume": "3", "brightness": "10"})
	b := desire(t, s, "d1", "u1", map[string]string{"volume": "5"})
	c := desire(t, s, "d1", "u1", map[string]string{"volume": "7", "brightness": "20"})
	create(t, s, newCmd("d1")) // open, and no settings change
	setState(t, s, a.ID, companion.StateSent)
	setState(t, s, c.ID, companion.StateCanceled)
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "5", "brightness": "10"}),
		"Desired after C canceled = %s; want B's volume and A's brightness, the latest still open", got)

	setState(t, s, b.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "3", "brightness": "10"}),
		"Desired after B failed = %s; want A's volume, C's ended too", got)

	d := desire(t, s, "d1", "u1", map[string]string{"volume": "9"})
	e := desire(t, s, "d1", "u1", map[string]string{"volume": "11"})
	setState(t, s, d.ID, companion.StateExpired)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"volume": "11", "brightness": "10"}),
		"Desired after D expired under E = %s; want E's volume untouched", got)

	setState(t, s, a.ID, companion.StateSucceeded)
	setState(t, s, e.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"brightness": "10"}),
		"Desired after E failed = %s; want no volume: A, before it, is final", got)

	// A setting the device reported meanwhile stays out.
	f := desire(t, s, "d1", "u1", map[string]string{"volume": "13"})
	g := desire(t, s, "d1", "u1", map[string]string{"volume": "15"})
	ok, err := s.PutReportedSettings(t.Context(), "d1", "", map[string]json.RawMessage{"volume": raw("15")}, nil, now(), 1)
	require.NoError(t, err)
	require.True(t, ok, "PutReportedSettings applied")
	setState(t, s, g.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"brightness": "10"}),
		"Desired after G failed, its volume reported = %s; want no volume", got)
	setState(t, s, f.ID, companion.StateCanceled)

	// An earlier change still open under a later one that succeeded is
	// not given back: the device ran it before that one, whose final
	// reply brought the value it set.
	h := desire(t, s, "d1", "u1", map[string]string{"volume": "21"})
	i := desire(t, s, "d1", "u1", map[string]string{"volume": "23"})
	j := desire(t, s, "d1", "u1", map[string]string{"volume": "25"})
	setState(t, s, i.ID, companion.StateSucceeded)
	setState(t, s, j.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"brightness": "10"}),
		"Desired after J failed, I before it succeeded = %s; want no volume, not H's before I", got)
	setState(t, s, h.ID, companion.StateCanceled)

	// Nor the value of one the device reports already: it is applied.
	k := desire(t, s, "d1", "u1", map[string]string{"volume": "41"})
	ok, err = s.PutReportedSettings(t.Context(), "d1", "", map[string]json.RawMessage{"volume": raw("41")}, nil, now(), 2)
	require.NoError(t, err)
	require.True(t, ok, "PutReportedSettings applied")
	l := desire(t, s, "d1", "u1", map[string]string{"volume": "43"})
	setState(t, s, l.ID, companion.StateFailed)
	got = desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"brightness": "10"}),
		"Desired after L failed, K's volume reported = %s; want no volume", got)
	setState(t, s, k.ID, companion.StateSucceeded)
}

// A settings change that succeeded with a report older than the one
// stored (the device has reported since: a later change the store does
// not know of, as after a restore from a backup, set the key again) no
// longer leaves its values desired: the device ran it, and what it
// reports now is newer. Before, its value stayed desired, and
// GET …/settings listed the key as pending for good, with no command to
// apply it (docs/reliability.md, bug 399). A key a later change asked for
// stays that change's.
func testDesiredDroppedWhenTheChangeSucceededBehindANewerReport(t *testing.T, s companion.Store) {
	ctx := t.Context()
	provision(t, s, "sim-1", "d1")
	bind(t, s, "u1", "d1")
	a := desire(t, s, "d1", "u1", map[string]string{"volume": "80", "brightness": "10"})
	b := desire(t, s, "d1", "u1", map[string]string{"brightness": "20"})
	require.Less(t, a.ID, b.ID)
	setState(t, s, a.ID, companion.StateDelivered)
	_, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": raw("30"), "brightness": raw("5")}, nil, now(), 300)
	require.NoError(t, err)
	old, err := companion.NewReportedSettings(map[string]json.RawMessage{"volume": raw("80"), "brightness": raw("10")}, nil, now().Add(-time.Minute), 200)
	require.NoError(t, err)
	_, err = updateWithReport(t, s, a.ID, succeed, companion.DeviceReport{Settings: &old})
	require.NoError(t, err)
	got := desired(t, s, "d1")
	assert.True(t, equalRaw(got, map[string]string{"brightness": "20"}),
		"Desired after A succeeded with a report older than the stored one = %s; want only B's brightness (A's volume is not pending)", got)
}
