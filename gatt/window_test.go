package gatt_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/sim"
)

// The status reads of the bridge's reporter and a command's upload go to
// one device at once. A stock device has BufCount SMP buffers for both
// (four by default) and loses a write that finds none free, so together
// the callers keep no more requests in flight than one caller may: a lost
// write would cost its request the whole request timeout.
func TestConcurrentCallersShareTheWindow(t *testing.T) {
	// Two buffers (the fewest MCUmgr runs with) leave a window of one.
	for _, bufs := range []int{2, 4} {
		t.Run(fmt.Sprint("bufs", bufs), func(t *testing.T) {
			// A device that takes its time over each request, as one
			// writing flash does: requests queue in its buffers.
			d, s, _, p := newSimPeripheral(t, fastLink,
				sim.PeripheralOptions{BufCount: bufs, HandleTime: 2 * time.Millisecond},
				gatt.DeviceOptions{RequestTimeout: 5 * time.Second})
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			errs := make(chan error, 100)
			wg.Go(func() {
				for i := range 3 {
					if err := d.PushImage(ctx, fmt.Sprint("img", i), "image/png", randomBytes(t, 20_000)); err != nil {
						errs <- fmt.Errorf("PushImage %d: %w", i, err)
					}
				}
			})
			wg.Go(func() {
				for i := range 10 {
					if _, err := d.Info(ctx); err != nil {
						errs <- fmt.Errorf("Info %d: %w", i, err)
					}
					if _, _, err := d.Settings(ctx); err != nil {
						errs <- fmt.Errorf("Settings %d: %w", i, err)
					}
				}
			})
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if got := p.Dropped(); got != 0 {
				t.Errorf("the device lost %d writes for want of a buffer", got)
			}
			if got := len(s.Images()); got != 3 {
				t.Errorf("%d images shown, want 3", got)
			}
		})
	}
}

// A request the caller stops waiting for still holds a buffer on the
// device until the device answers it, so it keeps its place in the window:
// the next request waits rather than reach a device with no buffer free.
func TestAbandonedRequestKeepsItsPlace(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, p := newSimClient(t, ctx, sim.PeripheralOptions{BufCount: 2, HandleTime: 20 * time.Millisecond})
	c.SetWindow(1) // two buffers: one request and its answer

	for i := range 3 {
		call, err := c.Start(ctx, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: fmt.Sprint("abandoned ", i)})
		if err != nil {
			t.Fatal(err)
		}
		// Let the device start on it: from then on it holds both of its
		// buffers, the request's and the answer's. (Were the next request
		// to arrive first, it would be taken anyway, and the test would
		// prove less, never fail for it.)
		time.Sleep(5 * time.Millisecond)
		call.Abandon()
		if got, err := c.Echo(ctx, fmt.Sprint("next ", i)); err != nil || got != fmt.Sprint("next ", i) {
			t.Fatalf("echo after an abandoned request = %q, %v", got, err)
		}
	}
	if got := p.Dropped(); got != 0 {
		t.Errorf("the device lost %d writes for want of a buffer", got)
	}
}

// Another transport of the device's MCUmgr (UART, a second central) holds
// one of its buffers, which its parameters do not tell: a request whose
// answer then finds no buffer is answered rc 2 (MGMT_ERR_ENOMEM), not run,
// as Zephyr's smp.c does. The bridge takes that as the busy answer it is,
// and asks again after a pause: the text is shown once the buffer is free.
// (Two buffers, a window of one: the request and its answer.)
func TestNoBufferForTheAnswerIsAskedAgain(t *testing.T) {
	d, s, _, p := newSimPeripheral(t, fastLink, sim.PeripheralOptions{BufCount: 2},
		gatt.DeviceOptions{RequestTimeout: 5 * time.Second, MinBackoff: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.Info(ctx); err != nil { // connected, its window learnt
		t.Fatal(err)
	}
	release := p.HoldBuffers(1)
	time.AfterFunc(300*time.Millisecond, release)
	start := time.Now()
	if err := d.PushText(ctx, "t1", "", "hello"); err != nil {
		t.Fatalf("PushText while a buffer was held elsewhere: %v", err)
	}
	if p.NoMemory() == 0 {
		t.Error("no request was answered MGMT_ERR_ENOMEM: the test shows nothing")
	}
	if got := s.Texts(); len(got) != 1 || s.Executions("t1") != 1 {
		t.Errorf("%d texts shown, executed %d times", len(got), s.Executions("t1"))
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("took %v: waited out a request timeout rather than asking again", d)
	}
}

// Narrow takes a place off the window for the rest of the link, down to
// one, whether the place is free or taken.
func TestNarrowShrinksTheWindow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, _ := newSimClient(t, ctx, sim.PeripheralOptions{HandleTime: 50 * time.Millisecond})
	c.SetWindow(3)
	first, err := c.Start(ctx, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "1"})
	if err != nil {
		t.Fatal(err)
	}
	c.Narrow() // a free place
	c.Narrow() // the one first holds: kept when it is given back
	c.Narrow() // no further than one
	short, stop := context.WithTimeout(ctx, 20*time.Millisecond)
	_, err = c.Start(short, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "2"})
	stop()
	if err == nil {
		t.Fatal("a second request went out beside the first in a window of one")
	}
	if err := first.Wait(ctx, nil); err != nil {
		t.Fatal(err)
	}
	second, err := c.Start(ctx, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "2"})
	if err != nil {
		t.Fatalf("the window's last place after the first answer: %v", err)
	}
	short, stop = context.WithTimeout(ctx, 20*time.Millisecond)
	_, err = c.Start(short, gatt.OpWrite, gatt.GroupOS, gatt.CmdOSEcho, gatt.EchoRequest{D: "3"})
	stop()
	if err == nil {
		t.Fatal("the place the first gave back was not kept: two requests in flight")
	}
	if err := second.Wait(ctx, nil); err != nil {
		t.Fatal(err)
	}
}

