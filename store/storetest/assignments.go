package storetest

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testAssignments(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"AssignDevice", testAssignDevice},
		{"UnassignedReadsOffline", testUnassignedReadsOffline},
		{"UnbindUnassignsFromUsersBridge", testUnbindUnassigns},
		{"SeqForgottenThroughNoBridge", testSeqForgottenThroughNoBridge},
	})
}

// AssignDevice's rules, step by step on one store: the operator assigns
// any device to any of the operator's bridges, and a user's device to that
// user's bridges only; a user assigns only their own devices, to their
// own bridges only (or to none). A refused assignment changes nothing, and
// not-owned reads as not found.
func testAssignDevice(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	require.ErrorIs(t, companion.ErrNotOwned, companion.ErrNotFound, "ErrNotOwned is not an ErrNotFound: the API would tell them apart")
	steps := []struct {
		name               string
		dev, bridge, owner string
		wantPrev           string
		wantErr            error
		wantBridge         string // the device's bridge after the step
	}{
		{name: "unknown device", dev: "ghost", bridge: "op1", wantErr: companion.ErrNotFound},
		{name: "unknown bridge", dev: "d1", bridge: "nope", wantErr: companion.ErrNotFound},
		{name: "invalid device id", dev: "d1\x00", bridge: "op1", wantErr: companion.ErrNotFound},
		{name: "invalid bridge id", dev: "d1", bridge: "op\x001", wantErr: companion.ErrNotFound},
		{name: "operator assigns", dev: "d1", bridge: "op1", wantBridge: "op1"},
		{name: "operator moves", dev: "d1", bridge: "op2", wantPrev: "op1", wantBridge: "op2"},
		{name: "same bridge again", dev: "d1", bridge: "op2", wantPrev: "op2", wantBridge: "op2"},
		{name: "user to own bridge", dev: "d1", bridge: "u1-hub", owner: "u1", wantPrev: "op2", wantBridge: "u1-hub"},
		{name: "user to another user's bridge", dev: "d1", bridge: "u2-hub", owner: "u1", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user to an operator's bridge", dev: "d1", bridge: "op1", owner: "u1", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user to unknown bridge", dev: "d1", bridge: "nope", owner: "u1", wantErr: companion.ErrNotFound, wantBridge: "u1-hub"},
		{name: "another user's device", dev: "d1", bridge: "u2-hub", owner: "u2", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "another user's device to none", dev: "d1", owner: "u2", wantErr: companion.ErrNotOwned, wantBridge: "u1-hub"},
		{name: "user, unbound device", dev: "d3", bridge: "u1-hub", owner: "u1", wantErr: companion.ErrNotOwned},
		{name: "operator, u2's device to u1's bridge", dev: "d2", bridge: "u1-hub", wantErr: companion.ErrNotOwned},
		{name: "operator, unbound device to u1's bridge", dev: "d3", bridge: "u1-hub", wantErr: companion.ErrNotOwned},
		{name: "operator, u2's device to u2's bridge", dev: "d2", bridge: "u2-hub", wantBridge: "u2-hub"},
		{name: "operator, unbound device to op1", dev: "d3", bridge: "op1", wantBridge: "op1"},
		{name: "user unassigns own device", dev: "d1", owner: "u1", wantPrev: "u1-hub"},
		{name: "unassign again", dev: "d1", owner: "u1"},
		{name: "operator unassigns", dev: "d3", wantPrev: "op1"},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			prev, err := s.AssignDevice(ctx, st.dev, st.bridge, st.owner)
			if !errors.Is(err, st.wantErr) || (st.wantErr == companion.ErrNotFound && errors.Is(err, companion.ErrNotOwned)) {
				t.Fatalf("AssignDevice(%q, %q, %q) = %q, %v; want error %v", st.dev, st.bridge, st.owner, prev, err, st.wantErr)
			}
			if err == nil && prev != st.wantPrev {
				t.Errorf("AssignDevice(%q, %q, %q) = %q; want previous %q", st.dev, st.bridge, st.owner, prev, st.wantPrev)
			}
			if st.dev != "ghost" && !strings.ContainsRune(st.dev, 0) {
				wantBridge(t, s, st.dev, st.wantBridge)
			}
		})
	}
	// Lookups of what is not there answer "none", not an error.
	if got, err := s.DeviceBridge(ctx, "ghost"); err != nil || got != "" {
		t.Errorf("DeviceBridge(ghost) = %q, %v; want \"\", nil", got, err)
	}
	if got, err := s.DeviceBridges(ctx, []string{"ghost", "d1\x00", ""}); err != nil || len(got) != 0 {
		t.Errorf("DeviceBridges(ghost, invalid, empty) = %v, %v; want none", got, err)
	}
	if got, err := s.DeviceBridges(ctx, nil); err != nil || len(got) != 0 {
		t.Errorf("DeviceBridges(none) = %v, %v; want none", got, err)
	}
	if ok, err := s.BridgeServes(ctx, "nope", "d2"); err != nil || ok {
		t.Errorf("BridgeServes(nope, d2) = %v, %v; want false, nil", ok, err)
	}
	if got, err := s.ServedDevices(ctx, "nope"); err != nil || len(got) != 0 {
		t.Errorf("ServedDevices(nope) = %v, %v; want none", got, err)
	}
}

