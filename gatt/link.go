// Package gatt is the bridge's Bluetooth side: the GATT link to a device
// (CONTRACT §5, docs/gatt.md), the SMP client that frames management
// messages over it, and the chunked transfer engine that moves images, app
// packages and firmware to a device and resumes after a dropped connection.
//
// Two implementations of Link exist: a simulated link (sim devices, tests,
// benchmarks) and BlueZ over D-Bus for real adapters on Linux gateways.
package gatt

import (
	"context"
	"errors"
)

// UUIDs of the profile. ServiceUUID and SMPCharUUID are Zephyr's SMP
// service and characteristic (subsys/mgmt/mcumgr/transport/smp_bt.c), the
// ones a device with CONFIG_MCUMGR_TRANSPORT_BT serves; the others are
// Bluetooth SIG assigned numbers.
const (
	ServiceUUID = "8d53dc1d-1db7-4cd3-868b-8a527460aa84" // Zephyr's SMP service
	SMPCharUUID = "da2e7828-fbce-4e01-ae9e-261174997c48" // SMP: write without response, notify

	BatteryServiceUUID = "0000180f-0000-1000-8000-00805f9b34fb"
	BatteryLevelUUID   = "00002a19-0000-1000-8000-00805f9b34fb" // read, notify; one byte 0–100
	DeviceInfoUUID     = "0000180a-0000-1000-8000-00805f9b34fb"
	ModelNumberUUID    = "00002a24-0000-1000-8000-00805f9b34fb" // read; UTF-8
	SerialNumberUUID   = "00002a25-0000-1000-8000-00805f9b34fb" // read; UTF-8, the device_id
	FirmwareRevUUID    = "00002a26-0000-1000-8000-00805f9b34fb" // read; UTF-8 semantic version
)

// DefaultMTU is the ATT MTU before any exchange (Bluetooth Core, Vol 3 Part F).
const DefaultMTU = 23

// ErrDisconnected is returned by a Link's methods once the link is down.
var ErrDisconnected = errors.New("gatt: disconnected")

// ErrNotPaired is wrapped by the error of a Link's method that the device
// refused for want of pairing: it requires an encrypted or authenticated
// link, which the gateway has no bond for (docs/gatt.md, "Link
// security"). Asking again, over this link or a new one, cannot help
// until someone pairs the gateway with the device.
var ErrNotPaired = errors.New("gatt: the device requires pairing")

// Link is one connection to a device's GATT server, as the bridge needs it.
// Methods are safe for concurrent use.
type Link interface {
	// MTU is the negotiated ATT MTU; a write carries at most MTU-3 bytes.
	MTU() int
	// Read reads a characteristic's value.
	Read(ctx context.Context, charUUID string) ([]byte, error)
	// Write writes one value (at most MTU-3 bytes) to a characteristic,
	// waiting for the device's response when withResponse is true.
	Write(ctx context.Context, charUUID string, data []byte, withResponse bool) error
	// Subscribe enables notifications of a characteristic and calls fn, in
	// order, for each value; fn must not block.
	Subscribe(ctx context.Context, charUUID string, fn func([]byte)) error
	// Done is closed when the link is lost or closed.
	Done() <-chan struct{}
	// Close disconnects.
	Close() error
}

// Connector opens links to devices by device id.
type Connector interface {
	// Connect finds the device and connects, within ctx's deadline.
	Connect(ctx context.Context, deviceID string) (Link, error)
}

// Characteristic properties, as GATT names them.
const (
	PropRead                 = "read"
	PropWrite                = "write"
	PropWriteWithoutResponse = "write-without-response"
	PropNotify               = "notify"
)

// Characteristic describes one characteristic a Peripheral serves.
type Characteristic struct {
	UUID       string
	Properties []string
}

// Service describes one primary service a Peripheral serves.
type Service struct {
	UUID            string
	Characteristics []Characteristic
}

// Peripheral is the device side of the profile: a GATT server. The
// simulator implements it; the simulated link and the fake BlueZ of the
// tests put it on the other end of a Link.
type Peripheral interface {
	// Services lists the primary services and their characteristics.
	Services() []Service
	// ReadChar answers a read of a characteristic.
	ReadChar(charUUID string) ([]byte, error)
	// WriteChar takes one ATT write (at most MTU-3 bytes) to a
	// characteristic; it returns quickly and answers, if at all, by
	// notification.
	WriteChar(charUUID string, data []byte) error
	// Connected tells the peripheral a central connected with this ATT MTU;
	// notify sends a notification to it, and drop ends the connection from
	// the device's side (as a reboot does). A peripheral that takes no
	// connection now (it is rebooting) returns an error, and the link
	// fails. Disconnected ends a connection, whoever ended it.
	Connected(mtu int, notify func(charUUID string, value []byte), drop func()) error
	Disconnected()
}
