package agent

import (
	"context"
	"slices"
	"time"

	"github.com/cenkalti/backoff/v5"
	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/retry"
	"github.com/devicecompanion/companion/topics"
)

// How the bridge subscribes to its devices' command topics, once per device.
//
// NATS Server's MQTT makes a session's subscriptions one after another (each
// a replicated JetStream consumer) and reads nothing else of the connection
// meanwhile: 200 took 18 s on a busy 2-core machine. One SUBSCRIBE of every
// filter would leave the connection's PINGREQs unanswered past the keep-alive
// and no SUBACK in any reasonable time; so the filters go in chunks, each
// SUBACK awaited for its own generous timeout. A broker may also refuse a
// filter (SUBACK 0x80): for a while (NATS, while a killed node's JetStream
// leaders are elected) or for good (a device the bridge does not serve,
// CONTRACT §9; a change of assignment disconnects the bridge). While the
// broker refuses a device's filter, the bridge starts none of the commands
// its spool holds for that device (holdRefused); at start and on every
// connection, it starts none of a device's commands until the broker has
// answered that device's filter on the connection, or the bridge finds
// itself away from the broker (awaitsAnswer, away): a filter left
// unanswered past the timeout holds the device's commands until a later
// round's SUBACK (docs/reliability.md, bug 291). What is refused or
// unanswered is asked again, with backoff, while the connection lasts; each
// connection starts over with every filter, because paho restores no
// subscription (SetResumeSubs concerns only SUBSCRIBEs not yet sent) and
// the session may be new.
const (
	// subscribeChunk is how many filters one SUBSCRIBE carries: about 3 s
	// of NATS's work here, well inside the keep-alive.
	subscribeChunk = 32
	// subscribeTimeout is how long a SUBACK is awaited before its filters
	// are left to the next round.
	subscribeTimeout = 30 * time.Second
	// subscribeRetryMin and subscribeRetryMax bound the pause between
	// rounds: a filter refused for a while is granted within a few rounds,
	// one refused for good is asked once a minute.
	subscribeRetryMin = time.Second
	subscribeRetryMax = time.Minute
)

// subscribeTiming is the timing of subscriptions, which tests shorten.
type subscribeTiming struct {
	timeout            time.Duration
	retryMin, retryMax time.Duration
}

// subscriber makes the command subscriptions of every connection: onConnect
// counts the connection and wakes it. It runs for the whole of Run.
func (a *Agent) subscriber(ctx context.Context) {
	var made uint64 // the connection served last
	for {
		if conn := a.conn.Load(); conn != made && a.client.IsConnectionOpen() {
			made = conn
			a.subscribeConn(ctx, conn)
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-a.subWake:
		}
	}
}

// subscribeConn subscribes to every command filter on connection conn, then
// says the bridge is online, then asks again for what the broker refused or
// did not answer until it is granted, ctx is done or the connection ends.
func (a *Agent) subscribeConn(ctx context.Context, conn uint64) {
	missing := a.filters
	logged := map[string]bool{} // refused filters logged on this connection
	var bo *backoff.ExponentialBackOff
	for first := true; ; first = false {
		left, ok := a.subscribeRound(ctx, conn, missing, logged)
		if !ok {
			return
		}
		switch {
		case first:
			// Each device's filter is granted (its commands run) or
			// refused (held, bug 240), or unanswered: held too until a
			// later round has its SUBACK, or the bridge is away from the
			// broker. Run as if granted, those of a device moved off the
			// bridge, which the server failed at the move, showed on the
			// device (docs/reliability.md, bug 291).
			a.announce(conn, len(missing)-len(left))
			if len(left) == len(missing) && a.everyFilterRefused() {
				a.log.Warn("the broker refuses the commands of every device of the bridge: the server serves none of them through this bridge "+
					"(assign them to it: PUT /api/v1/admin/devices/DEV/bridge), or the bridge's --topic-prefix is not the server's, "+
					"or the broker's ACLs for its account do not grant them; its statuses and replies are dropped as well: "+a.grantHint(),
					"topic_prefix", a.tree.Prefix(), "devices", len(a.filters))
			}
		case len(left) < len(missing):
			still := make(map[string]bool, len(left))
			for _, f := range left {
				still[f] = true
			}
			granted := slices.DeleteFunc(slices.Clone(missing), func(f string) bool { return still[f] })
			a.log.Info("the broker granted the commands of devices asked for again", "filters", granted)
			// The commands the server sent while the filters were missing
			// were dropped by the broker. "online" again has the server
			// send its devices' unfinished commands again (the bridge
			// drops those it has): as after a connect.
			a.client.Publish(a.stateTopic, 1, true, topics.BridgeOnline)
		}
		if len(left) == 0 {
			return
		}
		if bo == nil {
			bo = retry.Backoff(a.subTiming.retryMin, a.subTiming.retryMax)
		}
		if !a.subscribePause(ctx, conn, bo.NextBackOff()) {
			return
		}
		missing = left
	}
}

