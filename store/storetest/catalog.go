package storetest

import (
	"fmt"
	"testing"
	"time"

	"github.com/devicecompanion/companion"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testIdempotency(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"PutGet", testIdempotencyRecords},
		{"Expiry", testIdempotencyExpiry},
		{"Purge", testPurgeIdempotency},
		{"Claims", testIdempotencyClaims},
		{"ClaimRace", testIdempotencyClaimRace},
		{"GiveUpOwnClaim", testIdempotencyGiveUpOwnClaim},
		{"AnswerWithWork", testAnswerWithWork},
	})
}

func testIdempotencyRecords(t *testing.T, s companion.Store) {
	ctx := t.Context()
	rec := companion.Idempotency{UserID: "u1", Key: "k1", RequestHash: hashOf("req"), Status: 201, Body: []byte(`{"ok":true}`), Location: "/x"}

	_, err := s.Idempotency(ctx, "u1", "k1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(absent)")
	require.NoError(t, s.PutIdempotency(ctx, rec))
	assert.ErrorIs(t, s.PutIdempotency(ctx, rec), companion.ErrExists, "PutIdempotency(live)")
	assert.ErrorIs(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1"}), companion.ErrInvalid, "PutIdempotency(no key)")
	assert.ErrorIs(t, s.PutIdempotency(ctx, companion.Idempotency{Key: "k"}), companion.ErrInvalid, "PutIdempotency(no user)")

	got, err := s.Idempotency(ctx, "u1", "k1")
	require.NoError(t, err, "Idempotency(u1, k1)")
	assert.Equal(t, "u1", got.UserID)
	assert.Equal(t, "k1", got.Key)
	assert.Equal(t, 201, got.Status)
	assert.Equal(t, rec.Body, got.Body)
	assert.Equal(t, "/x", got.Location)
	assert.Equal(t, rec.RequestHash, got.RequestHash)
	assert.Empty(t, got.CommandID)
	near(t, "Idempotency(u1, k1).CreatedAt", got.CreatedAt)
	_, err = s.Idempotency(ctx, "u2", "k1")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(other user)")
	_, err = s.Idempotency(ctx, "u1", "k2")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Idempotency(other key)")
	_, err = s.Idempotency(ctx, "", "")
	assert.ErrorIs(t, err, companion.ErrNotFound, `Idempotency("", "")`)
	// Another user may use the same key.
	other := rec
	other.UserID, other.Status = "u2", 202
	require.NoError(t, s.PutIdempotency(ctx, other), "PutIdempotency(u2, k1)")
	got, err = s.Idempotency(ctx, "u2", "k1")
	require.NoError(t, err)
	assert.Equal(t, 202, got.Status)
}

// A record answers repeats for 24 hours from its CreatedAt; after that it
// reads as absent and may be replaced.
func testIdempotencyExpiry(t *testing.T, s companion.Store) {
	ctx := t.Context()
	for _, c := range []struct {
		key  string
		age  time.Duration
		want error
	}{
		{"fresh", 0, nil},
		{"a day less a minute", idempotencyTTL - maxClockSkew - time.Minute, nil},
		{"a day and a minute", idempotencyTTL + maxClockSkew + time.Minute, companion.ErrNotFound},
		{"a week", 7 * idempotencyTTL, companion.ErrNotFound},
	} {
		at := now().Add(-c.age)
		require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: c.key, Status: 200, CreatedAt: at}), "PutIdempotency(%s)", c.key)
		got, err := s.Idempotency(ctx, "u1", c.key)
		wantErr(t, err, c.want, fmt.Sprintf("Idempotency(%s old)", c.key))
		if err == nil {
			assert.True(t, got.CreatedAt.Equal(at), "Idempotency(%s).CreatedAt = %v; want %v as given", c.key, got.CreatedAt, at)
		}
	}
	// An expired record is replaced; a live one is not.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "a week", Status: 204}), "PutIdempotency(over an expired record)")
	got, err := s.Idempotency(ctx, "u1", "a week")
	require.NoError(t, err)
	assert.Equal(t, 204, got.Status, "Idempotency after replace")
	assert.ErrorIs(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "a day less a minute", Status: 500}), companion.ErrExists)
}

func testPurgeIdempotency(t *testing.T, s companion.Store) {
	ctx := t.Context()
	t0 := now().Add(-10 * time.Hour)
	for i, key := range []string{"a", "b", "c", "d", "e"} {
		require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{
			UserID: "u1", Key: key, Status: 200, CreatedAt: t0.Add(time.Duration(i) * time.Hour),
		}))
	}
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u2", Key: "a", Status: 200, CreatedAt: t0}))
	n, err := s.PurgeIdempotency(ctx, t0.Add(3*time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 4, n, "PurgeIdempotency: u1's a, b, c and u2's a")
	for key, want := range map[string]error{"a": companion.ErrNotFound, "b": companion.ErrNotFound, "c": companion.ErrNotFound, "d": nil, "e": nil} {
		_, err := s.Idempotency(ctx, "u1", key)
		wantErr(t, err, want, "Idempotency("+key+")")
	}
	_, err = s.Idempotency(ctx, "u2", "a")
	assert.ErrorIs(t, err, companion.ErrNotFound)
	n, err = s.PurgeIdempotency(ctx, t0)
	require.NoError(t, err)
	assert.Equal(t, 0, n, "PurgeIdempotency again")
	// A purged key is free.
	require.NoError(t, s.PutIdempotency(ctx, companion.Idempotency{UserID: "u1", Key: "a", Status: 201}))
}

