// Package broker is the command broker: it turns accepted operations into
// command messages on per-device MQTT topics, tracks each command's life from
// the bridges' replies, and takes device status and settings into the store.
//
// A command is stored (queued, fsync'd) before anything is published; an
// outbox publishes queued commands in acceptance order on start, on every
// reconnect and whenever a command is accepted, so a broker outage only
// delays them. The embedded MQTT server lives in broker/embedded.
//
// The files: broker.go holds the Broker and its life (New, Start, Close);
// conn.go its MQTT connection (subscriptions, the routing of messages, a
// Publish for other users of the connection); intake.go what the bridges
// publish (replies, statuses, settings, bridge states); commands.go a
// command's life as the API sees it (Submit, Cancel, Wait); outbox.go the
// publishing of commands, the sweep and the resends.
package broker
