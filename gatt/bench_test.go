package gatt_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// BenchmarkGoodput moves 1 MiB as an image push over the simulated link at
// its default rate (BLE 2M PHY with data length extension) and reports the
// goodput as a fraction of the link's modelled capacity.
func BenchmarkGoodput(b *testing.B) {
	for _, mtu := range []int{23, 185, 247} {
		b.Run(fmt.Sprintf("mtu=%d", mtu), func(b *testing.B) {
			d, _, n := newSimDevice(b, sim.LinkOptions{MTU: mtu}, gatt.DeviceOptions{})
			data := randomBytes(b, 1<<20)
			ctx := context.Background()
			if _, err := d.Info(ctx); err != nil { // connect outside the timing
				b.Fatal(err)
			}
			b.SetBytes(int64(len(data)))
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < b.N; i++ {
				if err := d.PushImage(ctx, fmt.Sprintf("img-%d", i), "image/png", data); err != nil {
					b.Fatal(err)
				}
			}
			el := time.Since(start)
			goodput := float64(len(data)*b.N) / el.Seconds()
			b.ReportMetric(goodput/1000, "kB/s")
			b.ReportMetric(goodput/n.Capacity(), "capacity")
		})
	}
}

// BenchmarkDropCost measures the time one dropped connection adds to a
// 1 MiB firmware update at MTU 247: the same update (upload, test, reset,
// confirm) with and without a drop half way through the upload.
func BenchmarkDropCost(b *testing.B) {
	d, _, _ := newSimDevice(b, sim.LinkOptions{}, gatt.DeviceOptions{})
	dropD, _, dropN := newSimDevice(b, sim.LinkOptions{}, gatt.DeviceOptions{})
	ctx := context.Background()
	for _, dev := range []*gatt.Device{d, dropD} {
		if _, err := dev.Info(ctx); err != nil {
			b.Fatal(err)
		}
	}
	var lost time.Duration
	b.ResetTimer()
	var size int
	for i := 0; i < b.N; i++ {
		// A new version each time: the device runs the last one.
		version := fmt.Sprintf("2.%d.0", i+1)
		b.StopTimer()
		data := firmwareImage(b, version, 1<<20)
		size = len(data)
		b.StartTimer()
		start := time.Now()
		if err := d.UpdateFirmware(ctx, fmt.Sprintf("fw-%d", i), version, data, nil); err != nil {
			b.Fatal(err)
		}
		clean := time.Since(start)
		var once sync.Once
		start = time.Now()
		err := dropD.UpdateFirmware(ctx, fmt.Sprintf("fw-%d", i), version, data, func(pct int) {
			if pct >= 45 {
				once.Do(func() { dropN.Drop("dev-1") })
			}
		})
		if err != nil {
			b.Fatal(err)
		}
		lost += time.Since(start) - clean
	}
	b.ReportMetric(float64(lost.Milliseconds())/float64(b.N), "ms-lost/drop")
	st := dropD.TransferStats()
	last := st[len(st)-1]
	b.ReportMetric(float64(last.DataBytesSent-int64(size)), "bytes-resent/drop")
}

// BenchmarkOps times each operation a command costs on the device, over
// the simulated link at its defaults (MTU 247, one 7.5 ms connection
// interval each way): a text, the status read after an app or OTA
// command, the settings read after a settings command, and a one-setting
// update (write, commit, save).
func BenchmarkOps(b *testing.B) {
	d, _, _ := newSimDevice(b, sim.LinkOptions{}, gatt.DeviceOptions{})
	ctx := context.Background()
	if _, err := d.Info(ctx); err != nil { // connect outside the timing
		b.Fatal(err)
	}
	ops := []struct {
		name string
		run  func(i int) error
	}{
		{"text", func(i int) error { return d.PushText(ctx, fmt.Sprintf("t-%d", i), "", "hello") }},
		{"status", func(int) error { _, err := d.Info(ctx); return err }},
		{"settings_read", func(int) error { _, _, err := d.Settings(ctx); return err }},
		{"settings_update", func(i int) error {
			return d.UpdateSettings(ctx, fmt.Sprintf("s-%d", i), map[string]any{"brightness": i % 100})
		}},
	}
	for _, op := range ops {
		b.Run(op.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if err := op.run(i); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
