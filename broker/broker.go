package broker

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/internal/pahostore"
	"github.com/devicecompanion/companion/internal/retry"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/topics"
)

// Store is what the broker needs of the store. The …Async writes call
// their done callback once the write is on disk, one callback at a time in
// the order the writes were made: the broker takes MQTT messages in and
// acknowledges them without waiting for each fsync, in order.
type Store interface {
	CreateCommandAsync(c companion.Command, maxOpen int, idem *companion.Idempotency, done func(companion.Command, bool, error))
	Command(ctx context.Context, id string) (companion.Command, error)
	UpdateCommand(ctx context.Context, id string, fn func(*companion.Command) error) (companion.Command, error)
	UpdateCommandAsync(id string, fn func(*companion.Command) error, done func(companion.Command, error))
	UpdateCommandWithReportAsync(id string, fn func(*companion.Command) error, report companion.DeviceReport, done func(companion.Command, error))
	OpenCommands(ctx context.Context, states ...string) ([]companion.Command, error)
	ExpiredCommands(ctx context.Context, now time.Time) ([]companion.Command, error)
	PutStatusAsync(s companion.Status, done func(bool, error))
	MarkBridgeOfflineAsync(bridgeID string, done func([]string, error))
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	DeviceBridge(ctx context.Context, deviceID string) (string, error)
	PutReportedSettingsAsync(deviceID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(bool, error))
	PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error)
	PurgeCommands(ctx context.Context, olderThan time.Time) (int, error)
	PurgeEvents(ctx context.Context, olderThan time.Time) (int, error)
	RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error)
	Status(ctx context.Context, deviceID string) (companion.Status, error)
}

// Options configure a Broker. The zero value of each optional field means
// its default.
type Options struct {
	Store Store // required

	// MQTTURL is required: tcp://host:port, mqtt://, ssl://, tls:// or
	// mqtts://, or a comma-separated list of them (a cluster's nodes,
	// tried in turn on every connect: paho fails over between them).
	MQTTURL   string
	Username  string
	Password  string
	ClientID  string      // default "companion-server"
	TLSConfig *tls.Config // for ssl:// and mqtts:// URLs
	// NewClient, when set, makes the MQTT client from the options the
	// broker chose, instead of paho's mqtt.NewClient: the embedded
	// broker's in-process connection (embedded.Server.NewClient).
	NewClient func(*mqtt.ClientOptions) mqtt.Client

	Topics          topics.Tree   // default topics.DefaultPrefix
	MaxOpenCommands int           // unfinished commands per device; default 1000
	SweepInterval   time.Duration // how often expired commands are swept; default 1s
	PublishTimeout  time.Duration // how long a publish waits for its PUBACK; default 30s
	Retention       time.Duration // how long final commands are kept; default 30 days
	// ExpiryGrace is how long past its TTL a sent command waits for the
	// bridge's word before the server calls it expired; default 1 min.
	ExpiryGrace time.Duration
	// SentRetry is how long a command may stay sent, with no word from the
	// bridge, while its device reads online, before it is sent again (see
	// retrySent); default 1 min.
	SentRetry time.Duration

	// Dispatcher, for replicas sharing one store, says whether this
	// replica is the one that publishes queued commands, resends them and
	// sweeps expiry (postgres.Store elects one; see docs/scale-out.md).
	// With one set, this replica publishes only while it dispatches, and
	// always from the store, in id order, so that one device's commands go
	// out once and in order whichever replica accepted them. nil: this
	// server is alone and always dispatches.
	Dispatcher Dispatcher

	// Observer, when set, is told of state changes, the MQTT connection
	// and store writes, for the server's metrics.
	Observer Observer

	Logger *slog.Logger
	Now    func() time.Time
}

// Dispatcher tells a replica whether it dispatches now.
type Dispatcher interface {
	Dispatching() bool
}

// dispatching reports whether this replica publishes and sweeps now.
func (b *Broker) dispatching() bool {
	return b.opts.Dispatcher == nil || b.opts.Dispatcher.Dispatching()
}