// announce tells the broker and the server that the bridge is online, once
// the first round of the subscriptions of connection conn is done; the
// bridge is connected from then on, unless conn has ended meanwhile.
func (a *Agent) announce(conn uint64, subscribed int) {
	a.client.Publish(a.stateTopic, 1, true, topics.BridgeOnline)
	a.connMu.Lock()
	if a.current(conn) {
		a.connected.Store(true)
		a.opts.Observer.MQTTConnected(true)
	}
	a.connMu.Unlock()
	a.log.Info("connected", "mqtt", a.opts.MQTTURL, "subscribed", subscribed, "devices", len(a.filters))
	for _, dr := range a.order {
		dr.requestReport(true, true, true)
	}
	signal(a.outboxWake)
}

// subscribeRound subscribes to filters in chunks of subscribeChunk, one
// SUBACK awaited at a time, and returns those not granted: refused,
// unanswered within the timeout, or failed. It logs each refused filter
// the first time on the connection (logged). ok is false when ctx is done
// or the connection ended.
func (a *Agent) subscribeRound(ctx context.Context, conn uint64, filters []string, logged map[string]bool) (left []string, ok bool) {
	for chunk := range slices.Chunk(filters, subscribeChunk) {
		want := make(map[string]byte, len(chunk))
		for _, f := range chunk {
			want[f] = 1
		}
		tok := a.client.SubscribeMultiple(want, nil) // every message goes to the default handler
		if !a.awaitSubscribe(ctx, conn, tok) {
			return nil, false
		}
		if !isDone(tok) {
			a.log.Warn("no SUBACK in time; holding its devices' commands and asking for them again later", "filters", len(chunk), "timeout", a.subTiming.timeout)
			left = append(left, chunk...)
			continue
		}
		if err := tok.Error(); err != nil {
			if !a.current(conn) {
				return nil, false
			}
			a.log.Warn("a SUBSCRIBE failed; holding its devices' commands and asking for them again later", "filters", len(chunk), "err", err)
			left = append(left, chunk...)
			continue
		}
		var granted map[string]byte
		if st, isSub := tok.(*mqtt.SubscribeToken); isSub {
			granted = st.Result()
		}
		var refused []string
		for _, f := range chunk {
			code, answered := granted[f]
			dr := a.byFilter[f]
			if answered && code != 0x80 {
				dr.setRefused(false)
				dr.answer(conn)
				continue
			}
			if answered {
				// The device's commands are held meanwhile (bug 240).
				dr.setRefused(true)
				dr.answer(conn)
			}
			left = append(left, f)
			if !logged[f] {
				logged[f] = true
				refused = append(refused, f)
			}
		}
		if len(refused) > 0 {
			a.log.Warn("the broker refused the commands of some devices; asking again", "filters", refused)
		}
	}
	a.opts.Observer.DevicesRefused(a.devicesRefused())
	return left, true
}

// awaitSubscribe waits for tok's SUBACK or the subscribe timeout. It
// returns false when ctx is done or connection conn ended.
func (a *Agent) awaitSubscribe(ctx context.Context, conn uint64, tok mqtt.Token) bool {
	return a.waitConn(ctx, conn, a.subTiming.timeout, tok.Done())
}

// subscribePause waits d. It returns false when ctx is done or connection
// conn ended first.
func (a *Agent) subscribePause(ctx context.Context, conn uint64, d time.Duration) bool {
	a.log.Debug("asking for refused command subscriptions again", "in", d)
	return a.waitConn(ctx, conn, d, nil) && a.current(conn)
}

// waitConn waits d or until done is closed (nil: never), whichever comes
// first. It returns false when ctx is done or connection conn ended first.
func (a *Agent) waitConn(ctx context.Context, conn uint64, d time.Duration, done <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-done:
			return true
		case <-t.C:
			return true
		case <-ctx.Done():
			return false
		case <-a.subWake:
			if !a.current(conn) {
				return false
			}
		}
	}
}

// current reports whether connection conn is the open one.
func (a *Agent) current(conn uint64) bool {
	return a.conn.Load() == conn && a.client.IsConnectionOpen()
}

// everyFilterRefused says whether the broker refused the command filter of
// every device of the bridge. A device moved away has its own refused,
// and says so (the line of subscribeRound); every one refused is rather a
// bridge run with another --topic-prefix than the server's, or one whose
// account's rights name none of its devices: it said only that "some"
// were refused, and the server read every command sent (docs/
// reliability.md, bug 485).
func (a *Agent) everyFilterRefused() bool {
	return len(a.order) > 0 && a.devicesRefused() == len(a.order)
}

// devicesRefused counts the devices whose command filter the broker
// refuses now (companion_bridge_devices_refused).
func (a *Agent) devicesRefused() int {
	n := 0
	for _, dr := range a.order {
		if dr.refused.Load() {
			n++
		}
	}
	return n
}
