package storetest

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/devicecompanion/companion"
)

func testUsers(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"CreateUser", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))
			tests := []struct {
				name string
				u    companion.User
				want error
			}{
				{"second user", companion.User{ID: "u2", Name: "Bob", TokenHash: hashOf("t2")}, nil},
				{"same id", companion.User{ID: "u1", TokenHash: hashOf("t3")}, companion.ErrExists},
				{"same token", companion.User{ID: "u3", TokenHash: hashOf("t1")}, companion.ErrExists},
				{"no id", companion.User{TokenHash: hashOf("t4")}, companion.ErrInvalid},
				{"no token", companion.User{ID: "u4"}, companion.ErrInvalid},
				{"NUL in id", companion.User{ID: "u\x005", TokenHash: hashOf("t5")}, companion.ErrInvalid},
			}
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					wantErr(t, s.CreateUser(ctx, tt.u), tt.want, fmt.Sprintf("CreateUser(%q)", tt.u.ID))
				})
			}

			u, err := s.User(ctx, "u1")
			require.NoError(t, err, "User(u1)")
			assert.Equal(t, "Ann", u.Name, "User(u1).Name")
			assert.Equal(t, hashOf("t1"), u.TokenHash, "User(u1).TokenHash")
			near(t, "User(u1).CreatedAt", u.CreatedAt)
			_, err = s.User(ctx, "nobody")
			assert.ErrorIs(t, err, companion.ErrNotFound, "User(nobody)")
			_, err = s.User(ctx, "")
			assert.ErrorIs(t, err, companion.ErrNotFound, `User("")`)
			// A refused CreateUser left no index entry behind.
			_, err = s.UserByTokenHash(ctx, hashOf("t3"))
			assert.ErrorIs(t, err, companion.ErrNotFound, "UserByTokenHash(t3)")
			_, err = s.User(ctx, "u3")
			assert.ErrorIs(t, err, companion.ErrNotFound, "User(u3) after a refused create")
		}},
		{"SetUserToken", func(t *testing.T, s companion.Store) {
			// A user's new token finds them, the old one nothing; the
			// user keeps their name; another user's token is refused.
			ctx := t.Context()
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "u2", Name: "Bob", TokenHash: hashOf("t2")}))
			// Found before, as every request of the user finds it: a
			// store that keeps the answer must let it go.
			_, err := s.UserByTokenHash(ctx, hashOf("t1"))
			require.NoError(t, err, "UserByTokenHash(the token before it is replaced)")
			for _, tt := range []struct {
				name, user string
				hash       []byte
				want       error
			}{
				{"no such user", "u9", hashOf("t9"), companion.ErrNotFound},
				{"NUL in id", "u\x001", hashOf("t9"), companion.ErrNotFound},
				{"no token", "u1", nil, companion.ErrInvalid},
				{"another user's token", "u1", hashOf("t2"), companion.ErrExists},
				{"a new token", "u1", hashOf("t3"), nil},
			} {
				t.Run(tt.name, func(t *testing.T) {
					wantErr(t, s.SetUserToken(ctx, tt.user, tt.hash), tt.want, fmt.Sprintf("SetUserToken(%q)", tt.user))
				})
			}
			_, err = s.UserByTokenHash(ctx, hashOf("t1"))
			assert.ErrorIs(t, err, companion.ErrNotFound, "UserByTokenHash(the old token)")
			u, err := s.UserByTokenHash(ctx, hashOf("t3"))
			require.NoError(t, err, "UserByTokenHash(the new token)")
			assert.Equal(t, "u1", u.ID)
			assert.Equal(t, "Ann", u.Name)
			u, err = s.UserByTokenHash(ctx, hashOf("t2"))
			require.NoError(t, err, "UserByTokenHash(the other user's token)")
			assert.Equal(t, "u2", u.ID)
			// The old token's index entry is gone: a new user may take it.
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "u4", TokenHash: hashOf("t1")}))
		}},
		{"GivenCreatedAt", func(t *testing.T, s companion.Store) {
			at := now().Add(-time.Hour)
			require.NoError(t, s.CreateUser(t.Context(), companion.User{ID: "u1", TokenHash: hashOf("t1"), CreatedAt: at}))
			u, err := s.User(t.Context(), "u1")
			require.NoError(t, err)
			assert.True(t, u.CreatedAt.Equal(at), "User(u1).CreatedAt = %v; want %v as given", u.CreatedAt, at)
		}},
		{"UserByTokenHash", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "u1", Name: "Ann", TokenHash: hashOf("t1")}))
			tests := []struct {
				name   string
				hash   []byte
				wantID string
				want   error
			}{
				{"right token", hashOf("t1"), "u1", nil},
				{"wrong token", hashOf("t2"), "", companion.ErrNotFound},
				{"empty", nil, "", companion.ErrNotFound},
			}
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					u, err := s.UserByTokenHash(ctx, tt.hash)
					wantErr(t, err, tt.want, fmt.Sprintf("UserByTokenHash(%x)", tt.hash))
					assert.Equal(t, tt.wantID, u.ID, "UserByTokenHash(%x).ID", tt.hash)
				})
			}
			// The returned hash is a copy: changing it changes nothing stored.
			u, err := s.UserByTokenHash(ctx, hashOf("t1"))
			require.NoError(t, err)
			u.TokenHash[0] ^= 0xff
			_, err = s.UserByTokenHash(ctx, hashOf("t1"))
			assert.NoError(t, err, "UserByTokenHash after changing a returned hash")
		}},
	})
}

