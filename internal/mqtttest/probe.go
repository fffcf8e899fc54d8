package mqtttest

import (
	"testing"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

// ProbeTimeout bounds a Probe's connect (a login the broker asks its
// auth callout about, on a busy machine, included).
const ProbeTimeout = 15 * time.Second

// Probe is a real paho client for tests of what a broker lets a login do:
// MQTT 3.1.1 (so that a refused login reports its own reason rather than
// paho's retry as 3.1), a clean session unless made by DialSession, no
// reconnect, handlers run in order.
type Probe struct {
	mqtt.Client
	// Msgs has every message the probe receives, in order (up to 1,000
	// not taken; past them the client stalls).
	Msgs chan mqtt.Message
	// Lost has the error the broker closed the connection with.
	Lost chan error
}

// DialProbe connects a Probe to url as clientID with user and pass, and
// returns the connect's error (a refused login is one). The test's end
// disconnects it.
func DialProbe(tb testing.TB, url, clientID, user, pass string) (*Probe, error) {
	tb.Helper()
	return dialProbe(tb, url, clientID, user, pass, true)
}

// DialSession is DialProbe with a persistent session (clean session off):
// the broker keeps the probe's subscriptions, and queues the QoS 1 messages
// they match while it is away, for the next DialSession as clientID.
func DialSession(tb testing.TB, url, clientID, user, pass string) (*Probe, error) {
	tb.Helper()
	return dialProbe(tb, url, clientID, user, pass, false)
}

func dialProbe(tb testing.TB, url, clientID, user, pass string, clean bool) (*Probe, error) {
	tb.Helper()
	p := &Probe{Msgs: make(chan mqtt.Message, 1000), Lost: make(chan error, 1)}
	p.Client = mqtt.NewClient(mqtt.NewClientOptions().
		AddBroker(url).
		SetClientID(clientID).
		SetUsername(user).
		SetPassword(pass).
		SetCleanSession(clean).
		SetProtocolVersion(4).
		SetAutoReconnect(false).
		SetConnectTimeout(ProbeTimeout).
		SetOrderMatters(true).
		SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) { p.Msgs <- m }).
		SetConnectionLostHandler(func(_ mqtt.Client, err error) { p.Lost <- err }))
	if err := mqtt.WaitTokenTimeout(p.Connect(), ProbeTimeout); err != nil {
		return nil, err
	}
	tb.Cleanup(func() {
		if p.IsConnected() {
			p.Disconnect(50)
		}
	})
	return p, nil
}
