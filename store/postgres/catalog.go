package postgres

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
)

// putRelease publishes a release in table: the same name and version again
// with the same digest is a no-op, with another digest ErrExists.
func (s *Store) putRelease(ctx context.Context, table, nameCol, name, version, sha string, size int64, created any) error {
	return s.tx(ctx, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO `+table+` (`+nameCol+`, version, sha256, size, created_at) VALUES ($1, $2, $3, $4, $5)
			ON CONFLICT DO NOTHING`, name, version, sha, size, created)
		if err != nil || tag.RowsAffected() == 1 {
			return err
		}
		var old string
		if err := tx.QueryRow(ctx, `SELECT sha256 FROM `+table+` WHERE `+nameCol+` = $1 AND version = $2`, name, version).Scan(&old); err != nil {
			return err
		}
		if old != sha {
			return companion.ErrExists
		}
		return nil
	})
}

// PutFirmware publishes a firmware image. CreatedAt is set to now when
// zero. Publishing the same model and version again with the same SHA256
// is a no-op; with another SHA256 it is ErrExists.
func (s *Store) PutFirmware(ctx context.Context, f companion.Firmware) error {
	if !validID(f.Model) || !companion.ValidVersion(f.Version) || f.SHA256 == "" || strings.ContainsRune(f.SHA256, 0) {
		return fmt.Errorf("%w: firmware needs a model, a semantic version and a digest", companion.ErrInvalid)
	}
	if f.CreatedAt.IsZero() {
		f.CreatedAt = s.clock()
	}
	return s.putRelease(ctx, "firmware", "model", f.Model, f.Version, f.SHA256, f.Size, f.CreatedAt)
}

func scanFirmware(row pgx.CollectableRow) (companion.Firmware, error) {
	var f companion.Firmware
	err := row.Scan(&f.Model, &f.Version, &f.SHA256, &f.Size, &f.CreatedAt)
	f.CreatedAt = f.CreatedAt.UTC()
	return f, err
}

// Firmware returns the firmware of the model and version, or ErrNotFound.
func (s *Store) Firmware(ctx context.Context, model, version string) (companion.Firmware, error) {
	if !validID(model) || !validID(version) {
		return companion.Firmware{}, companion.ErrNotFound
	}
	rows, _ := s.pool.Query(ctx, `SELECT model, version, sha256, size, created_at FROM firmware WHERE model = $1 AND version = $2`, model, version)
	f, err := pgx.CollectExactlyOneRow(rows, scanFirmware)
	return f, notFound(err)
}

// Firmwares returns the model's firmware images in ascending version
// order; empty, not an error, when there are none.
func (s *Store) Firmwares(ctx context.Context, model string) ([]companion.Firmware, error) {
	out := []companion.Firmware{}
	if !validID(model) {
		return out, nil
	}
	return releases(ctx, s, out, `SELECT model, version, sha256, size, created_at FROM firmware WHERE model = $1`, model,
		scanFirmware, func(f companion.Firmware) string { return f.Version })
}

// releases appends to out the releases query selects with arg, in
// ascending version order (which SQL cannot sort by).
func releases[T any](ctx context.Context, s *Store, out []T, query, arg string, scan pgx.RowToFunc[T], version func(T) string) ([]T, error) {
	rows, _ := s.pool.Query(ctx, query, arg)
	out, err := pgx.AppendRows(out, rows, scan)
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b T) int { return companion.ByVersion(version(a), version(b)) })
	return out, nil
}

// PutAppRelease publishes an app package. CreatedAt is set to now when
// zero. Publishing the same app and version again with the same SHA256 is
// a no-op; with another SHA256 it is ErrExists.
func (s *Store) PutAppRelease(ctx context.Context, a companion.AppRelease) error {
	if !validID(a.AppID) || !companion.ValidVersion(a.Version) || a.SHA256 == "" || strings.ContainsRune(a.SHA256, 0) {
		return fmt.Errorf("%w: app release needs an app id, a semantic version and a digest", companion.ErrInvalid)
	}
	if a.CreatedAt.IsZero() {
		a.CreatedAt = s.clock()
	}
	return s.putRelease(ctx, "app_releases", "app_id", a.AppID, a.Version, a.SHA256, a.Size, a.CreatedAt)
}

func scanApp(row pgx.CollectableRow) (companion.AppRelease, error) {
	var a companion.AppRelease
	err := row.Scan(&a.AppID, &a.Version, &a.SHA256, &a.Size, &a.CreatedAt)
	a.CreatedAt = a.CreatedAt.UTC()
	return a, err
}

// AppRelease returns the release of the app and version, or ErrNotFound.
func (s *Store) AppRelease(ctx context.Context, appID, version string) (companion.AppRelease, error) {
	if !validID(appID) || !validID(version) {
		return companion.AppRelease{}, companion.ErrNotFound
	}
	rows, _ := s.pool.Query(ctx, `SELECT app_id, version, sha256, size, created_at FROM app_releases WHERE app_id = $1 AND version = $2`, appID, version)
	a, err := pgx.CollectExactlyOneRow(rows, scanApp)
	return a, notFound(err)
}

// AppReleases returns the app's releases in ascending version order;
// empty, not an error, when there are none.
func (s *Store) AppReleases(ctx context.Context, appID string) ([]companion.AppRelease, error) {
	out := []companion.AppRelease{}
	if !validID(appID) {
		return out, nil
	}
	return releases(ctx, s, out, `SELECT app_id, version, sha256, size, created_at FROM app_releases WHERE app_id = $1`, appID,
		scanApp, func(a companion.AppRelease) string { return a.Version })
}

// AppCatalog returns a page of the app catalog in app id order: at most
// limit apps (limit <= 0: all) whose ids sort after `after`, each with its
// latest release and every version published, read in one query, and
// whether more apps follow. Versions are compared as semantic versions,
// which SQL cannot do, so it reads every release of the page's apps.
func (s *Store) AppCatalog(ctx context.Context, after string, limit int) ([]companion.CatalogApp, bool, error) {
	out := []companion.CatalogApp{}
	if strings.ContainsRune(after, 0) {
		return out, false, nil
	}
	rows, _ := s.pool.Query(ctx, `WITH page AS (
			SELECT DISTINCT app_id FROM app_releases WHERE app_id > $1 ORDER BY app_id LIMIT $2)
		SELECT app_id, version, sha256, size, created_at FROM app_releases JOIN page USING (app_id)
		ORDER BY app_id`, after, pageLimit(limit))
	all, err := pgx.CollectRows(rows, scanApp)
	if err != nil {
		return nil, false, err
	}
	for _, a := range all {
		if n := len(out); n > 0 && out[n-1].Latest.AppID == a.AppID {
			out[n-1].Add(a)
			continue
		}
		out = append(out, companion.CatalogApp{Latest: a, Versions: []string{a.Version}})
	}
	for i := range out {
		slices.SortFunc(out[i].Versions, companion.ByVersion)
	}
	out, more := trimPage(out, limit)
	return out, more, nil
}
