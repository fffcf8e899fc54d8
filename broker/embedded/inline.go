package embedded

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	paho "github.com/eclipse/paho.mqtt.golang"
	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// NewClient returns the companion server's own connection to this broker:
// a paho Client backed by mochi's inline client instead of a TCP
// connection, so the server's messages cost no encoding, no socket and no
// acknowledgement round trip (docs/performance.md, "The fourth pass"). It
// is the broker's own process: the inline client publishes and subscribes
// past the access rules, as the server account may anyway, and no network
// client can take it over (OnConnectAuthenticate refuses a client id that
// belongs to another account, and the inline client's has no username).
//
// It keeps what the command broker relies on from paho with these
// options: OnConnect is called once Connect is; each message goes to
// DefaultPublishHandler (or the route or callback of its filter) one at a
// time, in the order the broker took them in, however many bridges
// publish at once; Ack is a no-op, since the broker and this connection
// live and die together. A publish is done when mochi has handed the
// message to every subscriber (queued it for an offline persistent
// session), which is what its PUBACK would have said. Start the Server
// before calling Connect.
func (s *Server) NewClient(o *paho.ClientOptions) paho.Client {
	c := &inlineClient{srv: s, opts: o, routes: map[string]paho.MessageHandler{}, subs: map[string]int{}}
	c.cond = sync.NewCond(&c.mu)
	return c
}

// errInlineClosed is the error of a publish or subscription after
// Disconnect.
var errInlineClosed = errors.New("embedded: inline client disconnected")

type inlineClient struct {
	srv  *Server
	opts *paho.ClientOptions

	mu        sync.Mutex
	cond      *sync.Cond // signals queue and state changes to deliver
	connected bool
	closed    bool
	routes    map[string]paho.MessageHandler // by filter, from AddRoute
	subs      map[string]int                 // filter → inline subscription id
	nextSub   int
	queue     []*inlineMessage
	delivered chan struct{}  // closed when deliver has returned
	onConnect sync.WaitGroup // the OnConnect call, joined by Disconnect
}

// IsConnected reports whether Connect was called and Disconnect was not.
func (c *inlineClient) IsConnected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.connected && !c.closed
}

// IsConnectionOpen is IsConnected: the connection never drops.
func (c *inlineClient) IsConnectionOpen() bool { return c.IsConnected() }

// Connect starts the delivery of messages and calls OnConnect on a
// goroutine of its own, as paho does.
func (c *inlineClient) Connect() paho.Token {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return doneToken(errInlineClosed)
	case c.connected:
		return doneToken(nil)
	}
	if !c.srv.isStarted() {
		return doneToken(errors.New("embedded: inline client: the broker is not started"))
	}
	c.connected = true
	c.delivered = make(chan struct{})
	go c.deliver()
	if h := c.opts.OnConnect; h != nil {
		c.onConnect.Go(func() { h(c) })
	}
	return doneToken(nil)
}

// Disconnect drops the subscriptions, lets the message being handled
// finish and drops those still queued: what a closed connection does
// to messages not acknowledged yet (with the broker going too, nobody
// would deliver them again anyway). It returns once OnConnect has too.
func (c *inlineClient) Disconnect(uint) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	subs := c.subs
	c.subs = nil
	c.queue = nil
	delivered := c.delivered
	c.cond.Broadcast()
	c.mu.Unlock()
	for filter, id := range subs {
		_ = c.srv.mochi.Unsubscribe(filter, id)
	}
	if delivered != nil {
		<-delivered
	}
	c.onConnect.Wait()
}

// Publish hands the message to mochi, which delivers it to every
// subscriber before it returns.
func (c *inlineClient) Publish(topic string, qos byte, retained bool, payload any) paho.Token {
	if !c.IsConnected() {
		return doneToken(errInlineClosed)
	}
	var b []byte
	switch p := payload.(type) {
	case []byte:
		b = p
	case string:
		b = []byte(p)
	default:
		return doneToken(errors.New("embedded: inline client: unknown payload type"))
	}
	return doneToken(c.srv.mochi.Publish(topic, b, retained, qos))
}

// Subscribe subscribes to one filter.
func (c *inlineClient) Subscribe(filter string, qos byte, callback paho.MessageHandler) paho.Token {
	return c.SubscribeMultiple(map[string]byte{filter: qos}, callback)
}