// Broker is the command broker. Create it with New, start it with Start,
// stop it with Close.
type Broker struct {
	opts   Options
	st     Store
	tree   topics.Tree
	log    *slog.Logger
	now    func() time.Time
	client mqtt.Client

	kick      chan struct{} // wakes the outbox
	connected chan struct{} // one signal per (re)connect, for the outbox
	acks      chan inflight // published commands awaiting their PUBACK, in order

	mu      sync.Mutex
	waiters map[string][]chan companion.Command
	online  map[string]bool     // devices seen online since start
	resend  map[string]bool     // devices whose sent commands the outbox must publish again
	pending []companion.Command // accepted, on disk, not yet published: in commit order
	scan    bool                // pending is incomplete: the outbox reads the queued commands from the store
	// flying holds the commands the outbox took to publish whose state on
	// disk is still queued: until the bridge answers, or sentDelay after
	// the PUBACK, when "sent" is written (see flushSent).
	flying map[string]*outgoing
	// landed holds the ids that landed (see land) since the outbox last
	// read the store, while it publishes what it read: the store said
	// queued before they landed, so they must not go out again.
	landed  map[string]bool
	unsent  []string        // ids of flying commands acknowledged by the MQTT broker, oldest first
	live    map[string]bool // commands accepted here and not final yet (see Wait)
	ready   bool
	started bool
	closed  bool
	extra   []extraSub // subscriptions of other users of the connection

	quit chan struct{}
	wg   sync.WaitGroup
}

// New checks the options and returns a broker that is not yet connected.
func New(opts Options) (*Broker, error) {
	if opts.Store == nil {
		return nil, errors.New("broker: no store")
	}
	urls, err := tlsclient.BrokerURLs(opts.MQTTURL)
	if err != nil {
		return nil, fmt.Errorf("broker: %w", err)
	}
	if opts.ClientID == "" {
		opts.ClientID = "companion-server"
	}
	if opts.Topics == (topics.Tree{}) {
		opts.Topics = topics.MustNew(topics.DefaultPrefix)
	}
	if opts.MaxOpenCommands <= 0 {
		opts.MaxOpenCommands = 1000
	}
	if opts.SweepInterval <= 0 {
		opts.SweepInterval = time.Second
	}
	if opts.PublishTimeout <= 0 {
		opts.PublishTimeout = 30 * time.Second
	}
	if opts.ExpiryGrace <= 0 {
		opts.ExpiryGrace = time.Minute
	}
	if opts.SentRetry <= 0 {
		opts.SentRetry = time.Minute
	}
	if opts.Retention <= 0 {
		opts.Retention = 30 * 24 * time.Hour
	}
	if opts.Retention < 24*time.Hour {
		// An Idempotency-Key answers repeats for a day with its command.
		return nil, errors.New("broker: retention must be at least 24h")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Observer == nil {
		opts.Observer = nopObserver{}
	}
	b := &Broker{
		opts:      opts,
		st:        opts.Store,
		tree:      opts.Topics,
		log:       opts.Logger.With("component", "broker"),
		now:       opts.Now,
		kick:      make(chan struct{}, 1),
		connected: make(chan struct{}, 1),
		waiters:   make(map[string][]chan companion.Command),
		online:    make(map[string]bool),
		resend:    make(map[string]bool),
		flying:    make(map[string]*outgoing),
		live:      make(map[string]bool),
		acks:      make(chan inflight, maxInflight),
		quit:      make(chan struct{}),
	}

	co := mqtt.NewClientOptions()
	for _, u := range urls {
		co.AddBroker(u)
	}
	co.SetClientID(opts.ClientID).
		SetUsername(opts.Username).
		SetPassword(opts.Password).
		// A persistent session: replies published while the server is away
		// wait in the broker for it.
		SetCleanSession(false).
		// One handler call at a time, in arrival order: it hands each
		// message to the store's grouped writes, which keep that order.
		SetOrderMatters(true).
		// A message is acknowledged once the store has it on disk: a crash
		// in between makes the broker deliver it again.
		SetAutoAckDisabled(true).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second).
		SetMaxReconnectInterval(10 * time.Second).
		SetKeepAlive(30 * time.Second).
		SetStore(pahostore.New()).
		SetDefaultPublishHandler(b.route).
		SetOnConnectHandler(b.onConnect).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) {
			b.setReady(false)
			b.log.Warn("MQTT connection lost", "err", err)
		})
	if opts.TLSConfig != nil {
		co.SetTLSConfig(opts.TLSConfig)
	}
	newClient := opts.NewClient
	if newClient == nil {
		newClient = mqtt.NewClient
	}
	b.client = newClient(co)
	return b, nil
}

