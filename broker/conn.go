package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/topics"
)

// onConnect subscribes to what the bridges publish (and, with replicas, to
// their word of devices moved: tellMoved), and to the filters of the
// connection's other users, on every connect; the broker is ready once the
// MQTT broker has granted them all.
func (b *Broker) onConnect(c mqtt.Client) {
	b.log.Info("MQTT connected", "url", b.opts.MQTTURL)
	filters := map[string]byte{
		b.tree.AllReplies():      1,
		b.tree.AllStatus():       1,
		b.tree.AllSettings():     1,
		b.tree.AllBridgeStates(): 1,
		b.probe:                  1,
	}
	if b.opts.Dispatcher != nil {
		// Replicas share a store: the word of devices moved through
		// another (tellMoved).
		filters[b.moved] = 1
		filters[b.kickedAt] = 1
	}
	// Subscribing from the connect handler must not wait on the token in
	// this goroutine for long; paho allows it, but bound it.
	tok := c.SubscribeMultiple(filters, nil)
	b.mu.Lock()
	extra := b.extra
	b.mu.Unlock()
	b.goOwned(func() {
		if err := b.waitToken(tok); err != nil {
			if !errors.Is(err, ErrClosed) {
				b.log.Error("MQTT subscribe failed", "err", err)
			}
			return
		}
		// A broker may refuse a filter (SUBACK 0x80) for a while: NATS
		// does while a node's JetStream leaders are elected. Not ready
		// until every one is granted.
		for refused := refusedFilters(tok, filters); len(refused) > 0; refused = refusedFilters(tok, refused) {
			// Asked again every second, but logged once a minute: a
			// refusal for good (the account's ACLs) logged a line a
			// second (bug 460). Noted before it is logged.
			b.setNotReady(fmt.Sprintf("the MQTT broker refuses the server's subscriptions to %s: %s",
				strings.Join(slices.Sorted(maps.Keys(refused)), ", "), b.grantHint()))
			b.noisy.Warn("\x00subscriptions refused", "MQTT subscriptions refused; trying again", "filters", slices.Sorted(maps.Keys(refused)),
				"hint", b.grantHint())
			t := time.NewTimer(time.Second)
			select {
			case <-b.quit:
				t.Stop()
				return
			case <-t.C:
			}
			if !c.IsConnectionOpen() {
				return // the next connect subscribes again
			}
			tok = c.SubscribeMultiple(refused, nil)
			if err := b.waitToken(tok); err != nil {
				if !errors.Is(err, ErrClosed) {
					b.log.Error("MQTT subscribe failed", "err", err)
				}
				return
			}
		}
		// Ready means every user of the connection is subscribed too.
		for _, e := range extra {
			b.subscribeExtra(c, e)
		}
		if !b.selfCheck(c) {
			return
		}
		b.setReady(true)
		select {
		case b.connected <- struct{}{}:
		default:
		}
	})
}

// probeTimeout bounds the wait for the self-check's probe to come back;
// probeRetry is the pause before the next probe after one that did not.
const (
	probeTimeout = 10 * time.Second
	probeRetry   = 5 * time.Second
)

