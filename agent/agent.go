// Package agent is the bridge: it sits near Bluetooth devices, takes command
// messages from MQTT, runs them on the devices, and publishes replies, status
// and settings back (CONTRACT §3, docs/design.md).
//
// Every command is written to a bbolt spool (fsync'd) before its MQTT message
// is acknowledged, so neither a crash nor a broker outage loses one; the spool
// also remembers finished command ids for DoneRetention, so that a repeated
// message never runs twice. One worker per device runs that device's commands
// one at a time, each under a timeout, in the order the server accepted them
// (their ids are UUIDv7; ids of other versions run in order of arrival).
//
// Messages reach the spool in order of arrival: the paho client runs with
// SetOrderMatters(true), and its handler only appends to an in-memory list
// (it never blocks), so PUBACKs also go back in order (MQTT-4.6.0-2).
// With SetOrderMatters(false) each message would get its own goroutine and
// two commands could overtake each other on the way to the spool.
//
// The agent talks to devices only through the Device interface; it knows
// nothing of the server's HTTP API or store, and imports only topics of this
// project.
package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"

	"github.com/devicecompanion/companion/internal/fastjson"
	"github.com/devicecompanion/companion/internal/pahoconn"
	"github.com/devicecompanion/companion/internal/pahostore"
	"github.com/devicecompanion/companion/internal/tlsclient"
	"github.com/devicecompanion/companion/topics"
)

// Device is what the agent needs of a device. Implementations: gatt.Device
// (a device over Bluetooth, stock MCUmgr and the project's groups) and
// sim.Device (the simulator driven without a link).
//
// cmdID is the command id: a device treats a repeated cmdID as already done
// and returns nil without doing it again. Every method must return soon
// after ctx is done. Info and Settings may be called while a command runs.
type Device interface {
	ID() string
	Info(ctx context.Context) (companion.DeviceInfo, error)
	Settings(ctx context.Context) (map[string]any, topics.Schema, error)
	PushText(ctx context.Context, cmdID, title, text string) error
	PushImage(ctx context.Context, cmdID, contentType string, data []byte) error
	// InstallApp installs an app, or updates it when installed already.
	InstallApp(ctx context.Context, cmdID, appID, version string, pkg []byte) error
	UninstallApp(ctx context.Context, cmdID, appID string) error
	UpdateSettings(ctx context.Context, cmdID string, values map[string]any) error
	// UpdateFirmware installs image, an MCUboot image of version, calling
	// progress with 0–100 as it goes: the device reboots into it and it is
	// confirmed before UpdateFirmware returns nil.
	UpdateFirmware(ctx context.Context, cmdID, version string, image []byte, progress func(pct int)) error
}

// Defaults of Options.
const (
	DefaultCommandTimeout = 10 * time.Minute
	// DefaultBlobCacheMax is what the blob cache may hold: a few firmware
	// images, or a few hundred pushed images, on a gateway's flash.
	DefaultBlobCacheMax   = 512 << 20
	DefaultStatusInterval = time.Minute
)

// Options configure an Agent. The zero value of a field means its default.
type Options struct {
	MQTTURL string // required, e.g. tcp://127.0.0.1:1883
	// Username and Password authenticate to the broker: the bridge id and
	// its secret. Username defaults to BridgeID. Password is also the bearer
	// token of blob downloads.
	Username, Password string
	BridgeID           string // required
	// APIURL is the base of blob URLs, which arrive relative
	// ("/api/v1/blobs/SHA") or absolute; or a comma-separated list of the
	// bases of server replicas, a download failing over from one to the
	// next.
	APIURL  string
	DataDir string // required: the spool (spool.db) and the blob cache (blobs/)
	Devices []Device
	Topics  topics.Tree // default topics.DefaultPrefix
	Logger  *slog.Logger
	Now     func() time.Time

	CommandTimeout time.Duration // default DefaultCommandTimeout
	StatusInterval time.Duration // default DefaultStatusInterval
	TLSConfig      *tls.Config   // optional, for ssl:// or tls:// broker URLs
	HTTPClient     *http.Client  // optional, for blob downloads
	// BlobCacheMax bounds the bytes of downloaded blobs the cache keeps
	// (DefaultBlobCacheMax when 0; negative: no bound but BlobCacheAge).
	BlobCacheMax int64
	// Observer, when set, is told of finished commands and of the MQTT
	// connection, for the bridge's metrics.
	Observer Observer
	// AfterWait is how long a command waits for the one it runs after
	// (topics.Command.After) when the bridge has not had that one yet;
	// default DefaultAfterWait.
	AfterWait time.Duration
}

