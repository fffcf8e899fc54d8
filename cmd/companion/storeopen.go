package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/devicecompanion/companion/api"
	"github.com/devicecompanion/companion/broker"
	"github.com/devicecompanion/companion/internal/pprofserver"
	"github.com/devicecompanion/companion/store"
	"github.com/devicecompanion/companion/store/postgres"
)

// isPostgres reports whether --store names a PostgreSQL database.
func isPostgres(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

// openStore opens the store the configuration names: PostgreSQL for a
// postgres:// --store, the bbolt file in --data otherwise.
func (m *Main) openStore(ctx context.Context) error {
	cfg := m.Config
	switch {
	case isPostgres(cfg.Store):
		pg, err := postgres.Open(ctx, cfg.Store, postgres.Options{Logger: m.Logger, Now: cfg.Now})
		if postgres.Refused(err) {
			// Refused again at every start: a usage error, exit status
			// 2, which the unit does not restart; a database not up yet
			// stays status 1, restarted (bug 437).
			return usageError{fmt.Sprintf("--store: %v: PostgreSQL refuses the role, its password or the database of --store at every start: "+
				"mend the URL (COMPANION_STORE) or the database's roles, then start the server again", err)}
		}
		if err != nil {
			return fmt.Errorf("--store: %w", err)
		}
		m.DB, m.pg = pg, pg
	case cfg.Store == "":
		db, err := store.Open(filepath.Join(cfg.Data, "companion.db"), store.Options{Now: cfg.Now, Logger: m.Logger})
		if err != nil {
			return err
		}
		m.DB, m.bolt = db, db
		if m.PProf != nil {
			pprofserver.Publish("store", func() any { return db.WriteStats() })
		}
	default:
		return usageError{fmt.Sprintf("--store %q: give a postgres:// URL, or nothing for the bbolt file in --data", cfg.Store)}
	}
	return nil
}

// readyTimeout bounds the store's check in /readyz.
const readyTimeout = 2 * time.Second

// ready is /readyz's check (CONTRACT §1: store open, MQTT connected). A
// PostgreSQL store is asked: while the database cannot be reached every
// request but the health checks is a 503 unavailable, and a load balancer
// should know it; so is a pool whose every connection stays in use (by
// statements waiting for a lock), which Ping tells apart. So is a store whose last write its disk refused (full;
// PostgreSQL's, or read-only): every write is a 503 unavailable until one
// succeeds; and a bbolt store whose disk has kept a write waiting 10 s.
// So is a server whose Mosquitto account may not use the dynamic-security
// plugin (dynsec.Driver.NotReady).
func (m *Main) ready(ctx context.Context) error {
	if err := m.Broker.NotReady(); err != nil {
		return err
	}
	if m.Dynsec != nil {
		// Commands flow, but no account can be made (bug 483).
		if err := m.Dynsec.NotReady(); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	if m.pg != nil {
		if err := m.pg.Ping(ctx); err != nil {
			var taken *postgres.PoolTakenError
			if errors.As(err, &taken) {
				return taken // the database answers; what holds the pool does not
			}
			return fmt.Errorf("the PostgreSQL store cannot be reached within %v", readyTimeout)
		}
		if err := m.pg.CheckWrites(ctx); err != nil {
			return errors.New("the PostgreSQL store cannot write now (its disk full, or the server read-only): see the log")
		}
	}
	if m.bolt != nil {
		if err := m.bolt.CheckWrites(ctx); err != nil {
			return errors.New("the store cannot write to its disk now (full, or failing): see the log")
		}
	}
	return nil
}

// joinReplicas, with a PostgreSQL store, answers this replica's waiters
// when another replica finishes a command and wakes the dispatcher when
// another accepts one (the store's notifications), and campaigns to be the
// replica that dispatches (CONTRACT §11). Its goroutines end in Close.
func (m *Main) joinReplicas() {
	if m.pg == nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.stopListen = cancel
	m.listenDone = make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		err := m.pg.ListenCommands(ctx, func(id string) { m.Broker.CommandChanged(ctx, id) })
		if err != nil && ctx.Err() == nil {
			m.Logger.Error("listening for other replicas' commands ended", "err", err)
		}
	})
	wg.Go(func() {
		err := m.pg.Campaign(ctx, m.Broker.DispatcherChanged)
		if err != nil && ctx.Err() == nil {
			m.Logger.Error("the dispatcher campaign ended", "err", err)
		}
	})
	go func() {
		wg.Wait()
		close(m.listenDone)
	}()
}

