package agent_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/mcuboot"
	"github.com/devicecompanion/companion/sim"
	"github.com/devicecompanion/companion/topics"
)

// waitLong bounds every wait of these tests; nothing should take near it.
const waitLong = 15 * time.Second

var tree = topics.MustNew(topics.DefaultPrefix)

func testLogger(tb testing.TB) *slog.Logger {
	if os.Getenv("AGENT_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// testBroker is an embedded mochi MQTT broker on a free port that lets
// everyone in.
type testBroker struct {
	srv  *mochi.Server
	url  string
	hook *allowHook
	pubs *publishCounter
}

func startBroker(tb testing.TB) *testBroker {
	tb.Helper()
	hook, pubs := new(allowHook), newPublishCounter()
	srv, url := mochitest.Start(tb, hook, pubs)
	return &testBroker{srv: srv, url: url, hook: hook, pubs: pubs}
}

// publishCounter counts the PUBLISHes the broker takes, by topic and
// payload, leaving out those a client sent again (DUP). A message a client
// publishes as it connects can reach subscribers twice: paho, resuming a
// session, also sends what was published while it read its store, with
// DUP set, and QoS 1 allows it. (The bridge's state messages go again
// unretained, see pahostore.Store.ResentUnretained; a count here does not depend
// on it.)
type publishCounter struct {
	mochi.HookBase
	mu     sync.Mutex
	n      map[string]int
	notify chan struct{} // closed and replaced on every count
}

func newPublishCounter() *publishCounter {
	return &publishCounter{n: map[string]int{}, notify: make(chan struct{})}
}

func (c *publishCounter) ID() string { return "publish-counter" }

func (c *publishCounter) Provides(b byte) bool { return b == mochi.OnPublish }

func (c *publishCounter) OnPublish(_ *mochi.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.FixedHeader.Dup {
		return pk, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[pk.TopicName+"\x00"+string(pk.Payload)]++
	close(c.notify)
	c.notify = make(chan struct{})
	return pk, nil
}

// count is how many times topic was published with payload.
func (c *publishCounter) count(topic, payload string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[topic+"\x00"+payload]
}

// waitBridgeState waits until the bridge has published state n times
// (counting from 1, repeats sent with DUP left out).
func (b *testBroker) waitBridgeState(tb testing.TB, bridgeID, state string, n int) {
	tb.Helper()
	topic, _ := tree.BridgeState(bridgeID)
	deadline := time.NewTimer(waitLong)
	defer deadline.Stop()
	for {
		b.pubs.mu.Lock()
		got, ch := b.pubs.n[topic+"\x00"+state], b.pubs.notify
		b.pubs.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			tb.Fatalf("bridge %s published %s %d times; waited for %d", bridgeID, state, got, n)
		}
	}
}

// allowHook lets every client in and allows everything, like mochi's
// auth.AllowHook (whose package needs a module this one does not require).
// Setting refuse turns every new connection away, refusing its login;
// setting away closes each without an answer, as a broker out of reach
// is to the bridge (the login not refused).
type allowHook struct {
	mochi.HookBase
	refuse, away atomic.Bool
}

func (h *allowHook) ID() string { return "allow-all" }

func (h *allowHook) Provides(b byte) bool {
	return b == mochi.OnConnect || b == mochi.OnConnectAuthenticate || b == mochi.OnACLCheck
}

func (h *allowHook) OnConnect(*mochi.Client, packets.Packet) error {
	if h.away.Load() {
		return errors.New("test: the broker is out of reach")
	}
	return nil
}

func (h *allowHook) OnConnectAuthenticate(*mochi.Client, packets.Packet) bool {
	return !h.refuse.Load()
}

func (h *allowHook) OnACLCheck(*mochi.Client, string, bool) bool { return true }

// dropClient ends a client's connection abruptly, as a crash or a network
// failure would: the broker then publishes the client's Will.
func (b *testBroker) dropClient(tb testing.TB, clientID string) {
	tb.Helper()
	cl, ok := b.srv.Clients.Get(clientID)
	if !ok {
		tb.Fatalf("broker has no client %q", clientID)
	}
	// Closing the socket makes mochi's read loop fail, as a real network
	// failure would; cl.Stop instead may end the loop cleanly, without
	// the Will.
	cl.Net.Conn.Close()
}

// message is one message the watcher saw.
type message struct {
	topic    string
	payload  []byte
	retained bool
}

// watcher plays the server: a real paho client that publishes commands and
// collects everything under the prefix.
type watcher struct {
	tb     testing.TB
	client mqtt.Client

	mu     sync.Mutex
	msgs   []message
	notify chan struct{} // closed and replaced on every message
}

func newWatcher(tb testing.TB, b *testBroker) *watcher {
	tb.Helper()
	w := &watcher{tb: tb, notify: make(chan struct{})}
	// One subscription, made on every connect. (Subscribing again after
	// Connect as well raced the handler, which paho runs on a goroutine of
	// its own: a SUBSCRIBE that arrived after the bridge's first status
	// replaced the subscription, and the broker sent the retained status
	// again, as MQTT 3.1.1 says it must.)
	subscribed := make(chan error, 1)
	opts := mqtt.NewClientOptions().AddBroker(b.url).
		SetClientID("watcher-" + uuid.NewString()).
		SetCleanSession(true).
		SetDefaultPublishHandler(w.onMessage).
		SetOnConnectHandler(func(c mqtt.Client) {
			err := mqtt.WaitTokenTimeout(c.Subscribe(tree.Prefix()+"/#", 1, nil), waitLong)
			select {
			case subscribed <- err:
			default:
			}
		})
	w.client = mqtt.NewClient(opts)
	if err := mqtt.WaitTokenTimeout(w.client.Connect(), waitLong); err != nil {
		tb.Fatal(err)
	}
	if err := <-subscribed; err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { w.client.Disconnect(100) })
	return w
}

func (w *watcher) onMessage(_ mqtt.Client, m mqtt.Message) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, message{topic: m.Topic(), payload: append([]byte(nil), m.Payload()...), retained: m.Retained()})
	close(w.notify)
	w.notify = make(chan struct{})
}

