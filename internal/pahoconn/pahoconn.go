// Package pahoconn gives paho's plain TCP connections a read buffer.
//
// Paho reads each packet straight from its connection
// (packets.ReadPacket): one read for the packet's first byte, one for each
// byte of its remaining length, one for the rest. That is three system
// calls or more per packet, however many packets wait in the socket: a
// fifth of a bridge's CPU under load went to them (docs/performance.md,
// "The ninth pass"). Through a buffer, one read takes in whatever has
// arrived. TLS connections need none: crypto/tls reads whole records and
// hands out bytes from them. Writes are left alone: paho writes each
// packet whole, and a buffer would have to know when to flush.
package pahoconn

import (
	"bufio"
	"net"
	"net/url"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"golang.org/x/net/proxy"
)

// readBuffer holds a burst of small packets (a command is a few hundred
// bytes) and one 4 KiB text push whole.
const readBuffer = 8 << 10

// Buffered has the client that o configures dial its brokers through a
// read buffer, when every broker URL is plain TCP (tcp:// or mqtt://); it
// leaves o to paho's own dialing otherwise. As paho does, it dials
// through the proxy that ALL_PROXY names, with o's Dialer. It returns o.
func Buffered(o *mqtt.ClientOptions) *mqtt.ClientOptions {
	for _, u := range o.Servers {
		if !plain(u) {
			return o
		}
	}
	return o.SetCustomOpenConnectionFn(open(func(o mqtt.ClientOptions) dialFunc {
		d := o.Dialer
		if d == nil {
			d = &net.Dialer{Timeout: o.ConnectTimeout}
		}
		return proxy.FromEnvironmentUsing(d).Dial
	}))
}

func plain(u *url.URL) bool { return u.Scheme == "tcp" || u.Scheme == "mqtt" }

type dialFunc func(network, addr string) (net.Conn, error)

// open is the OpenConnectionFunc that dials with what dialer gives for
// the client's options and wraps the connection in a read buffer.
func open(dialer func(mqtt.ClientOptions) dialFunc) mqtt.OpenConnectionFunc {
	return func(u *url.URL, o mqtt.ClientOptions) (net.Conn, error) {
		c, err := dialer(o)("tcp", u.Host)
		if err != nil {
			return nil, err
		}
		return &conn{Conn: c, r: bufio.NewReaderSize(c, readBuffer)}, nil
	}
}

// conn is a net.Conn whose reads go through r.
type conn struct {
	net.Conn
	r *bufio.Reader
}

func (c *conn) Read(p []byte) (int, error) { return c.r.Read(p) }
