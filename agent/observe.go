package agent

import "time"

// Observer is told what the bridge does, for its metrics (internal/metrics
// implements it with Prometheus; companion-bridge --metrics). It is
// declared here, where it is called, so that the agent imports no metrics
// library; Options.Observer nil means nobody counts. Its methods are
// called from the workers and paho's handlers: they must be quick and must
// not block.
type Observer interface {
	// CommandDone is called once for each command the bridge ran to its
	// end (or found expired before it ran, or failed with
	// device_not_served at start), with its op, its final state
	// (succeeded, failed or expired), whether it ran (false for those two,
	// which never did: docs/reliability.md, bug 361) and how long it ran.
	CommandDone(op, result string, ran bool, took time.Duration)
	// MQTTConnected is called when the bridge's MQTT connection comes up
	// (subscribed, "online" said) and when it is lost.
	MQTTConnected(up bool)
	// SpoolWritable is called with false when a write of the spool fails
	// after the last one succeeded (its disk full, a quota, a file size
	// limit, a failing disk: the bridge takes no command in meanwhile),
	// and with true when one succeeds again.
	SpoolWritable(ok bool)
	// ReplyUnheard is called for each command the server sent again and
	// again after the bridge had finished and answered it: its replies do
	// not reach the server (noteRepeated).
	ReplyUnheard()
	// DevicesRefused is called after each round of the bridge's command
	// subscriptions with how many of its devices' filters the broker
	// refuses (SUBACK 0x80): devices the server serves through another
	// bridge, or all of them when the bridge's --topic-prefix or its
	// account's rights are wrong.
	DevicesRefused(n int)
}

// nopObserver is the Observer of an agent nobody observes.
type nopObserver struct{}

func (nopObserver) CommandDone(string, string, bool, time.Duration) {}
func (nopObserver) MQTTConnected(bool)                              {}
func (nopObserver) SpoolWritable(bool)                              {}
func (nopObserver) ReplyUnheard()                                   {}
func (nopObserver) DevicesRefused(int)                              {}
