package store

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/google/uuid"
	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/internal/faultlog"
	"github.com/devicecompanion/companion/internal/groupcommit"
)

// SchemaVersion is the layout of the bbolt file this code reads and
// writes. Open migrates older files up to it and refuses newer ones.
const SchemaVersion = 7

// Bucket names. Index buckets hold keys only (empty values) unless said
// otherwise; composite keys join their parts with a NUL byte, which no id
// may contain, so a part followed by NUL is a prefix for a cursor scan.
var (
	bucketMeta          = []byte("meta")
	bucketUsers         = []byte("users")          // user id → User
	bucketUserTokens    = []byte("user_tokens")    // token hash → user id
	bucketDevices       = []byte("devices")        // device id → RegistryDevice
	bucketBridges       = []byte("bridges")        // bridge id → Bridge
	bucketBridgeSecrets = []byte("bridge_secrets") // secret hash → bridge id
	bucketBindings      = []byte("bindings")       // device id → Binding
	bucketUserBindings  = []byte("user_bindings")  // user id, device id → Binding (a copy: a list reads no second bucket); schema 6 on
	bucketStatus        = []byte("status")         // device id → Status
	bucketBridgeDevices = []byte("bridge_devices") // bridge id, device id
	bucketSettings      = []byte("settings")       // device id → Settings
	bucketCommands      = []byte("commands")       // command id → Command
	bucketDeviceCmds    = []byte("device_cmds")    // device id, command id; from schema 7, once folded from device_cmds_new
	bucketOpen          = []byte("open")           // command id → device id, non-final only
	bucketDeviceOpen    = []byte("device_open")    // device id, command id, non-final only; until schema 3
	bucketIdempotency   = []byte("idempotency")    // user id, key → Idempotency
	bucketFirmware      = []byte("firmware")       // model, version → Firmware
	bucketApps          = []byte("apps")           // app id, version → AppRelease
	bucketBlobs         = []byte("blobs")          // sha256 hex → Blob

	// Since schema version 2: what the outbox and the expiry sweep read,
	// so that neither has to decode every open command.
	bucketQueued = []byte("queued") // command id → device id, state queued only
	bucketExpiry = []byte("expiry") // expires_at (8-byte big-endian unix ns), command id; queued or sent only

	// Since schema version 3, in place of device_open: how many non-final
	// commands each device has, so that accepting one reads one key rather
	// than counting up to the limit, and a commit writes one small page
	// for all of them.
	bucketOpenCount = []byte("open_count") // device id → count (8-byte big-endian), when not 0

	// Since schema version 4: which bridge serves which device (CONTRACT
	// §9), and which unfinished commands need which blob.
	bucketAssignments  = []byte("assignments")   // device id → bridge id
	bucketBridgeServes = []byte("bridge_serves") // bridge id, device id
	bucketBlobRefs     = []byte("blob_refs")     // sha256, command id → device id; non-final only
	bucketOwnerBridges = []byte("owner_bridges") // user id, bridge id: the users' own bridges

	// Since schema version 7: the device_cmds entries of the newest
	// commands, not yet folded into device_cmds (see foldDeviceCmds). A
	// command's entry in device_cmds dirties a page of its own device,
	// while this bucket only grows at its end.
	bucketDeviceCmdsNew = []byte("device_cmds_new") // command id → device id

	keySchemaVersion = []byte("schema_version")
)

// allBuckets is every bucket of schema version 1.
var allBuckets = [][]byte{
	bucketMeta, bucketUsers, bucketUserTokens, bucketDevices, bucketBridges,
	bucketBridgeSecrets, bucketBindings, bucketUserBindings, bucketStatus,
	bucketBridgeDevices, bucketSettings, bucketCommands, bucketDeviceCmds,
	bucketOpen, bucketDeviceOpen, bucketIdempotency, bucketFirmware,
	bucketApps, bucketBlobs,
}