// waitFor waits until some message seen so far satisfies match, and returns
// the first such.
func (w *watcher) waitFor(what string, match func(message) bool) message {
	w.tb.Helper()
	deadline := time.NewTimer(waitLong)
	defer deadline.Stop()
	for {
		w.mu.Lock()
		msgs, ch := w.msgs, w.notify
		w.mu.Unlock()
		for _, m := range msgs {
			if match(m) {
				return m
			}
		}
		select {
		case <-ch:
		case <-deadline.C:
			w.tb.Fatalf("timed out waiting for %s", what)
		}
	}
}

// replies returns every reply seen so far for a command, in order.
func (w *watcher) replies(deviceID, cmdID string) []topics.Reply {
	topic, _ := tree.Replies(deviceID)
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []topics.Reply
	for _, m := range w.msgs {
		if m.topic != topic {
			continue
		}
		r, err := topics.ParseReply(m.payload)
		if err != nil {
			w.tb.Errorf("bad reply %s: %v", m.payload, err)
			continue
		}
		if r.CommandID == cmdID {
			out = append(out, r)
		}
	}
	return out
}

// waitReply waits for a reply of the command in the given state.
func (w *watcher) waitReply(deviceID, cmdID, state string) topics.Reply {
	w.tb.Helper()
	topic, _ := tree.Replies(deviceID)
	m := w.waitFor(fmt.Sprintf("%s reply of %s", state, cmdID), func(m message) bool {
		if m.topic != topic {
			return false
		}
		r, err := topics.ParseReply(m.payload)
		return err == nil && r.CommandID == cmdID && r.State == state
	})
	r, _ := topics.ParseReply(m.payload)
	return r
}

// waitFinal waits for the command's final reply and returns it.
func (w *watcher) waitFinal(deviceID, cmdID string) topics.Reply {
	w.tb.Helper()
	topic, _ := tree.Replies(deviceID)
	m := w.waitFor("final reply of "+cmdID, func(m message) bool {
		if m.topic != topic {
			return false
		}
		r, err := topics.ParseReply(m.payload)
		return err == nil && r.CommandID == cmdID && companion.IsFinal(r.State)
	})
	r, _ := topics.ParseReply(m.payload)
	return r
}

