package store

import (
	"context"
	"slices"
	"testing"

	"github.com/devicecompanion/companion"
)

func TestValidVersion(t *testing.T) {
	for v, want := range map[string]bool{
		"1.2.3": true, "0.0.1": true, "1.0.0-rc.1": true, "1.0.0+build.5": true, "10.20.30-alpha+001": true,
		"": false, "v1.2.3": false, "1": false, "1.2": false, "01.2.3": false, "1.2.3.4": false, "x": false,
	} {
		if got := ValidVersion(v); got != want {
			t.Errorf("ValidVersion(%q) = %v; want %v", v, got, want)
		}
	}
}

func TestCompareVersions(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"1.10.0", "1.9.0", 1},
		{"1.0.0-rc.1", "1.0.0", -1},
		{"1.0.0-alpha", "1.0.0-beta", -1},
		{"1.0.0-rc.2", "1.0.0-rc.10", -1},
		{"2.0.0", "2.0.0", 0},
		{"2.0.0+a", "2.0.0+b", 0},
	}
	for _, tt := range tests {
		if got := CompareVersions(tt.a, tt.b); got != tt.want {
			t.Errorf("CompareVersions(%q, %q) = %d; want %d", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestFirmware(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	for _, v := range []string{"1.9.0", "1.10.0", "1.0.0", "1.0.0-rc.1", "0.9.9"} {
		mustNil(t, "PutFirmware("+v+")", db.PutFirmware(ctx, companion.Firmware{Model: "sim-1", Version: v, SHA256: "sha-" + v, Size: 10}))
	}
	mustNil(t, "PutFirmware(other model)", db.PutFirmware(ctx, companion.Firmware{Model: "sim-10", Version: "9.0.0", SHA256: "x"}))

	tests := []struct {
		name string
		f    companion.Firmware
		want error
	}{
		{"same sha again", companion.Firmware{Model: "sim-1", Version: "1.9.0", SHA256: "sha-1.9.0"}, nil},
		{"other sha", companion.Firmware{Model: "sim-1", Version: "1.9.0", SHA256: "other"}, companion.ErrExists},
		{"shorthand version", companion.Firmware{Model: "sim-1", Version: "1.2", SHA256: "a"}, companion.ErrInvalid},
		{"leading v", companion.Firmware{Model: "sim-1", Version: "v1.2.0", SHA256: "a"}, companion.ErrInvalid},
		{"no model", companion.Firmware{Version: "1.2.0", SHA256: "a"}, companion.ErrInvalid},
		{"no sha", companion.Firmware{Model: "sim-1", Version: "1.2.0"}, companion.ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErr(t, "PutFirmware", db.PutFirmware(ctx, tt.f), tt.want)
		})
	}

	got, err := db.Firmwares(ctx, "sim-1")
	if err != nil {
		t.Fatal(err)
	}
	var versions []string
	for _, f := range got {
		versions = append(versions, f.Version)
	}
	if want := []string{"0.9.9", "1.0.0-rc.1", "1.0.0", "1.9.0", "1.10.0"}; !slices.Equal(versions, want) {
		t.Errorf("Firmwares(sim-1) = %v; want %v", versions, want)
	}
	if f, err := db.Firmware(ctx, "sim-1", "1.10.0"); err != nil || f.SHA256 != "sha-1.10.0" || f.CreatedAt.IsZero() {
		t.Errorf("Firmware(sim-1, 1.10.0) = %+v, %v", f, err)
	}
	_, err = db.Firmware(ctx, "sim-1", "2.0.0")
	wantErr(t, "Firmware(absent)", err, companion.ErrNotFound)
	if got, err := db.Firmwares(ctx, "nope"); err != nil || len(got) != 0 {
		t.Errorf("Firmwares(nope) = %v, %v; want none", got, err)
	}
}

func TestAppReleases(t *testing.T) {
	ctx := context.Background()
	db := openTestDB(t)
	releases := map[string][]string{
		"clock":     {"1.0.0", "1.10.0", "1.9.0"},
		"clock.pro": {"2.0.0-rc.1"},
		"weather":   {"0.1.0", "1.0.0", "1.0.0-beta"},
	}
	for app, vs := range releases {
		for _, v := range vs {
			mustNil(t, "PutAppRelease", db.PutAppRelease(ctx, companion.AppRelease{AppID: app, Version: v, SHA256: app + v, Size: 1}))
		}
	}
	mustNil(t, "PutAppRelease(again)", db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: "clock1.0.0"}))
	wantErr(t, "PutAppRelease(other sha)", db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "1.0.0", SHA256: "x"}), companion.ErrExists)
	wantErr(t, "PutAppRelease(bad version)", db.PutAppRelease(ctx, companion.AppRelease{AppID: "clock", Version: "latest", SHA256: "x"}), companion.ErrInvalid)

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
		got, err := db.AppReleases(ctx, tt.app)
		if err != nil {
			t.Fatal(err)
		}
		var versions []string
		for _, a := range got {
			versions = append(versions, a.Version)
		}
		if !slices.Equal(versions, tt.want) {
			t.Errorf("AppReleases(%q) = %v; want %v", tt.app, versions, tt.want)
		}
	}

	latest, err := db.LatestApps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, a := range latest {
		got = append(got, a.AppID+"@"+a.Version)
	}
	if want := []string{"clock@1.10.0", "clock.pro@2.0.0-rc.1", "weather@1.0.0"}; !slices.Equal(got, want) {
		t.Errorf("LatestApps() = %v; want %v", got, want)
	}
	if a, err := db.AppRelease(ctx, "weather", "1.0.0-beta"); err != nil || a.SHA256 != "weather1.0.0-beta" {
		t.Errorf("AppRelease(weather, 1.0.0-beta) = %+v, %v", a, err)
	}
	_, err = db.AppRelease(ctx, "weather", "9.9.9")
	wantErr(t, "AppRelease(absent)", err, companion.ErrNotFound)
}
