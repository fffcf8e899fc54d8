//go:build linux

package main

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
	"github.com/devicecompanion/companion/topics"
)

// --bluez-adapter chooses the adapter of --gatt bluez: on a gateway with
// two (a built-in one and a USB one for range), the bridge used hci0,
// with no way to choose the other (docs/reliability.md, bug 411).
func TestBluezAdapterFlag(t *testing.T) {
	fake := fakebluez.New(t)
	fake.Replug("/org/bluez/hci1") // BlueZ has hci1 only
	for _, tc := range []struct {
		adapter string
		wantErr string
	}{
		{adapter: "hci1"},
		{adapter: fakebluez.AdapterAddr},
		{adapter: "hci0", wantErr: `no adapter "hci0"`},
	} {
		t.Run(tc.adapter, func(t *testing.T) {
			m := NewMain()
			m.Stderr = io.Discard
			if err := m.ParseFlags([]string{"--bridge-id", "b1", "--bridge-secret", "s", "--gatt", "bluez", "--devices", "d1", "--bluez-adapter", tc.adapter}); err != nil {
				t.Fatalf("ParseFlags: %v", err)
			}
			_, _, err := m.connector(slog.New(slog.DiscardHandler))
			m.Close()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("connector with --bluez-adapter %s: %v", tc.adapter, err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("connector with --bluez-adapter %s = %v; want an error naming %s", tc.adapter, err, tc.wantErr)
			}
		})
	}
}

// A system bus that dies or restarts under the bridge ends its BlueZ
// connection for good: the bridge exits with an error that says so, and
// systemd (Restart=on-failure) starts it on a new connection. Before, it
// ran on with every device offline, each Connect failing on the closed
// connection, until someone restarted it (docs/reliability.md, bug 413).
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