// waitStatus waits for a status of the device that satisfies match.
func (w *watcher) waitStatus(deviceID, what string, match func(topics.Status) bool) topics.Status {
	w.tb.Helper()
	topic, _ := tree.Status(deviceID)
	m := w.waitFor("status: "+what, func(m message) bool {
		if m.topic != topic {
			return false
		}
		s, err := topics.ParseStatus(m.payload)
		return err == nil && match(s)
	})
	s, _ := topics.ParseStatus(m.payload)
	return s
}

// waitBridgeState waits for the n-th message (counting from 1) on the
// bridge's state topic with this payload. A bridge's "online" may come
// twice (see publishCounter): count those with testBroker.waitBridgeState.
func (w *watcher) waitBridgeState(bridgeID, state string, n int) {
	w.tb.Helper()
	w.waitFor(fmt.Sprintf("bridge %s %s #%d", bridgeID, state, n), func(message) bool {
		return w.count(isState(bridgeID, state)) >= n
	})
}

func (w *watcher) count(match func(message) bool) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, m := range w.msgs {
		if match(m) {
			n++
		}
	}
	return n
}

// send publishes a command as the server would and waits for the PUBACK.
func (w *watcher) send(c topics.Command) {
	w.tb.Helper()
	topic, err := tree.Command(c.DeviceID, c.Op)
	if err != nil {
		w.tb.Fatal(err)
	}
	b, err := json.Marshal(c)
	if err != nil {
		w.tb.Fatal(err)
	}
	if err := mqtt.WaitTokenTimeout(w.client.Publish(topic, 1, false, b), waitLong); err != nil {
		w.tb.Fatal(err)
	}
}

// command builds a command that expires in an hour.
func command(tb testing.TB, deviceID, op string, payload any) topics.Command {
	tb.Helper()
	id, err := uuid.NewV7()
	if err != nil {
		tb.Fatal(err)
	}
	b, err := json.Marshal(payload)
	if err != nil {
		tb.Fatal(err)
	}
	now := time.Now().UTC()
	return topics.Command{ID: id.String(), Op: op, DeviceID: deviceID, CreatedAt: now, ExpiresAt: now.Add(time.Hour), Payload: b}
}

const testSecret = "s3cret-of-the-bridge"

// blobServer serves blobs at /api/v1/blobs/{sha} as the server does, with
// Range support, and can cut a response short to prove that the bridge
// resumes.
type blobServer struct {
	srv *httptest.Server

	mu       sync.Mutex
	blobs    map[string][]byte
	cut      map[string]int // sha → bytes to send before breaking the next response
	requests []*http.Request
}

func startBlobServer(tb testing.TB) *blobServer {
	tb.Helper()
	bs := &blobServer{blobs: map[string][]byte{}, cut: map[string]int{}}
	bs.srv = httptest.NewServer(http.HandlerFunc(bs.serve))
	tb.Cleanup(bs.srv.Close)
	return bs
}

// add stores data and returns its reference, with a relative URL.
func (bs *blobServer) add(data []byte) topics.Blob {
	sum := sha256.Sum256(data)
	sha := hex.EncodeToString(sum[:])
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.blobs[sha] = data
	return topics.Blob{SHA256: sha, Size: int64(len(data)), URL: "/api/v1/blobs/" + sha}
}

func (bs *blobServer) cutNext(sha string, after int) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	bs.cut[sha] = after
}

func (bs *blobServer) seen() []*http.Request {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return append([]*http.Request(nil), bs.requests...)
}

type cutWriter struct {
	http.ResponseWriter
	left int
}

func (c *cutWriter) Write(b []byte) (int, error) {
	if len(b) > c.left {
		n, _ := c.ResponseWriter.Write(b[:c.left])
		c.left -= n
		c.ResponseWriter.(http.Flusher).Flush()
		return n, errors.New("cut")
	}
	n, err := c.ResponseWriter.Write(b)
	c.left -= n
	return n, err
}