// Start connects to the MQTT broker (retrying in the background until it
// answers) and starts the outbox, the message workers and the expiry sweep.
func (b *Broker) Start() error {
	b.mu.Lock()
	if b.started {
		b.mu.Unlock()
		return errors.New("broker: already started")
	}
	b.started = true
	b.mu.Unlock()

	b.goOwned(b.outbox)
	b.goOwned(b.confirm)
	b.goOwned(b.sweep)
	b.goOwned(b.sentLoop)
	b.goOwned(b.retryLoop)
	// With ConnectRetry the token completes only once connected; we do not
	// wait for it: commands wait as queued until the broker is there.
	b.client.Connect()
	return nil
}

// Ready reports whether the broker is connected to MQTT.
func (b *Broker) Ready() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ready
}

func (b *Broker) setReady(v bool) {
	b.mu.Lock()
	b.ready = v
	b.mu.Unlock()
	b.opts.Observer.MQTTConnected(v)
}

// Close disconnects and waits for every goroutine of the broker to end.
// Commands not yet published stay queued in the store for the next start.
func (b *Broker) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	close(b.quit)
	b.client.Disconnect(250)
	b.wg.Wait()
	return nil
}

func (b *Broker) onConnect(c mqtt.Client) {
	b.log.Info("MQTT connected", "url", b.opts.MQTTURL)
	filters := map[string]byte{
		b.tree.AllReplies():      1,
		b.tree.AllStatus():       1,
		b.tree.AllSettings():     1,
		b.tree.AllBridgeStates(): 1,
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
			b.log.Warn("MQTT subscriptions refused; trying again", "filters", slices.Sorted(maps.Keys(refused)))
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
		b.setReady(true)
		select {
		case b.connected <- struct{}{}:
		default:
		}
	})
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

// goOwned runs f on a goroutine that Close waits for, unless the broker is
// closing already: every goroutine of the broker has an owner.
func (b *Broker) goOwned(f func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		f()
	}()
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

// ErrNotConnected is Publish's answer while the MQTT connection is down.
var ErrNotConnected = errors.New("broker: MQTT not connected")

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

// route takes one message in: it parses it and hands what it says to the
// store, and acknowledges it once the store has it on disk. It never waits
// for the disk: paho calls it for one message at a time, and the store's
// writes keep their order, so the messages of a device are taken, and
// acknowledged, in the order they came. A message that is dropped (bad,
// stale, unknown) is acknowledged at once. Nothing a bridge sends can make
// it fail loudly: bad messages are logged and dropped.
func (b *Broker) route(_ mqtt.Client, m mqtt.Message) {
	ctx := context.Background()
	t, err := b.tree.Parse(m.Topic())
	if err != nil {
		b.log.Warn("message on an unknown topic", "topic", m.Topic())
		m.Ack()
		return
	}
	switch t.Kind {
	case topics.KindReplies:
		r, err := topics.ParseReply(m.Payload())
		if err != nil {
			b.log.Warn("bad reply", "device_id", t.DeviceID, "err", err)
			m.Ack()
			return
		}
		b.takeReply(t.DeviceID, r, m.Ack) // it checks that a bridge serves the device
	case topics.KindStatus:
		if len(m.Payload()) == 0 {
			m.Ack() // a cleared retained message
			return
		}
		s, err := topics.ParseStatus(m.Payload())
		if err != nil {
			b.log.Warn("bad status", "device_id", t.DeviceID, "err", err)
			m.Ack()
			return
		}
		if !b.served(ctx, t.DeviceID, s.BridgeID) {
			m.Ack()
			return
		}
		b.takeStatus(ctx, t.DeviceID, s, m.Ack)
	case topics.KindSettings:
		if len(m.Payload()) == 0 {
			m.Ack()
			return
		}
		s, err := topics.ParseSettings(m.Payload())
		if err != nil {
			b.log.Warn("bad settings", "device_id", t.DeviceID, "err", err)
			m.Ack()
			return
		}
		if !b.served(ctx, t.DeviceID, "") {
			m.Ack()
			return
		}
		b.takeSettings(ctx, t.DeviceID, s, m.Ack)
	case topics.KindBridgeState:
		switch string(m.Payload()) {
		case topics.BridgeOnline:
			b.bridgeOnline(ctx, t.BridgeID)
			m.Ack()
		case topics.BridgeOffline:
			b.bridgeOffline(t.BridgeID, m.Ack)
		default:
			m.Ack()
		}
	default:
		// Our own commands never come back: we do not subscribe to them.
		m.Ack()
	}
}

