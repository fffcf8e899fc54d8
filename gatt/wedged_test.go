package gatt_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// wedgingConnector passes its links' writes on until wedge is set; then
// the SMP characteristic's writes go nowhere, as to a device whose MCUmgr
// is wedged while its Bluetooth stack takes connections and serves reads.
type wedgingConnector struct {
	gatt.Connector
	wedged   atomic.Bool
	swallow  sync.Once
	swallows chan struct{} // closed at the first write swallowed
}

type wedgingLink struct {
	gatt.Link
	c *wedgingConnector
}

func (c *wedgingConnector) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &wedgingLink{Link: l, c: c}, nil
}

func (l *wedgingLink) Write(ctx context.Context, uuid string, data []byte, withResp bool) error {
	if uuid == gatt.SMPCharUUID && l.c.wedged.Load() {
		l.c.swallow.Do(func() { close(l.c.swallows) })
		return nil
	}
	return l.Link.Write(ctx, uuid, data, withResp)
}

// A device whose MCUmgr wedges while it still takes connections: a
// command whose request was in flight when the link dropped (the status
// read's timeout drops it, or the radio) reconnects, and fails timeout
// once the device has left the first request of each new connection
// unanswered for a request timeout in all; so does the next command. The
// command's own time is far longer, and the device is told wedged well
// before it. Before, each reconnected until that time ran out, 10 minutes
// by default, holding the device's commands behind it, where docs/gatt.md
// promises a timeout at the request timeout (docs/reliability.md, bug 197).
func TestAWedgedDeviceFailsAtTheRequestTimeoutAcrossReconnects(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	wc := &wedgingConnector{Connector: n, swallows: make(chan struct{})}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: wc, RequestTimeout: 300 * time.Millisecond, MinBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Close()
		n.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.Info(ctx); err != nil {
		t.Fatalf("Info before the wedge: %v", err)
	}

	wc.wedged.Store(true)
	done := make(chan error, 1)
	go func() { done <- d.UninstallApp(ctx, "0190a000-0000-7000-8000-000000000001", "weather") }()
	select {
	case <-wc.swallows:
	case <-ctx.Done():
		t.Fatal("the command's request never went out")
	}
	n.Drop("dev-1") // as the status read's timeout drops it
	var first error
	select {
	case first = <-done:
	case <-ctx.Done():
		t.Fatal("the command did not end")
	}
	if !errors.Is(first, gatt.ErrTimeout) || ctx.Err() != nil {
		t.Errorf("the command on a wedged device = %v (its context: %v); want gatt.ErrTimeout, before its own time ran out", first, ctx.Err())
	}
	connects := n.Connects()
	if connects < 2 {
		t.Errorf("%d connections; want a reconnect", connects)
	}

	// The next command, on a device still wedged.
	err = d.PushText(ctx, "0190a000-0000-7000-8000-000000000002", "", "hi")
	if !errors.Is(err, gatt.ErrTimeout) || ctx.Err() != nil {
		t.Errorf("the next command = %v (its context: %v); want gatt.ErrTimeout, before its own time ran out", err, ctx.Err())
	}
	if s.Executions("0190a000-0000-7000-8000-000000000002") != 0 || len(s.Texts()) != 0 {
		t.Error("the wedged device ran a command")
	}

	// Unwedged, the device takes commands again.
	wc.wedged.Store(false)
	if err := d.PushText(ctx, "0190a000-0000-7000-8000-000000000003", "", "back"); err != nil {
		t.Errorf("a command once the device answers again: %v", err)
	}
}
