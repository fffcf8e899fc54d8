// Package storetest holds the conformance tests of companion.Store: what
// every store engine (store for bbolt, store/postgres) must do, checked
// through the interface alone. An engine's tests call Run with a function
// that opens a new, empty store.
//
// The suite tests behaviour, not storage: nothing here knows of files,
// buckets, tables or migrations, and nothing sets the store's clock. Times
// the API takes (LastSeen, At, ExpiresAt, BoundAt, CreatedAt when given)
// are passed in whole seconds, so an engine that keeps microseconds
// compares them exactly; times the store sets itself are checked against
// each other, or loosely against time.Now.
//
// It is not for the engines' own details (durability, group commit,
// schema upgrades): each engine tests those in its own package.
package storetest

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/require"
)

// Opener returns a new, empty store, closed by its own t.Cleanup.
type Opener = func(t *testing.T) companion.Store

// Run runs every conformance test against stores that open returns; each
// call of open must return a new, empty store, closed by open's own t.Cleanup.
func Run(t *testing.T, open func(t *testing.T) companion.Store) {
	groups := []struct {
		name string
		run  func(t *testing.T, open Opener)
	}{
		{"Users", testUsers},
		{"Devices", testDevices},
		{"Bridges", testBridges},
		{"Assignments", testAssignments},
		{"Bindings", testBindings},
		{"ListDevices", testListDevices},
		{"Status", testStatus},
		{"Settings", testSettings},
		{"Commands", testCommands},
		{"UpdateCommandWithReport", testUpdateCommandWithReport},
		{"Async", testAsync},
		{"Idempotency", testIdempotency},
		{"Catalog", testCatalog},
		{"Blobs", testBlobs},
		{"BlobNeeded", testBlobNeeded},
		{"Events", testEvents},
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) { g.run(t, open) })
	}
}

// subtests runs each named test as a subtest of t, each with a store of
// its own.
func subtests(t *testing.T, open Opener, tests []namedTest) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { tt.run(t, open(t)) })
	}
}

type namedTest struct {
	name string
	run  func(t *testing.T, s companion.Store)
}

// maxClockSkew is how far the store's own clock may be from the test's:
// a store that sets a time is checked only to be within it of time.Now.
const maxClockSkew = time.Minute

// idempotencyTTL is how long an idempotency record answers repeats
// (CONTRACT §2: "within 24 h").
const idempotencyTTL = 24 * time.Hour

// now is time.Now in whole seconds, for times the test passes in.
func now() time.Time {
	return time.Now().UTC().Truncate(time.Second)
}

// near fails the test unless got, a time the store set itself, is within
// maxClockSkew of time.Now.
func near(t testing.TB, what string, got time.Time) {
	t.Helper()
	if d := time.Since(got); d > maxClockSkew || d < -maxClockSkew {
		t.Errorf("%s = %v; want within %v of now (%v)", what, got, maxClockSkew, time.Now())
	}
}

// hashOf is the SHA-256 of s, as tokens, secrets and claim codes are kept.
func hashOf(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:]
}

// shaHex is the SHA-256 of b in lower-case hex, as blobs are named.
func shaHex(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

func raw(s string) json.RawMessage { return json.RawMessage(s) }

func intp(i int) *int { return &i }

// wantErr fails the test now unless errors.Is(err, want); want nil means
// no error.
func wantErr(t testing.TB, err, want error, what string) {
	t.Helper()
	if want == nil {
		require.NoError(t, err, what)
		return
	}
	require.ErrorIs(t, err, want, what)
}

// equalRaw reports whether the JSON values of got are those written in
// want, whatever their spacing or the order of their keys.
func equalRaw(got map[string]json.RawMessage, want map[string]string) bool {
	g := make(map[string]string, len(got))
	for k, v := range got {
		g[k] = canon(v)
	}
	w := make(map[string]string, len(want))
	for k, v := range want {
		w[k] = canon([]byte(v))
	}
	return maps.Equal(g, w)
}

// canon is the JSON value v with sorted keys and no spaces; v itself,
// marked, when it is not JSON.
func canon(v []byte) string {
	var x any
	if err := json.Unmarshal(v, &x); err != nil {
		return "not JSON: " + string(v)
	}
	out, err := json.Marshal(x)
	if err != nil {
		return "not JSON: " + string(v)
	}
	return string(out)
}

// provision adds devices with the model to the registry, each with the
// hash of its id as claim.
func provision(t testing.TB, s companion.Store, model string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		require.NoError(t, s.ProvisionDevice(t.Context(), companion.RegistryDevice{ID: id, Model: model, ClaimHash: hashOf(id)}), "ProvisionDevice(%q)", id)
	}
}

// bind binds each device to the user or fails the test.
func bind(t testing.TB, s companion.Store, user string, devs ...string) {
	t.Helper()
	for _, dev := range devs {
		_, _, err := s.Bind(t.Context(), companion.Binding{DeviceID: dev, UserID: user})
		require.NoError(t, err, "Bind(%q, %q)", dev, user)
	}
}

// assign makes the bridge serve the device, as owner asks ("" the
// operator), or fails the test.
func assign(t testing.TB, s companion.Store, dev, bridge, owner string) {
	t.Helper()
	_, err := s.AssignDevice(t.Context(), dev, bridge, owner)
	require.NoError(t, err, "AssignDevice(%q, %q, %q)", dev, bridge, owner)
}

// serve makes the operator's bridge (created if need be) serve each
// device (provisioned if need be): the stores take a status naming a
// bridge only from the bridge that serves its device (docs/reliability.md,
// bug 271).
func serve(t testing.TB, s companion.Store, bridge string, devs ...string) {
	t.Helper()
	ctx := t.Context()
	if err := s.CreateBridge(ctx, companion.Bridge{ID: bridge, SecretHash: hashOf(bridge)}); !errors.Is(err, companion.ErrExists) {
		require.NoError(t, err, "CreateBridge(%q)", bridge)
	}
	for _, dev := range devs {
		if _, err := s.RegistryDevice(ctx, dev); errors.Is(err, companion.ErrNotFound) {
			provision(t, s, "sim-1", dev)
		}
		assign(t, s, dev, bridge, "")
	}
}
