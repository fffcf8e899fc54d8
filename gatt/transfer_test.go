package gatt_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// A transfer cut in the middle resumes from the device's offset: the only
// data sent twice is what was in flight when the link dropped.
func TestResumeAfterDropCostsOneRoundTrip(t *testing.T) {
	opts := fastLink
	opts.MTU = 247
	d, s, n := newSimDevice(t, opts, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	img := firmwareImage(t, "2.0.0", 200_000)
	var once sync.Once
	err := d.UpdateFirmware(ctx, "fw-1", "2.0.0", img, func(pct int) {
		if pct >= 45 {
			once.Do(func() {
				if !n.Drop("dev-1") {
					t.Error("no link to drop")
				}
			})
		}
	})
	if err != nil {
		t.Fatalf("UpdateFirmware: %v", err)
	}
	if s.Firmware() != "2.0.0" {
		t.Errorf("firmware %q", s.Firmware())
	}
	stats := d.TransferStats()
	if len(stats) != 1 {
		t.Fatalf("stats %+v", stats)
	}
	st := stats[0]
	chunk, err := gatt.NewTransfer(gatt.Upload{Stock: true, Data: img}).ChunkSize(247-3, sim.DefaultBufSize, false)
	if err != nil {
		t.Fatal(err)
	}
	window := sim.DefaultBufCount - 1
	resent := st.DataBytesSent - int64(len(img))
	if st.Attempts != 2 {
		t.Errorf("attempts = %d; want 2 (one drop)", st.Attempts)
	}
	if resent < 0 || resent > int64(window*chunk) {
		t.Errorf("re-sent %d bytes; want at most one window (%d chunks of %d = %d)", resent, window, chunk, window*chunk)
	}
	// Requests: one that opens (or resumes) the upload per attempt, plus
	// the chunks sent.
	chunks := (st.DataBytesSent + int64(chunk) - 1) / int64(chunk)
	if int64(st.Requests) > chunks+int64(st.Attempts)+int64(window) {
		t.Errorf("requests %d for %d chunks over %d attempts", st.Requests, chunks, st.Attempts)
	}
	t.Logf("chunk %d, window %d, re-sent %d bytes, %d requests", chunk, window, resent, st.Requests)
}

// corrupter flips the last byte of one full-size write of upload data (a
// tap of tapConnector): the transfer's framing survives, its SHA-256 does
// not.
type corrupter struct {
	mu     sync.Mutex
	writes int
	done   bool
}

func (c *corrupter) tap(l gatt.Link, data []byte) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(data) == l.MTU()-3 {
		c.writes++
		// Full writes after the first few carry upload data, and data is
		// the last field of the body, so a fragment's last byte is data.
		if c.writes == 6 && !c.done {
			c.done = true
			data = append([]byte(nil), data...)
			data[len(data)-1] ^= 0xff
		}
	}
	return data, nil
}

// tapConnector makes its Connector's links pass each write through tap
// first: tap returns what the link is to write, or an error that fails the
// write in the link's place.
type tapConnector struct {
	gatt.Connector
	tap func(l gatt.Link, data []byte) ([]byte, error)
}

type tapLink struct {
	gatt.Link
	tap func(l gatt.Link, data []byte) ([]byte, error)
}

func (c *tapConnector) Connect(ctx context.Context, id string) (gatt.Link, error) {
	l, err := c.Connector.Connect(ctx, id)
	if err != nil {
		return nil, err
	}
	return &tapLink{Link: l, tap: c.tap}, nil
}

func (l *tapLink) Write(ctx context.Context, uuid string, data []byte, withResp bool) error {
	data, err := l.tap(l.Link, data)
	if err != nil {
		return err
	}
	return l.Link.Write(ctx, uuid, data, withResp)
}

func TestChecksumMismatchFails(t *testing.T) {
	s := sim.New(sim.Options{ID: "dev-1"})
	n := sim.NewNetwork(fastLink)
	n.Add("dev-1", sim.NewPeripheral(s, sim.PeripheralOptions{}))
	cc := &corrupter{}
	d, err := gatt.NewDevice(gatt.DeviceOptions{ID: "dev-1", Connector: &tapConnector{Connector: n, tap: cc.tap}})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	err = d.PushImage(ctx, "img-1", "image/png", randomBytes(t, 60_000))
	if code := errorCode(err); code != gatt.CodeChecksumMismatch {
		t.Fatalf("PushImage over a corrupting link = %v (code %q); want %s", err, code, gatt.CodeChecksumMismatch)
	}
	if len(s.Images()) != 0 || !cc.done {
		t.Errorf("images %d, corrupted %v", len(s.Images()), cc.done)
	}
	// The device dropped the bad upload: the same command sent again
	// starts afresh and succeeds.
	img := randomBytes(t, 60_000)
	if err := d.PushImage(ctx, "img-1", "image/png", img); err != nil {
		t.Fatalf("PushImage again: %v", err)
	}
	if got := s.Images(); len(got) != 1 || !bytes.Equal(got[0].Data, img) {
		t.Errorf("images after retry: %d", len(got))
	}
}

// Links dropping every few milliseconds still get a transfer through.
func TestTransferSurvivesRepeatedDrops(t *testing.T) {
	opts := sim.LinkOptions{MTU: 23, KBPS: 20_000, Latency: -1, ConnectDelay: -1, DropEvery: 40 * time.Millisecond}
	d, s, n := newSimDevice(t, opts, gatt.DeviceOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	img := randomBytes(t, 300<<10)
	if err := d.PushImage(ctx, "img-1", "image/jpeg", img); err != nil {
		t.Fatalf("PushImage: %v", err)
	}
	if got := s.Images(); len(got) != 1 || !bytes.Equal(got[0].Data, img) {
		t.Fatalf("images %d", len(got))
	}
	st := d.TransferStats()[0]
	if n.Drops() < 2 || st.Attempts < 2 {
		t.Errorf("drops %d, attempts %d: the test did not drop the link", n.Drops(), st.Attempts)
	}
	t.Logf("drops %d, attempts %d, sent %d of %d bytes", n.Drops(), st.Attempts, st.DataBytesSent, len(img))
}