// dispatcher is the broker's Dispatcher: the PostgreSQL store's election,
// or none for a server alone on its bbolt file.
func (m *Main) dispatcher() broker.Dispatcher {
	if m.pg == nil {
		return nil
	}
	return m.pg
}

// rateLimiter keeps the API's rate limits: with a PostgreSQL store in the
// database, so that the replicas on it share one budget per token, user
// and source address (CONTRACT §11); with the bbolt file, nil (the API's
// own, in this process).
func (m *Main) rateLimiter() api.RateLimiter {
	if m.pg == nil {
		return nil
	}
	return m.pg.RateLimiter(postgres.RateLimiterOptions{})
}

// replicaClientID is the server's MQTT client id: companion-server alone,
// or companion-server-ID for a replica that shares its store (PostgreSQL)
// and broker with others, which must each have their own (by default the
// host's name).
func replicaClientID(cfg Config) (string, error) {
	id := cfg.ReplicaID
	if id == "" && isPostgres(cfg.Store) {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("--replica-id: no host name to default to: %w", err)
		}
		id = h
	}
	if id == "" {
		return "companion-server", nil
	}
	return "companion-server-" + id, nil
}

// runMigrate applies the PostgreSQL store's schema (companion migrate
// --store URL); the server checks it at start and refuses an older one.
func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setUsage(fs)
	dsn := fs.String("store", "", "postgres://USER@HOST:PORT/DB to bring to this version's schema")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("migrate takes no arguments, got %q", fs.Args())}
	}
	if !isPostgres(*dsn) {
		return usageError{"migrate needs --store postgres://…: the bbolt file migrates itself when the server opens it"}
	}
	if err := postgres.Migrate(ctx, *dsn); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "companion: the store's schema is up to date")
	return nil
}

// storeUnavailable tells the store's errors of being unreachable or
// unable to write now (the API answers them 503 with Retry-After, nothing
// accepted): PostgreSQL's, and the bbolt file's disk full or failing.
func (m *Main) storeUnavailable(err error) bool {
	if m.pg != nil {
		return postgres.IsUnavailable(err)
	}
	return errors.Is(err, store.ErrUnwritable)
}

// storeLogger is the logger of the pieces that use the store (the API,
// the broker, the events hub). A line of theirs whose err is a fault of
// the store's (storeUnavailable: PostgreSQL cannot be reached, refuses
// connections, cannot write, a lock waited out; the bbolt file's disk
// full or failing) is at debug level: the store says each fault itself,
// once as it starts, once a minute while it stands and once as it is
// gone, with what to do (internal/faultlog). Every request and every
// retry of a reply said it again (bugs 185 and 199).
func (m *Main) storeLogger() *slog.Logger {
	return slog.New(storeFaultsAtDebug{m.Logger.Handler(), m.storeUnavailable})
}

// storeFaultsAtDebug is a handler that logs the records whose err is a
// fault of the store's at debug level. It reads the record's own
// attributes: no line of the store's users attaches its err with
// Logger.With, which this would miss.
type storeFaultsAtDebug struct {
	slog.Handler
	fault func(error) bool // the store's: whether err is a fault it says itself
}

func (h storeFaultsAtDebug) Handle(ctx context.Context, r slog.Record) error {
	if r.Level > slog.LevelDebug && h.storeFault(r) {
		if !h.Handler.Enabled(ctx, slog.LevelDebug) {
			return nil
		}
		r = r.Clone()
		r.Level = slog.LevelDebug
	}
	return h.Handler.Handle(ctx, r)
}

func (h storeFaultsAtDebug) WithAttrs(attrs []slog.Attr) slog.Handler {
	return storeFaultsAtDebug{h.Handler.WithAttrs(attrs), h.fault}
}

func (h storeFaultsAtDebug) WithGroup(name string) slog.Handler {
	return storeFaultsAtDebug{h.Handler.WithGroup(name), h.fault}
}

// storeFault reports whether r's err is a fault of the store's.
func (h storeFaultsAtDebug) storeFault(r slog.Record) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if err, ok := a.Value.Any().(error); ok && a.Key == "err" && h.fault(err) {
			found = true
			return false
		}
		return true
	})
	return found
}