// Agent is a running bridge. Create it with New, start it with Run, stop it
// by canceling Run's context or with Close.
type Agent struct {
	opts       Options
	log        *slog.Logger
	now        func() time.Time
	tree       topics.Tree
	spool      *spool
	blobs      *blobs
	client     mqtt.Client
	stateTopic string
	filters    []string // the command topics of the devices, in their order, to subscribe to
	byFilter   map[string]*deviceRunner
	devices    map[string]*deviceRunner
	order      []*deviceRunner

	// connected is set while a connection is open that said the bridge
	// online (announce): replies and reports go out meanwhile. connMu
	// orders its changes: announce's and onConnectionLost's.
	connected atomic.Bool
	connMu    sync.Mutex
	// loginRefused is set while the broker refuses the bridge's login
	// (noteLogin): no command starts meanwhile.
	loginRefused atomic.Bool
	// unanswered is the connection (conn) on which each device's commands
	// wait for the broker's answer to the device's filter (awaitsAnswer),
	// 1 from New, or 0: none starts until the broker answers it
	// (deviceRunner.answer), or the bridge finds itself away from the
	// broker (away), which sets 0.
	unanswered atomic.Uint64
	// startHold bounds how long the workers wait at start for a
	// connection to the broker (holdAtStart): connectTimeout.
	startHold time.Duration
	// conn counts the connections; onConnect adds one and wakes the
	// subscriber (subWake), which makes that connection's subscriptions.
	conn      atomic.Uint64
	subWake   chan struct{}
	subTiming subscribeTiming
	// resync is set until the first message of a connection arrives, which
	// sets settleUntil: see settleTime. settleUntil is on the monotonic
	// clock, as time since born: a wall time lay an hour ahead once the
	// clock stepped back an hour, and the intake slept until then on every
	// message (docs/reliability.md, bug 327).
	resync      atomic.Bool
	settleUntil atomic.Int64
	born        time.Time

	// connectedAt is when the last connection was made, as time since
	// born; closings holds when the broker closed a connection soon
	// after it was made, within closingsWindow, and hinted when the
	// bridge last said another process may log in as it (noteClosed).
	connectedAt atomic.Int64
	closingsMu  sync.Mutex
	closings    []time.Duration
	hinted      time.Duration

	// repeats notes the finished commands the server sent again, and
	// unheardHinted when the bridge last said its replies do not reach
	// the server (noteRepeated); unheardSpan is the const of that name,
	// which tests shorten.
	repeatsMu     sync.Mutex
	repeats       map[string]*repeatNote
	unheardHinted time.Duration
	unheardSpan   time.Duration

	// server is the least the server's clock reads, from the commands'
	// created_at: TTLs are judged on it too (ttlNow).
	server serverClock

	seqMu   sync.Mutex
	lastSeq uint64

	intakeMu   sync.Mutex
	intake     []mqtt.Message
	intakeWake chan struct{}

	delivMu    sync.Mutex
	delivQueue []owedDelivered // "delivered" replies owed, oldest first
	delivOwed  map[string]bool // ids of delivQueue whose reply is still owed
	delivWake  chan struct{}

	outboxWake chan struct{}
	outboxMu   sync.Mutex
	flying     map[uint64]bool   // outbox keys of final replies published, PUBACK awaited
	unfinished []finishJob       // final replies the spool failed to record, to try again
	acks       chan pendingFinal // published final replies awaiting their PUBACK, in order

	runMu   sync.Mutex
	started bool
	closed  bool
	stop    chan struct{} // closed by Close
	stopped chan struct{} // closed when Run has stopped everything

	spoolPath   string // the spool's file, for the log
	spoolHealth spoolHealth

	closeDB sync.Once
	dbErr   error

	wg sync.WaitGroup // the loops
}

