package postgres

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrClosed is returned by the methods of a closed Store.
var ErrClosed = errors.New("postgres: store closed")

// IdempotencyTTL is how long an idempotency record answers repeats.
const IdempotencyTTL = 24 * time.Hour

// Options configures Open. The zero value gives the defaults.
type Options struct {
	// Logger receives the store's few log lines; slog.Default() when nil.
	Logger *slog.Logger
	// Now is the clock; time.Now when nil. Tests inject their own.
	Now func() time.Time
	// MaxConns bounds the connection pool; when <= 0, the DSN's
	// pool_max_conns, or else 16. Half of them (at least 2) are the lanes
	// of the per-device writes. Besides the pool, each ListenCommands and
	// the dispatcher's campaign hold a connection of their own, and the
	// health probe makes one for a moment while the database fails, as
	// Ping does while every connection of the pool is in use.
	MaxConns int32
	// Migrate has Open apply the migrations the database lacks. Without
	// it Open only checks the schema and refuses one older than this
	// build's (CONTRACT §11: `companion migrate` applies it, so that a
	// replica of a new build never changes the schema under the replicas
	// of the old one).
	Migrate bool
}

// Store is companion.Store on PostgreSQL. It is safe for concurrent use,
// by any number of processes on one database.
type Store struct {
	pool   *pgxpool.Pool
	cfg    *pgxpool.Config
	now    func() time.Time
	log    *slog.Logger
	ids    idGen
	health *health
	lanes  []*lane
	wg     sync.WaitGroup // the lanes' goroutines
	mu     sync.RWMutex   // closed, and submissions against Close
	closed bool
	done   chan struct{} // closed by Close: stops ListenCommands and Campaign

	dispatching atomic.Bool  // this store holds the dispatcher's lock (Campaign)
	offset      atomic.Int64 // ClockOffset, in nanoseconds, as last seen (offsetAt)
	// xidOffset moves the event log's places past the transaction ids of
	// the database a restored dump was taken from (openEventsLog); 0 for
	// a database never restored. Set by Open.
	xidOffset uint64

	purgeBatch int // deletions per transaction of the Purge methods; purgeBatch when 0 (tests set it)
	// afterPurgeBatch, when set (by tests, before the store is used), runs
	// between two transactions of a purge.
	afterPurgeBatch func()
}

var _ companion.Store = (*Store)(nil)

// LockTimeout is how long a statement of the store waits for a lock that
// another session holds (PostgreSQL's lock_timeout, on every session of
// the store but the migrations'; a DSN that sets lock_timeout has its
// own) before it fails with lock_not_available, which IsUnavailable
// tells. The store's own transactions hold their locks for milliseconds;
// one that waits this long waits for something else (a transaction left
// open, a migration or a VACUUM FULL waiting its turn): the request is
// answered 503 with Retry-After, nothing written, rather than held until
// its client gives up, and the lane of writes it was on goes on.
const LockTimeout = 5 * time.Second

// ConnectTimeout bounds making a connection to the database, its TLS and
// startup included, unless the DSN sets connect_timeout. Without it, a
// host that stops answering (powered off, or its packets dropped) held
// every write that needed a new connection for as long as the kernel
// tried to connect (about two minutes), or for ever where the connection
// completed and nothing answered: the store's writes run on no request's
// context. Past it the write fails as unavailable (a 503).
const ConnectTimeout = 5 * time.Second

// Open connects to the database of dsn (a PostgreSQL URL or key=value
// string; a search_path parameter puts the tables in that schema),
// checks its schema (applies the migrations it lacks with opts.Migrate;
// see Migrate) and starts the lanes of
// the per-device writes. Its sessions run with synchronous_commit on
// and lock_timeout LockTimeout, and connect within ConnectTimeout, unless
// the DSN sets them.
func Open(ctx context.Context, dsn string, opts Options) (*Store, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if opts.MaxConns <= 0 {
		opts.MaxConns = 16
		if setsPoolMaxConns(dsn) {
			opts.MaxConns = cfg.MaxConns
		}
	}
	cfg.MaxConns = opts.MaxConns
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = ConnectTimeout
	}
	// A 202 means committed: a commit returns once its WAL is flushed,
	// whatever the database's or role's default says, unless the DSN
	// itself says otherwise.
	params := cfg.ConnConfig.RuntimeParams
	if _, ok := params["synchronous_commit"]; !ok {
		params["synchronous_commit"] = "on"
	}
	if _, ok := params["application_name"]; !ok {
		params["application_name"] = "companion"
	}
	if err := migrate(ctx, cfg.ConnConfig, opts.Logger, opts.Migrate); err != nil {
		return nil, err
	}
	// Set after the migrations, which may wait as long as another
	// replica's take.
	if _, ok := params["lock_timeout"]; !ok {
		params["lock_timeout"] = strconv.Itoa(int(LockTimeout / time.Millisecond))
	}
	h := newHealth(opts.Logger, cfg.ConnConfig)
	// The pool's connections, and those of ListenCommands and Campaign
	// (copies of its config), tell h what the database answers.
	cfg.ConnConfig.Tracer = tracer{h}
	cfg.BeforeConnect = h.beforeConnect
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	s := &Store{pool: pool, cfg: cfg, now: opts.Now, log: opts.Logger, health: h, done: make(chan struct{})}
	var db time.Time
	if err := pool.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&db); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: %w", err)
	}
	s.offsetAt(db) // ClockOffset, before the first write
	if err := s.openEventsLog(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres: the event log: %w", err)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.watch()
	}()
	n := max(2, int(opts.MaxConns)/2)
	s.lanes = make([]*lane, n)
	for i := range s.lanes {
		s.lanes[i] = newLane()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.runLane(s.lanes[i])
		}()
	}
	return s, nil
}

