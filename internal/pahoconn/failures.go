package pahoconn

import (
	"errors"
	"log/slog"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/eclipse/paho.mqtt.golang/packets"
)

// failureRepeat is how often the same connect failure is logged again
// while it lasts.
const failureRepeat = time.Minute

// ReportFailures has the client that o configures log its failed attempts
// to connect. Paho retries them on its own (ConnectRetry, AutoReconnect)
// and says nothing: a wrong password, or a broker that is not there, showed
// only a client that never connected. The first failure is a warning with
// paho's reason (the broker's refusal, or the dial's error); the same reason
// again is logged once a minute at most, with the attempts since, and a
// connection ends the run. With several brokers (a cluster's nodes, which
// the client fails over between), each connection made is logged with
// the node it is to: the client's own log names only the list. When the
// broker refuses the login (CONNACK 4, bad user name or password, or 5,
// not authorized), which retrying does not mend, the warning carries
// refused as its hint: what the operator is to do. It returns o.
func ReportFailures(o *mqtt.ClientOptions, log *slog.Logger, refused string) *mqtt.ClientOptions {
	var (
		r       failureLog
		tried   atomic.Pointer[url.URL] // the broker of the attempt under way
		several = len(o.Servers) > 1
	)
	return o.SetConnectionNotificationHandler(func(_ mqtt.Client, n mqtt.ConnectionNotification) {
		switch n := n.(type) {
		case mqtt.ConnectionNotificationBroker:
			tried.Store(n.Broker)
		case mqtt.ConnectionNotificationConnected:
			r.connected()
			if u := tried.Load(); several && u != nil {
				log.Info("MQTT connected to a broker of the list", "broker", u.Redacted())
			}
		case mqtt.ConnectionNotificationFailed:
			hint := ""
			if errors.Is(n.Reason, packets.ErrorRefusedBadUsernameOrPassword) || errors.Is(n.Reason, packets.ErrorRefusedNotAuthorised) {
				hint = refused
			}
			r.failed(log, n.Reason, hint, time.Now())
		}
	})
}

// failureLog is the run of failed attempts since the last connection.
type failureLog struct {
	mu       sync.Mutex
	reason   string    // of the last failure logged; "" when connected
	loggedAt time.Time // when it was logged
	attempts int       // failures since
}

func (r *failureLog) connected() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reason, r.attempts = "", 0
}

func (r *failureLog) failed(log *slog.Logger, err error, hint string, now time.Time) {
	reason := "unknown"
	if err != nil {
		reason = err.Error()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts++
	if reason == r.reason && now.Sub(r.loggedAt) < failureRepeat {
		return
	}
	if hint != "" {
		log.Warn("MQTT connect failed; retrying", "err", reason, "attempts", r.attempts, "hint", hint)
	} else {
		log.Warn("MQTT connect failed; retrying", "err", reason, "attempts", r.attempts)
	}
	r.reason, r.loggedAt, r.attempts = reason, now, 0
}
