// Package store keeps the service's durable state in one bbolt file, with
// large binary content (images, app packages, firmware) as files beside it.
//
// Every access goes through Update, View or Batch callbacks; byte slices are
// copied out before a transaction ends. Concurrent writers use Batch so that
// their fsyncs are grouped. The store knows nothing of HTTP or MQTT and
// imports nothing of this project.
package store