// A device no bridge serves any more reads offline (CONTRACT §9), whichever
// way it lost its bridge: unassigned, its bridge deleted, or unbound from
// its user's own bridge. Its Seq stays, so the next report applies. A
// device moved to another bridge reads offline, with no bridge, until that
// one reports (it may not have the device at all), and its Seq goes to 0:
// a seq is a bridge's own clock, and the new bridge's reports apply however
// far behind the old one's its clock is.
func testUnassignedReadsOffline(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	for _, a := range [][3]string{{"d1", "op1", ""}, {"d2", "op2", ""}, {"d3", "op2", ""}, {"d4", "u1-hub", "u1"}} {
		assign(t, s, a[0], a[1], a[2])
		_, err := s.PutStatus(ctx, companion.Status{DeviceID: a[0], Online: true, BridgeID: a[1], Seq: 7})
		require.NoError(t, err)
	}
	_, err := s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": json.RawMessage("7")}, nil, time.Now(), 7)
	require.NoError(t, err)
	online := func(dev string, want bool) {
		t.Helper()
		st, err := s.Status(ctx, dev)
		if err != nil || st.Online != want || st.Seq != 7 {
			t.Errorf("Status(%q) = online %v, seq %d, %v; want online %v, seq 7", dev, st.Online, st.Seq, err, want)
		}
		if !want && st.BridgeID != "" {
			t.Errorf("Status(%q).BridgeID = %q once no bridge serves it; want none", dev, st.BridgeID)
		}
	}

	assign(t, s, "d1", "op2", "")
	st, err := s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.False(t, st.Online, "d1 online after the move, before its new bridge reported it")
	assert.Empty(t, st.BridgeID, "Status(d1).BridgeID after the move, before its new bridge reported it")
	assert.Zero(t, st.Seq, "Status(d1).Seq after the move")
	ok, err := s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op2", Seq: 3, Battery: intp(55)})
	require.NoError(t, err)
	assert.True(t, ok, "the new bridge's report, its clock behind the old one's, applied")
	ok, err = s.PutReportedSettings(ctx, "d1", "", map[string]json.RawMessage{"volume": json.RawMessage("3")}, nil, time.Now(), 3)
	require.NoError(t, err)
	assert.True(t, ok, "the new bridge's settings, its clock behind the old one's, applied")
	assign(t, s, "d1", "op2", "")
	ok, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op2", Seq: 2})
	require.NoError(t, err)
	assert.False(t, ok, "an older report after an assignment to the same bridge applied")
	assign(t, s, "d1", "op1", "")
	_, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op1", Seq: 7})
	require.NoError(t, err)
	online("d1", true)
	assign(t, s, "d1", "", "")
	st, err = s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.False(t, st.Online, "d1 online after the unassignment")
	assert.Equal(t, uint64(7), st.Seq, "Status(d1).Seq after the unassignment")
	assert.Empty(t, st.BridgeID, "Status(d1).BridgeID after the unassignment")
	// d3 offline already (its bridge's Will), still naming op2.
	_, err = s.MarkBridgeOffline(ctx, "op2")
	require.NoError(t, err)
	_, err = s.PutStatus(ctx, companion.Status{DeviceID: "d2", Online: true, BridgeID: "op2", Seq: 7, LastSeen: time.Now()})
	require.NoError(t, err)
	_, err = s.DeleteBridge(ctx, "op2", "")
	require.NoError(t, err)
	online("d2", false)
	online("d3", false)
	devs, err := s.BridgeDevices(ctx, "op2")
	require.NoError(t, err)
	assert.Empty(t, devs, "BridgeDevices(op2) after it was deleted")
	_, err = s.Unbind(ctx, "d4", "u1")
	require.NoError(t, err)
	online("d4", false)
	ok, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op1", Seq: 8})
	require.NoError(t, err)
	assert.False(t, ok, "PutStatus(d1, seq 8) of the bridge it left, after the unassignment, applied") // bug 271
	online("d1", false)
	assign(t, s, "d1", "op1", "")
	ok, err = s.PutStatus(ctx, companion.Status{DeviceID: "d1", Online: true, BridgeID: "op1", Seq: 8})
	require.NoError(t, err)
	assert.True(t, ok, "PutStatus(d1, seq 8) once assigned again applied")
	st, err = s.Status(ctx, "d1")
	require.NoError(t, err)
	assert.True(t, st.Online, "d1 online after a newer report")
	assert.Equal(t, uint64(8), st.Seq, "Status(d1).Seq after a newer report")
}

