package pahoconn

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"github.com/devicecompanion/companion/internal/mochitest"
)

// countingConn counts the reads that reach the connection.
type countingConn struct {
	net.Conn
	reads *atomic.Int64
}

func (c countingConn) Read(p []byte) (int, error) {
	c.reads.Add(1)
	return c.Conn.Read(p)
}

// TestOneReadTakesManyPackets: a client that receives n small QoS 1
// messages reads its connection fewer than twice per message. Paho alone
// reads at least three times per packet (first byte, length, rest).
func TestOneReadTakesManyPackets(t *testing.T) {
	_, url := mochitest.Start(t, new(mochitest.AllowAll))
	const n = 500
	var reads atomic.Int64
	counting := func(mqtt.ClientOptions) dialFunc {
		return func(network, addr string) (net.Conn, error) {
			c, err := net.Dial(network, addr)
			return countingConn{Conn: c, reads: &reads}, err
		}
	}

	var mu sync.Mutex
	var got []string
	all := make(chan struct{})
	sub := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(url).SetClientID("sub").
		SetOrderMatters(true).SetCustomOpenConnectionFn(open(counting)))
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