// served reports whether a message about deviceID may be taken in: the
// device is served by a bridge, by bridgeID when the message names one
// (a status does). The broker's rights keep a bridge to the devices it
// serves; what slips past them (a broker without them, a race with a
// move) is dropped here, and logged (CONTRACT §9).
func (b *Broker) served(ctx context.Context, deviceID, bridgeID string) bool {
	bridge, err := b.st.DeviceBridge(ctx, deviceID)
	if err != nil {
		b.log.Error("reading a device's bridge; message dropped", "device_id", deviceID, "err", err)
		return false
	}
	return b.servedBy(deviceID, bridgeID, bridge)
}

// servedBy is served once the device's bridge is read: bridge serves it.
func (b *Broker) servedBy(deviceID, bridgeID, bridge string) bool {
	switch {
	case bridge == "":
		b.log.Warn("message for a device no bridge serves; dropped", "device_id", deviceID, "bridge_id", bridgeID)
		return false
	case bridgeID != "" && bridge != bridgeID:
		b.log.Warn("message from a bridge that does not serve the device; dropped", "device_id", deviceID, "bridge_id", bridgeID, "serving", bridge)
		return false
	}
	return true
}

// DeviceMoved says a device changed bridges, or lost its bridge: its
// unfinished commands go again, to whichever bridge serves it now (those
// of a device no bridge serves wait queued).
func (b *Broker) DeviceMoved(deviceID string) {
	b.mu.Lock()
	b.resend[deviceID] = true
	b.mu.Unlock()
	b.wake()
}

// bridgeOffline takes a bridge's Will: every device it served reads
// offline.
func (b *Broker) bridgeOffline(bridgeID string, ack func()) {
	start := time.Now()
	b.st.MarkBridgeOfflineAsync(bridgeID, func(ids []string, err error) {
		defer ack()
		b.opts.Observer.StoreWrite(StoreWriteOffline, time.Since(start))
		if err != nil {
			b.log.Error("marking a bridge's devices offline", "bridge_id", bridgeID, "err", err)
			return
		}
		b.mu.Lock()
		for _, id := range ids {
			delete(b.online, id)
		}
		b.mu.Unlock()
		b.log.Info("bridge offline", "bridge_id", bridgeID, "devices", len(ids))
	})
}

// errStale marks a reply that must change nothing.
var errStale = errors.New("stale reply")

// takeReply stores a bridge's reply to a command, with the device's state
// that came with it, and once both are on disk calls ack and wakes those
// waiting for the command if it is final: what they read next reflects it.
func (b *Broker) takeReply(deviceID string, r topics.Reply, ack func()) {
	b.takeReplyAttempt(deviceID, r, ack, 1)
}

// maxReplyAttempts bounds how often a reply the store fails to take is
// taken again: about ten minutes of an unreachable store.
const maxReplyAttempts = 64

