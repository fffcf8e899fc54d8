// Package store keeps the service's durable state in one bbolt file, with
// large binary content (images, app packages, firmware) as files beside it.
//
// Every access goes through Update, View or Batch callbacks; byte slices are
// copied out before a transaction ends. Concurrent writers use Batch so that
// their fsyncs are grouped. The store knows nothing of HTTP or MQTT; of this
// project it imports only the domain (package companion, the module's
// root), whose types it stores and whose errors it returns.
//
// Values are JSON in buckets keyed by id. Lookups other than by id go
// through index buckets kept in the same transaction as the records they
// point at (token hash → user, user+device → binding, device+command →
// command, the open commands, bridge+device → status), so listings are
// cursor scans in key order. Composite keys join their parts with a NUL
// byte, which no id may contain. Command ids are UUIDv7 assigned inside the
// write transaction, so their order is the order in which commands were
// accepted.
//
// The store checks what keeps its data consistent (uniqueness, ordering
// of reports, the open-command limit, final states) and nothing else:
// validating ids, settings against their schema, and claim codes is the
// caller's job.
package store
