package pahoconn

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/mochitest"
)

// countingConn counts the reads and the writes that reach the connection.
type countingConn struct {
	net.Conn
	reads, writes *atomic.Int64
}

func (c countingConn) Read(p []byte) (int, error) {
	c.reads.Add(1)
	return c.Conn.Read(p)
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// counting is a dialer for open whose connections count their reads and
// writes.
func counting(reads, writes *atomic.Int64) func(mqtt.ClientOptions) dialFunc {
	return func(mqtt.ClientOptions) dialFunc {
		return func(network, addr string) (net.Conn, error) {
			c, err := net.Dial(network, addr)
			return countingConn{Conn: c, reads: reads, writes: writes}, err
		}
	}
}

// TestOneReadTakesManyPackets: a client that receives n small QoS 1
// messages reads its connection fewer than twice per message. Paho alone
// reads at least three times per packet (first byte, length, rest).
func TestOneReadTakesManyPackets(t *testing.T) {
	_, url := mochitest.Start(t, new(mochitest.AllowAll))
	const n = 500
	var reads, writes atomic.Int64

	var mu sync.Mutex
	var got []string
	all := make(chan struct{})
	sub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("sub").
		SetOrderMatters(true).SetCustomOpenConnectionFn(open(counting(&reads, &writes))))
	if err := mqtt.WaitTokenTimeout(sub.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer sub.Disconnect(0)
	tok := sub.Subscribe("t", 1, func(_ mqtt.Client, m mqtt.Message) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, string(m.Payload()))
		if len(got) == n {
			close(all)
		}
	})
	if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
		t.Fatalf("Subscribe = %v", err)
	}

	pub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("pub"))
	if err := mqtt.WaitTokenTimeout(pub.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer pub.Disconnect(0)
	before := reads.Load()
	toks := make([]mqtt.Token, n)
	for i := range n {
		toks[i] = pub.Publish("t", 1, false, fmt.Sprint(i))
	}
	for _, tok := range toks {
		if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
			t.Fatalf("Publish = %v", err)
		}
	}
	select {
	case <-all:
	case <-time.After(20 * time.Second):
		mu.Lock()
		t.Fatalf("%d of %d messages arrived", len(got), n)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, m := range got {
		if m != fmt.Sprint(i) {
			t.Fatalf("message %d = %q; want %d (in order)", i, m, i)
		}
	}
	r := reads.Load() - before
	t.Logf("%d reads of the connection for %d messages", r, n)
	if r >= 2*n {
		t.Errorf("%d reads of the connection for %d messages; want fewer than %d", r, n, 2*n)
	}
}

// TestBufferedOnlyForPlainTCP: Buffered dials tcp:// and mqtt:// brokers
// itself and leaves any other scheme (TLS, WebSocket) to paho.
func TestBufferedOnlyForPlainTCP(t *testing.T) {
	for _, c := range []struct {
		urls []string
		want bool
	}{
		{[]string{"tcp://127.0.0.1:1883"}, true},
		{[]string{"mqtt://a:1883", "tcp://b:1883"}, true},
		{[]string{"mqtts://127.0.0.1:8883"}, false},
		{[]string{"ssl://a:8883", "tls://b:8883"}, false},
		{[]string{"ws://127.0.0.1:9001"}, false},
		{[]string{"tcp://a:1883", "mqtts://b:8883"}, false},
	} {
		o := mqtt.NewClientOptions()
		for _, u := range c.urls {
			o.AddBroker(u)
		}
		if got := Buffered(o).CustomOpenConnectionFn != nil; got != c.want {
			t.Errorf("Buffered(%q) dials itself: %v; want %v", c.urls, got, c.want)
		}
	}
}

