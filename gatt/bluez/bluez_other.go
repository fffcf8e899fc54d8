//go:build !linux

// Package bluez is the gatt.Connector for real Bluetooth adapters on Linux
// gateways (BlueZ over D-Bus). On other systems New returns an error.
package bluez

import (
	"context"
	"errors"
	"log/slog"

	"github.com/devicecompanion/companion/gatt"
)

// ErrClosed is returned by Connect once the Connector is closed.
var ErrClosed = errors.New("bluez: connector closed")

// ErrBusLost is returned by Connect once the connection to the system bus
// is lost; here, never.
var ErrBusLost = errors.New("bluez: the connection to the system D-Bus was lost (dbus restarted or died); restart the bridge")

// errNotLinux: BlueZ is Linux's Bluetooth stack.
var errNotLinux = errors.New("bluez: BlueZ needs Linux")

// Options configure a Connector. The zero value means defaults.
type Options struct {
	// Adapter is the BlueZ adapter to use; "hci0" when empty.
	Adapter string
	// Logger; slog.Default() when nil.
	Logger *slog.Logger
	// StateFile is where the Linux Connector keeps the devices' addresses.
	StateFile string
}

// Connector opens GATT links through BlueZ; on this system it cannot.
type Connector struct{}

// New returns an error: BlueZ needs Linux.
func New(Options) (*Connector, error) { return nil, errNotLinux }

// Connect returns an error: BlueZ needs Linux.
func (*Connector) Connect(context.Context, string) (gatt.Link, error) { return nil, errNotLinux }

// BusLost is never closed here.
func (*Connector) BusLost() <-chan struct{} { return nil }

// Close does nothing.
func (*Connector) Close() error { return nil }