// replyRetryDelay is the pause before attempt+1: 100 ms doubling up to
// 10 s, each ±50% (the library's ExponentialBackOff, as in gatt), so that
// replicas whose store came back together do not retry in lockstep. The
// jitter is even on both sides: maxReplyAttempts still spans about ten
// minutes.
func replyRetryDelay(attempt int) time.Duration {
	bo := retry.Backoff(100*time.Millisecond, 10*time.Second)
	// A reply's attempts share no state: step to this one (the interval
	// reaches its cap at the eighth).
	for range min(attempt, 8) - 1 {
		bo.NextBackOff()
	}
	return bo.NextBackOff()
}

// later runs f after d on a goroutine Close waits for, unless the broker
// is closing by then.
func (b *Broker) later(d time.Duration, f func()) {
	time.AfterFunc(d, func() { b.goOwned(f) })
}

func (b *Broker) takeReplyAttempt(deviceID string, r topics.Reply, ack func(), attempt int) {
	bridge, err := b.st.DeviceBridge(context.Background(), deviceID)
	if err != nil && !errors.Is(err, companion.ErrNotFound) && attempt < maxReplyAttempts {
		// As below: the store failed, the reply waits unacknowledged.
		b.log.Warn("reading a device's bridge failed; taking its reply again", "device_id", deviceID, "attempt", attempt, "err", err)
		b.later(replyRetryDelay(attempt), func() { b.takeReplyAttempt(deviceID, r, ack, attempt+1) })
		return
	}
	if err != nil {
		b.log.Error("reading a device's bridge; reply dropped", "device_id", deviceID, "err", err)
		ack()
		return
	}
	if !b.servedBy(deviceID, "", bridge) {
		ack()
		return
	}
	var report companion.DeviceReport
	if r.Status != nil {
		s := storeStatus(deviceID, *r.Status)
		report.Status = &s
	}
	if r.Settings != nil {
		rs, err := reportedSettings(*r.Settings)
		if err != nil {
			b.log.Warn("reply with settings that cannot be stored; storing the reply without them", "device_id", deviceID, "command_id", r.CommandID, "err", err)
		} else {
			report.Settings = &rs
		}
	}
	start := time.Now()
	var from string // the state before the reply, for the Observer
	b.st.UpdateCommandWithReportAsync(r.CommandID, func(c *companion.Command) error {
		if c.DeviceID != deviceID {
			return fmt.Errorf("%w: reply on device %s for a command of %s", errStale, deviceID, c.DeviceID)
		}
		switch {
		case companion.Rank(r.State) < companion.Rank(c.State):
			return errStale
		case r.State == c.State && r.State != companion.StateInProgress:
			return errStale
		case r.State == companion.StateInProgress && r.Progress != nil && c.Progress != nil && *r.Progress < *c.Progress:
			return errStale
		}
		from = c.State
		c.State = r.State
		if r.Progress != nil {
			p := *r.Progress
			c.Progress = &p
		}
		if r.State == companion.StateSucceeded {
			p := 100
			c.Progress = &p
		}
		if r.Error != nil {
			c.Error = &companion.CommandError{Code: r.Error.Code, Message: r.Error.Message}
		}
		if len(r.Result) > 0 {
			c.Result = append(json.RawMessage(nil), r.Result...)
		}
		return nil
	}, report, func(cmd companion.Command, err error) {
		b.opts.Observer.StoreWrite(StoreWriteReply, time.Since(start))
		if err == nil && cmd.State != from {
			b.opts.Observer.CommandState(cmd.Op, cmd.State, b.now().Sub(cmd.CreatedAt))
		}
		if err != nil && !errors.Is(err, companion.ErrNotFound) && !errors.Is(err, companion.ErrFinal) &&
			!errors.Is(err, errStale) && !errors.Is(err, companion.ErrInvalid) && attempt < maxReplyAttempts {
			// The store failed (PostgreSQL restarting, say): the reply is
			// not acknowledged, and is taken again a little later; the
			// bridge's later replies meanwhile are ranked against it.
			b.log.Warn("storing a reply failed; taking it again", "command_id", r.CommandID, "attempt", attempt, "err", err)
			b.later(replyRetryDelay(attempt), func() { b.takeReplyAttempt(deviceID, r, ack, attempt+1) })
			return
		}
		defer ack()
		b.land(r.CommandID) // the bridge has it: no "sent" to write
		switch {
		case errors.Is(err, companion.ErrNotFound):
			b.log.Warn("reply for an unknown command ignored", "device_id", deviceID, "command_id", r.CommandID)
		case errors.Is(err, companion.ErrFinal), errors.Is(err, errStale):
			b.log.Debug("stale reply ignored", "command_id", r.CommandID, "state", r.State, "err", err)
		case err != nil:
			b.log.Error("storing a reply", "command_id", r.CommandID, "err", err)
		case companion.IsFinal(cmd.State):
			b.notify(cmd)
		}
	})
}