// selfCheck publishes a probe on the server's own topic under the prefix
// (Topics.ServerProbe), which it subscribed to, and reports true once one
// comes back. A broker whose ACLs do not let the server publish, or read,
// under its prefix says nothing of it: Mosquitto acknowledges a QoS 1
// PUBLISH it refuses and drops it (MQTT 3.1.1 has no refusal), and grants
// a subscription whose messages it then withholds. Without the check the
// server read ready, and every command stayed sent for ever (bug 459).
// Until a probe comes back, the broker is not ready, says why (NotReady),
// and probes again; it gives up (false) when the connection is lost (the
// next connect checks again) or the broker closes.
func (b *Broker) selfCheck(c mqtt.Client) bool {
	// The tokens published on this connect: a probe of an earlier connect,
	// or of an earlier run (the session is persistent), proves nothing of
	// the ACLs now; one of this connect's that comes late, behind the
	// session's queued messages, does.
	sent := map[string]bool{}
	// A check of an earlier connect may still run (its publish waiting on
	// a connection lost): only the latest goes on, and what the other
	// takes of its probes it hands back.
	b.mu.Lock()
	b.probeGen++
	gen := b.probeGen
	b.mu.Unlock()
	latest := func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.probeGen == gen
	}
	for {
		if !latest() {
			return false
		}
		token := randomHex()
		sent[token] = true
		err := b.waitToken(c.Publish(b.probe, 1, false, token))
		if errors.Is(err, ErrClosed) {
			return false
		}
		if err == nil {
			t := time.NewTimer(probeTimeout)
		wait:
			for {
				select {
				case p := <-b.probed:
					if !latest() {
						t.Stop()
						select {
						case b.probed <- p:
						default:
						}
						return false
					}
					if sent[p] {
						t.Stop()
						return true
					}
				case <-b.quit:
					t.Stop()
					return false
				case <-t.C:
					break wait
				}
			}
			if !latest() {
				return false
			}
			reason := fmt.Sprintf("the server's probe published on %s did not come back within %v: the MQTT broker drops what the server publishes under its topic prefix, or withholds it from the server; %s",
				b.probe, probeTimeout, b.grantHint())
			// Noted before it is logged: whoever reads the line finds
			// /readyz saying why.
			b.setNotReady(reason)
			b.log.Error("MQTT self-check failed; not ready", "topic", b.probe, "username", b.opts.Username, "hint", b.grantHint())
		} else {
			b.log.Warn("MQTT self-check publish failed", "topic", b.probe, "err", err)
		}
		t := time.NewTimer(probeRetry)
		select {
		case <-b.quit:
			t.Stop()
			return false
		case <-t.C:
		}
		if !c.IsConnectionOpen() {
			return false // the next connect checks again
		}
	}
}

// takeProbe takes a self-check probe in (selfCheck): it must not block.
func (b *Broker) takeProbe(_ mqtt.Client, m mqtt.Message) {
	select {
	case b.probed <- string(m.Payload()):
	default: // a flood of stale ones: this connect's comes again
	}
	m.Ack()
}

// grantHint says what the server's MQTT account needs, for the log and
// /readyz of a broker that refuses it.
func (b *Broker) grantHint() string {
	p := b.tree.Prefix()
	return fmt.Sprintf("grant the server's account (%q) publishClientSend, publishClientReceive and subscribePattern on '%s/#' in its Mosquitto dynamic-security role, or 'topic readwrite %s/#' in the acl_file, or on NATS publish and subscribe on '%s/#', with the prefix the server runs with (--topic-prefix %s; docs/mosquitto.md, docs/scale-out.md)",
		b.opts.Username, p, p, p, p)
}

// setNotReady marks the broker not ready, for reason.
func (b *Broker) setNotReady(reason string) {
	b.mu.Lock()
	was := b.ready
	b.ready, b.notReady = false, reason
	b.mu.Unlock()
	if was {
		b.opts.Observer.MQTTConnected(false)
	}
}

// probeID is the server's client id as a topic level of its probe
// (Topics.ServerProbe): the same on every run, for the subscription
// stays in the persistent session (a new one each run would pile up
// there, and on NATS each is a JetStream consumer); each replica's its
// own, for each has its own client id.
func probeID(clientID string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == ':', r == '-':
			return r
		}
		return '_'
	}, clientID)
}

// randomHex is 16 random hexadecimal digits.
func randomHex() string {
	var p [8]byte
	_, _ = rand.Read(p[:])
	return hex.EncodeToString(p[:])
}

// refusedFilters are those of filters that the SUBACK of tok refused.
func refusedFilters(tok mqtt.Token, filters map[string]byte) map[string]byte {
	st, ok := tok.(*mqtt.SubscribeToken)
	if !ok {
		return nil
	}
	refused := map[string]byte{}
	for f, qos := range filters {
		if code, ok := st.Result()[f]; ok && code == 0x80 {
			refused[f] = qos
		}
	}
	return refused
}