func testCatalog(t *testing.T, open Opener) {
	subtests(t, open, []namedTest{
		{"Firmware", testFirmware},
		{"AppReleases", testAppReleases},
		{"AppCatalog", testAppCatalog},
	})
}

func testFirmware(t *testing.T, s companion.Store) {
	ctx := t.Context()
	for _, v := range []string{"1.9.0", "1.10.0", "1.0.0", "1.0.0-rc.1", "0.9.9"} {
		require.NoError(t, s.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: v, SHA256: "sha-" + v, Size: 10}), "PutFirmware(%s)", v)
	}
	require.NoError(t, s.PutFirmware(ctx, companion.Firmware{Model: "sim-10", Version: "9.0.0", SHA256: "x"}), "PutFirmware(other model)")
	given := now().Add(-time.Hour)
	require.NoError(t, s.PutFirmware(ctx, companion.Firmware{Model: "sim", Version: "0.0.1", SHA256: "y", Size: 3, CreatedAt: given}), "PutFirmware(sim)")

	tests := []struct {
		name string
		f    companion.Firmware
		want error
	}{
		{"same sha again", companion.Firmware{Model: "sim-1", Version: "1.9.0", SHA256: "sha-1.9.0"}, nil},
		{"other sha", companion.Firmware{Model: "sim-1", Version: "1.9.0", SHA256: "other"}, companion.ErrExists},
		{"shorthand version", companion.Firmware{Model: "sim-1", Version: "1.2", SHA256: "a"}, companion.ErrInvalid},
		{"leading v", companion.Firmware{Model: "sim-1", Version: "v1.2.0", SHA256: "a"}, companion.ErrInvalid},
		{"leading zero", companion.Firmware{Model: "sim-1", Version: "01.2.0", SHA256: "a"}, companion.ErrInvalid},
		{"four parts", companion.Firmware{Model: "sim-1", Version: "1.2.3.4", SHA256: "a"}, companion.ErrInvalid},
		{"no model", companion.Firmware{Version: "1.2.0", SHA256: "a"}, companion.ErrInvalid},
		{"no sha", companion.Firmware{Model: "sim-1", Version: "1.2.0"}, companion.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr(t, s.PutFirmware(ctx, tt.f), tt.want, fmt.Sprintf("PutFirmware(%s %s)", tt.f.Model, tt.f.Version))
		})
	}

	got, err := s.Firmwares(ctx, "sim-1")
	require.NoError(t, err)
	var versions []string
	for _, f := range got {
		assert.Equal(t, "sim-1", f.Model)
		versions = append(versions, f.Version)
	}
	assert.Equal(t, []string{"0.9.9", "1.0.0-rc.1", "1.0.0", "1.9.0", "1.10.0"}, versions, "Firmwares(sim-1): semantic version order")
	f, err := s.Firmware(ctx, "sim-1", "1.10.0")
	require.NoError(t, err, "Firmware(sim-1, 1.10.0)")
	assert.Equal(t, "sha-1.10.0", f.SHA256)
	assert.Equal(t, int64(10), f.Size)
	near(t, "Firmware(sim-1, 1.10.0).CreatedAt", f.CreatedAt)
	f, err = s.Firmware(ctx, "sim-1", "1.9.0")
	require.NoError(t, err)
	assert.Equal(t, "sha-1.9.0", f.SHA256, "the first publication stays")
	f, err = s.Firmware(ctx, "sim", "0.0.1")
	require.NoError(t, err)
	assert.True(t, f.CreatedAt.Equal(given), "Firmware(sim).CreatedAt = %v; want %v as given", f.CreatedAt, given)
	_, err = s.Firmware(ctx, "sim-1", "2.0.0")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Firmware(absent)")
	_, err = s.Firmware(ctx, "sim-10", "1.0.0")
	assert.ErrorIs(t, err, companion.ErrNotFound, "Firmware(another model's version)")
	none, err := s.Firmwares(ctx, "nope")
	require.NoError(t, err)
	assert.Empty(t, none, "Firmwares(nope)")
	one, err := s.Firmwares(ctx, "sim")
	require.NoError(t, err)
	assert.Len(t, one, 1, "Firmwares(sim): not sim-1's nor sim-10's")
}