func testDevices(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"ProvisionDevice", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			d := companion.RegistryDevice{ID: "dev-1", Model: "sim-1", ClaimHash: hashOf("claim")}
			require.NoError(t, s.ProvisionDevice(ctx, d))
			assert.ErrorIs(t, s.ProvisionDevice(ctx, d), companion.ErrExists, "ProvisionDevice again")
			assert.ErrorIs(t, s.ProvisionDevice(ctx, companion.RegistryDevice{Model: "x"}), companion.ErrInvalid, "ProvisionDevice(no id)")
			assert.ErrorIs(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "a\x00b", Model: "x"}), companion.ErrInvalid, "ProvisionDevice(NUL in id)")

			got, err := s.RegistryDevice(ctx, "dev-1")
			require.NoError(t, err, "RegistryDevice(dev-1)")
			assert.Equal(t, "sim-1", got.Model)
			assert.Equal(t, hashOf("claim"), got.ClaimHash)
			assert.Equal(t, "", got.BridgeID, "RegistryDevice(dev-1).BridgeID of a device provisioned without one")
			near(t, "RegistryDevice(dev-1).CreatedAt", got.CreatedAt)
			_, err = s.RegistryDevice(ctx, "dev-2")
			assert.ErrorIs(t, err, companion.ErrNotFound, "RegistryDevice(dev-2)")
			_, err = s.RegistryDevice(ctx, "")
			assert.ErrorIs(t, err, companion.ErrNotFound, `RegistryDevice("")`)
		}},
		{"OnABridge", func(t *testing.T, s companion.Store) {
			// ProvisionDevice assigns to one of the operator's bridges only.
			ctx := t.Context()
			tenancy(t, s)
			require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d5", Model: "sim-1", BridgeID: "op1"}))
			wantBridge(t, s, "d5", "op1")
			for _, bridge := range []string{"nope", "u1-hub"} {
				err := s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d6", Model: "sim-1", BridgeID: bridge})
				assert.ErrorIs(t, err, companion.ErrNotFound, "ProvisionDevice(d6, %s)", bridge)
				_, err = s.RegistryDevice(ctx, "d6")
				assert.ErrorIs(t, err, companion.ErrNotFound, "RegistryDevice(d6) after a refused provision on %s", bridge)
			}
			// A device provisioned already is ErrExists whatever bridge the
			// repeat names (CONTRACT §2: 409 if it exists), and stays
			// where it is.
			for _, bridge := range []string{"op2", "nope", "u1-hub"} {
				err := s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d5", Model: "sim-1", BridgeID: bridge})
				assert.ErrorIs(t, err, companion.ErrExists, "ProvisionDevice(d5 again, %s)", bridge)
			}
			wantBridge(t, s, "d5", "op1")
		}},
	})
}

