package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/google/uuid"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/internal/mochitest"
	"github.com/devicecompanion/companion/topics"
)

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string // substring; "" for success
		check   func(t *testing.T, c Config)
	}{
		{
			name: "flags",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "dev-1, dev-2", "--log-level", "debug"},
			check: func(t *testing.T, c Config) {
				if c.BridgeID != "b1" || len(c.SimDevices) != 2 || c.SimDevices[1] != "dev-2" || c.LogLevel != slog.LevelDebug {
					t.Errorf("config %+v", c)
				}
				if c.MQTTURL != "tcp://127.0.0.1:1883" || c.APIURL != "http://127.0.0.1:8080" || c.Data != "./bridge-data" ||
					c.SimModel != "sim-1" || c.SimFirmware != "1.0.0" || c.TopicPrefix != "companion/v1" {
					t.Errorf("defaults %+v", c)
				}
			},
		},
		{
			name: "environment, flags win",
			args: []string{"--bridge-id", "from-flag"},
			env: map[string]string{
				"COMPANION_BRIDGE_ID": "from-env", "COMPANION_BRIDGE_SECRET": "env-secret",
				"COMPANION_SIM_DEVICES": "a,b,c", "COMPANION_MQTT_URL": "tcp://broker:1883", "COMPANION_TOPIC_PREFIX": "acme/v1",
			},
			check: func(t *testing.T, c Config) {
				if c.BridgeID != "from-flag" || c.BridgeSecret != "env-secret" || len(c.SimDevices) != 3 ||
					c.MQTTURL != "tcp://broker:1883" || c.TopicPrefix != "acme/v1" {
					t.Errorf("config %+v", c)
				}
			},
		},
		{name: "no secret", args: []string{"--bridge-id", "b1", "--sim-devices", "d"}, wantErr: "--bridge-secret"},
		{name: "no bridge id", args: []string{"--bridge-secret", "s", "--sim-devices", "d"}, wantErr: "--bridge-id"},
		{name: "bad bridge id", args: []string{"--bridge-id", "b/1", "--bridge-secret", "s", "--sim-devices", "d"}, wantErr: "--bridge-id"},
		{name: "bad device id", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "ok,bad#id"}, wantErr: "bad#id"},
		{name: "credentials in the broker URL", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d", "--mqtt-url", "tcp://b1:pw@127.0.0.1:1883"}, wantErr: "--mqtt-url"},
		{name: "broker URL without a port", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d", "--mqtt-url", "broker"}, wantErr: "needs a host and a port"},
		{name: "no devices", args: []string{"--bridge-id", "b1", "--bridge-secret", "s"}, wantErr: "no devices"},
		{name: "gatt needs devices", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez"}, wantErr: "needs --devices"},
		{name: "gatt and sim", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--sim-devices", "d2"}, wantErr: "--sim-devices"},
		{name: "sim mtu too small", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--sim-mtu", "10"}, wantErr: "mtu"},
		{name: "gatt unknown", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "winrt"}, wantErr: "only backend is bluez"},
		{name: "bad log level", args: []string{"--log-level", "loud"}, wantErr: "loud"},
		// An empty --data (COMPANION_DATA= in an env file) ended the
		// bridge once it ran, exit status 1, with "agent: no data
		// directory", naming no flag.
		{name: "data directory empty", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--data", ""}, wantErr: "--data is empty"},
		// An --api-url blob downloads could never use is refused at start,
		// naming the flag: without a scheme agent.New refused it only
		// once the bridge ran (exit status 1, "agent: invalid API URL"),
		// and one of another scheme was taken, to fail each download.
		{name: "API URL without a scheme", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "127.0.0.1:8080"}, wantErr: "--api-url"},
		{name: "API URL of another scheme", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "ftp://127.0.0.1:8080"}, wantErr: "--api-url"},
		{name: "API URL without a host", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1"}, env: map[string]string{"COMPANION_API_URL": "http:///api"}, wantErr: "--api-url"},
		{
			name: "API URL of https",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "https://companion.example.com"},
			check: func(t *testing.T, c Config) {
				if c.APIURL != "https://companion.example.com" {
					t.Errorf("APIURL = %q", c.APIURL)
				}
			},
		},
		{
			name: "API URLs of replicas",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "http://10.0.0.1:8080,http://10.0.0.2:8080"},
			check: func(t *testing.T, c Config) {
				if c.APIURL != "http://10.0.0.1:8080,http://10.0.0.2:8080" {
					t.Errorf("APIURL = %q", c.APIURL)
				}
			},
		},
		{name: "API URL of the API's root", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "http://127.0.0.1:8080/api/v1/"}, wantErr: "without /api/v1"},
		{
			name: "API URL behind a proxy's prefix",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "https://gw.example/companion"},
			check: func(t *testing.T, c Config) {
				if c.APIURL != "https://gw.example/companion" {
					t.Errorf("APIURL = %q", c.APIURL)
				}
			},
		},
		// Before, the later listener failed "address already in use",
		// exit status 1, as if another process held the port.
		{name: "metrics and pprof on one port", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--metrics", "127.0.0.1:9465", "--pprof", "localhost:9465"}, wantErr: "--pprof"},
		{name: "API URLs, one of another scheme", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--api-url", "http://10.0.0.1:8080,ftp://10.0.0.2"}, wantErr: "--api-url"},
		// A listen address net.Listen could never take is a usage error
		// naming the flag, not a listen error once the bridge runs.
		{name: "metrics address without a port", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--metrics", "127.0.0.1"}, wantErr: "--metrics"},
		{name: "pprof port out of range", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1"}, env: map[string]string{"COMPANION_PPROF": "127.0.0.1:99999"}, wantErr: "--pprof"},
		{
			name: "command timeout",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--command-timeout", "45m"},
			check: func(t *testing.T, c Config) {
				if c.CommandTimeout != 45*time.Minute {
					t.Errorf("CommandTimeout = %s", c.CommandTimeout)
				}
			},
		},
		{
			name: "command timeout by default",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1"},
			check: func(t *testing.T, c Config) {
				if c.CommandTimeout != agent.DefaultCommandTimeout {
					t.Errorf("CommandTimeout = %s", c.CommandTimeout)
				}
			},
		},
		{
			name: "blob cache by default and set",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1"},
			env:  map[string]string{"COMPANION_BLOB_CACHE_MB": "64"},
			check: func(t *testing.T, c Config) {
				if c.BlobCacheMB != 64 || blobCacheMax(c.BlobCacheMB) != 64<<20 || blobCacheMax(0) >= 0 || NewMain().Config.BlobCacheMB<<20 != agent.DefaultBlobCacheMax {
					t.Errorf("BlobCacheMB = %d (%d bytes); default %d MiB", c.BlobCacheMB, blobCacheMax(c.BlobCacheMB), NewMain().Config.BlobCacheMB)
				}
			},
		},
		{name: "blob cache negative", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--blob-cache-mb", "-1"}, wantErr: "--blob-cache-mb"},
		{name: "command timeout zero", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--command-timeout", "0s"}, wantErr: "--command-timeout"},
		{
			name: "bluez adapter",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--bluez-adapter", "hci1"},
			check: func(t *testing.T, c Config) {
				if c.BluezAdapter != "hci1" {
					t.Errorf("BluezAdapter = %q; want hci1", c.BluezAdapter)
				}
			},
		},
		{
			name: "bluez adapter in the environment",
			args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1"},
			env:  map[string]string{"COMPANION_BLUEZ_ADAPTER": "00:1A:7D:DA:71:01"},
			check: func(t *testing.T, c Config) {
				if c.BluezAdapter != "00:1A:7D:DA:71:01" {
					t.Errorf("BluezAdapter = %q; want the address", c.BluezAdapter)
				}
			},
		},
		{name: "bluez adapter without bluez", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--sim-devices", "d1", "--bluez-adapter", "hci1"}, wantErr: "--bluez-adapter needs --gatt bluez"},
		// The simulator's flags would do nothing to real devices.
		{name: "gatt and a sim flag", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--sim-mtu", "100"}, wantErr: "--sim-mtu"},
		{name: "gatt and sim state", args: []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--sim-state", "/tmp/x"}, wantErr: "--sim-state"},
		{
			name:    "gatt and a sim flag in the environment",
			args:    []string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1"},
			env:     map[string]string{"COMPANION_SIM_KBPS": "100"},
			wantErr: "--sim-kbps",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			m := NewMain()
			m.Stderr = io.Discard
			err := m.ParseFlags(tt.args)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("ParseFlags(%q) = %v; want nil", tt.args, err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("ParseFlags(%q) = %v; want an error about %q", tt.args, err, tt.wantErr)
			}
			if tt.check != nil {
				tt.check(t, m.Config)
			}
		})
	}
}

func startBroker(tb testing.TB) string {
	tb.Helper()
	_, url := mochitest.Start(tb)
	return url
}

// watch subscribes a real MQTT client, playing the server, to every topic
// of the tree and returns a function that waits (15 s at most) for a
// message match accepts.
func watch(t *testing.T, url string, tree topics.Tree) func(what string, match func(mqtt.Message) bool) mqtt.Message {
	t.Helper()
	got := make(chan mqtt.Message, 100)
	watcher := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("watcher").
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) { got <- m }))
	if err := mqtt.WaitTokenTimeout(watcher.Connect(), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { watcher.Disconnect(100) })
	if err := mqtt.WaitTokenTimeout(watcher.Subscribe(tree.Prefix()+"/#", 1, nil), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return func(what string, match func(mqtt.Message) bool) mqtt.Message {
		t.Helper()
		timeout := time.After(15 * time.Second)
		for {
			select {
			case m := <-got:
				if match(m) {
					return m
				}
			case <-timeout:
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
}

// runMain runs the bridge program with args as main does, until stop.
func runMain(t *testing.T, args ...string) (m *Main, stop func()) {
	t.Helper()
	m = NewMain()
	m.Stderr = io.Discard
	if err := m.ParseFlags(args); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := m.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return m, func() {
		cancel()
		wg.Wait()
		if err := m.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
}

// pushText publishes a text push for dev-1 as the server does and returns
// its command id.
func pushText(t *testing.T, url string, tree topics.Tree, text string) string {
	t.Helper()
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("server"))
	if err := mqtt.WaitTokenTimeout(c.Connect(), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	defer c.Disconnect(100)
	payload, _ := json.Marshal(topics.PushText{Text: text})
	cmd := topics.Command{ID: uuid.Must(uuid.NewV7()).String(), Op: topics.OpPushText, DeviceID: "dev-1",
		CreatedAt: time.Now(), ExpiresAt: time.Now().Add(time.Hour), Payload: payload}
	b, _ := json.Marshal(cmd)
	cmdTopic, _ := tree.Command("dev-1", topics.OpPushText)
	if err := mqtt.WaitTokenTimeout(c.Publish(cmdTopic, 1, false, b), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return cmd.ID
}

// TestMainEndToEnd runs the bridge program as main does, against a real
// broker, and plays the server with a real MQTT client.
func TestMainEndToEnd(t *testing.T) {
	url := startBroker(t)
	tree := topics.MustNew(topics.DefaultPrefix)
	await := watch(t, url, tree)
	m, stop := runMain(t, "--mqtt-url", url, "--bridge-id", "b1", "--bridge-secret", "s", "--data", t.TempDir(), "--sim-devices", "dev-1")

	stateTopic, _ := tree.BridgeState("b1")
	statusTopic, _ := tree.Status("dev-1")
	await("online", func(m mqtt.Message) bool { return m.Topic() == stateTopic && string(m.Payload()) == "online" })
	await("status", func(m mqtt.Message) bool {
		s, err := topics.ParseStatus(m.Payload())
		return m.Topic() == statusTopic && err == nil && s.Online && s.FirmwareVersion == "1.0.0"
	})

	id := pushText(t, url, tree, "hello")
	repliesTopic, _ := tree.Replies("dev-1")
	await("succeeded", func(m mqtt.Message) bool {
		r, err := topics.ParseReply(m.Payload())
		return m.Topic() == repliesTopic && err == nil && r.CommandID == id && r.State == companion.StateSucceeded
	})
	if texts := m.Sims()[0].Texts(); len(texts) != 1 || texts[0].Text != "hello" {
		t.Errorf("texts %+v", texts)
	}

	stop()
	await("offline", func(m mqtt.Message) bool { return m.Topic() == stateTopic && string(m.Payload()) == "offline" })
}

// --command-timeout reaches the commands: a push that cannot cross the
// simulated link (a round trip of 15 ms) within 1 ms fails with the code
// timeout.
func TestCommandTimeoutFlag(t *testing.T) {
	url := startBroker(t)
	tree := topics.MustNew(topics.DefaultPrefix)
	await := watch(t, url, tree)
	_, stop := runMain(t, "--mqtt-url", url, "--bridge-id", "b1", "--bridge-secret", "s", "--data", t.TempDir(),
		"--sim-devices", "dev-1", "--command-timeout", "1ms")
	defer stop()
	stateTopic, _ := tree.BridgeState("b1")
	await("online", func(m mqtt.Message) bool { return m.Topic() == stateTopic && string(m.Payload()) == "online" })

	id := pushText(t, url, tree, "too slow")
	repliesTopic, _ := tree.Replies("dev-1")
	m := await("the final reply", func(m mqtt.Message) bool {
		r, err := topics.ParseReply(m.Payload())
		return m.Topic() == repliesTopic && err == nil && r.CommandID == id && companion.IsFinal(r.State)
	})
	r, _ := topics.ParseReply(m.Payload())
	if r.State != companion.StateFailed || r.Error == nil || r.Error.Code != "timeout" {
		t.Errorf("final reply %+v (error %+v); want failed with code timeout", r, r.Error)
	}
}

// -h starts with a synopsis, and shows each flag's default once and the
// log level's as companion serve does ("info"; slog's own text is "INFO").
func TestHelpShowsEachDefaultOnce(t *testing.T) {
	var help bytes.Buffer
	m := NewMain()
	m.Stderr = &help
	if err := m.ParseFlags([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("ParseFlags(-h) = %v", err)
	}
	out := help.String()
	if !strings.HasPrefix(out, "usage: companion-bridge --mqtt-url URL") || !strings.Contains(out, "\n\nflags:\n  -api-url URL\n") {
		t.Errorf("the help does not start with a synopsis and its flags, as companion serve's:\n%s", out)
	}
	if !strings.Contains(out, "-log-level string\n    \tdebug, info, warn or error (default \"info\")\n") {
		t.Errorf("the log level's help is not serve's:\n%s", out)
	}
	for _, entry := range strings.Split(out, "\n  -")[1:] {
		if n := strings.Count(entry, "(default"); n > 1 {
			t.Errorf("-%s says default %d times", strings.TrimSpace(entry), n)
		}
	}
	if !strings.Contains(out, "-sim-kbps rate\n    \trate of the simulated Bluetooth link in kbit/s each way") || !strings.Contains(out, "(default 1400)") {
		t.Errorf("-sim-kbps:\n%s", out)
	}
}