// takeStatus stores a device's status, then calls ack.
func (b *Broker) takeStatus(ctx context.Context, deviceID string, s topics.Status, ack func()) {
	if _, err := b.st.RegistryDevice(ctx, deviceID); err != nil {
		b.log.Warn("status for a device that was never provisioned", "device_id", deviceID)
		ack()
		return
	}
	start := time.Now()
	b.st.PutStatusAsync(storeStatus(deviceID, s), func(_ bool, err error) {
		defer ack()
		b.opts.Observer.StoreWrite(StoreWriteStatus, time.Since(start))
		if err != nil {
			b.log.Error("storing a status", "device_id", deviceID, "err", err)
			return
		}
		b.sawDevice(deviceID, s.Online)
	})
}

// sawDevice notes whether a device is online. The first time a device is
// seen online after start, or after it went offline, its bridge has just
// (re)subscribed: commands sent earlier may have reached a broker that had no
// session for the bridge (a first connection, a broker restarted without its
// queue, an expired session) and been dropped. The outbox publishes them
// again; the bridge drops any it already has.
func (b *Broker) sawDevice(deviceID string, online bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !online {
		delete(b.online, deviceID)
		return
	}
	if b.online[deviceID] {
		return
	}
	b.online[deviceID] = true
	b.resend[deviceID] = true
	b.wake()
}

// bridgeOnline takes a bridge's "online": the bridge has just connected and
// subscribed (it says so only after its SUBACK). Its devices' commands that
// are not final go out again. Without this, a broker that crashed (SIGKILL,
// power loss) between its autosaves takes with it the commands it had
// acknowledged to us but not yet handed to the bridge, and the final replies
// it had acknowledged to the bridge but not yet handed to us; no Will fires
// in a crash, so sawDevice would see no device come back online, and those
// commands would stay sent or delivered forever. The bridge drops the ids it
// has queued or running and answers those it finished with their final reply.
func (b *Broker) bridgeOnline(ctx context.Context, bridgeID string) {
	ids, err := b.st.ServedDevices(ctx, bridgeID)
	if err != nil {
		b.log.Error("listing a bridge's devices", "bridge_id", bridgeID, "err", err)
		return
	}
	if len(ids) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, id := range ids {
		b.resend[id] = true
	}
	b.wake()
	b.log.Info("bridge online; resending its devices' unfinished commands", "bridge_id", bridgeID, "devices", len(ids))
}

// takeSettings stores the settings a device reported, then calls ack.
func (b *Broker) takeSettings(ctx context.Context, deviceID string, s topics.Settings, ack func()) {
	if _, err := b.st.RegistryDevice(ctx, deviceID); err != nil {
		b.log.Warn("settings for a device that was never provisioned", "device_id", deviceID)
		ack()
		return
	}
	r, err := reportedSettings(s)
	if err != nil {
		b.log.Warn("settings that cannot be stored", "device_id", deviceID, "err", err)
		ack()
		return
	}
	start := time.Now()
	b.st.PutReportedSettingsAsync(deviceID, r.Reported, r.Schema, r.At, r.Seq, func(_ bool, err error) {
		defer ack()
		b.opts.Observer.StoreWrite(StoreWriteSettings, time.Since(start))
		if err != nil {
			b.log.Error("storing settings", "device_id", deviceID, "err", err)
		}
	})
}

