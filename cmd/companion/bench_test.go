package main

import (
	"fmt"

	"sync"
	"testing"

	"github.com/devicecompanion/companion/api"
)

// BenchmarkAcceptPushText measures POST …/push/text answered 202 (the
// command validated and fsync'd as queued) by 8 concurrent clients, while a
// bridge drains the queues.
func BenchmarkAcceptPushText(b *testing.B) {
	_, f, devs := benchFleet(b)
	b.SetParallelism(4) // 4×GOMAXPROCS clients
	var next sync.Mutex
	i := 0
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		next.Lock()
		d := devs[i%len(devs)]
		i++
		next.Unlock()
		for pb.Next() {
			r := f.user.do("POST", "/api/v1/devices/"+d+"/push/text", map[string]any{"text": "bench"})
			if r.Status != 202 {
				b.Errorf("push: %d %s", r.Status, r.Body)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "accepted/s")
}

func benchFleet(b *testing.B) (*Main, *fleet, []string) {
	b.Helper()
	m := startServer(b, Config{Limits: api.Limits{RequestsPerSecond: -1}})
	devs := make([]string, 8)
	for i := range devs {
		devs[i] = fmt.Sprintf("dev-%d", i)
	}
	f := setupFleet(b, m, devs...)
	startBridge(b, m, m.MQTTURL(), f, "", devs...)
	for _, d := range devs {
		r := f.user.do("POST", "/api/v1/devices/register", map[string]string{"device_id": d, "claim_code": f.claims[d]})
		if r.Status != 201 {
			b.Fatalf("register: %d %s", r.Status, r.Body)
		}
	}
	return m, f, devs
}

// BenchmarkEndToEnd measures commands per second from the HTTP request to
// succeeded on a simulated device, over the embedded broker and a real
// bridge, with 8 clients pushing to 8 devices.
func BenchmarkEndToEnd(b *testing.B) {
	_, f, devs := benchFleet(b)
	b.ResetTimer()
	var wg sync.WaitGroup
	per := (b.N + len(devs) - 1) / len(devs)
	for _, d := range devs {
		wg.Add(1)
		go func(d string) {
			defer wg.Done()
			for i := 0; i < per; i++ {
				r := f.user.do("POST", "/api/v1/devices/"+d+"/push/text", map[string]any{"text": "bench"}, "Prefer", "wait=60")
				if r.Status != 200 {
					b.Errorf("push: %d %s", r.Status, r.Body)
					return
				}
			}
		}(d)
	}
	wg.Wait()
	b.ReportMetric(float64(per*len(devs))/b.Elapsed().Seconds(), "commands/s")
}