// extraSub is a subscription made for another user of the broker's MQTT
// connection (see Subscribe).
type extraSub struct {
	filter     string
	subscribed func(granted bool)
}

// Subscribe adds a subscription that the broker makes on every connect,
// besides its own, for another user of its MQTT connection (the
// dynamic-security driver). Each message on filter is handed to msg in
// arrival order and acknowledged after; msg must not block. After each
// subscription attempt, subscribed is told whether the MQTT broker granted
// it; it must not block either. Call Subscribe before Start.
func (b *Broker) Subscribe(filter string, msg func(payload []byte), subscribed func(granted bool)) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started {
		return errors.New("broker: Subscribe after Start")
	}
	b.extra = append(b.extra, extraSub{filter: filter, subscribed: subscribed})
	b.client.AddRoute(filter, func(_ mqtt.Client, m mqtt.Message) {
		msg(m.Payload())
		m.Ack()
	})
	return nil
}

func (b *Broker) subscribeExtra(c mqtt.Client, e extraSub) {
	tok := c.Subscribe(e.filter, 1, nil)
	err := b.waitToken(tok)
	if errors.Is(err, ErrClosed) {
		return
	}
	granted := err == nil
	if st, ok := tok.(*mqtt.SubscribeToken); ok && st.Result()[e.filter] == 0x80 {
		granted = false
	}
	if !granted {
		b.log.Error("MQTT subscription refused", "filter", e.filter, "err", err)
	}
	e.subscribed(granted)
}

