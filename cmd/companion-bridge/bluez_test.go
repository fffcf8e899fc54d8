//go:build linux

package main

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/devicecompanion/companion/gatt/bluez/fakebluez"
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