// Unbind takes a device off its user's own bridge (which serves only that
// user's devices), but not off one of the operator's.
func testUnbindUnassigns(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	assign(t, s, "d1", "u1-hub", "u1")
	assign(t, s, "d4", "op1", "")
	got, err := s.Unbind(ctx, "d1", "u1")
	require.NoError(t, err, "Unbind(d1)")
	assert.Equal(t, "u1-hub", got.Bridge, "Unbind(d1) unassigned")
	wantBridge(t, s, "d1", "")
	got, err = s.Unbind(ctx, "d4", "u1")
	require.NoError(t, err, "Unbind(d4)")
	assert.Equal(t, "", got.Bridge, "Unbind(d4): nothing unassigned")
	wantBridge(t, s, "d4", "op1")

	// Bound to u2 now, d1 cannot go back on u1's bridge.
	bind(t, s, "u2", "d1")
	_, err = s.AssignDevice(ctx, "d1", "u1-hub", "u1")
	assert.ErrorIs(t, err, companion.ErrNotOwned, "AssignDevice(d1 of u2, u1-hub, u1)")
	_, err = s.AssignDevice(ctx, "d1", "u1-hub", "")
	assert.ErrorIs(t, err, companion.ErrNotOwned, "AssignDevice(d1 of u2, u1-hub, operator)")
	wantBridge(t, s, "d1", "")
}

// A device that reaches a bridge after a time with none takes that bridge's
// reports however far behind its clock is, as one moved straight between
// bridges does (bug 73): a seq is the clock of the bridge that reported
// last, which is gone. Each way a device loses its bridge is tried: an
// unassignment, an unbind off its owner's bridge (a device sold on, the
// next owner's bridge then serving it), and its bridge deleted. The last
// owner's bridge could otherwise report a seq up to a day ahead before it
// let the device go, and the next owner's bridge was ignored for that day:
// the device read offline, with the firmware and settings that bridge had
// said (docs/reliability.md, bug 241).
func testSeqForgottenThroughNoBridge(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	ahead := uint64(time.Now().Add(23 * time.Hour).UnixNano()) // within companion.MaxSeqAhead
	now := uint64(time.Now().UnixNano())
	report := func(dev, bridge string, seq uint64) (status, settings bool) {
		t.Helper()
		var err error
		status, err = s.PutStatus(ctx, companion.Status{DeviceID: dev, Online: true, BridgeID: bridge, Seq: seq, FirmwareVersion: bridge})
		require.NoError(t, err)
		settings, err = s.PutReportedSettings(ctx, dev, "", map[string]json.RawMessage{"volume": json.RawMessage(`"` + bridge + `"`)}, nil, time.Now(), seq)
		require.NoError(t, err)
		return status, settings
	}
	for _, c := range []struct {
		name, dev, from, fromOwner, to, toOwner string
		let                                     func()
	}{
		{"unassigned", "d1", "op1", "", "op2", "", func() { assign(t, s, "d1", "", "") }},
		{"unbound off its owner's bridge", "d4", "u1-hub", "u1", "u2-hub", "u2", func() {
			_, err := s.Unbind(ctx, "d4", "u1")
			require.NoError(t, err)
			bind(t, s, "u2", "d4")
		}},
		{"its bridge deleted", "d3", "op2", "", "op1", "", func() {
			_, err := s.DeleteBridge(ctx, "op2", "")
			require.NoError(t, err)
		}},
	} {
		assign(t, s, c.dev, c.from, c.fromOwner)
		status, settings := report(c.dev, c.from, ahead)
		require.True(t, status && settings, "%s: the first bridge's reports", c.name)
		c.let()
		assign(t, s, c.dev, c.to, c.toOwner)
		status, settings = report(c.dev, c.to, now)
		assert.True(t, status, "%s: the status of the bridge it reached after none, its clock behind the last one's, applied", c.name)
		assert.True(t, settings, "%s: the settings of the bridge it reached after none, its clock behind the last one's, applied", c.name)
		st, err := s.Status(ctx, c.dev)
		require.NoError(t, err)
		assert.Equal(t, c.to, st.FirmwareVersion, "%s: the status", c.name)
	}
}