// New checks the options, opens the spool and prepares the MQTT client. It
// does not connect: Run does.
func New(opts Options) (*Agent, error) {
	if !topics.ValidBridgeID(opts.BridgeID) {
		return nil, fmt.Errorf("agent: invalid bridge id %q", opts.BridgeID)
	}
	urls, err := tlsclient.BrokerURLs(opts.MQTTURL)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if opts.DataDir == "" {
		return nil, errors.New("agent: no data directory")
	}
	if opts.Username == "" {
		opts.Username = opts.BridgeID
	}
	if opts.Topics.Prefix() == "" {
		opts.Topics = topics.MustNew(topics.DefaultPrefix)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.CommandTimeout <= 0 {
		opts.CommandTimeout = DefaultCommandTimeout
	}
	if opts.StatusInterval <= 0 {
		opts.StatusInterval = DefaultStatusInterval
	}
	if opts.BlobCacheMax == 0 {
		opts.BlobCacheMax = DefaultBlobCacheMax
	}
	if opts.HTTPClient == nil {
		opts.HTTPClient = &http.Client{Transport: http.DefaultTransport}
	}
	if opts.Observer == nil {
		opts.Observer = nopObserver{}
	}
	a := &Agent{
		opts:        opts,
		log:         opts.Logger.With("bridge_id", opts.BridgeID),
		now:         opts.Now,
		born:        time.Now(),
		tree:        opts.Topics,
		devices:     map[string]*deviceRunner{},
		byFilter:    map[string]*deviceRunner{},
		intakeWake:  make(chan struct{}, 1),
		subWake:     make(chan struct{}, 1),
		subTiming:   subscribeTiming{timeout: subscribeTimeout, retryMin: subscribeRetryMin, retryMax: subscribeRetryMax},
		unheardSpan: unheardSpan,
		startHold:   connectTimeout,
		outboxWake:  make(chan struct{}, 1),
		delivOwed:   map[string]bool{},
		delivWake:   make(chan struct{}, 1),
		flying:      map[uint64]bool{},
		acks:        make(chan pendingFinal, maxFlying),
		stop:        make(chan struct{}),
		stopped:     make(chan struct{}),
	}
	for _, d := range opts.Devices {
		id := d.ID()
		if !topics.ValidDeviceID(id) {
			return nil, fmt.Errorf("agent: invalid device id %q", id)
		}
		if a.devices[id] != nil {
			return nil, fmt.Errorf("agent: device %q given twice", id)
		}
		f, err := a.tree.CommandsFilter(id)
		if err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
		dr := newDeviceRunner(d)
		a.devices[id] = dr
		a.order = append(a.order, dr)
		a.filters = append(a.filters, f)
		a.byFilter[f] = dr
	}
	if a.stateTopic, err = a.tree.BridgeState(opts.BridgeID); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}

	if err := os.MkdirAll(opts.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: data directory: %w", err)
	}
	if a.blobs, err = newBlobs(filepath.Join(opts.DataDir, "blobs"), opts.APIURL, opts.Password, opts.HTTPClient, a.now, a.log); err != nil {
		return nil, err
	}
	a.blobs.max = opts.BlobCacheMax
	// Commands spooled before a restart are released to their workers at
	// once: their "delivered" went out (or is moot) in the earlier life.
	a.spoolPath = filepath.Join(opts.DataDir, "spool.db")
	if a.spool, err = openSpool(opts.DataDir); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if opts.AfterWait > 0 {
		a.spool.afterWait = opts.AfterWait
	}
	a.resync.Store(true)
	a.unanswered.Store(1) // the first connection's

	co := mqtt.NewClientOptions()
	for _, u := range urls {
		co.AddBroker(u)
	}
	co.SetClientID("companion-bridge-"+opts.BridgeID).
		SetUsername(opts.Username).
		SetPassword(opts.Password).
		SetCleanSession(false).
		// Order matters: commands must reach the spool in the order they
		// arrived, and PUBACKs go back in that order (MQTT-4.6.0-2). The
		// handler only appends to an in-memory list, so it never blocks.
		SetOrderMatters(true).
		SetAutoAckDisabled(true).
		SetAutoReconnect(true).
		SetConnectRetry(true).
		SetConnectRetryInterval(time.Second).
		SetMaxReconnectInterval(15*time.Second).
		SetConnectTimeout(connectTimeout).
		SetKeepAlive(30*time.Second).
		SetWriteTimeout(10*time.Second).
		SetResumeSubs(false).
		// The state is said anew on every connect: an old one sent again
		// goes unretained (see pahostore.Store.ResentUnretained).
		SetStore(pahostore.New().ResentUnretained(func(topic string) bool { return topic == a.stateTopic })).
		SetBinaryWill(a.stateTopic, []byte(topics.BridgeOffline), 1, true).
		SetDefaultPublishHandler(a.onMessage).
		SetOnConnectHandler(a.onConnect).
		SetConnectionLostHandler(a.onConnectionLost)
	if opts.TLSConfig != nil {
		co.SetTLSConfig(opts.TLSConfig)
	}
	co = pahoconn.ReportFailures(pahoconn.Buffered(co), a.log, refusedLogin)
	report := co.OnConnectionNotification
	co.SetConnectionNotificationHandler(func(c mqtt.Client, n mqtt.ConnectionNotification) {
		// The refusal is noted, and the commands held, before the
		// failure is logged: whoever reads the line (a test, before it
		// lets a command end) finds the hold in place.
		if f, failed := n.(mqtt.ConnectionNotificationFailed); failed {
			a.noteLogin(f.Reason)
			a.away("an attempt to connect to the broker failed")
		}
		report(c, n)
	})
	a.client = mqtt.NewClient(co)
	return a, nil
}

// connectTimeout bounds an attempt to connect to the broker (the dial
// and the CONNACK), and how long the workers wait at start for a
// connection (holdAtStart).
const connectTimeout = 10 * time.Second

// noteLogin notes whether the broker refuses the bridge's login (CONNACK
// 4 or 5): the bridge was deleted, or its secret is not the one the server
// has. The server failed the commands of its devices, device_not_served,
// as it deleted it; run on, they showed on the devices afterwards (docs/
// reliability.md, bug 243). While the login is refused, no device's
// commands start (holdRefused); once the broker lets the bridge in
// (onConnect), they run as it answers the connection's subscriptions,
// those of devices whose command filter it refuses excepted.
func (a *Agent) noteLogin(reason error) {
	if !errors.Is(reason, packets.ErrorRefusedBadUsernameOrPassword) && !errors.Is(reason, packets.ErrorRefusedNotAuthorised) {
		return
	}
	if !a.loginRefused.Swap(true) {
		a.log.Warn("holding every device's commands: the broker refuses the bridge's login, which the server deleted or gave another secret")
		// What runs stops, and the links go: the devices may be assigned
		// to a bridge beside this one, which a device that takes one
		// central at a time kept out (docs/reliability.md, bug 505).
		for _, dr := range a.order {
			dr.stopRunning(errLoginRefused)
			signal(dr.rwake)
		}
	}
}