// migrations[v] takes a file from schema version v to v+1. A file with no
// meta bucket is version 0 (new or empty).
var migrations = []func(tx *bolt.Tx) error{
	0: func(tx *bolt.Tx) error {
		for _, name := range allBuckets {
			if _, err := tx.CreateBucketIfNotExists(name); err != nil {
				return fmt.Errorf("create bucket %s: %w", name, err)
			}
		}
		return nil
	},
	1: func(tx *bolt.Tx) error {
		for _, name := range [][]byte{bucketQueued, bucketExpiry} {
			if _, err := tx.CreateBucketIfNotExists(name); err != nil {
				return fmt.Errorf("create bucket %s: %w", name, err)
			}
		}
		cmds := tx.Bucket(bucketCommands)
		return tx.Bucket(bucketOpen).ForEach(func(id, _ []byte) error {
			var c companion.Command
			ok, err := getJSON(cmds, id, &c)
			if err != nil || !ok {
				return err
			}
			return indexCommand(tx, companion.Command{}, c)
		})
	},
	2: func(tx *bolt.Tx) error {
		if err := tx.DeleteBucket(bucketOpenCount); err != nil && !errors.Is(err, bolterrors.ErrBucketNotFound) {
			return err
		}
		counts, err := tx.CreateBucket(bucketOpenCount)
		if err != nil {
			return err
		}
		err = tx.Bucket(bucketOpen).ForEach(func(_, dev []byte) error {
			_, err := addOpen(counts, bytes.Clone(dev), 1, 0)
			return err
		})
		if err != nil {
			return err
		}
		if err := tx.DeleteBucket(bucketDeviceOpen); err != nil && !errors.Is(err, bolterrors.ErrBucketNotFound) {
			return err
		}
		return nil
	},
	3: migrateTo4,
	4: migrateTo5,
	5: migrateTo6,
	6: migrateTo7,
}

// migrateTo4 makes the buckets of bridge assignments and blob references.
// So that an upgrade does not stop every device, each device is assigned
// to the bridge that last reported it, if that bridge still exists; and
// each unfinished command's blob is read from its payload.
func migrateTo4(tx *bolt.Tx) error {
	for _, name := range [][]byte{bucketAssignments, bucketBridgeServes, bucketBlobRefs, bucketOwnerBridges} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return fmt.Errorf("create bucket %s: %w", name, err)
		}
	}
	bridges := tx.Bucket(bucketBridges)
	err := tx.Bucket(bucketStatus).ForEach(func(dev, v []byte) error {
		var s companion.Status
		if err := fastjson.Unmarshal(v, &s); err != nil {
			return fmt.Errorf("status %s: %w", dev, err)
		}
		if s.BridgeID == "" || bridges.Get([]byte(s.BridgeID)) == nil || tx.Bucket(bucketDevices).Get(dev) == nil {
			return nil
		}
		return assign(tx, string(dev), s.BridgeID)
	})
	if err != nil {
		return err
	}
	cmds := tx.Bucket(bucketCommands)
	return tx.Bucket(bucketOpen).ForEach(func(id, _ []byte) error {
		var c companion.Command
		ok, err := getJSON(cmds, id, &c)
		if err != nil || !ok {
			return err
		}
		var p struct {
			Blob struct {
				SHA256 string `json:"sha256"`
			} `json:"blob"`
		}
		if fastjson.Unmarshal(c.Payload, &p) != nil || p.Blob.SHA256 == "" {
			return nil
		}
		c.Blob = p.Blob.SHA256
		if err := putJSON(cmds, id, c); err != nil {
			return err
		}
		return tx.Bucket(bucketBlobRefs).Put(key(c.Blob, c.ID), []byte(c.DeviceID))
	})
}