// storeStatus is a device's status message as the store keeps it.
func storeStatus(deviceID string, s topics.Status) companion.Status {
	apps := make([]companion.App, 0, len(s.Apps))
	for _, a := range s.Apps {
		apps = append(apps, companion.App{AppID: a.AppID, Version: a.Version})
	}
	return companion.Status{
		DeviceID:        deviceID,
		Online:          s.Online,
		Battery:         s.Battery,
		FirmwareVersion: s.FirmwareVersion,
		Model:           s.Model,
		Apps:            apps,
		BridgeID:        s.BridgeID,
		LastSeen:        s.At,
		Seq:             s.Seq,
	}
}

// reportedSettings is a device's settings message as the store keeps it.
func reportedSettings(s topics.Settings) (companion.ReportedSettings, error) {
	reported := make(map[string]json.RawMessage, len(s.Reported))
	for k, v := range s.Reported {
		raw, err := fastjson.Marshal(v)
		if err != nil {
			return companion.ReportedSettings{}, fmt.Errorf("setting %q: %w", k, err)
		}
		reported[k] = raw
	}
	schema, err := fastjson.Marshal(s.Schema)
	if err != nil {
		return companion.ReportedSettings{}, fmt.Errorf("schema: %w", err)
	}
	return companion.NewReportedSettings(reported, schema, s.At, s.Seq)
}

// Submit stores a command as queued (durably) and hands it to the outbox.
// The store assigns its id. With idem set, a repeat of the same request
// returns the first command and replayed true.
func (b *Broker) Submit(ctx context.Context, c companion.Command, idem *companion.Idempotency) (companion.Command, bool, error) {
	if !topics.ValidOp(c.Op) || c.Op == topics.OpCancel || !topics.ValidDeviceID(c.DeviceID) {
		return companion.Command{}, false, fmt.Errorf("broker: bad command %q for %q", c.Op, c.DeviceID)
	}
	type result struct {
		cmd      companion.Command
		replayed bool
		err      error
	}
	ch := make(chan result, 1)
	start := time.Now()
	b.st.CreateCommandAsync(c, b.opts.MaxOpenCommands, idem, func(cmd companion.Command, replayed bool, err error) {
		b.opts.Observer.StoreWrite(StoreWriteCreate, time.Since(start))
		// The store calls back in commit order: the outbox gets each
		// device's commands in the order of their ids.
		if err == nil && !replayed {
			b.opts.Observer.CommandState(cmd.Op, cmd.State, 0)
			b.mu.Lock()
			b.live[cmd.ID] = true
			b.mu.Unlock()
			b.enqueue(cmd)
		}
		ch <- result{cmd, replayed, err}
	})
	r := <-ch
	return r.cmd, r.replayed, r.err
}

func (b *Broker) wake() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// Cancel cancels a command the bridge does not have yet. A command already
// handed to the MQTT broker is also withdrawn from the bridge with a cancel
// message; one the bridge has acknowledged can no longer be canceled.
func (b *Broker) Cancel(ctx context.Context, id string) (companion.Command, error) {
	var was string
	start := time.Now()
	cmd, err := b.st.UpdateCommand(ctx, id, func(c *companion.Command) error {
		if c.State != companion.StateQueued && c.State != companion.StateSent {
			return ErrNotCancelable
		}
		was = c.State
		c.State = companion.StateCanceled
		c.Error = &companion.CommandError{Code: "canceled", Message: "canceled by the user"}
		return nil
	})
	b.opts.Observer.StoreWrite(StoreWriteCancel, time.Since(start))
	if err != nil {
		return cmd, err
	}
	b.opts.Observer.CommandState(cmd.Op, cmd.State, b.now().Sub(cmd.CreatedAt))
	b.notify(cmd)
	b.mu.Lock()
	// Not yet taken by the outbox: it never goes out.
	b.pending = slices.DeleteFunc(b.pending, func(c companion.Command) bool { return c.ID == id })
	_, out := b.flying[id] // taken, perhaps published: the cancel follows it
	b.mu.Unlock()
	// With replicas, the dispatcher may have published it although the
	// store still says queued (sent is written after the PUBACK).
	if out || was == companion.StateSent || b.opts.Dispatcher != nil {
		b.publishCancel(cmd)
	}
	return cmd, nil
}

