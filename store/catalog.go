package store

import (
	"bytes"
	"context"
	"fmt"
	"slices"

	"github.com/devicecompanion/companion"
	"github.com/devicecompanion/companion/internal/fastjson"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/mod/semver"
)

// ValidVersion reports whether v is a full semantic version without a
// leading "v": MAJOR.MINOR.PATCH, with an optional pre-release and build
// (companion.ValidVersion).
func ValidVersion(v string) bool { return companion.ValidVersion(v) }

// CompareVersions compares two semantic versions (without "v") as
// semver.Compare does: -1, 0 or +1. Build metadata does not count.
func CompareVersions(a, b string) int {
	return semver.Compare("v"+a, "v"+b)
}

// Names of a release in the log of one that does not decode
// (logUndecodable), which counts each record once whichever read meets it.
const (
	undecodableFirmware = "firmware release"
	undecodableApp      = "release of an app"
)

// PutFirmware publishes a firmware image. CreatedAt is set to now when
// zero. Publishing the same model and version again with the same SHA256
// is a no-op; with another SHA256 it is ErrExists. A stored one that does
// not decode is replaced as if there were none (getOrNone).
func (db *DB) PutFirmware(ctx context.Context, f companion.Firmware) error {
	if !validID(f.Model) || !ValidVersion(f.Version) || f.SHA256 == "" {
		return fmt.Errorf("%w: firmware needs a model, a semantic version and a digest", companion.ErrInvalid)
	}
	if f.CreatedAt.IsZero() {
		f.CreatedAt = db.now()
	}
	return db.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketFirmware)
		var old companion.Firmware
		if getOrNone(db, b, undecodableFirmware, key(f.Model, f.Version), &old) {
			if old.SHA256 == f.SHA256 {
				return nil
			}
			return abort(companion.ErrExists)
		}
		return putJSON(b, key(f.Model, f.Version), f)
	})
}

// Firmware returns the firmware of the model and version, or ErrNotFound
// (also when its record does not decode: getOrNone).
func (db *DB) Firmware(ctx context.Context, model, version string) (companion.Firmware, error) {
	var f companion.Firmware
	if !validID(model) || !validID(version) {
		return f, companion.ErrNotFound
	}
	ok := false
	err := db.bolt.View(func(tx *bolt.Tx) error {
		ok = getOrNone(db, tx.Bucket(bucketFirmware), undecodableFirmware, key(model, version), &f)
		return nil
	})
	switch {
	case err != nil:
		return companion.Firmware{}, err
	case !ok:
		return companion.Firmware{}, companion.ErrNotFound
	}
	return f, nil
}

// Firmwares returns the model's firmware images in ascending version
// order; empty, not an error, when there are none. One that does not
// decode is left out (scanReleases).
func (db *DB) Firmwares(ctx context.Context, model string) ([]companion.Firmware, error) {
	out := []companion.Firmware{}
	if !validID(model) {
		return out, nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		scanReleases(db, tx.Bucket(bucketFirmware), undecodableFirmware, prefix(model), func(f companion.Firmware) { out = append(out, f) })
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b companion.Firmware) int { return companion.ByVersion(a.Version, b.Version) })
	return out, nil
}

// PutAppRelease publishes an app package. CreatedAt is set to now when
// zero. Publishing the same app and version again with the same SHA256 is
// a no-op; with another SHA256 it is ErrExists. A stored one that does not
// decode is replaced as if there were none (getOrNone).
func (db *DB) PutAppRelease(ctx context.Context, a companion.AppRelease) error {
	if !validID(a.AppID) || !ValidVersion(a.Version) || a.SHA256 == "" {
		return fmt.Errorf("%w: app release needs an app id, a semantic version and a digest", companion.ErrInvalid)
	}
	if a.CreatedAt.IsZero() {
		a.CreatedAt = db.now()
	}
	return db.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketApps)
		var old companion.AppRelease
		if getOrNone(db, b, undecodableApp, key(a.AppID, a.Version), &old) {
			if old.SHA256 == a.SHA256 {
				return nil
			}
			return abort(companion.ErrExists)
		}
		return putJSON(b, key(a.AppID, a.Version), a)
	})
}

// AppRelease returns the release of the app and version, or ErrNotFound
// (also when its record does not decode: getOrNone).
func (db *DB) AppRelease(ctx context.Context, appID, version string) (companion.AppRelease, error) {
	var a companion.AppRelease
	if !validID(appID) || !validID(version) {
		return a, companion.ErrNotFound
	}
	ok := false
	err := db.bolt.View(func(tx *bolt.Tx) error {
		ok = getOrNone(db, tx.Bucket(bucketApps), undecodableApp, key(appID, version), &a)
		return nil
	})
	switch {
	case err != nil:
		return companion.AppRelease{}, err
	case !ok:
		return companion.AppRelease{}, companion.ErrNotFound
	}
	return a, nil
}

// AppReleases returns the app's releases in ascending version order;
// empty, not an error, when there are none. One that does not decode is
// left out (scanReleases).
func (db *DB) AppReleases(ctx context.Context, appID string) ([]companion.AppRelease, error) {
	out := []companion.AppRelease{}
	if !validID(appID) {
		return out, nil
	}
	err := db.bolt.View(func(tx *bolt.Tx) error {
		scanReleases(db, tx.Bucket(bucketApps), undecodableApp, prefix(appID), func(a companion.AppRelease) { out = append(out, a) })
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b companion.AppRelease) int { return companion.ByVersion(a.Version, b.Version) })
	return out, nil
}

// AppCatalog returns a page of the app catalog in app id order: at most
// limit apps (limit <= 0: all) whose ids sort after `after`, each with its
// latest release and every version published, read in one transaction,
// and whether more apps follow.
func (db *DB) AppCatalog(ctx context.Context, after string, limit int) ([]companion.CatalogApp, bool, error) {
	out := []companion.CatalogApp{}
	more := false
	err := db.bolt.View(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketApps).Cursor()
		// Keys are app id, NUL, version: all releases of an app are
		// adjacent, and apps come in id order. The first key past every
		// release of `after` is its prefix's end.
		k, v := c.First()
		if after != "" {
			k, v = c.Seek(prefixEnd(prefix(after)))
		}
		for ; k != nil; k, v = c.Next() {
			var a companion.AppRelease
			if err := fastjson.Unmarshal(v, &a); err != nil {
				// One release that does not decode (the file damaged
				// there) is left out and logged: it failed the whole
				// catalog (docs/reliability.md, bug 595).
				db.logUndecodable(undecodableApp, k, err)
				continue
			}
			n := len(out)
			if n > 0 && out[n-1].Latest.AppID == a.AppID {
				out[n-1].Add(a)
				continue
			}
			if limit > 0 && n == limit {
				more = true
				return nil
			}
			out = append(out, companion.CatalogApp{Latest: a, Versions: []string{a.Version}})
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	for i := range out {
		slices.SortFunc(out[i].Versions, companion.ByVersion)
	}
	return out, more, nil
}

// scanReleases decodes every release of b under the key prefix p in key
// order and passes it to fn. One that does not decode (the file damaged
// there) is left out and logged once (logUndecodable, what names it): it
// failed every read of its model's or app's releases, and with them every
// OTA and install without a version (docs/reliability.md, bug 566).
func scanReleases[T any](db *DB, b *bolt.Bucket, what string, p []byte, fn func(T)) {
	c := b.Cursor()
	for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
		var t T
		if err := fastjson.Unmarshal(v, &t); err != nil {
			db.logUndecodable(what, k, err)
			continue
		}
		fn(t)
	}
}
