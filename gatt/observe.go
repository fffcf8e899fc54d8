package gatt

import "time"

// Observer is told what a Device does on its link, for the bridge's
// metrics (internal/metrics implements it with Prometheus;
// companion-bridge --metrics). It is declared here, where it is called, so
// that the Bluetooth side imports no metrics library; DeviceOptions.Observer
// nil means nobody counts. Its methods must be quick and must not block.
type Observer interface {
	// Transfer reports a chunked upload that ended: what it carried
	// ("image", "app" or "firmware"), the data bytes it sent over the link
	// (chunks repeated after a dropped link included), how long it took
	// across its reconnects, and whether it failed.
	Transfer(kind string, bytesSent int64, took time.Duration, failed bool)
	// LinkLost reports a link found down that the Device had not closed:
	// lost, dropped by the device (a reboot into new firmware among them),
	// or closed after a request timed out or a response lost a
	// notification. It is seen when the link is next needed, or at once
	// when a request was in flight.
	LinkLost()
}

// nopObserver is the Observer of a device nobody observes.
type nopObserver struct{}

func (nopObserver) Transfer(string, int64, time.Duration, bool) {}
func (nopObserver) LinkLost()                                   {}

// Connected reports whether the device has a live link now. It does not
// connect.
func (d *Device) Connected() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sess != nil && alive(d.sess)
}
