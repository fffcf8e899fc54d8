// Package broker is the command broker: it turns accepted operations into
// command messages on per-device MQTT topics, tracks each command's life from
// the bridges' replies, and takes device status and settings into the store.
//
// A command is stored (queued, fsync'd) before anything is published; an
// outbox publishes queued commands in acceptance order on start, on every
// reconnect and whenever a command is accepted, so a broker outage only
// delays them. The embedded MQTT server lives in broker/embedded.
package broker