// newSimClient is a gatt.Client on a link to a simulated peripheral of
// popts, closed with the test.
func newSimClient(t *testing.T, ctx context.Context, popts sim.PeripheralOptions) (*gatt.Client, *sim.Peripheral) {
	t.Helper()
	n := sim.NewNetwork(sim.LinkOptions{KBPS: 200_000, Latency: -1, ConnectDelay: -1})
	p := sim.NewPeripheral(sim.New(sim.Options{ID: "dev-1"}), popts)
	n.Add("dev-1", p)
	t.Cleanup(func() { n.Close() })
	link, err := n.Connect(ctx, "dev-1")
	if err != nil {
		t.Fatal(err)
	}
	c, err := gatt.NewClient(ctx, link, gatt.ClientOptions{RequestTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, p
}

// A device may report more SMP buffers than the header's sequence numbers
// tell apart (256). The window stays within them: an upload of more than
// 256 chunks to a device reporting 1,000 buffers, or with a Window of
// 1,000 set, goes through. Before, the 257th request was refused ("256
// requests in flight") and the upload failed (bug 145).
func TestManyBuffersKeepToTheSequenceNumbers(t *testing.T) {
	for _, tt := range []struct {
		name   string
		popts  sim.PeripheralOptions
		window int
	}{
		{"buf_count 1000", sim.PeripheralOptions{BufCount: 1000, BufSize: 300}, 0},
		{"window 1000", sim.PeripheralOptions{BufCount: 1000, BufSize: 300}, 1000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			opts := fastLink
			opts.MTU = 247
			d, s, _, _ := newSimPeripheral(t, opts, tt.popts, gatt.DeviceOptions{Window: tt.window})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			img := randomBytes(t, 200_000) // about 700 chunks
			if err := d.PushImage(ctx, "img-1", "image/png", img); err != nil {
				t.Fatalf("PushImage: %v", err)
			}
			if len(s.Images()) != 1 {
				t.Errorf("%d images shown", len(s.Images()))
			}
		})
	}
}

// stalledLink stays up and takes every write, and nothing comes back over
// it: a device whose SMP stopped answering while its link stays, a stall
// without a disconnect.
type stalledLink struct {
	once sync.Once
	done chan struct{}
}

func (l *stalledLink) MTU() int                                              { return 247 }
func (l *stalledLink) Read(context.Context, string) ([]byte, error)          { return nil, nil }
func (l *stalledLink) Write(context.Context, string, []byte, bool) error     { return nil }
func (l *stalledLink) Subscribe(context.Context, string, func([]byte)) error { return nil }
func (l *stalledLink) Done() <-chan struct{}                                 { return l.done }
func (l *stalledLink) Close() error                                          { l.once.Do(func() { close(l.done) }); return nil }

// On a link that stalls, a request nobody waits for yet (an upload's next
// chunks, a status read's second request) still ends at its request
// timeout and gives back its place in the window: a caller waiting in
// Start for that place gets it, and its own request times out in turn.
// Before, only a caller's Wait saw the timeout, and the caller waiting in
// Start waited until its own context ended, a command's ten minutes
// (docs/reliability.md, bug 181). The context here is far longer than the
// request timeout, to tell the two apart.
func TestUnansweredRequestsGiveTheirPlaceBackAtTheirTimeout(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := gatt.NewClient(ctx, &stalledLink{done: make(chan struct{})}, gatt.ClientOptions{RequestTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetWindow(1)
	first, err := c.Start(ctx, gatt.OpRead, gatt.GroupImage, gatt.CmdImageState, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Nobody waits for the first yet: its caller is starting the next.
	next, err := c.Start(ctx, gatt.OpRead, gatt.GroupApps, gatt.CmdAppsList, nil)
	if err != nil {
		t.Fatalf("Start while the request holding the window went unanswered = %v; want a place once its timeout passed", err)
	}
	for i, call := range []*gatt.Call{first, next} {
		if err := call.Wait(ctx, nil); !errors.Is(err, gatt.ErrTimeout) {
			t.Errorf("Wait of request %d = %v; want gatt.ErrTimeout", i+1, err)
		}
	}
}