func testBridges(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"CreateBridge", func(t *testing.T, s companion.Store) {
			ctx := t.Context()
			require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: "br1", SecretHash: hashOf("s1")}))
			tests := []struct {
				name string
				b    companion.Bridge
				want error
			}{
				{"same id", companion.Bridge{ID: "br1", SecretHash: hashOf("s2")}, companion.ErrExists},
				{"same secret", companion.Bridge{ID: "br2", SecretHash: hashOf("s1")}, companion.ErrExists},
				{"no secret", companion.Bridge{ID: "br3"}, companion.ErrInvalid},
				{"no id", companion.Bridge{SecretHash: hashOf("s5")}, companion.ErrInvalid},
				{"NUL in id", companion.Bridge{ID: "b\x00r", SecretHash: hashOf("s6")}, companion.ErrInvalid},
				{"another", companion.Bridge{ID: "br4", SecretHash: hashOf("s4"), OwnerID: "u1"}, nil},
			}
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					wantErr(t, s.CreateBridge(ctx, tt.b), tt.want, fmt.Sprintf("CreateBridge(%q)", tt.b.ID))
				})
			}

			b, err := s.Bridge(ctx, "br1")
			require.NoError(t, err, "Bridge(br1)")
			assert.Equal(t, hashOf("s1"), b.SecretHash)
			assert.Equal(t, "", b.OwnerID)
			near(t, "Bridge(br1).CreatedAt", b.CreatedAt)
			_, err = s.Bridge(ctx, "nope")
			assert.ErrorIs(t, err, companion.ErrNotFound, "Bridge(nope)")
			b, err = s.BridgeBySecretHash(ctx, hashOf("s4"))
			require.NoError(t, err, "BridgeBySecretHash(s4)")
			assert.Equal(t, "br4", b.ID)
			assert.Equal(t, "u1", b.OwnerID)
			_, err = s.BridgeBySecretHash(ctx, hashOf("s2"))
			assert.ErrorIs(t, err, companion.ErrNotFound, "BridgeBySecretHash(s2)")
			_, err = s.BridgeBySecretHash(ctx, nil)
			assert.ErrorIs(t, err, companion.ErrNotFound, "BridgeBySecretHash(nil)")
		}},
		{"NotAUsersID", func(t *testing.T, s companion.Store) {
			// Bridges and users share the broker's usernames: a bridge
			// cannot take a user's id.
			ctx := t.Context()
			require.NoError(t, s.CreateUser(ctx, companion.User{ID: "9c1f0d1e-user", Name: "alice", TokenHash: hashOf("tok")}))
			err := s.CreateBridge(ctx, companion.Bridge{ID: "9c1f0d1e-user", SecretHash: hashOf("s"), OwnerID: "u2"})
			assert.ErrorIs(t, err, companion.ErrExists, "CreateBridge(a user's id)")
			_, err = s.Bridge(ctx, "9c1f0d1e-user")
			assert.ErrorIs(t, err, companion.ErrNotFound, "Bridge(a user's id)")
		}},
		{"ListBridges", testListBridges},
		{"CountBridges", testCountBridges},
		{"DeleteBridge", testDeleteBridge},
		{"SetBridgeSecret", testSetBridgeSecret},
	})
}