// SubscribeMultiple subscribes to every filter; the messages of each go to
// callback, or (when nil) to the filter's route or the default handler.
// Retained messages on the filters are queued before it returns.
func (c *inlineClient) SubscribeMultiple(filters map[string]byte, callback paho.MessageHandler) paho.Token {
	for filter := range filters {
		c.mu.Lock()
		if c.closed || !c.connected {
			c.mu.Unlock()
			return doneToken(errInlineClosed)
		}
		id, ok := c.subs[filter]
		if !ok {
			c.nextSub++
			id = c.nextSub
			c.subs[filter] = id
		}
		h := callback
		if h == nil {
			h = c.routes[filter]
		}
		if h == nil {
			h = c.opts.DefaultPublishHandler
		}
		c.mu.Unlock()
		// A message reads retained only as the retained message of the
		// subscription made, as MQTT has it (MQTT-3.3.1-9): mochi hands
		// those over within Subscribe, and a live one with its publisher's
		// flag. (One published meanwhile reads retained if it was.)
		var replaying atomic.Bool
		replaying.Store(true)
		err := c.srv.mochi.Subscribe(filter, id, func(_ *mqtt.Client, _ packets.Subscription, pk packets.Packet) {
			c.enqueue(&inlineMessage{topic: pk.TopicName, payload: pk.Payload, qos: pk.FixedHeader.Qos,
				retained: pk.FixedHeader.Retain && replaying.Load(), handler: h})
		})
		replaying.Store(false)
		if err != nil {
			return doneToken(err)
		}
	}
	return doneToken(nil)
}

// Unsubscribe drops the subscriptions to the filters.
func (c *inlineClient) Unsubscribe(filters ...string) paho.Token {
	for _, filter := range filters {
		c.mu.Lock()
		id, ok := c.subs[filter]
		delete(c.subs, filter)
		c.mu.Unlock()
		if ok {
			if err := c.srv.mochi.Unsubscribe(filter, id); err != nil {
				return doneToken(err)
			}
		}
	}
	return doneToken(nil)
}

// AddRoute sends the messages of a later subscription to exactly filter,
// made without a callback, to callback.
func (c *inlineClient) AddRoute(filter string, callback paho.MessageHandler) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.routes[filter] = callback
}

// OptionsReader reads the options the client was made with.
func (c *inlineClient) OptionsReader() paho.ClientOptionsReader { return paho.NewOptionsReader(c.opts) }

// enqueue is called by mochi on the goroutine of the message's publisher
// (a bridge's connection): it must not wait for the handler, which may
// itself publish. The queue has no bound of its own, like the store's
// commit queue the handler feeds: the handler never waits for the disk,
// so it drains as fast as the commits take the writes. (Over TCP, mochi
// queued up to maxWritesPending messages for the server and dropped the
// rest.)
func (c *inlineClient) enqueue(m *inlineMessage) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.queue = append(c.queue, m)
	c.cond.Signal()
}

// deliver hands the queued messages to their handlers, one at a time, in
// order, until Disconnect.
func (c *inlineClient) deliver() {
	defer close(c.delivered)
	for {
		c.mu.Lock()
		for len(c.queue) == 0 && !c.closed {
			c.cond.Wait()
		}
		if c.closed {
			c.mu.Unlock()
			return
		}
		batch := c.queue
		c.queue = nil
		c.mu.Unlock()
		for i, m := range batch {
			if m.handler != nil {
				m.handler(c, m)
			}
			batch[i] = nil
			if c.isClosed() {
				return
			}
		}
	}
}

func (c *inlineClient) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// inlineMessage is a message delivered to the inline client.
type inlineMessage struct {
	topic    string
	payload  []byte
	qos      byte
	retained bool
	handler  paho.MessageHandler
}

func (m *inlineMessage) Duplicate() bool   { return false }
func (m *inlineMessage) Qos() byte         { return m.qos }
func (m *inlineMessage) Retained() bool    { return m.retained }
func (m *inlineMessage) Topic() string     { return m.topic }
func (m *inlineMessage) MessageID() uint16 { return 0 }
func (m *inlineMessage) Payload() []byte   { return m.payload }
func (m *inlineMessage) Ack()              {}

// doneToken is a paho Token complete from the start, with err.
func doneToken(err error) paho.Token { return completeToken{err} }

var closedDone = func() chan struct{} { ch := make(chan struct{}); close(ch); return ch }()

type completeToken struct{ err error }

func (t completeToken) Wait() bool                     { return true }
func (t completeToken) WaitTimeout(time.Duration) bool { return true }
func (t completeToken) Done() <-chan struct{}          { return closedDone }
func (t completeToken) Error() error                   { return t.err }