// Run starts the workers, connects to the broker (retrying until it can or
// ctx is done) and serves until ctx is canceled or Close is called. It
// returns once everything it started has stopped, having published
// "offline" on the bridge's state topic. Run may be called once.
func (a *Agent) Run(ctx context.Context) error {
	a.runMu.Lock()
	if a.closed || a.started {
		a.runMu.Unlock()
		return errors.New("agent: Run called twice or after Close")
	}
	a.started = true
	a.runMu.Unlock()
	defer close(a.stopped)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-a.stop:
			cancel()
		case <-ctx.Done():
		}
	}()

	a.failUnserved(ctx)
	a.goLoop(func() { a.intakeLoop(ctx) })
	a.goLoop(func() { a.outboxLoop(ctx) })
	a.goLoop(func() { a.confirm(ctx) })
	a.goLoop(func() { a.deliveredLoop(ctx) })
	a.goLoop(func() { a.housekeeping(ctx) })
	a.goLoop(func() { a.subscriber(ctx) })
	a.goLoop(func() { a.holdAtStart(ctx) })
	for _, dr := range a.order {
		a.goLoop(func() { a.work(ctx, dr) })
		a.goLoop(func() { a.report(ctx, dr) })
	}

	a.log.Info("connecting", "mqtt", a.opts.MQTTURL, "devices", len(a.order))
	tok := a.client.Connect()
	select {
	case <-tok.Done():
		if err := tok.Error(); err != nil {
			a.log.Error("MQTT connect failed", "err", err)
		}
	case <-ctx.Done():
	}
	<-ctx.Done()

	a.wg.Wait()
	if a.client.IsConnectionOpen() {
		// A clean disconnect does not fire the Will: say it ourselves.
		t := a.client.Publish(a.stateTopic, 1, true, topics.BridgeOffline)
		if err := mqtt.WaitTokenTimeout(t, 5*time.Second); err != nil {
			a.log.Warn("publishing offline state failed", "err", err)
		}
	}
	a.connected.Store(false)
	a.opts.Observer.MQTTConnected(false)
	a.client.Disconnect(250)
	a.log.Info("stopped")
	return nil
}

// failUnserved ends the commands the spool holds for devices the bridge
// no longer serves: its Devices lost them since the commands were spooled
// (a restart with a shorter list). No worker runs them and nothing else
// answers them, so the server would read them delivered until the device
// moved to another bridge. Each fails with device_not_served through the
// spool's finish, as a command that ran does: its final reply is on disk
// and goes out from the outbox, again until the broker acknowledges it.
// The device may have started one before the restart; what it did is not
// known, hence failed rather than expired or canceled.
func (a *Agent) failUnserved(ctx context.Context) {
	for _, r := range a.spool.claimUnserved(func(id string) bool { return a.devices[id] != nil }) {
		c := r.Cmd
		ce := cmdErr(companion.CodeDeviceNotServed, fmt.Sprintf("bridge %s no longer serves device %s", a.opts.BridgeID, c.DeviceID))
		a.log.Warn("command failed: the bridge no longer serves its device", "device_id", c.DeviceID, "command_id", c.ID, "op", c.Op)
		a.opts.Observer.CommandDone(c.Op, companion.StateFailed, false, 0)
		a.finish(ctx, r, topics.Reply{CommandID: c.ID, State: companion.StateFailed, Error: ce.reply(), At: a.now()})
	}
}

func (a *Agent) goLoop(f func()) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		f()
	}()
}