// SetBridgeSecret replaces a bridge's secret: the new one finds the
// bridge, the old one nothing; a user changes only their own bridge's,
// the operator any; the bridge keeps its devices and its owner.
func testSetBridgeSecret(t *testing.T, s companion.Store) {
	ctx := t.Context()
	require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: "hub", SecretHash: hashOf("s1"), OwnerID: "u1"}))
	require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: "op1", SecretHash: hashOf("o1")}))
	require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: "d1", Model: "sim-1", BridgeID: "op1"}))

	tests := []struct {
		name            string
		bridge, ownerID string
		hash            []byte
		want            error
	}{
		{"another user's", "hub", "u2", hashOf("s2"), companion.ErrNotOwned},
		{"no such bridge", "nope", "", hashOf("s2"), companion.ErrNotFound},
		{"NUL in id", "h\x00ub", "", hashOf("s2"), companion.ErrNotFound},
		{"no secret", "hub", "u1", nil, companion.ErrInvalid},
		{"another bridge's secret", "hub", "u1", hashOf("o1"), companion.ErrExists},
		{"the owner", "hub", "u1", hashOf("s2"), nil},
		{"the operator", "hub", "", hashOf("s3"), nil},
		{"the operator's, by a user", "op1", "u1", hashOf("o2"), companion.ErrNotOwned},
		{"the operator's", "op1", "", hashOf("o2"), nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr(t, s.SetBridgeSecret(ctx, tt.bridge, tt.ownerID, tt.hash), tt.want,
				fmt.Sprintf("SetBridgeSecret(%q, owner %q)", tt.bridge, tt.ownerID))
		})
	}

	for _, old := range []string{"s1", "s2"} {
		_, err := s.BridgeBySecretHash(ctx, hashOf(old))
		assert.ErrorIs(t, err, companion.ErrNotFound, "BridgeBySecretHash(%s) once replaced", old)
	}
	b, err := s.BridgeBySecretHash(ctx, hashOf("s3"))
	require.NoError(t, err, "BridgeBySecretHash(s3)")
	assert.Equal(t, "hub", b.ID)
	assert.Equal(t, "u1", b.OwnerID)
	b, err = s.Bridge(ctx, "hub")
	require.NoError(t, err, "Bridge(hub)")
	assert.Equal(t, hashOf("s3"), b.SecretHash)
	b, err = s.BridgeBySecretHash(ctx, hashOf("o2"))
	require.NoError(t, err, "BridgeBySecretHash(o2)")
	assert.Equal(t, "op1", b.ID)
	wantBridge(t, s, "d1", "op1")

	// The old secret's index entry is gone: a new bridge may take it.
	require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: "br9", SecretHash: hashOf("s1")}))
}

// CountBridges counts one owner's bridges (or the operator's), whatever
// devices they serve, and follows a deletion (bug 367).
func testCountBridges(t *testing.T, s companion.Store) {
	ctx := t.Context()
	owners := map[string]string{"a-op": "", "b-u1": "u1", "c-u2": "u2", "d-u1": "u1", "e-op": "", "f-u1": "u1"}
	for _, id := range slices.Sorted(maps.Keys(owners)) {
		require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: id, SecretHash: hashOf(id), OwnerID: owners[id]}), "CreateBridge(%s)", id)
	}
	for _, dev := range []string{"d1", "d2", "d3"} {
		require.NoError(t, s.ProvisionDevice(ctx, companion.RegistryDevice{ID: dev, Model: "sim-1", BridgeID: "e-op"}))
	}
	count := func(owner string) int {
		t.Helper()
		n, err := s.CountBridges(ctx, owner)
		require.NoError(t, err, "CountBridges(%q)", owner)
		return n
	}
	assert.Equal(t, 2, count(""), "the operator's")
	assert.Equal(t, 3, count("u1"), "u1's")
	assert.Equal(t, 1, count("u2"), "u2's")
	assert.Equal(t, 0, count("u9"), "a user with none")
	assert.Equal(t, 0, count("u\x001"), "NUL in the owner's id")
	_, err := s.DeleteBridge(ctx, "d-u1", "u1")
	require.NoError(t, err, "DeleteBridge(d-u1)")
	assert.Equal(t, 2, count("u1"), "u1's after a deletion")
}