// publishCancel withdraws a canceled command from the bridge. It is best
// effort: the bridge also checks expiry, and the server ignores whatever it
// reports for a canceled command.
func (b *Broker) publishCancel(cmd companion.Command) {
	topic, err := b.tree.Command(cmd.DeviceID, topics.OpCancel)
	if err != nil {
		b.log.Error("cancel not sent: no topic for the device", "command_id", cmd.ID, "device_id", cmd.DeviceID, "err", err)
		return
	}
	payload, err := fastjson.Marshal(topics.Cancel{CommandID: cmd.ID})
	if err != nil {
		b.log.Error("cancel not sent", "command_id", cmd.ID, "err", err)
		return
	}
	msg, err := fastjson.Marshal(topics.Command{
		ID:        cmd.ID,
		Op:        topics.OpCancel,
		DeviceID:  cmd.DeviceID,
		CreatedAt: b.now().UTC(),
		ExpiresAt: cmd.ExpiresAt,
		Payload:   payload,
	})
	if err != nil {
		b.log.Error("cancel not sent", "command_id", cmd.ID, "err", err)
		return
	}
	b.client.Publish(topic, 1, false, msg)
}

// Wait returns the command once it is final, or its latest state when ctx
// ends first.
func (b *Broker) Wait(ctx context.Context, id string) (companion.Command, error) {
	ch := make(chan companion.Command, 1)
	b.mu.Lock()
	b.waiters[id] = append(b.waiters[id], ch)
	live := b.live[id]
	b.mu.Unlock()
	defer b.forget(id, ch)

	// A command accepted here and not final yet will be notified; any
	// other may be final already.
	if !live {
		cmd, err := b.st.Command(ctx, id)
		if err != nil || companion.IsFinal(cmd.State) {
			return cmd, err
		}
	}
	var cmd companion.Command
	select {
	case cmd = <-ch:
		return cmd, nil
	case <-ctx.Done():
		return b.st.Command(context.WithoutCancel(ctx), id)
	case <-b.quit:
		return b.st.Command(context.WithoutCancel(ctx), id)
	}
}

func (b *Broker) forget(id string, ch chan companion.Command) {
	b.mu.Lock()
	defer b.mu.Unlock()
	list := b.waiters[id]
	for i, c := range list {
		if c == ch {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(b.waiters, id)
	} else {
		b.waiters[id] = list
	}
}

// DispatcherChanged tells the broker that this replica started or stopped
// dispatching: a new dispatcher reads the store at once.
func (b *Broker) DispatcherChanged(dispatching bool) {
	b.log.Info("dispatcher", "dispatching", dispatching)
	if dispatching {
		b.wake()
	}
}

// CommandChanged says another replica changed command id in the shared
// store (the store's notification): those waiting here for it are
// answered if it is final now. It costs nothing when nobody here waits.
// An empty id means notifications may have been lost (the store's listener
// reconnected): every command waited for here is read again.
func (b *Broker) CommandChanged(ctx context.Context, id string) {
	if b.opts.Dispatcher != nil {
		// Perhaps a command another replica accepted: the dispatcher reads
		// the queue again.
		b.mu.Lock()
		b.scan = true
		b.mu.Unlock()
		b.wake()
	}
	b.mu.Lock()
	var ids []string
	if id == "" {
		for w := range b.waiters {
			ids = append(ids, w)
		}
	} else if len(b.waiters[id]) > 0 {
		ids = append(ids, id)
	}
	b.mu.Unlock()
	for _, id := range ids {
		cmd, err := b.st.Command(ctx, id)
		if err != nil {
			b.log.Warn("a changed command could not be read", "command_id", id, "err", err)
			continue
		}
		if companion.IsFinal(cmd.State) {
			b.notify(cmd)
		}
	}
}

// notify hands a command that became final to those waiting for it.
func (b *Broker) notify(cmd companion.Command) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.live, cmd.ID)
	for _, ch := range b.waiters[cmd.ID] {
		select {
		case ch <- cmd:
		default:
		}
	}
}
