package broker

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/logevery"
	"github.com/devicecompanion/companion/internal/pahoconn"
	"github.com/devicecompanion/companion/internal/pahostore"
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
	QueuedCommandsWith(ctx context.Context, deviceIDs, skip []string) ([]companion.Command, error)
	SentCommandsOnline(ctx context.Context) ([]companion.Command, error)
	ListCommands(ctx context.Context, q companion.CommandQuery) ([]companion.Command, bool, error)
	CountOpen(ctx context.Context, deviceID string) (int, error)
	ExpiredCommands(ctx context.Context, now time.Time) ([]companion.Command, error)
	PutStatusAsync(s companion.Status, done func(bool, error))
	MarkBridgeOfflineAsync(bridgeID string, done func([]string, error))
	Bridge(ctx context.Context, id string) (companion.Bridge, error)
	ServedDevices(ctx context.Context, bridgeID string) ([]string, error)
	DeviceBridge(ctx context.Context, deviceID string) (string, error)
	DeviceBridges(ctx context.Context, deviceIDs []string) (map[string]string, error)
	PutReportedSettingsAsync(deviceID, bridgeID string, reported map[string]json.RawMessage, schema json.RawMessage, at time.Time, seq uint64, done func(bool, error))
	PurgeIdempotency(ctx context.Context, olderThan time.Time) (int, error)
	PurgeCommands(ctx context.Context, olderThan time.Time) (int, error)
	PurgeEvents(ctx context.Context, olderThan time.Time) (int, error)
	PurgeBlobs(ctx context.Context, olderThan time.Time) (int, error)
	RegistryDevice(ctx context.Context, id string) (companion.RegistryDevice, error)
	Status(ctx context.Context, deviceID string) (companion.Status, error)
	Settings(ctx context.Context, deviceID string) (companion.Settings, error)
}

// clockOffsetter is a Store whose times are on a clock other than the
// replica's: its ClockOffset is how far that clock is ahead of Options.Now
// (store/postgres, the database's).
type clockOffsetter interface {
	ClockOffset() time.Duration
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
	// KickGrace is how long the Will of a bridge disconnected for a change
	// of its rights is held (BridgesDisconnecting); default 10s.
	KickGrace      time.Duration
	PublishTimeout time.Duration // how long a publish waits for its PUBACK; default 30s
	Retention      time.Duration // how long final commands are kept; default 30 days
	// ExpiryGrace is how long past its TTL a sent command waits for the
	// bridge's word before the server calls it expired; default 1 min.
	ExpiryGrace time.Duration
	// SentRetry is how long a command may stay sent, with no word from the
	// bridge, while its device reads online, before it is sent again (see
	// retrySent); default 1 min.
	SentRetry time.Duration
	// RepeatSpacing is the least time between two repeats of one command
	// (a send of one the bridge may have had already): it doubles with
	// each repeat, up to SentRetry or a minute, whichever is less. A
	// repeat that comes sooner waits until then (see holdRepeat); default
	// 5s.
	RepeatSpacing time.Duration
	// ReportRate is how many statuses, and how many settings, of one
	// device are taken in a second from the status and settings topics,
	// with bursts of ReportBurst; a report over it waits its turn, and a
	// newer one of the device takes a waiting one's place (see
	// reportGate). Defaults 1 and 10; a negative ReportRate takes every
	// report at once.
	ReportRate  float64
	ReportBurst int

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

	// stateLogEvery is the interval of the lines of a bridge's state
	// (logState); a minute when 0. Tests shorten it.
	stateLogEvery time.Duration
}

// Dispatcher tells a replica whether it dispatches now.
type Dispatcher interface {
	Dispatching() bool
}

// dispatching reports whether this replica publishes and sweeps now.
func (b *Broker) dispatching() bool {
	on := b.opts.Dispatcher == nil || b.opts.Dispatcher.Dispatching()
	b.sawDispatching(on)
	return on
}

// sawDispatching notes whether this replica dispatches, as it asks
// (dispatching) or is told (DispatcherChanged): once it is seen to start,
// the commands accepted before may have gone out with the dispatcher
// before it (see expiredAt).
func (b *Broker) sawDispatching(on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if on && !b.dispatched {
		b.dispatchSince = b.now()
	}
	b.dispatched = on
}