// Close finishes the writes under way (their done funcs are called), stops
// ListenCommands and closes the pool. Calls made after Close fail with
// ErrClosed.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.done)
	for _, l := range s.lanes {
		l.close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	s.pool.Close()
	return nil
}

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migration is one file of migrations: NNNN_name.sql applies version NNNN.
type migration struct {
	version int
	name    string
	sql     string
}

// migrations returns the embedded migrations in version order.
func migrations() ([]migration, error) {
	names, err := fs.Glob(migrationFiles, "migrations/*.sql")
	if err != nil {
		return nil, err
	}
	var out []migration
	for _, name := range names {
		base := path.Base(name)
		num, _, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("postgres: migration %s: name is not NNNN_name.sql", base)
		}
		b, err := migrationFiles.ReadFile(name)
		if err != nil {
			return nil, err
		}
		out = append(out, migration{version: v, name: strings.TrimSuffix(base, ".sql"), sql: string(b)})
	}
	slices.SortFunc(out, func(a, b migration) int { return a.version - b.version })
	for i, m := range out {
		if m.version != i+1 {
			return nil, fmt.Errorf("postgres: migration %s: want version %d", m.name, i+1)
		}
	}
	return out, nil
}

// SchemaVersion is the highest migration this build knows.
func SchemaVersion() int {
	ms, err := migrations()
	if err != nil {
		panic(err) // the embedded files are part of the build
	}
	return len(ms)
}

// setsPoolMaxConns reports whether the DSN sets pgxpool's pool_max_conns:
// pgxpool's own default otherwise (the CPUs, at least 4) is not the
// store's. pgconn keeps parameters it does not know among the runtime
// ones.
func setsPoolMaxConns(dsn string) bool {
	c, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return false
	}
	_, ok := c.RuntimeParams["pool_max_conns"]
	return ok
}

// Refused reports whether err, of Open or Migrate, is PostgreSQL refusing
// the connection for good: a wrong password, a role or database that does
// not exist, or one the role may not use (SQLSTATE classes 28 and 3D, and
// 42501). Each is refused again at every start until a person mends the
// --store URL or the database's roles, unlike a server not up yet (at
// boot), which passes by itself (bug 437).
func Refused(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	return strings.HasPrefix(pe.Code, "28") || pe.Code == "3D000" || pe.Code == "42501"
}

// Migrate applies to the database of dsn the migrations it lacks, each in
// a transaction of its own that first takes an advisory lock, so replicas
// that start together apply each one once. A database migrated by a newer
// build is ErrSchemaTooNew.
func Migrate(ctx context.Context, dsn string) error {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = ConnectTimeout
	}
	return migrate(ctx, cfg, slog.Default(), true)
}

// migrationLock is the advisory lock (two-key form, which does not overlap
// the one-key locks of idempotency keys) that migrations take.
const migrationLock = `SELECT pg_advisory_xact_lock(1668246896, 1)`

// The classes of the transaction-scoped advisory locks of the two-key
// form whose second key is a hash of an id (idLockKey, statusLockKey).
// They are apart from the migrations' and the dispatcher's locks (class
// 1668246896, keys 1 and 2) and from the one-key locks of idempotency
// keys. Two ids of one key share a lock: they wait for each other, no
// more.
const (
	// lockClassStatus is held by the first report of a device (putStatus).
	lockClassStatus int32 = 1668246897
	// lockClassAccount is held by CreateUser and CreateBridge: users and
	// bridges share the broker's usernames.
	lockClassAccount int32 = 1668246898
	// lockClassSettings is held by the first write of a device's settings
	// (lockSettings).
	lockClassSettings int32 = 1668246899
)

// idLockKey is the second key of an id's advisory lock.
func idLockKey(id string) int32 {
	h := fnv.New32a()
	h.Write([]byte(id))
	return int32(h.Sum32())
}

// ErrSchemaOld is returned by Open for a database whose schema is older
// than this build's: run companion migrate.
var ErrSchemaOld = errors.New("postgres: the database's schema is older than this build's: run companion migrate --store URL")