// Options configures Open. The zero value gives the defaults.
type Options struct {
	// Now is the clock; time.Now when nil. Tests inject their own.
	Now func() time.Time
	// Logger receives the store's few log lines; slog.Default() when nil.
	Logger *slog.Logger
	// BlobDir holds blob files; "blobs" beside the bbolt file when empty.
	BlobDir string
	// Timeout bounds the wait for the bbolt file lock, so that a second
	// process gets an error rather than hanging; 5s when zero.
	Timeout time.Duration
}

// DB is the service's store: one bbolt file and a directory of blobs.
// It is safe for concurrent use.
type DB struct {
	bolt    *bolt.DB
	writer  *groupcommit.Committer // the grouped writes (batch)
	path    string
	blobDir string
	now     func() time.Time
	log     *slog.Logger

	// faults says in the log that the disk refuses the store's writes,
	// once as it starts, once a minute while it does and once as it takes
	// them again (watchDisk), rather than every caller for every write.
	faults    *faultlog.Log[diskFault]
	stop      chan struct{} // closed by Close: watchDisk returns
	stopOnce  sync.Once
	watchDone chan struct{} // closed as watchDisk returns

	purgeBatch int // deletions per transaction of PurgeCommands, PurgeEvents and PurgeIdempotency
	// afterPurgeBatch, when set (by tests), runs between two write
	// transactions of a purge that has more to do.
	afterPurgeBatch func()

	onEvents atomic.Pointer[func()] // called after each commit that appended events (OnEvents)

	blobMu sync.RWMutex // the blob directory's files against their records (blobLock)

	backupMu sync.Mutex // one Backup at a time (its mark, keyBackup)

	tokens tokenCache // UserByTokenHash's answers

	undecodable  sync.Map     // records logged as left out for not decoding (logUndecodable)
	undecodableN atomic.Int64 // how many undecodable holds (Undecodable)

	foldAt int // device_cmds_new entries that make a fold due (foldDeviceCmdsAt)

	uuidV7 func() (uuid.UUID, error) // the UUIDv7 a command id starts from (commandID); uuid.NewV7
}

// commitLinger is how long the store's committer waits for company after a
// commit of several writes (groupcommit.Options.Linger). Measured with the
// path benchmark (docs/performance.md): at 1 ms the server spends a fifth
// less CPU per accepted command; 2 ms saved more end to end but accepted
// no faster in the closed loop of 32 clients, whose every request waits it.
const commitLinger = time.Millisecond

// preallocate is how much of the file past its last page the store keeps
// written with zeros (groupcommit.Options.Preallocate): a store that grows
// under load then commits into blocks the file system has allocated.
const preallocate = 4 << 20