// Broker is the command broker. Create it with New, start it with Start,
// stop it with Close.
type Broker struct {
	opts Options
	st   Store
	tree topics.Tree
	log  *slog.Logger
	// noisy logs the lines of what bridges send that a bridge can repeat
	// as fast as it publishes (a malformed message, a reply of no
	// command): once a minute per line and device (bug 379).
	noisy *logevery.Log
	// hourly logs the warnings of a bridge misconfigured on the broker
	// (noteUnheard, checkStateless): once an hour per bridge.
	hourly *logevery.Log
	now    func() time.Time
	client mqtt.Client

	kick      chan struct{}     // wakes the outbox
	connected chan struct{}     // one signal per (re)connect, for the outbox
	acks      chan inflight     // published commands awaiting their PUBACK, in order
	inbox     chan mqtt.Message // messages route took, for intake, in order
	// moved is the topic where replicas sharing a store tell each other
	// of a device that changed bridges (tellMoved): under the prefix,
	// which only the servers may read and write outside the devices' and
	// bridges' topics (CONTRACT §3). The payload is the device's id.
	moved string
	// kickedAt is the topic where they tell each other of a bridge about
	// to be disconnected (BridgesDisconnecting); the payload is its id.
	kickedAt string

	mu      sync.Mutex
	waiters map[string][]chan companion.Command
	online  map[string]bool     // devices seen online since start
	offline map[string]bool     // devices whose retained status publishOffline set offline, with no online status taken in since
	resend  map[string]bool     // devices whose sent commands the outbox must publish again
	pending []companion.Command // accepted, on disk, not yet published: in commit order
	scan    bool                // pending is incomplete: the outbox reads the queued commands from the store
	// flying holds the commands the outbox took to publish whose state on
	// disk is still queued: until the bridge answers, or sentDelay after
	// the PUBACK, when "sent" is written (see flushSent).
	flying map[string]*outgoing
	// moving counts, per device, the moves under way (PrepareMove): the
	// outbox publishes none of the device's commands meanwhile.
	moving map[string]int
	moves  atomic.Int32 // the moves under way, of every device
	// words holds, per command id, the moves waiting for the bridge's
	// word on the command (awaitWord), which landAs wakes.
	words map[string][]chan struct{}
	// landed holds the ids that landed since the outbox last read the
	// store, while it publishes what it read: the store said queued (or
	// not final) before they landed. Those that ended (true, land) must
	// not go out; those the bridge has (false, arrived) go only as
	// repeats asked for.
	landed map[string]bool
	// lastOut holds, per device, the newest of its commands this broker
	// published that it has not seen end: the next command of the device
	// names it as the one to run after (topics.Command.After).
	lastOut map[string]string
	// named holds the ids that went out as a command's After and have not
	// ended here: should one expire, the bridge is told (see expire).
	named map[string]bool
	// recheck holds the ids of named that another replica changed
	// since retryLoop last read them (see checkNamed).
	recheck map[string]bool
	// repeats holds, per device, the commands repeated here and when each
	// may go out again; held, per device with a repeat held back, the
	// earliest time one may go (see holdRepeat).
	repeats map[string]map[string]*repeat
	held    map[string]time.Time
	finals  idSet           // commands seen final here (notify)
	gate    *reportGate     // bounds how often a device's reports are taken in
	unsent  []string        // ids of flying commands acknowledged by the MQTT broker, oldest first
	live    map[string]bool // commands accepted here, not final, not changed by another replica (see Wait)
	ready   bool
	// notReady says why the broker is connected but not ready (its
	// probe did not come back: see selfCheck); "" otherwise. Under mu.
	notReady string
	started  bool
	closed   bool
	extra    []extraSub // subscriptions of other users of the connection

	// probe is this server's own topic for its self-check (selfCheck):
	// what it publishes there it must receive; probed has each payload
	// that arrived there.
	probe    string
	probed   chan string
	probeGen uint64 // counts selfCheck's runs; under mu

	// elsewhere holds the commands another replica changed lately
	// (CommandChanged): one whose acceptance the store calls back only
	// after is not made live (see Submit; bug 232). Under mu.
	elsewhere idSet
	// lost counts the times notifications may have been lost
	// (CommandChanged("")): a command whose acceptance the store calls
	// back after one began is not made live (see Submit; bug 253). Added
	// to under mu; Submit reads it first without mu, on the command path.
	lost atomic.Uint64

	// dispatchSince is when this broker was last seen to become the
	// dispatcher; for a server alone, when New made it. A command accepted
	// before may have been published by the dispatcher before it: a server
	// since restarted, or a replica since gone (see expiredAt).
	dispatchSince time.Time
	dispatched    bool // whether this broker dispatched when last seen (sawDispatching)

	// bridgeGen holds the number of each bridge's latest state message
	// taken in, counted in bridgeStates (see noteBridgeState), until the
	// bridge is forgotten (forgetBridge); under mu.
	bridgeGen map[string]uint64
	// stateless keeps the bridges whose devices were heard from live,
	// for checkStateless; under its own lock.
	stateless *stateless
	// stateLines holds, of each bridge whose state was logged, what
	// logState has to say of it; under stateMu.
	stateMu      sync.Mutex
	stateLines   map[string]*stateLines
	bridgeStates uint64
	// kicked holds when each bridge was last said to be disconnected for
	// a change of its rights (BridgesDisconnecting); under mu.
	kicked map[string]time.Time
	// away holds the bridges whose Will was the last word taken in from
	// them: their devices' commands wait queued in the store until the
	// bridge is back (see publish); awayDevices, the devices whose
	// commands publish held for such a bridge (device → bridge), whose
	// queued commands the outbox's reads of the store leave out until
	// then (heldAway), and lastFullRead when a read last left none out.
	// Under mu.
	away         map[string]bool
	awayDevices  map[string]string
	lastFullRead time.Time

	// release is closed by Release (and Close): every Wait, under way or
	// to come, answers at once.
	release chan struct{}
	quit    chan struct{}
	wg      sync.WaitGroup
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
	if opts.KickGrace <= 0 {
		opts.KickGrace = 10 * time.Second
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
	if opts.RepeatSpacing <= 0 {
		opts.RepeatSpacing = 5 * time.Second
	}
	if opts.Retention <= 0 {
		opts.Retention = 30 * 24 * time.Hour
	}
	if opts.ReportRate == 0 {
		opts.ReportRate = defaultReportRate
	}
	if opts.ReportBurst <= 0 {
		opts.ReportBurst = defaultReportBurst
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
	now := opts.Now
	if st, ok := opts.Store.(clockOffsetter); ok {
		// The store stamps commands by the database's clock when this
		// replica's is far from it: their expires_at, created_at and
		// updated_at are judged by that clock too (bug 314).
		now = func() time.Time { return opts.Now().Add(st.ClockOffset()) }
	}
	log := opts.Logger.With("component", "broker")
	b := &Broker{
		opts:        opts,
		noisy:       logevery.New(log, time.Minute, nil),
		hourly:      logevery.New(log, time.Hour, now),
		st:          opts.Store,
		tree:        opts.Topics,
		log:         log,
		now:         now,
		kick:        make(chan struct{}, 1),
		connected:   make(chan struct{}, 1),
		waiters:     make(map[string][]chan companion.Command),
		online:      make(map[string]bool),
		offline:     make(map[string]bool),
		resend:      make(map[string]bool),
		flying:      make(map[string]*outgoing),
		moving:      make(map[string]int),
		words:       make(map[string][]chan struct{}),
		lastOut:     make(map[string]string),
		named:       make(map[string]bool),
		recheck:     make(map[string]bool),
		repeats:     make(map[string]map[string]*repeat),
		held:        make(map[string]time.Time),
		live:        make(map[string]bool),
		acks:        make(chan inflight, maxInflight),
		inbox:       make(chan mqtt.Message, maxIntakeBatch),
		moved:       opts.Topics.DevicesMoved(),
		kickedAt:    opts.Topics.BridgesKicked(),
		probe:       opts.Topics.ServerProbe(probeID(opts.ClientID)),
		probed:      make(chan string, 16),
		bridgeGen:   make(map[string]uint64),
		stateless:   newStateless(),
		stateLines:  make(map[string]*stateLines),
		kicked:      make(map[string]time.Time),
		away:        make(map[string]bool),
		awayDevices: make(map[string]string),
		release:     make(chan struct{}),
		quit:        make(chan struct{}),
	}
	b.dispatchSince, b.dispatched = b.now(), opts.Dispatcher == nil
	b.gate = newReportGate(opts.ReportRate, opts.ReportBurst, b.later, b.log, opts.Observer.ReportCoalesced)

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
	pahoconn.ReportFailures(pahoconn.Buffered(co), b.log,
		"the broker refuses the server's login: give --mqtt-username and --mqtt-password of an account the broker holds (docs/mosquitto.md)")
	newClient := opts.NewClient
	if newClient == nil {
		newClient = mqtt.NewClient
	}
	b.client = newClient(co)
	b.client.AddRoute(b.probe, b.takeProbe)
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

	b.goOwned(b.intake)
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

// Ready reports whether the broker is connected to MQTT, subscribed, and
// receives what it publishes under its prefix.
func (b *Broker) Ready() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ready
}

// NotReady says why the broker is not ready: nil when it is.
func (b *Broker) NotReady() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.ready:
		return nil
	case b.notReady != "":
		return errors.New(b.notReady)
	}
	return errors.New("the MQTT connection is down")
}

func (b *Broker) setReady(v bool) {
	b.mu.Lock()
	b.ready = v
	b.notReady = ""
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
	b.Release()
	close(b.quit)
	b.client.Disconnect(250)
	b.wg.Wait()
	return nil
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

// ErrNotConnected is Publish's answer while the MQTT connection is down.
var ErrNotConnected = errors.New("broker: MQTT not connected")

// errStale marks a reply that must change nothing.
var errStale = errors.New("stale reply")

// maxReplyAttempts bounds how often a reply, or a bridge's state, that
// the store fails to take is taken again: about ten minutes of an
// unreachable store.
const maxReplyAttempts = 64