func (bs *blobServer) serve(w http.ResponseWriter, r *http.Request) {
	bs.mu.Lock()
	bs.requests = append(bs.requests, r.Clone(context.Background()))
	sha, _ := strings.CutPrefix(r.URL.Path, "/api/v1/blobs/")
	data, ok := bs.blobs[sha]
	cut, cutting := bs.cut[sha]
	delete(bs.cut, sha)
	bs.mu.Unlock()
	if r.Header.Get("Authorization") != "Bearer "+testSecret {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	if !ok {
		http.NotFound(w, r)
		return
	}
	if cutting {
		http.ServeContent(&cutWriter{ResponseWriter: w, left: cut}, r, "", time.Time{}, strings.NewReader(string(data)))
		panic(http.ErrAbortHandler) // break the connection mid-body
	}
	http.ServeContent(w, r, "", time.Time{}, strings.NewReader(string(data)))
}

// bridge is an agent under test with its sim devices.
type bridge struct {
	*agent.Agent
	id      string
	dataDir string
	done    chan error
}

type bridgeConfig struct {
	id       string
	dataDir  string
	devices  []*sim.Device
	timeout  time.Duration
	interval time.Duration
	now      func() time.Time
	// afterWait is agent.Options.AfterWait.
	afterWait time.Duration
	// wrap, when set, stands between the bridge and each device.
	wrap func(*sim.Device) agent.Device
	// logger, when set, is the bridge's logger instead of testLogger's.
	logger *slog.Logger
	// subscribeTimeout, when set, is how long the bridge awaits a SUBACK
	// (agent.SetSubscribeTiming, its rounds 20 to 200 ms apart).
	subscribeTimeout time.Duration
}

// startBridge runs an agent against the broker and the blob server and
// waits for it to say it is online.
func startBridge(tb testing.TB, b *testBroker, bs *blobServer, w *watcher, cfg bridgeConfig) *bridge {
	tb.Helper()
	if cfg.id == "" {
		cfg.id = "b1"
	}
	if cfg.dataDir == "" {
		cfg.dataDir = tb.TempDir()
	}
	devs := make([]agent.Device, len(cfg.devices))
	for i, d := range cfg.devices {
		devs[i] = d
		if cfg.wrap != nil {
			devs[i] = cfg.wrap(d)
		}
	}
	opts := agent.Options{
		MQTTURL:        b.url,
		Password:       testSecret,
		BridgeID:       cfg.id,
		DataDir:        cfg.dataDir,
		Devices:        devs,
		Logger:         testLogger(tb),
		Now:            cfg.now,
		CommandTimeout: cfg.timeout,
		StatusInterval: cfg.interval,
		AfterWait:      cfg.afterWait,
	}
	if cfg.logger != nil {
		opts.Logger = cfg.logger
	}
	if bs != nil {
		opts.APIURL = bs.srv.URL
	}
	a, err := agent.New(opts)
	if err != nil {
		tb.Fatal(err)
	}
	if cfg.subscribeTimeout > 0 {
		a.SetSubscribeTiming(cfg.subscribeTimeout, 20*time.Millisecond, 200*time.Millisecond)
	}
	br := &bridge{Agent: a, id: cfg.id, dataDir: cfg.dataDir, done: make(chan error, 1)}
	stateTopic, _ := tree.BridgeState(cfg.id)
	onlineBefore := b.pubs.count(stateTopic, topics.BridgeOnline)
	go func() { br.done <- a.Run(context.Background()) }()
	tb.Cleanup(func() { br.stop(tb) })
	b.waitBridgeState(tb, cfg.id, topics.BridgeOnline, onlineBefore+1)
	return br
}

func isState(bridgeID, state string) func(message) bool {
	topic, _ := tree.BridgeState(bridgeID)
	return func(m message) bool { return m.topic == topic && string(m.payload) == state }
}

// stop closes the agent and waits for Run to return; it may be called twice.
func (br *bridge) stop(tb testing.TB) {
	tb.Helper()
	if err := br.Close(); err != nil {
		tb.Errorf("Close: %v", err)
	}
	select {
	case err, ok := <-br.done:
		if ok && err != nil {
			tb.Errorf("Run: %v", err)
		}
		if ok {
			close(br.done)
		}
	case <-time.After(waitLong):
		tb.Fatal("Run did not return after Close")
	}
}

func newSim(id string) *sim.Device {
	return sim.New(sim.Options{ID: id})
}

// firmwareImage makes payload an MCUboot image of version, as a firmware
// engineer's build signs it.
func firmwareImage(tb testing.TB, version string, payload []byte) []byte {
	tb.Helper()
	v, err := mcuboot.ParseVersion(version)
	if err != nil {
		tb.Fatal(err)
	}
	return mcuboot.MustBuild(payload, mcuboot.Options{Version: v, HeaderSize: 0x200})
}