func testAppReleases(t *testing.T, s companion.Store) {
	ctx := t.Context()
	publishApps(t, s)
	require.NoError(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: "clock1.0.0"}), "PutAppRelease(again)")
	assert.ErrorIs(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: "x"}), companion.ErrExists, "PutAppRelease(other sha)")
	assert.ErrorIs(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "latest", SHA256: "x"}), companion.ErrInvalid, "PutAppRelease(bad version)")
	assert.ErrorIs(t, s.PutAppRelease(ctx, companion.AppRelease{Version: "1.0.0", SHA256: "x"}), companion.ErrInvalid, "PutAppRelease(no app)")
	assert.ErrorIs(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "3.0.0"}), companion.ErrInvalid, "PutAppRelease(no sha)")

	tests := []struct {
		app  string
		want []string
	}{
		{"clock", []string{"1.0.0", "1.9.0", "1.10.0"}},
		{"weather", []string{"0.1.0", "1.0.0-beta", "1.0.0"}},
		{"clock.pro", []string{"2.0.0-rc.1"}},
		{"none", nil},
	}
	for _, tt := range tests {
		got, err := s.AppReleases(ctx, tt.app)
		require.NoError(t, err)
		var versions []string
		for _, a := range got {
			assert.Equal(t, tt.app, a.AppID)
			versions = append(versions, a.Version)
		}
		assert.Equal(t, tt.want, versions, "AppReleases(%q)", tt.app)
	}
	a, err := s.AppRelease(ctx, "weather", "1.0.0-beta")
	require.NoError(t, err, "AppRelease(weather, 1.0.0-beta)")
	assert.Equal(t, "weather1.0.0-beta", a.SHA256)
	assert.Equal(t, int64(1), a.Size)
	near(t, "AppRelease().CreatedAt", a.CreatedAt)
	a, err = s.AppRelease(ctx, "clock", "1.0.0")
	require.NoError(t, err)
	assert.Equal(t, "clock1.0.0", a.SHA256, "the first publication stays")
	_, err = s.AppRelease(ctx, "weather", "9.9.9")
	assert.ErrorIs(t, err, companion.ErrNotFound, "AppRelease(absent)")
	_, err = s.AppRelease(ctx, "nope", "1.0.0")
	assert.ErrorIs(t, err, companion.ErrNotFound, "AppRelease(no such app)")
}

func testAppCatalog(t *testing.T, s companion.Store) {
	ctx := t.Context()
	apps, more, err := s.AppCatalog(ctx, "", 0)
	require.NoError(t, err)
	assert.Empty(t, apps, "AppCatalog() of an empty catalog")
	assert.False(t, more, "AppCatalog() of an empty catalog: more")
	publishApps(t, s)
	// One app whose id runs on from another's, and one that sorts first.
	require.NoError(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "clock-x", Version: "0.0.1", SHA256: "clock-x0.0.1", Size: 1}))
	require.NoError(t, s.PutAppRelease(ctx, companion.AppRelease{AppID: "alarm", Version: "1.0.0", SHA256: "alarm1.0.0", Size: 1}))

	// Each app: its latest release, and its versions ascending.
	all := []string{
		"alarm@1.0.0=alarm1.0.0 [1.0.0]",
		"clock@1.10.0=clock1.10.0 [1.0.0 1.9.0 1.10.0]",
		"clock-x@0.0.1=clock-x0.0.1 [0.0.1]",
		"clock.pro@2.0.0-rc.1=clock.pro2.0.0-rc.1 [2.0.0-rc.1]",
		"weather@1.0.0=weather1.0.0 [0.1.0 1.0.0-beta 1.0.0]",
	}
	tests := []struct {
		after string
		limit int
		want  []string
		more  bool
	}{
		{"", 0, all, false},
		{"", 5, all, false},
		{"", 2, all[:2], true},
		{"alarm", 2, all[1:3], true},
		{"clock", 2, all[2:4], true},
		{"clock.pro", 1, all[4:], false},
		{"weather", 3, nil, false},
		{"b", 1, all[1:2], true},      // not an app: the page after where it would sort
		{"clock-", 0, all[2:], false}, // a prefix of clock-x's id
		{"zzz", 2, nil, false},
	}
	for _, tt := range tests {
		apps, more, err := s.AppCatalog(ctx, tt.after, tt.limit)
		require.NoError(t, err, "AppCatalog(%q, %d)", tt.after, tt.limit)
		var got []string
		for _, a := range apps {
			l := a.Latest
			got = append(got, fmt.Sprintf("%s@%s=%s %v", l.AppID, l.Version, l.SHA256, a.Versions))
			near(t, "AppCatalog().Latest.CreatedAt", l.CreatedAt)
		}
		assert.Equal(t, tt.want, got, "AppCatalog(%q, %d)", tt.after, tt.limit)
		assert.Equal(t, tt.more, more, "AppCatalog(%q, %d): more", tt.after, tt.limit)
	}
}

// publishApps fills the app catalog of the catalog tests.
func publishApps(t *testing.T, s companion.Store) {
	t.Helper()
	releases := []struct {
		app string
		vs  []string
	}{
		{"weather", []string{"0.1.0", "1.0.0", "1.0.0-beta"}},
		{"clock", []string{"1.0.0", "1.10.0", "1.9.0"}},
		{"clock.pro", []string{"2.0.0-rc.1"}},
	}
	for _, r := range releases {
		for _, v := range r.vs {
			require.NoError(t, s.PutAppRelease(t.Context(), companion.AppRelease{AppID: r.app, Version: v, SHA256: r.app + v, Size: 1}), "PutAppRelease(%s %s)", r.app, v)
		}
	}
}