// TestManyPacketsInOneWrite: a client that publishes n QoS 1 messages at
// once writes its connection fewer times than it writes packets, and
// every message arrives, in order. Paho alone writes once per packet.
func TestManyPacketsInOneWrite(t *testing.T) {
	_, url := mochitest.Start(t, new(mochitest.AllowAll))
	const n = 2000
	var reads, writes atomic.Int64

	got := make(chan string, n)
	sub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("sub").SetOrderMatters(true))
	if err := mqtt.WaitTokenTimeout(sub.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer sub.Disconnect(0)
	tok := sub.Subscribe("t", 1, func(_ mqtt.Client, m mqtt.Message) { got <- string(m.Payload()) })
	if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
		t.Fatalf("Subscribe = %v", err)
	}

	pub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("pub").
		SetCustomOpenConnectionFn(open(counting(&reads, &writes))))
	if err := mqtt.WaitTokenTimeout(pub.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer pub.Disconnect(0)
	before := writes.Load()
	toks := make([]mqtt.Token, n)
	for i := range n {
		toks[i] = pub.Publish("t", 1, false, fmt.Sprint(i))
	}
	for _, tok := range toks {
		if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
			t.Fatalf("Publish = %v", err)
		}
	}
	w := writes.Load() - before
	for i := range n {
		select {
		case m := <-got:
			if m != fmt.Sprint(i) {
				t.Fatalf("message %d = %q; want %d (in order)", i, m, i)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
	t.Logf("%d writes of the connection for %d packets", w, n)
	if w >= n {
		t.Errorf("%d writes of the connection for %d packets; want fewer", w, n)
	}
}

// TestDisconnectIsWrittenBeforeClose: paho writes DISCONNECT and closes
// the connection at once; the DISCONNECT still reaches the broker, which
// therefore does not publish the client's Will.
func TestDisconnectIsWrittenBeforeClose(t *testing.T) {
	_, url := mochitest.Start(t, new(mochitest.AllowAll))
	wills := make(chan string, 10)
	sub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("sub"))
	if err := mqtt.WaitTokenTimeout(sub.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer sub.Disconnect(0)
	tok := sub.Subscribe("will/#", 1, func(_ mqtt.Client, m mqtt.Message) { wills <- m.Topic() })
	if err := mqtt.WaitTokenTimeout(tok, 10*time.Second); err != nil {
		t.Fatalf("Subscribe = %v", err)
	}

	const n = 20
	for i := range n {
		topic := fmt.Sprintf("will/%d", i)
		c := mqtt.NewClient(Buffered(mqtt.NewClientOptions().AddBroker(url).SetClientID(topic).
			SetWill(topic, "gone", 1, false)))
		if err := mqtt.WaitTokenTimeout(c.Connect(), 10*time.Second); err != nil {
			t.Fatalf("Connect = %v", err)
		}
		c.Disconnect(250)
	}
	// The control: a client whose connection just ends has its Will
	// published, so the wait below would see the others'.
	ctl := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("control").
		SetWill("will/control", "gone", 1, false).
		SetCustomOpenConnectionFn(func(u *neturl.URL, o mqtt.ClientOptions) (net.Conn, error) {
			c, err := net.Dial("tcp", u.Host)
			if err == nil {
				time.AfterFunc(200*time.Millisecond, func() { c.Close() })
			}
			return c, err
		}).SetAutoReconnect(false))
	if err := mqtt.WaitTokenTimeout(ctl.Connect(), 10*time.Second); err != nil {
		t.Fatalf("Connect = %v", err)
	}
	defer ctl.Disconnect(0)
	select {
	case topic := <-wills:
		if topic != "will/control" {
			t.Fatalf("Will of %s published: its DISCONNECT was lost", topic)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the control's Will never came")
	}
}

// TestWriteBehindHoldsBackAndFails: writes to a peer that reads nothing
// queue up to maxQueued and then wait, as they would on the socket; Close
// gives up on them after closeFlush; and once a write has failed, every
// later Write fails too.
func TestWriteBehindHoldsBackAndFails(t *testing.T) {
	c, peer := net.Pipe() // synchronous: a write waits for its reader
	defer peer.Close()
	w := newWriteBehind(c, 0)
	packet := make([]byte, 10<<10)
	wrote := make(chan int, 100)
	go func() {
		defer close(wrote)
		for i := 0; ; i++ {
			if _, err := w.write(packet); err != nil {
				return
			}
			wrote <- i
		}
	}()
	// The flusher's write (what queued before it began, up to maxQueued)
	// waits; the queue holds up to maxQueued more.
	var n int
	for done := false; !done; {
		select {
		case <-wrote:
			n++
		case <-time.After(300 * time.Millisecond):
			done = true
		}
	}
	if want := 2*maxQueued/len(packet) + 1; n > want {
		t.Fatalf("%d writes queued to a peer that reads nothing; want at most %d", n, want)
	}

	start := time.Now()
	w.close()
	if d := time.Since(start); d < closeFlush/2 || d > 5*closeFlush {
		t.Errorf("close took %v; want about %v, the flush it gives the queue", d, closeFlush)
	}
	for range wrote {
	} // the blocked writer gives up
	if _, err := w.write(packet); err == nil {
		t.Error("write after close = nil; want an error")
	}

	// A failed write fails what follows.
	c2, peer2 := net.Pipe()
	w2 := newWriteBehind(c2, 0)
	peer2.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := w2.write([]byte("x")); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("writes to a closed peer still succeed")
		}
		time.Sleep(time.Millisecond)
	}
	w2.close()
}

// TestFailedWriteFailsTheRead: a write that fails (here: timed out, the
// peer reading nothing) fails the connection's read, which paho waits in,
// and not as a closed connection, which paho takes for its own Disconnect
// and would not reconnect from (a server that never noticed its broker
// had dropped it, found by broker's TestCommandsLostWithTheConnectionRunInOrder).
func TestFailedWriteFailsTheRead(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		peer, err := ln.Accept()
		if err == nil {
			accepted <- peer // and never read
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer := <-accepted
	defer peer.Close()
	cc := &conn{Conn: c, r: bufio.NewReader(c), w: newWriteBehind(c, 100*time.Millisecond)}
	defer cc.Close()

	read := make(chan error, 1)
	go func() {
		_, err := cc.Read(make([]byte, 1))
		read <- err
	}()
	// Fill both sockets' buffers until a write times out.
	chunk := make([]byte, 64<<10)
	for i := 0; ; i++ {
		if _, err := cc.Write(chunk); err != nil {
			break
		}
		if i == 4096 {
			t.Fatal("256 MiB written to a peer that reads nothing")
		}
	}
	select {
	case err := <-read:
		if err == nil || errors.Is(err, net.ErrClosed) || strings.Contains(err.Error(), "use of closed network connection") {
			t.Fatalf("Read = %v; want an error paho reports as a lost connection", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Read still waits after the write failed")
	}
}
