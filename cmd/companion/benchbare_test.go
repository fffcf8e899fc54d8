package main

// The bare forwarder of BenchmarkCommandPath: what the command path is built
// on, with nothing of the project in between. A gin handler publishes each
// push at QoS 1 through paho to a mochi-mqtt broker in the same process and
// answers 202 on the PUBACK (or, with Prefer: wait, on the bridge's reply); a
// bare bridge subscribed to every command topic answers each with
// "succeeded". No auth, no store, no spool, no device. Both run as processes
// of their own, like the real server and bridge: the test binary runs
// itself with benchRoleEnv set.

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/gin-gonic/gin"
	"github.com/google/uuid"
	mochi "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"

	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/topics"
)

// benchRoleEnv names the role a re-executed test binary plays: bare-server
// or bare-bridge. BENCH_HTTP and BENCH_MQTT give its addresses.
const benchRoleEnv = "COMPANION_BENCH_ROLE"

// runBenchRole runs the role named in the environment until SIGTERM and
// reports whether there was one.
func runBenchRole() bool {
	role := os.Getenv(benchRoleEnv)
	if role == "" {
		return false
	}
	var err error
	switch role {
	case "bare-server":
		err = runBareServer(os.Getenv("BENCH_HTTP"), os.Getenv("BENCH_MQTT"))
	case "bare-bridge":
		err = runBareBridge(os.Getenv("BENCH_MQTT"), strings.Split(os.Getenv("BENCH_DEVICE_IDS"), ","))
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, role+":", err)
		os.Exit(1)
	}
	return true
}

func waitForSignal() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, os.Interrupt)
	<-ch
}

// bareClient connects a paho client whose every message goes to onMessage
// (paho's default handler: as the project's clients, it matches no routes
// per message).
func bareClient(url, id string, onMessage mqtt.MessageHandler, onConnect func(mqtt.Client)) (mqtt.Client, error) {
	c := mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(url).
		SetClientID(id).
		SetCleanSession(true).
		SetAutoReconnect(true).
		SetDefaultPublishHandler(onMessage).
		SetOnConnectHandler(onConnect))
	if err := mqtt.WaitTokenTimeout(c.Connect(), 10*time.Second); err != nil {
		return nil, err
	}
	return c, nil
}

func runBareServer(httpAddr, mqttAddr string) error {
	// Mochi's defaults drop QoS 1 messages once a client's write queue
	// holds 1024; the project's embedded broker raises both limits, and so
	// does the bare one, or it would lose commands under the accepting load.
	caps := mochi.NewDefaultServerCapabilities()
	caps.MaximumInflight = math.MaxUint16
	caps.MaximumClientWritesPending = math.MaxUint16
	broker := mochi.New(&mochi.Options{Capabilities: caps, Logger: slog.New(slog.DiscardHandler)})
	if err := broker.AddHook(new(mochitest.AllowAll), nil); err != nil {
		return err
	}
	if err := broker.AddListener(listeners.NewTCP(listeners.Config{ID: "tcp", Address: mqttAddr})); err != nil {
		return err
	}
	if err := broker.Serve(); err != nil {
		return err
	}
	defer mochitest.Close(broker)

	tree := topics.MustNew(topics.DefaultPrefix)
	var (
		mu      sync.Mutex
		waiters = map[string]chan struct{}{}
	)
	onReply := func(_ mqtt.Client, m mqtt.Message) {
		var r struct {
			CommandID string `json:"command_id"`
		}
		if json.Unmarshal(m.Payload(), &r) != nil {
			return
		}
		mu.Lock()
		if ch := waiters[r.CommandID]; ch != nil {
			close(ch)
			delete(waiters, r.CommandID)
		}
		mu.Unlock()
	}
	client, err := bareClient("tcp://"+mqttAddr, "bare-server", onReply, func(c mqtt.Client) {
		c.Subscribe(tree.AllReplies(), 1, nil)
	})
	if err != nil {
		return err
	}
	defer client.Disconnect(100)

	var durable *bareLog
	if dir := os.Getenv(bareLogDirEnv); dir != "" {
		if durable, err = openBareLog(dir); err != nil {
			return err
		}
		defer durable.close()
	}

	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	r.POST("/api/v1/devices/:id/push/text", func(c *gin.Context) {
		var req struct {
			Text string `json:"text"`
		}
		if err := c.ShouldBindJSON(&req); err != nil || req.Text == "" {
			c.JSON(400, gin.H{"error": "bad body"})
			return
		}
		dev := c.Param("id")
		topic, err := tree.Command(dev, topics.OpPushText)
		if err != nil {
			c.JSON(404, gin.H{"error": "bad device"})
			return
		}
		id := uuid.Must(uuid.NewV7()).String()
		now := time.Now().UTC()
		payload, _ := json.Marshal(topics.PushText{Text: req.Text})
		msg, _ := json.Marshal(topics.Command{ID: id, Op: topics.OpPushText, DeviceID: dev, CreatedAt: now, ExpiresAt: now.Add(24 * time.Hour), Payload: payload})
		wait := strings.HasPrefix(c.GetHeader("Prefer"), "wait=")
		done := make(chan struct{})
		if wait {
			mu.Lock()
			waiters[id] = done
			mu.Unlock()
		}
		if durable != nil {
			durable.append(msg)
		}
		if err := mqtt.WaitTokenTimeout(client.Publish(topic, 1, false, msg), 30*time.Second); err != nil {
			c.JSON(500, gin.H{"error": err.Error()})
			return
		}
		status, state := 202, "sent"
		if wait {
			select {
			case <-done:
				status, state = 200, "succeeded"
			case <-time.After(preferredWait(c.GetHeader("Prefer"))):
			}
		}
		c.JSON(status, gin.H{"id": id, "device_id": dev, "op": topics.OpPushText, "state": state})
	})
	r.GET("/readyz", func(c *gin.Context) { c.Status(200) })
	ln, err := net.Listen("tcp", httpAddr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: r, ErrorLog: nil}
	go srv.Serve(ln)
	waitForSignal()
	return srv.Close()
}