// migrate applies the migrations the database lacks, or with apply false
// only checks that it lacks none.
func migrate(ctx context.Context, cfg *pgx.ConnConfig, log *slog.Logger, apply bool) error {
	ms, err := migrations()
	if err != nil {
		return err
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer conn.Close(context.Background())
	for _, m := range append(ms, migration{}) {
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, migrationLock); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
				version    integer PRIMARY KEY,
				name       text NOT NULL,
				applied_at timestamptz NOT NULL DEFAULT now())`)
			if err != nil {
				return err
			}
			var have int
			if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM schema_migrations`).Scan(&have); err != nil {
				return err
			}
			if have > len(ms) {
				return fmt.Errorf("%w: database has schema %d, this build knows %d", companion.ErrSchemaTooNew, have, len(ms))
			}
			if m.version == 0 || have >= m.version {
				return nil // the check alone, or applied already
			}
			if !apply {
				return fmt.Errorf("%w (it has %d, this build needs %d)", ErrSchemaOld, have, len(ms))
			}
			if _, err := tx.Exec(ctx, m.sql); err != nil {
				return fmt.Errorf("migration %s: %w", m.name, err)
			}
			_, err = tx.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.version, m.name)
			if err == nil {
				log.Info("postgres: schema migrated", "migration", m.name)
			}
			return err
		})
		if err != nil {
			if errors.Is(err, companion.ErrSchemaTooNew) || errors.Is(err, ErrSchemaOld) {
				return err
			}
			return fmt.Errorf("postgres: migrate: %w", err)
		}
	}
	return nil
}

// tx runs fn in a transaction (READ COMMITTED) and commits it. fn may run
// more than once: a deadlock or a serialization failure, which PostgreSQL
// resolves by aborting one transaction, runs it again. Whatever else fn
// returns rolls the transaction back and is returned as is.
func (s *Store) tx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	for attempt := 1; ; attempt++ {
		err := pgx.BeginFunc(ctx, s.pool, fn)
		if attempt < 5 && retryable(err) {
			continue
		}
		return err
	}
}

// clock returns the store's time to the microsecond, as PostgreSQL keeps
// it, so that what a write returns equals what a read returns later: its
// clock plus ClockOffset, the database's when the store's is far from it
// (bug 314).
func (s *Store) clock() time.Time {
	return pgTime(s.now().Add(s.ClockOffset()))
}

// clockTrust is how far the store's clock may be from the database's and
// still stamp what it writes (stampAt), and judge ages (purgeCut).
const clockTrust = time.Minute

// stampAt is the time to stamp a write with, given db, the database's
// clock as the write's transaction read it: the store's own, to the
// microsecond, when within clockTrust of the database's; the database's
// when further. Every replica stamps by that one clock, the clock the
// purges judge ages by (purgeCut): a replica 2 h behind stamped a command
// it had just ended 2 h old, and the hourly purge deleted it and its
// events 2 h before their retention (docs/reliability.md, bug 313).
func (s *Store) stampAt(db time.Time) time.Time {
	return pgTime(s.now().Add(s.offsetAt(db)))
}

// offsetAt notes and returns the store's ClockOffset given db, the
// database's clock as read a moment ago.
func (s *Store) offsetAt(db time.Time) time.Duration {
	d := db.Sub(s.now())
	switch old := s.ClockOffset(); {
	case d >= -clockTrust && d <= clockTrust:
		d = 0
	case d-old > -time.Second && d-old < time.Second:
		return old // the same, but for the round trip's jitter: kept steady
	}
	s.offset.Store(int64(d))
	return d
}

// ClockOffset is how far the database's clock is ahead of the store's
// (Options.Now), as last seen: 0 while they are within a minute, as the
// store stamps then by its own. The store's clock plus ClockOffset is the
// clock of the times it stamps (stampAt) and of a command's ExpiresAt:
// what a dispatcher judges them by, whatever its own clock says (bug
// 314). It is seen as the store opens, in each write of a command and in
// each ExpiredCommands.
func (s *Store) ClockOffset() time.Duration {
	return time.Duration(s.offset.Load())
}

// pgTime is t in UTC to the microsecond, as a timestamptz keeps it.
func pgTime(t time.Time) time.Time {
	return t.Truncate(time.Microsecond).UTC()
}

// validID reports whether s can be an id: not empty, no NUL byte (which
// PostgreSQL's text cannot hold, and which the bbolt engine refuses).
func validID(s string) bool {
	return s != "" && !strings.ContainsRune(s, 0)
}

// isUniqueViolation reports whether err is a unique_violation.
func isUniqueViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505"
}

// pageCap is the capacity to give a page of at most limit items.
func pageCap(limit int) int {
	if limit <= 0 {
		return 0
	}
	return min(limit, 1000)
}

// seqText is a uint64 as the text of a numeric.
func seqText(seq uint64) string { return strconv.FormatUint(seq, 10) }

// parseSeq reads back what seqText wrote.
func parseSeq(s string) (uint64, error) {
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("postgres: bad seq %q: %w", s, err)
	}
	return v, nil
}