// Publish publishes payload on topic at QoS 1, not retained, and waits for
// the MQTT broker's PUBACK or ctx. It is for other users of the broker's
// connection (the dynamic-security driver); commands go through Submit.
// While the connection is down it fails at once with ErrNotConnected
// rather than queue a message that would go out late.
func (b *Broker) Publish(ctx context.Context, topic string, payload []byte) error {
	if !b.client.IsConnectionOpen() {
		return ErrNotConnected
	}
	tok := b.client.Publish(topic, 1, false, payload)
	select {
	case <-tok.Done():
		return tok.Error()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// maxIntakeBatch bounds the messages intake takes in with one read of
// their devices' bridges, and how many route holds for it.
const maxIntakeBatch = 256

// route hands a message to intake, in the order paho delivers them (one
// at a time). It waits while intake holds maxIntakeBatch, and so holds
// paho's next message back.
func (b *Broker) route(_ mqtt.Client, m mqtt.Message) {
	select {
	case b.inbox <- m:
	case <-b.quit:
		// Not acknowledged: the MQTT broker delivers it again.
	}
}

// intake takes in the messages route hands it, in order, in batches of
// what arrived meanwhile: the bridges of a batch's devices are read from
// the store at once (DeviceBridges), then each message is taken as take
// says. One read per message, in paho's one goroutine, held every message
// of the connection behind the store's round trip: on PostgreSQL, with
// the machine busy, replies came in slower than the bridges sent them
// (docs/reliability.md, bug 98).
func (b *Broker) intake() {
	batch := make([]inbound, 0, maxIntakeBatch)
	devices := make([]string, 0, maxIntakeBatch)
	for {
		batch, devices = batch[:0], devices[:0]
		select {
		case <-b.quit:
			return
		case m := <-b.inbox:
			batch = append(batch, b.parseInbound(m))
		}
	more:
		for len(batch) < maxIntakeBatch {
			select {
			case m := <-b.inbox:
				batch = append(batch, b.parseInbound(m))
			default:
				break more
			}
		}
		b.mu.Lock()
		for i := range batch {
			in := &batch[i]
			if in.err == nil && in.t.Kind == topics.KindReplies && in.rerr == nil {
				in.final = b.finals.has(in.r.CommandID)
			}
			if in.err == nil && in.t.DeviceID != "" && !in.final {
				devices = append(devices, in.t.DeviceID)
			}
		}
		b.mu.Unlock()
		var (
			bridges map[string]string
			err     error
		)
		if len(devices) > 0 {
			bridges, err = b.st.DeviceBridges(context.Background(), devices)
		}
		for _, in := range batch {
			b.take(in, bridges, err)
		}
	}
}

// inbound is a message intake took, with its topic parsed (or err) and,
// on a replies topic, its reply (or rerr). final says the reply's command
// is known final here (finals): the reply can change nothing.
type inbound struct {
	m     mqtt.Message
	t     topics.Topic
	err   error
	r     topics.Reply
	rerr  error
	final bool
}

func (b *Broker) parseInbound(m mqtt.Message) inbound {
	t, err := b.tree.Parse(m.Topic())
	in := inbound{m: m, t: t, err: err}
	if err == nil && t.Kind == topics.KindReplies && len(m.Payload()) > 0 {
		in.r, in.rerr = topics.ParseReply(m.Payload())
	}
	return in
}

// warnBadAt logs a bridge's message whose `at` is no time the server
// reads (topics.Reply.BadAt, its JSON as written), once a minute per
// device and kind of message: the message is taken without it, and the
// bridge breaks the contract (docs/asyncapi.yaml: RFC 3339 with a time
// zone), which its operator should hear of (bug 425).
func (b *Broker) warnBadAt(what, deviceID, bad string) {
	if bad == "" {
		return
	}
	b.noisy.Warn("bad at\x00"+what+"\x00"+deviceID, "a bridge's at is no RFC 3339 time (a time zone, Z or an offset, is required); the message is taken without it",
		"device_id", deviceID, "message", what, "at", bad)
}

// take takes one message in: it hands what it says to the store, and
// acknowledges it once the store has it on disk. It never waits for the
// disk: intake calls it for one message at a time, in the order paho
// delivered them, and the store's writes keep their order, so the
// messages of a device are taken, and acknowledged, in the order they
// came. bridges are the devices' bridges as intake read them, or readErr.
// A message that is dropped (bad, stale, unknown) is acknowledged at once.
// Nothing a bridge sends can make it fail loudly: bad messages are logged
// and dropped.
func (b *Broker) take(in inbound, bridges map[string]string, readErr error) {
	m, t := in.m, in.t
	switch m.Topic() {
	case b.moved:
		b.takeMoved(m.Payload())
		m.Ack()
		return
	case b.kickedAt:
		if id := string(m.Payload()); topics.ValidBridgeID(id) {
			b.noteKicked(id)
		}
		m.Ack()
		return
	}
	if in.err != nil {
		b.noisy.Warn("unknown topic", "message on an unknown topic", "topic", m.Topic())
		m.Ack()
		return
	}
	switch t.Kind {
	case topics.KindReplies:
		if len(m.Payload()) == 0 {
			m.Ack() // the server's clearing of a reply retained (DeviceMoved)
			return
		}
		if in.rerr != nil {
			b.noisy.Warn("bad reply\x00"+t.DeviceID, "bad reply", "device_id", t.DeviceID, "err", in.rerr)
			m.Ack()
			return
		}
		b.warnBadAt("reply", t.DeviceID, in.r.BadAt)
		if in.r.Error != nil && in.r.Error.BadCode != "" {
			// Set aside (replyError), and the bridge breaks the contract,
			// which its operator should hear of (bug 569).
			b.noisy.Warn("bad error code\x00"+t.DeviceID, "a bridge's error code is not of the contract's form (^[a-z0-9_]+$, at most 64 bytes); the command reads the code its state has without one",
				"device_id", t.DeviceID, "command_id", in.r.CommandID, "state", in.r.State, "code", in.r.Error.BadCode)
		}
		if in.r.Status != nil {
			b.warnBadAt("reply's status", t.DeviceID, in.r.Status.BadAt)
		}
		if in.r.Settings != nil {
			b.warnBadAt("reply's settings", t.DeviceID, in.r.Settings.BadAt)
		}
		if in.final {
			// A repeat of a final reply, most likely (the bridge answers
			// every repeat of a command it finished): the store would
			// refuse it, report and all (bug 100).
			b.log.Debug("reply for a command final here; dropped", "device_id", t.DeviceID, "command_id", in.r.CommandID, "state", in.r.State)
			b.land(in.r.CommandID) // as the store's refusal would
			m.Ack()
			return
		}
		b.heardLive(bridges[t.DeviceID])
		// takeReplyAttempt checks that a bridge serves the device.
		b.takeReplyAttempt(t.DeviceID, bridges[t.DeviceID], readErr, in.r, m.Ack, 1)
	case topics.KindStatus:
		if len(m.Payload()) == 0 {
			m.Ack() // a cleared retained message
			return
		}
		s, err := topics.ParseStatus(m.Payload())
		if err != nil {
			b.noisy.Warn("bad status\x00"+t.DeviceID, "bad status", "device_id", t.DeviceID, "err", err)
			m.Ack()
			return
		}
		b.warnBadAt("status", t.DeviceID, s.BadAt)
		live := !m.Retained()
		b.gate.admit(topics.KindStatus, t.DeviceID, s.Seq, s.At, func(late bool) {
			bridge, err := bridges[t.DeviceID], readErr
			if late {
				bridge, err = b.st.DeviceBridge(context.Background(), t.DeviceID)
			}
			b.takeStatus(t.DeviceID, s, bridge, err, live, m.Ack)
		}, m.Ack)
	case topics.KindSettings:
		if len(m.Payload()) == 0 {
			m.Ack()
			return
		}
		s, err := topics.ParseSettings(m.Payload())
		if err != nil {
			b.noisy.Warn("bad settings\x00"+t.DeviceID, "bad settings", "device_id", t.DeviceID, "err", err)
			m.Ack()
			return
		}
		b.warnBadAt("settings", t.DeviceID, s.BadAt)
		live := !m.Retained()
		b.gate.admit(topics.KindSettings, t.DeviceID, s.Seq, s.At, func(late bool) {
			bridge, err := bridges[t.DeviceID], readErr
			if late {
				bridge, err = b.st.DeviceBridge(context.Background(), t.DeviceID)
			}
			b.takeSettings(t.DeviceID, s, bridge, err, live, m.Ack)
		}, m.Ack)
	case topics.KindBridgeState:
		switch bridgeState(m.Payload()) {
		case topics.BridgeOnline:
			b.backFromKick(t.BridgeID)
			b.bridgeOnline(t.BridgeID, b.noteBridgeState(t.BridgeID), m.Ack, 1)
		case topics.BridgeOffline:
			n := b.noteBridgeState(t.BridgeID)
			if b.holdKickedWill(t.BridgeID, n) {
				m.Ack() // the retained Will stands for it, should this server stop meanwhile
				return
			}
			b.bridgeOffline(t.BridgeID, n, m.Ack, 1)
		case "":
			// Its retained state cleared: the bridge was deleted
			// (BridgeDeleted).
			b.forgetBridge(t.BridgeID)
			m.Ack()
		default:
			b.log.Warn("a bridge state that is neither online nor offline ignored", "bridge_id", t.BridgeID, "payload", truncate(string(m.Payload()), 64))
			m.Ack()
		}
	default:
		// Our own commands never come back: we do not subscribe to them.
		m.Ack()
	}
}

// bridgeState is a bridge's state message as the state it says: "online"
// or "offline" in any case, with white space around it ("offline\n", as
// mosquitto_pub -l, echo and config files write it) or as a JSON string
// (from a bridge that encodes every payload as JSON). Written so, the
// state was ignored without a word, and the Will of such a bridge left its
// devices online for good (docs/reliability.md, bug 375). Zero bytes stay
// "" (the state cleared); anything else is returned as it is.
func bridgeState(p []byte) string {
	s := strings.TrimSpace(string(p))
	if len(s) >= 2 && s[0] == '"' && s[len(s)-1] == '"' {
		s = strings.TrimSpace(s[1 : len(s)-1])
	}
	for _, state := range []string{topics.BridgeOnline, topics.BridgeOffline} {
		if strings.EqualFold(s, state) {
			return state
		}
	}
	return string(p)
}

// truncate is s cut to at most n bytes, for a log line.
func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
