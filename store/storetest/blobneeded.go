package storetest

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testBlobNeeded(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"Rules", testBlobNeededRules},
		{"FollowsTheCommandsBlob", testBlobNeededFollowsTheCommand},
	})
}

// BlobNeeded: a bridge may download a blob exactly while an unfinished
// command of a device it serves now references it (CONTRACT §9).
func testBlobNeededRules(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	bind(t, s, "u1", "d3") // a store takes a user's commands for their own devices only
	assign(t, s, "d1", "op1", "")
	assign(t, s, "d2", "op2", "")
	shaA, shaB := strings.Repeat("a", 64), strings.Repeat("b", 64)
	withBlob := func(dev, sha string) companion.Command {
		c := newCmd(dev)
		c.Op, c.Payload, c.Blob = "push.image", raw(`{"blob":{"sha256":"`+sha+`"}}`), sha
		return create(t, s, c)
	}
	needed := func(sha, bridge string, want bool) {
		t.Helper()
		if got, err := s.BlobNeeded(ctx, sha, bridge); err != nil || got != want {
			t.Errorf("BlobNeeded(%.4s…, %q) = %v, %v; want %v", sha, bridge, got, err, want)
		}
	}

	needed(shaA, "op1", false) // nothing references it yet
	a1, a2 := withBlob("d1", shaA), withBlob("d1", shaA)
	b3 := withBlob("d3", shaB) // d3: no bridge serves it
	d2 := newCmd("d2")
	d2.UserID = "u2" // d2's owner
	create(t, s, d2)
	needed(shaA, "op1", true)
	needed(shaA, "op2", false) // another bridge's device
	needed(shaB, "op1", false)
	needed(shaB, "op2", false)
	needed(strings.Repeat("c", 64), "op1", false)
	needed(shaA, "nope", false)
	needed("", "op1", false)
	needed(shaA, "", false)

	assign(t, s, "d3", "op2", "")
	needed(shaB, "op2", true)

	// While one command still needs it, the blob stays needed; a command
	// that moved on but is not final still needs it.
	setState(t, s, a1.ID, companion.StateSucceeded)
	needed(shaA, "op1", true)
	setState(t, s, a2.ID, companion.StateInProgress)
	needed(shaA, "op1", true)
	// Moving the device moves the right.
	assign(t, s, "d1", "op2", "")
	needed(shaA, "op1", false)
	needed(shaA, "op2", true)
	setState(t, s, a2.ID, companion.StateFailed)
	setState(t, s, b3.ID, companion.StateExpired)
	needed(shaA, "op2", false)
	needed(shaB, "op2", false)

	// A user's own bridge: only while it serves the device.
	a4 := withBlob("d4", shaA)
	needed(shaA, "u1-hub", false)
	assign(t, s, "d4", "u1-hub", "u1")
	needed(shaA, "u1-hub", true)
	if _, err := s.Unbind(ctx, "d4", "u1"); err != nil {
		t.Fatalf("Unbind(d4) = %v", err)
	}
	needed(shaA, "u1-hub", false)
	// The unbind ended a4 too: the device's next bridge may not have it.
	assign(t, s, "d4", "op1", "")
	needed(shaA, "op1", false)
	if c, err := s.Command(ctx, a4.ID); err != nil || !companion.IsFinal(c.State) {
		t.Errorf("a4 after the unbind = %s, %v; want it final", c.State, err)
	}
	// A deleted bridge serves nothing.
	bind(t, s, "u1", "d4") // bound again, for a command of u1's
	a5 := withBlob("d4", shaA)
	needed(shaA, "op1", true)
	if _, err := s.DeleteBridge(ctx, "op1", ""); err != nil {
		t.Fatalf("DeleteBridge(op1) = %v", err)
	}
	needed(shaA, "op1", false)
	setState(t, s, a5.ID, companion.StateCanceled)
}

// What keeps a blob needed is the blob an unfinished command references
// now. UpdateCommand's fn may change any field but the id, the device and
// the creation time: a command whose Blob it changes needs the new blob
// and no longer the old, for BlobNeeded and PurgeBlobs alike, and needs
// neither once it is final.
func testBlobNeededFollowsTheCommand(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	assign(t, s, "d1", "op1", "")
	put := func(content string) string {
		t.Helper()
		b, err := s.PutBlob(ctx, bytes.NewReader([]byte(content)), 0)
		require.NoError(t, err, "PutBlob(%s)", content)
		return b.SHA256
	}
	shaA, shaB := put("first image"), put("second image")
	needed := func(sha string, want bool) {
		t.Helper()
		if got, err := s.BlobNeeded(ctx, sha, "op1"); err != nil || got != want {
			t.Errorf("BlobNeeded(%.4s…, op1) = %v, %v; want %v", sha, got, err, want)
		}
	}
	// Every blob counts as stored before a cut an hour ahead: only what
	// references a blob keeps it.
	purge := func(want int, what string) {
		t.Helper()
		n, err := s.PurgeBlobs(ctx, time.Now().Add(time.Hour))
		require.NoError(t, err)
		assert.Equal(t, want, n, "PurgeBlobs %s", what)
	}
	stored := func(sha string, want bool) {
		t.Helper()
		_, err := s.Blob(ctx, sha)
		if (err == nil) != want {
			t.Errorf("Blob(%.4s…) = %v; want it there: %v", sha, err, want)
		}
	}

	c := newCmd("d1")
	c.Op, c.Blob = "push.image", shaA
	c = create(t, s, c)
	needed(shaA, true)
	needed(shaB, false)

	_, err := s.UpdateCommand(ctx, c.ID, func(c *companion.Command) error {
		c.State, c.Blob = companion.StateSent, shaB
		return nil
	})
	require.NoError(t, err, "UpdateCommand(→ sent, other blob)")
	needed(shaA, false)
	needed(shaB, true)
	purge(1, "after the command's blob changed")
	stored(shaA, false)
	stored(shaB, true)

	setState(t, s, c.ID, companion.StateSucceeded)
	needed(shaB, false)
	purge(1, "after the command ended")
	stored(shaB, false)
}