// Open opens or creates the bbolt file at path, creating its directory
// (mode 0700) and the blob directory, and migrates the file to
// SchemaVersion. It returns ErrSchemaTooNew for a file written by a newer
// version of the store, and ErrDamaged for one it cannot read (cut short,
// or empty where a store was), which it leaves as it is.
func Open(path string, opts Options) (*DB, error) {
	if path == "" {
		return nil, fmt.Errorf("%w: empty path", companion.ErrInvalid)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.BlobDir == "" {
		opts.BlobDir = filepath.Join(filepath.Dir(path), "blobs")
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	if err := os.MkdirAll(opts.BlobDir, 0o700); err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	_, statErr := os.Stat(path)
	created := errors.Is(statErr, os.ErrNotExist) // by this Open, if it makes one
	if err := checkFile(path); err != nil {
		if errors.Is(err, fs.ErrPermission) {
			return nil, permissionError(path, err)
		}
		return nil, fmt.Errorf("store: %s: %w; the server does not open it and leaves it as it is: restore it from a backup, or move it aside to start with an empty store", path, err)
	}
	bdb, err := bolt.Open(path, 0o600, &bolt.Options{
		Timeout: opts.Timeout,
		// The freelist is not written at each commit but rebuilt from the
		// pages when the file is opened (as etcd does): a commit writes
		// only the pages it changed. The hashmap freelist allocates in
		// constant time however fragmented the file is.
		NoFreelistSync: true,
		FreelistType:   bolt.FreelistMapType,
		// bbolt maps the file and maps it again, larger, whenever it
		// outgrows the mapping (doubling up to 1 GiB), and to do so a commit
		// waits until every read transaction has ended and holds new ones
		// off. Reserving the address space up front (as etcd does) spares a
		// growing store those stalls; the reservation is not memory.
		InitialMmapSize: groupcommit.MmapReserve,
	})
	if errors.Is(err, bolterrors.ErrTimeout) {
		// bbolt locks the file for one process: say who holds it rather
		// than a bare "timeout".
		return nil, fmt.Errorf("store: open %s: another process holds it (a companion server already running on this --data?): %w", path, err)
	}
	if errors.Is(err, fs.ErrPermission) && !created {
		return nil, permissionError(path, err)
	}
	if err != nil {
		removeCreated(path, created)
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	db := &DB{bolt: bdb, path: path, blobDir: opts.BlobDir, now: opts.Now, log: opts.Logger, foldAt: foldDeviceCmdsAt, uuidV7: uuid.NewV7,
		faults: newDiskFaults(opts.Logger, path), stop: make(chan struct{}), watchDone: make(chan struct{})}
	if err := db.migrate(); err != nil {
		_ = bdb.Close()
		removeCreated(path, created)
		return nil, err
	}
	db.writer = groupcommit.New(bdb, groupcommit.Options{Linger: commitLinger, Begin: fillAppendOnly, Preallocate: preallocate,
		StallAfter: stallAfter, OnStall: db.onStall, Lasting: diskFull, RetryAfter: commitRetry})
	go db.watchDisk()
	// We hold the file lock, so no other store uses this blob directory:
	// temp files left there are from a crash.
	db.removeStaleTemps()
	return db, nil
}

// permissionError is the error of Open for a file the server's user may
// not read or write (bug 431): one restored by root into the data
// directory, say. It is no sign of damage, and the advice for a damaged
// file (move it aside to start with an empty store) would lose it: it
// says whose the file is and to give it to the owner of its directory.
func permissionError(path string, err error) error {
	msg := fmt.Sprintf("store: %s: %v: the server, running as uid %d, may not read and write the file; it has not changed it", path, err, os.Geteuid())
	var file, dir syscall.Stat_t
	if syscall.Stat(path, &file) == nil && syscall.Stat(filepath.Dir(path), &dir) == nil {
		msg += fmt.Sprintf(" (it belongs to uid %d, its directory to uid %d): give it to the server's user, as the rest of its data directory (chown %d:%d %s; a restore as root leaves it root's), and start it again",
			file.Uid, dir.Uid, dir.Uid, dir.Gid, path)
	} else {
		msg += ": give it to the server's user (chown), and start it again"
	}
	return &permError{msg: msg, err: err}
}

// permError is permissionError's error: its message, and err to match.
type permError struct {
	msg string
	err error
}

func (e *permError) Error() string { return e.msg }
func (e *permError) Unwrap() error { return e.err }

// removeCreated removes the bbolt file at path that a failed Open created,
// so that it leaves nothing behind: bbolt creates the file before it
// writes its first pages, and on a full disk left it empty, which the
// next Open, with space back, took for a store lost (ErrDamaged).
func removeCreated(path string, created bool) {
	if created {
		_ = os.Remove(path)
	}
}

// migrate takes the file from its stored schema version to SchemaVersion
// in one transaction, one step at a time.
func (db *DB) migrate() error {
	return db.bolt.Update(func(tx *bolt.Tx) error {
		from, err := schemaVersion(tx)
		if err != nil {
			return err
		}
		if from > SchemaVersion {
			// The file named, and what to do: the server exits 65 on
			// it, not restarted by its unit (bug 433).
			return fmt.Errorf("%w: %s has schema %d, this build knows %d; the server has not changed it: start the newer build on it again, "+
				"or, to go back, put back the copy of the data directory kept before the upgrade (docs/operations.md, Upgrading)",
				companion.ErrSchemaTooNew, db.path, from, SchemaVersion)
		}
		for v := from; v < SchemaVersion; v++ {
			if err := migrations[v](tx); err != nil {
				return fmt.Errorf("store: migrate schema %d to %d: %w", v, v+1, err)
			}
		}
		if err := db.openedBackup(tx); err != nil {
			return fmt.Errorf("store: open a backup: %w", err)
		}
		if from == SchemaVersion {
			return nil
		}
		if err := tx.Bucket(bucketMeta).Put(keySchemaVersion, []byte(strconv.Itoa(SchemaVersion))); err != nil {
			return err
		}
		db.log.Info("store: schema migrated", "path", db.path, "from", from, "to", SchemaVersion)
		return nil
	})
}

// schemaVersion reads the stored schema version; 0 for a file without one.
func schemaVersion(tx *bolt.Tx) (int, error) {
	meta := tx.Bucket(bucketMeta)
	if meta == nil {
		return 0, nil
	}
	raw := meta.Get(keySchemaVersion)
	if raw == nil {
		return 0, nil
	}
	v, err := strconv.Atoi(string(raw))
	if err != nil || v < 0 {
		return 0, fmt.Errorf("store: bad schema version %q", raw)
	}
	return v, nil
}

// Close finishes the writes under way and closes the bbolt file. Calls
// made after Close fail.
func (db *DB) Close() error {
	db.stopOnce.Do(func() { close(db.stop) })
	<-db.watchDone
	db.writer.Close()
	return db.bolt.Close()
}

// WriteStats counts the store's grouped writes.
type WriteStats struct {
	Commits int64 `json:"commits"` // transactions committed, each one fsync of the file
	Writes  int64 `json:"writes"`  // writes they carried
	Pages   int64 `json:"pages"`   // dirty pages the transactions wrote (bbolt's spilled nodes)
}

// WriteStats returns how many grouped writes the store has committed, and
// in how many transactions, since Open.
func (db *DB) WriteStats() WriteStats {
	s, b := db.writer.Stats(), db.bolt.Stats()
	return WriteStats{Commits: s.Commits, Writes: s.Ops, Pages: b.TxStats.GetSpill()}
}

// WriteWaiting returns how long the group of writes under way has waited
// for its commit; 0 when none is under way. A disk that does not answer
// keeps it waiting (bug 339), and the server's shutdown says so (bug 343).
func (db *DB) WriteWaiting() time.Duration {
	return db.writer.Busy()
}

// Path returns the path of the bbolt file.
func (db *DB) Path() string {
	return db.path
}

// BlobDir returns the directory holding blob files.
func (db *DB) BlobDir() string {
	return db.blobDir
}

// ErrUnwritable means the store could not write to its disk now: the disk
// is full, a file size limit or quota is reached, or it fails. Nothing of
// the write was kept (bbolt rolled its transaction back; a blob's temp
// file is removed), and the same write may succeed once the disk takes
// writes again, without a restart.
var ErrUnwritable = errors.New("store: the data directory cannot be written now")

// unwritable marks err, the disk's refusal of a write, as ErrUnwritable,
// and tells the log's fault of it (db.faults): the store's callers need
// not log it again.
func (db *DB) unwritable(err error) error {
	err = fmt.Errorf("%w: %w", ErrUnwritable, err)
	db.faults.Failed(diskUnwritable, err)
	return err
}

// Faults calls fn with the name of each fault of the store's disk the log
// says ("cannot write", "not answering") and whether it stands now, for
// the server's metrics (bug 340).
func (db *DB) Faults(fn func(name string, stands bool)) {
	db.faults.Each(fn)
}

// diskFault is a fault of the store's disk: it refuses writes, or does not
// answer.
type diskFault int

const (
	diskUnwritable diskFault = iota
	// diskStalled: a write has waited stallAfter for its commit, the
	// disk not answering (bug 339).
	diskStalled
)

// newDiskFaults returns the log of the disk's faults of the store at path.
func newDiskFaults(log *slog.Logger, path string) *faultlog.Log[diskFault] {
	return faultlog.New(faultlog.Options[diskFault]{
		Logger: log,
		Faults: map[diskFault]faultlog.Fault{diskUnwritable: {
			Name: "cannot write",
			Words: "store: the data directory cannot be written (its disk full, a quota or the file size limit reached, the disk " +
				"failing, or its file system read-only): requests that would store something are answered 503 unavailable, and the " +
				"bridges' replies and statuses wait, until it can; free space on its disk (du -sh DATA/companion.db DATA/blobs), or see " +
				"the system's log for the disk's errors",
		}, diskStalled: {
			Name: "not answering",
			Words: "store: a write of the data directory has not finished in " + stallAfter.String() + " (its disk not answering: " +
				"a network volume unreachable, or a failing disk retrying): requests that would store something, and the bridges' " +
				"replies and statuses, wait for it, and /readyz answers 503 until it answers; see the system's log for the disk's errors",
		}},
		Attrs: []any{"path", path},
		Still: "store: the data directory still cannot be written",
		Gone:  "store: the data directory takes writes again",
	})
}

// diskRefused reports whether err is the disk's refusal of a write: no
// space, the file size limit (RLIMIT_FSIZE), the quota; or the disk
// failing (EIO), or its file system gone read-only (EROFS, as ext4
// remounts itself on the disk's errors), which a bbolt commit meets as a
// failed commit too (bug 338).
func diskRefused(err error) bool {
	for _, e := range []syscall.Errno{syscall.ENOSPC, syscall.EFBIG, syscall.EDQUOT, syscall.EIO, syscall.EROFS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// diskFull reports whether err, a commit's failure, is of a disk that
// refuses every write that grows a file, for as long as it is full (no
// space, the file size limit, the quota) or read-only: bbolt's error in
// growing the file carries the disk's in its text only. The committer
// tries a commit again only every commitRetry then (bug 342).
func diskFull(err error) bool {
	for _, e := range []syscall.Errno{syscall.ENOSPC, syscall.EFBIG, syscall.EDQUOT, syscall.EROFS} {
		if errors.Is(err, e) {
			return true
		}
	}
	return strings.Contains(err.Error(), "file resize error")
}

// commitRetry is how long after a commit the disk refused for being full
// the store's writes fail at once, without a commit (bbolt's rollback of
// a failed commit scans the whole file, a third of a second of CPU for
// 500 MB), before one is tried again: the writes of that time, and the
// probes of CheckWrites, are ErrUnwritable without costing the disk or
// the CPU anything. Tests shorten it.
var commitRetry = 2 * time.Second

// keyWriteProbe is the meta key CheckWrites writes and deletes.
var keyWriteProbe = []byte("write_probe")

// CheckWrites reports whether the store takes writes now: nil while its
// last commit succeeded; when it failed, CheckWrites commits a small write
// of its own (a page of the meta bucket written again) and returns its
// error, ErrUnwritable while the disk refuses it. So the answer follows
// the disk back even when nothing else writes, as when a server reported
// not ready is sent no requests. It is ErrUnwritable too while a write has
// waited stallAfter for its commit, the disk not answering (bug 339).
func (db *DB) CheckWrites(ctx context.Context) error {
	if err := db.stalled(); err != nil {
		return err
	}
	if db.writer.Err() == nil && !db.faults.Stands(diskUnwritable) {
		return nil
	}
	return db.checkWrite(ctx)
}

// stalled is ErrUnwritable while the group of writes under way has waited
// stallAfter or more for its commit (a disk that does not answer), and
// nil otherwise; it ends the log's fault of it once none waits so.
func (db *DB) stalled() error {
	if d := db.writer.Busy(); d >= stallAfter {
		return fmt.Errorf("%w: a write has waited %v for the disk", ErrUnwritable, d.Round(time.Millisecond))
	}
	db.faults.Gone(diskStalled)
	return nil
}

// checkWrite commits a small write of its own (a page of the meta bucket
// written again): nil once it committed and the file could grow,
// ErrUnwritable while the disk refuses either. The write fits in pages
// the file has free, which a full disk leaves it as a rule, so the file's
// room to grow is asked of the committer's zeros ahead, which the write's
// transaction tries to write (groupcommit.Committer.Cramped): without
// it, the write succeeded while every new command was refused (bug 341).
// It ends the log's fault when both succeed; its failures are not counted
// among the writes that met the fault.
func (db *DB) checkWrite(ctx context.Context) error {
	ch := make(chan error, 1)
	db.writer.Go(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketMeta)
		if err := b.Put(keyWriteProbe, []byte{1}); err != nil {
			return err
		}
		return b.Delete(keyWriteProbe)
	}, func(err error) { ch <- err })
	select {
	case err := <-ch:
		var ce *groupcommit.CommitError
		if errors.As(err, &ce) {
			return fmt.Errorf("%w: %w", ErrUnwritable, err)
		}
		if err == nil && db.writer.Cramped() {
			return fmt.Errorf("%w: the file cannot grow: writing zeros past its pages failed", ErrUnwritable)
		}
		if err == nil {
			db.faults.Gone(diskUnwritable)
		}
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// watchDisk asks, every second while the disk refuses the store's writes,
// whether it takes them again (a write of its own), so that the log says
// so even when nothing else writes; until Close, which waits for it.
func (db *DB) watchDisk() {
	defer close(db.watchDone)
	db.faults.Watch(db.stop, func(f diskFault) error {
		if f == diskStalled {
			return db.stalled()
		}
		return db.probeWrites()
	})
}

// onStall tells the log's fault of a write that has waited stallAfter
// (groupcommit.Options.OnStall), which watchDisk then follows.
func (db *DB) onStall() {
	if err := db.stalled(); err != nil {
		db.faults.Failed(diskStalled, err)
	}
}

// stallAfter is how long a write may wait for its commit before the store
// takes its disk as not answering (diskStalled); tests shorten it.
var stallAfter = 10 * time.Second

// probeTimeout bounds a probe of watchDisk's.
const probeTimeout = 2 * time.Second

// probeWrites is the log's probe of the disk's fault (faultlog.Watch):
// a write of its own.
func (db *DB) probeWrites() error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	return db.checkWrite(ctx)
}

// softError carries an error found by a Batch callback before it wrote
// anything. See batch.
type softError struct{ err error }

func (e softError) Error() string { return e.err.Error() }

// abort marks err as found before the callback wrote anything.
func abort(err error) error { return softError{err} }

// batch runs fn in a write transaction shared with every other write that
// queued up while the previous one was committing (internal/groupcommit):
// one transaction and one fsync for all of them. A callback that returns an
// error makes the group roll back and run again without that callback.
// Expected refusals (not found, queue full, …) are common and found before
// any write, so fn returns them wrapped by abort: batch then commits the
// group as usual and hands the error to its caller alone. fn may run more
// than once; it must reset whatever it reports on each run.
func (db *DB) batch(fn func(tx *bolt.Tx) error) error {
	ch := make(chan error, 1)
	db.batchAsync(fn, func(err error) { ch <- err })
	return <-ch
}

// batchAsync is batch without the wait: done (if not nil) gets the outcome
// once the transaction is committed. The done callbacks of all writes run
// one at a time in the order the writes were queued; they must be quick and
// must not wait for another write of the store.
func (db *DB) batchAsync(fn func(tx *bolt.Tx) error, done func(error)) {
	var soft error
	db.writer.Go(func(tx *bolt.Tx) error {
		soft = nil
		err := fn(tx)
		var se softError
		if errors.As(err, &se) {
			soft = se.err
			return nil
		}
		return err
	}, func(err error) {
		var ce *groupcommit.CommitError
		switch {
		case err == nil:
			err = soft
		case errors.As(err, &ce):
			// bbolt wraps some of the disk's errors in text only
			// (growing the file): every failed commit is the disk's.
			err = db.unwritable(err)
		}
		if done != nil {
			done(err)
		}
	})
}

// appendOnly are the buckets whose new keys sort after the old ones:
// UUIDv7 command ids, the event log's sequence, expiry times. bbolt splits
// a full page at the bucket's FillPercent, 50 % unless told, so that every
// page such a bucket leaves behind stays half empty for good: twice the
// pages to write, to keep and to walk.
var appendOnly = [][]byte{bucketCommands, bucketOpen, bucketQueued, bucketExpiry, bucketEvents, bucketDeviceCmdsNew}

// appendFill is where the append-only buckets split a full page.
const appendFill = 0.9

// fillAppendOnly has the append-only buckets of tx split their pages at 90 %;
// the committer runs it at the start of each transaction (bbolt keeps a
// bucket per transaction, so that this holds for every later tx.Bucket of
// it).
func fillAppendOnly(tx *bolt.Tx) {
	for _, name := range appendOnly {
		if b := tx.Bucket(name); b != nil {
			b.FillPercent = appendFill
		}
	}
}

// update runs fn in a write transaction of its own, for the rare writes
// that gain nothing from grouping. Errors wrapped by abort are unwrapped.
func (db *DB) update(fn func(tx *bolt.Tx) error) error {
	var fnErr error
	err := groupcommit.Update(db.bolt, func(tx *bolt.Tx) error {
		fnErr = fn(tx)
		return fnErr
	})
	var se softError
	switch {
	case errors.As(err, &se):
		return se.err
	case err != nil && fnErr == nil && !errors.Is(err, bolterrors.ErrDatabaseNotOpen):
		return db.unwritable(err) // the commit failed, as in batch
	}
	return err
}

// key joins parts with NUL bytes into a bbolt key.
func key(parts ...string) []byte {
	return []byte(strings.Join(parts, "\x00"))
}

// prefix is the key prefix of every composite key whose first part is p.
func prefix(p string) []byte {
	return []byte(p + "\x00")
}

// validID reports whether s can be a part of a key.
func validID(s string) bool {
	return s != "" && !strings.ContainsRune(s, 0)
}

// getJSON decodes the value at k into v; false when absent. Decoding
// copies, so v outlives the transaction.
func getJSON(b *bolt.Bucket, k []byte, v any) (bool, error) {
	raw := b.Get(k)
	if raw == nil {
		return false, nil
	}
	if err := fastjson.Unmarshal(raw, v); err != nil {
		return false, fmt.Errorf("store: decode %q: %w", k, err)
	}
	return true, nil
}

// putJSON encodes v and stores it at k.
func putJSON(b *bolt.Bucket, k []byte, v any) error {
	raw, err := fastjson.Marshal(v)
	if err != nil {
		return fmt.Errorf("store: encode %q: %w", k, err)
	}
	return b.Put(k, raw)
}

// scanPrefix calls fn with the rest of every key in b that starts with p,
// in key order, until fn returns false.
func scanPrefix(b *bolt.Bucket, p []byte, fn func(rest []byte) bool) {
	c := b.Cursor()
	for k, _ := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, _ = c.Next() {
		if !fn(k[len(p):]) {
			return
		}
	}
}

// cloneRaw copies a JSON value, keeping nil as nil.
func cloneRaw(m json.RawMessage) json.RawMessage {
	if m == nil {
		return nil
	}
	return bytes.Clone(m)
}

var _ companion.Store = (*DB)(nil)