// Close stops Run, waits for it to finish, and closes the spool.
func (a *Agent) Close() error {
	a.runMu.Lock()
	if !a.closed {
		a.closed = true
		close(a.stop)
	}
	started := a.started
	a.runMu.Unlock()
	if started {
		<-a.stopped
	}
	a.closeDB.Do(func() { a.dbErr = a.spool.close() })
	return a.dbErr
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// onConnect runs on every (re)connection, in a goroutine of paho's. It
// only counts the connection and wakes the subscriber, which subscribes
// (that may take minutes on NATS: see subscribe.go) and then says the
// bridge is online. Until then every message goes to the default handler,
// which also catches what a persistent session delivers before the
// subscriptions are made again; and no command starts (unanswered): what
// the last connection said of each device's filter may have changed
// meanwhile, as a move disconnects the bridge (docs/reliability.md, bug
// 250). A login the broker refused before is let in here, not in the
// connection notification, which paho runs in a goroutine of its own: a
// command released there could start before this one marked the
// connection unanswered.
func (a *Agent) onConnect(mqtt.Client) {
	a.connectedAt.Store(int64(time.Since(a.born)))
	a.unanswered.Store(a.conn.Add(1))
	if a.loginRefused.Swap(false) {
		a.log.Info("the broker lets the bridge in again; its devices' commands run once it answers their subscriptions")
	}
	signal(a.subWake)
}

// testHookLost, when set, runs as onConnectionLost starts: a test holds
// the handler there, as paho's scheduling may.
var testHookLost atomic.Pointer[func()]

func (a *Agent) onConnectionLost(_ mqtt.Client, err error) {
	if h := testHookLost.Load(); h != nil {
		(*h)()
	}
	a.away("the connection to the broker was lost")
	// Paho runs this in a goroutine of its own, beside its reconnect: a
	// connection open by now is the next one, which may have said the
	// bridge online already (announce). Marked offline, the bridge
	// published no final reply nor status on it until the one after
	// (docs/reliability.md, bug 290).
	a.connMu.Lock()
	if !a.client.IsConnectionOpen() {
		a.connected.Store(false)
		a.opts.Observer.MQTTConnected(false)
	}
	a.connMu.Unlock()
	a.resync.Store(true)
	signal(a.subWake) // stop asking for refused filters on the lost connection
	a.log.Warn("MQTT connection lost", "err", err)
	a.noteClosed(err)
}

// Of closings: a connection the broker closes (EOF, or a reset:
// closedByPeer) within closingSoon of being made, closingsToHint times
// within closingsWindow, is taken as another process logging in as the
// bridge, said at most once in hintEvery.
const (
	closingSoon    = 30 * time.Second // a connection lasts up to paho's 15 s backoff of the other
	closingsWindow = 2 * time.Minute
	closingsToHint = 3
	hintEvery      = time.Hour
)

// noteClosed notes a connection lost with err, and says, once an hour,
// that another process may log in as the bridge when the broker has
// closed its connections soon after they were made, again and again: two
// bridges started with the same id and secret log in with the same
// client id, and the broker closes the older connection at each login,
// as long as both run. Each said only "MQTT connection lost" (EOF) and
// "connected", as a bad network would have it; on a user's own bridge,
// whose owner has no server log to read, nothing named the cause
// (docs/reliability.md, bug 458).
func (a *Agent) noteClosed(err error) {
	now := time.Since(a.born)
	if !closedByPeer(err) || now-time.Duration(a.connectedAt.Load()) > closingSoon {
		return
	}
	a.closingsMu.Lock()
	a.closings = append(slices.DeleteFunc(a.closings, func(at time.Duration) bool { return now-at > closingsWindow }), now)
	n := len(a.closings)
	hint := n >= closingsToHint && (a.hinted == 0 || now-a.hinted >= hintEvery)
	if hint {
		a.hinted = now
	}
	a.closingsMu.Unlock()
	if hint {
		a.log.Warn("the broker closed the bridge's connection soon after it was made, again and again: "+
			"another process may log in as this bridge (the same --bridge-id and secret), each login closing the other's; if so, stop one "+
			"(a device moved to or from the bridge closes it once too)",
			"closings", n, "within", closingsWindow)
	}
}

// closedByPeer reports whether err is the broker closing the connection:
// EOF, or a reset or broken pipe, which is what a close reaches the bridge
// as when the broker had not read all the bridge sent (a PINGREQ, a status
// on its way). Mosquitto, taking a connection over, reset two in thirteen
// of two idle bridges with one id; counted as EOF only, a busy pair could
// take each other over for good without either saying why
// (docs/reliability.md, bug 467).
func closedByPeer(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// refusedLogin is what to do when the broker refuses the bridge's login,
// which the bridge retries in vain: its id and secret are not a bridge the
// server knows (docs/reliability.md, bug 198).
const refusedLogin = "the broker refuses the bridge's id and secret: --bridge-secret is not the secret of --bridge-id, " +
	"or the bridge was deleted on the server, or given a new secret there; give the secret companion bridge create printed, " +
	"or give the bridge a new secret (companion bridge secret ID, or POST /api/v1/bridges/ID/secret), " +
	"or create the bridge again (companion bridge create ID, or POST /api/v1/bridges), and give the secret printed; " +
	"or the server could not make the bridge's account on the broker (its /readyz and log say why: docs/reliability.md, bug 483)"

// settleTime is how long the intake gathers the messages that arrive first
// on a connection before it takes them in. Those are the backlog of the
// bridge's session, which a broker may resend out of order (mochi does);
// taken in together, each device's commands run in the order of their ids.
const settleTime = 100 * time.Millisecond

// onMessage is paho's handler for every message. It must not block: it only
// hands the message to the intake loop, which acknowledges it once spooled.
func (a *Agent) onMessage(_ mqtt.Client, m mqtt.Message) {
	if a.resync.CompareAndSwap(true, false) {
		a.settleUntil.Store(int64(time.Since(a.born) + settleTime))
	}
	a.intakeMu.Lock()
	a.intake = append(a.intake, m)
	a.intakeMu.Unlock()
	signal(a.intakeWake)
}

func (a *Agent) intakeLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.intakeWake:
		}
		if d := time.Duration(a.settleUntil.Load()) - time.Since(a.born); d > 0 && !sleepCtx(ctx, d) {
			return
		}
		a.intakeMu.Lock()
		batch := a.intake
		a.intake = nil
		a.intakeMu.Unlock()
		if len(batch) > 0 {
			a.accept(ctx, batch)
		}
	}
}

// cmdKey tells commands apart: a cancel carries the id of the command it
// cancels.
type cmdKey struct{ op, id string }

