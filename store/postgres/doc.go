// Package postgres keeps the service's state in PostgreSQL (15 or later):
// companion.Store for any number of server replicas sharing one database
// (CONTRACT §11). Blobs are in the database too. Open connects and applies
// the schema; Migrate applies it alone, for `companion migrate`.
//
// It is the same store as the bbolt engine (package store), whose doc
// comments are the semantics; store/storetest checks both. It is not a
// general SQL layer: each method is one short transaction written by hand.
//
// # Schema
//
// Every bbolt bucket is a table (migrations/*.sql, applied in order, each
// in its own transaction under an advisory lock, and recorded in
// schema_migrations). Fields the store selects, orders or checks by are
// typed columns; values that are JSON to the service (a command's payload
// and result, settings, a status's apps) are json columns: json keeps the
// text as the store was given it (compacted), where jsonb would rewrite
// numbers, escapes and key order, and nothing queries inside them. Ids
// that lists are ordered by are text COLLATE "C", so pages follow byte
// order as in the bbolt engine, whatever the database's locale.
//
// # Order of a device's commands
//
// There is no single writer. CreateCommand locks the device's row of
// device_queues (SELECT … FOR UPDATE; a device's first command inserts
// the row, which locks it too) before anything else of the device: the
// commands of one device are accepted one at a time, across replicas. The
// row holds the device's count of unfinished commands (the queue limit)
// and the highest command id it has given. The id, a UUIDv7, is made inside that transaction, after
// the lock: from this process's clock, rising within the process, and
// above the device's last id whatever another replica's clock said. So
// the ids of a device rise in the order their transactions commit.
//
// Each id carries 16 bits of a hash of its device id in its random part
// (a UUIDv7 lets the random bits be anything): the asynchronous writes of
// a command are routed by that hash alone, with no lookup.
//
// # Asynchronous writes
//
// Writes that concern one device (commands, status, settings) go through
// a fixed set of lanes (half of MaxConns), each one goroutine, chosen by
// the hash of the device id: the writes of one device apply in the order
// they were made, those of different devices in parallel. The writes
// waiting on a lane when it comes to them share one transaction (up to 32:
// one commit, one WAL flush for all), each under a savepoint, so that one
// refused undoes only its own changes; within it they take their locks in
// the order of their device hashes, so batches on two replicas do not wait
// for each other in a circle, and if it fails before COMMIT all the same
// its writes run again one by one. A write that waits LockTimeout for a
// lock another session holds fails, and so do the writes after it in its
// batch, rather than hold the lane for as long as the lock is held. The synchronous methods wait on the
// same lanes, so they keep the order with the asynchronous ones.
// MarkBridgeOffline, which touches many devices, is a barrier: it runs
// once every lane has finished what was made before it, and the lanes
// wait for it. done runs on the lane after COMMIT returned (synchronous_commit
// on: the write is on disk), in the order of the writes, so it must be
// quick and must not wait for another write of the store. Close waits for
// the lanes.
//
// # Replicas
//
// Idempotency records are rows, and CreateCommand and PutIdempotency take
// a transaction-scoped advisory lock on the (user, key) pair, so two
// replicas given the same key create one command. Moving a command on is
// a compare-and-set: UpdateCommand reads it FOR UPDATE and hands it to fn,
// so of two replicas that both try to mark a queued command sent, the
// second sees it sent. Every transaction that changes a command's state
// calls pg_notify('companion_commands', id); ListenCommands lets a replica
// wake its `Prefer: wait` waiters when another replica stored the reply.
//
// Where there is no row yet to lock, a transaction-scoped advisory lock
// of the id stands for it: a device's first status report (putStatus), and
// the id that users and bridges share (CreateUser, CreateBridge).
//
// # Faults of the database
//
// Every connection the store makes carries a pgx tracer (health.go) that
// sorts each failed statement into a fault of the database's: it cannot
// be reached, it refuses new connections, it cannot write, it lacks other
// resources (IsUnavailable tells them all; the API answers them 503). The
// store logs each once as it starts, once a minute while it stands and
// once as a probe, every second while one stands, finds it gone
// (internal/faultlog, which the bbolt store shares); a lock waited out
// (LockTimeout) once a minute at most. Its callers need not
// log them again. CheckWrites, for /readyz, asks with a write of its own
// while a refusal to write stands.
package postgres
