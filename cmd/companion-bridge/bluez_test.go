//go:build linux

package main

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
	"github.com/devicecompanion/companion/topics"
)

// --bluez-adapter chooses the adapter of --gatt bluez: on a gateway with
// two (a built-in one and a USB one for range), the bridge used hci0,
// with no way to choose the other (docs/reliability.md, bug 389). One that
// is not there is waited for, with a warning naming those there are
// (bug 434: the bridge exited before, restarted every 2 s).
func TestBluezAdapterFlag(t *testing.T) {
	fake := fakebluez.New(t)
	fake.Replug("/org/bluez/hci1") // BlueZ has hci1 only
	for _, tc := range []struct {
		adapter  string
		wantWarn string
	}{
		{adapter: "hci1"},
		{adapter: fakebluez.AdapterAddr},
		{adapter: "hci0", wantWarn: `no adapter \"hci0\"; BlueZ has hci1`},
	} {
		t.Run(tc.adapter, func(t *testing.T) {
			m := NewMain()
			m.Stderr = io.Discard
			if err := m.ParseFlags([]string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--bluez-adapter", tc.adapter}); err != nil {
				t.Fatalf("ParseFlags: %v", err)
			}
			logs := &strings.Builder{}
			_, _, err := m.connector(slog.New(slog.NewTextHandler(logs, nil)))
			m.Close()
			if err != nil {
				t.Fatalf("connector with --bluez-adapter %s: %v", tc.adapter, err)
			}
			if w := strings.Contains(logs.String(), "level=WARN"); w != (tc.wantWarn != "") || !strings.Contains(logs.String(), tc.wantWarn) {
				t.Errorf("connector with --bluez-adapter %s logged (want a warning naming %q: %v):\n%s", tc.adapter, tc.wantWarn, tc.wantWarn != "", logs)
			}
		})
	}
}

// A bridge started before bluetoothd (at boot) stays up: it connects to
// the broker and publishes, its devices offline until BlueZ comes. Before,
// it exited with status 1, and systemd started it again every 2 s for as
// long as bluetoothd was away (docs/reliability.md, bug 434).
func TestBridgeStartsBeforeBluetoothd(t *testing.T) {
	fake := fakebluez.New(t)
	fake.Exit()
	url := startBroker(t)
	published := make(chan struct{})
	var once sync.Once
	watcher := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("watcher").
		SetDefaultPublishHandler(func(mqtt.Client, mqtt.Message) { once.Do(func() { close(published) }) }))
	if err := mqtt.WaitTokenTimeout(watcher.Connect(), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	defer watcher.Disconnect(100)
	if err := mqtt.WaitTokenTimeout(watcher.Subscribe(topics.DefaultPrefix+"/#", 1, nil), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	m := NewMain()
	m.Stderr = io.Discard
	if err := m.ParseFlags([]string{"--mqtt-url", url, "--bridge-id", "b1", "--bridge-secret", "s", "--data", t.TempDir(),
		"--gatt", "bluez", "--devices", "dev-1"}); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	select {
	case err := <-done:
		t.Fatalf("Run without bluetoothd = %v; want the bridge to stay up and wait for it", err)
	case <-published:
	case <-time.After(15 * time.Second):
		t.Fatal("the bridge published nothing within 15 s")
	}
	fake.Start()
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v after its context ended", err)
	}
}

// A system bus that dies or restarts under the bridge ends its BlueZ
// connection for good: the bridge exits with an error that says so, and
// systemd (Restart=on-failure) starts it on a new connection. Before, it
// ran on with every device offline, each Connect failing on the closed
// connection, until someone restarted it (docs/reliability.md, bug 391).
func TestBridgeExitsWhenTheSystemBusIsLost(t *testing.T) {
	fake := fakebluez.New(t)
	url := startBroker(t)
	next := watch(t, url, topics.MustNew(topics.DefaultPrefix))
	m := NewMain()
	m.Stderr = io.Discard
	if err := m.ParseFlags([]string{"--mqtt-url", url, "--bridge-id", "b1", "--bridge-secret", "s", "--data", t.TempDir(),
		"--gatt", "bluez", "--devices", "dev-1"}); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	next("the bridge's first message", func(mqtt.Message) bool { return true })

	fake.KillBus()
	err := <-done
	if ctx.Err() != nil || err == nil || !strings.Contains(err.Error(), "D-Bus") {
		t.Fatalf("Run = %v (after its context ended: %v); want it to end with an error about the lost D-Bus connection", err, ctx.Err() != nil)
	}
}