// accept spools a batch of messages in one transaction, then acknowledges
// them in order of arrival and answers each.
func (a *Agent) accept(ctx context.Context, batch []mqtt.Message) {
	type item struct {
		msg mqtt.Message
		cmd *topics.Command
		res acceptResult
	}
	items := make([]item, len(batch))
	var cmds []topics.Command
	for i, m := range batch {
		items[i].msg = m
		cmd, err := a.parse(m)
		if err != nil {
			a.log.Warn("dropping bad command message", "topic", m.Topic(), "err", err)
			continue
		}
		items[i].cmd = &cmd
		cmds = append(cmds, cmd)
	}

	var results []acceptResult
	var held map[cmdKey]bool // the batch's commands, once a write failed
	for len(cmds) > 0 {
		var err error
		if results, err = a.spool.acceptAt(cmds, a.now(), a.ttlNow(), a.stampNow()); err == nil {
			a.spoolWritten()
			break
		}
		a.spoolFailed("taking commands in", err)
		a.log.Debug("spooling commands failed; retrying", "commands", len(cmds), "err", err)
		select {
		case <-ctx.Done():
			return // unacknowledged: the broker redelivers them
		case <-time.After(time.Second):
		}
		// What came in meanwhile joins the batch, but for the repeats
		// of a command it holds: the server sends a command again while
		// the bridge has not said it has it, and each repeat, held
		// unacknowledged, grew the bridge's memory for as long as the
		// spool failed, up to the broker's in-flight window (65,535
		// messages on the embedded broker). A repeat is acknowledged
		// and dropped: the message it repeats is still unacknowledged,
		// so the broker sends that one again if the bridge stops before
		// the spool takes it (docs/reliability.md, bug 177).
		if held == nil {
			held = make(map[cmdKey]bool, len(cmds))
			kept := items[:0]
			cmds = cmds[:0]
			for _, it := range items {
				if it.cmd != nil {
					k := cmdKey{it.cmd.Op, it.cmd.ID}
					if held[k] {
						it.msg.Ack()
						continue
					}
					held[k] = true
					cmds = append(cmds, *it.cmd)
				}
				kept = append(kept, it)
			}
			items = kept
		}
		a.intakeMu.Lock()
		more := a.intake
		a.intake = nil
		a.intakeMu.Unlock()
		for _, m := range more {
			cmd, err := a.parse(m)
			if err != nil {
				a.log.Warn("dropping bad command message", "topic", m.Topic(), "err", err)
				m.Ack()
				continue
			}
			k := cmdKey{cmd.Op, cmd.ID}
			if held[k] {
				m.Ack()
				continue
			}
			held[k] = true
			items = append(items, item{msg: m, cmd: &cmd})
			cmds = append(cmds, cmd)
		}
	}
	j := 0
	for i := range items {
		if items[i].cmd != nil {
			items[i].res = results[j]
			j++
		}
	}

	var released []*record
	for _, it := range items {
		it.msg.Ack()
		if it.cmd == nil {
			continue
		}
		c := it.cmd
		if c.Op == topics.OpCancel {
			// Perhaps of the command another waits for (a tombstone,
			// when the bridge never had it): that one runs now.
			signal(a.devices[c.DeviceID].wake)
		}
		switch it.res.outcome {
		case acceptQueued:
			a.log.Debug("command spooled", "device_id", c.DeviceID, "command_id", c.ID, "op", c.Op, "after", c.After)
			a.oweDelivered(c.DeviceID, c.ID)
			released = append(released, it.res.rec)
		case acceptExpired:
			// On disk as done, its reply in the outbox (published from
			// there again until the broker has it): never "delivered".
			a.log.Info("command expired before the bridge took it", "device_id", c.DeviceID, "command_id", c.ID, "op", c.Op)
			a.opts.Observer.CommandDone(c.Op, companion.StateExpired, false, 0)
			a.publishFinal(ctx, it.res.key, c.DeviceID, *it.res.final)
		case acceptKnown:
			// Held already, queued or running: it does not run again, but
			// is answered "delivered" (unless it ends first). The server
			// sends a command again when it has not heard that the bridge
			// has it (the "delivered" lost with a crash of the bridge, a
			// broker or the server); unanswered, it read sent, went out
			// again every minute and expired past its TTL while held here.
			a.log.Debug("duplicate command not run again", "device_id", c.DeviceID, "command_id", c.ID)
			a.oweDelivered(c.DeviceID, c.ID)
		case acceptDone:
			a.log.Debug("finished command repeated; republishing its reply", "device_id", c.DeviceID, "command_id", c.ID)
			if it.res.final != nil {
				a.publishReply(c.DeviceID, *it.res.final)
				a.noteRepeated(c.DeviceID, c.ID)
			}
		case acceptCanceled:
			a.log.Info("command canceled before it ran", "device_id", c.DeviceID, "command_id", it.res.final.CommandID)
			// No "delivered" after "canceled": the one owed when the
			// command (or a repeat of it, earlier in this batch) came in.
			a.settleDelivered(it.res.canceled)
			a.publishReply(c.DeviceID, *it.res.final)
		}
	}
	// The whole batch at once: a backlog the broker redelivers out of
	// order (mochi does) runs in the order of the ids.
	a.spool.release(released...)
	for _, r := range released {
		signal(a.devices[r.Cmd.DeviceID].wake)
	}
}

func (a *Agent) parse(m mqtt.Message) (topics.Command, error) {
	t, err := a.tree.Parse(m.Topic())
	if err != nil {
		return topics.Command{}, err
	}
	if t.Kind != topics.KindCommand {
		return topics.Command{}, fmt.Errorf("not a command topic")
	}
	if a.devices[t.DeviceID] == nil {
		return topics.Command{}, fmt.Errorf("device %q is not served by this bridge", t.DeviceID)
	}
	c, err := topics.ParseCommand(m.Payload())
	if err != nil {
		return topics.Command{}, err
	}
	if c.DeviceID != t.DeviceID || c.Op != t.Op {
		return topics.Command{}, fmt.Errorf("message for %s %s on the topic of %s %s", c.DeviceID, c.Op, t.DeviceID, t.Op)
	}
	a.server.observe(c.CreatedAt)
	return c, nil
}

// serverClock is the least the server's clock can read, as the commands
// show it: the server wrote each command's created_at (a cancel's, as it
// sent it) on its clock, so that clock reads at least the latest of them
// plus the time since that command came in, counted on the monotonic
// clock, which no step of the bridge's wall clock moves.
type serverClock struct {
	mu   sync.Mutex
	seen time.Time // a created_at
	at   time.Time // when it came in, with its monotonic reading
}

// lastSeqTime is the last time a seq (nanoseconds since 1970, an int64 in
// the stores) can hold.
var lastSeqTime = time.Unix(0, math.MaxInt64)

// observe takes in a command's created_at. One past what a seq can hold
// (a server's clock set centuries ahead) is not taken: stamped on a
// report, it made a seq the server refused for good.
func (c *serverClock) observe(created time.Time) {
	if created.IsZero() || created.After(lastSeqTime.Add(-time.Hour)) {
		return
	}
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || created.After(c.seen.Add(now.Sub(c.at))) {
		c.seen, c.at = created, now
	}
}

