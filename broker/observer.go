package broker

import "time"

// Observer is told what the broker does, for the server's metrics
// (internal/metrics implements it with Prometheus; --metrics). It is
// declared here, where it is called, so that the broker neither imports a
// metrics library nor cares whether anyone counts: Options.Observer nil
// means nobody does. Its methods are called on the broker's hot paths,
// some from the store's commit callbacks and paho's handlers: they must be
// quick and must not block.
type Observer interface {
	// CommandState is called once each time a command that this server
	// accepted or changed enters a state: StateQueued when it is
	// accepted, then each later state it is written in (a command may
	// skip sent and delivered: see sentDelay). age is the time since the
	// command was accepted, no less than 0 (sinceAccepted); for a final
	// state it is the command's accept-to-final latency.
	CommandState(op, state string, age time.Duration)
	// MQTTConnected is called when the broker's MQTT connection becomes
	// ready (connected and subscribed) and when it is lost.
	MQTTConnected(up bool)
	// StoreWrite is called when a write the broker made to the store is
	// durable (or failed), with its kind (one of the StoreWrite…
	// constants) and how long it took from the call.
	StoreWrite(kind string, took time.Duration)
	// ReportCoalesced is called when a device's status or settings
	// (kind: "status" or "settings") was acknowledged and not stored,
	// because it came over Options.ReportRate and a newer one took its
	// place.
	ReportCoalesced(kind string)
	// BridgesAway is called with how many bridges this server takes as
	// away (their Will the last word from them; their devices' commands
	// wait queued) each time that changes.
	BridgesAway(n int)
	// BridgesUnheard is called after each retry of long sent commands
	// with how many bridges have a command sent again UnheardRepeats
	// times or more with no word (docs/reliability.md, bug 489).
	BridgesUnheard(n int)
	// BridgesStateless is called after each retry of long sent commands
	// with how many bridges have had their devices heard from for
	// StatelessAfter while no state message of theirs was ever taken in
	// (docs/reliability.md, bug 496).
	BridgesStateless(n int)
}

// The kinds of write StoreWrite reports.
const (
	StoreWriteCreate   = "create_command" // a command accepted (Submit)
	StoreWriteReply    = "reply"          // a bridge's reply, with the state that came with it
	StoreWriteSent     = "sent"           // a command marked sent
	StoreWriteCancel   = "cancel"         // a command canceled
	StoreWriteExpire   = "expire"         // a command expired
	StoreWriteStatus   = "status"         // a device's status
	StoreWriteSettings = "settings"       // a device's reported settings
	StoreWriteOffline  = "bridge_offline" // a bridge's devices marked offline
)

// nopObserver is the Observer of a broker nobody observes.
type nopObserver struct{}

func (nopObserver) CommandState(string, string, time.Duration) {}
func (nopObserver) MQTTConnected(bool)                         {}
func (nopObserver) StoreWrite(string, time.Duration)           {}
func (nopObserver) ReportCoalesced(string)                     {}
func (nopObserver) BridgesAway(int)                            {}
func (nopObserver) BridgesUnheard(int)                         {}
func (nopObserver) BridgesStateless(int)                       {}

// sinceAccepted is the age of a command accepted at created (its
// created_at, a wall time the store keeps) at now, for CommandState: no
// less than 0. After the server's clock stepped back (NTP setting a fast
// clock right), or on a replica whose clock is behind the one that
// accepted the command, created lies ahead of now: the latency histogram
// took in a time below 0, and its sum fell (docs/reliability.md, bug 354).
func sinceAccepted(now, created time.Time) time.Duration {
	return max(now.Sub(created), 0)
}
