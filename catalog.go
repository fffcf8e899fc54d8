package companion

import (
	"strings"
	"time"

	"golang.org/x/mod/semver"
)

// ValidVersion reports whether v is a full semantic version without a
// leading "v": MAJOR.MINOR.PATCH, with an optional pre-release and build.
// It is the rule the stores apply to catalog versions, whatever the engine.
func ValidVersion(v string) bool {
	sv := "v" + v
	if !semver.IsValid(sv) {
		return false
	}
	// semver.IsValid also takes the shorthands "v1" and "v1.2".
	core, _, _ := strings.Cut(sv, "+")
	return semver.Canonical(sv) == core
}

// ByVersion orders versions (without "v") ascending as semantic versions;
// equal ones (differing only in build metadata) by their text, so the
// order is total: how the stores list a catalog.
func ByVersion(a, b string) int {
	if c := semver.Compare("v"+a, "v"+b); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}

// Firmware is one published firmware image for a model.
type Firmware struct {
	Model     string    `json:"model"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// AppRelease is one published version of an app package.
type AppRelease struct {
	AppID     string    `json:"app_id"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// Blob is content stored once by its SHA-256 (lower-case hex).
type Blob struct {
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// CatalogApp is one app of the catalog: its latest release (the highest
// version) and every version published.
type CatalogApp struct {
	Latest AppRelease
	// Versions are every version published, in ascending version order
	// once the store has read them all.
	Versions []string
}

// Add takes another release of the app in: its version, and the release
// as the latest when its version is higher.
func (c *CatalogApp) Add(r AppRelease) {
	c.Versions = append(c.Versions, r.Version)
	if ByVersion(r.Version, c.Latest.Version) > 0 {
		c.Latest = r
	}
}