// least returns the least the server's clock reads now, and false before
// any command came in.
func (c *serverClock) least() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() {
		return time.Time{}, false
	}
	return c.seen.Add(time.Since(c.at)), true
}

// ttlNow is the time a command's TTL is judged at: the bridge's clock, but
// never past the least the server's clock reads. The server sets
// expires_at on its clock; a bridge whose clock ran a day ahead (a board
// without a battery-backed clock, a wrong time zone) took every command
// with the default TTL for expired as it arrived, and one with the
// shortest TTL when it was a minute ahead (docs/reliability.md, bug 328).
// A bridge whose clock is behind still judges on its own: the least the
// server's clock reads can be far behind it (the first command after a
// start may have waited in the broker), and the server withdraws a
// command it expired after sending it.
func (a *Agent) ttlNow() time.Time {
	now := a.now()
	if s, ok := a.server.least(); ok && s.Before(now) {
		return s
	}
	return now
}

// stampNow is the time the bridge stamps what it keeps and reports by: a
// command's record done (record.DoneAt), a report's seq (nextSeq) and at,
// which the server shows as the device's last_seen (it read 1970 beside a
// seq of the server's time: docs/reliability.md, bug 334). It is the
// bridge's clock, but never before the least the server's reads. The
// spool forgets a done id DoneRetention after it, judged at ttlNow, so
// that neither a clock behind nor one ahead forgets it early (before a
// command came in since the start, none is forgotten: purgeSpool). A
// bridge at 1970 until NTP synced stamped its done ids 1970, and forgot them at the
// next purge once the clock was set: a repeat of such a command, which the
// server sends when it never stored the final reply, ran again
// (docs/reliability.md, bug 330).
func (a *Agent) stampNow() time.Time {
	now := a.now()
	if s, ok := a.server.least(); ok && s.After(now) {
		return s
	}
	return now
}

// publishReply publishes a reply without waiting for its PUBACK. Final
// replies also sit in the spool's outbox until acknowledged.
func (a *Agent) publishReply(deviceID string, r topics.Reply) mqtt.Token {
	topic, err := a.tree.Replies(deviceID)
	if err != nil {
		a.log.Error("reply dropped: no topic for the device", "device_id", deviceID, "command_id", r.CommandID, "err", err)
		return nil
	}
	b, err := fastjson.Marshal(r)
	if err != nil {
		a.log.Error("reply dropped: it cannot be encoded", "device_id", deviceID, "command_id", r.CommandID, "err", err)
		return nil
	}
	return a.client.Publish(topic, 1, false, b)
}

// deliveredDelay is how long the "delivered" reply of a command waits for
// the command to end. A command that ends sooner gets its final reply only:
// the final state says the bridge had it, and a reply message fewer, and a
// write fewer in the server's store, make every quick command cheaper. A
// command queued behind others on its device, or a long one, reads
// "delivered" this much after the bridge took it.
const deliveredDelay = 250 * time.Millisecond

// owedDelivered is a "delivered" reply not yet published.
type owedDelivered struct {
	deviceID, id string
	at           time.Time // when the bridge took the command in
}

// oweDelivered schedules the "delivered" reply of a command just spooled.
func (a *Agent) oweDelivered(deviceID, id string) {
	a.delivMu.Lock()
	a.delivQueue = append(a.delivQueue, owedDelivered{deviceID: deviceID, id: id, at: time.Now()})
	a.delivOwed[id] = true
	first := len(a.delivQueue) == 1
	a.delivMu.Unlock()
	if first {
		signal(a.delivWake)
	}
}

// settleDelivered drops a command's owed "delivered" reply: a later state
// is on its way.
func (a *Agent) settleDelivered(id string) {
	a.delivMu.Lock()
	delete(a.delivOwed, id)
	a.delivMu.Unlock()
}

// deliveredLoop publishes each owed "delivered" reply once deliveredDelay
// has passed, unless the command has ended (or reported progress) since.
func (a *Agent) deliveredLoop(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		a.delivMu.Lock()
		var due []owedDelivered
		wait := time.Duration(-1)
		now := time.Now()
		for len(a.delivQueue) > 0 {
			d := a.delivQueue[0]
			if left := d.at.Add(deliveredDelay).Sub(now); left > 0 {
				wait = left
				break
			}
			a.delivQueue[0] = owedDelivered{}
			a.delivQueue = a.delivQueue[1:]
			if a.delivOwed[d.id] {
				delete(a.delivOwed, d.id)
				due = append(due, d)
			}
		}
		if len(a.delivQueue) == 0 {
			a.delivQueue = nil
		}
		a.delivMu.Unlock()
		for _, d := range due {
			at := a.now().Add(d.at.Sub(now)) // on the agent's clock
			a.publishReply(d.deviceID, topics.Reply{CommandID: d.id, State: companion.StateDelivered, At: at})
		}
		var timer <-chan time.Time
		if wait >= 0 {
			t.Reset(wait)
			timer = t.C
		}
		select {
		case <-ctx.Done():
			return
		case <-a.delivWake:
		case <-timer:
		}
	}
}

// maxFlying bounds the final replies published and not yet acknowledged by
// the MQTT broker: past it, publishing waits for PUBACKs.
const maxFlying = 4096

// pendingFinal is a final reply published from the outbox, awaiting its
// PUBACK.
type pendingFinal struct {
	key uint64
	tok mqtt.Token
}