// ListBridges pages over one owner's bridges (or the operator's) in id
// order, in full pages, and says more follow exactly when they do, also
// when other owners' bridges sort among or after them.
func testListBridges(t *testing.T, s companion.Store) {
	ctx := t.Context()
	order := []string{"a-op", "b-u1", "c-op", "d-u2", "e-u1", "f-op", "g-u1", "h-u2", "i-u1", "j-op", "k-u1", "z-u2"}
	owners := map[string]string{ // bridge id → owner ("" the operator)
		"a-op": "", "b-u1": "u1", "c-op": "", "d-u2": "u2", "e-u1": "u1",
		"f-op": "", "g-u1": "u1", "h-u2": "u2", "i-u1": "u1", "j-op": "", "k-u1": "u1", "z-u2": "u2",
	}
	// Created out of id order, so that insertion order cannot pass for it.
	for i := range order {
		id := order[(i*5)%len(order)]
		require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: id, SecretHash: hashOf(id), OwnerID: owners[id]}), "CreateBridge(%s)", id)
	}
	want := map[string][]string{}
	for _, id := range order {
		want[owners[id]] = append(want[owners[id]], id)
	}

	for _, owner := range []string{"", "u1", "u2"} {
		all := want[owner]
		for limit := 1; limit <= len(all)+1; limit++ {
			t.Run(fmt.Sprintf("owner %q limit %d", owner, limit), func(t *testing.T) {
				var got []string
				after := ""
				for page := 0; ; page++ {
					require.Less(t, page, len(all)+1, "ListBridges(%q, limit %d) does not end", owner, limit)
					bs, more, err := s.ListBridges(ctx, owner, after, limit)
					require.NoError(t, err, "ListBridges(%q, %q, %d)", owner, after, limit)
					rest := len(all) - len(got)
					require.Len(t, bs, min(limit, rest), "ListBridges(%q, %q, %d): want a full page", owner, after, limit)
					require.Equal(t, rest > limit, more, "ListBridges(%q, %q, %d) more (%d left)", owner, after, limit, rest-len(bs))
					for _, b := range bs {
						require.Equal(t, owner, b.OwnerID, "ListBridges(%q) gave %q", owner, b.ID)
						got = append(got, b.ID)
					}
					if !more {
						break
					}
					after = bs[len(bs)-1].ID
				}
				assert.Equal(t, all, got, "ListBridges(%q) pages", owner)
			})
		}
		bs, more, err := s.ListBridges(ctx, owner, "", 0)
		require.NoError(t, err)
		assert.False(t, more, "ListBridges(%q, no limit) more", owner)
		assert.Len(t, bs, len(all), "ListBridges(%q, no limit)", owner)
	}
	bs, more, err := s.ListBridges(ctx, "u9", "", 10)
	require.NoError(t, err)
	assert.False(t, more)
	assert.Empty(t, bs, "ListBridges(u9)")
}