// bareLogDirEnv, set for a bare server, has it write each command to a log
// file in that directory and fdatasync it before it publishes: the least a
// server whose 202 means "on disk" must do (CONTRACT §7), one sequential
// append and one sync per group of the commands that queued up meanwhile,
// with no index, no state and no linger. BenchmarkCommandPath runs such a
// server as a third path, "durable" (BENCH_BARE_SYNC); issue 8's targets are
// measured against the plain one.
const bareLogDirEnv = "BENCH_BARE_LOG_DIR"

// bareLog is the bare server's durable log of commands (bareLogDirEnv).
type bareLog struct {
	f *os.File
	q chan bareLogEntry
}

type bareLogEntry struct {
	b    []byte
	done chan struct{}
}

// openBareLog makes the log in dir (the benchmark's temporary directory,
// removed with it: the bare server is killed, not stopped).
func openBareLog(dir string) (*bareLog, error) {
	f, err := os.CreateTemp(dir, "bare-log-*")
	if err != nil {
		return nil, err
	}
	l := &bareLog{f: f, q: make(chan bareLogEntry, 4096)}
	go l.syncLoop()
	return l, nil
}

// append returns once b is in the file and synced.
func (l *bareLog) append(b []byte) {
	e := bareLogEntry{b: b, done: make(chan struct{})}
	l.q <- e
	<-e.done
}

// syncLoop writes whatever queued up while the last sync ran, in one write
// and one fdatasync.
func (l *bareLog) syncLoop() {
	var buf []byte
	for e := range l.q {
		group := []bareLogEntry{e}
	more:
		for {
			select {
			case e := <-l.q:
				group = append(group, e)
			default:
				break more
			}
		}
		buf = buf[:0]
		for _, e := range group {
			buf = append(append(buf, e.b...), '\n')
		}
		_, err := l.f.Write(buf)
		if err == nil {
			err = syscall.Fdatasync(int(l.f.Fd()))
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bare-server: log:", err)
			os.Exit(1)
		}
		for _, e := range group {
			close(e.done)
		}
	}
}

func (l *bareLog) close() { l.f.Close() }

// preferredWait reads Prefer: "wait=N".
func preferredWait(prefer string) time.Duration {
	n, err := strconv.Atoi(strings.TrimPrefix(prefer, "wait="))
	if err != nil {
		return time.Minute
	}
	return time.Duration(n) * time.Second
}

// runBareBridge answers the commands of the devices it serves, each with
// a subscription of its own as the real bridge has.
func runBareBridge(mqttAddr string, devices []string) error {
	tree := topics.MustNew(topics.DefaultPrefix)
	onCommand := func(c mqtt.Client, m mqtt.Message) {
		var cmd topics.Command
		if json.Unmarshal(m.Payload(), &cmd) != nil {
			return
		}
		topic, err := tree.Replies(cmd.DeviceID)
		if err != nil {
			return
		}
		b, _ := json.Marshal(topics.Reply{CommandID: cmd.ID, State: companion.StateSucceeded, At: time.Now().UTC()})
		c.Publish(topic, 1, false, b)
	}
	filters := map[string]byte{}
	for _, d := range devices {
		f, err := tree.CommandsFilter(d)
		if err != nil {
			return err
		}
		filters[f] = 1
	}
	client, err := bareClient("tcp://"+mqttAddr, "bare-bridge", onCommand, func(c mqtt.Client) {
		c.SubscribeMultiple(filters, nil)
	})
	if err != nil {
		return err
	}
	waitForSignal()
	client.Disconnect(100)
	return nil
}

// discard drains and closes an HTTP answer's body so that its connection
// is reused.
func discard(r *http.Response) {
	io.Copy(io.Discard, r.Body)
	r.Body.Close()
}