// publishFinal publishes a final reply that is in the spool's outbox under
// key, unless it is on its way already or the broker is out of reach (the
// outbox loop sends it after the next connect). confirm deletes it from the
// outbox once the broker has acknowledged it.
func (a *Agent) publishFinal(ctx context.Context, key uint64, deviceID string, r topics.Reply) {
	if !a.connected.Load() {
		return
	}
	a.outboxMu.Lock()
	busy := a.flying[key]
	a.flying[key] = true
	a.outboxMu.Unlock()
	if busy {
		return
	}
	tok := a.publishReply(deviceID, r)
	if tok == nil {
		a.land(key)
		return
	}
	select {
	case a.acks <- pendingFinal{key: key, tok: tok}:
	case <-ctx.Done():
		a.land(key)
	}
}

func (a *Agent) land(key uint64) {
	a.outboxMu.Lock()
	delete(a.flying, key)
	a.outboxMu.Unlock()
}

// outboxLoop publishes the final replies in the spool's outbox after every
// connect and every 30 s: those whose publish was lost (the broker was
// down, the bridge crashed) go again. Replies finished while connected are
// published as they finish (publishFinal). It also retries the final
// replies the spool failed to record.
func (a *Agent) outboxLoop(ctx context.Context) {
	tick := time.NewTicker(30 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-a.outboxWake:
		case <-tick.C:
		}
		a.outboxMu.Lock()
		retry := a.unfinished
		a.unfinished = nil
		a.outboxMu.Unlock()
		for _, j := range retry {
			a.finish(ctx, j.r, j.final)
		}
		if !a.connected.Load() {
			continue
		}
		items, err := a.spool.outbox()
		if err != nil {
			a.log.Error("reading the outbox failed", "err", err)
			continue
		}
		for _, it := range items {
			a.publishFinal(ctx, it.key, it.DeviceID, it.Reply)
		}
	}
}

// confirm waits for the PUBACK of each published final reply, in the order
// they were published, and then deletes it from the outbox (a write that
// shares the spool's next commit). One not acknowledged stays in the
// outbox for the next pass of the outbox loop.
func (a *Agent) confirm(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		var p pendingFinal
		select {
		case <-ctx.Done():
			return
		case p = <-a.acks:
		}
		t.Reset(30 * time.Second) // Go ≥ 1.23: no stale tick survives Reset
		select {
		case <-p.tok.Done():
		case <-t.C:
		case <-ctx.Done():
			return
		}
		if err := p.tok.Error(); err != nil || !isDone(p.tok) {
			a.log.Warn("final reply not acknowledged; it stays in the outbox", "err", err)
			a.land(p.key)
			continue
		}
		a.spool.deleteOutbox(p.key, func(err error) {
			a.land(p.key)
			if err != nil {
				a.spoolFailed("forgetting an acknowledged final reply", err)
			}
		})
	}
}

func isDone(tok mqtt.Token) bool {
	select {
	case <-tok.Done():
		return true
	default:
		return false
	}
}

// SpoolStats counts the spool's grouped writes.
type SpoolStats struct {
	Commits int64 `json:"commits"` // transactions committed, each one fsync of the spool
	Writes  int64 `json:"writes"`  // writes they carried
	Pages   int64 `json:"pages"`   // dirty pages the transactions wrote (bbolt's spilled nodes)
}

// SpoolStats returns how many writes the spool has committed, and in how
// many transactions, since New.
func (a *Agent) SpoolStats() SpoolStats {
	s := a.spool.w.Stats()
	b := a.spool.db.Stats()
	return SpoolStats{Commits: s.Commits, Writes: s.Ops, Pages: b.TxStats.GetSpill()}
}

// housekeeping forgets old finished command ids and old cached blobs.
func (a *Agent) housekeeping(ctx context.Context) {
	tick := time.NewTicker(time.Hour)
	defer tick.Stop()
	for {
		now := a.now()
		if n, err := a.purgeSpool(); err != nil {
			a.log.Error("purging the spool failed", "err", err)
		} else if n > 0 {
			a.log.Info("forgot old command ids", "count", n)
		}
		if n := a.blobs.purge(now.Add(-BlobCacheAge)); n > 0 {
			a.log.Info("deleted old cached blobs", "count", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// purgeSpool forgets the ids of commands done DoneRetention ago, on both
// clocks (stampNow). Before a command came in since the start, the
// server's clock is unknown and none is forgotten: judged on the bridge's
// clock alone, one that ran 8 days ahead at its start forgot every id it
// ran before, and a repeat the server sent after the restart ran again
// (docs/reliability.md, bug 353). Nothing is done without a command, so
// the spool grows no larger meanwhile.
func (a *Agent) purgeSpool() (int, error) {
	var cutoff time.Time // before every record: none is old
	if _, ok := a.server.least(); ok {
		cutoff = a.ttlNow().Add(-DoneRetention)
	}
	return a.spool.purge(cutoff)
}

// nextSeq returns a status sequence number: the clock in nanoseconds, so it
// rises across restarts without storage, and strictly increasing. The
// clock is the later of the bridge's and the least the server's reads
// (stampNow): a bridge at 1970 until NTP synced made seqs below those it
// made before its restart, and the server refused its reports until the
// sync (docs/reliability.md, bug 333).
func (a *Agent) nextSeq() uint64 {
	a.seqMu.Lock()
	defer a.seqMu.Unlock()
	s := uint64(max(a.stampNow().UnixNano(), 0))
	if s <= a.lastSeq {
		s = a.lastSeq + 1
	}
	a.lastSeq = s
	return s
}