// DeleteBridge removes the bridge, its secret and its assignments, and
// answers the devices it served; a user deletes only their own bridges.
func testDeleteBridge(t *testing.T, s companion.Store) {
	ctx := t.Context()
	tenancy(t, s)
	assign(t, s, "d1", "u1-hub", "u1")
	assign(t, s, "d4", "u1-hub", "u1")
	assign(t, s, "d2", "op1", "")

	for _, c := range []struct{ bridge, owner string }{{"u1-hub", "u2"}, {"op1", "u1"}} {
		_, err := s.DeleteBridge(ctx, c.bridge, c.owner)
		assert.ErrorIs(t, err, companion.ErrNotOwned, "DeleteBridge(%q, %q)", c.bridge, c.owner)
	}
	_, err := s.DeleteBridge(ctx, "nope", "u1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "DeleteBridge(nope)")
	assert.False(t, errors.Is(err, companion.ErrNotOwned), "DeleteBridge(nope) = %v; want a plain not found", err)
	wantBridge(t, s, "d1", "u1-hub")

	served, err := s.DeleteBridge(ctx, "u1-hub", "u1")
	require.NoError(t, err, "DeleteBridge(u1-hub, u1)")
	assert.Equal(t, []string{"d1", "d4"}, served, "DeleteBridge(u1-hub, u1)")
	wantBridge(t, s, "d1", "")
	wantBridge(t, s, "d4", "")
	wantBridge(t, s, "d2", "op1")
	_, err = s.Bridge(ctx, "u1-hub")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Bridge(u1-hub) after delete")
	_, err = s.BridgeBySecretHash(ctx, hashOf("u1-hub"))
	assert.ErrorIs(t, err, companion.ErrNotFound, "BridgeBySecretHash(u1-hub's secret) after delete")
	bs, more, err := s.ListBridges(ctx, "u1", "", 0)
	require.NoError(t, err)
	assert.False(t, more)
	assert.Empty(t, bs, "ListBridges(u1) after delete")
	_, err = s.DeleteBridge(ctx, "u1-hub", "u1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "DeleteBridge(u1-hub) again")

	// The operator deletes any bridge, a user's too; the id and the
	// secret are free again.
	served, err = s.DeleteBridge(ctx, "op1", "")
	require.NoError(t, err, "DeleteBridge(op1)")
	assert.Equal(t, []string{"d2"}, served, "DeleteBridge(op1)")
	served, err = s.DeleteBridge(ctx, "u2-hub", "")
	require.NoError(t, err, "DeleteBridge(u2-hub, operator)")
	assert.Empty(t, served, "DeleteBridge(u2-hub, operator)")
	require.NoError(t, s.CreateBridge(ctx, companion.Bridge{ID: "u1-hub", SecretHash: hashOf("u1-hub"), OwnerID: "u1"}), "CreateBridge(u1-hub) again")
	wantBridge(t, s, "d1", "")
	bs, _, err = s.ListBridges(ctx, "", "", 0)
	require.NoError(t, err)
	var left []string
	for _, b := range bs {
		left = append(left, b.ID)
	}
	assert.Equal(t, []string{"op2"}, left, "the operator's bridges after the deletes")
}

// tenancyBridges are the bridges of tenancy.
var tenancyBridges = []string{"op1", "op2", "u1-hub", "u2-hub"}

// tenancy fills s with the devices and bridges of the assignment tests:
// the operator's bridges op1 and op2, u1's own bridge u1-hub and u2's
// u2-hub; d1 and d4 bound to u1, d2 to u2, d3 to nobody, none assigned.
func tenancy(t *testing.T, s companion.Store) {
	t.Helper()
	provision(t, s, "sim-1", "d1", "d2", "d3", "d4")
	for _, b := range []companion.Bridge{
		{ID: "op1", SecretHash: hashOf("op1")},
		{ID: "op2", SecretHash: hashOf("op2")},
		{ID: "u1-hub", SecretHash: hashOf("u1-hub"), OwnerID: "u1"},
		{ID: "u2-hub", SecretHash: hashOf("u2-hub"), OwnerID: "u2"},
	} {
		require.NoError(t, s.CreateBridge(t.Context(), b), "CreateBridge(%s)", b.ID)
	}
	bind(t, s, "u1", "d1", "d4")
	bind(t, s, "u2", "d2")
}

// wantBridge fails the test unless the device is served by bridge ("" none),
// as every lookup of the store tells it.
func wantBridge(t *testing.T, s companion.Store, dev, bridge string) {
	t.Helper()
	ctx := t.Context()
	got, err := s.DeviceBridge(ctx, dev)
	if err != nil || got != bridge {
		t.Errorf("DeviceBridge(%q) = %q, %v; want %q", dev, got, err, bridge)
	}
	// Read with others, it reads the same.
	all, err := s.DeviceBridges(ctx, []string{"ghost", dev, "d2", dev})
	if b, ok := all[dev]; err != nil || b != bridge || ok != (bridge != "") {
		t.Errorf("DeviceBridges(…, %q, …)[%q] = %q, %v, %v; want %q", dev, dev, b, ok, err, bridge)
	}
	if _, ok := all["ghost"]; ok {
		t.Errorf("DeviceBridges(ghost, …) has ghost: %v", all)
	}
	if d, err := s.RegistryDevice(ctx, dev); err != nil || d.BridgeID != bridge {
		t.Errorf("RegistryDevice(%q).BridgeID = %q, %v; want %q", dev, d.BridgeID, err, bridge)
	}
	for _, b := range tenancyBridges {
		serves, err := s.BridgeServes(ctx, b, dev)
		if err != nil || serves != (b == bridge) {
			t.Errorf("BridgeServes(%q, %q) = %v, %v; want %v", b, dev, serves, err, b == bridge)
		}
		served, err := s.ServedDevices(ctx, b)
		if err != nil || slices.Contains(served, dev) != (b == bridge) {
			t.Errorf("ServedDevices(%q) = %v, %v; want %q in it: %v", b, served, err, dev, b == bridge)
		}
		if !slices.IsSorted(served) {
			t.Errorf("ServedDevices(%q) = %v; want them in order", b, served)
		}
		// A list of bridges carries the same devices.
		br, err := s.Bridge(ctx, b)
		if errors.Is(err, companion.ErrNotFound) {
			continue
		}
		require.NoError(t, err, "Bridge(%q)", b)
		listed, _, err := s.ListBridges(ctx, br.OwnerID, "", 0)
		require.NoError(t, err, "ListBridges(%q)", br.OwnerID)
		i := slices.IndexFunc(listed, func(l companion.ServingBridge) bool { return l.ID == b })
		if i < 0 || !slices.Equal(listed[i].Devices, served) || listed[i].Devices == nil {
			t.Errorf("ListBridges(%q) lists %q at %d: %+v; want it with the devices %q", br.OwnerID, b, i, listed, served)
		}
	}
}
